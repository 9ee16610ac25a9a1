"""Staging on one node (local shared-storage source): atomic publish, resume, idempotence,
disk space, ENOSPC, GC, deep verify, check mode, source layouts."""

import errno
import json
import os
import subprocess
import time

import pytest

from llmfleet.stage import checkpoint, store, transfer
from llmfleet.stage import staging as stage
from llmfleet.stage.manifest import build_manifest
from tests.helpers.ckpt import make_checkpoint

REV = "1" * 40
REV2 = "2" * 40
REV3 = "3" * 40


@pytest.fixture
def src(tmp_path):
    return make_checkpoint(tmp_path / "shared" / "m", shards=4, tensors_per_shard=3, shape=(64, 64))


def manifest_of(d):
    return build_manifest(str(d))


def run(root, src, rev=REV, manifest=None, **kw):
    req = stage.StageRequest(root=str(root), model="m", revision=rev, manifest=manifest or manifest_of(src), **kw)
    return stage.stage(req, lambda rel: [stage.LocalSource(str(src))])


def test_stage_publish_and_rerun(tmp_path, src):
    root = tmp_path / "nvme"
    r = run(root, src)
    total = sum(os.path.getsize(src / f) for f in os.listdir(src))
    assert r["changed"] and r["bytes_copied"] == r["total_bytes"] == total == r["source_bytes_read"]
    mdir = root / "m"
    assert os.readlink(mdir / "current") == REV
    assert sorted(os.listdir(mdir)) == [".records", REV, "current"]  # no partial left, nothing else
    assert checkpoint.verify(str(mdir / REV)).ok
    for f in os.listdir(mdir / REV):
        assert (mdir / REV / f).read_bytes() == (src / f).read_bytes()
        assert oct(os.stat(mdir / REV / f).st_mode & 0o777) == "0o444"
    assert oct(os.stat(mdir / REV).st_mode & 0o777) == "0o555"
    again = run(root, src)
    assert again["changed"] is False and again["bytes_copied"] == 0 and again["files_to_copy"] == 0


def test_check_mode_touches_nothing(tmp_path, src):
    root = tmp_path / "nvme"
    r = run(root, src, check_mode=True)
    assert r["changed"] and r["bytes_to_copy"] == r["total_bytes"] and r["bytes_copied"] == 0
    assert not root.exists()


def test_branch_names_are_refused(tmp_path, src):
    with pytest.raises(stage.StageError, match="not a 40-hex commit"):
        run(tmp_path / "nvme", src, rev="main")


class Flaky:
    """A source that fails for some files (a crash mid-run, seen from the copy's side)."""

    from_peer = False

    def __init__(self, inner, fail):
        self.inner, self.fail = inner, fail

    def open(self, rel):
        if rel in self.fail:
            raise OSError(errno.EIO, "simulated crash")
        return self.inner.open(rel)


def test_resume_keeps_verified_files(tmp_path, src):
    root = tmp_path / "nvme"
    m = manifest_of(src)
    shards = sorted(e["path"] for e in m["files"] if e["path"].endswith(".safetensors"))
    req = stage.StageRequest(root=str(root), model="m", revision=REV, manifest=m, threads=1)
    with pytest.raises(stage.StageError, match="simulated crash"):
        stage.stage(req, lambda rel: [Flaky(stage.LocalSource(str(src)), {shards[0]})])
    mdir = root / "m"
    assert not (mdir / REV).exists() and not (mdir / "current").exists()  # nothing published
    journal = store.read_journal(str(mdir / f".partial-{REV}"))
    assert shards[0] not in journal and shards[1] in journal
    plan = stage.plan(req)
    assert [e["path"] for e in plan["todo"]] == [shards[0]]
    r = stage.stage(req, lambda rel: [stage.LocalSource(str(src))])
    assert r["bytes_copied"] == os.path.getsize(src / shards[0])
    assert checkpoint.verify(str(mdir / REV)).ok


def test_a_file_changed_after_journaling_is_recopied(tmp_path, src):
    root = tmp_path / "nvme"
    m = manifest_of(src)
    req = stage.StageRequest(root=str(root), model="m", revision=REV, manifest=m, threads=1)
    with pytest.raises(stage.StageError):
        stage.stage(req, lambda rel: [Flaky(stage.LocalSource(str(src)), {"config.json"})])
    partial = root / "m" / f".partial-{REV}"
    victim = sorted(p for p in os.listdir(partial) if p.endswith(".safetensors"))[0]
    with open(partial / victim, "r+b") as f:  # a torn write after a reboot: same size, new mtime
        f.seek(100)
        f.write(b"\xff")
    os.utime(partial / victim, ns=(time.time_ns(), time.time_ns() + 10**9))
    r = stage.stage(req, lambda rel: [stage.LocalSource(str(src))])
    assert r["bytes_copied"] == os.path.getsize(src / victim) + os.path.getsize(src / "config.json")
    assert checkpoint.verify(str(root / "m" / REV), None).ok
    assert (root / "m" / REV / victim).read_bytes() == (src / victim).read_bytes()


def test_source_damage_blocks_publish_and_keeps_current(tmp_path, src):
    root = tmp_path / "nvme"
    run(root, src)  # REV is current
    m = manifest_of(src)
    shard = sorted(p for p in os.listdir(src) if p.endswith(".safetensors"))[1]
    data = bytearray((src / shard).read_bytes())
    data[-1] ^= 1
    (src / shard).write_bytes(bytes(data))
    with pytest.raises(stage.StageError, match=f"{shard}: sha256 .* does not match the manifest"):
        run(root, src, rev=REV2, manifest=m)
    assert os.readlink(root / "m" / "current") == REV
    assert not (root / "m" / REV2).exists()


def test_structure_problem_blocks_publish(tmp_path, src):
    os.remove(src / "tokenizer.json")
    with pytest.raises(stage.StageError, match="missing_tokenizer"):
        run(tmp_path / "nvme", src)
    assert not (tmp_path / "nvme" / "m" / REV).exists()


def test_disk_space_is_checked_before_copying(tmp_path, src):
    with pytest.raises(
        stage.StageError,
        match=rf"GiB free, staging needs 0.00 GiB \(8 file\(s\) of {REV[:12]} still missing\) \+ .* GiB margin",
    ):
        run(tmp_path / "nvme", src, margin_bytes=10**18)
    assert store.read_journal(str(tmp_path / "nvme" / "m" / f".partial-{REV}")) == {}


def test_enospc_mid_copy_keeps_previous_revision(tmp_path, src, monkeypatch):
    root = tmp_path / "nvme"
    run(root, src)
    real_write = os.write
    budget = {"n": 40_000}  # the revision is ~100 kB

    def write(fd, data):
        if budget["n"] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        budget["n"] -= len(data)
        return real_write(fd, data)

    real_copy = os.copy_file_range

    def copy_file_range(src, dst, count, *args):  # the local copy's path (transfer._copy_in_kernel)
        if budget["n"] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real_copy(src, dst, count, *args)
        budget["n"] -= n
        return n

    real_pwrite = os.pwrite

    def pwrite(fd, data, offset):  # the direct-I/O path (transfer._copy_direct; the model lock's pwrite goes on)
        if not os.readlink(f"/proc/self/fd/{fd}").endswith(".llmfleet-part"):
            return real_pwrite(fd, data, offset)
        if budget["n"] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        budget["n"] -= len(data)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(transfer.os, "write", write)
    monkeypatch.setattr(transfer.os, "pwrite", pwrite)
    monkeypatch.setattr(transfer.os, "copy_file_range", copy_file_range)
    src2 = make_checkpoint(tmp_path / "shared" / "m2", shards=4, tensors_per_shard=3, shape=(64, 64), seed=7)
    with pytest.raises(
        stage.StageError,
        match=r"disk full while copying .* nothing published changed \(published revisions and `current` are as before\)",
    ):
        run(root, src2, rev=REV2, manifest=manifest_of(src2))
    monkeypatch.undo()
    mdir = root / "m"
    assert os.readlink(mdir / "current") == REV and checkpoint.verify(str(mdir / REV)).ok
    assert not (mdir / REV2).exists()
    leftovers = [p for p in os.listdir(mdir / f".partial-{REV2}") if p.endswith(".llmfleet-part")]
    assert leftovers == []  # the failed file's partial bytes were freed


def test_deep_verify_repairs_a_damaged_published_file(tmp_path, src):
    root = tmp_path / "nvme"
    run(root, src)
    rdir = root / "m" / REV
    victim = sorted(p for p in os.listdir(rdir) if p.endswith(".safetensors"))[2]
    st = os.stat(rdir / victim)
    os.chmod(rdir, 0o755)
    os.chmod(rdir / victim, 0o644)
    with open(rdir / victim, "r+b") as f:  # bit rot: same size, mtime restored
        f.seek(st.st_size - 3)
        f.write(b"\x00\x01\x02")
    os.utime(rdir / victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert run(root, src)["bytes_copied"] == 0  # the cheap check cannot see it
    r = run(root, src, deep_verify=True)
    assert r["changed"] and r["bytes_copied"] == st.st_size
    assert (rdir / victim).read_bytes() == (src / victim).read_bytes()
    assert os.readlink(root / "m" / "current") == REV


def test_gc_keeps_newest_current_and_in_use(tmp_path):
    root = tmp_path / "nvme"
    srcs = {}
    for i, rev in enumerate((REV, REV2, REV3)):
        srcs[rev] = make_checkpoint(tmp_path / "shared" / rev[:4], shards=1, seed=i)
        run(root, srcs[rev], rev=rev, keep=10, activate=(rev != REV3))
        time.sleep(0.01)
    mdir = root / "m"
    assert os.readlink(mdir / "current") == REV2
    # a process holds a file of REV open: it is in use
    holder = subprocess.Popen(["sleep", "30"], stdin=open(mdir / REV / "config.json"))
    try:
        res = store.gc(str(mdir), keep=1)
    finally:
        holder.kill()
        holder.wait()
    assert (res["removed"], res["kept_in_use"]) == ([], [REV])  # REV3 newest, REV2 current, REV in use
    assert res["kept"] == {REV: f"in use by pid {holder.pid} (sleep)", REV2: "current", REV3: "one of the newest 1"}
    res = store.gc(str(mdir), keep=1)
    assert (res["removed"], res["kept_in_use"]) == ([REV], [])
    assert sorted(p for p in os.listdir(mdir) if not p.startswith(".")) == [REV2, REV3, "current"]
    assert not os.path.exists(store.record_path(str(mdir), REV))


def test_resolve_source_layouts(tmp_path, src):
    hub = tmp_path / "models--org--m"
    (hub / "snapshots" / REV).mkdir(parents=True)
    assert stage.resolve_source(str(hub), REV) == str(hub / "snapshots" / REV)
    with pytest.raises(stage.StageError, match=f"no snapshot {REV2} .*snapshots: {REV}"):
        stage.resolve_source(str(hub), REV2)
    with pytest.raises(stage.StageError, match=f"is snapshot {REV}, not the requested revision {REV2}"):
        stage.resolve_source(str(hub / "snapshots" / REV), REV2)
    assert stage.resolve_source(str(src), REV) == str(src)
    with pytest.raises(stage.StageError, match="not a directory on this node"):
        stage.resolve_source(str(tmp_path / "nope"), REV)


def test_assign_files_balances_bytes():
    files = [{"path": f"f{i}", "size": s} for i, s in enumerate([100, 90, 50, 40, 10, 10])]
    a = stage.assign_files(files, ["n1", "n2"])
    load = {h: sum(f["size"] for f in files if a[f["path"]] == h) for h in ("n1", "n2")}
    assert set(a) == {f["path"] for f in files} and load == {"n1": 150, "n2": 150}
    assert stage.assign_files(files, []) == {}


def test_progress_file_is_written(tmp_path, src):
    prog = tmp_path / "progress.json"
    run(tmp_path / "nvme", src, progress_path=str(prog))
    p = json.loads(prog.read_text())
    assert p["phase"] == "published" and p["done_bytes"] == p["total_bytes"] > 0


# ---- the progress line and the module layout ---------------------------------------------------


SNAPSHOT = {"phase": "copying", "total_bytes": 4 * 2**30, "done_bytes": 2**30, "rate_bytes_per_s": 2**29,
            "source_bytes_read": 2**30, "peer_bytes_read": 0}  # fmt: skip


def test_progress_line_for_the_cli_and_for_the_playbook():
    from llmfleet.stage.progress import progress_line

    assert progress_line(SNAPSHOT) == "[#######.......................]  25.0% 1.00/4.00 GiB 512 MiB/s copying"
    assert progress_line(SNAPSHOT, "node1") == (
        "node1: copying 1.00/4.00 GiB (25%) at 512 MiB/s; from shared storage 1.00 GiB, from peers 0.00 GiB"
    )
    assert progress_line({}) == "[##############################] 100.0% 0.00/0.00 GiB 0 MiB/s "
    assert progress_line({}, "node1") == (
        "node1: ? 0.00/0.00 GiB (100%) at 0 MiB/s; from shared storage 0.00 GiB, from peers 0.00 GiB"
    )


STAGING = ("stage_errors", "stage_progress", "manifest", "checkpoint", "store", "transfer", "stage")


def _imports(name):
    import ast
    from pathlib import Path

    import llmfleet

    tree = ast.parse((Path(llmfleet.__file__).parent / "stage" / f"{name}.py").read_text(), feature_version=(3, 8))
    out = set()
    for node in ast.walk(tree):  # siblings in stage/ by name, the core's modules as "..name"
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            out.update("." * (node.level - 1) + n for n in names)
    return out


def test_staging_modules_are_layered():
    """Each staging module imports only the ones below it (errors, progress < manifest < checkpoint <
    store < transfer < staging): the store never copies, transfer never decides the flow."""
    assert _imports("errors") == set()
    assert _imports("progress") == {".safefs"}
    # .facts: the one revision pattern and deployment rule of the fleet contract (stdlib, imports nothing).
    assert _imports("manifest") == {".facts", ".safefs", "errors"}
    assert _imports("checkpoint") == {"manifest"}
    assert _imports("store") == {"checkpoint", ".facts", "manifest", ".safefs", "errors"}
    assert _imports("transfer") == {".fabric_key", "manifest", ".safefs", "errors", "progress", "store"}
    assert _imports("staging") <= {".facts", "manifest", "errors", "progress", "store", "transfer"}


def test_the_names_stage_exports_are_the_same_objects():
    from llmfleet.stage import errors as stage_errors

    assert stage.StageError is stage_errors.StageError and stage.DiskFullError is stage_errors.DiskFullError
    assert stage.LocalSource is transfer.LocalSource and stage.PeerSource is transfer.PeerSource
    assert set(stage.__all__) <= set(dir(stage))


@pytest.mark.parametrize("kernel", ["direct I/O", "copy_file_range", "no copy_file_range (EXDEV)"])
def test_a_local_copy_is_hashed_from_what_landed_with_or_without_the_kernel_copy(tmp_path, src, monkeypatch, kernel):
    """The local copy reads the source into one buffer with direct I/O, hashes it and writes that buffer
    with direct I/O; where a filesystem refuses direct I/O it goes through copy_file_range and hashes
    the destination's own pages; where the kernel cannot copy (another filesystem, an old kernel) it
    reads and writes. Each way a source byte that differs from the manifest is caught, and a good
    revision publishes (the shards' sizes are not multiples of the 4 KiB direct-I/O block)."""
    calls = []
    real_copy, real_pwrite = os.copy_file_range, os.pwrite

    def copy_file_range(*args):
        calls.append(args[2])
        if kernel != "copy_file_range":
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_copy(*args)

    def pwrite(fd, data, offset):
        calls.append(len(data))
        return real_pwrite(fd, data, offset)

    if kernel == "direct I/O":  # as for a run larger than the kernel's dirty limit
        monkeypatch.setattr(transfer, "direct_io_pays", lambda need: True)
        monkeypatch.setattr(transfer.os, "pwrite", pwrite)
    else:  # a filesystem without direct I/O (tmpfs)
        monkeypatch.setattr(transfer, "_set_direct", lambda fd, on: False)
        monkeypatch.setattr(transfer.os, "copy_file_range", copy_file_range)
    man = manifest_of(src)
    shard = sorted(p for p in os.listdir(src) if p.endswith(".safetensors"))[0]
    with open(src / shard, "r+b") as f:  # same size, one byte changed after the manifest
        f.seek(os.path.getsize(src / shard) - 1)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(stage.StageError, match=f"{shard}: sha256 .* does not match the manifest"):
        run(tmp_path / "nvme", src, manifest=man)
    with open(src / shard, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(last)
    r = run(tmp_path / "nvme", src, manifest=man)
    published = tmp_path / "nvme" / "m" / REV
    assert r["changed"] and calls and checkpoint.verify(str(published)).ok
    assert all((published / e["path"]).read_bytes() == (src / e["path"]).read_bytes() for e in man["files"])


@pytest.mark.parametrize(
    ("need_gib", "avail_gib", "ratio", "direct"),
    [(8, 22, 20, True), (2, 22, 20, False), (8, 125, 20, False), (40, 125, 20, True), (8, 22, None, False)],
)
def test_direct_io_only_above_the_kernels_dirty_limit(tmp_path, need_gib, avail_gib, ratio, direct):
    """The measured cases (8 GiB on 24 GiB: direct; 2 GiB there and 8 GiB on 125 GiB: the page cache),
    and no direct I/O where the kernel's figures cannot be read."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: 1 kB\nMemAvailable: {avail_gib * 2**20} kB\n")
    dirty = tmp_path / "dirty_ratio"
    if ratio is not None:
        dirty.write_text(f"{ratio}\n")
    assert transfer.direct_io_pays(need_gib * 2**30, str(meminfo), str(dirty)) is direct
