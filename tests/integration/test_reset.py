"""playbooks/reset.yml on the lab (as ops with become, real systemd): a deployed fleet, a --check reset that changes
nothing and lists what would go, a reset with the staged revision and the runtime that leaves no trace of the
deployment on any node - except what another deployment installed on node2 still uses -, and a second reset that
changes nothing. site.yml bringing the deployment back is test_site.py's first test, which runs next in the suite
(the lab tests run in file order) from the fleet this test leaves: one site.yml run fewer in `make test`."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

from tests.integration.conftest import LAB_NODES, run_ansible, ssh

REV = "5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed"  # inventory/lab/group_vars/all.yml
MODEL_DIR = "/mnt/nvme/models/demo-model"
NODES = [f"node{i}" for i in range(1, LAB_NODES + 1)]
UNITS = ["llmfleet-demo.service", "llmfleet-demo-router.service"]
# Where the engine, base and llmfleet roles put anything of a deployment or of the runtime.
WHERE = "/var/log /etc/systemd /run/systemd/system /etc/llmfleet /var/lib/llmfleet /var/lib/node_exporter /mnt/nvme /opt /usr/local/bin"
# Another deployment's files on node2, as the engine role writes them (a claim, its key, a unit naming the revision).
OTHER = {
    "/etc/llmfleet/gpus/other.json": '{"deployment": "other", "gpus": [], "ports": {}}',
    "/etc/llmfleet/credentials/other.api-key": "other-key",
    "/etc/systemd/system/llmfleet-other.service": f"[Service]\nExecStart=/bin/sleep infinity {MODEL_DIR}/{REV}\n",
}


def ask():
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "What is 37\u00d719? Reply with only the number."}],
            "temperature": 0}  # fmt: skip
    req = urllib.request.Request("http://10.77.0.11:30000/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 (http to the lab head)
        return json.loads(r.read())["choices"][0]["message"]["content"]


def recap_changed(stdout: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\S+)\s+: ok=\d+\s+changed=(\d+)", stdout, re.M)}


def traces(lab, node: str) -> list[str]:
    """Every path under the roles' places that names the deployment, or holds the runtime; the units systemd knows."""
    found = ssh(lab, node, f"find {WHERE} \\( -name '*demo*' -o -path '/opt/llmfleet' -o -path '/usr/local/bin/llmfleet' "
                           f"-o -path /etc/llmfleet/runtime.env -o -path /var/log/llmfleet \\) -print 2>/dev/null; "
                           "grep -rl 'deployment=\"demo\"' /var/lib/node_exporter 2>/dev/null; true").stdout.split()  # fmt: skip
    for u in UNITS:
        state = ssh(lab, node, f"systemctl show {u} --property=LoadState --value").stdout.strip()
        if state != "not-found":
            found.append(f"{u}: LoadState={state}")
    return sorted(set(found))


def reset(tmp_path, *extra, check=True):
    t0 = time.monotonic()
    cp = run_ansible("ansible-playbook", "playbooks/reset.yml", "-e", f"llmfleet_report_dir={tmp_path}", *extra,
                     check=check)  # fmt: skip
    return cp, time.monotonic() - t0


@pytest.fixture
def other_deployment(lab):
    """node2's stand-in for another deployment (files only), gone again whatever the test's outcome: left behind,
    its claim would stop every later deployment of the lab on node2."""
    yield OTHER
    ssh(lab, "node2", "rm -f " + " ".join(OTHER) + " && systemctl daemon-reload", check=False)


def test_reset_removes_every_trace_and_a_second_reset_changes_nothing(lab, tmp_path, other_deployment):
    # The premise: demo is the only deployment installed (an earlier lab test that leaves its own installed would keep
    # the runtime in use on its nodes, and the assertions below would blame the reset).
    for n in NODES:
        units = ssh(lab, n, "ls /etc/systemd/system | grep '^llmfleet-.*\\.service$' || true").stdout.split()
        others = [u for u in units if u not in UNITS]
        assert not others, f"{n}: installed by an earlier lab test and not removed in its teardown: {others}"
    seconds = {}
    t0 = time.monotonic()
    run_ansible("ansible-playbook", "playbooks/site.yml", "-e", f"llmfleet_report_dir={tmp_path}")
    seconds["site.yml (deploy)"] = time.monotonic() - t0
    assert (tmp_path / "file_sd" / "demo-engine.json").exists() and (tmp_path / "endpoint-demo.json").exists()
    for n in NODES:
        assert traces(lab, n), n  # the check below can see what a deployment leaves
    for path, text in other_deployment.items():
        ssh(lab, "node2", f"echo '{text}' | tee {path} >/dev/null && chmod 0600 {path}")

    # --check on the deployed fleet: lists what would go, changes nothing
    cp, seconds["reset.yml --check"] = reset(tmp_path, "--check", "-e", "engine_reset_revisions=true",
                                             "-e", "base_state=absent")  # fmt: skip
    out = " ".join(cp.stdout.split())
    for n in NODES:
        assert f"{n}: demo would remove /etc/systemd/system/llmfleet-demo.service" in out, out[-6000:]
        assert ssh(lab, n, "systemctl is-active llmfleet-demo.service", check=False).stdout.strip() == "active", n
    assert (
        f"{MODEL_DIR}/{REV}" in out and "kept" in out and "named by /etc/systemd/system/llmfleet-other.service" in out
    )
    assert ask() == "703"

    # the reset, with the revision and the runtime
    cp, seconds["reset.yml"] = reset(tmp_path, "-e", "engine_reset_revisions=true", "-e", "base_state=absent")
    out = " ".join(cp.stdout.split())
    assert "node2: runtime kept: still used by other" in out, out[-6000:]
    for n in NODES:
        left = traces(lab, n)
        if n == "node2":  # the other deployment's revision and the runtime it runs on stay, and its files
            assert left == sorted([MODEL_DIR, "/opt/llmfleet", "/usr/local/bin/llmfleet", "/etc/llmfleet/runtime.env",
                                   "/var/log/llmfleet"]), left  # fmt: skip
            ssh(lab, n, f"test -f {MODEL_DIR}/{REV}/config.json && test -d /var/lib/llmfleet")
            for path in OTHER:
                ssh(lab, n, f"test -f {path}")
        else:
            assert left == [], (n, left)
        assert ssh(lab, n, "id llmfleet", check=False).returncode == 0  # the service account stays
    assert not (tmp_path / "file_sd" / "demo-engine.json").exists() and not (tmp_path / "endpoint-demo.json").exists()
    assert (tmp_path / "engine-demo.json").exists()  # reports stay unless engine_reset_reports

    # nothing left to do: a second reset changes nothing
    cp, seconds["reset.yml again"] = reset(tmp_path, "-e", "engine_reset_revisions=true", "-e", "base_state=absent")
    changed = recap_changed(cp.stdout)
    assert sorted(changed) == sorted([*NODES, "localhost"]) and set(changed.values()) == {0}, cp.stdout[-4000:]
    print("seconds:", {k: round(v, 1) for k, v in seconds.items()})
