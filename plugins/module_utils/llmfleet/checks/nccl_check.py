"""NCCL check: one rank of an NCCL (GPU) or Gloo (CPU) world that runs all_reduce,
broadcast, a send/recv ring and all_gather over a size sweep with inputs chosen so every result is
exact in fp32 and bf16 for any world the check accepts, counts wrong elements per receiver and per
source rank, times each op, and reports algbw/busbw with nccl-tests' formulas. It never hangs: a
rendezvous timeout, a per-collective timeout and an outer watchdog end the rank with os._exit, after
recording the phase it reached in the TCPStore so the launcher can say which ranks never arrived or
stalled.

    python -m llmfleet.checks.nccl_check rank --rank R --world W --master IP --port P [--backend nccl|gloo] ...
    python -m llmfleet.checks.nccl_check local --nproc N ...   (N ranks of a single-node world on this host)
    python -m llmfleet.checks.nccl_check ranks --spec JSON      (several ranks, torch imported once: run_node_ranks)

The module imports only the stdlib at load time (torch is imported inside the rank and passed to the
pattern functions), so the same file works as ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.checks.nccl_check. What the
results mean (one world's verdict, the fleet's after every phase) is llmfleet.checks.nccl_verdict.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from ..engine_env import popen_kwargs
from .nccl_verdict import judge

OPS = ("all_reduce", "broadcast", "sendrecv", "all_gather")
DTYPES = ("fp32", "bf16")
# Every value is m * 2**-e with m in 128..254 (8 significant bits: exact in bf16 and fp32). The
# period 127 is prime, so data shifted by any power of two (a chunk size) differs in every element.
PERIOD = 127
# e = source rank // 127 stays <= 126, so every value is a normal number of both dtypes.
MAX_WORLD = PERIOD * PERIOD
EXIT_WRONG, EXIT_ERROR, EXIT_TIMEOUT = 1, 2, 3
CHUNK = 1 << 24  # elements compared per step: bounds the check's scratch memory at any size


def parse_size(text: str) -> int:
    units = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
    t = text.strip().upper().rstrip("B") or "0"
    num = t.rstrip("KMG")
    return int(float(num) * units[t[len(num) :]])


def size_sweep(lo: int, hi: int, factor: int = 4) -> list[int]:
    """lo, lo*factor, ... and always hi itself (8 B ... 1 GiB ends at 1 GiB)."""
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    if out[-1] != hi:
        out.append(hi)
    return out


def bus_factor(op: str, world: int) -> float:
    """nccl-tests: busbw = algbw x factor (AllReduce 2(n-1)/n, AllGather (n-1)/n, Broadcast 1, SendRecv 1)."""
    if world <= 1:
        return 1.0 if op in ("broadcast", "sendrecv") else 0.0
    return {"all_reduce": 2 * (world - 1) / world, "all_gather": (world - 1) / world}.get(op, 1.0)


def check_exactness(world: int, dtype: str) -> bool:
    """Every value the check sends, sums or expects is exact in the dtype, whatever the reduction order:
    each value has 8 significant bits and a normal exponent, and an all_reduce position has one non-zero
    term (disjoint support), so every partial sum is 0 or that value."""
    return dtype in DTYPES and 1 <= world <= MAX_WORLD


def world_error(world: int) -> str | None:
    """Why a world size cannot be checked exactly (None when it can)."""
    if not check_exactness(world, "bf16"):
        return (f"a world of {world} ranks cannot be checked: values are exact for 1 to {MAX_WORLD} ranks "
                "(split the fleet into smaller worlds)")  # fmt: skip
    return None


# ---- patterns (pure: torch is passed in, so tests simulate any world on the CPU) ------------------------


def signature(torch: Any, src: Any, idx: Any) -> Any:
    """The value rank `src` owns at index `idx` of its buffer (int64 tensors or ints), as fp32:
    (128 + (idx + src) % 127) * 2**-(src // 127). Any two ranks differ in every element."""
    src = torch.as_tensor(src, device=idx.device)
    m = 128 + (idx % PERIOD + src % PERIOD) % PERIOD
    scale = ((127 - src // PERIOD).to(torch.int32) << 23).view(torch.float32)  # exactly 2**-e
    return m.to(torch.float32) * scale


class Pattern:
    """The data of one op for one rank: what it hands over, what lands where in its result and from whom.

    all_reduce uses disjoint support: rank r is the only non-zero term at positions i = r (mod world), so
    every partial sum is 0 or that one value (exact at any world size, in any reduction order) and a
    wrong element's position says whose contribution it carries. broadcast sends the root's signature,
    all_gather and the send/recv ring each rank's own."""

    def __init__(self, op: str, rank: int, world: int, n: int) -> None:
        self.op, self.rank, self.world, self.n = op, rank, world, n
        self._held: dict[Any, Any] = {}  # a one-chunk result's expected values, kept for the next check

    def out_numel(self) -> int:
        return self.n * self.world if self.op == "all_gather" else self.n

    def contribution(self, torch: Any, dtype: Any, device: Any = "cpu") -> Any:
        """What this rank hands over: the formula for one period, repeated (a copy instead of the formula's
        integer arithmetic per element, which took a quarter of a lab rank's CPU)."""
        if self.op == "broadcast" and self.rank != 0:
            return torch.zeros(self.n, device=device, dtype=dtype)
        m = min(self.n, self.period())
        pos = torch.arange(m, device=device)
        if self.op == "all_reduce":
            zero = torch.zeros((), device=device)
            v = torch.where(pos % self.world == self.rank, signature(torch, self.rank, pos), zero)
        else:
            v = signature(torch, 0 if self.op == "broadcast" else self.rank, pos)
        v = v.to(dtype)
        return v.repeat(-(-self.n // m))[: self.n] if self.n > m else v

    def sources(self, torch: Any, pos: Any) -> tuple[Any, Any]:
        """For output positions `pos`: (source rank whose data lands there, index in its buffer)."""
        if self.op == "all_reduce":
            return pos % self.world, pos
        if self.op == "all_gather":
            return pos // self.n, pos % self.n
        if self.op == "broadcast":
            return torch.zeros_like(pos), pos
        return torch.full_like(pos, (self.rank - 1) % self.world), pos  # ring: from rank - 1

    def expected(self, torch: Any, pos: Any, dtype: Any) -> tuple[Any, Any]:
        """(expected values, source ranks) at output positions `pos`."""
        src, idx = self.sources(torch, pos)
        return signature(torch, src, idx).to(dtype), src

    def period(self) -> int:
        """Output positions repeat their expected value after this many (within one source's block for
        all_gather): the signature repeats every PERIOD indexes, all_reduce's owner every `world`."""
        return PERIOD * self.world // math.gcd(PERIOD, self.world) if self.op == "all_reduce" else PERIOD

    def expected_values(self, torch: Any, lo: int, hi: int, dtype: Any, device: Any) -> Any:
        """expected()'s values at output positions lo..hi-1, computed by the formula for one period and
        repeated (a copy, not the formula's integer arithmetic per element: 0.5 s per 4 M elements on a CPU)."""
        parts, i = [torch.empty(0, dtype=dtype, device=device)] if hi <= lo else [], lo
        while i < hi:
            # all_gather: one source's block at a time (its period starts at the block); others: one run.
            end = min(hi, (i // self.n + 1) * self.n) if self.op == "all_gather" else hi
            m = min(self.period(), end - i)
            base = self.expected(torch, torch.arange(i, i + m, device=device), dtype)[0]
            reps = -(-(end - i) // m)
            parts.append(base.repeat(reps)[: end - i] if reps > 1 else base)
            i = end
        return torch.cat(parts) if len(parts) != 1 else parts[0]

    def _expected_chunk(self, torch: Any, got: Any, lo: int, hi: int) -> Any:
        """One chunk's expected values; a result of one chunk keeps them for the next check iteration (larger
        results are computed per chunk and never held: they would double the check's memory)."""
        if got.numel() > CHUNK:
            return self.expected_values(torch, lo, hi, got.dtype, got.device)
        key = (got.dtype, got.device)
        if key not in self._held:
            self._held[key] = self.expected_values(torch, lo, hi, got.dtype, got.device)
        return self._held[key]

    def count_wrong(self, torch: Any, got: Any) -> tuple[int, dict[int, int], list]:
        """Compare every element of `got` (this rank's result) with the formula, CHUNK elements at a time:
        (wrong elements, {source rank: wrong elements carrying its data}, the first few wrong elements)."""
        total, wrong, per_src, first = got.numel(), 0, {}, []
        for lo in range(0, total, CHUNK):
            hi = min(total, lo + CHUNK)
            exp = self._expected_chunk(torch, got, lo, hi)
            bad = got[lo:hi] != exp
            c = int(bad.sum().item())
            if not c:
                continue
            wrong += c
            pos = torch.arange(lo, hi, device=got.device)[bad]
            src = self.sources(torch, pos)[0]
            u, cnt = torch.unique(src, return_counts=True)
            for s, k in zip(u.tolist(), cnt.tolist()):
                per_src[int(s)] = per_src.get(int(s), 0) + int(k)
            for i, s in zip(pos[: 3 - len(first)].tolist(), src[: 3 - len(first)].tolist()):
                first.append({"index": i, "from": int(s), "got": float(got[i].item()),
                              "want": float(exp[i - lo].item())})  # fmt: skip
        return wrong, per_src, first

    def corrupt_positions(self, src: int | None) -> list[int]:
        """Positions of the result that carry data of `src` (None: one per source): the in-transit fault
        injection damages these after the collective, as a bad link or receiver would."""
        srcs = [src] if src is not None else list(range(self.world))
        if self.op == "all_reduce":
            return [s for s in srcs if s < self.n]
        if self.op == "all_gather":
            return [s * self.n for s in srcs]
        owner = 0 if self.op == "broadcast" else (self.rank - 1) % self.world
        return [0] if src in (None, owner) else []


def parse_transit(text: str) -> tuple[int | None, int | None] | None:
    """--corrupt-transit RECEIVER:SOURCE, each a rank or '*' (every one); '' = off."""
    if not text:
        return None
    try:
        q, s = text.split(":")
        return (None if q == "*" else int(q)), (None if s == "*" else int(s))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RECEIVER:SOURCE, each a rank or '*'") from None


# ---- the rank -----------------------------------------------------------------------------------


def probe(addrs: list[tuple[str, int]], seconds: float) -> dict[tuple[str, int], str]:
    """TCP connects to every address at once, for at most `seconds`: "open" (accepted), "refused" (the host
    answered: nothing listens there yet) or "silent" (no answer at all, or no route: the host cannot be reached)."""
    import errno
    import selectors

    out: dict[tuple[str, int], str] = {}
    sel = selectors.DefaultSelector()
    try:
        for addr in dict.fromkeys(addrs):
            s = socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            err = s.connect_ex(addr)
            if err in (0, errno.EINPROGRESS):
                sel.register(s, selectors.EVENT_WRITE, addr)
            else:
                out[addr] = "refused" if err == errno.ECONNREFUSED else "silent"
                s.close()
        end = time.monotonic() + seconds
        while sel.get_map() and (left := end - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                err = key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                out[key.data] = "open" if err == 0 else "refused" if err == errno.ECONNREFUSED else "silent"
                sel.unregister(key.fileobj)
                key.fileobj.close()
        for key in list(sel.get_map().values()):
            out[key.data] = "silent"
            key.fileobj.close()
    finally:
        sel.close()
    return out


class Silence:
    """How long each address has given no answer at all (a refusal or an accepted connection is an answer)."""

    def __init__(self) -> None:
        self.since: dict[tuple[str, int], float] = {}

    def update(self, answers: dict[tuple[str, int], str], now: float) -> None:
        for addr, how in answers.items():
            if how == "silent":
                self.since.setdefault(addr, now)
            else:
                self.since.pop(addr, None)

    def silent_for(self, addr: tuple[str, int], now: float) -> float:
        return now - self.since[addr] if addr in self.since else 0.0


class RendezvousCut(TimeoutError):
    """Rank 0 found the node of a missing rank silent (no TCP answer at all) and ended the rendezvous early.
    `stalled`: every rank's phase as the store said before this rank left it (rank 0's store ends with rank 0)."""

    def __init__(self, why: str, stalled: dict[str, str] | None = None) -> None:
        super().__init__(why)
        self.stalled = stalled


class Rank:
    def __init__(self, a: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.a = torch, dist, a
        self.rank, self.world = a.rank, a.world
        self.gpu = a.backend == "nccl"
        if not self.gpu:
            # Gloo ranks share the host's cores: a compute thread per core in every rank oversubscribed them
            # (8 lab ranks on 2 cores: 18 s per world instead of 10), and the check's arithmetic is small.
            torch.set_num_threads(1)
        self.device = torch.device("cuda", a.local_rank) if self.gpu else torch.device("cpu")
        if self.gpu:
            torch.cuda.set_device(self.device)
        # Graph-captured timing loops cost no launch overhead per op (nccl-tests -G); CPUs time eagerly.
        self.timing = "graph" if self.gpu and a.timing in ("auto", "graph") else "eager"
        self.graph_error: str | None = None
        self.last_timing = self.timing
        self.last_times: dict[str, float] = {}
        self.store = None
        self.results: list[dict[str, Any]] = []
        self.phase = "start"
        self.deadline = a.deadline  # the watchdog's; a chained phase tightens it once every rank has arrived

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        if self.store is not None:
            try:
                self.store.set(f"phase/{self.rank}", phase)
            except Exception:  # noqa: S110 (best effort: the store may be gone when a peer died)
                pass

    def init(self) -> None:
        from datetime import timedelta

        dist = self.dist
        end = time.monotonic() + self.a.timeout
        if self.rank != 0:
            self._await_head(end)
        try:
            self.store = dist.TCPStore(self.a.master, self.a.port, self.world, is_master=self.rank == 0,
                                       timeout=timedelta(seconds=max(1.0, end - time.monotonic())),
                                       wait_for_workers=False)  # fmt: skip
        except Exception as e:
            raise StoreUnreachable(f"cannot reach the rendezvous store of rank 0 at {self.a.master}:{self.a.port} "
                                   f"within {self.a.timeout}s: {str(e)[:200]}") from None  # fmt: skip
        chained = self.a.prev_wall is not None and self.a.deadline_factor > 0
        if chained:  # before this rank's phase key: whoever sees every phase key also sees every wall
            self.store.set(f"prev_wall/{self.rank}", str(self.a.prev_wall))
        self.set_phase("rendezvous")
        # Every rank waits for every rank's key before any backend starts: a rank that never comes is
        # named within the rendezvous timeout, also with NCCL, whose own bootstrap would wait forever; one on
        # a node that gives no answer at all is named as soon as rank 0 has seen that for --unreachable-after.
        self._rendezvous(end)
        if chained:
            self.deadline = chained_deadline(self.a, self._prev_walls())
        dist.init_process_group(self.a.backend, store=self.store, rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=self.a.op_timeout), **self._device_kw())  # fmt: skip
        self.set_phase("initialized")

    def _await_head(self, end: float) -> None:
        """Until rank 0's store accepts a connection: a refusal is an answer (rank 0 is not listening yet, its
        node is there), silence for --unreachable-after is not: its node cannot be reached from here, said at once
        instead of at the end of the rendezvous timeout."""
        head, silence = (self.a.master, self.a.port), Silence()
        while True:
            now = time.monotonic()
            answer = probe([head], min(1.0, max(0.1, end - now)))[head]
            now = time.monotonic()
            if answer == "open":
                return
            silence.update({head: answer}, now)
            if silence.silent_for(head, now) >= self.a.unreachable_after:
                raise StoreUnreachable(f"rank 0's node {self.a.master} gave no answer at all (no connection, no "
                                       f"refusal) to port {self.a.port} for {self.a.unreachable_after:g}s: it "
                                       "cannot be reached over the fabric from here, or a firewall drops that "
                                       "port")  # fmt: skip
            if now >= end:
                raise StoreUnreachable(f"cannot reach the rendezvous store of rank 0 at {self.a.master}:"
                                       f"{self.a.port} within {self.a.timeout}s: connection refused")  # fmt: skip
            if answer == "refused":
                time.sleep(min(0.2, max(0.0, end - now)))

    def _rendezvous(self, end: float) -> None:
        """Wait for every rank's phase key. Rank 0 (with --hosts) probes the nodes of the ranks still missing and
        ends the rendezvous for every rank (an `abort` key) once one has been silent for --unreachable-after."""
        from datetime import timedelta

        keys = [f"phase/{i}" for i in range(self.world)]
        hosts = self.a.hosts if self.a.hosts and self.world % len(self.a.hosts) == 0 else []
        silence = Silence()
        while True:
            t0 = time.monotonic()
            left = end - t0
            if left <= 0:
                raise TimeoutError(f"rendezvous: not every rank arrived within {self.a.timeout}s")
            step = min(0.5, left)
            try:
                self.store.wait(keys, timedelta(seconds=step))
                return
            except Exception:  # not yet: look again until the rendezvous timeout (never a tight loop)
                time.sleep(max(0.0, step - (time.monotonic() - t0)))
            try:
                if self.store.check(["abort"]):
                    why, stalled = self.store.get("abort").decode(), _stalled(self, self.a)
                    self.store.set(f"abort_seen/{self.rank}", "1")  # rank 0 may now close its store
                    raise RendezvousCut(why, stalled)
                if self.rank == 0 and hosts:
                    self._watch_missing(hosts, keys, silence)
            except RendezvousCut:
                raise
            except Exception:  # noqa: S110 (the store answers again at the next look, or the timeout ends it)
                pass

    def _watch_missing(self, hosts: list[str], keys: list[str], silence: Silence) -> None:
        from datetime import timedelta

        per_node = self.world // len(hosts)
        missing = [i for i, k in enumerate(keys) if not self.store.check([k])]
        nodes = sorted({i // per_node for i in missing})
        answers = probe([(hosts[n], self.a.port) for n in nodes], 1.0)
        now = time.monotonic()
        silence.update(answers, now)
        cut = [n for n in nodes if silence.silent_for((hosts[n], self.a.port), now) >= self.a.unreachable_after]
        if cut:
            ranks = [i for i in missing if i // per_node in cut]
            why = (f"rendezvous: rank(s) {ranks} cut off: their node(s) {', '.join(hosts[n] for n in cut)} gave rank 0 "
                   f"no answer at all for {self.a.unreachable_after:g}s (unreachable over the fabric, or a firewall "
                   f"drops port {self.a.port})")  # fmt: skip
            self.store.set("abort", why)
            # The store lives in this process: keep it until every rank that arrived has read why (their next look,
            # within a second), at most 5 s; a rank that misses it still ends at the rendezvous timeout.
            arrived = [f"abort_seen/{i}" for i in range(1, self.world) if i not in missing]
            try:
                self.store.wait(arrived, timedelta(seconds=5))
            except Exception:  # noqa: S110 (see above)
                pass
            raise RendezvousCut(why)

    def _prev_walls(self) -> list[float]:
        walls = []
        for i in range(self.world):
            key = f"prev_wall/{i}"
            if self.store.check([key]):  # a rank started without --prev-wall sets none
                walls.append(float(self.store.get(key).decode()))
        return walls

    def _device_kw(self) -> dict[str, Any]:
        import inspect

        if self.gpu and "device_id" in inspect.signature(self.dist.init_process_group).parameters:
            return {"device_id": self.device}
        return {}

    def sync(self) -> None:
        if self.gpu:
            self.torch.cuda.synchronize(self.device)

    def wait(self, work: Any) -> None:
        from datetime import timedelta

        if work is not None and not work.wait(timeout=timedelta(seconds=self.a.op_timeout)):
            raise TimeoutError(f"collective did not finish in {self.a.op_timeout}s")

    def inject(self, op: str, x: Any, n: int) -> None:
        """--corrupt-rank: this rank hands a wrong value to the collective (at a position it owns)."""
        if self.a.corrupt_rank != self.rank or (op == "broadcast" and self.rank != 0):
            return
        p = self.rank if op == "all_reduce" and self.rank < n else 0
        x[p] = x[p] * 2 + 1  # differs from any positive value and from zero, in either dtype

    def transit(self, op: str, got: Any, n: int) -> None:
        """--corrupt-transit Q:S: rank Q damages what it received from S after the collective, as a bad
        link or a bad receiver would; every contribution stays right."""
        if self.a.corrupt_transit is None:
            return
        q, s = self.a.corrupt_transit
        if q is not None and q != self.rank:
            return
        for p in Pattern(op, self.rank, self.world, n).corrupt_positions(s):
            got[p] = got[p] * 2 + 1

    def run_op(self, op: str, x: Any, out: Any) -> Any:
        dist = self.dist
        if op == "all_reduce":
            return dist.all_reduce(x, async_op=True)
        if op == "broadcast":
            return dist.broadcast(x, src=0, async_op=True)
        if op == "all_gather":
            return dist.all_gather_into_tensor(out, x, async_op=True)
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, out, prv)])
        return _Multi(reqs)

    def one(self, op: str, dtype_name: str, nbytes: int) -> dict[str, Any]:
        """Time `iters` back-to-back ops on a scratch buffer, then run `check_iters` ops on the exact
        pattern outside the timed loop and compare every element of every result (nccl-tests -c)."""
        torch = self.torch
        dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
        esize = 4 if dtype_name == "fp32" else 2
        n = max(1, nbytes // esize)
        if op == "sendrecv" and self.world == 1:
            return {"op": op, "dtype": dtype_name, "bytes": n * esize, "skipped": "world of 1"}
        pat = Pattern(op, self.rank, self.world, n)
        out = torch.zeros(pat.out_numel(), device=self.device, dtype=dtype)
        t = self.timed(op, torch.zeros(n, device=self.device, dtype=dtype), out)
        x0 = pat.contribution(torch, dtype, self.device)  # the formula's values, never handed over
        wrong, wrong_from, first, contribution_ok = 0, {}, [], True
        for _ in range(self.a.check_iters):
            x = x0.clone()
            self.inject(op, x, n)
            # The buffer handed over is checked against the formula first: a wrong one is this rank's fault.
            contribution_ok &= bool(torch.equal(x, x0))
            out.zero_()  # every expected value is non-zero: an element nobody wrote is wrong
            self.wait(self.run_op(op, x, out))
            self.sync()
            got = out if op in ("all_gather", "sendrecv") else x
            self.transit(op, got, n)
            w, per_src, f = pat.count_wrong(torch, got)
            if w >= wrong:
                wrong, first = w, f
            for s, c in per_src.items():
                wrong_from[s] = max(wrong_from.get(s, 0), c)
        # nccl-tests' size: the per-rank buffer, except AllGather where it is the gathered output.
        size = n * esize * (self.world if op == "all_gather" else 1)
        alg = size / t
        res = {"op": op, "dtype": dtype_name, "bytes": size, "time_us": round(t * 1e6, 2),
               "algbw_GBps": round(alg / 1e9, 3), "busbw_GBps": round(alg * bus_factor(op, self.world) / 1e9, 3),
               "wrong": wrong, "timing": self.last_timing}  # fmt: skip
        for mode, secs in self.last_times.items():
            res[f"{mode}_time_us"] = round(secs * 1e6, 2)
        if wrong:
            res["wrong_from"] = {str(s): c for s, c in sorted(wrong_from.items())}
            res["first_wrong"] = first
        if not contribution_ok:
            res["contribution_ok"] = False
        if self.a.reference and op == "all_reduce":
            ref = self.reference_time(torch.zeros(n, device=self.device, dtype=dtype))
            res["ref_time_us"] = round(ref * 1e6, 2)
            res["ref_busbw_GBps"] = round(n * esize / ref * bus_factor(op, self.world) / 1e9, 3)
        return res

    def timed(self, op: str, scratch: Any, out: Any) -> float:
        """Seconds per op over `iters` back-to-back ops, timed by CUDA events (median of `reps` loops).
        The loop is captured once as a CUDA graph and replayed (no host launch cost per op, nccl-tests -G);
        with --timing auto, from --eager-from bytes it is also enqueued eagerly (nccl-tests' default) and
        the faster is reported - the same NCCL call on the same buffers either way, both times kept in the
        result (a captured copy can be slower at large sizes). --timing eager, or a failed capture: eager
        only; --timing graph: graph only."""
        torch = self.torch
        self.last_times = {}
        if not self.gpu:
            for _ in range(self.a.warmup):
                self.wait(self.run_op(op, scratch, out))
            t0 = time.perf_counter()
            for _ in range(self.a.iters):
                self.wait(self.run_op(op, scratch, out))
            self.last_timing = "eager"
            return (time.perf_counter() - t0) / max(1, self.a.iters)
        for _ in range(max(1, self.a.warmup)):  # also creates the communicator before any capture
            self.enqueue(op, scratch, out)
        torch.cuda.synchronize(self.device)
        times = self.last_times
        if self.timing == "graph":
            try:
                times["graph"] = self.graph_time(op, scratch, out)
            except Exception as e:  # a torch/NCCL that cannot capture this op: time it eagerly, say so
                self.graph_error = f"{op}: {type(e).__name__}: {str(e)[:300]}"
                self.timing = "eager"
                torch.cuda.synchronize(self.device)
        if "graph" not in times or (self.a.timing == "auto" and scratch.numel() * scratch.element_size()
                                    >= self.a.eager_from):  # fmt: skip
            times["eager"] = self.median_time(lambda: [self.enqueue(op, scratch, out) for _ in range(self.a.iters)])
        self.last_timing = min(times, key=times.get)
        return times[self.last_timing]

    def graph_time(self, op: str, scratch: Any, out: Any) -> float:
        torch = self.torch
        g = torch.cuda.CUDAGraph()
        # thread_local: torch's NCCL watchdog thread may query events while this thread captures
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            for _ in range(max(1, self.a.iters)):
                self.enqueue(op, scratch, out)
        g.replay()  # the first replay uploads the graph
        torch.cuda.synchronize(self.device)
        t = self.median_time(g.replay)
        del g
        return t

    def median_time(self, launch: Any) -> float:
        torch = self.torch
        times = []
        for _ in range(max(1, self.a.reps)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launch()
            end.record()
            torch.cuda.synchronize(self.device)
            times.append(start.elapsed_time(end) / 1e3 / max(1, self.a.iters))
        return sorted(times)[len(times) // 2]

    def enqueue(self, op: str, x: Any, out: Any) -> None:
        """Plain blocking-style calls (on NCCL they only enqueue on the stream), like the reference."""
        dist = self.dist
        if op == "all_reduce":
            dist.all_reduce(x)
        elif op == "broadcast":
            dist.broadcast(x, src=0)
        elif op == "all_gather":
            dist.all_gather_into_tensor(out, x)
        else:
            self.run_op(op, x, out).wait()  # P2P: wait() makes the stream wait; the host does not block

    def reference_time(self, buf: Any) -> float:
        """PyTorch's plain timing of the same all_reduce: CUDA events around back-to-back eager calls,
        no checks, no graph (the side-by-side reference for the checker's own numbers)."""
        dist = self.dist
        for _ in range(self.a.warmup):
            dist.all_reduce(buf)
        if self.gpu:
            self.torch.cuda.synchronize(self.device)
            return self.median_time(lambda: [dist.all_reduce(buf) for _ in range(self.a.iters)])
        t0 = time.perf_counter()
        for _ in range(self.a.iters):
            dist.all_reduce(buf)
        return (time.perf_counter() - t0) / max(1, self.a.iters)

    def at_fault(self, mine: bool) -> list[int]:
        """Every rank shares whether a buffer it handed over differed from the formula: those ranks'
        contributions were wrong before any transfer (all ranks agree on the answer)."""
        torch = self.torch
        flags = torch.tensor([1.0 if mine else 0.0], device=self.device)
        gathered = torch.zeros(self.world, device=self.device)
        self.wait(self.dist.all_gather_into_tensor(gathered, flags, async_op=True))
        return [i for i, f in enumerate(gathered.tolist()) if f]


def chained_deadline(a: argparse.Namespace, walls: list[float]) -> float:
    """A chained phase's rank deadline, as the role derives it for a phase it starts itself: the previous
    phase's slowest rank in the whole world x the factor + the rendezvous timeout, at most --deadline."""
    if not walls or a.deadline_factor <= 0:
        return a.deadline
    return min(a.deadline, float(math.ceil(max(walls) * a.deadline_factor + a.timeout)))


class StoreUnreachable(Exception):
    """Rank 0's TCPStore could not be reached: rank 0 never started, or its node cannot be reached."""


class _Multi:
    def __init__(self, reqs: list) -> None:
        self.reqs = reqs

    def wait(self, timeout: Any = None) -> bool:
        if timeout is None:
            return all(r.wait() is not False for r in self.reqs)
        return all(r.wait(timeout=timeout) is not False for r in self.reqs)


def run_rank(a: argparse.Namespace) -> int:
    """One rank; prints one JSON line and exits with 0 (exact), 1 (wrong values), 2 (error), 3 (timeout)."""
    out: dict[str, Any] = {"rank": a.rank, "world": a.world, "host": socket.gethostname(), "backend": a.backend,
                           "local_rank": a.local_rank, "ok": False}  # fmt: skip
    state = {"rank": None}

    threading.Thread(target=_watchdog, args=(a, state, out, time.monotonic()), daemon=True).start()
    code = EXIT_ERROR
    try:
        r = state["rank"] = Rank(a)
        if a.delay_start:
            time.sleep(a.delay_start)  # fault injection: a rank that starts late / never in time
        r.init()
        mine = False  # whether a buffer this rank handed over differed from the formula
        for op in a.ops:
            for dt in a.dtypes:
                for size in a.sizes:
                    r.set_phase(f"{op}/{dt}/{size}")
                    res = r.one(op, dt, size)
                    r.results.append(res)
                    mine |= res.get("contribution_ok", True) is False
        # Once for every op and size (not a collective after each: an eighth of a lab rank's collectives).
        r.set_phase("culprits")
        culprits = set(r.at_fault(mine))
        r.set_phase("done")
        wrong = sum(x.get("wrong", 0) for x in r.results)
        out.update(ok=wrong == 0 and not culprits, wrong=wrong, culprit_ranks=sorted(culprits), results=r.results,
                   phase="done", timing=r.timing, deadline_s=r.deadline)  # fmt: skip
        if r.graph_error:
            out["graph_error"] = r.graph_error
        code = 0 if out["ok"] else EXIT_WRONG
        if a.barrier_end:
            r.wait(r.dist.barrier(async_op=True))
    except StoreUnreachable as e:
        out.update(error=str(e), phase="start", store_unreachable=True)
        code = EXIT_TIMEOUT
    except TimeoutError as e:
        rk = state["rank"]
        stalled = getattr(e, "stalled", None) or _stalled(rk, a)
        out.update(error=str(e), phase=rk.phase if rk else "start", stalled=stalled,
                   results=rk.results if rk else [])  # fmt: skip
        code = EXIT_TIMEOUT
    except Exception as e:
        rk = state["rank"]
        out.update(error=f"{type(e).__name__}: {str(e)[:500]}", phase=rk.phase if rk else "start",
                   stalled=_stalled(rk, a), results=rk.results if rk else [])  # fmt: skip
        code = EXIT_ERROR if "timeout" not in str(e).lower() and "timed out" not in str(e).lower() else EXIT_TIMEOUT
    _emit(out, a)
    os._exit(code)  # a broken communicator must not block interpreter exit


def _watchdog(a: argparse.Namespace, state: dict[str, Any], out: dict[str, Any], t0: float) -> None:
    """Ends the rank at its deadline, saying where it stood. The deadline is read again and again: a chained
    phase tightens it once every rank has arrived."""
    while True:
        r = state["rank"]
        left = t0 + (r.deadline if r else a.deadline) - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(left, 0.5))
    out.update(error=f"watchdog: rank {a.rank} still running after {r.deadline if r else a.deadline:g}s",
               phase=r.phase if r else "start", stalled=_stalled(r, a), results=r.results if r else [])  # fmt: skip
    _emit(out, a)
    os._exit(EXIT_TIMEOUT)


def _stalled(rk: Rank | None, a: argparse.Namespace) -> dict[str, str] | None:
    """Phase of every rank from the store (rank 0's view): 'missing' = never arrived."""
    if rk is None or rk.store is None:
        return None
    from datetime import timedelta

    phases = {}
    try:
        rk.store.set_timeout(timedelta(seconds=2))
    except Exception:  # noqa: S110 (older torch: keep the default timeout)
        pass
    for i in range(a.world):
        try:
            phases[str(i)] = rk.store.get(f"phase/{i}").decode() if rk.store.check([f"phase/{i}"]) else "missing"
        except Exception:
            phases[str(i)] = "unknown"
    return phases


def _emit(out: dict[str, Any], a: argparse.Namespace) -> None:
    line = json.dumps(out)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    print(line, flush=True)


# ---- local launcher (one host, N ranks) ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def launch_local(a: argparse.Namespace) -> int:
    """Start nproc ranks of a single-node world (one process per GPU with NCCL), wait with a
    deadline, print a summary JSON with every rank's result."""
    port = a.port or free_port()
    procs = []
    base = [sys.executable, "-m", __spec__.name if __spec__ else "llmfleet.checks.nccl_check", "rank"]
    for r in range(a.nproc):
        argv = [*base, "--rank", str(r), "--world", str(a.nproc), "--local-rank", str(r), "--master", "127.0.0.1",
                "--port", str(port), *_common_args(a)]  # fmt: skip
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    ranks = collect(list(enumerate(procs)), a.deadline + 10)
    verdict = judge(ranks)
    print(json.dumps({"ranks": ranks, **verdict}, indent=None if a.compact else 2))
    return 0 if verdict["ok"] else 1


def collect(procs: list[tuple[int, Any]], seconds: float) -> list[dict[str, Any]]:
    """Each rank's JSON line, waiting at most `seconds` overall; a rank that outlives that (its own
    watchdog failed) is killed, so no rank is ever left running."""
    t0 = time.monotonic()
    end = t0 + seconds
    out = []
    for rank, p in procs:
        try:
            so, se = p.communicate(timeout=max(1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
        wall = time.monotonic() - t0  # an upper bound for ranks collected after a slower one
        out.append(rank_result(rank, so, se, p.returncode, round(wall, 2)))
    return out


def _common_args(a: argparse.Namespace) -> list[str]:
    transit = a.corrupt_transit
    return ["--backend", a.backend, "--ops", ",".join(a.ops), "--dtypes", ",".join(a.dtypes),
            "--sizes", ",".join(map(str, a.sizes)), "--iters", str(a.iters), "--warmup", str(a.warmup),
            "--reps", str(a.reps), "--timing", a.timing, "--eager-from", str(a.eager_from),
            "--timeout", str(a.timeout), "--unreachable-after", str(a.unreachable_after),
            "--op-timeout", str(a.op_timeout), "--deadline", str(a.deadline),
            "--check-iters", str(a.check_iters), "--corrupt-rank", str(a.corrupt_rank),
            *(["--corrupt-transit", ":".join("*" if v is None else str(v) for v in transit)] if transit else []),
            *(["--reference"] if a.reference else [])]  # fmt: skip


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="default: nccl if CUDA, else gloo")
    p.add_argument("--ops", type=lambda s: [x for x in s.split(",") if x], default=list(OPS))
    p.add_argument("--dtypes", type=lambda s: [x for x in s.split(",") if x], default=list(DTYPES))
    p.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",") if x], default=None,
                   help="bytes per rank, e.g. 8,1K,1M,1G (default: 8B..1GiB x4 on GPU, 8B..4MiB on CPU)")  # fmt: skip
    p.add_argument("--iters", type=int, default=20, help="ops per timed loop")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=3, help="timed loops per size on GPUs; the median is reported")
    p.add_argument("--timing", choices=["auto", "graph", "eager"], default="auto",
                   help="GPU timing loop: a captured CUDA graph, eager calls, or auto (see --eager-from)")  # fmt: skip
    p.add_argument("--eager-from", type=parse_size, default=1024**2,
                   help="auto timing: from this many bytes per rank, also eager calls; the faster counts")  # fmt: skip
    p.add_argument("--timeout", type=float, default=60, help="rendezvous timeout (s)")
    p.add_argument("--unreachable-after", type=float, default=5,
                   help="a node that gives no TCP answer at all (no connection, no refusal) for this long is named "
                        "cut off at once, within the rendezvous timeout (s)")  # fmt: skip
    p.add_argument("--op-timeout", type=float, default=60, help="per-collective timeout (s)")
    p.add_argument("--deadline", type=float, default=600, help="outer watchdog for the whole rank (s)")
    p.add_argument("--check-iters", type=int, default=2, help="runs on the exact pattern whose results are checked")
    p.add_argument("--reference", action="store_true", help="also time all_reduce as plain PyTorch (side by side)")
    p.add_argument("--corrupt-rank", type=int, default=-1, help="fault injection: this rank contributes a wrong value")
    p.add_argument("--corrupt-transit", type=parse_transit, default=None, metavar="RECEIVER:SOURCE",
                   help="fault injection: RECEIVER damages what it received from SOURCE (a rank or '*')")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llmfleet.checks.nccl_check", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rp = sub.add_parser("rank", help="run one rank")
    rp.add_argument("--rank", type=int, required=True)
    rp.add_argument("--world", type=int, required=True)
    rp.add_argument("--local-rank", type=int, default=0)
    rp.add_argument("--master", required=True)
    rp.add_argument("--port", type=int, required=True)
    rp.add_argument("--out", help="also write the JSON result here")
    rp.add_argument("--delay-start", type=float, default=0, help="fault injection: start this many seconds late")
    rp.add_argument("--barrier-end", action="store_true")
    rp.add_argument("--hosts", type=lambda s: [x for x in s.split(",") if x], default=[],
                    help="the world's nodes' fabric IPs in rank order (each node's ranks consecutive): rank 0 probes "
                         "the nodes of ranks that do not arrive")  # fmt: skip
    rp.add_argument("--prev-wall", type=float, default=None,
                    help="chained phase: the slowest wall time (s) of this node's previous-phase ranks")  # fmt: skip
    rp.add_argument("--deadline-factor", type=float, default=0,
                    help="chained phase: deadline = min(--deadline, slowest previous wall of the world x this "
                         "+ --timeout), known once every rank has arrived (0: --deadline)")  # fmt: skip
    add_common(rp)
    lp = sub.add_parser("local", help="N ranks of a single-node world on this host")
    lp.add_argument("--nproc", type=int, required=True)
    lp.add_argument("--port", type=int, default=0)
    lp.add_argument("--compact", action="store_true")
    add_common(lp)
    gp = sub.add_parser("ranks", help="several ranks of this host, torch imported once (one process each, forked)")
    gp.add_argument("--spec", required=True, help="JSON list: each rank's arguments of the rank command")
    gp.add_argument("--then", default=None,
                    help="JSON list: ranks of a next world, forked when these have ended (from the same import), "
                         "each given --prev-wall")  # fmt: skip
    a = ap.parse_args(argv)
    if a.cmd == "ranks":
        try:
            arg_lists = json.loads(a.spec)
        except ValueError as e:
            ap.error(f"--spec: not JSON: {e}")
        phases = [arg_lists]
        if a.then is not None:
            try:
                phases.append(json.loads(a.then))
            except ValueError as e:
                ap.error(f"--then: not JSON: {e}")
        for flag, lists in zip(("--spec", "--then"), phases):
            if not isinstance(lists, list) or not lists or not all(isinstance(x, list) for x in lists):
                ap.error(f"{flag}: a non-empty JSON list of argument lists (one per rank)")
        return run_ranks(*[[_checked(ap, ap.parse_args(["rank", *map(str, x)])) for x in lists] for lists in phases])
    a = _checked(ap, a)
    return run_rank(a) if a.cmd == "rank" else launch_local(a)


def _checked(ap: argparse.ArgumentParser, a: argparse.Namespace) -> argparse.Namespace:
    """Defaults that depend on the backend, and every refusal, before any rank starts."""
    if a.backend is None:
        a.backend = _default_backend()
    if a.sizes is None:
        a.sizes = size_sweep(8, 1024**3) if a.backend == "nccl" else size_sweep(8, 4 * 1024**2)
    bad = [o for o in a.ops if o not in OPS] + [d for d in a.dtypes if d not in DTYPES]
    if bad:
        ap.error(f"unknown op/dtype {bad}: ops {OPS}, dtypes {DTYPES}")
    world, flag = (a.world, "--world") if a.cmd == "rank" else (a.nproc, "--nproc")
    why = world_error(world)
    if why:  # refused before any rank starts: a result that cannot be exact would blame good links
        ap.error(f"{flag} {world}: {why}")
    if a.cmd == "rank" and not 0 <= a.rank < world:
        ap.error(f"--rank {a.rank}: must be 0 to {world - 1} in a world of {world}")
    return a


def run_ranks(ranks: list[argparse.Namespace], then: list[argparse.Namespace] | None = None) -> int:
    """Several ranks of one host from one import of torch: each rank is a child forked after the import
    (about 3 CPU-s per import on a lab node; a rank process of its own paid it once per rank and phase).
    Forked before any collective, CUDA call or thread, so each child is as fresh as a rank started alone.
    `then`: ranks of the next world, forked from the same import as soon as these have ended, each told
    the slowest of these ranks' wall times (--prev-wall) for its deadline.
    Prints one JSON line per world, a list with a result per rank as collect() makes it; exits 0 when every
    rank passed."""
    import gc
    import tempfile

    # Imported once here, inherited by every forked rank. Frozen: a rank's garbage collections then skip
    # torch's hundreds of thousands of objects (and leave their pages shared with this process).
    import torch.distributed  # noqa: F401

    gc.freeze()

    tmp = tempfile.mkdtemp(prefix="llmfleet-nccl-check-")  # private (0700): the ranks' outputs
    try:
        out = _fork_world(ranks, tmp)
        print(json.dumps(out), flush=True)
        ok = all(r.get("ok") for r in out)
        if then:
            prev = max(r["wall_s"] for r in out)
            for a in then:
                a.prev_wall = prev
            nxt = _fork_world(then, tmp)
            print(json.dumps(nxt), flush=True)
            ok = ok and all(r.get("ok") for r in nxt)
    finally:
        os.rmdir(tmp)
    return 0 if ok else 1


def _fork_world(ranks: list[argparse.Namespace], tmp: str) -> list[dict[str, Any]]:
    """Fork one world's ranks of this host and wait for them: a result per rank, in the order given."""
    kids: dict[int, tuple[argparse.Namespace, float]] = {}
    for a in ranks:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the rank: its stdout/stderr to its own files, then run_rank, which ends with os._exit
            try:
                for fd, name in ((1, "out"), (2, "err")):
                    f = os.open(os.path.join(tmp, f"{a.rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    os.dup2(f, fd)
                    os.close(f)
                run_rank(a)
            finally:
                os._exit(EXIT_ERROR)
        kids[pid] = (a, time.monotonic())
    # Each rank ends itself at its deadline (watchdog); this bound only catches a rank whose watchdog failed.
    end = time.monotonic() + max(a.deadline for a in ranks) + 10
    done: dict[int, dict[str, Any]] = {}
    while kids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > end:
                for p in kids:
                    os.kill(p, 9)
                end = float("inf")
            time.sleep(0.05)
            continue
        a, t0 = kids.pop(pid)
        # os.waitstatus_to_exitcode needs 3.9; nodes may run 3.8: the exit code, or minus the signal.
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        done[a.rank] = {"exit": code, "wall_s": round(time.monotonic() - t0, 2)}
    out = []
    for a in ranks:
        texts = []
        for name in ("out", "err"):
            try:
                with open(os.path.join(tmp, f"{a.rank}.{name}"), encoding="utf-8", errors="replace") as f:
                    texts.append(f.read())
                os.unlink(os.path.join(tmp, f"{a.rank}.{name}"))
            except OSError:
                texts.append("")
        out.append({**rank_result(a.rank, texts[0], texts[1], **done[a.rank]), "forked_from": os.getpid()})
    return out


def rank_result(rank: int, stdout: str, stderr: str, exit: int | None, wall_s: float) -> dict[str, Any]:
    """A rank's JSON line (its last), or what is known of it when it printed none."""
    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith("{")), None)
    res = (
        json.loads(line) if line else {"rank": rank, "ok": False, "error": f"no result (exit {exit}): {stderr[-400:]}"}
    )
    res["exit"] = exit
    res["wall_s"] = wall_s
    return res


def _default_backend() -> str:
    try:
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"
    except ImportError:
        return "gloo"


# ---- a node's share of a (multi-node) world, for the Ansible module -----------------------------------


def read_env_file(path: str) -> dict[str, str]:
    env: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for raw in f:
                line = raw.strip()
                if line and not line.startswith("#") and "=" in line:
                    k, _, v = line.partition("=")
                    env[k.strip()] = v.strip()
    except OSError:
        pass
    return env


def run_node_ranks(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """This node's ranks of one world (run_node_worlds without `then`)."""
    return run_node_worlds({k: v for k, v in spec.items() if k != "then"})[0]


def run_node_worlds(spec: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Start this node's ranks of one world and wait for them (with a deadline); with spec["then"], this node's
    ranks of a second world right after, from the same processes: a list of results per world.

    spec: python, world, master, port, ranks ([[global_rank, local_rank], ...]), env (dict),
    args (list of extra rank args), deadline, pythonpath, run_as (the engine's account), hosts (the world's
    nodes' fabric IPs, for rank 0's probes), delay_ranks ({rank: seconds}, fault injection); then: the second
    world's world, master, port, ranks, deadline (at most), deadline_factor, hosts, args (more rank args),
    delay_ranks. One process per NUMA node of the ranks' GPUs (all of them when none is known) imports torch
    once and forks its ranks (run_ranks), bound like engine ranks with numactl."""
    env = {**os.environ, **spec.get("env", {})}
    if spec.get("pythonpath"):
        env["PYTHONPATH"] = spec["pythonpath"] + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # As the engine's account (spec["run_as"]), or as root only from an interpreter no one else can change:
    # EngineEnvError before any rank starts.
    kw = popen_kwargs(spec["python"], spec.get("run_as"), env, what="the NCCL check ranks")
    numactl = shutil.which("numactl")
    then = then_spec(spec)
    world_specs = [spec, then] if then else [spec]
    procs = []
    t0 = time.monotonic()
    for numa, members in numa_groups(spec).items():
        argv = group_argv(spec, members, numa, numactl, then)
        # A session of its own: a group that outlives the deadline is killed with every rank it forked.
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                             **kw)  # fmt: skip
        procs.append((members, p))
    worlds: list[list[dict[str, Any]]] = [[] for _ in world_specs]
    # The ranks' deadlines count from their fork, after the import (and the first world, for the second's).
    end = t0 + spec["deadline"] + 45 + (then["deadline"] + 10 if then else 0)
    for members, p in procs:
        try:
            so, se = p.communicate(timeout=max(1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            so, se = p.communicate()
        lines = [ln for ln in so.splitlines() if ln.startswith("[")]
        wall = round(time.monotonic() - t0, 2)
        for k, world_spec in enumerate(world_specs):
            try:
                got = {int(r["rank"]): r for r in json.loads(lines[k])} if k < len(lines) else {}
            except (ValueError, KeyError, TypeError):
                got = {}
            for rank, _ in _members_of(world_spec, members):
                worlds[k].append(got.get(rank) or rank_result(rank, "", se, p.returncode, wall))
    visible = [v for v in (spec.get("env") or {}).get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    for world_spec, out in zip(world_specs, worlds):  # one list per world (zip's strict= needs 3.10)
        local_of = {int(r): int(lr) for r, lr in world_spec["ranks"]}
        for res in out:
            res["node"] = socket.gethostname()
            lr = local_of.get(int(res.get("rank", -1)))
            if lr is not None:  # the GPU (nvidia-smi index) this rank ran on
                res["gpu"] = visible[lr] if lr < len(visible) else str(lr)
    return worlds


def then_spec(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The second world of a chained run as a spec of its own (the first's python, env and args, plus its own)."""
    t = spec.get("then")
    if not t:
        return None
    base = {k: v for k, v in spec.items() if k not in ("then", "delay_ranks")}
    args = [*spec.get("args", []), *t.get("args", []), "--deadline-factor", str(t.get("deadline_factor", 0))]
    return {**base, **{k: v for k, v in t.items() if k != "args"}, "args": args}


def _members_of(world_spec: dict[str, Any], first_members: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """A world's [global, local] pairs on the local ranks of one group of the first world."""
    locals_ = {lr for _, lr in first_members}
    return [(int(r), int(lr)) for r, lr in world_spec["ranks"] if int(lr) in locals_]


def numa_groups(spec: dict[str, Any]) -> dict[int | None, list[tuple[int, int]]]:
    """This node's [global, local] rank pairs by the NUMA node of their GPU (None: not known)."""
    numa = spec.get("numa_nodes") or []
    groups: dict[int | None, list[tuple[int, int]]] = {}
    for rank, local in spec["ranks"]:
        node = numa[int(local)] if int(local) < len(numa) else None
        groups.setdefault(node, []).append((int(rank), int(local)))
    return groups


def visible_env(visible_devices: str) -> dict[str, str]:
    """The environment that puts local rank i on the i-th of a deployment's GPUs ({} = every GPU)."""
    if not visible_devices.strip():
        return {}
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": visible_devices.replace(" ", "")}


def rank_args(spec: dict[str, Any], rank: int, local: int) -> list[str]:
    """One rank's arguments of the rank command."""
    args = ["--rank", str(rank), "--world", str(spec["world"]), "--local-rank", str(local), "--master", spec["master"],
            "--port", str(spec["port"]), "--deadline", str(spec["deadline"]), *spec.get("args", [])]  # fmt: skip
    if "--timing" not in args and len(spec.get("ranks") or []) < spec["world"]:
        # A world across nodes times eagerly: graph capture over host-staged transports can hang.
        args += ["--timing", "eager"]
    if spec.get("hosts"):
        args += ["--hosts", ",".join(spec["hosts"])]
    delay = (spec.get("delay_ranks") or {}).get(str(rank))
    if delay:
        args += ["--delay-start", str(delay)]
    return args


def group_argv(
    spec: dict[str, Any],
    members: list[tuple[int, int]],
    numa: int | None,
    numactl: str | None,
    then: dict[str, Any] | None = None,
) -> list[str]:
    """The command of one NUMA node's ranks (and of its ranks of the `then` world); bound to that node (CPUs
    and memory) when the topology gave it and numactl is installed, as engines pin their ranks."""
    ranks = json.dumps([rank_args(spec, rank, local) for rank, local in members])
    argv = [spec["python"], "-m", "llmfleet.checks.nccl_check", "ranks", "--spec", ranks]
    if then:
        argv += ["--then", json.dumps([rank_args(then, r, lr) for r, lr in _members_of(then, members)])]
    if numactl and numa is not None:
        argv = [numactl, f"--cpunodebind={numa}", f"--membind={numa}", *argv]
    return argv


if __name__ == "__main__":
    sys.exit(main())
