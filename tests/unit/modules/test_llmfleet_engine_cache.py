"""llmfleet_engine_cache: options -> the fingerprint inputs and the engine.prepare_cache call."""

import grp
import os
import pwd

import pytest

import llmfleet_engine_cache as mod
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.command import PlanError, fingerprint
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.safefs import UnsafePathError
from tests.unit.modules.util import Recorder, fail, run, undocumented

pytestmark = pytest.mark.usefixtures("module_exits")

ME = pwd.getpwuid(os.getuid()).pw_name
MY_GROUP = grp.getgrgid(os.getgid()).gr_name
VERSIONS = {"versions": {"vllm": "0.32.0", "flashinfer": "0.4", "torch": "2.9"}, "cuda": "12.8"}


@pytest.fixture
def fakes(monkeypatch, tmp_path):
    calls = {
        "engine_versions": Recorder(VERSIONS),
        "gpu_facts": Recorder({"driver": "580.1", "compute_capability": "9.0"}),
        "model_identity": Recorder({"model_revision": "c" * 40, "quantization": "fp8", "model_real_path": "/m/ccc"}),
        "fingerprint_dirs_in_use": Recorder({str(tmp_path / "cache" / "0000000000000000")}),
        "prepare_cache": Recorder(
            lambda root, fp, keep, **kw: {
                "cache_dir": f"{root}/{fp}",
                "created": True,
                "chowned": [f"{root}/{fp}"],
                "removed": [],
                "remove_failed": [],
            }
        ),
    }
    for name, rec in calls.items():
        monkeypatch.setattr(mod, name, rec)
    return calls


def base(tmp_path, **over):
    (tmp_path / "model").mkdir(exist_ok=True)
    return {"engine_python": "/opt/vllm/bin/python", "engine": "vllm_pd", "model_path": str(tmp_path / "model"),
            "tp": "8", "pp": 2, "cache_root": str(tmp_path / "cache"), "owner": ME, "group": MY_GROUP, **over}  # fmt: skip


@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
def test_options_become_the_fingerprint_and_the_cache_call(fakes, tmp_path, check):
    res = run(mod, base(tmp_path, extra={"moe_kernel": "triton"}, keep=3), check=check)
    assert fakes["engine_versions"].args == ("/opt/vllm/bin/python",)
    assert fakes["engine_versions"].kwargs == {"run_as": ME}  # the engine's account asks its Python, never root
    # no revision given (an engine_model_path override): the model directory's own name
    assert fakes["model_identity"].args == (str(tmp_path / "model"), None)
    assert res["inputs"] == {
        "engine": "vllm_pd",
        "engine_version": "0.32.0",  # vllm_pd runs the vllm package
        "kernel_libs": {"flashinfer": "0.4", "torch": "2.9"},
        "cuda": "12.8",
        "driver": "580.1",
        "compute_capability": "9.0",
        "tp": 8,
        "pp": 2,
        "model_revision": "c" * 40,
        "quantization": "fp8",
        "extra": {"moe_kernel": "triton"},
    }
    assert res["fingerprint"] == fingerprint(res["inputs"])
    assert fakes["fingerprint_dirs_in_use"].args == (str(tmp_path / "cache"),)
    assert fakes["prepare_cache"].args == (str(tmp_path / "cache"), res["fingerprint"], 3)
    assert fakes["prepare_cache"].kwargs == {"uid": os.getuid(), "gid": os.getgid(), "check": check,
                                             "in_use": {str(tmp_path / "cache" / "0000000000000000")}}  # fmt: skip
    assert res["changed"] is True and res["model_real_path"] == "/m/ccc" and res["created"] is True
    assert not undocumented(mod, res)


def test_engine_version_option_wins_and_nothing_to_do_is_unchanged(fakes, monkeypatch, tmp_path):
    monkeypatch.setattr(mod, "prepare_cache", Recorder({"cache_dir": "/c/x", "created": False, "chowned": [],
                                                        "removed": [], "remove_failed": []}))  # fmt: skip
    res = run(mod, base(tmp_path, engine="sglang", engine_version="sha256:abc"))
    assert res["inputs"]["engine_version"] == "sha256:abc" and res["inputs"]["extra"] is None
    assert res["inputs"]["kernel_libs"] == VERSIONS["versions"]  # nothing is "the engine" for sglang here
    assert res["changed"] is False


BAD = [
    ({"owner": "no-such-user-llmfleet"}, "engine user/group not found on this node: \"getpwnam(): name not found: 'no-such-user-llmfleet'\"; run the base role first"),
    ({"group": "no-such-group-llmfleet"}, "engine user/group not found on this node"),
    ({"model_path": "/nonexistent/model"}, "engine_model_path /nonexistent/model is not a directory on this node; stage it first"),
    ({"tp": "eight"}, "argument 'tp' is of type str and we were unable to convert to int"),
    ({"cache_root": None}, "missing required arguments: cache_root"),
    ({"keep": [1]}, "argument 'keep' is of type list and we were unable to convert to int"),
]  # fmt: skip


@pytest.mark.parametrize(("over", "text"), BAD)
def test_bad_options_fail_naming_them(fakes, tmp_path, over, text):
    args = {k: v for k, v in base(tmp_path, **over).items() if v is not None}
    assert text in fail(mod, args)["msg"]
    assert fakes["prepare_cache"].calls == []


@pytest.mark.parametrize(
    ("target", "error", "text"),
    [
        ("engine_versions", PlanError("/opt/vllm/bin/python cannot import vllm"), "/opt/vllm/bin/python cannot import vllm"),
        ("prepare_cache", UnsafePathError("demo is a symlink to /etc; nothing was changed"), "compile cache {cache}: demo is a symlink"),
        ("prepare_cache", PermissionError(13, "Permission denied"), "cannot prepare the compile cache under {cache}: [Errno 13]"),
    ],
)  # fmt: skip
def test_package_errors_are_failures_not_tracebacks(fakes, monkeypatch, tmp_path, target, error, text):
    monkeypatch.setattr(mod, target, Recorder(raises=error))
    res = fail(mod, base(tmp_path))
    assert text.format(cache=tmp_path / "cache") in res["msg"]


def test_the_revision_the_role_gives_is_the_one_hashed(fakes, tmp_path):
    """The fleet contract's revision reaches the fingerprint as given, never read back from a link on the node."""
    run(mod, base(tmp_path, revision="5eed" * 10))
    assert fakes["model_identity"].args == (str(tmp_path / "model"), "5eed" * 10)
