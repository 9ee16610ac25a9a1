"""The deployment report reads the newest run only: every record carries its run's id, run-<deployment>.json names
the newest run and where it stopped. A passing run, then a run failing at each step in turn: the report is never
PASS, says where the run stopped first, and every step the run did not reach is "not run in this run (it stopped at
<step> on <node>)". Records without a run id are an earlier run's. Over the real lab record set
(tests/fixtures/reports/lab-vllm), with run ids and run records as the roles and the run callback write them."""

import json
import shutil
from pathlib import Path

import pytest

from llmfleet.report import build as report
from llmfleet.report import cli as report_cli

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests/fixtures/reports/lab-vllm"
PASSED = "20261204T080000Z-aaaaaa"
FAILED = "20261204T090000Z-bbbbbb"
SITE_STEPS = ["preflight", "topology", "staging", "nccl", "timeline", "acceptance"]
# The records of each step, in the order site.yml writes them (fleet-summary.json: the report role, last).
STEP_FILES = {
    "preflight": ["preflight.json"],
    "topology": ["topology.json"],
    "staging": ["stage-det-model.json"],
    "nccl": ["nccl-check.json"],
    "engine": ["engine-demo.json", "endpoint-demo.json"],
    "acceptance": ["acceptance-demo.json"],
    "report": ["fleet-summary.json"],
}
ORDER = ["llmfleet", "preflight", "base", "topology", "model_stage", "nccl_check", "engine", "acceptance", "report"]
ROLE_FILES = {"model_stage": "staging", "nccl_check": "nccl"}


def stamp(d: Path, name: str, run_id: str | None, change=None) -> None:
    p = d / name
    data = json.loads(p.read_text())
    data.pop("run_id", None)
    if run_id:
        data["run_id"] = run_id
    if change:
        change(data)
    p.write_text(json.dumps(data))


def run_record(d: Path, run_id: str, **kw) -> None:
    data = {"run_id": run_id, "deployment": "demo", "playbook": "site.yml", "started_at": "2026-12-04T09:00:00Z",
            "steps": SITE_STEPS, "tags": ["all"], "skip_tags": [], **kw}  # fmt: skip
    (d / "run-demo.json").write_text(json.dumps(data))


def passing_run(tmp_path: Path) -> Path:
    d = tmp_path / "reports"
    shutil.copytree(FIX, d, ignore=shutil.ignore_patterns("*.py", "*.md", "bench-demo"))
    for files in STEP_FILES.values():
        for name in files:
            stamp(d, name, PASSED)
    run_record(d, PASSED, outcome="completed", stopped=None, started_at="2026-12-04T08:00:00Z")
    return d


def steps(model: dict) -> dict:
    return {s["id"]: s for s in model["steps"]}


def test_the_passing_run_passes(tmp_path):
    m = report.collect(passing_run(tmp_path), "demo")
    assert m["status"] == "pass", m["verdict"]
    assert m["run"]["id"] == PASSED and m["run"]["outcome"] == "completed"
    lines = report.summary_lines(m)
    assert lines[1].startswith(f"  run {PASSED} (site.yml")
    # bench is not a step of site.yml: said so, not a failure
    assert (
        steps(m)["bench"]["status"] == "not-run" and "site.yml does not take this step" in steps(m)["bench"]["reason"]
    )


# Where a run fails, and whether that step writes a failing record of its own before the play stops.
FAILURES = [
    ("llmfleet", None),  # the fleet contract's checks (pulled in by preflight): no record at all
    ("preflight", "preflight"),  # a failed check: preflight.json with status fail
    ("base", None),  # the node runtime: no record
    ("topology", None),  # discovery failed before topology.json
    ("model_stage", "staging"),  # a node failed staging: stage-*.json names it
    ("nccl_check", "nccl"),  # nccl-check.json not ok
    ("engine", None),  # the engine's flag check (--enable-metricz) refused before the gate: no engine record
    ("engine", "engine"),  # the readiness gate failed: engine-demo.json not ok
    ("acceptance", "acceptance"),  # NOT ACCEPTED
    ("report", None),  # duplicate machine-ids: the report role's own check
]


def failing_run(d: Path, role: str, record: str | None) -> None:
    """Run FAILED over the passing run's directory: the steps before `role` write their records again (this run's
    id), `role` writes a failing record or none, nothing after it runs; the run callback's stop."""
    upto = ORDER.index(role)
    for r in ORDER[:upto]:
        for name in STEP_FILES.get(ROLE_FILES.get(r, r), []):
            stamp(d, name, FAILED)
    if record == "preflight":
        stamp(d, "preflight.json", FAILED, lambda x: x.update(status="fail", failed_nodes=["node2"]))
    elif record == "staging":
        stamp(d, "stage-det-model.json", FAILED,
              lambda x: x["nodes"]["node2"].update(failed=True, msg="digest mismatch"))  # fmt: skip
    elif record == "nccl":
        stamp(d, "nccl-check.json", FAILED, lambda x: x.update(ok=False, verdict="FAIL: node2 culprit"))
    elif record == "engine":
        stamp(d, "engine-demo.json", FAILED,
              lambda x: x.update(ok=False, failure={"verdict": "unit failed", "node": "node2"}))  # fmt: skip
    elif record == "acceptance":
        stamp(d, "acceptance-demo.json", FAILED, lambda x: x.update(accepted=False, summary="NOT ACCEPTED"))
    msg = {"engine": "unrecognized arguments: --enable-metricz (did you mean --enable-metrics?)"}.get(role, "failed")
    stop = {"node": "node2", "role": role, "task": f"{role}: a task", "message": msg, "at": "2026-12-04T09:01:00Z",
            "within": "preflight" if role == "llmfleet" else ""}  # fmt: skip
    run_record(d, FAILED, outcome="failed", stopped=stop, finished_at="2026-12-04T09:02:00Z")


@pytest.mark.parametrize(("role", "record"), FAILURES)
def test_a_run_failing_at_each_step_after_a_passing_run_is_never_pass(tmp_path, role, record):
    d = passing_run(tmp_path)
    assert report.collect(d, "demo")["status"] == "pass"
    failing_run(d, role, record)
    m = report.collect(d, "demo")
    assert m["status"] == "fail", m["verdict"]
    assert m["run"]["id"] == FAILED
    lines = report.summary_lines(m)
    assert lines[0].startswith("deployment demo: FAIL at "), lines
    if role != "acceptance":  # acceptance is the deployment's, asked from the ops host: no node of its own
        assert "node2" in lines[0], lines  # the failure first, with its node
    where = report.stop_step({"role": role, "within": "preflight" if role == "llmfleet" else ""})
    stopped = f"not run in this run (it stopped at {where} on node2"
    # every step after the stop is not this run's, and says where the run stopped
    after = {"llmfleet": SITE_STEPS, "preflight": SITE_STEPS[1:], "base": SITE_STEPS[1:], "topology": SITE_STEPS[1:],
             "model_stage": SITE_STEPS[3:], "nccl_check": SITE_STEPS[4:], "engine": SITE_STEPS[5:],
             "acceptance": [], "report": []}[role]  # fmt: skip
    if record is None and role == "topology":
        after = SITE_STEPS[1:]
    for sid in after:
        st = steps(m)[sid]
        assert st["status"] == "not-run", (sid, st)
        line = next(x for x in lines if x.split()[0] == {"nccl": "nccl", "timeline": "engine/cold"}.get(sid, sid))
        assert stopped in line or "it stopped at" in line, line
    # nothing of the passing run is shown as this run's
    for sid in after:
        assert steps(m)[sid]["summary"] == "not run in this run"
    assert m["has_own_records"]  # the earlier run's records are there: the CLI says no "no record of demo"
    if role == "engine" and record is None:
        assert "--enable-metricz" in m["verdict"] and m["failure"]["node"] == "node2"
        assert "first correct answer" not in "\n".join(lines)  # the earlier run's gate is not shown


def test_a_run_that_did_not_end_is_incomplete_not_pass(tmp_path):
    """Interrupted (or still running): no outcome in the run record; its records so far are shown, the rest said."""
    d = passing_run(tmp_path)
    for name in ("preflight.json", "topology.json"):
        stamp(d, name, FAILED)
    run_record(d, FAILED)
    m = report.collect(d, "demo")
    assert m["status"] == "incomplete" and "has not ended" in m["verdict"], m["verdict"]
    assert steps(m)["preflight"]["status"] != "not-run" and steps(m)["staging"]["status"] == "not-run"
    assert "is from an earlier run (" + PASSED in steps(m)["staging"]["reason"]


def test_records_without_a_run_id_are_an_earlier_runs(tmp_path):
    d = passing_run(tmp_path)
    stamp(d, "acceptance-demo.json", None)  # written before llmfleet kept run ids
    m = report.collect(d, "demo")
    assert m["status"] == "incomplete"
    assert "acceptance-demo.json has no run id: written by an earlier run" in steps(m)["acceptance"]["reason"]


def test_without_a_run_record_the_newest_run_id_is_the_run(tmp_path):
    d = passing_run(tmp_path)
    (d / "run-demo.json").unlink()
    stamp(d, "preflight.json", FAILED)  # a newer run that wrote only this
    m = report.collect(d, "demo")
    assert m["run"]["id"] == FAILED and m["status"] == "incomplete"
    assert steps(m)["preflight"]["status"] != "not-run" and steps(m)["acceptance"]["status"] == "not-run"


def test_a_tagged_run_says_which_steps_it_left_out(tmp_path):
    d = passing_run(tmp_path)
    stamp(d, "engine-demo.json", FAILED)
    stamp(d, "endpoint-demo.json", FAILED)
    run_record(d, FAILED, tags=["engine"], outcome="completed", stopped=None)
    m = report.collect(d, "demo")
    assert steps(m)["timeline"]["status"] == "pass" and m["status"] == "incomplete"
    assert "site.yml with --tags engine does not take this step" in steps(m)["preflight"]["reason"]


def test_the_page_and_the_markdown_name_the_run_and_the_stop(tmp_path):
    d = passing_run(tmp_path)
    failing_run(d, "engine", None)
    html, md = report.render(report.collect(d, "demo"))
    assert f'data-run-id="{FAILED}"' in html and "it stopped at engine on node2" in html
    assert f"Run `{FAILED}` (site.yml" in md and "Not run in this run: it stopped at engine on node2" in md


def test_the_not_run_lines_show_a_normalised_report_dir(tmp_path, capsys):
    d = tmp_path / "playbooks"
    d.mkdir()
    (tmp_path / "reports").mkdir()
    args = report_cli.argparse.Namespace(dir=str(d / ".." / "reports"), deployment="demo", max_age=24.0, json=True,
                                         show=False)  # fmt: skip
    assert report_cli.run(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert steps(res)["preflight"]["reason"] == f"no preflight.json in {tmp_path / 'reports'}"
    assert res["run"] is None  # no record: no run
    assert "/../" not in json.dumps(res)


def test_a_fleet_contract_stop_names_the_step_that_pulled_it_in():
    stop = {"role": "llmfleet", "within": "preflight", "node": "node1"}
    assert report.stop_step(stop) == "preflight (the fleet contract's checks)"
    assert report.stop_step({"role": "model_stage"}) == "staging"
