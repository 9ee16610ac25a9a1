"""The manifest is trusted only as far as it deserves: compared with what the source itself says of
its files (hub-cache blob names, Git LFS pointers, sha256 lists), a cached copy on the shared-rw
area (which nodes can write) re-checked before use, and an operator's pin enforced."""

import hashlib
import json
import os
import shutil
import subprocess

import pytest

from llmfleet.stage import manifest as mf
from llmfleet.stage.errors import StageError
from tests.helpers.ckpt import make_checkpoint

SHARD = "model-00002-of-00003.safetensors"


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def git_blob_id(path):
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324


def hub_cache(tmp_path, rev):
    """A huggingface_hub cache repo: snapshots/<rev>/<file> -> ../../blobs/<id> (sha256 for the LFS
    shards, the git blob sha1 for the small files), as the hub library lays it out."""
    plain = make_checkpoint(tmp_path / "plain")
    repo = tmp_path / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    for f in sorted(plain.iterdir()):
        blob = sha256(f) if f.suffix == ".safetensors" else git_blob_id(f)
        shutil.copy(f, repo / "blobs" / blob)
        (snap / f.name).symlink_to(f"../../blobs/{blob}")
    return snap


def obtain(src, rev, cache, **kw):
    return mf.obtain_manifest(
        str(src), "m", rev, str(cache), build=lambda: mf.build_manifest(str(src), revision=rev), **kw
    )


def rewrite_cache(cache, rev, change):
    path = mf.manifest_cache_path(str(cache), "m", rev)
    with open(path) as f:
        m = json.load(f)
    change(m)
    with open(path, "w") as f:
        json.dump(m, f, indent=2)


REV = "c" * 40


def test_hub_blob_names_confirm_the_manifest(tmp_path):
    snap = hub_cache(tmp_path, REV)
    got = obtain(snap, REV, tmp_path / "rw")
    assert got["origin"] == "built"
    assert got["trust"] == {
        "upstream_checked": 7,
        "upstream_kinds": ["hub blob"],
        "rehashed": 4,
        "unverified": 0,
        "notes": [],
    }
    assert got["sha256"] == mf.manifest_digest(got["manifest"])
    again = obtain(snap, REV, tmp_path / "rw")  # from the cache: every check again, and small files re-hashed
    assert again["origin"] == "cache" and again["sha256"] == got["sha256"]
    assert again["trust"]["rehashed"] == 7  # (these test shards are small too)


def test_a_corrupt_blob_on_shared_storage_is_named(tmp_path):
    """Before: the manifest was built from the damaged bytes and "sha256 = LFS oid" was never checked, so
    every node got (and verified against) the damaged shard."""
    snap = hub_cache(tmp_path, REV)
    blob = os.path.realpath(snap / SHARD)
    data = bytearray(open(blob, "rb").read())
    data[-1] ^= 1
    with open(blob, "wb") as f:
        f.write(data)
    with pytest.raises(
        StageError,
        match=rf"{SHARD}: the manifest says sha256 [0-9a-f]{{12}}…, its hub-cache blob name [0-9a-f]{{12}}… says",
    ):
        obtain(snap, REV, tmp_path / "rw")
    assert not os.path.exists(mf.manifest_cache_path(str(tmp_path / "rw"), "m", REV))  # nothing cached


def test_a_rewritten_cached_manifest_is_refused(tmp_path):
    """A node can write the shared-rw area: a forged shard hash there would make every node accept a
    forged shard from that node. Before: a cached manifest was checked for sizes only."""
    snap = hub_cache(tmp_path, REV)
    obtain(snap, REV, tmp_path / "rw")
    rewrite_cache(
        tmp_path / "rw", REV, lambda m: next(e for e in m["files"] if e["path"] == SHARD).update(sha256="e" * 64)
    )
    with pytest.raises(
        StageError,
        match=rf"{SHARD}: the manifest says sha256 eeeeeeeeeeee…, its hub-cache blob name .*delete .*/manifests/m/{REV}.json",
    ):
        obtain(snap, REV, tmp_path / "rw")


def test_small_files_of_a_cached_manifest_are_rehashed(tmp_path):
    src = make_checkpoint(tmp_path / "plain")
    obtain(src, REV, tmp_path / "rw")
    rewrite_cache(
        tmp_path / "rw",
        REV,
        lambda m: next(e for e in m["files"] if e["path"] == "config.json").update(sha256="e" * 64),
    )
    with pytest.raises(StageError, match=r"config.json: the manifest says sha256 eeeeeeeeeeee…, the source file's is"):
        obtain(src, REV, tmp_path / "rw")


def test_a_plain_directory_says_what_is_unverified(tmp_path, monkeypatch):
    src = make_checkpoint(tmp_path / "plain")
    got = obtain(src, REV, tmp_path / "rw")
    assert got["trust"] == {"upstream_checked": 0, "upstream_kinds": [], "rehashed": 0, "unverified": 7, "notes": []}
    monkeypatch.setattr(mf, "SMALL_FILE", 1024)  # shards above it, as real ones are
    cached = obtain(src, REV, tmp_path / "rw")["trust"]
    assert (cached["rehashed"], cached["unverified"]) == (4, 3)  # only the pin vouches for the 3 shards


def test_a_source_rewritten_since_the_manifest_is_refused(tmp_path):
    """Same size, new bytes: the sizes check alone missed it."""
    src = make_checkpoint(tmp_path / "plain")
    obtain(src, REV, tmp_path / "rw")
    st = os.stat(src / SHARD)
    os.utime(src / SHARD, (st.st_atime, st.st_mtime + 10))
    with pytest.raises(StageError, match=rf"{SHARD} rewritten since the manifest .* was built \(mtime\)"):
        obtain(src, REV, tmp_path / "rw")


@pytest.mark.parametrize("kind", ["sidecar", "SHA256SUMS"])
def test_upstream_sha256_lists_are_compared(tmp_path, kind):
    src = make_checkpoint(tmp_path / "plain")
    good = sha256(src / SHARD)
    if kind == "sidecar":
        (src / f"{SHARD}.sha256").write_text(f"{'0' * 64}  {SHARD}\n")
        where = f"{SHARD}.sha256"
    else:
        (src / "SHA256SUMS").write_text(f"{sha256(src / 'config.json')}  config.json\n{'0' * 64} *{SHARD}\n")
        where = "SHA256SUMS"
    with pytest.raises(
        StageError, match=rf"{SHARD}: the manifest says sha256 {good[:12]}…, {where} says 000000000000…"
    ):
        obtain(src, REV, tmp_path / "rw")


def git(repo, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo), *args],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip


def lfs_checkout(tmp_path, oid_of=None):
    """A git clone of the hub repo with its LFS files pulled: HEAD holds the pointers, the work tree the bytes."""
    repo = make_checkpoint(tmp_path / "clone")
    git(repo, "init", "-q")
    real = {}
    for f in sorted(repo.glob("*.safetensors")):
        real[f.name] = f.read_bytes()
        oid = (oid_of or {}).get(f.name, sha256(f))
        f.write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {len(real[f.name])}\n")
    (repo / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "upload")
    for name, data in real.items():
        (repo / name).write_bytes(data)
    return repo, git(repo, "rev-parse", "HEAD")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git (not git-lfs)")
def test_git_lfs_pointers_confirm_the_manifest(tmp_path):
    repo, head = lfs_checkout(tmp_path)
    got = obtain(repo, head, tmp_path / "rw")
    assert got["trust"]["upstream_checked"] == 7
    assert got["trust"]["upstream_kinds"] == ["git blob", "git-lfs pointer"]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git (not git-lfs)")
def test_a_file_that_is_not_its_lfs_object_is_named(tmp_path):
    repo, head = lfs_checkout(tmp_path, oid_of={SHARD: "f" * 64})
    with pytest.raises(
        StageError,
        match=rf"{SHARD}: the manifest says sha256 [0-9a-f]{{12}}…, its git-lfs pointer in HEAD says ffffffffffff…",
    ):
        obtain(repo, head, tmp_path / "rw")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git (not git-lfs)")
def test_a_checkout_of_another_commit_is_refused(tmp_path):
    repo, head = lfs_checkout(tmp_path)
    with pytest.raises(StageError, match=rf"is a git checkout at {head}, not the pinned revision {REV}"):
        obtain(repo, REV, tmp_path / "rw")


def test_without_git_the_pointers_are_reported_unchecked(tmp_path, monkeypatch):
    src = make_checkpoint(tmp_path / "plain")
    (src / ".git").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    got = obtain(src, REV, tmp_path / "rw")
    assert got["trust"]["notes"] == [
        f"{src} is a git checkout but git is not installed here: its LFS pointers were not compared"
    ]


def test_the_pin_is_enforced_and_survives_reformatting(tmp_path):
    src = make_checkpoint(tmp_path / "plain")
    pin = obtain(src, REV, tmp_path / "rw")["sha256"]
    rewrite_cache(tmp_path / "rw", REV, lambda m: None)  # re-indented, same content
    assert obtain(src, REV, tmp_path / "rw", expected_sha256=pin)["sha256"] == pin
    with pytest.raises(StageError, match=rf"has digest {pin}, the pinned model_stage_manifest_sha256 is {'0' * 64}"):
        obtain(src, REV, tmp_path / "rw", expected_sha256="0" * 64)


def test_check_mode_reads_no_contents(tmp_path, monkeypatch):
    snap = hub_cache(tmp_path, REV)
    obtain(snap, REV, tmp_path / "rw")
    monkeypatch.setattr(mf, "_hash_both", lambda *a: pytest.fail("check mode read a file"))
    got = obtain(snap, REV, tmp_path / "rw", check_mode=True)
    assert got["origin"] == "cache" and got["trust"] is None
