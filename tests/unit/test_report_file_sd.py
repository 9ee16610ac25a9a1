"""The report role's Prometheus file_sd targets (roles/report/tasks/0030-file-sd.yml with the role's defaults),
run by ansible-playbook on localhost for an inventory of three nodes (connection local): the files' content, no
change on a rerun, a clear error for a bad exporter entry, and promtool's own service discovery reading them
(the same file_sd code Prometheus runs)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.promtool import promtool_path

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "roles" / "report" / "tasks" / "0030-file-sd.yml"
DEFAULTS = ROOT / "roles" / "report" / "defaults" / "main.yml"

PLAY = f"""
- name: The report role's file_sd targets
  hosts: all
  gather_facts: false
  vars_files: [{DEFAULTS}]
  tasks:
    - name: As the role imports them
      ansible.builtin.import_tasks: {TASKS}
"""
INVENTORY = """
all:
  hosts:
    node1: {ansible_host: 10.77.0.11}
    node2: {ansible_host: "fd00::12"}
    node3: {}
"""
# What the engine role publishes beside the reports (reports/endpoint-<deployment>.json), as a later run reads it.
ENDPOINT = {"deployment": "demo", "engine": "vllm", "head": "node1", "model": "det-model", "profile": "vllm",
            "node_url": "http://127.0.0.1:8000", "url": "http://10.77.0.11:8000"}  # fmt: skip


def play(tmp_path: Path, **extra) -> tuple[int, str]:
    (tmp_path / "play.yml").write_text(PLAY)
    (tmp_path / "inventory.yml").write_text(INVENTORY)
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": f"{bindir}:{os.environ['PATH']}",
           "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp")}  # fmt: skip
    extra_vars = {"llmfleet_deployment": "demo", "llmfleet_report_dir": str(tmp_path / "reports"),
                  "ansible_python_interpreter": sys.executable, **extra}  # fmt: skip
    cp = subprocess.run(
        [f"{bindir}/ansible-playbook", "-i", str(tmp_path / "inventory.yml"), "-c", "local", str(tmp_path / "play.yml"),
         "-e", json.dumps(extra_vars)],
        capture_output=True, text=True, check=False, timeout=180, cwd=ROOT, env=env,
    )  # fmt: skip
    out = cp.stdout + cp.stderr
    assert "Traceback" not in out, out[-3000:]
    return cp.returncode, " ".join(out.split())


def recap_changed(out: str) -> set[int]:
    return {int(n) for n in re.findall(r"changed=(\d+)", out)}


def test_targets_files_for_the_engine_and_each_exporter_and_no_change_on_a_rerun(tmp_path):
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "endpoint-demo.json").write_text(json.dumps(ENDPOINT))
    rc, out = play(tmp_path)
    assert rc == 0, out[-3000:]
    sd = tmp_path / "reports" / "file_sd"
    assert sorted(p.name for p in sd.iterdir()) == ["demo-dcgm.json", "demo-engine.json", "demo-node.json"]
    assert json.loads((sd / "demo-engine.json").read_text()) == [
        {"targets": ["10.77.0.11:8000"],
         "labels": {"deployment": "demo", "node": "node1", "profile": "vllm", "model": "det-model"}}
    ]  # fmt: skip
    # One group per node: its inventory name as `node`, an IPv6 address in brackets, no ansible_host: the name.
    assert json.loads((sd / "demo-node.json").read_text()) == [
        {"targets": ["10.77.0.11:9100"], "labels": {"deployment": "demo", "node": "node1"}},
        {"targets": ["[fd00::12]:9100"], "labels": {"deployment": "demo", "node": "node2"}},
        {"targets": ["node3:9100"], "labels": {"deployment": "demo", "node": "node3"}},
    ]
    assert [g["targets"] for g in json.loads((sd / "demo-dcgm.json").read_text())] == [
        ["10.77.0.11:9400"], ["[fd00::12]:9400"], ["node3:9400"]]  # fmt: skip
    assert {oct(p.stat().st_mode & 0o777) for p in sd.iterdir()} == {"0o644"}
    assert max(recap_changed(out)) > 0
    rc, out = play(tmp_path)
    assert rc == 0 and recap_changed(out) == {0}, out[-2000:]


def test_this_runs_endpoint_wins_no_endpoint_no_engine_target_and_an_empty_dir_writes_nothing(tmp_path):
    published = {**ENDPOINT, "url": "http://10.77.0.99:30000", "profile": "sglang", "head": "node2"}
    rc, out = play(tmp_path, engine_endpoint=published, report_file_sd_exporters={"node": 9100})
    assert rc == 0, out[-3000:]
    sd = tmp_path / "reports" / "file_sd"
    assert sorted(p.name for p in sd.iterdir()) == ["demo-engine.json", "demo-node.json"]
    (group,) = json.loads((sd / "demo-engine.json").read_text())
    assert group["targets"] == ["10.77.0.99:30000"] and group["labels"]["profile"] == "sglang"
    assert group["labels"]["node"] == "node2"
    rc, out = play(tmp_path, llmfleet_deployment="nothing-yet")
    assert rc == 0, out[-3000:]
    assert json.loads((sd / "nothing-yet-engine.json").read_text()) == []  # no endpoint published yet
    off = tmp_path / "off"
    off.mkdir()
    rc, out = play(off, report_file_sd_dir="")
    assert rc == 0 and not (off / "reports").exists(), out[-2000:]


def test_a_deployment_of_replicas_is_scraped_at_each_replica(tmp_path):
    """The router's port serves no /metrics: each replica's own API is a target, labelled with the replica."""
    (tmp_path / "reports").mkdir()
    router = {**ENDPOINT, "url": "http://10.77.0.11:30000", "router": "vllm-router", "replicas": ["demo-r0", "demo-r1"],
              "replica_endpoints": [{"deployment": "demo-r0", "url": "http://10.77.0.11:8000", "head": "node1"},
                                    {"deployment": "demo-r1", "url": "http://10.77.0.13:8000", "head": "node3"}]}  # fmt: skip
    (tmp_path / "reports" / "endpoint-demo.json").write_text(json.dumps(router))
    rc, out = play(tmp_path, llmfleet_replicas=[{"name": "r0"}, {"name": "r1"}], engine_endpoint={"url": "http://x:1"},
                   report_file_sd_exporters={})  # fmt: skip
    assert rc == 0, out[-3000:]
    groups = json.loads((tmp_path / "reports" / "file_sd" / "demo-engine.json").read_text())
    assert [(g["targets"], g["labels"]["replica"], g["labels"]["node"]) for g in groups] == [
        (["10.77.0.11:8000"], "demo-r0", "node1"), (["10.77.0.13:8000"], "demo-r1", "node3")]  # fmt: skip
    assert groups[0]["labels"]["deployment"] == "demo" and groups[0]["labels"]["profile"] == "vllm"


@pytest.mark.parametrize("exporters", [{"node": "http"}, {"node": 0}, {"node": 70000}, {"bad/name": 9100}], ids=str)
def test_a_bad_exporter_entry_fails_naming_the_variable_and_writes_nothing(tmp_path, exporters):
    rc, out = play(tmp_path, report_file_sd_exporters=exporters)
    assert rc != 0
    assert "report_file_sd_exporters:" in out and "with a TCP port (1-65535)" in out, out[-2000:]
    assert not (tmp_path / "reports" / "file_sd").exists()


PROMETHEUS_YML = """
scrape_configs:
  - job_name: llmfleet-node
    honor_labels: true
    file_sd_configs: [{files: ["SD/*-node.json"]}]
  - job_name: llmfleet-engine
    file_sd_configs: [{files: ["SD/*-engine.json"]}]
"""


def test_prometheus_service_discovery_reads_the_files(tmp_path, promtool):
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "endpoint-demo.json").write_text(json.dumps(ENDPOINT))
    rc, out = play(tmp_path)
    assert rc == 0, out[-3000:]
    config = tmp_path / "prometheus.yml"
    config.write_text(PROMETHEUS_YML.replace("SD", str(tmp_path / "reports" / "file_sd")))
    found = {}
    for job in ("llmfleet-node", "llmfleet-engine"):
        cp = subprocess.run([promtool, "check", "service-discovery", "--timeout=10s", str(config), job],
                            capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        assert cp.returncode == 0, cp.stdout + cp.stderr
        found[job] = json.loads(cp.stdout)
    nodes = {t["labels"]["node"]: t["labels"] for t in found["llmfleet-node"]}
    assert sorted(nodes) == ["node1", "node2", "node3"]
    assert nodes["node2"]["instance"] == "[fd00::12]:9100" and nodes["node2"]["deployment"] == "demo"
    (engine,) = found["llmfleet-engine"]
    assert engine["labels"]["instance"] == "10.77.0.11:8000" and engine["labels"]["profile"] == "vllm"


@pytest.fixture
def promtool():
    return promtool_path()
