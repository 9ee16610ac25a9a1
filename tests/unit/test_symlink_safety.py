"""Root-run writes into directories the engine user owns never follow a symlink that user planted.

These tests run as root (the project's test machines do) so that chown really happens: the "engine
user" is a scratch uid (65534), the "victim" is a root-owned directory outside the cache that must
come out of every test exactly as it went in (owner, mode, contents).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from llmfleet import safefs
from llmfleet.engine import node as engine_node
from llmfleet.safefs import UnsafePathError
from llmfleet.stage.errors import StageError
from llmfleet.stage.manifest import obtain_manifest
from llmfleet.stage.progress import Progress

ENGINE_UID = ENGINE_GID = 65534
FP, OLD1, OLD2 = "d" * 16, "a" * 16, "b" * 16

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: proves chown does not reach outside")


def snapshot(top: Path) -> dict[str, tuple]:
    """Owner, mode and content of everything under top (symlinks not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in [".", *dirnames, *filenames]:
            p = Path(dirpath) / name
            st = p.lstat()
            data = p.read_bytes() if stat.S_ISREG(st.st_mode) else None
            out[str(p)] = (st.st_uid, st.st_gid, st.st_mode, data)
    return out


@pytest.fixture
def victim(tmp_path):
    """A root-owned directory standing in for /etc."""
    v = tmp_path / "etc"
    v.mkdir(mode=0o755)
    (v / "shadow").write_text("root:*:1:0:99999:7:::\n")
    os.chmod(v / "shadow", 0o640)
    (v / "sub").mkdir()
    (v / "sub" / "keep").write_text("keep me\n")
    before = snapshot(v)
    yield v
    assert snapshot(v) == before, "something outside the cache directory changed"


def engine_owned(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, ENGINE_UID, ENGINE_GID)
    return path


def prepare(root, fp=FP, keep=2, check=False, in_use=frozenset()):
    return engine_node.prepare_cache(
        str(root), fp, keep, uid=ENGINE_UID, gid=ENGINE_GID, in_use=set(in_use), check=check
    )


# ---------------------------------------------------------------------------------------------
# engine_node.prepare_cache


def test_cache_dirs_are_created_and_chowned(tmp_path):
    root = tmp_path / "cache" / "demo"
    res = prepare(root)
    assert res["created"] and res["cache_dir"] == str(root / FP)
    for d in (root, root / FP):
        st = d.lstat()
        assert stat.S_ISDIR(st.st_mode) and (st.st_uid, st.st_gid) == (ENGINE_UID, ENGINE_GID)
    again = prepare(root)
    assert not again["created"] and not again["chowned"] and not again["removed"]


@pytest.mark.parametrize("check", [False, True])
def test_planted_fingerprint_symlink_is_refused(tmp_path, victim, check):
    """The reproduced attack: <root>/<fingerprint> -> /etc got /etc chowned to the engine user."""
    root = engine_owned(tmp_path / "cache" / "demo")
    (root / FP).symlink_to(victim)
    os.lchown(root / FP, ENGINE_UID, ENGINE_GID)
    with pytest.raises(UnsafePathError, match=rf"{FP} is a symlink to {victim}.*nothing was changed"):
        prepare(root, check=check)
    assert (root / FP).is_symlink()


def test_planted_file_instead_of_the_fingerprint_dir_is_refused(tmp_path):
    root = engine_owned(tmp_path / "cache" / "demo")
    (root / FP).write_text("x")
    with pytest.raises(UnsafePathError, match="not a directory"):
        prepare(root)


def test_deployment_dir_replaced_by_a_symlink_in_an_engine_owned_parent(tmp_path, victim):
    """engine_cache_root itself inside a directory the engine user owns: <cache>/<deployment> -> /etc."""
    cache = engine_owned(tmp_path / "cache")
    (cache / "demo").symlink_to(victim)
    os.lchown(cache / "demo", ENGINE_UID, ENGINE_GID)
    with pytest.raises(UnsafePathError, match="demo is a symlink"):
        prepare(cache / "demo")
    assert not (victim / FP).exists()


def test_symlink_made_by_root_in_a_root_only_directory_is_followed(tmp_path):
    """An administrator's symlink (root's, in a directory only root can change) is not an attack."""
    real = tmp_path / "nvme" / "cache"
    real.mkdir(parents=True)
    os.chmod(tmp_path, 0o755)
    (tmp_path / "cache").symlink_to(real)
    res = prepare(tmp_path / "cache" / "demo")
    assert res["created"] and (real / "demo" / FP).is_dir()


def test_gc_unlinks_a_planted_symlink_and_never_touches_its_target(tmp_path, victim):
    root = engine_owned(tmp_path / "cache" / "demo")
    (root / OLD1).symlink_to(victim)
    res = prepare(root, keep=5)
    assert res["removed"] == [str(root / OLD1)]
    assert not (root / OLD1).exists() and not (root / OLD1).is_symlink()


def test_gc_removes_an_old_cache_without_following_links_inside_it(tmp_path, victim):
    root = engine_owned(tmp_path / "cache" / "demo")
    engine_owned(root / OLD1 / "xdg")
    engine_owned(root / OLD2)
    (root / OLD1 / "triton").symlink_to(victim)
    (root / OLD1 / "xdg" / "shadow").symlink_to(victim / "shadow")
    (root / OLD1 / "xdg" / "f").write_text("cache")
    for i, name in enumerate((OLD1, OLD2)):
        os.utime(root / name, (1000 + i, 1000 + i))
    res = prepare(root, keep=2)
    # keep=2: the current one and the newest old one (b); a goes, with its links (not their targets).
    assert res["removed"] == [str(root / OLD1)]
    assert not (root / OLD1).exists() and (root / OLD2).is_dir()


def test_gc_check_mode_only_predicts(tmp_path, victim):
    root = engine_owned(tmp_path / "cache" / "demo")
    engine_owned(root / OLD1)
    os.utime(root / OLD1, (1000, 1000))
    (root / OLD2).symlink_to(victim)
    res = prepare(root, keep=1, check=True)
    assert res["created"] and sorted(res["removed"]) == [str(root / OLD1), str(root / OLD2)]
    assert (root / OLD1).is_dir() and (root / OLD2).is_symlink() and not (root / FP).exists()


def test_in_use_cache_is_kept(tmp_path):
    root = engine_owned(tmp_path / "cache" / "demo")
    engine_owned(root / OLD1)
    res = prepare(root, keep=1, in_use={str(root / OLD1)})
    assert res["removed"] == [] and (root / OLD1).is_dir()


def test_bad_fingerprint_is_refused(tmp_path):
    with pytest.raises(engine_node.PlanError):
        prepare(tmp_path, fp="../../etc")


# ---------------------------------------------------------------------------------------------
# safefs


def test_open_dir_refuses_a_user_symlink_on_the_way(tmp_path, victim):
    home = engine_owned(tmp_path / "var" / "lib" / "llmfleet")
    (home / "stage").symlink_to(victim)
    os.lchown(home / "stage", ENGINE_UID, ENGINE_GID)
    with pytest.raises(UnsafePathError, match="stage is a symlink"):
        safefs.write_json(str(home / "stage" / "x.progress.json"), {"a": 1}, create_dirs=True)


def test_open_dir_follows_relative_root_links_and_dotdot(tmp_path):
    os.chmod(tmp_path, 0o755)
    (tmp_path / "real" / "deep").mkdir(parents=True)
    (tmp_path / "link").symlink_to("real/deep")
    fd = safefs.open_dir(str(tmp_path / "link" / ".." / "deep"))
    try:
        assert os.path.samestat(os.fstat(fd), (tmp_path / "real" / "deep").stat())
    finally:
        os.close(fd)


def test_write_file_replaces_a_planted_symlink_instead_of_writing_through_it(tmp_path, victim):
    d = engine_owned(tmp_path / "state")
    (d / "p.json").symlink_to(victim / "shadow")
    (d / f".p.json.{os.getpid()}.tmp").symlink_to(victim / "shadow")  # the temporary name, guessed
    safefs.write_json(str(d / "p.json"), {"ok": True})
    assert not (d / "p.json").is_symlink() and json.loads((d / "p.json").read_text()) == {"ok": True}


def test_rmtree_at_unlinks_links_it_finds(tmp_path, victim):
    d = tmp_path / "gone"
    (d / "a" / "b").mkdir(parents=True)
    (d / "a" / "b" / "etc").symlink_to(victim)
    (d / "a" / "x").symlink_to(victim / "shadow")
    fd = safefs.open_dir(str(tmp_path))
    try:
        safefs.rmtree_at(fd, "gone")
        safefs.rmtree_at(fd, "gone")  # already gone: nothing to do
    finally:
        os.close(fd)
    assert not d.exists()


# ---------------------------------------------------------------------------------------------
# stage: progress file and manifest cache (root writes into /var/lib/llmfleet and shared storage)


def test_progress_file_never_writes_through_a_planted_link(tmp_path, victim):
    d = engine_owned(tmp_path / "stage")
    path = d / "m-rev.progress.json"
    path.symlink_to(victim / "shadow")
    (d / f".m-rev.progress.json.{os.getpid()}.tmp").symlink_to(victim / "shadow")
    p = Progress(total=10, path=str(path))
    p.flush(force=True)
    assert json.loads(path.read_text())["total_bytes"] == 10


def test_progress_dir_swapped_for_a_symlink_is_not_followed(tmp_path, victim):
    home = engine_owned(tmp_path / "llmfleet")
    (home / "stage").symlink_to(victim)
    os.lchown(home / "stage", ENGINE_UID, ENGINE_GID)
    p = Progress(total=10, path=str(home / "stage" / "m-rev.progress.json"))
    p.flush(force=True)  # refused (progress is best effort): nothing lands in the victim


def test_manifest_cache_on_shared_storage_never_writes_through_a_planted_link(tmp_path, victim):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    shared = tmp_path / "shared-rw"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # root_squash shared storage: everybody may write
    mdir = shared / "manifests" / "m"
    mdir.mkdir(parents=True)
    os.chown(shared / "manifests", ENGINE_UID, ENGINE_GID)
    os.chown(mdir, ENGINE_UID, ENGINE_GID)
    rev = "5" * 40
    (mdir / f"{rev}.json.{os.getpid()}.tmp").symlink_to(victim / "shadow")
    manifest = {"files": [{"path": "config.json", "size": 2, "sha256": "0" * 64}]}
    got = obtain_manifest(str(src), "m", rev, str(shared), build=lambda: dict(manifest))
    assert got["origin"] == "built"
    assert json.loads((mdir / f"{rev}.json").read_text())["revision"] == rev


def test_manifest_cache_dir_swapped_for_a_symlink_is_refused(tmp_path, victim):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    shared = tmp_path / "shared-rw"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (shared / "manifests").symlink_to(victim)
    os.lchown(shared / "manifests", ENGINE_UID, ENGINE_GID)
    manifest = {"files": [{"path": "config.json", "size": 2, "sha256": "0" * 64}]}
    with pytest.raises(StageError, match="manifests is a symlink"):
        obtain_manifest(str(src), "m", "5" * 40, str(shared), build=lambda: dict(manifest))


# ---------------------------------------------------------------------------------------------
# library/llmfleet_engine_cache.py: the refusal is a clean fail_json naming the link


def test_engine_cache_fails_naming_the_planted_link(module_exits, monkeypatch, tmp_path, victim):
    import llmfleet_engine_cache
    from tests.unit.module_utils import AnsibleFailJson, set_module_args

    monkeypatch.setattr(
        llmfleet_engine_cache, "engine_versions", lambda python, **_: {"versions": {"sglang": "0.5"}, "cuda": "12.8"}
    )
    monkeypatch.setattr(llmfleet_engine_cache, "gpu_facts", lambda: {"driver": "570", "compute_capability": "9.0"})
    model = tmp_path / "model"
    model.mkdir()
    cache = engine_owned(tmp_path / "cache")
    (cache / "demo").symlink_to(victim)
    os.lchown(cache / "demo", ENGINE_UID, ENGINE_GID)
    args = {"engine_python": "/usr/bin/python3", "engine": "sglang", "model_path": str(model), "tp": 1, "pp": 1,
            "cache_root": str(cache / "demo"), "owner": "nobody", "group": "nogroup"}  # fmt: skip
    with set_module_args(args), pytest.raises(AnsibleFailJson) as e:
        llmfleet_engine_cache.main()
    msg = e.value.args[0]["msg"]
    assert f"{cache / 'demo'} is a symlink to {victim}" in msg and "nothing was changed" in msg
