"""The reader cap is exact: a stale slot is taken over by exactly one contender, and a holder whose
slot was taken over finds out."""

import json
import multiprocessing
import os
import re
import signal
import time

import pytest

from llmfleet.stage import lease

CTX = multiprocessing.get_context("fork")
ROUNDS = 40
CONTENDERS = 16


def _one_attempt(d, barrier, wins, lock, r):
    """A short-lived contender: tries once, keeps what it got until everybody tried, then dies
    without releasing, so the next round finds slot 0 held by a dead process (stale at once)."""
    try:
        barrier.wait(timeout=60)
        if lease.Lease(d, cap=1, ttl=30, host="node-x", label=f"r{r}").try_acquire():
            with lock:
                wins[r] += 1
        barrier.wait(timeout=60)
    finally:
        os._exit(0)


def _contender(d, barrier, wins, lock):
    for r in range(ROUNDS):
        pid = os.fork()
        if pid == 0:
            _one_attempt(d, barrier, wins, lock, r)
        os.waitpid(pid, 0)
        barrier.wait(timeout=60)  # every attempt of this round has exited before the next one starts


def test_a_stale_slot_is_taken_over_by_exactly_one_contender(tmp_path):
    """Sixteen processes see the same stale slot at once (its holder died); before the fix two of
    them could both end up holding slot 0: the stale check and the rename-steal were not one
    atomic step. Within a round nobody's lease can go stale (ttl 30 s, holders alive)."""
    d = str(tmp_path)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if lease.Lease(d, cap=1, ttl=30, host="node-x").try_acquire() else 1)
    assert os.waitpid(pid, 0)[1] == 0
    barrier, lock, wins = CTX.Barrier(CONTENDERS), CTX.Lock(), CTX.RawArray("i", ROUNDS)
    procs = [CTX.Process(target=_contender, args=(d, barrier, wins, lock)) for _ in range(CONTENDERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * CONTENDERS
    assert list(wins) == [1] * ROUNDS, f"winners per round: {list(wins)}"


def _records(d, slot=0):
    return sorted(int(p.name.rsplit(".", 1)[1]) for p in d.glob(f"slot-{slot}.*"))


def test_a_holder_that_stopped_renewing_finds_out_its_slot_was_taken(tmp_path):
    """Before the fix a holder whose slot was stolen kept reading: nothing told it."""
    a = lease.Lease(str(tmp_path), cap=1, ttl=0.4, host="node1", label="stage m@abc")
    assert a.try_acquire()  # no heartbeat: a holder that stops renewing
    a.check()  # fresh: still valid
    b = lease.Lease(str(tmp_path), cap=1, ttl=0.4, host="node2", label="manifest")
    b.acquire(timeout=10, poll=0.02)  # after a full ttl without renewal
    with pytest.raises(lease.LeaseLost) as e:
        a.check()
    msg = str(e.value)
    assert re.search(
        rf"slot 0 in {re.escape(str(tmp_path))}: taken over by node2:{os.getpid()} \(manifest\) at 20", msg
    )
    assert "node1" in msg and "stop reading" in msg
    assert e.value.slot == 0 and e.value.by["token"] == b.token and e.value.at is not None
    b.check()  # the taker holds it
    a.release()  # releasing a lost lease leaves the taker alone
    assert b.holders()[0]["token"] == b.token
    b.check()
    events = [json.loads(x)["event"] for x in (tmp_path / "readers.log").read_text().splitlines()]
    assert events == ["acquire", "expired", "acquire", "lost"]
    b.release()


def test_check_renews_a_lapsed_lease_nobody_took_and_refuses_after_release(tmp_path):
    a = lease.Lease(str(tmp_path), cap=1, ttl=0.2)
    assert a.try_acquire()
    first = a.gen
    a.check()
    assert a.gen == first  # still valid: no I/O, no new record
    time.sleep(0.15)  # past ttl/2: check() renews before answering
    a.check()
    assert a.gen == first + 1 and _records(tmp_path) == [first, first + 1]
    a.release()
    with pytest.raises(lease.LeaseLost, match="holds no reader slot"):
        a.check()


def _held_then_stopped(d, ready, ttl):
    lz = lease.Lease(d, cap=1, ttl=ttl, host="node1", label="held")
    lz.acquire(timeout=5)
    ready.set()
    # SIGSTOPped here by the test; only the heartbeat can notice the takeover (check() is not called).
    deadline = time.monotonic() + 20
    while lz.lost is None and time.monotonic() < deadline:
        time.sleep(0.01)
    print(lz.lost, flush=True)
    os._exit(0 if lz.lost is not None and "taken over by node2" in str(lz.lost) else 3)


def test_the_heartbeat_notices_a_takeover_after_the_holder_was_stopped(tmp_path):
    ready = CTX.Event()
    p = CTX.Process(target=_held_then_stopped, args=(str(tmp_path), ready, 0.3))
    p.start()
    assert ready.wait(10)
    os.kill(p.pid, signal.SIGSTOP)  # node frozen: no renewals
    try:
        b = lease.Lease(str(tmp_path), cap=1, ttl=0.3, host="node2", label="taker")
        b.acquire(timeout=10, poll=0.02)
    finally:
        os.kill(p.pid, signal.SIGCONT)
    p.join(30)
    assert p.exitcode == 0
    b.check()
    b.release()


def test_a_contender_that_judged_a_slot_stale_gets_nothing_once_another_took_it(tmp_path, monkeypatch):
    """The interleaving behind the reported double holding, made deterministic: A reads the stale
    holder's lease, B takes the slot over before A acts on what it read; A must not get the slot
    (before the fix A's rename-steal removed B's fresh lease and both held slot 0)."""
    old = lease.Lease(str(tmp_path), cap=1, ttl=0.05, host="node0")
    assert old.try_acquire()
    time.sleep(0.15)  # expired by more than ttl + skew
    a = lease.Lease(str(tmp_path), cap=1, ttl=0.05, host="nodeA")
    b = lease.Lease(str(tmp_path), cap=1, ttl=0.05, host="nodeB")
    read, interleaved = lease._read, []

    def read_then_let_b_in(path, dir_fd=None):
        info = read(path, dir_fd)
        if not interleaved and info and info.get("token") == old.token:
            interleaved.append(path)
            assert b.try_acquire()  # B reads the same stale lease and takes the slot over
        return info

    monkeypatch.setattr(lease, "_read", read_then_let_b_in)
    got = a.try_acquire()
    assert interleaved and b.slot is not None
    assert not got and a.slot is None


def test_a_renewal_after_a_long_stall_does_not_resurrect_a_collected_record(tmp_path):
    """Superseded records are collected; a holder stalled past gc_after/2 that recreates the name of
    a collected record must not count itself the holder."""
    a = lease.Lease(str(tmp_path), cap=1, ttl=0.1, host="node1", gc_after=0.2)
    assert a.try_acquire()  # record 0, then stalled (no heartbeat)
    b = lease.Lease(str(tmp_path), cap=1, ttl=0.1, host="node2", gc_after=0.2)
    b.acquire(timeout=5, poll=0.01)  # record 1
    time.sleep(0.5)  # b renews every ttl/4 and collects what was superseded more than 0.2 s ago
    assert _records(tmp_path)[0] > 1  # records 0 and 1 are gone: a's renewal can create "1" again
    with pytest.raises(lease.LeaseLost, match="slot 0"):
        a.check()
    assert a.lost and b.holders()[0]["token"] == b.token
    b.check()
    b.release()


def test_a_live_lease_of_the_former_format_keeps_its_slot(tmp_path):
    (tmp_path / "slot-0").write_text(json.dumps({"host": "old", "pid": 1, "token": "t", "expires": time.time() + 60}))
    lz = lease.Lease(str(tmp_path), cap=2, ttl=30)
    assert lz.try_acquire() and lz.slot == 1
    lz.release()
    (tmp_path / "slot-0").write_text(json.dumps({"host": "old", "pid": 1, "token": "t", "expires": time.time() - 1}))
    assert lz.try_acquire() and lz.slot == 0
    lz.release()


def test_timeout_message_copes_with_a_record_missing_fields(tmp_path):
    (tmp_path / "slot-0.0").write_text(json.dumps({"state": "held", "host": "n3", "expires": time.time() + 60}))
    with pytest.raises(lease.LeaseTimeout, match=r"held by n3:\? \(\)"):
        lease.Lease(str(tmp_path), cap=1, ttl=30).acquire(timeout=0.1, poll=0.05)


def test_shared_lease_check_raises_once_the_process_lost_its_slot(tmp_path):
    shared = lease.SharedLease(lease.Lease(str(tmp_path), cap=1, ttl=0.3, host="node1"), timeout=5)
    with shared():
        shared.check()
        shared.lease._stop.set()  # heartbeat gone (as if the node froze): the slot goes stale
        other = lease.Lease(str(tmp_path), cap=1, ttl=0.3, host="node2", label="other")
        other.acquire(timeout=10, poll=0.02)
        with pytest.raises(lease.LeaseLost, match=r"taken over by node2:\d+ \(other\)"):
            shared.check()
    assert other.holders()[0]["token"] == other.token
    other.release()


def test_log_intervals_end_where_a_lost_holding_stopped_being_valid(tmp_path):
    a = lease.Lease(str(tmp_path), cap=1, ttl=0.3, host="node1")
    assert a.try_acquire()
    b = lease.Lease(str(tmp_path), cap=1, ttl=0.3, host="node2")
    b.acquire(timeout=10, poll=0.02)
    time.sleep(0.05)
    with pytest.raises(lease.LeaseLost):
        a.check()  # detected well after b took over
    b.release()
    iv = lease.intervals_from_log(str(tmp_path / "readers.log"))
    assert len(iv) == 2 and lease.max_overlap(iv) == 1
