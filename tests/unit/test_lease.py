"""Fleet-wide reader leases: cap, expiry, dead holders, heartbeat, accounting."""

import json
import os
import subprocess
import threading
import time

import pytest

from llmfleet.stage import lease


def test_cap_is_never_exceeded_and_is_reached(tmp_path):
    def reader(i):
        lz = lease.Lease(str(tmp_path), cap=2, ttl=30, label=f"r{i}")
        lz.acquire(timeout=30, poll=0.01)
        time.sleep(0.05)
        lz.release()

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    iv = lease.intervals_from_log(str(tmp_path / "readers.log"))
    assert len(iv) == 6
    assert lease.max_overlap(iv) == 2
    assert lease.Lease(str(tmp_path), cap=2).holders() == [None, None]  # all released


def _slot(path, **info):
    """A holding record written by another process (the newest record of its slot)."""
    now = time.time()
    rec = {"state": "held", "host": "other", "pid": 1, "token": "x", "label": "op2", "acquired": 0, "t": now, **info}
    path.write_text(json.dumps(rec))


def test_expired_lease_is_taken_over(tmp_path):
    # Expired by more than the allowed clock skew (default: ttl): taken over at once.
    _slot(tmp_path / "slot-0.0", expires=time.time() - 31)
    lz = lease.Lease(str(tmp_path), cap=1, ttl=30)
    assert lz.try_acquire()
    assert json.loads((tmp_path / "slot-0.1").read_text())["token"] == lz.token
    events = [json.loads(line)["event"] for line in (tmp_path / "readers.log").read_text().splitlines()]
    assert events == ["expired", "acquire"]
    lz.release()


def test_expiry_within_the_allowed_skew_waits_for_a_full_ttl_unrenewed(tmp_path):
    """Just expired by the holder's clock, which may be ahead of ours: not taken at once, only after
    the record stayed the newest one for a full ttl by our own monotonic clock."""
    _slot(tmp_path / "slot-0.0", expires=time.time() - 5)
    lz = lease.Lease(str(tmp_path), cap=1, ttl=30, max_skew=10)
    assert not lz.try_acquire()
    lz.ttl = 0.2  # shorten the observation for the test; the skew allowance stays 10 s
    time.sleep(0.25)
    assert lz.try_acquire()
    assert json.loads((tmp_path / "slot-0.1").read_text())["took_over"]["why"] == "unrenewed"
    lz.release()


def test_dead_local_holder_is_taken_over(tmp_path):
    p = subprocess.Popen(["true"])
    p.wait()
    lz = lease.Lease(str(tmp_path), cap=1, ttl=30)
    _slot(tmp_path / "slot-0.0", host=lz.host, pid=p.pid, expires=time.time() + 300)
    assert lz.try_acquire()
    lz.release()


def test_live_holder_blocks_until_deadline_with_a_clear_message(tmp_path):
    _slot(tmp_path / "slot-0.0", expires=time.time() + 300)
    lz = lease.Lease(str(tmp_path), cap=1, ttl=30)
    with pytest.raises(lease.LeaseTimeout, match=r"cap 1 .* held by other:1 \(op2\)"):
        lz.acquire(timeout=0.3, poll=0.05)


def test_heartbeat_renews_expiry(tmp_path):
    lz = lease.Lease(str(tmp_path), cap=1, ttl=0.3)
    lz.acquire(timeout=1)
    first = lz.holders()[0]["expires"]
    time.sleep(0.5)
    assert lz.holders()[0]["expires"] > first
    other = lease.Lease(str(tmp_path), cap=1, ttl=0.3, host="elsewhere")
    assert not other.try_acquire()  # renewed, so not stale
    lz.release()
    assert other.try_acquire()
    other.release()


def test_shared_lease_counts_a_node_once(tmp_path):
    shared = lease.SharedLease(lease.Lease(str(tmp_path), cap=2, ttl=30), timeout=5)
    inside = []

    def worker():
        with shared():
            inside.append(sum(1 for h in shared.lease.holders() if h))
            time.sleep(0.05)

    ts = [threading.Thread(target=worker) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert inside == [1, 1, 1, 1]
    assert len(shared.intervals) >= 1 and shared.lease.holders() == [None, None]


@pytest.mark.parametrize(
    ("intervals", "expected"),
    [([], 0), ([(0, 1)], 1), ([(0, 1), (1, 2)], 1), ([(0, 2), (1, 3), (1.5, 4)], 3), ([(0, 5), (1, 2), (3, 4)], 2)],
)
def test_max_overlap(intervals, expected):
    assert lease.max_overlap(intervals) == expected


def test_planted_links_in_the_shared_lease_dir_are_never_followed(tmp_path):
    """Other users of the shared storage can write the lease directory; root's writes there (the
    readers log, heartbeat renewals) must not follow a link they planted, nor its reads block."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    d = tmp_path / "leases"
    d.mkdir()
    (d / "readers.log").symlink_to(victim)
    lz = lease.Lease(str(d), cap=1, ttl=0.6)
    lz.acquire(timeout=5)
    (d / f"slot-0.{lz.gen + 1}").symlink_to(victim)  # where the next renewal would go
    time.sleep(0.3)  # at least one heartbeat (every ttl/4): it finds the name taken
    with pytest.raises(lease.LeaseLost, match="slot 0"):
        lz.check()
    lz.release()
    assert victim.read_text() == "precious\n"
    assert (d / "readers.log").is_symlink()
    # A FIFO or a link planted as the newest record is not read through (nor blocks): unknown holder.
    os.mkfifo(d / "slot-0.50")
    other = lease.Lease(str(d), cap=1, ttl=0.6, host="elsewhere")
    assert not other.try_acquire()
    assert other.holders() == [None]
