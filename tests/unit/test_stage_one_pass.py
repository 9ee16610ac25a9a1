"""Staging without a manifest builds it from the copy itself (one read of the source): each file's
sha256 is what landed, taken only when the source file did not change under its copy; a kill -9
resumes from the verified files; the result is checked against the source's own digests before
publish. And the durability order of every copy: the data is synced before the file is renamed and
journaled, every file journaled before the revision is published."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmfleet import cli
from llmfleet.stage import checkpoint, manifest, store, transfer
from llmfleet.stage import staging as stage
from llmfleet.stage.manifest import build_manifest, manifest_digest
from tests.helpers.ckpt import make_checkpoint

REV = "1" * 40
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def src(tmp_path):
    return make_checkpoint(tmp_path / "shared" / "m", shards=4, tensors_per_shard=3, shape=(64, 64))


def request(root, src, **kw):
    return stage.StageRequest(
        root=str(root), model="m", revision=REV, manifest=stage.sizes_manifest(str(src), REV), build_from=str(src), **kw
    )


def run(root, src, **kw):
    return stage.stage(request(root, src, **kw), lambda rel: [transfer.LocalSource(str(src))])


def shas(files):
    return {e["path"]: (e["size"], e["sha256"]) for e in files}


def published_manifest(root):
    return json.loads((root / "m" / ".records" / f"{REV}.json").read_text())["manifest"]


def test_the_cli_without_a_manifest_reads_each_source_file_once_and_publishes_its_manifest(tmp_path, src, monkeypatch):
    opened = []
    real = manifest.open_source_file

    def counting(directory, rel, bounds):
        opened.append(rel)
        return real(directory, rel, bounds)

    monkeypatch.setattr(manifest, "open_source_file", counting)  # the manifest build's opens
    monkeypatch.setattr(transfer, "open_source_file", counting)  # the copy's
    root = tmp_path / "nvme"
    rc = cli.main(["stage", str(src), "--model", "m", "--revision", REV, "--root", str(root)])
    assert rc == 0
    names = sorted(os.listdir(src))
    assert sorted(opened) == names  # each file read once: by its copy (the build used to read it first)
    monkeypatch.undo()
    built = published_manifest(root)
    assert shas(built["files"]) == shas(build_manifest(str(src))["files"])
    assert built["revision"] == REV and built["total_bytes"] == sum(os.path.getsize(src / n) for n in names)
    (tmp_path / "built.json").write_text(json.dumps(built))
    assert checkpoint.verify(str(root / "m" / REV), str(tmp_path / "built.json")).ok
    assert os.readlink(root / "m" / "current") == REV


def test_the_result_names_the_digest_of_the_manifest_it_built(tmp_path, src):
    r = run(tmp_path / "nvme", src)
    assert r["manifest_sha256"] == manifest_digest({**build_manifest(str(src)), "revision": REV})
    assert r["source_bytes_read"] == r["total_bytes"]


def test_a_source_file_rewritten_under_its_copy_is_refused(tmp_path, src, monkeypatch):
    """Same size, mtime set back: only the ctime tells (the kernel sets it, nobody can set it back)."""
    shard = sorted(p for p in os.listdir(src) if p.endswith(".safetensors"))[1]
    real = transfer.copy_stream

    def rewriting(s, fd, want, *a, **k):
        if want["path"] == shard:
            path = src / shard
            st = os.stat(path)
            with open(path, "r+b") as f:
                f.seek(200)
                f.write(b"\x7f" * 8)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        return real(s, fd, want, *a, **k)

    monkeypatch.setattr(transfer, "copy_stream", rewriting)
    root = tmp_path / "nvme"
    with pytest.raises(stage.StageError, match=f"{shard}: the source file .* changed while it was copied"):
        run(root, src, threads=1)
    partial = root / "m" / f".partial-{REV}"
    assert not (root / "m" / REV).exists() and not (root / "m" / "current").exists()
    assert shard not in store.read_journal(str(partial))
    assert not list(partial.glob("*.llmfleet-part"))


def test_a_kill_mid_file_resumes_from_the_verified_files(tmp_path, src):
    """A real SIGKILL in the middle of the second shard's copy (small chunks, one thread)."""
    root = tmp_path / "nvme"
    killer = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from llmfleet.stage import staging as stage, transfer
        transfer.CHUNK = transfer.FAST_CHUNK = 4096  # whichever way the copy goes, 4 KiB at a time
        first = -(-max(os.path.getsize(os.path.join({str(src)!r}, f)) for f in os.listdir({str(src)!r})) // 4096)
        real, calls = transfer.RateLimit.take, []
        def dying(self, n):
            real(self, n)
            calls.append(n)
            if len(calls) == first + 3:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-file: three chunks of the second file written
        transfer.RateLimit.take = dying
        req = stage.StageRequest(root={str(root)!r}, model="m", revision={REV!r}, threads=1,
                                 manifest=stage.sizes_manifest({str(src)!r}, {REV!r}), build_from={str(src)!r})
        stage.stage(req, lambda rel: [transfer.LocalSource({str(src)!r})])
    """)
    p = subprocess.run([sys.executable, "-c", killer], capture_output=True, text=True, check=False, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    partial = root / "m" / f".partial-{REV}"
    journal = store.read_journal(str(partial))
    assert len(journal) == 1 and list(partial.glob("*.llmfleet-part"))  # one file verified, one cut short
    (done,) = journal
    assert journal[done]["source"] == list(transfer.source_identity(os.stat(src / done)))
    r = run(root, src)
    assert r["bytes_copied"] == r["total_bytes"] - os.path.getsize(src / done)
    assert shas(published_manifest(root)["files"]) == shas(build_manifest(str(src))["files"])
    assert checkpoint.verify(str(root / "m" / REV)).ok and not (root / "m" / f".partial-{REV}").exists()


class Failing:
    """A source whose open of the given files fails (a run that stops part way)."""

    from_peer = False

    def __init__(self, inner, fail):
        self.inner, self.fail = inner, fail

    def open(self, rel):
        if rel in self.fail:
            raise OSError(5, "simulated failure")
        return self.inner.open(rel)


def test_a_journaled_file_whose_source_changed_since_is_copied_again(tmp_path, src):
    root = tmp_path / "nvme"
    with pytest.raises(stage.StageError, match="simulated failure"):
        stage.stage(
            request(root, src, threads=1), lambda rel: [Failing(transfer.LocalSource(str(src)), {"config.json"})]
        )
    journal = store.read_journal(str(root / "m" / f".partial-{REV}"))
    shard = sorted(p for p in journal if p.endswith(".safetensors"))[0]
    data = bytearray((src / shard).read_bytes())
    data[-1] ^= 1  # the same size: a rewrite the size check alone would miss
    (src / shard).write_bytes(bytes(data))
    r = run(root, src)
    assert r["bytes_copied"] == os.path.getsize(src / shard) + os.path.getsize(src / "config.json")
    assert (root / "m" / REV / shard).read_bytes() == bytes(data)
    assert shas(published_manifest(root)["files"]) == shas(build_manifest(str(src))["files"])


def test_a_rerun_on_the_published_revision_copies_nothing_and_deep_verify_uses_the_record(tmp_path, src):
    root = tmp_path / "nvme"
    run(root, src)
    again = run(root, src)
    assert again["changed"] is False and again["bytes_copied"] == 0
    shard = sorted(p for p in os.listdir(src) if p.endswith(".safetensors"))[0]
    victim = root / "m" / REV / shard
    st = os.stat(victim)
    os.chmod(victim, 0o644)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    repaired = run(root, src, deep_verify=True)
    assert repaired["state_before"] == "damaged" and repaired["bytes_copied"] == os.path.getsize(src / shard)
    assert victim.read_bytes() == (src / shard).read_bytes()


def test_a_hub_blob_that_is_not_what_its_name_says_is_refused_before_publish(tmp_path):
    plain = make_checkpoint(tmp_path / "plain", shards=2, tensors_per_shard=2)
    repo = tmp_path / "hub" / "models--org--m"
    snap = repo / "snapshots" / REV
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    bad = sorted(p for p in os.listdir(plain) if p.endswith(".safetensors"))[0]
    for f in sorted(os.listdir(plain)):
        data = (plain / f).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if f == bad:
            data = data[:-1] + bytes([data[-1] ^ 1])  # damaged on disk after the hub named it
        blob.write_bytes(data)
        (snap / f).symlink_to(os.path.join("..", "..", "blobs", blob.name))
    root = tmp_path / "nvme"
    with pytest.raises(stage.StageError, match=f"{bad}: the manifest says sha256 .*hub-cache blob name"):
        run(root, snap)
    assert not (root / "m" / REV).exists() and not (root / "m" / "current").exists()


def test_a_link_planted_as_the_part_file_is_not_written_through(tmp_path, src):
    root = tmp_path / "nvme"
    with pytest.raises(stage.StageError):
        stage.stage(
            request(root, src, threads=1), lambda rel: [Failing(transfer.LocalSource(str(src)), {"config.json"})]
        )
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    partial = root / "m" / f".partial-{REV}"
    (partial / "config.json.llmfleet-part").symlink_to(victim)
    run(root, src)
    assert victim.read_bytes() == b"keep me"
    assert (root / "m" / REV / "config.json").read_bytes() == (src / "config.json").read_bytes()


@pytest.mark.parametrize("one_pass", [False, True], ids=["manifest", "no-manifest"])
def test_every_file_is_synced_before_it_is_renamed_and_journaled_and_all_before_publish(
    tmp_path, src, monkeypatch, one_pass
):
    events = []
    real_sync, real_add, real_publish, real_replace = transfer._datasync, store.Journal.add, stage.publish, os.replace

    def sync(fd):
        real_sync(fd)
        events.append(("synced", os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).removesuffix(".llmfleet-part")))

    def replace(a, b, **kw):
        if str(a).endswith(".llmfleet-part"):
            events.append(("renamed", b))
        return real_replace(a, b, **kw)

    def add(self, entry):
        events.append(("journaled", os.path.basename(entry["path"])))
        return real_add(self, entry)

    def publish(*a, **k):
        events.append(("published", ""))
        return real_publish(*a, **k)

    monkeypatch.setattr(transfer, "_datasync", sync)
    monkeypatch.setattr(transfer.os, "replace", replace)
    monkeypatch.setattr(store.Journal, "add", add)
    monkeypatch.setattr(stage, "publish", publish)
    root = tmp_path / "nvme"
    if one_pass:
        run(root, src)
    else:
        stage.stage(
            stage.StageRequest(root=str(root), model="m", revision=REV, manifest=build_manifest(str(src))),
            lambda rel: [transfer.LocalSource(str(src))],
        )
    monkeypatch.undo()
    names = sorted(os.listdir(src))
    published = events.index(("published", ""))
    for n in names:
        order = [events.index((what, n)) for what in ("synced", "renamed", "journaled")]
        assert order == sorted(order) and order[-1] < published, (n, events)


def test_the_manifest_built_from_a_direct_io_copy_is_the_sources(tmp_path, src, monkeypatch):
    """A run above the kernel's dirty limit copies with direct I/O: the same manifest, the same bytes."""
    writes = []
    real_pwrite = os.pwrite

    def pwrite(fd, data, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".llmfleet-part"):  # the copy's, not the model lock's
            writes.append(len(data))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(transfer, "direct_io_pays", lambda need: True)
    monkeypatch.setattr(transfer.os, "pwrite", pwrite)
    root = tmp_path / "nvme"
    run(root, src)
    monkeypatch.undo()
    assert writes and all(n % 4096 == 0 for n in writes)  # whole blocks, the tails cut back after
    assert shas(published_manifest(root)["files"]) == shas(build_manifest(str(src))["files"])
    assert all((root / "m" / REV / n).read_bytes() == (src / n).read_bytes() for n in os.listdir(src))
