"""llmfleet_record (an action plugin; library/ holds its doc stub): a record of the run written on the ops host in
the controller's process - the text to_nice_json wrote before, the directory created, unchanged text left alone,
check mode writing nothing, and bad names refused before anything is written."""

import datetime
import importlib.util
import json
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
from ansible.errors import AnsibleActionFail

PATH = Path(__file__).parents[3] / "action_plugins" / "llmfleet_record.py"
_spec = importlib.util.spec_from_file_location("llmfleet_record_action", PATH)
action = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(action)


def run(args, check=False, task_vars=None):
    task = SimpleNamespace(args=args, async_val=0, check_mode=check, action="llmfleet_record", diff=False)
    conn = SimpleNamespace(_shell=SimpleNamespace(tmpdir="/nonexistent"))  # never used: nothing runs on a host
    am = action.ActionModule(task, conn, play_context=None, loader=None, templar=None, shared_loader_obj=None)
    am._load_name = "llmfleet_record"
    return am.run(task_vars=task_vars or {})


def test_the_record_is_the_text_to_nice_json_wrote_and_the_directory_is_created(tmp_path):
    d = tmp_path / "reports" / "deep"
    res = run({"dir": str(d), "name": "topology.json", "content": {"nodes": {"b": 2, "a": [1]}}})
    assert res["changed"] and res["path"] == str(d / "topology.json")
    text = (d / "topology.json").read_text()
    assert text == '{\n    "nodes": {\n        "a": [\n            1\n        ],\n        "b": 2\n    }\n}\n'
    assert stat.S_IMODE(os.stat(d / "topology.json").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o755
    assert os.listdir(d) == ["topology.json"]  # no temporary file left


def test_unchanged_text_is_not_rewritten_and_a_new_mode_is(tmp_path):
    args = {"dir": str(tmp_path), "name": "r.json", "content": [1, 2]}
    run(args)
    inode = os.stat(tmp_path / "r.json").st_ino
    assert run(args)["changed"] is False and os.stat(tmp_path / "r.json").st_ino == inode
    assert run({**args, "mode": "0600"})["changed"] is True
    assert stat.S_IMODE(os.stat(tmp_path / "r.json").st_mode) == 0o600


def test_check_mode_says_it_would_change_and_writes_nothing(tmp_path):
    d = tmp_path / "reports"
    assert run({"dir": str(d), "name": "r.json", "content": {"a": 1}}, check=True)["changed"] is True
    assert not d.exists()


def test_stamp_adds_generated_at_in_utc_seconds():
    now = datetime.datetime(2026, 12, 2, 5, 4, 3, 999, tzinfo=datetime.UTC)
    assert json.loads(action.render({"a": 1}, True, now)) == {"a": 1, "generated_at": "2026-12-02T05:04:03Z"}
    with pytest.raises(AnsibleActionFail, match="give content as a mapping"):
        action.render([1], True)


@pytest.mark.parametrize(
    ("args", "text"),
    [
        ({"name": "../x.json"}, "give a file name without a directory"),
        ({"name": ".."}, "give a file name without a directory"),
        ({"mode": "rw-r--r--"}, "give an octal file mode"),
        ({"content": None, "extra": 1}, "Unsupported parameters"),
    ],
)
def test_bad_options_fail_before_anything_is_written(tmp_path, args, text):
    with pytest.raises(AnsibleActionFail, match=text):
        run({"dir": str(tmp_path / "d"), "name": "r.json", "content": {}, **args})
    assert not (tmp_path / "d").exists()


def test_a_directory_that_cannot_be_made_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(AnsibleActionFail, match=r"cannot write .*/file/sub/r\.json on the ops host"):
        run({"dir": str(tmp_path / "file" / "sub"), "name": "r.json", "content": {}})


def test_a_record_written_during_a_run_carries_its_id(tmp_path):
    rid = "20261204T080725Z-108366"
    run(
        {"dir": str(tmp_path), "name": "t.json", "content": {"a": 1}, "stamp": True}, task_vars={"llmfleet_run_id": rid}
    )
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["run_id"] == rid and data["a"] == 1 and "generated_at" in data
    run({"dir": str(tmp_path), "name": "l.json", "content": [1]}, task_vars={"llmfleet_run_id": rid})
    assert json.loads((tmp_path / "l.json").read_text()) == [1]  # a list has no place for it
    run({"dir": str(tmp_path), "name": "o.json", "content": {"a": 1}})
    assert "run_id" not in json.loads((tmp_path / "o.json").read_text())  # outside a run
    with pytest.raises(AnsibleActionFail, match=r"llmfleet_run_id '\.\./x': not a run id"):
        run({"dir": str(tmp_path), "name": "b.json", "content": {}}, task_vars={"llmfleet_run_id": "../x"})
