"""llmfleet_metrics_textfile in-process: check mode predicts without writing, changed only when the bytes
differ, diff, a missing directory, bad source / record / name, a symlinked target."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import llmfleet_metrics_textfile as mod
from tests.unit.modules.util import fail, run, undocumented

pytestmark = pytest.mark.usefixtures("module_exits")

ROOT = Path(__file__).resolve().parents[2]
STAGE = json.loads((ROOT / "tests" / "fixtures" / "metrics" / "stage-demo-model.json").read_text())["nodes"]
NAME = "llmfleet_stage_demo-model.prom"


def args(d, **over):
    return {"directory": str(d), "name": NAME, "source": "stage", "record": STAGE["node1"],
            "labels": {"deployment": "demo"}, "node": "node1", **over}  # fmt: skip


def test_check_mode_predicts_and_writes_nothing(tmp_path):
    res = run(mod, {**args(tmp_path), "_ansible_diff": True}, check=True)
    assert res["changed"] is True and res["path"] == str(tmp_path / NAME) and res["series"] == 8
    assert res["diff"]["before"] == "" and res["diff"]["after"].startswith("# HELP llmfleet_stage_ok")
    assert os.listdir(tmp_path) == []
    assert not undocumented(mod, res)


def test_run_writes_then_is_unchanged_then_changes_with_the_record(tmp_path):
    res = run(mod, args(tmp_path))
    assert res["changed"] is True and res["created"] is False
    text = (tmp_path / NAME).read_text()
    assert next(f.name for f in text_string_to_metric_families(text)) == "llmfleet_stage_ok"
    assert stat.S_IMODE(os.stat(tmp_path / NAME).st_mode) == 0o644
    assert run(mod, args(tmp_path))["changed"] is False
    assert run(mod, args(tmp_path), check=True)["changed"] is False
    # Any byte differs: a new value is a change (here the run time the stage module reports).
    res = run(mod, {**args(tmp_path, record={**STAGE["node1"], "elapsed_s": 1.5}), "_ansible_diff": True})
    assert res["changed"] is True and "llmfleet_stage_seconds" in res["diff"]["after"]
    assert res["diff"]["before"] == text
    assert sorted(os.listdir(tmp_path)) == [NAME]


def test_missing_directory_fails_with_the_fix_unless_create(tmp_path):
    missing = tmp_path / "textfile_collector"
    for check in (False, True):
        msg = fail(mod, args(missing), check=check)["msg"]
        assert f"{missing}/{NAME} (source stage)" in msg
        assert "does not exist: create it" in msg and "llmfleet_metrics_dir" in msg
    res = run(mod, args(missing, create=True), check=True)
    assert res["changed"] and res["created"] and not missing.exists()
    res = run(mod, args(missing, create=True))
    assert res["created"] and (missing / NAME).is_file() and stat.S_IMODE(missing.stat().st_mode) == 0o755


@pytest.mark.parametrize(
    ("over", "text"),
    [
        ({"source": "gpu"}, "value of source must be one of: stage, nccl_check, engine_ready, acceptance, bench, got: gpu"),
        ({"name": "stage.txt"}, "'stage.txt' is not valid: a plain file name ending in .prom"),
        ({"name": "../x.prom"}, "a plain file name ending in .prom"),
        ({"source": "nccl_check"}, "(source nccl_check): nccl_check: the record is not a verdict"),
        ({"source": "engine_ready", "node": ""}, "engine_ready: give node"),
        ({"record": {"failed": True, "msg": "x"}, "labels": {}}, "stage: the record names no model or revision"),
        ({"labels": {"__x": "1"}}, "label name '__x' (a constant label)"),
        ({"labels": {"model": "other"}}, "constant label model='other' contradicts the record's model='demo-model'"),
        ({"record": "not a dict"}, "argument 'record' is of type str and we were unable to convert to dict"),
    ],
)  # fmt: skip
def test_bad_input_fails_with_a_message_not_a_traceback(tmp_path, over, text):
    assert text in fail(mod, args(tmp_path, **over))["msg"]
    assert os.listdir(tmp_path) == []


def test_symlinked_target_is_refused_even_in_check_mode(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.write_text("keep\n")
    d = tmp_path / "collector"
    d.mkdir()
    (d / NAME).symlink_to(outside)
    for check in (True, False):
        assert "is a symlink: refusing to replace it" in fail(mod, args(d), check=check)["msg"]
    assert outside.read_text() == "keep\n"
