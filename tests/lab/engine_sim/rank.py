"""One rank process (`engine_sim.py _rank -`, its config JSON on stdin): the gloo world, loading its share
of the checkpoint, the engine loop and, on the head's global rank 0, the HTTP API. Only rank processes
import torch."""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import resource
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .api import Api, Job
from .checkpoint import (
    INDEX_NAME,
    LAYER_RE,
    SAFETENSORS_CODES,
    SafetensorError,
    model_config,
    plan_share,
    read_span,
    shard_files,
)
from .faults import FAULT_SIGNALS, Fault, mark_fired, parse_fault
from .logs import Log, progress_line, worker_tag, write_all

REPO = Path(__file__).resolve().parents[3]  # the checkout: module_utils/ holds llmfleet when it is not installed

HEARTBEAT_S = 0.25  # rank 0 broadcasts a command at least this often
DRAIN_S = 5.0  # how long rank 0 lets running requests finish after SIGTERM
CMD_NOOP, CMD_STEP, CMD_SHUTDOWN = 0, 1, 2
AVAIL_GB = 79.10  # the "GPU memory" the simulator reports
KV_TOKENS = 524288


class DistBackendError(RuntimeError):
    pass


DistBackendError.__module__ = "torch.distributed"


def _is_timeout(e: BaseException) -> bool:
    return "timed out" in str(e).lower() or "timeout" in type(e).__name__.lower()


class World:
    """The gloo process group, with NCCL's behaviour on a lost peer: the watchdog waits until the
    distributed timeout, then fails (LLMFLEET_SIM_PEER_LOSS=crash: fail at once)."""

    def __init__(self, rank: Rank):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.r = torch, dist, rank
        self.seq = 0

    def _guard(self, op: str, fn: Any, numel: int = 0) -> Any:
        r = self.r
        self.seq += 1
        t0 = time.monotonic()
        try:
            return fn()
        except Exception as e:
            r.on_broken(e)
            ms = int((time.monotonic() - t0) * 1000)
            if _is_timeout(e) and op == "INIT":
                raise  # the rendezvous' own message names how many ranks joined
            if not _is_timeout(e):
                if os.environ.get("LLMFLEET_SIM_PEER_LOSS") == "crash":
                    raise
                cause = (str(e).strip().splitlines() or [type(e).__name__])[0]
                r.log(
                    f"Watchdog: collective operation on rank {r.g} did not complete; waiting up to dist-timeout "
                    f"({r.timeout}s) before failing. Cause: {cause}",
                    "ERROR",
                )
                while time.monotonic() < t0 + r.timeout:
                    time.sleep(max(0.01, min(1.0, t0 + r.timeout - time.monotonic())))
                ms = int((time.monotonic() - t0) * 1000)
            raise DistBackendError(
                f"[Rank {r.g}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={self.seq}, "
                f"OpType={op}, NumelIn={numel}, NumelOut={numel}, Timeout(ms)={r.timeout * 1000}) ran for {ms} "
                "milliseconds before timing out."
            ) from e

    def init(self) -> None:
        cfg = self.r.cfg
        self._guard(
            "INIT",
            lambda: self.dist.init_process_group(
                "gloo",
                init_method=f"tcp://{cfg['addr']}:{cfg['dist_port']}",
                rank=self.r.g,
                world_size=cfg["world"],
                timeout=datetime.timedelta(seconds=self.r.timeout),
            ),
        )

    def all_reduce(self, t: Any, op: Any = None) -> None:
        op = self.dist.ReduceOp.SUM if op is None else op
        self._guard("ALLREDUCE", lambda: self.dist.all_reduce(t, op=op), t.numel())

    def broadcast(self, t: Any) -> None:
        self._guard("BROADCAST", lambda: self.dist.broadcast(t, 0), t.numel())


class Rank:
    def __init__(self, cfg: dict[str, Any]):
        self.cfg = cfg
        self.flavour = cfg["flavour"]
        self.g = cfg["rank"]
        self.tp_rank, self.pp_rank = self.g % cfg["tp"], self.g // cfg["tp"]
        self.timeout = cfg["timeout"]
        self.local = self.g - cfg["node_rank"] * cfg["rpn"]
        # vLLM: tagged `Worker` until the rank knows its place in the world (then worker_tag)
        self.log = (
            Log(self.flavour, self.tp_rank, self.pp_rank) if self.flavour == "sglang" else Log("vllm", role="Worker")
        )
        self.faults = [f for f in (parse_fault(s) for s in cfg["faults"]) if f.applies_to(self.g)]
        self.is_api = self.g == 0 and cfg["is_head"]
        self.serving = False
        self.shutdown = False
        self.api: Api | None = None
        self.world: World | None = None

    # faults
    def _fire(self, f: Fault) -> None:
        mark_fired(f, self.cfg["state_dir"])

    def crash(self, f: Fault) -> None:
        self._fire(f)
        if f.signal:
            # A WARNING for vLLM: a real signal death leaves no line of its own (the executor reports it)
            self.log(f"injected fault {f.spec} (LLMFLEET_SIM_FAULT): killing myself with SIG{f.signal}", "WARNING")
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.kill(os.getpid(), FAULT_SIGNALS[f.signal])
            time.sleep(10)
            os._exit(128 + FAULT_SIGNALS[f.signal])
        err = RuntimeError(f"injected fault: {f.spec} (LLMFLEET_SIM_FAULT, phase {f.phase}, global rank {self.g})")
        err.sim_exit = f.exit  # type: ignore[attr-defined]
        raise err

    def fault_point(self, phase: str) -> None:
        for f in self.faults:
            if f.kind in ("crash", "hang") and f.phase == phase and f.rank == self.g:
                if f.kind == "crash":
                    time.sleep(f.after)
                    self.crash(f)
                self._fire(f)
                while True:  # hang: no progress, no output, until killed
                    time.sleep(3600)

    def on_broken(self, e: BaseException) -> None:
        if self.api is not None:
            self.api.state.fail_all(f"engine world is broken on rank {self.g}: {type(e).__name__}: {e}".strip())

    # phases
    def run(self) -> None:
        cfg, log = self.cfg, self.log
        t_start = time.monotonic()
        self.fault_point("start")
        init = f"tcp://{cfg['addr']}:{cfg['dist_port']}"
        if self.flavour == "sglang":
            log("Init torch distributed begin.")
        else:
            log(f"world_size={cfg['world']} rank={self.g} local_rank={self.local} distributed_init_method={init} "
                "backend=gloo", src="parallel_state.py:1906")  # fmt: skip
        self.fault_point("rendezvous")
        import torch

        self.world = World(self)
        self.world.init()
        t = torch.tensor([float(self.g + 1)])
        self.world.all_reduce(t)
        want = cfg["world"] * (cfg["world"] + 1) / 2
        if float(t[0]) != want:
            raise RuntimeError(f"all_reduce sanity check failed: got {float(t[0])}, expected {want}")
        if self.flavour == "sglang":
            log("Init torch distributed ends. mem usage=0.00 GB")
        else:
            if self.local == 0:  # logger.info_once: the node's local rank 0 only
                log(f"rank {self.g} in world size {cfg['world']} is assigned as DP rank 0, PP rank {self.pp_rank}, "
                    f"PCP rank 0, TP rank {self.tp_rank}, ETP rank {self.tp_rank}, EP rank N/A, EPLB rank N/A",
                    src="parallel_state.py:2350")  # fmt: skip
            log.role = worker_tag(self.tp_rank, self.pp_rank, cfg["tp"], cfg["pp"])
        nbytes = self.load()
        avail = torch.tensor([AVAIL_GB - nbytes / 2**30])
        self.world.all_reduce(avail, self.world.dist.ReduceOp.MIN)  # the engines size the KV cache by the minimum
        if self.flavour == "sglang":
            log(f"KV Cache is allocated. #tokens: {KV_TOKENS}, K size: 1.00 GB, V size: 1.00 GB")
            log(f"Capture cuda graph begin. This can take up to several minutes. avail mem={float(avail[0]):.2f} GB")
            log(f"Capture cuda graph end. Time elapsed: 0.01 s. mem usage=0.00 GB. avail mem={float(avail[0]):.2f} GB.")
        else:
            self.vllm_warm_up(float(avail[0]), time.monotonic() - t_start)
        if self.is_api:
            self.api = Api(cfg, self)
            self.api.start()
        self.serve()

    def vllm_warm_up(self, avail_gib: float, took: float) -> None:
        """vLLM 0.32's CPU build after loading: torch.compile warm-up on every rank (not with --enforce-eager),
        every rank's KV-cache line (the last rank line before serving), the head's engine core summary."""
        cfg, log = self.cfg, self.log
        if not cfg.get("enforce_eager"):
            log("Warming up model for the compilation...", src="cpu_model_runner.py:87")
            log("Warming up done.", src="cpu_model_runner.py:91")
        space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")  # GiB per rank, as the CPU build reads it
        if space:
            log(
                f"Explicitly set ({round(float(space), 2)}/{AVAIL_GB}) GiB for KV cache on node 0.",
                src="cpu_worker.py:260",
            )
        else:
            kv, used = round(avail_gib * 0.9, 2), round(AVAIL_GB - avail_gib, 2)
            log(f"Auto set ({kv}/{AVAIL_GB}) GiB for KV cache on node 0, with {round(avail_gib, 2)} GiB requested memory "
                f"for the worker. {used} GiB memory was consumed by non-kv usages.", src="cpu_worker.py:260")  # fmt: skip
        if self.is_api:  # the engine core (one per deployment, on the head)
            core = Log("vllm", role="EngineCore", pid=cfg["parent_pid"])
            ctx = cfg["context"]
            core(f"CPU KV cache size: {KV_TOKENS:,} tokens, Maximum concurrency for {ctx:,} tokens per request: "
                 f"{KV_TOKENS / ctx:.2f}x", src="kv_cache_utils.py:2327")  # fmt: skip
            core(f"init engine (profile, create kv cache, warmup model) took {took:.2f} s", src="core.py:402")

    def load(self) -> int:  # noqa: PLR0912 (phases, faults and progress in load order)
        cfg, log = self.cfg, self.log
        try:
            from llmfleet.stage.checkpoint import HeaderError, parse_header
        except ImportError:  # not installed in this interpreter: the checkout this package lives in
            sys.path.insert(0, str(REPO / "module_utils"))
            from llmfleet.stage.checkpoint import HeaderError, parse_header

        t0 = time.monotonic()
        model = cfg["model"]
        if self.flavour == "sglang":
            log(f"Load weight begin. avail mem={AVAIL_GB:.2f} GB")
        else:
            log(f"Starting to load model {model}...", src="cpu_model_runner.py:68")
        shards = shard_files(model)
        headers = {}
        for shard in shards:
            path = os.path.join(model, shard)
            try:
                headers[shard] = parse_header(path)
            except HeaderError as e:
                code = "HeaderTooLarge" if "exceeds" in str(e) else SAFETENSORS_CODES.get(e.kind, "InvalidHeader")
                log(f"Failed to load checkpoint shard {path}", "ERROR")
                raise SafetensorError(f"Error while deserializing header: {code} ({path}: {e})") from None
            except FileNotFoundError:
                raise FileNotFoundError(f"checkpoint shard {path} named by {INDEX_NAME} does not exist") from None
        names = [n for h in headers.values() for n in h["tensors"]]
        config = model_config(model)
        layers = config.get("num_hidden_layers") or (config.get("text_config") or {}).get("num_hidden_layers")
        if not isinstance(layers, int) or layers < 1:
            layers = 1 + max((int(m.group(1)) for n in names if (m := LAYER_RE.search(n))), default=0)
        share = plan_share(names, layers, cfg["tp"], cfg["pp"], self.tp_rank, self.pp_rank)
        slow = sum(f.seconds for f in self.faults if f.kind == "slow_load" and f.applies_to(self.g))
        for f in self.faults:
            if f.kind == "slow_load" and f.applies_to(self.g):
                self._fire(f)
        total = len(shards)
        if self.flavour == "vllm" and self.local == 0:
            log(f"Initializing model took {time.monotonic() - t0:.6f} seconds", src="base_loader.py:82")
        self._progress(progress_line(0, total, 0.0))
        nbytes = 0
        with ThreadPoolExecutor(max_workers=cfg["threads"]) as pool:
            for k, shard in enumerate(shards):
                deadline = time.monotonic() + slow / max(total, 1)
                while time.monotonic() < deadline:  # slow_load: a line per second, as tqdm would
                    time.sleep(min(1.0, deadline - time.monotonic()))
                    self._progress(progress_line(k, total, time.monotonic() - t0))
                path, h = os.path.join(model, shard), headers[shard]
                base = 8 + h["header_len"]
                spans = [(base + t["data_offsets"][0], t["data_offsets"][1] - t["data_offsets"][0])
                         for n, t in sorted(h["tensors"].items()) if n in share]  # fmt: skip
                nbytes += sum(pool.map(lambda s, p=path: read_span(p, *s), spans))
                self._progress(progress_line(k + 1, total, time.monotonic() - t0))
                if k == 0:
                    self.fault_point("load")
        if not shards:
            self.fault_point("load")
        dt = time.monotonic() - t0
        gib = nbytes / 2**30
        log(
            f"Read {len(share)} of {len(names)} tensors ({nbytes} bytes, {cfg['threads']} threads): "
            f"the share of PP rank {self.pp_rank} TP rank {self.tp_rank} (llmfleet simulator)"
        )
        if self.flavour == "sglang":
            log(
                f"Load weight end. type=Sim, dtype=torch.bfloat16, avail mem={AVAIL_GB - gib:.2f} GB, mem usage={gib:.2f} GB."
            )
        elif self.local == 0:  # logger.info_once: once per node (the CPU build logs no `Model loading took`)
            log(f"Loading weights took {dt:.2f} seconds", src="default_loader.py:501")
        return nbytes

    def _progress(self, line: str) -> None:
        """SGLang: every rank logs its progress; vLLM: tqdm's bar, global rank 0 only (a headless node shows none)."""
        if self.flavour == "sglang" or self.g == 0:
            self.log.progress(line)

    def request_shutdown(self, *_: Any) -> None:
        self.shutdown = True  # a plain flag: the loop wakes at least every HEARTBEAT_S

    def serve(self) -> None:  # noqa: PLR0912 (the engine loop: leader, followers, drain, faults)
        import torch

        world, cfg = self.world, self.cfg
        assert world is not None
        self.serving = True
        start = time.monotonic()
        crashes = [f for f in self.faults if f.kind == "crash" and f.phase == "serve" and f.rank == self.g]
        leader = self.g == 0
        state = self.api.state if self.api else None
        if state is not None and self.flavour == "sglang":
            threading.Thread(target=self.api.warmup, daemon=True).start()
        fd = cfg.get("ready_fd")
        if fd is not None:
            write_all(fd, b"ready\n")
            os.close(fd)
        cmd_t = torch.zeros(3, dtype=torch.int64)
        drain_deadline = None
        seq = 0
        while True:
            for f in crashes:
                if time.monotonic() - start >= f.after:
                    self.crash(f)
            jobs: list[Job] = []
            if leader:
                if state is not None:
                    if not state.pending() and not self.shutdown:
                        state.wake.wait(HEARTBEAT_S)
                    state.wake.clear()
                    jobs = state.take()
                elif not self.shutdown:
                    time.sleep(HEARTBEAT_S)
                if self.shutdown and drain_deadline is None:
                    drain_deadline = time.monotonic() + DRAIN_S
                    if state is not None:
                        state.draining = True
                if jobs:
                    cmd = CMD_STEP
                elif self.shutdown and (state is None or state.active <= 0 or time.monotonic() > drain_deadline):
                    cmd = CMD_SHUTDOWN
                else:
                    cmd = CMD_NOOP
                seq += 1
                cmd_t[0], cmd_t[1], cmd_t[2] = cmd, seq, len(jobs)
            world.broadcast(cmd_t)
            ack = torch.ones(1, dtype=torch.int64)
            world.all_reduce(ack)  # every rank took part in this step
            if int(ack[0]) != cfg["world"]:
                raise RuntimeError(f"step {int(cmd_t[1])}: {int(ack[0])} of {cfg['world']} ranks acknowledged")
            if state is not None:
                state.finish(jobs)
            if int(cmd_t[0]) == CMD_SHUTDOWN:
                if self.flavour == "sglang":
                    self.log("Received ShutdownReq from rank 0; scheduler exiting.")
                else:
                    self.log("Parent process exited, terminating worker queues", src="multiproc_executor.py:843")
                if self.api is not None:
                    self.api.stop()
                return


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def rank_main(cfg_text: str) -> int:
    cfg = json.loads(cfg_text)
    _die_with_parent(cfg["parent_pid"])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the node main process decides (systemd signals the whole cgroup)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank = Rank(cfg)
    signal.signal(signal.SIGUSR1, rank.request_shutdown)
    code = 0
    try:
        rank.run()
    except BaseException as e:
        code = getattr(e, "sim_exit", 1)
        tb = traceback.format_exc().rstrip()
        if rank.flavour == "sglang":
            rank.log(f"Scheduler hit an exception: {tb}", "ERROR")
        elif rank.serving:  # vLLM's WorkerProc.worker_main: logger.exception, then the process ends
            rank.log(f"WorkerProc failed.\n{tb}", "ERROR", src="multiproc_executor.py:959")
        else:
            rank.log(f"WorkerProc failed to start.\n{tb}", "ERROR", src="multiproc_executor.py:953")
    os._exit(code)
