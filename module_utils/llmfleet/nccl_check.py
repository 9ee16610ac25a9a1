"""NCCL check: one rank of an NCCL (GPU) or Gloo (CPU) world that runs all_reduce,
broadcast, a send/recv ring and all_gather over a size sweep with inputs chosen so every result is
exact in fp32 and bf16, counts wrong elements, times each op, and reports algbw/busbw with
nccl-tests' formulas. It never hangs: a rendezvous timeout, a per-collective timeout and an outer
watchdog end the rank with os._exit, after recording the phase it reached in the TCPStore so the
launcher can say which ranks never arrived or stalled.

    python -m llmfleet.nccl_check rank --rank R --world W --master IP --port P [--backend nccl|gloo] ...
    python -m llmfleet.nccl_check local --nproc N ...   (N ranks of a single-node world on this host)

The module imports only the stdlib at load time (torch is imported inside the rank), so the same file
works as ansible.module_utils.llmfleet.nccl_check. What the results mean (one world's verdict, the
fleet's after every phase) is llmfleet.nccl_verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from .nccl_verdict import judge

OPS = ("all_reduce", "broadcast", "sendrecv", "all_gather")
DTYPES = ("fp32", "bf16")
# Values in [1, 4]: a sum over up to 64 ranks stays <= 256, exact in bf16 (8-bit significand).
PATTERN = 4
EXIT_WRONG, EXIT_ERROR, EXIT_TIMEOUT = 1, 2, 3


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


def allreduce_expected(world: int) -> list[int]:
    """Element i of rank r holds ((r + i) % 4) + 1; the sum depends on i % 4 only."""
    return [sum(((r + k) % PATTERN) + 1 for r in range(world)) for k in range(PATTERN)]


def exact_limit(dtype: str) -> int:
    return 256 if dtype == "bf16" else 2**24


def check_exactness(world: int, dtype: str) -> bool:
    """Every value the checker produces or expects is an integer the dtype represents exactly."""
    lim = exact_limit(dtype)
    return max(allreduce_expected(world)) <= lim and world + PATTERN <= lim and 251 <= lim


# ---- the rank -----------------------------------------------------------------------------------


class Rank:
    def __init__(self, a: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.a = torch, dist, a
        self.rank, self.world = a.rank, a.world
        self.gpu = a.backend == "nccl"
        self.device = torch.device("cuda", a.local_rank) if self.gpu else torch.device("cpu")
        if self.gpu:
            torch.cuda.set_device(self.device)
        self.store = None
        self.results: list[dict[str, Any]] = []
        self.phase = "start"

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
        self.store = dist.TCPStore(self.a.master, self.a.port, self.world, is_master=self.rank == 0,
                                   timeout=timedelta(seconds=self.a.timeout), wait_for_workers=False)  # fmt: skip
        self.set_phase("rendezvous")
        dist.init_process_group(self.a.backend, store=self.store, rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=self.a.op_timeout), **self._device_kw())  # fmt: skip
        self.set_phase("initialized")

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

    def tensors(self, op: str, n: int, dtype: Any) -> tuple[Any, Any]:
        torch, r, w = self.torch, self.rank, self.world
        idx = torch.arange(n, device=self.device)
        if op == "all_reduce":
            x = (((idx + r) % PATTERN) + 1).to(dtype)
            exp = torch.tensor(allreduce_expected(w), device=self.device, dtype=dtype)[idx % PATTERN]
        elif op == "broadcast":
            pattern = ((idx % 251) + 1).to(dtype)
            x = pattern.clone() if r == 0 else torch.zeros(n, device=self.device, dtype=dtype)
            exp = pattern
        elif op == "all_gather":
            x = torch.full((n,), float(r + 1), device=self.device, dtype=dtype)
            exp = torch.arange(1, w + 1, device=self.device, dtype=dtype).repeat_interleave(n)
        else:  # sendrecv ring: send to r+1, receive from r-1
            x = (((idx % 3) + r + 1) % 251 + 1).to(dtype)
            src = (r - 1) % w
            exp = (((idx % 3) + src + 1) % 251 + 1).to(dtype)
        if self.a.corrupt_rank == r and op in ("all_reduce", "all_gather", "sendrecv") and n > 0:
            x[0] += 1  # fault injection: this rank contributes a wrong value
        if self.a.corrupt_rank == r and op == "broadcast" and r == 0 and n > 0:
            x[0] += 1
        return x, exp

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
        """Time `iters` back-to-back ops on a zero buffer (values stay exact), then run `check_iters`
        ops on the exact pattern and count wrong elements (as nccl-tests -c does)."""
        torch = self.torch
        dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
        esize = 4 if dtype_name == "fp32" else 2
        n = max(1, nbytes // esize)
        if op == "sendrecv" and self.world == 1:
            return {"op": op, "dtype": dtype_name, "bytes": n * esize, "skipped": "world of 1"}
        x0, exp = self.tensors(op, n, dtype)
        out = torch.zeros(n * self.world if op == "all_gather" else n, device=self.device, dtype=dtype)
        scratch = torch.zeros_like(x0)
        t = self.timed(op, scratch, out)
        wrong = 0
        for _ in range(self.a.check_iters):
            x = x0.clone()
            out.zero_()
            self.wait(self.run_op(op, x, out))
            self.sync()
            got = out if op in ("all_gather", "sendrecv") else x
            wrong = max(wrong, int((got != exp).sum().item()))
        # nccl-tests' size: the per-rank buffer, except AllGather where it is the gathered output.
        size = n * esize * (self.world if op == "all_gather" else 1)
        alg = size / t
        res = {"op": op, "dtype": dtype_name, "bytes": size, "time_us": round(t * 1e6, 2),
               "algbw_GBps": round(alg / 1e9, 3), "busbw_GBps": round(alg * bus_factor(op, self.world) / 1e9, 3),
               "wrong": wrong}  # fmt: skip
        if self.a.reference and op == "all_reduce":
            ref = self.reference_time(scratch)
            res["ref_time_us"] = round(ref * 1e6, 2)
            res["ref_busbw_GBps"] = round(n * esize / ref * bus_factor(op, self.world) / 1e9, 3)
        return res

    def timed(self, op: str, scratch: Any, out: Any) -> float:
        """Seconds per op over `iters` back-to-back ops. On GPUs the ops are only enqueued (the host
        never waits per op) and CUDA events time the stream, as nccl-tests does; a hung collective is
        ended by NCCL's watchdog (op_timeout) or the rank's outer watchdog."""
        if not self.gpu:
            for _ in range(self.a.warmup):
                self.wait(self.run_op(op, scratch, out))
            t0 = time.perf_counter()
            for _ in range(self.a.iters):
                self.wait(self.run_op(op, scratch, out))
            return (time.perf_counter() - t0) / max(1, self.a.iters)
        torch = self.torch
        for _ in range(self.a.warmup):
            self.enqueue(op, scratch, out)
        torch.cuda.synchronize(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.a.iters):
            self.enqueue(op, scratch, out)
        end.record()
        torch.cuda.synchronize(self.device)
        return start.elapsed_time(end) / 1e3 / max(1, self.a.iters)

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
        """PyTorch's plain timing of the same all_reduce: CUDA events around back-to-back calls,
        no checks, no waits (the side-by-side reference for the checker's own numbers)."""
        torch, dist = self.torch, self.dist
        for _ in range(self.a.warmup):
            dist.all_reduce(buf)
        if self.gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record()
            for _ in range(self.a.iters):
                dist.all_reduce(buf)
            end.record()
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(end) / 1e3 / max(1, self.a.iters)
        t0 = time.perf_counter()
        for _ in range(self.a.iters):
            dist.all_reduce(buf)
        return (time.perf_counter() - t0) / max(1, self.a.iters)

    def any_wrong(self, wrong: int) -> bool:
        t = self.torch.tensor([float(wrong)], device=self.device)
        self.wait(self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, async_op=True))
        return bool(t.item() > 0)

    def diagnose(self, op: str) -> list[int]:
        """After wrong results: every rank shares whether what it contributed differs from the
        formula; ranks whose contribution differs are the culprits (all ranks agree on the answer)."""
        torch = self.torch
        x, _ = self.tensors(op, 64, torch.float32)
        injected, self.a.corrupt_rank = self.a.corrupt_rank, -1
        ref, _ = self.tensors(op, 64, torch.float32)
        self.a.corrupt_rank = injected
        flags = torch.tensor([0.0 if torch.equal(x, ref) else 1.0], device=self.device)
        gathered = torch.zeros(self.world, device=self.device)
        self.wait(self.dist.all_gather_into_tensor(gathered, flags, async_op=True))
        return [i for i, f in enumerate(gathered.tolist()) if f]


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

    def watchdog() -> None:
        time.sleep(a.deadline)
        r = state["rank"]
        out.update(error=f"watchdog: rank {a.rank} still running after {a.deadline}s", phase=r.phase if r else "start")
        _emit(out, a)
        os._exit(EXIT_TIMEOUT)

    threading.Thread(target=watchdog, daemon=True).start()
    code = EXIT_ERROR
    try:
        r = state["rank"] = Rank(a)
        if a.delay_start:
            time.sleep(a.delay_start)  # fault injection: a rank that starts late / never in time
        r.init()
        culprits: set[int] = set()
        for op in a.ops:
            for dt in a.dtypes:
                for size in a.sizes:
                    r.set_phase(f"{op}/{dt}/{size}")
                    res = r.one(op, dt, size)
                    r.results.append(res)
                    if r.any_wrong(res.get("wrong", 0)):  # collective: every rank diagnoses, or none
                        culprits.update(r.diagnose(op))
        r.set_phase("done")
        wrong = sum(x.get("wrong", 0) for x in r.results)
        out.update(ok=wrong == 0, wrong=wrong, culprit_ranks=sorted(culprits), results=r.results, phase="done")
        code = 0 if wrong == 0 else EXIT_WRONG
        if a.barrier_end:
            r.wait(r.dist.barrier(async_op=True))
    except TimeoutError as e:
        rk = state["rank"]
        out.update(error=str(e), phase=rk.phase if rk else "start", stalled=_stalled(rk, a))
        code = EXIT_TIMEOUT
    except Exception as e:
        rk = state["rank"]
        out.update(error=f"{type(e).__name__}: {str(e)[:500]}", phase=rk.phase if rk else "start",
                   stalled=_stalled(rk, a))  # fmt: skip
        code = EXIT_ERROR if "timeout" not in str(e).lower() and "timed out" not in str(e).lower() else EXIT_TIMEOUT
    _emit(out, a)
    os._exit(code)  # a broken communicator must not block interpreter exit


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
    base = [sys.executable, "-m", __spec__.name if __spec__ else "llmfleet.nccl_check", "rank"]
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
    end = time.monotonic() + seconds
    out = []
    for rank, p in procs:
        try:
            so, se = p.communicate(timeout=max(1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
        line = next((ln for ln in reversed(so.splitlines()) if ln.startswith("{")), None)
        res = (
            json.loads(line)
            if line
            else {"rank": rank, "ok": False, "error": f"no result (exit {p.returncode}): {se[-400:]}"}
        )
        res["exit"] = p.returncode
        out.append(res)
    return out


def _common_args(a: argparse.Namespace) -> list[str]:
    return ["--backend", a.backend, "--ops", ",".join(a.ops), "--dtypes", ",".join(a.dtypes),
            "--sizes", ",".join(map(str, a.sizes)), "--iters", str(a.iters), "--warmup", str(a.warmup),
            "--timeout", str(a.timeout), "--op-timeout", str(a.op_timeout), "--deadline", str(a.deadline),
            "--check-iters", str(a.check_iters), "--corrupt-rank", str(a.corrupt_rank),
            *(["--reference"] if a.reference else [])]  # fmt: skip


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="default: nccl if CUDA, else gloo")
    p.add_argument("--ops", type=lambda s: [x for x in s.split(",") if x], default=list(OPS))
    p.add_argument("--dtypes", type=lambda s: [x for x in s.split(",") if x], default=list(DTYPES))
    p.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",") if x], default=None,
                   help="bytes per rank, e.g. 8,1K,1M,1G (default: 8B..1GiB x4 on GPU, 8B..4MiB on CPU)")  # fmt: skip
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=float, default=60, help="rendezvous timeout (s)")
    p.add_argument("--op-timeout", type=float, default=60, help="per-collective timeout (s)")
    p.add_argument("--deadline", type=float, default=600, help="outer watchdog for the whole rank (s)")
    p.add_argument("--check-iters", type=int, default=2, help="runs on the exact pattern whose results are checked")
    p.add_argument("--reference", action="store_true", help="also time all_reduce as plain PyTorch (side by side)")
    p.add_argument("--corrupt-rank", type=int, default=-1, help="fault injection: this rank contributes a wrong value")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llmfleet.nccl_check", description=__doc__.split("\n\n")[0])
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
    add_common(rp)
    lp = sub.add_parser("local", help="N ranks of a single-node world on this host")
    lp.add_argument("--nproc", type=int, required=True)
    lp.add_argument("--port", type=int, default=0)
    lp.add_argument("--compact", action="store_true")
    add_common(lp)
    a = ap.parse_args(argv)
    if a.backend is None:
        a.backend = _default_backend()
    if a.sizes is None:
        a.sizes = size_sweep(8, 1024**3) if a.backend == "nccl" else size_sweep(8, 4 * 1024**2)
    bad = [o for o in a.ops if o not in OPS] + [d for d in a.dtypes if d not in DTYPES]
    if bad:
        ap.error(f"unknown op/dtype {bad}: ops {OPS}, dtypes {DTYPES}")
    return run_rank(a) if a.cmd == "rank" else launch_local(a)


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
    """Start this node's ranks of one world and wait for them (with a deadline).

    spec: python, world, master, port, ranks ([[global_rank, local_rank], ...]), env (dict),
    args (list of extra rank args), deadline, pythonpath, delay_ranks ({rank: seconds}, fault injection)."""
    env = {**os.environ, **spec.get("env", {})}
    if spec.get("pythonpath"):
        env["PYTHONPATH"] = spec["pythonpath"] + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    procs = []
    numactl = shutil.which("numactl")
    for rank, local in spec["ranks"]:
        argv = rank_argv(spec, rank, local, numactl)
        procs.append((rank, subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)))
    out = collect(procs, spec["deadline"] + 15)
    for res in out:
        res["node"] = socket.gethostname()
    return out


def rank_argv(spec: dict[str, Any], rank: int, local: int, numactl: str | None) -> list[str]:
    """The command of one rank; bound to its GPU's NUMA node (CPUs and memory) when the topology
    gave one (spec['numa_nodes'][local]) and numactl is installed, as engines pin their ranks."""
    argv = [spec["python"], "-m", "llmfleet.nccl_check", "rank", "--rank", str(rank), "--world", str(spec["world"]),
            "--local-rank", str(local), "--master", spec["master"], "--port", str(spec["port"]),
            "--deadline", str(spec["deadline"]), *spec.get("args", [])]  # fmt: skip
    delay = (spec.get("delay_ranks") or {}).get(str(rank))
    if delay:
        argv += ["--delay-start", str(delay)]
    numa = spec.get("numa_nodes") or []
    if numactl and local < len(numa) and numa[local] is not None:
        argv = [numactl, f"--cpunodebind={numa[local]}", f"--membind={numa[local]}", *argv]
    return argv


if __name__ == "__main__":
    sys.exit(main())
