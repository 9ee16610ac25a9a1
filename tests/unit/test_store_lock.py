"""One staging run per model and node: a second run while the first one's job is alive (lost SSH, a
wait that timed out, two operators) waits for it or says who holds it - never "Address already in
use" on the peer port. And a lost shared-storage reader lease stops the reading at once, keeping
the journal, with a message that says a rerun resumes."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from llmfleet.stage import lease as lease_module
from llmfleet.stage import staging as stage
from llmfleet.stage import store, swarm
from llmfleet.stage.errors import LeaseLostError, LockedError, StageError
from llmfleet.stage.manifest import build_manifest
from tests.helpers.ckpt import make_checkpoint

REV = "a" * 40


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def src(tmp_path):
    return make_checkpoint(tmp_path / "shared" / "m", shards=4, tensors_per_shard=2, shape=(64, 64))


def node_run(tmp_path, src, port, **req_kw):
    """One node's run as the module starts it: its own peer server on the derived port, reading shared storage."""
    req = stage.StageRequest(root=str(tmp_path / "nvme"), model="m", revision=REV, manifest=build_manifest(str(src)),
                             threads=1, unit_glob="", **req_kw)  # fmt: skip
    cfg = swarm.SwarmConfig(me="n1", peer_key=b"k" * 32, source_dir=str(src), lease_dir=str(tmp_path / "leases"),
                            peers={"n1": f"http://127.0.0.1:{port}"}, seeds=["n1"], serve_bind="127.0.0.1",
                            serve_port=port, finish_wait=0)  # fmt: skip
    return swarm.run_node(req, cfg)


class Background:
    """A first run that is alive and slow (its job outlived the play): reads block until released."""

    def __init__(self, monkeypatch, tmp_path, src, port):
        self.gate = threading.Event()
        gate = self.gate

        class Slow(stage.LocalSource):
            def open(self, rel):
                assert gate.wait(30)
                return super().open(rel)

        monkeypatch.setattr(swarm, "LocalSource", Slow)
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(tmp_path, src, port))
        self.thread.start()
        lock = tmp_path / "nvme" / "m" / store.LOCK
        deadline = time.monotonic() + 10
        while not (lock.exists() and lock.read_text()):
            assert time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.01)

    def _run(self, tmp_path, src, port):
        try:
            self.result = node_run(tmp_path, src, port, run_by="alice")
        except Exception as e:
            self.error = e

    def finish(self):
        self.gate.set()
        self.thread.join(30)
        assert self.error is None, self.error
        return self.result


def test_a_second_run_says_who_holds_the_model(tmp_path, src, monkeypatch):
    """Before: the second run bound the same derived peer port and died with "Address already in use"
    (or, without a server, wrote the same partial dir as the first)."""
    port = free_port()
    first = Background(monkeypatch, tmp_path, src, port)
    try:
        with pytest.raises(LockedError) as e:
            node_run(tmp_path, src, port)
        msg = str(e.value)
        assert "another staging run of m is in progress: " in msg
        assert (
            f"pid {os.getpid()} on {socket.gethostname()}, started " in msg
            and "by alice, staging revision aaaaaaaaaaaa" in msg
        )
        assert (
            f"kill {os.getpid()} on {socket.gethostname()}" in msg
            and "the rerun resumes from the files it verified" in msg
        )
        assert "Address already in use" not in msg
    finally:
        r = first.finish()
    assert r["bytes_copied"] == r["total_bytes"]
    assert not (tmp_path / "nvme" / "m" / store.LOCK).exists()  # released with the run


def test_a_second_run_can_wait_for_the_first(tmp_path, src, monkeypatch):
    port = free_port()
    first = Background(monkeypatch, tmp_path, src, port)
    second: dict = {}
    t = threading.Thread(target=lambda: second.update(r=node_run(tmp_path, src, port, lock_wait=30)))
    t.start()
    time.sleep(0.3)
    assert t.is_alive()  # waiting, not failing
    first.finish()
    t.join(30)
    assert second["r"]["state_before"] == "published" and second["r"]["bytes_copied"] == 0


def test_the_wait_is_bounded(tmp_path, src, monkeypatch):
    port = free_port()
    first = Background(monkeypatch, tmp_path, src, port)
    t0 = time.monotonic()
    try:
        with pytest.raises(LockedError, match=r"in progress \(waited 0.5 s\): pid "):
            node_run(tmp_path, src, port, lock_wait=0.5)
    finally:
        first.finish()
    assert 0.5 <= time.monotonic() - t0 < 5


def test_a_killed_holder_never_blocks(tmp_path, src):
    mdir = tmp_path / "nvme" / "m"
    mdir.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from llmfleet.stage import store; store.ModelLock(sys.argv[1]).acquire(); "
         "print('locked', flush=True); time.sleep(60)", str(mdir)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(LockedError):
        store.ModelLock(str(mdir)).acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (mdir / store.LOCK).exists()  # left behind by SIGKILL ...
    r = node_run(tmp_path, src, free_port())  # ... and harmless: the kernel dropped the flock
    assert r["bytes_copied"] == r["total_bytes"]


def test_stage_alone_takes_the_lock_too(tmp_path, src):
    """`llmfleet stage` (no swarm) against a playbook's job on the same node."""
    mdir = tmp_path / "nvme" / "m"
    mdir.mkdir(parents=True)
    lock = store.ModelLock(str(mdir), REV, "bob")
    lock.acquire()
    try:
        req = stage.StageRequest(
            root=str(tmp_path / "nvme"), model="m", revision=REV, manifest=build_manifest(str(src))
        )
        with pytest.raises(LockedError, match="by bob, staging revision aaaaaaaaaaaa"):
            stage.stage(req, lambda rel: [stage.LocalSource(str(src))])
        assert not (mdir / f".partial-{REV}").exists()  # nothing touched
    finally:
        lock.release()


def test_a_port_taken_by_another_program_is_named(tmp_path, src):
    port = free_port()
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        with pytest.raises(StageError, match=rf"n1: peer port 127.0.0.1:{port} is already in use, not by a staging run "
                                             r"of m .* set model_stage_peer_port to a free port"):  # fmt: skip
            node_run(tmp_path, src, port)
    assert not (tmp_path / "nvme" / "m" / store.LOCK).exists()


# ---- a lost reader lease ---------------------------------------------------------------------------


class Lost(Exception):
    """Stands in for lease.LeaseLost until lease.py has it."""


def test_a_lost_lease_stops_reading_and_keeps_the_journal(tmp_path, src, monkeypatch):
    """Before: nobody asked the lease; a node whose slot was taken over kept reading shared storage."""
    checks, opens = [], []

    class StubShared:
        def __init__(self, lease, timeout):
            self.intervals = []

        @contextlib.contextmanager
        def __call__(self):
            yield

        def check(self):
            checks.append(1)
            if len(checks) > 6:  # two files in (one check per file, one per chunk read)
                raise Lost("slot-0 was taken over by node9")

    class Counting(stage.LocalSource):
        def open(self, rel):
            opens.append(rel)
            return super().open(rel)

    monkeypatch.setattr(lease_module, "LeaseLost", Lost, raising=False)
    monkeypatch.setattr(swarm, "SharedLease", StubShared)
    monkeypatch.setattr(swarm, "LocalSource", Counting)
    with pytest.raises(LeaseLostError) as e:
        node_run(tmp_path, src, 0)
    assert str(e.value) == (
        "lost the shared-storage reader lease on n1 (slot-0 was taken over by node9): stopped reading shared "
        "storage; the files verified so far are kept and the file being copied was removed; rerun to resume"
    )
    partial = tmp_path / "nvme" / "m" / f".partial-{REV}"
    journal = store.read_journal(str(partial))
    assert sorted(journal) == sorted(opens) and len(opens) == 2  # nothing opened after the loss
    assert not [p for p in os.listdir(partial) if p.endswith(".llmfleet-part")]
    monkeypatch.undo()
    r = node_run(tmp_path, src, 0)
    assert r["bytes_copied"] == r["total_bytes"] - sum(j["size"] for j in journal.values())


def test_other_lease_errors_are_not_disguised(tmp_path, src, monkeypatch):
    class StubShared:
        def __init__(self, lease, timeout):
            self.intervals = []

        @contextlib.contextmanager
        def __call__(self):
            yield

        def check(self):
            raise PermissionError("leases dir not writable")

    monkeypatch.setattr(lease_module, "LeaseLost", Lost, raising=False)
    monkeypatch.setattr(swarm, "SharedLease", StubShared)
    with pytest.raises(PermissionError, match="leases dir not writable"):  # the module names node and revision
        node_run(tmp_path, src, 0)
