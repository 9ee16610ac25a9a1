"""The bench role's last check: when cases did not run or failed, its message is one line per case (id, status,
why), then where the report is - not one line of every case's message joined (six NOT_EXECUTED cases read as the
same message six times in one line). Rendered with Ansible's own templar from roles/bench/tasks/main.yml."""

import json
from pathlib import Path

import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

ROOT = Path(__file__).resolve().parents[2]


def the_assert() -> dict:
    block = yaml.safe_load((ROOT / "roles/bench/tasks/main.yml").read_text())[0]["block"]
    return next(t for t in block if t["name"] == "Every case ran and succeeded")


def test_one_line_per_case_that_did_not_run_or_failed():
    task = the_assert()
    why = "the tool could not be started: [Errno 2] No such file or directory: 'python'"
    cases = [{"id": f"in32-out16-c{c}", "status": "NOT_EXECUTED", "why": why} for c in (1, 4)]
    cases += [{"id": "in256-out16-c1", "status": "OK", "why": ""},
              {"id": "in256-out16-c4", "status": "FAILED", "why": "success rate 0.50 < 1.0"}]  # fmt: skip
    variables = {"_bench_run": {"stdout": json.dumps({"cases": cases})}, "_bench_local": "/r/bench-demo"}
    templar = Templar(loader=DataLoader(), variables=variables)
    # Text read from the task file is a template only once trusted, as Ansible trusts its own task files.
    templar.available_variables = {**variables, "_bad": templar.template(trust_as_template(task["vars"]["_bad"]))}
    msg = templar.template(trust_as_template(task["ansible.builtin.assert"]["fail_msg"]))
    assert msg.splitlines() == [
        f"in32-out16-c1: NOT_EXECUTED: {why}",
        f"in32-out16-c4: NOT_EXECUTED: {why}",
        "in256-out16-c4: FAILED: success rate 0.50 < 1.0",
        "see /r/bench-demo/report.md",
    ]
