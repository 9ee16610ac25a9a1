"""site.yml from the installed collection on the lab, as a site runs it: the collection built from this checkout and
installed into an empty collections path, `ansible-playbook llmfleet.fleet.site -i inventory/lab` from a directory
outside the checkout whose ansible.cfg is the site's own (the collections path, the run callback enabled, pipelining;
none of llmfleet's settings), no ANSIBLE_* of the suite, connecting as the operator `ops` with become (the lab
inventory's group_vars). The ops host's Python finds no llmfleet package of its own: a decoy on PYTHONPATH fails any
`python -m llmfleet` that does not take the collection's package.

Then the way out, from the same installed collection (`llmfleet.fleet.reset`) on the deployment that run left: a
--check reset that changes nothing and lists what would go, a reset with the staged revision and the runtime that
leaves no trace of the deployment on any node - except what another deployment installed on node2 still uses -, a
second reset that changes nothing, and site.yml bringing the deployment back to serving; on it, preflight refuses
to disturb the serving deployment and site.yml stops it in order when asked.

The first run is also the suite's end-to-end check of site.yml on a fresh fleet (what it installs, stages, starts,
accepts and reports), and of what its preflight and NCCL check find on the clean lab: one bring-up serves them all
(test_site.py keeps the refusal of a contradictory inventory; test_preflight.py and test_nccl_check.py their faults)."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import collection
from tests.integration.conftest import LAB_NODES, ROOT, ssh

NODES = [f"node{i}" for i in range(1, LAB_NODES + 1)]
REV = "5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed"  # inventory/lab/group_vars/all.yml
MODEL_DIR = "/mnt/nvme/models/demo-model"
UNITS = ["llmfleet-demo.service", "llmfleet-demo-router.service"]
# Where the engine, base and llmfleet roles put anything of a deployment or of the runtime.
WHERE = "/var/log /etc/systemd /run/systemd/system /etc/llmfleet /var/lib/llmfleet /var/lib/node_exporter /mnt/nvme /opt /usr/local/bin"
# Another deployment's files on node2, as the engine role writes them (a claim, its key, a unit naming the revision).
OTHER = {
    "/etc/llmfleet/gpus/other.json": '{"deployment": "other", "gpus": [], "ports": {}}',
    "/etc/llmfleet/credentials/other.api-key": "other-key",
    "/etc/systemd/system/llmfleet-other.service": f"[Service]\nExecStart=/bin/sleep infinity {MODEL_DIR}/{REV}\n",
}


@pytest.fixture(scope="module")
def site(lab, tmp_path_factory):
    base = tmp_path_factory.mktemp("site")
    _, installed = collection.build_and_install(base)
    work = base / "site"
    work.mkdir()
    (work / "ansible.cfg").write_text(
        f"""[defaults]
collections_path = {installed.parents[2]}
callbacks_enabled = llmfleet.fleet.llmfleet_run
forks = 64
[ssh_connection]
pipelining = True
control_path_dir = {work}/cp
""",
        encoding="utf-8",
    )
    decoy = base / "decoy" / "llmfleet"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text(
        "raise ImportError(\"the ops host's own llmfleet was imported, not the collection's package\")\n"
    )
    env = collection.site_env(installed.parents[2])
    env.pop("ANSIBLE_COLLECTIONS_PATH")  # the site's ansible.cfg names it
    env.update(ANSIBLE_CONFIG=str(work / "ansible.cfg"), PYTHONPATH=str(base / "decoy"), ANSIBLE_NOCOLOR="1")
    yield installed, work, env
    # Leave the lab as the other modules expect it: nothing serving, no unit failed, the NVMe empty. The last test
    # stops the deployment itself: the ordered stop runs again only where a unit of it still runs.
    running = "systemctl list-units 'llmfleet-*' --state=active,activating,deactivating,reloading --plain --no-legend"
    if any(ssh(lab, n, running).stdout.strip() for n in NODES):
        playbook(work, env, "llmfleet.fleet.engine_stop", "-e", f"llmfleet_report_dir={work}/reports")
    for i, n in enumerate(NODES, 1):
        ssh(lab, n, "systemctl reset-failed 'llmfleet-*' || true", check=False)
        lab.wipe_nvme(lab.node(i))


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
    # A staging textfile is the model's (llmfleet_stage_<model>.prom, labelled with the deployment that staged it
    # last): other models' (the staging lab tests stage several as demo) describe revisions a reset of demo keeps.
    found = [p for p in found if not re.search(r"/llmfleet_stage_(?!demo-model\.prom$)[^/]*\.prom$", p)]
    # The claimed ports' reservation (docs/engine.md, "Reserved ports"): the lab's nodes reserve nothing else.
    reserved = ssh(lab, node, "echo reserved: $(cat /proc/sys/net/ipv4/ip_local_reserved_ports); "
                              "ls /etc/sysctl.d 2>/dev/null | grep llmfleet; true").stdout.splitlines()  # fmt: skip
    found += [line.strip() for line in reserved if line.strip() not in ("", "reserved:")]
    for u in UNITS:
        state = ssh(lab, node, f"systemctl show {u} --property=LoadState --value").stdout.strip()
        if state != "not-found":
            found.append(f"{u}: LoadState={state}")
    return sorted(set(found))


@pytest.fixture
def other_deployment(lab):
    """node2's stand-in for another deployment (files only), gone again whatever the test's outcome: left behind,
    its claim would stop every later deployment of the lab on node2."""
    yield OTHER
    ssh(lab, "node2", "rm -f " + " ".join(OTHER) + " && systemctl daemon-reload", check=False)


def playbook(work, env, *args, check=True):
    cp = subprocess.run([str(collection.BIN / "ansible-playbook"), "-i", str(ROOT / "inventory/lab"), *args],
                        cwd=work, env=env, capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    if check and cp.returncode != 0:
        raise AssertionError(
            f"ansible-playbook {' '.join(args)}: exit {cp.returncode}\n{cp.stdout[-6000:]}\n{cp.stderr[-3000:]}"
        )
    return cp


STEPS_RUN = ["preflight", "topology", "staging", "nccl check", "engine/cold start", "acceptance"]


def check_the_deployment_report(report_dir):
    """site.yml ends with the deployment report of this run: every step it ran is in it, with its numbers."""
    latest = report_dir / "demo" / "latest"
    model = json.loads((latest / "report.json").read_text())
    steps = {s["name"]: s["status"] for s in model["steps"]}
    # The lab has no GPUs (preflight warns) and no bench in site.yml; every other step passed.
    assert [n for n in STEPS_RUN if steps[n] not in ("pass", "warn")] == [], steps
    assert steps["bench"] == "not-run" and model["status"] == "pass", model["verdict"]
    md = (latest / "report.md").read_text()
    assert (
        sum(line.startswith(f"| node{i} |") for i in range(1, LAB_NODES + 1) for line in md.splitlines()) >= LAB_NODES
    )
    # the lab's engine serves on every address without a key: the report says so, not only the play output
    assert "node1 serves the sglang API of demo" in md, md[:3000]
    html = (latest / "report.html").read_text()
    assert 'id="timeline"' in html and "<svg" in html and "http://" not in html.split("<body", 1)[0]


def check_the_metrics(lab):
    """The roles left node_exporter textfiles on the head that Prometheus' own parser reads."""
    out = ssh(
        lab,
        "node1",
        'cd /var/lib/node_exporter/textfile_collector && for f in *.prom; do echo "# FILE $f"; cat $f; done',
    )
    files = [line.split()[-1] for line in out.stdout.splitlines() if line.startswith("# FILE ")]
    assert {"llmfleet_stage_demo-model.prom", "llmfleet_nccl_check.prom", "llmfleet_engine_ready_demo.prom",
            "llmfleet_acceptance_demo.prom"} <= set(files), files  # fmt: skip
    names = {s.name for fam in text_string_to_metric_families(out.stdout) for s in fam.samples}
    assert {"llmfleet_stage_ok", "llmfleet_engine_gate_ok", "llmfleet_engine_ready_timestamp_seconds",
            "llmfleet_stage_timestamp_seconds", "llmfleet_collective_timestamp_seconds"} <= names, sorted(names)  # fmt: skip


def check_the_collectives(lab, stdout):
    """site.yml's NCCL check on the fresh fleet: real Gloo worlds across the nodes (2 ranks per node), every value
    exact, each rank where the layout puts it; it ended without polling (test_nccl_check.py: its faults)."""
    play = stdout.split("PLAY [Check collectives across the fleet", 1)[1].split("\nPLAY [", 1)[0]
    assert "FAILED - RETRYING" not in play, play[-3000:]
    v = json.loads(ssh(lab, "node1", "cat /var/lib/llmfleet/checks/nccl-check-latest.json").stdout)
    assert v["ok"] and len(v["ranks"]) == 2 * LAB_NODES and sum(r["wrong"] for r in v["ranks"]) == 0
    assert sorted(r["rank"] for r in v["ranks"]) == list(range(2 * LAB_NODES))
    assert {r["rank"]: r["host"] for r in v["ranks"]}[2] == "node2"  # rank = node index x 2 + local


def check_what_site_installed_staged_and_reported(lab, reports):
    """site.yml on a fresh fleet (nothing staged): what it installed, staged, accepted and reported."""
    # the clean lab passes preflight, with the warnings of a lab without GPUs (test_preflight.py: its faults)
    preflight = json.loads((reports / "preflight.json").read_text())
    assert preflight["status"] == "warn" and preflight["failed_nodes"] == [], preflight
    report = json.loads((reports / "fleet-summary.json").read_text())
    assert sorted(report["nodes"]) == NODES
    assert len({n["machine_id"] for n in report["nodes"].values()}) == LAB_NODES
    assert any("with no llmfleet_api_key" in w for w in report["warnings"])
    # the demo model was staged on every node, reading shared storage once for the fleet
    stage = json.loads((reports / "stage-demo-model.json").read_text())["nodes"]
    assert sorted(stage) == sorted(report["nodes"])
    total = stage["node1"]["total_bytes"]
    assert sum(r["source_bytes_read"] for r in stage.values()) == total
    assert all(r["bytes_copied"] == total for r in stage.values())
    # the runtime the base role installed works on a node, as the service account
    out = ssh(lab, "node2", "setpriv --reuid=llmfleet --regid=llmfleet --init-groups llmfleet node-info --json").stdout
    assert json.loads(out)["hostname"] == "node2"
    # and the staged revision verifies with it
    rev = stage["node2"]["revision"]
    assert ssh(lab, "node2", f"llmfleet checkpoint verify {MODEL_DIR}/{rev}").returncode == 0
    # site.yml ends with acceptance: the endpoint the engine role published passed the hard gates
    endpoint = json.loads((reports / "endpoint-demo.json").read_text())
    assert endpoint["url"] == "http://10.77.0.11:30000" and endpoint["model"] == "demo-model", endpoint
    accepted = json.loads((reports / "acceptance-demo.json").read_text())
    assert accepted["accepted"], accepted["summary"]
    assert [c["verdict"] for c in accepted["checks"] if c["kind"] == "gate"] == ["pass"] * 3
    assert "ACCEPTED" in (reports / "acceptance-demo.md").read_text()
    check_the_deployment_report(reports)
    check_the_metrics(lab)
    # the report role's Prometheus file_sd targets: the published endpoint, and node_exporter on every node
    sd = reports / "file_sd"
    assert [g["targets"] for g in json.loads((sd / "demo-engine.json").read_text())] == [["10.77.0.11:30000"]]
    node_sd = json.loads((sd / "demo-node.json").read_text())
    assert [g["labels"]["node"] for g in node_sd] == NODES, node_sd


def test_site_from_the_installed_collection_as_ops(lab, site):
    installed, work, env = site
    reports = work / "reports"
    t0 = time.time()
    # The lab may serve from an earlier module: the ordered stop first, as an operator re-running site.yml would ask.
    cp = playbook(work, env, "llmfleet.fleet.site", "-e", f"llmfleet_report_dir={reports}",
                  "-e", "llmfleet_stop_before_checks=true")  # fmt: skip
    t1 = time.time()
    print(f"site.yml from the installed collection: {t1 - t0:.0f} s")
    # Every step passed, with the report the report role rendered with the collection's package.
    model = json.loads((reports / "demo" / "latest" / "report.json").read_text())
    assert model["status"] == "pass", model["verdict"]
    assert json.loads((reports / "acceptance-demo.json").read_text())["accepted"]
    check_what_site_installed_staged_and_reported(lab, reports)
    check_the_collectives(lab, cp.stdout)
    # The collection's run callback (enabled by the site's ansible.cfg) kept how the run ended.
    run = json.loads((reports / "run-demo.json").read_text())
    assert run["outcome"] == "completed" and run["stopped"] is None, run
    # The node runtime the base role installed is the installed collection's package, on every node.
    want = hashlib.sha256((installed / "plugins/module_utils/llmfleet/__init__.py").read_bytes()).hexdigest()
    for n in NODES:
        got = ssh(lab, n, "sha256sum /opt/llmfleet/lib/llmfleet/__init__.py").stdout.split()[0]
        assert got == want, n
    # Serving, under root's systemd (become).
    assert ssh(lab, "node1", "systemctl is-active llmfleet-demo.service", check=False).stdout.strip() == "active"
    # Its API, rendezvous and link ports are the head's reserved ports (no outgoing connection of the node takes one).
    head = traces(lab, "node1")
    assert "reserved: 30000,50080,50082" in head and "60-llmfleet-reserved-ports.conf" in head, head
    # Ansible logged in as the operator on every node (its own SSH masters: the site's control_path_dir) and became
    # root with sudo. (The lab's own root logins, the test's and any lab status check, can fall in the same window.)
    for n in NODES:
        log = ssh(lab, n, f"journalctl -q --no-pager --since=@{int(t0)} --until=@{int(t1) + 1}").stdout
        users = set(re.findall(r"Accepted publickey for (\S+) from", log))
        assert "ops" in users, (n, users)
        assert re.search(r"sudo\[\d+\]: +ops : .*USER=root", log), (n, log[-3000:])


def reset(work, env, reports, *extra):
    t0 = time.monotonic()
    cp = playbook(work, env, "llmfleet.fleet.reset", "-e", f"llmfleet_report_dir={reports}", *extra)
    return cp, time.monotonic() - t0


def test_reset_from_the_collection_removes_every_trace_and_a_second_reset_changes_nothing(lab, site, other_deployment):
    _, work, env = site
    reports = work / "reports"
    # The premise: demo is the only deployment installed (an earlier lab test that leaves its own installed would keep
    # the runtime in use on its nodes, and the assertions below would blame the reset).
    for n in NODES:
        units = ssh(lab, n, "ls /etc/systemd/system | grep '^llmfleet-.*\\.service$' || true").stdout.split()
        others = [u for u in units if u not in UNITS]
        assert not others, f"{n}: installed by an earlier lab test and not removed in its teardown: {others}"
    seconds = {}
    # The deployment the test above left serving (deployed here when this test runs alone).
    if ssh(lab, "node1", "systemctl is-active llmfleet-demo.service", check=False).stdout.strip() != "active":
        playbook(work, env, "llmfleet.fleet.site", "-e", f"llmfleet_report_dir={reports}",
                 "-e", "llmfleet_stop_before_checks=true")  # fmt: skip
    assert (reports / "file_sd" / "demo-engine.json").exists() and (reports / "endpoint-demo.json").exists()
    for n in NODES:
        assert traces(lab, n), n  # the check below can see what a deployment leaves
    for path, text in other_deployment.items():
        ssh(lab, "node2", f"echo '{text}' | tee {path} >/dev/null && chmod 0600 {path}")

    # --check on the deployed fleet: lists what would go, changes nothing
    cp, seconds["reset --check"] = reset(work, env, reports, "--check", "-e", "engine_reset_revisions=true",
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
    cp, seconds["reset"] = reset(work, env, reports, "-e", "engine_reset_revisions=true", "-e", "base_state=absent")
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
    assert not (reports / "file_sd" / "demo-engine.json").exists() and not (reports / "endpoint-demo.json").exists()
    assert (reports / "engine-demo.json").exists()  # reports stay unless engine_reset_reports

    # nothing left to do: a second reset changes nothing
    cp, seconds["reset again"] = reset(work, env, reports, "-e", "engine_reset_revisions=true",
                                       "-e", "base_state=absent")  # fmt: skip
    changed = recap_changed(cp.stdout)
    assert sorted(changed) == sorted([*NODES, "localhost"]) and set(changed.values()) == {0}, cp.stdout[-4000:]
    print("seconds:", {k: round(v, 1) for k, v in seconds.items()})


def test_site_from_the_collection_brings_a_reset_fleet_back(lab, site):
    """After the reset above (node2's other deployment gone in its teardown): site.yml installs the runtime, stages
    the revision and serves again; every node holds the deployment's files again."""
    _, work, env = site
    reports = work / "reports"
    t0 = time.monotonic()
    playbook(work, env, "llmfleet.fleet.site", "-e", f"llmfleet_report_dir={reports}",
             "-e", "llmfleet_stop_before_checks=true")  # fmt: skip
    print(f"site.yml after the reset: {time.monotonic() - t0:.0f} s")
    assert ask() == "703"
    for n in NODES:
        assert ssh(lab, n, "systemctl is-active llmfleet-demo.service").stdout.strip() == "active", n
        assert "/opt/llmfleet" in traces(lab, n), n  # the runtime, and the revision, back on every node
        ssh(lab, n, f"test -f {MODEL_DIR}/{REV}/config.json")
    assert (reports / "endpoint-demo.json").exists() and (reports / "file_sd" / "demo-engine.json").exists()


def test_preflight_refuses_the_serving_fleet_and_site_stops_it_in_order_when_asked(lab, site):
    """On the deployment the run above brought back: preflight (which binds and probes its ports) refuses, naming
    the way out; asked to, site.yml stops the deployment in order first, and preflight runs."""
    _, work, env = site
    reports = work / "reports"
    if ssh(lab, "node1", "systemctl is-active llmfleet-demo.service", check=False).stdout.strip() != "active":
        playbook(work, env, "llmfleet.fleet.site", "-e", f"llmfleet_report_dir={reports}",
                 "-e", "llmfleet_stop_before_checks=true")  # fmt: skip
    cp = playbook(work, env, "llmfleet.fleet.preflight", "-e", f"llmfleet_report_dir={reports}", check=False)
    assert cp.returncode != 0
    out = " ".join(cp.stdout.split())
    assert f"demo is serving on {', '.join(NODES)} (llmfleet-demo.service is running)" in out, cp.stdout[-3000:]
    assert "llmfleet_stop_before_checks=true" in out
    (reports / "preflight.json").unlink(missing_ok=True)
    # An inventory or command line that says engine_state=started (the default, spelled out) does not turn the stop
    # into a start: extra vars beat every include var, so the stop is asked for by an internal name.
    cp = playbook(work, env, "llmfleet.fleet.site", "--tags", "preflight", "-e", "llmfleet_stop_before_checks=true",
                  "-e", "engine_state=started", "-e", f"llmfleet_report_dir={reports}")  # fmt: skip
    assert "Ordered stop, head first" in cp.stdout
    assert ssh(lab, "node1", "systemctl is-active llmfleet-demo.service", check=False).stdout.strip() == "inactive"
    assert json.loads((reports / "preflight.json").read_text())["status"] != "fail"
