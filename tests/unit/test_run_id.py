"""The run id, end to end through real ansible-playbook on this host (connection local): playbooks/run_start.yml
makes it once and writes run-<deployment>.json, the llmfleet_record action adds it to every record of the run, the
run callback (playbooks/callback_plugins/llmfleet_run.py) adds where the run stopped, and the report reads that run
only. The playbook beside run_start.yml is a stand-in for site.yml: a role that writes its record, then one that
fails (as the engine's flag check does, before any record of its own)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmfleet.report import build as report

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = """\
- name: Start the run
  ansible.builtin.import_playbook: run_start.yml
  vars:
    llmfleet_run_playbook: site.yml
    llmfleet_run_steps: [preflight, timeline, acceptance]

- name: A step that writes its record
  hosts: llmfleet_nodes
  gather_facts: false
  roles: [preflight]

- name: A step that fails
  hosts: llmfleet_nodes
  gather_facts: false
  roles: [engine]
"""
PREFLIGHT = """\
- name: Write preflight.json
  llmfleet.fleet.llmfleet_record:
    dir: "{{ llmfleet_report_dir }}"
    name: preflight.json
    content: {status: pass, failed_nodes: [], rows: []}
  delegate_to: localhost
  run_once: true
"""
# A playbook that tests what a run deployed (acceptance.yml, bench.yml): it carries that run's id.
CONTINUE = """\
- name: Carry the deployed run's id
  ansible.builtin.import_playbook: run_start.yml
  vars:
    llmfleet_run_playbook: acceptance.yml
    llmfleet_run_steps: [acceptance]
    llmfleet_run_continue: true

- name: A step of the deployed run
  hosts: llmfleet_nodes
  gather_facts: false
  roles: [preflight]
"""
ENGINE = """\
- name: Validate the engine flags
  ansible.builtin.fail:
    msg: "unrecognized arguments: --enable-metricz (did you mean --enable-metrics?)"
  when: fail_engine | bool
  no_log: "{{ hide | default(false) | bool }}"

- name: Wait for the readiness gate
  ansible.builtin.fail:
    msg: "{{ 'engine not ready: first failed node ' ~ item ~ ' (node rank 1)' if item == 'node2' else 'fine' }}"
  loop: [node1, node2]
  when: fail_loop | default(false) | bool and item == 'node2'
"""
# The fleet contract: a dependency of every role (roles/llmfleet), here of the engine's.
CONTRACT = """\
- name: Refuse to disturb a serving deployment
  ansible.builtin.fail:
    msg: demo is serving
  when: fail_contract | default(false) | bool
"""


def play(tmp_path: Path, fail: bool, playbook: str = "site.yml", *extra: str) -> subprocess.CompletedProcess:
    pb = tmp_path / "playbooks"
    if not pb.exists():
        pb.mkdir()
        shutil.copy(ROOT / "playbooks/run_start.yml", pb)
        shutil.copy(ROOT / "playbooks/inventory_check.yml", pb)
        shutil.copytree(ROOT / "playbooks/callback_plugins", pb / "callback_plugins",
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
        (pb / "site.yml").write_text(PLAYBOOK)
        (pb / "acceptance.yml").write_text(CONTINUE)
        for role, text in (("preflight", PREFLIGHT), ("engine", ENGINE), ("llmfleet", CONTRACT)):
            (tmp_path / "roles" / role / "tasks").mkdir(parents=True)
            (tmp_path / "roles" / role / "tasks/main.yml").write_text(text)
        (tmp_path / "roles/engine/meta").mkdir()
        (tmp_path / "roles/engine/meta/main.yml").write_text("dependencies: [llmfleet]\n")
        (tmp_path / "hosts.ini").write_text("[llmfleet_nodes]\nnode1 ansible_connection=local\n")
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_ROLES_PATH": str(tmp_path / "roles"),
           "ANSIBLE_PYTHON_INTERPRETER": sys.executable, "ANSIBLE_HOME": str(tmp_path / ".ansible"),
           "ANSIBLE_NOCOLOR": "1"}  # fmt: skip
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp_path / "hosts.ini"), str(pb / playbook),
            "-e", f"llmfleet_report_dir={tmp_path / 'reports'}", "-e", "llmfleet_deployment=demo",
            "-e", f"fail_engine={fail}", *extra]  # fmt: skip
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.skipif(shutil.which("ansible-playbook", path=str(Path(sys.executable).parent)) is None,
                    reason="needs ansible-playbook in the venv")  # fmt: skip
def test_every_record_carries_the_run_id_and_the_run_record_says_where_it_stopped(tmp_path):
    ok = play(tmp_path, fail=False)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-2000:]
    d = tmp_path / "reports"
    first = json.loads((d / "run-demo.json").read_text())
    assert first["outcome"] == "completed" and first["stopped"] is None and first["playbook"] == "site.yml"
    assert json.loads((d / "preflight.json").read_text())["run_id"] == first["run_id"]
    # a playbook that tests the deployed run writes its records under that run's id, and starts no run
    (d / "endpoint-demo.json").write_text(json.dumps({"url": "http://node1:8000", "run_id": first["run_id"]}))
    cont = play(tmp_path, fail=False, playbook="acceptance.yml")
    assert cont.returncode == 0, cont.stdout[-3000:] + cont.stderr[-2000:]
    assert json.loads((d / "run-demo.json").read_text()) == first
    assert json.loads((d / "preflight.json").read_text())["run_id"] == first["run_id"]
    (d / "endpoint-demo.json").unlink()

    bad = play(tmp_path, fail=True)
    assert bad.returncode != 0
    run = json.loads((d / "run-demo.json").read_text())
    assert run["run_id"] != first["run_id"] and run["run_id"] > first["run_id"][:16]
    assert json.loads((d / "preflight.json").read_text())["run_id"] == run["run_id"]  # once per run, every record
    assert run["outcome"] == "failed"
    assert run["stopped"]["node"] == "node1" and run["stopped"]["role"] == "engine"
    assert "--enable-metricz" in run["stopped"]["message"]
    assert run["stopped"]["task"].endswith("Validate the engine flags")

    m = report.collect(d, "demo")
    assert m["status"] == "fail" and m["verdict"].startswith("FAIL at engine on node1: unrecognized arguments")
    by = {s["id"]: s for s in m["steps"]}
    assert by["preflight"]["status"] == "pass"
    assert by["acceptance"]["reason"] == "it stopped at engine on node1"

    # a task of the fleet contract names the step that pulled it in
    contract = play(tmp_path, False, "site.yml", "-e", "fail_contract=true")
    assert contract.returncode != 0
    stop = json.loads((d / "run-demo.json").read_text())["stopped"]
    assert stop["role"] == "llmfleet" and stop["within"] == "engine", stop
    assert report.collect(d, "demo")["verdict"].startswith("FAIL at engine (the fleet contract's checks) on node1: ")


@pytest.mark.skipif(shutil.which("ansible-playbook", path=str(Path(sys.executable).parent)) is None,
                    reason="needs ansible-playbook in the venv")  # fmt: skip
def test_a_no_log_tasks_failure_message_stays_out_of_the_run_record(tmp_path):
    """A no_log task's message never reaches the run record, which says why it has none."""
    bad = play(tmp_path, True, "site.yml", "-e", "hide=true")
    assert bad.returncode != 0
    stop = json.loads((tmp_path / "reports" / "run-demo.json").read_text())["stopped"]
    assert stop["role"] == "engine" and "--enable-metricz" not in stop["message"], stop
    assert "hidden" in stop["message"]


@pytest.mark.skipif(shutil.which("ansible-playbook", path=str(Path(sys.executable).parent)) is None,
                    reason="needs ansible-playbook in the venv")  # fmt: skip
def test_a_failed_loop_is_recorded_with_its_failed_items_message(tmp_path):
    """Ansible says only "One or more items failed" of a failed loop (the readiness gate is one): the record says
    what the failed item said."""
    bad = play(tmp_path, False, "site.yml", "-e", "fail_loop=true")
    assert bad.returncode != 0
    stop = json.loads((tmp_path / "reports" / "run-demo.json").read_text())["stopped"]
    assert stop["message"] == "engine not ready: first failed node node2 (node rank 1)", stop


def test_failed_message_shapes():
    from llmfleet.failures import failed_message

    assert (
        failed_message(
            {
                "msg": "One or more items failed",
                "results": [{"failed": False, "msg": "ok"}, {"failed": True, "stderr": "a\nboom"}],
            }
        )
        == "boom"
    )
    assert failed_message({"failed": True, "rc": 3}) == "exit 3"
    assert failed_message({"msg": "x" * 700}).endswith("...") and len(failed_message({"msg": "x" * 700})) == 600
    assert "hidden" in failed_message({"_ansible_no_log": True, "msg": "secret"})
    assert failed_message(None) == "failed"
