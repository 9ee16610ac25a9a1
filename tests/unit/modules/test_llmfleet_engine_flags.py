"""llmfleet_engine_flags: options -> engine.help_text and helpflags.unknown_flags (the engine's --help
played by a captured one)."""

from pathlib import Path

import pytest

import llmfleet_engine_flags as mod
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.command import PlanError
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.helpflags import unknown_flags
from tests.unit.modules.util import Recorder, fail, run, undocumented

pytestmark = pytest.mark.usefixtures("module_exits")

SGLANG_HELP = (Path(__file__).parents[2] / "fixtures/engines/sglang-0.5.23.serve-help.txt").read_text()
CMD = ["/opt/sglang/bin/sglang", "serve"]


@pytest.fixture
def helps(monkeypatch):
    got = {"help_text": Recorder((SGLANG_HELP, False)), "unknown_flags": Recorder(unknown_flags)}
    for name, rec in got.items():
        monkeypatch.setattr(mod, name, rec)
    return got


@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
def test_options_become_the_help_call_and_the_check(helps, check):
    argv = [*CMD, "--model-path", "/m", "--tp-size", "8"]
    res = run(mod, {"command": CMD, "profile": "sglang", "argv": argv, "timeout": "60"}, check=check)
    assert helps["help_text"].args == (CMD, "sglang", 60.0)
    # check mode reads the help cache, never writes it
    assert helps["help_text"].kwargs == {"cache_dir": "", "cache_key": "", "store": not check, "run_as": ""}
    assert helps["unknown_flags"].args == (argv, SGLANG_HELP, "sglang")
    assert helps["unknown_flags"].kwargs == {"skip": 2}  # the command words are not flags
    assert res == {"changed": False, "unknown": [], "known_flags": 560, "cached": False}
    assert not undocumented(mod, res)


def test_an_unknown_flag_fails_with_the_did_you_mean(helps):
    res = fail(mod, {"command": CMD, "profile": "sglang", "argv": [*CMD, "--tp-sise", "8"]})
    assert res["unknown"][0]["flag"] == "--tp-sise" and res["known_flags"] == 560
    assert "--tp-sise" in res["msg"] and "--tp-size" in res["msg"]
    assert helps["help_text"].args[2] == 300  # the default timeout
    assert not undocumented(mod, res)


def test_help_that_fails_is_a_failure_naming_the_command(monkeypatch):
    monkeypatch.setattr(mod, "help_text", Recorder(raises=PlanError("`sglang serve --help` failed (exit 127): ")))
    res = fail(mod, {"command": ["sglang", "serve"], "profile": "sglang", "argv": ["sglang", "serve"]})
    assert res["msg"].startswith("`sglang serve --help` failed (exit 127)")
    assert res["unknown"] == [] and res["known_flags"] == 0


def test_the_cache_options_reach_the_help_call(helps):
    args = {"command": CMD, "profile": "sglang", "argv": CMD, "cache_dir": "/var/lib/llmfleet/engine/help-cache",
            "cache_key": '{"sglang": "0.5.23"}'}  # fmt: skip
    run(mod, args)
    kw = helps["help_text"].kwargs
    assert (kw["cache_dir"], kw["cache_key"]) == ("/var/lib/llmfleet/engine/help-cache", '{"sglang": "0.5.23"}')


BAD = [
    ({"profile": "tgi"}, "value of profile must be one of: sglang, vllm, vllm_pd, custom, router, got: tgi"),
    ({"argv": None}, "missing required arguments: argv"),
    ({"timeout": "soon"}, "argument 'timeout' is of type str and we were unable to convert to float"),
]  # fmt: skip


@pytest.mark.parametrize(("over", "text"), BAD)
def test_bad_options_fail_naming_them(helps, over, text):
    args = {k: v for k, v in {"command": CMD, "profile": "sglang", "argv": CMD, **over}.items() if v is not None}
    assert text in fail(mod, args)["msg"]
    assert helps["help_text"].calls == []
