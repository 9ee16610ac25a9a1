"""playbooks/site.yml end to end on the lab."""

import json

from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import LAB_NODES, run_ansible, ssh

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


def test_site_installs_runtime_and_reports(lab, tmp_path):
    run_ansible("ansible-playbook", "playbooks/site.yml", "-e", f"llmfleet_report_dir={tmp_path}")
    report = json.loads((tmp_path / "fleet-summary.json").read_text())
    assert sorted(report["nodes"]) == [f"node{i}" for i in range(1, LAB_NODES + 1)]
    assert len({n["machine_id"] for n in report["nodes"].values()}) == LAB_NODES
    assert any("with no llmfleet_api_key" in w for w in report["warnings"])
    # the demo model was staged on every node, reading shared storage once for the fleet
    stage = json.loads((tmp_path / "stage-demo-model.json").read_text())["nodes"]
    assert sorted(stage) == sorted(report["nodes"])
    total = stage["node1"]["total_bytes"]
    assert sum(r["source_bytes_read"] for r in stage.values()) == total
    assert all(r["bytes_copied"] == total for r in stage.values())
    # the runtime the base role installed works on a node, as the service account
    out = ssh(lab, "node2", "setpriv --reuid=llmfleet --regid=llmfleet --init-groups llmfleet node-info --json").stdout
    assert json.loads(out)["hostname"] == "node2"
    # and the staged revision verifies with it
    rev = stage["node2"]["revision"]
    assert ssh(lab, "node2", f"llmfleet checkpoint verify /mnt/nvme/models/demo-model/{rev}").returncode == 0
    # site.yml ends with acceptance: the endpoint the engine role published passed the hard gates
    endpoint = json.loads((tmp_path / "endpoint-demo.json").read_text())
    assert endpoint["url"] == "http://10.77.0.11:30000" and endpoint["model"] == "demo-model", endpoint
    accepted = json.loads((tmp_path / "acceptance-demo.json").read_text())
    assert accepted["accepted"], accepted["summary"]
    assert [c["verdict"] for c in accepted["checks"] if c["kind"] == "gate"] == ["pass"] * 3
    assert "ACCEPTED" in (tmp_path / "acceptance-demo.md").read_text()
    check_the_deployment_report(tmp_path)
    check_the_metrics(lab)
    # the report role's Prometheus file_sd targets: the published endpoint, and node_exporter on every node
    sd = tmp_path / "file_sd"
    assert [g["targets"] for g in json.loads((sd / "demo-engine.json").read_text())] == [["10.77.0.11:30000"]]
    node_sd = json.loads((sd / "demo-node.json").read_text())
    assert [g["labels"]["node"] for g in node_sd] == [f"node{i}" for i in range(1, LAB_NODES + 1)], node_sd
    # Now it serves: preflight (which binds and probes its ports) refuses, naming the way out.
    cp = run_ansible(
        "ansible-playbook", "playbooks/preflight.yml", "-e", f"llmfleet_report_dir={tmp_path}", check=False
    )
    assert cp.returncode != 0
    nodes = ", ".join(f"node{i}" for i in range(1, LAB_NODES + 1))
    assert f"demo is serving on {nodes} (llmfleet-demo.service is running)" in cp.stdout, cp.stdout[-3000:]
    assert "llmfleet_stop_before_checks=true" in cp.stdout
    # Asked to, site.yml stops the deployment in order first, and preflight runs.
    (tmp_path / "preflight.json").unlink()
    cp = run_ansible("ansible-playbook", "playbooks/site.yml", "--tags", "preflight", "-e", "llmfleet_stop_before_checks=true",
                     "-e", f"llmfleet_report_dir={tmp_path}")  # fmt: skip
    assert "Ordered stop, head first" in cp.stdout
    assert ssh(lab, "node1", "systemctl is-active llmfleet-demo.service", check=False).stdout.strip() == "inactive"
    assert json.loads((tmp_path / "preflight.json").read_text())["status"] != "fail"


def test_site_refuses_a_contradictory_inventory(lab, tmp_path):
    inv = tmp_path / "hosts.yml"
    inv.write_text(
        "all:\n  children:\n    llmfleet_nodes:\n      children:\n"
        "        head: {hosts: {node1: {ansible_host: 10.77.0.11, llmfleet_fabric_ip: 10.77.0.11}}}\n"
        "        worker: {hosts: {node2: {ansible_host: 10.77.0.12, llmfleet_fabric_ip: 10.77.0.11}}}\n"
    )
    cp = run_ansible("ansible-playbook", "-i", str(inv), "playbooks/site.yml", check=False)
    assert cp.returncode != 0
    assert "10.77.0.11 on node1 and node2" in " ".join(cp.stdout.split())
    assert "Install the llmfleet node runtime" not in cp.stdout  # failed before touching nodes
