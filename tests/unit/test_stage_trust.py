"""Staging's trust boundaries: what a model source may contain (links that stay in it, regular files),
the node's model store (root writes only through fds of a model dir nobody else can write) and the
shared lease directory (never followed through a planted link, never blocked on a planted FIFO).

Tests run as root; "planted by another user" is the real ownership of what another account would leave
(os.lchown/os.chown to nobody), which is what the guards look at."""

import hashlib
import json
import os
import pwd
import socket
import stat
import subprocess
import sys
import threading

import pytest

from llmfleet.stage import lease, manifest, store, transfer
from llmfleet.stage import staging as stage
from llmfleet.stage.errors import StageError
from llmfleet.stage.manifest import build_manifest
from tests.helpers.ckpt import make_checkpoint

REV = "1" * 40
OTHER = pwd.getpwnam("nobody")


def planted(path):
    """What another account left: owned by nobody (a link itself, not its target)."""
    os.lchown(path, OTHER.pw_uid, OTHER.pw_gid)


def tree(d):
    """Every entry below d with its mode and bytes (links as their target, not followed)."""
    out = {}
    for top, dirs, files in os.walk(d):
        for name in dirs + files:
            p = os.path.join(top, name)
            st = os.lstat(p)
            body = (
                os.readlink(p)
                if stat.S_ISLNK(st.st_mode)
                else (open(p, "rb").read() if stat.S_ISREG(st.st_mode) else b"")
            )
            out[os.path.relpath(p, d)] = (stat.S_IMODE(st.st_mode), body)
    return out


@pytest.fixture
def src(tmp_path):
    return make_checkpoint(tmp_path / "shared" / "m", shards=2, tensors_per_shard=2)


def request(root, man, **kw):
    return stage.StageRequest(root=str(root), model="m", revision=REV, manifest=man, **kw)


def run(root, src, man=None, allow=()):
    man = man or build_manifest(str(src), allow_links_into=allow)
    return stage.stage(request(root, man), lambda rel: [transfer.LocalSource(str(src), allow)])


# ---- sources ----------------------------------------------------------------------------------------


def test_a_link_out_of_the_source_is_refused_by_name(tmp_path, src):
    secret = tmp_path / "etc" / "credentials" / "dep.api-key"
    secret.parent.mkdir(parents=True)
    secret.write_text("sk-root-only\n")
    (src / "notes.txt").symlink_to(secret)
    for call in (manifest.list_files, build_manifest, manifest.stat_manifest):
        with pytest.raises(StageError) as e:
            call(str(src))
        assert f"notes.txt is a link to {secret}, outside the source" in str(e.value)
        assert "model_stage_source_allow_links_into" in str(e.value)
    with pytest.raises(StageError, match=r"notes\.txt is a link"):
        run(tmp_path / "nvme", src)
    assert not (tmp_path / "nvme" / "m" / REV).exists()


def test_links_inside_the_source_and_a_hub_snapshots_blobs_are_staged(tmp_path):
    """A hub-cache snapshot links every file to ../../blobs/<id>: that stays within the repo dir."""
    plain = make_checkpoint(tmp_path / "plain", shards=2, tensors_per_shard=2)
    repo = tmp_path / "hub" / "models--org--m"
    snap = repo / "snapshots" / REV
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(os.listdir(plain)):
        data = (plain / f).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f).symlink_to(os.path.join("..", "..", "blobs", blob.name))
    (snap / "sub").mkdir()
    (snap / "sub" / "again.json").symlink_to("../config.json")  # a link within the snapshot itself
    r = run(tmp_path / "nvme", snap)
    assert (
        r["changed"]
        and (tmp_path / "nvme" / "m" / REV / "sub" / "again.json").read_bytes() == (plain / "config.json").read_bytes()
    )


def test_a_directory_the_inventory_allows_is_staged(tmp_path, src):
    elsewhere = tmp_path / "extra"
    elsewhere.mkdir()
    (elsewhere / "chat_template.jinja").write_text("{{ messages }}\n")
    (src / "chat_template.jinja").symlink_to(elsewhere / "chat_template.jinja")
    r = run(tmp_path / "nvme", src, allow=(str(elsewhere),))
    assert r["changed"] and (tmp_path / "nvme" / "m" / REV / "chat_template.jinja").read_text() == "{{ messages }}\n"


@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_only_regular_files_are_staged(tmp_path, src, kind):
    path = src / "weights.bin"
    if kind == "fifo":
        os.mkfifo(path)
        what = "a FIFO"
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
        what = "a socket"
    with pytest.raises(StageError, match=f"weights.bin is {what}, not a regular file: only regular files are staged"):
        build_manifest(str(src))


def test_a_link_swapped_in_after_the_manifest_is_not_followed_out_by_the_copy(tmp_path, src):
    """The copy opens what the manifest checked: a shard replaced by a link to an outside file with the
    very same bytes (so the hash would match) is still refused, and nothing is published."""
    man = build_manifest(str(src))
    shard = sorted(p for p in os.listdir(src) if p.endswith(".safetensors"))[0]
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / shard).write_bytes((src / shard).read_bytes())
    os.unlink(src / shard)
    (src / shard).symlink_to(outside / shard)
    with pytest.raises(StageError, match=f"{shard} is a link to {outside / shard}, outside the source"):
        run(tmp_path / "nvme", src, man=man)
    assert not (tmp_path / "nvme" / "m" / REV).exists()


def test_a_directory_swapped_between_the_check_and_the_open_is_refused(tmp_path, monkeypatch):
    """The race the check alone cannot close: sub/ is replaced by a link out right after the file was
    checked; the open lands outside, and where the fd really points is checked after the open."""
    src = make_checkpoint(tmp_path / "src", shards=1, tensors_per_shard=1)
    (src / "sub").mkdir()
    (src / "sub" / "extra.txt").write_text("fine\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "extra.txt").write_text("secret\n")
    real_check = manifest.check_source_file

    def check_then_swap(directory, rel, bounds, **kw):
        st = real_check(directory, rel, bounds, **kw)
        if rel == "sub/extra.txt":
            os.rename(src / "sub", tmp_path / "sub.old")
            (src / "sub").symlink_to(outside)
        return st

    monkeypatch.setattr(manifest, "check_source_file", check_then_swap)
    with pytest.raises(StageError, match=f"sub/extra.txt is a link to {outside / 'extra.txt'}, outside the source"):
        manifest.open_source_file(str(src), "sub/extra.txt", manifest.source_bounds(str(src)))


def test_the_cli_exits_1_naming_the_link(tmp_path, src):
    (src / "notes.txt").symlink_to("/etc/shadow")
    cp = subprocess.run([sys.executable, "-m", "llmfleet", "checkpoint", "manifest", str(src)],
                        capture_output=True, text=True, check=False)  # fmt: skip
    assert cp.returncode == 1 and "Traceback" not in cp.stderr
    assert "notes.txt is a link to /etc/shadow, outside the source" in cp.stderr and not cp.stdout


# ---- the store --------------------------------------------------------------------------------------


def test_a_planted_partial_link_in_a_model_dir_others_can_write_is_refused(tmp_path, src):
    """The reported case: a model dir another user can write (a 1777 scratch disk) with .partial-<rev>
    planted as a link to a directory elsewhere. Root must neither write the model there nor chmod it."""
    root = tmp_path / "nvme"
    mdir = root / "m"
    mdir.mkdir(parents=True)
    os.chmod(mdir, 0o1777)
    target = tmp_path / "victim"
    target.mkdir()
    (target / "keep.txt").write_text("mine\n")
    os.chmod(target, 0o700)
    before = tree(target)
    (mdir / f".partial-{REV}").symlink_to(target)
    planted(mdir / f".partial-{REV}")
    with pytest.raises(StageError) as e:
        run(root, src)
    assert f"the model dir {mdir} is owned by uid 0 (root) with mode 1777" in str(e.value)
    assert f"chmod 0755 {mdir}" in str(e.value) and "Nothing was written" in str(e.value)
    assert tree(target) == before and stat.S_IMODE(os.stat(target).st_mode) == 0o700
    assert sorted(os.listdir(mdir)) == [f".partial-{REV}"]  # not even the lock file


def test_a_model_dir_another_user_owns_is_refused(tmp_path, src):
    root = tmp_path / "nvme"
    (root / "m").mkdir(parents=True)
    os.chown(root / "m", OTHER.pw_uid, OTHER.pw_gid)
    with pytest.raises(StageError, match=r"owned by uid 65534 \(nobody\)"):
        run(root, src)
    assert os.listdir(root / "m") == []


def test_a_model_root_others_can_write_is_refused_unless_sticky(tmp_path, src):
    """In a 0777 root anyone may rename the model dir away and plant another; a sticky (1777) root is the
    usual scratch disk: nobody else can rename what root made there, so staging goes on."""
    root = tmp_path / "nvme"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(StageError, match=r"the model root \(llmfleet_model_root\) .* mode 0777") as e:
        run(root, src)
    assert f"chown root:root {root} && chmod 0755 {root}" in str(e.value)
    assert os.listdir(root) == []
    os.chmod(root, 0o1777)
    r = run(root, src)
    assert r["changed"] and stat.S_IMODE(os.stat(root / "m").st_mode) == 0o755


def test_a_planted_model_dir_link_is_refused(tmp_path, src):
    root = tmp_path / "nvme"
    root.mkdir()
    os.chmod(root, 0o1777)
    target = tmp_path / "victim"
    target.mkdir()
    (root / "m").symlink_to(target)
    planted(root / "m")
    with pytest.raises(StageError, match=f"model dir {root / 'm'}: .* is a symlink to {target}"):
        run(root, src)
    assert os.listdir(target) == []


def test_the_store_never_writes_through_a_link_inside_its_own_dirs(tmp_path, src):
    """Belt and braces below the checked model dir: a link where a directory of the copy goes is refused
    (O_NOFOLLOW on every level), and GC removes a link it meets, never what it points to."""
    root = tmp_path / "nvme"
    run(root, src)
    mdir = root / "m"
    target = tmp_path / "victim"
    target.mkdir()
    (target / "keep.txt").write_text("mine\n")
    partial = mdir / f".partial-{'2' * 40}"
    partial.mkdir()
    (partial / "sub").symlink_to(target)
    j = store.Journal(str(partial))
    try:
        with pytest.raises(StageError, match="sub is a symlink"):
            transfer.fetch_file(transfer.LocalSource(str(src)), "sub/config.json", str(partial),
                                {"path": "sub/config.json", "size": 1, "sha256": "0" * 64}, j)  # fmt: skip
    finally:
        j.close()
    store.gc(str(mdir), keep=1, protect={REV}, unit_glob="")
    assert not partial.exists() and os.listdir(target) == ["keep.txt"]


# ---- the lease directory ----------------------------------------------------------------------------


def _bounded(fn, what):
    """Run fn in a thread; a hang (what the lease directory's guards exist to prevent) fails the test
    after a minute instead of blocking the suite. Not a timing assertion: a correct run takes ms."""
    out = {}

    def go():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test
            out["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), f"{what} hung"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_a_fifo_planted_as_readers_log_neither_hangs_nor_gets_lines(tmp_path):
    d = tmp_path / "leases"
    d.mkdir()
    os.mkfifo(d / "readers.log")
    lz = lease.Lease(str(d), cap=1, ttl=30)

    def cycle():
        lz.acquire(timeout=5)
        lz.release()
        return lz.try_acquire()

    assert _bounded(cycle, "acquire/release with a FIFO as readers.log") is True
    _bounded(lz.release, "release")
    assert stat.S_ISFIFO(os.lstat(d / "readers.log").st_mode)


def test_a_fifo_planted_as_a_lease_record_is_skipped(tmp_path):
    d = tmp_path / "leases"
    d.mkdir()
    os.mkfifo(d / "slot-0.0")
    lz = lease.Lease(str(d), cap=2, ttl=30)
    assert _bounded(lz.try_acquire, "acquire past a FIFO record") is True
    assert lz.slot == 1 and lz.holders() == [None, json.loads((d / "slot-1.0").read_text())]
    _bounded(lz.release, "release")


def test_a_symlinked_leases_dir_is_refused_and_nothing_is_written_there(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # every node (or every squashed user) writes here
    target = tmp_path / "victim"
    target.mkdir()
    (target / "slot-0.0").write_text("{}")
    before = tree(target)
    (shared / "leases").symlink_to(target)
    planted(shared / "leases")
    lz = lease.Lease(str(shared / "leases"), cap=1, ttl=30)
    with pytest.raises(OSError, match=r"lease directory \(model_stage_lease_dir\): .*leases is a symlink to"):
        lz.acquire(timeout=1)
    assert tree(target) == before


def test_a_symlinked_readers_log_gets_no_lines_and_gc_deletes_only_links(tmp_path):
    d = tmp_path / "leases"
    d.mkdir()
    victim = tmp_path / "victim.log"
    victim.write_text("precious\n")
    (d / "readers.log").symlink_to(victim)
    (d / "tmp-planted").symlink_to(victim)
    os.utime(d / "tmp-planted", (0, 0), follow_symlinks=False)  # old enough for the temp-file GC
    lz = lease.Lease(str(d), cap=1, ttl=30, gc_after=1)
    lz.acquire(timeout=5)
    lz.release()
    assert victim.read_text() == "precious\n" and (d / "readers.log").is_symlink()
    assert not os.path.lexists(d / "tmp-planted")  # the link was collected, its target kept
