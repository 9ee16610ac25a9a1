"""llmfleet_model_stage: options -> the StageRequest and SwarmConfig handed to swarm.run_node (check
mode: to stage.plan)."""

import json

import pytest

import llmfleet_model_stage as mod
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.errors import StageError
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.lease import LeaseTimeout
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.manifest import manifest_digest
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.staging import StageRequest
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.swarm import SwarmConfig
from tests.unit.modules.util import Recorder, fail, job_result, run, undocumented

pytestmark = pytest.mark.usefixtures("module_exits")

REV = "d2dc35658bcf77e66643428cb52e774cc3b5bd29"
MANIFEST = {"format": "llmfleet-manifest/1", "revision": REV, "total_bytes": 7,
            "files": [{"path": "a.safetensors", "size": 3, "sha256": "0" * 64}, {"path": "b.json", "size": 4, "sha256": "1" * 64}]}  # fmt: skip
RESULT = {"changed": True, "revision": REV, "path": f"/nvme/models/qwen/{REV}", "total_bytes": 7, "bytes_to_copy": 7,
          "files_to_copy": 2, "bytes_copied": 7, "source_bytes_read": 3, "peer_bytes_read": 4, "state_before": "absent",
          "gc": {"removed": [], "kept_in_use": []}, "served_bytes": 4, "reader_intervals": [[1.0, 2.0]],
          "source_fallback_files": [], "seed": True, "assigned_files": 1}  # fmt: skip


@pytest.fixture
def fakes(monkeypatch, tmp_path):
    got = {
        "resolve_source": Recorder(str(tmp_path / "src")),
        "run_node": Recorder(RESULT),
        "plan": Recorder({"state": "partial", "todo": MANIFEST["files"][1:], "total_bytes": 7}),
        "stat_manifest": Recorder(MANIFEST),
    }
    for name, rec in got.items():
        monkeypatch.setattr(mod, name, rec)
    return got


def base(tmp_path, **over):
    mf = tmp_path / "m.json"
    mf.write_text(json.dumps(MANIFEST))
    return {"source": "/mnt/shared/models--Qwen--Qwen3.8", "manifest_path": str(mf), "model": "qwen", "revision": REV,
            "lease_dir": "/mnt/shared/.llmfleet/leases", "me": "node1", **over}  # fmt: skip


def key_file(tmp_path, mode=0o600):
    """The deployment's fabric key file, as the llmfleet role writes it (owner: this test's user)."""
    f = tmp_path / "dep.fabric-key"
    f.write_text("k" * 48)
    f.chmod(mode)
    return str(f)


def test_options_become_the_request_and_the_swarm(fakes, tmp_path):
    progress = tmp_path / "state" / "progress.json"
    res = run(mod, base(tmp_path, root="/nvme/models", threads="8", keep=3, free_space_margin_bytes=2**30,
                        deep_verify="yes", activate=False, max_source_readers=4, lease_ttl=90, lease_timeout=600,
                        peers={"node1": "http://10.0.0.11:50080", "node2": "http://10.0.0.12:50080"}, seeds=["node1"],
                        serve_bind="10.0.0.11", serve_port=50080, peer_wait=30, peer_dead_after=5, finish_wait=60,
                        progress_path=str(progress), rate_limit_bytes_per_s=2**20, lock_wait=30,
                        unit_glob="/etc/systemd/system/serve-*.service", run_by="alice",
                        manifest_sha256=manifest_digest(MANIFEST), peer_key_file=key_file(tmp_path)))  # fmt: skip
    req, cfg = fakes["run_node"].args
    assert fakes["resolve_source"].args == ("/mnt/shared/models--Qwen--Qwen3.8", REV)
    assert req == StageRequest(root="/nvme/models", model="qwen", revision=REV, manifest=MANIFEST, threads=8,
                               margin_bytes=2**30, keep=3, deep_verify=True, activate=False, check_mode=False,
                               progress_path=str(progress), rate_limit_bytes_per_s=2**20, lock_wait=30.0,
                               unit_glob="/etc/systemd/system/serve-*.service", run_by="alice")  # fmt: skip
    assert cfg == SwarmConfig(me="node1", source_dir=str(tmp_path / "src"), lease_dir="/mnt/shared/.llmfleet/leases",
                              max_source_readers=4, peers={"node1": "http://10.0.0.11:50080", "node2": "http://10.0.0.12:50080"},
                              seeds=["node1"], serve_bind="10.0.0.11", serve_port=50080, lease_ttl=90.0,
                              lease_timeout=600.0, peer_wait=30.0, peer_dead_after=5.0, finish_wait=60.0,
                              peer_key=b"k" * 48)  # fmt: skip
    assert progress.parent.is_dir()  # made for the progress file
    assert res == RESULT
    assert not undocumented(mod, res)


def test_defaults(fakes, tmp_path):
    run(mod, base(tmp_path))
    req, cfg = fakes["run_node"].args
    assert (req.root, req.threads, req.margin_bytes, req.keep, req.deep_verify, req.activate, req.progress_path,
            req.rate_limit_bytes_per_s, req.lock_wait, req.unit_glob, req.run_by) == (
        "/mnt/nvme/models", 4, 0, 2, False, True, None, 0, 0.0, "/etc/systemd/system/llmfleet-*.service", "")  # fmt: skip
    assert cfg == SwarmConfig(me="node1", source_dir=str(tmp_path / "src"), lease_dir="/mnt/shared/.llmfleet/leases")


@pytest.mark.parametrize("with_manifest", [True, False], ids=["manifest", "sizes-from-stat"])
def test_check_mode_plans_and_copies_nothing(fakes, tmp_path, with_manifest):
    args = base(tmp_path) if with_manifest else {**base(tmp_path), "manifest_path": str(tmp_path / "none.json")}
    res = run(mod, args, check=True)
    (req,) = fakes["plan"].args
    assert req.check_mode is True and req.manifest == MANIFEST
    assert (fakes["stat_manifest"].calls != []) is not with_manifest
    assert fakes["run_node"].calls == []
    assert res == {"changed": True, "state": "partial", "bytes_to_copy": 4, "files_to_copy": 1, "total_bytes": 7}
    assert not undocumented(mod, res)


def test_no_manifest_outside_check_mode_is_a_failure(fakes, tmp_path):
    msg = fail(mod, {**base(tmp_path), "manifest_path": str(tmp_path / "none.json")})["msg"]
    assert f"manifest_path '{tmp_path / 'none.json'}' missing: run llmfleet_model_manifest first" in msg
    assert fakes["run_node"].calls == []


@pytest.mark.parametrize(
    "error",
    [StageError("a.safetensors: sha256 mismatch"), LeaseTimeout("no reader slot"), OSError(28, "No space left")],
)
def test_staging_errors_are_failures_naming_node_and_revision(fakes, monkeypatch, tmp_path, error):
    monkeypatch.setattr(mod, "run_node", Recorder(raises=error))
    msg = fail(mod, base(tmp_path))["msg"]
    assert f"(node1): staging qwen@{REV} failed: {error}" in msg


def test_a_manifest_rewritten_since_the_manifest_task_is_refused(fakes, tmp_path):
    """The manifest task hands its digest over; a manifest file changed on the shared storage in between
    (a node can write there) is refused before anything is copied."""
    pinned = manifest_digest(MANIFEST)
    args = base(tmp_path, manifest_sha256=pinned)
    forged = {**MANIFEST, "files": [{**MANIFEST["files"][0], "sha256": "f" * 64}, MANIFEST["files"][1]]}
    (tmp_path / "m.json").write_text(json.dumps(forged))
    msg = fail(mod, args)["msg"]
    assert f"has digest {manifest_digest(forged)}, not the {pinned} that llmfleet_model_manifest checked" in msg
    assert fakes["run_node"].calls == []


BAD = [
    ({"keep": 0}, "llmfleet_model_stage: keep=0 is out of range (set by the role variable model_stage_keep): it must be >= 1"),
    ({"serve_port": 65536}, "serve_port=65536 is out of range (set by the role variable model_stage_peer_port): it must be between 0 and 65535"),
    ({"peer_dead_after": 0}, "peer_dead_after=0.0 is out of range: it must be >= 0.1"),
    ({"me": None}, "missing required arguments: me"),
    ({"deep_verify": "sometimes"}, "argument 'deep_verify' is of type str and we were unable to convert to bool"),
    ({"lock_wait": -1}, "lock_wait=-1.0 is out of range (set by the role variable model_stage_lock_wait): it must be >= 0"),
    ({"manifest_sha256": "main"}, "manifest_sha256='main' is not a sha256"),
]  # fmt: skip


@pytest.mark.parametrize(("over", "text"), BAD)
def test_bad_options_fail_naming_them(fakes, tmp_path, over, text):
    args = {k: v for k, v in base(tmp_path, **over).items() if v is not None}
    assert text in fail(mod, args)["msg"]
    assert fakes["run_node"].calls == [] and fakes["resolve_source"].calls == []


@pytest.mark.parametrize("error", [None, StageError("a.safetensors: sha256 mismatch")])
def test_detach_returns_a_job_whose_file_gets_the_modules_result(fakes, monkeypatch, tmp_path, error):

    if error:
        monkeypatch.setattr(mod, "run_node", Recorder(raises=error))
    monkeypatch.setenv("ANSIBLE_ASYNC_DIR", str(tmp_path / "async"))
    res = run(mod, base(tmp_path, detach=True, job_timeout=60))
    assert res["started"] is True and res["finished"] is False and res["changed"] is False
    assert not undocumented(mod, res)
    data = job_result(res["results_file"])  # what the module returns (or fails with) without detach
    want = {"failed": True, "changed": False, "msg": f"{__import__('socket').gethostname()} (node1): staging "
            f"qwen@{REV} failed: {error}"} if error else RESULT  # fmt: skip
    assert data == want


def test_check_mode_never_detaches(fakes, tmp_path):
    res = run(mod, base(tmp_path, detach=True), check=True)
    assert "ansible_job_id" not in res and res["state"] == "partial"


def test_peers_without_the_fabric_key_are_refused(fakes, tmp_path):
    msg = fail(mod, base(tmp_path, peers={"node1": "http://a:1", "node2": "http://b:1"}, serve_port=50080))["msg"]
    assert "peer_key_file is required when this node serves or has peers" in msg
    assert not fakes["run_node"].calls


def test_a_fabric_key_file_others_can_read_is_refused(fakes, tmp_path):
    path = key_file(tmp_path, 0o644)
    msg = fail(mod, base(tmp_path, peers={"node2": "http://b:1"}, peer_key_file=path))["msg"]
    assert f"fabric key {path}: owner uid" in msg and "mode 0644" in msg and "it must be owned by uid" in msg
    assert "k" * 48 not in msg
