"""llmfleet_reset in-process: check mode lists and removes nothing, a real run removes and reports the units for
systemd's reload, a second run changes nothing, a path behind another account's link fails the task naming it,
and the option pairs that cannot work are refused with what to pass."""

from __future__ import annotations

import pytest

import llmfleet_reset as mod
from tests.unit.modules.util import fail, run, undocumented

pytestmark = pytest.mark.usefixtures("module_exits")


def node(tmp_path):
    (tmp_path / "units").mkdir()
    (tmp_path / "units" / "llmfleet-demo.service").write_text("[Service]\n")
    (tmp_path / "gpus").mkdir()
    (tmp_path / "gpus" / "demo.json").write_text("{}")
    (tmp_path / "state" / "demo").mkdir(parents=True)
    return {"deployment": "demo", "units": ["llmfleet-demo.service"], "unit_dirs": [str(tmp_path / "units")],
            "claim_dir": str(tmp_path / "gpus"), "paths": [str(tmp_path / "gpus" / "demo.json"),
                                                          str(tmp_path / "state" / "demo")]}  # fmt: skip


def test_check_then_run_then_nothing(tmp_path):
    args = node(tmp_path)
    res = run(mod, args, check=True)
    assert res["changed"] is True and len(res["removed"]) == 3 and (tmp_path / "state" / "demo").is_dir()
    assert res["units_removed"] == [str(tmp_path / "units" / "llmfleet-demo.service")]
    assert not undocumented(mod, res)
    res = run(mod, args)
    assert res["changed"] is True and not (tmp_path / "state" / "demo").exists()
    assert not (tmp_path / "units" / "llmfleet-demo.service").exists()
    res = run(mod, args)
    assert res["changed"] is False and res["removed"] == [] and res["units_removed"] == []


def test_a_path_behind_another_accounts_link_fails_naming_it_after_the_rest(tmp_path):
    args = node(tmp_path)
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    (tmp_path / "open" / "lnk").symlink_to(tmp_path / "state")
    res = fail(mod, {**args, "paths": [str(tmp_path / "open" / "lnk" / "demo"), args["paths"][0]]})
    assert (
        "root would have followed another account's link" in res["msg"] and str(tmp_path / "open" / "lnk") in res["msg"]
    )
    assert (tmp_path / "state" / "demo").is_dir()  # not through the link...
    assert not (tmp_path / "gpus" / "demo.json").exists() and res["changed"] is True  # ...the rest went


@pytest.mark.parametrize(
    ("over", "msg"),
    [({"shared": ["/opt/llmfleet"], "claim_dir": ""}, "shared paths need claim_dir"),
     ({"labelled": ["/m/llmfleet_nccl_check.prom"], "deployment": ""}, "labelled textfiles need the deployment")],
)  # fmt: skip
def test_options_that_cannot_work_are_refused(tmp_path, over, msg):
    assert msg in fail(mod, {**node(tmp_path), **over})["msg"]
