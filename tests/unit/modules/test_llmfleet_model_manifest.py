"""llmfleet_model_manifest: options -> manifest.obtain_manifest, and the build it may run -> a reader lease
and manifest.build_manifest."""

from typing import ClassVar

import pytest

import llmfleet_model_manifest as mod
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.errors import StageError
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.lease import LeaseTimeout
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.manifest import (
    build_manifest as real_build_manifest,
)
from tests.unit.modules.util import Recorder, fail, run, undocumented

pytestmark = pytest.mark.usefixtures("module_exits")

REV = "d2dc35658bcf77e66643428cb52e774cc3b5bd29"
MANIFEST = {"files": [{"path": "a", "size": 3}, {"path": "b", "size": 4}], "total_bytes": 7}


class FakeLease:
    log: ClassVar[list] = []

    def __init__(self, *args, **kwargs):
        FakeLease.log.append(("init", args, kwargs))

    def acquire(self, timeout):
        FakeLease.log.append(("acquire", timeout))

    def release(self):
        FakeLease.log.append(("release",))


@pytest.fixture
def fakes(monkeypatch):
    FakeLease.log = []
    got = {
        "resolve_source": Recorder("/mnt/shared/models--Qwen--Qwen3.8/snapshots/" + REV),
        "build_manifest": Recorder(MANIFEST),
        # The real obtain_manifest calls build() when nothing is cached: do that.
        "obtain_manifest": Recorder(
            lambda src, model, rev, cache, *, build, check_mode, expected_sha256, allow_links_into: {
                "origin": "built",
                "path": f"{cache}/manifests/{model}/{rev}.json",
                "manifest": build(),
            }
        ),
        "stat_manifest": Recorder(MANIFEST),
    }
    for name, rec in got.items():
        monkeypatch.setattr(mod, name, rec)
    monkeypatch.setattr(mod, "Lease", FakeLease)
    monkeypatch.setattr(mod.socket, "gethostname", lambda: "node1")
    return got


def base(**over):
    return {"source": "/mnt/shared/models--Qwen--Qwen3.8", "model": "qwen3.8", "revision": REV,
            "cache_dir": "/mnt/shared/.llmfleet", "lease_dir": "/mnt/shared/.llmfleet/leases", **over}  # fmt: skip


def test_options_become_the_manifest_calls(fakes):
    res = run(mod, base(max_source_readers="3", lease_timeout=60, threads=8, source_allow_links_into=["/srv/blobs"]))
    src = fakes["resolve_source"].result
    assert fakes["resolve_source"].args == ("/mnt/shared/models--Qwen--Qwen3.8", REV)
    assert fakes["obtain_manifest"].args == (src, "qwen3.8", REV, "/mnt/shared/.llmfleet")
    assert fakes["obtain_manifest"].kwargs["check_mode"] is False
    assert FakeLease.log == [("init", ("/mnt/shared/.llmfleet/leases", 3), {"host": "node1", "label": "manifest"}),
                             ("acquire", 60.0), ("release",)]  # fmt: skip
    assert fakes["build_manifest"].args == (src,)
    # this lease has no check(); the allowed link targets reach the build and the cached manifest's check
    assert fakes["build_manifest"].kwargs == {
        "threads": 8, "revision": REV, "check": None, "allow_links_into": ["/srv/blobs"]
    }  # fmt: skip
    assert fakes["obtain_manifest"].kwargs["allow_links_into"] == ["/srv/blobs"]
    assert fakes["obtain_manifest"].kwargs["expected_sha256"] is None
    assert res == {"changed": True, "manifest_path": f"/mnt/shared/.llmfleet/manifests/qwen3.8/{REV}.json",
                   "source_dir": src, "origin": "built", "files": 2, "total_bytes": 7, "trust": None}  # fmt: skip
    assert not undocumented(mod, res)


@pytest.mark.parametrize(("origin", "changed"), [("cache", False), ("shipped", True)])
def test_a_found_manifest_builds_nothing(fakes, monkeypatch, origin, changed):
    monkeypatch.setattr(mod, "obtain_manifest", Recorder({"origin": origin, "path": "/c/m.json", "manifest": MANIFEST}))
    res = run(mod, base())
    assert res["changed"] is changed and res["origin"] == origin and FakeLease.log == []


def test_check_mode_reads_no_file_contents(fakes, monkeypatch):
    obtain = Recorder({"origin": "would build", "path": "/c/m.json", "manifest": None})
    monkeypatch.setattr(mod, "obtain_manifest", obtain)
    res = run(mod, base(), check=True)
    assert obtain.kwargs["check_mode"] is True
    assert fakes["stat_manifest"].args == (fakes["resolve_source"].result, [])  # sizes from stat
    assert fakes["build_manifest"].calls == [] and FakeLease.log == []
    assert res["changed"] is True and res["origin"] == "would build" and res["total_bytes"] == 7


@pytest.mark.parametrize(
    ("error", "text"),
    [
        (StageError(f"revision {REV} not in snapshots"), f"node1: manifest of qwen3.8@{REV}: revision {REV} not in snapshots"),
        (LeaseTimeout("no reader slot in 3600 s"), "no reader slot in 3600 s"),
        (ValueError("malformed manifest"), "malformed manifest"),
    ],
)  # fmt: skip
def test_package_errors_are_failures(fakes, monkeypatch, error, text):
    monkeypatch.setattr(mod, "obtain_manifest", Recorder(raises=error))
    assert text in fail(mod, base())["msg"]


def test_the_pin_and_the_digest_travel(fakes, monkeypatch):
    trust = {"upstream_checked": 1, "upstream_kinds": ["hub blob"], "rehashed": 1, "unverified": 0, "notes": []}
    obtain = Recorder(
        {"origin": "cache", "path": "/c/m.json", "manifest": MANIFEST, "sha256": "d" * 64, "trust": trust}
    )
    monkeypatch.setattr(mod, "obtain_manifest", obtain)
    res = run(mod, base(expected_sha256="d" * 64))
    assert obtain.kwargs["expected_sha256"] == "d" * 64
    assert res["manifest_sha256"] == "d" * 64 and res["trust"] == trust
    assert not undocumented(mod, res)


def test_a_lost_lease_stops_the_build_with_a_clear_message(fakes, monkeypatch, tmp_path):
    """The build reads the source under a reader lease: when the lease is lost, reading stops between
    two chunks and the task fails saying so (not a traceback, not a manifest)."""
    from tests.helpers.ckpt import make_checkpoint

    src = make_checkpoint(tmp_path / "src", shards=2)
    globs = (
        mod.lease_check.__globals__
    )  # the package as the module imports it (ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet)

    class Lost(Exception):
        pass

    monkeypatch.setattr(globs["lease_module"], "LeaseLost", Lost, raising=False)
    calls = []

    def check(self):
        calls.append(1)
        if len(calls) > 2:
            raise Lost("slot-0 now holds node7's token")

    monkeypatch.setattr(FakeLease, "check", check, raising=False)
    monkeypatch.setattr(mod, "resolve_source", Recorder(str(src)))
    monkeypatch.setattr(mod, "build_manifest", real_build_manifest)
    msg = fail(mod, base())["msg"]
    assert "node1: manifest of qwen3.8@" in msg
    assert "lost the shared-storage reader lease on node1 (slot-0 now holds node7's token)" in msg
    assert ("release",) in FakeLease.log


BAD = [
    ({"threads": 0}, "llmfleet_model_manifest: threads=0 is out of range (set by the role variable model_stage_threads): it must be >= 1"),
    ({"lease_timeout": -1}, "lease_timeout=-1.0 is out of range: it must be >= 0"),
    ({"revision": None}, "missing required arguments: revision"),
    ({"max_source_readers": "two"}, "argument 'max_source_readers' is of type str and we were unable to convert to int"),
    ({"expected_sha256": "abc"}, "expected_sha256='abc' (set by the role variable model_stage_manifest_sha256) is not a sha256"),
]  # fmt: skip


@pytest.mark.parametrize(("over", "text"), BAD)
def test_bad_options_fail_naming_them(fakes, over, text):
    args = {k: v for k, v in base(**over).items() if v is not None}
    assert text in fail(mod, args)["msg"]
    assert fakes["resolve_source"].calls == []


def test_a_link_out_of_the_source_fails_the_task_by_name(fakes, monkeypatch, tmp_path):
    """A source file linked to a root-only file elsewhere would be staged as root, world-readable, and
    served to peers: the task fails naming the link, where it points and the fix; allowing its directory
    (model_stage_source_allow_links_into) makes it part of the revision."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.manifest import (
        obtain_manifest as real_obtain_manifest,
    )
    from tests.helpers.ckpt import make_checkpoint

    src = make_checkpoint(tmp_path / "src", shards=1)
    secret = tmp_path / "etc" / "api-key"
    secret.parent.mkdir()
    secret.write_text("sk-not-for-peers\n")
    (src / "notes.txt").symlink_to(secret)
    monkeypatch.setattr(mod, "resolve_source", Recorder(str(src)))
    monkeypatch.setattr(mod, "build_manifest", real_build_manifest)
    monkeypatch.setattr(mod, "obtain_manifest", real_obtain_manifest)
    msg = fail(mod, base(cache_dir=str(tmp_path / "cache")))["msg"]
    assert f"notes.txt is a link to {secret}, outside the source" in msg
    assert "model_stage_source_allow_links_into" in msg
    assert not (tmp_path / "cache" / "manifests").exists()
    res = run(mod, base(cache_dir=str(tmp_path / "cache"), source_allow_links_into=[str(secret.parent)]))
    assert res["origin"] == "built" and res["files"] == len(list(src.iterdir()))
