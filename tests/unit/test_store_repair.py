"""Repairing a damaged published revision never takes the model away, and a failed publish keeps
its resume journal: what a node serves stays intact until a verified replacement is in place."""

import errno
import json
import os

import pytest

from llmfleet.stage import checkpoint, store
from llmfleet.stage import staging as stage
from llmfleet.stage.manifest import build_manifest
from tests.helpers.ckpt import make_checkpoint

REV = "1" * 40


@pytest.fixture
def src(tmp_path):
    return make_checkpoint(tmp_path / "shared" / "m", shards=4, tensors_per_shard=3, shape=(64, 64))


class Flaky:
    """Shared storage that fails for some files (the mount went away mid-repair)."""

    from_peer = False

    def __init__(self, directory, fail):
        self.inner, self.fail = stage.LocalSource(str(directory)), set(fail)

    def open(self, rel):
        if rel in self.fail:
            raise OSError(errno.EIO, "Input/output error")
        return self.inner.open(rel)


def request(root, src, **kw):
    return stage.StageRequest(root=str(root), model="m", revision=REV, manifest=build_manifest(str(src)), **kw)


def published(root, src):
    """Stage REV and damage one shard by bit rot (same size, mtime restored: only deep_verify sees it)."""
    stage.stage(request(root, src), lambda rel: [stage.LocalSource(str(src))])
    rdir = root / "m" / REV
    victim = sorted(p for p in os.listdir(rdir) if p.endswith(".safetensors"))[2]
    st = os.stat(rdir / victim)
    os.chmod(rdir, 0o755)
    os.chmod(rdir / victim, 0o644)
    with open(rdir / victim, "r+b") as f:
        f.seek(st.st_size - 3)
        f.write(b"\x00\x01\x02")
    os.chmod(rdir / victim, 0o444)
    os.chmod(rdir, 0o555)
    os.utime(rdir / victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    return rdir, victim


def verified(rdir, src):
    """The structure and every file's sha256 against the source's manifest."""
    path = rdir.parent.parent / "manifest.json"
    path.write_text(json.dumps(build_manifest(str(src))))
    report = checkpoint.verify(str(rdir), str(path))
    return report.ok and not report.problems


def snapshot(rdir):
    return {p: (rdir / p).read_bytes() for p in sorted(os.listdir(rdir))}


def test_a_failed_repair_leaves_the_published_revision_and_current(tmp_path, src):
    """Before: the repair unlinked `current` and renamed the revision to .partial-*; a source failure then
    left the node with no model at all."""
    root = tmp_path / "nvme"
    rdir, victim = published(root, src)
    before = snapshot(rdir)
    with pytest.raises(stage.StageError, match=f"{victim}: cannot copy"):
        stage.stage(request(root, src, deep_verify=True), lambda rel: [Flaky(src, {victim})])
    assert os.readlink(root / "m" / "current") == REV
    assert snapshot(rdir) == before  # as it was (damage included): nothing removed, nothing half-written
    assert oct(os.stat(rdir).st_mode & 0o777) == "0o555"
    assert checkpoint.verify_structure(str(rdir)).ok
    # the repair so far is kept beside it: a rerun fetches only the damaged file
    r = stage.stage(request(root, src, deep_verify=True), lambda rel: [stage.LocalSource(str(src))])
    assert r["changed"] and r["state_before"] == "damaged" and r["bytes_copied"] == os.path.getsize(src / victim)
    assert (rdir / victim).read_bytes() == (src / victim).read_bytes()


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_repair_swaps_in_a_verified_copy_linking_the_intact_files(tmp_path, src, monkeypatch, exchange):
    root = tmp_path / "nvme"
    rdir, victim = published(root, src)
    if not exchange:
        monkeypatch.setattr(store, "_exchange", lambda *a: False)
    intact = sorted(p for p in os.listdir(rdir) if p != victim)
    inodes = {p: os.stat(rdir / p).st_ino for p in intact}
    published_at = store.read_record(str(root / "m"), REV)["published_at"]
    r = stage.stage(request(root, src, deep_verify=True), lambda rel: [stage.LocalSource(str(src))])
    assert r["changed"] and r["bytes_copied"] == r["bytes_to_copy"] == os.path.getsize(src / victim)
    assert r["source_bytes_read"] == os.path.getsize(src / victim)  # intact files were not re-read
    assert {p: os.stat(rdir / p).st_ino for p in intact} == inodes  # hard-linked, not copied
    assert all(oct(os.stat(rdir / p).st_mode & 0o777) == "0o444" for p in os.listdir(rdir))
    assert oct(os.stat(rdir).st_mode & 0o777) == "0o555"
    assert verified(rdir, src)
    assert os.readlink(root / "m" / "current") == REV
    assert sorted(os.listdir(root / "m")) == [".records", REV, "current"]  # no partial, no old copy, no lock
    assert store.read_record(str(root / "m"), REV)["published_at"] == published_at  # GC's order is unchanged
    again = stage.stage(request(root, src, deep_verify=True), lambda rel: [stage.LocalSource(str(src))])
    assert again["changed"] is False and again["bytes_copied"] == 0


def test_a_failed_swap_puts_the_published_revision_back(tmp_path, src, monkeypatch):
    root = tmp_path / "nvme"
    rdir, victim = published(root, src)
    before = snapshot(rdir)
    monkeypatch.setattr(store, "_exchange", lambda *a: False)
    real_rename = os.rename

    def rename(a, b, **kw):
        if str(a).endswith(f".partial-{REV}"):
            raise OSError(errno.EIO, "Input/output error")
        return real_rename(a, b, **kw)

    monkeypatch.setattr(store.os, "rename", rename)
    with pytest.raises(OSError, match="Input/output error"):
        stage.stage(request(root, src, deep_verify=True), lambda rel: [stage.LocalSource(str(src))])
    monkeypatch.undo()
    assert snapshot(rdir) == before and os.readlink(root / "m" / "current") == REV
    r = stage.stage(request(root, src, deep_verify=True), lambda rel: [stage.LocalSource(str(src))])
    assert r["bytes_copied"] == 0  # the verified repair was kept: only the swap was left to do
    assert (rdir / victim).read_bytes() == (src / victim).read_bytes()


def test_a_crash_right_after_the_exchange_is_cleaned_up(tmp_path, src, monkeypatch):
    root = tmp_path / "nvme"
    rdir, victim = published(root, src)
    real_rename = os.rename

    def rename(a, b, **kw):
        if f"{store.OLD}{REV}" in str(b):
            raise KeyboardInterrupt  # killed between the swap and moving the damaged copy aside
        return real_rename(a, b, **kw)

    monkeypatch.setattr(store.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        stage.stage(request(root, src, deep_verify=True), lambda rel: [stage.LocalSource(str(src))])
    monkeypatch.undo()
    assert (rdir / victim).read_bytes() == (src / victim).read_bytes()  # the repair is in place
    assert (root / "m" / f".partial-{REV}").is_dir()  # the damaged copy, under the partial name
    r = stage.stage(request(root, src, deep_verify=True), lambda rel: [stage.LocalSource(str(src))])
    assert r["bytes_copied"] == 0 and r["gc"]["removed_partials"] == [f".partial-{REV}"]
    assert sorted(os.listdir(root / "m")) == [".records", REV, "current"]


def test_repair_without_hard_links_copies_the_intact_files_from_the_node(tmp_path, src, monkeypatch):
    root = tmp_path / "nvme"
    rdir, victim = published(root, src)

    def no_links(*a, **kw):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(store.os, "link", no_links)
    total = sum(os.path.getsize(src / p) for p in os.listdir(src))
    r = stage.stage(request(root, src, deep_verify=True), lambda rel: [stage.LocalSource(str(src))])
    assert r["bytes_copied"] == r["bytes_to_copy"] == total
    assert r["source_bytes_read"] == os.path.getsize(src / victim)  # the rest came from the node itself
    assert r["peer_bytes_read"] == 0
    assert verified(rdir, src)


def test_repair_disk_check_says_what_the_repair_needs(tmp_path, src):
    """Before: "staging needs N GiB (remaining files)" after the revision had already been taken apart."""
    root = tmp_path / "nvme"
    rdir, victim = published(root, src)
    size = os.path.getsize(src / victim)
    with pytest.raises(stage.StageError) as e:
        stage.stage(request(root, src, deep_verify=True, margin_bytes=10**18), lambda rel: [])
    msg = str(e.value)
    assert (
        f"GiB free, staging needs {size / 2**30:.2f} GiB (repairing {REV[:12]}: 1 damaged file(s) to re-fetch) + "
        in msg
    )
    assert f"Nothing was copied; {root / 'm'} holds {REV[:12]} (" in msg and ", current)" in msg
    assert "lower model_stage_keep" not in msg  # GC runs only after a publish: that would free nothing
    assert os.readlink(root / "m" / "current") == REV and checkpoint.verify_structure(str(rdir)).ok


def test_disk_full_during_a_repair_is_reported_truly(tmp_path, src, monkeypatch):
    from llmfleet.stage import transfer

    root = tmp_path / "nvme"
    rdir, _victim = published(root, src)
    before = snapshot(rdir)

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transfer.os, "write", full)
    monkeypatch.setattr(transfer.os, "copy_file_range", lambda *a: full(*a[:2]))
    real_pwrite = os.pwrite

    def pwrite(fd, data, offset):  # the copy's direct-I/O writes (the model lock's pwrite goes on)
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".llmfleet-part"):
            full(fd, data)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(transfer.os, "pwrite", pwrite)
    with pytest.raises(stage.DiskFullError, match=r"nothing published changed \(published revisions and `current`"):
        stage.stage(request(root, src, deep_verify=True), lambda rel: [stage.LocalSource(str(src))])
    assert snapshot(rdir) == before and os.readlink(root / "m" / "current") == REV


def test_a_failed_publish_keeps_its_journal(tmp_path, src, monkeypatch):
    """ENOSPC while writing the publish record. Before: the journal was deleted first, so the rerun
    copied everything again (and the partial dir had been made read-only)."""
    root = tmp_path / "nvme"
    real_dump = json.dump

    def dump(obj, f, **kw):
        if isinstance(obj, dict) and "published_at" in obj:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_dump(obj, f, **kw)

    monkeypatch.setattr(store.json, "dump", dump)
    req = request(root, src)
    with pytest.raises(
        stage.DiskFullError, match=r"writing the publish record .*: disk full; all 8 files .* are verified"
    ):
        stage.stage(req, lambda rel: [stage.LocalSource(str(src))])
    monkeypatch.undo()
    partial = root / "m" / f".partial-{REV}"
    assert len(store.read_journal(str(partial))) == 8
    assert not (root / "m" / REV).exists() and not (root / "m" / "current").exists()
    assert not os.path.exists(store.record_path(str(root / "m"), REV) + ".tmp")
    r = stage.stage(req, lambda rel: [stage.LocalSource(str(src))])
    assert r["changed"] and r["bytes_copied"] == 0 and r["state_before"] == "partial"
    assert verified(root / "m" / REV, src)
    assert not (root / "m" / REV / store.JOURNAL).exists()


def test_a_crash_after_the_rename_leaves_nothing_a_rerun_cannot_finish(tmp_path, src, monkeypatch):
    root = tmp_path / "nvme"
    monkeypatch.setattr(store, "finish_published", lambda rdir: None)  # killed right after the rename
    stage.stage(request(root, src), lambda rel: [stage.LocalSource(str(src))])
    monkeypatch.undo()
    rdir = root / "m" / REV
    assert (rdir / store.JOURNAL).exists()
    r = stage.stage(request(root, src), lambda rel: [stage.LocalSource(str(src))])
    assert r["bytes_copied"] == 0 and not (rdir / store.JOURNAL).exists()
    assert oct(os.stat(rdir).st_mode & 0o777) == "0o555"
