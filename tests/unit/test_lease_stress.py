"""The reader cap under contention: 16 processes x 200 acquisitions with short leases; some holders
stall past their ttl without renewing (their slots are taken over), some read for longer than the
ttl without a heartbeat (check() must renew, and nobody may take those slots). Holders record
themselves while they believe they hold (from a passed check() to the end of that chunk) and a
sampler watches the count."""

import json
import multiprocessing
import random
import threading
import time

from llmfleet.stage import lease

# Not fork: the test process may hold threads (torch, imported by other tests in the same worker), and a child
# forked from it aborted in the garbage collector once ("Fatal Python error: Aborted" in threading).
CTX = multiprocessing.get_context("forkserver")
WORKERS = 16
ITERS = 200
CAP = 3
TTL = 0.3  # validity ttl/2: a chunk (1 ms here) preempted for longer than 0.15 s could overlap
STALL_EVERY = 50  # one acquisition in 50 stalls past its ttl: ~64 forced takeovers in all
LONG_EVERY = 100  # one in 100 reads for longer than ttl without a heartbeat (check() renews)


def _worker(d, wid, shared, lock):
    cur, peak, per_slot, stats = shared
    rnd = random.Random(wid)  # noqa: S311 - reproducible jitter, not a secret
    for k in range(ITERS):
        lz = lease.Lease(d, CAP, ttl=TTL, host=f"node{wid % 4}", label=f"w{wid}.{k}", gc_after=0.3)
        stall = rnd.randrange(STALL_EVERY) == 0
        chunks = 3 if stall or rnd.randrange(LONG_EVERY) else int(TTL * 1.2 / 0.002)
        if stall or chunks > 3:
            while not lz.try_acquire():  # no heartbeat: a holder that stops renewing
                time.sleep(0.005 + rnd.random() * 0.005)
        else:
            lz.acquire(timeout=120, poll=0.005 + rnd.random() * 0.005)
        slot = lz.slot
        try:
            for chunk in range(chunks):
                if stall and chunk == 1:
                    time.sleep(TTL * 1.5)  # stalled: neither reading nor renewing
                try:
                    lz.check()
                except lease.LeaseLost:
                    with lock:
                        stats[0] += 1
                    break
                with lock:
                    cur.value += 1
                    per_slot[slot] += 1
                    peak.value = max(peak.value, cur.value)
                    if per_slot[slot] > 1:
                        stats[1] += 1
                time.sleep(0.001)  # the read
                with lock:
                    cur.value -= 1
                    per_slot[slot] -= 1
        finally:
            lz.release()


def test_sampled_concurrent_holders_never_exceed_the_cap(tmp_path):
    d = str(tmp_path)
    lock = CTX.Lock()
    shared = (CTX.RawValue("i", 0), CTX.RawValue("i", 0), CTX.RawArray("i", CAP), CTX.RawArray("i", 2))
    procs = [CTX.Process(target=_worker, args=(d, w, shared, lock)) for w in range(WORKERS)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    sampled = []
    done = threading.Event()

    def sampler():
        while not done.is_set():
            sampled.append(shared[0].value)
            time.sleep(0.001)

    s = threading.Thread(target=sampler)
    s.start()
    for p in procs:
        p.join(300)
    done.set()
    s.join()
    elapsed = time.monotonic() - t0
    assert [p.exitcode for p in procs] == [0] * WORKERS
    lost, same_slot = shared[3][0], shared[3][1]
    log = [json.loads(x) for x in (tmp_path / "readers.log").read_text().splitlines()]
    acquires = sum(r["event"] == "acquire" for r in log)
    takeovers = sum(r["event"] == "expired" for r in log)
    print(f"{acquires} acquisitions, {takeovers} takeovers, {lost} holders told LeaseLost, "
          f"{len(sampled)} samples (max {max(sampled)}), peak {shared[1].value}, {elapsed:.1f}s")  # fmt: skip
    assert acquires == WORKERS * ITERS
    assert same_slot == 0
    assert max(sampled) <= CAP and shared[1].value <= CAP
    assert shared[1].value == CAP  # the cap was reached: the contention was real
    assert lost > 0 and takeovers >= lost  # staleness was forced, and every loss was a takeover
    assert lease.max_overlap(lease.intervals_from_log(str(tmp_path / "readers.log"))) <= CAP
    assert len(list(tmp_path.glob("slot-*"))) < 2000  # superseded records are collected
