"""The lab's engine simulator (the package tests/lab/engine_sim/, run as tests/lab/engine_sim.py): CLI,
deterministic answers, fault specs, and real gloo worlds of node main processes on 127.0.0.1 through the
sim-bin shims. Every node main runs in its own process group (its ranks too), killed in teardown whatever
happened."""

import contextlib
import http.client
import http.server
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmfleet.engine import command as engine
from llmfleet.wrapper import run as wrapper
from tests.helpers import burst
from tests.helpers.ckpt import make_checkpoint
from tests.lab.engine_sim import answers, api, checkpoint, faults

ROOT = Path(__file__).resolve().parents[2]
WRAP = [sys.executable, "-m", "llmfleet", "exec"]  # the real wrapper, as the unit runs it
BIN = ROOT / "tests" / "lab" / "sim-bin"
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (gloo)")
Q_ZH = "计算 37\u00d719\uff0c只回答数字。"  # "calculate 37 times 19, answer with the number only"
Q_EN = "What is 37\u00d719? Reply with only the number."


def sg_tag(t: int, p: int) -> str:
    """The SGLang-style rank prefix as a regex."""
    return rf"\[\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d TP{t} PP{p}\] "


def vl_tag(tag: str, level: str = "INFO", src: str = r"[\w.]+:\d+") -> str:
    """vLLM 0.32's logger prefix as a regex: `(Worker_TP1 pid=N) INFO mm-dd hh:mm:ss [file.py:line] `."""
    return rf"\({tag} pid=\d+\) {level} \d\d-\d\d \d\d:\d\d:\d\d \[{src}\] "


def observed(node, plan):
    """The node's output through the wrapper's log observer, with the READY rule the role would give it
    (plan: engine.ready_rule's profile, node rank, nodes, ranks per node, argv)."""
    rule = engine.ready_rule(*plan)
    obs = wrapper.LogObserver(rule["regex"], rule["count"])
    for i, line in enumerate(node.out.splitlines()):
        if line.strip():
            obs.feed(line, float(i))
    return obs


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "current weather",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["location", "unit"]}}}]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One node main process (what the unit's wrapper would start), output to a file."""

    def __init__(self, flavour: str, args: list[str], env: dict[str, str], log: Path, argv: list | None = None):
        self.log = log
        with open(log, "wb") as f:
            argv = argv or [BIN / flavour, *args]  # argv: the node main under another command (the wrapper)
            self.p = subprocess.Popen(list(map(str, argv)), stdout=f, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env, start_new_session=True)  # fmt: skip

    @property
    def out(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.log.name} still running after {timeout}s:\n{self.out[-4000:]}")

    def wait_for(self, needle: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.out:
            if time.monotonic() > deadline:
                pytest.fail(f"{needle!r} not in {self.log.name} after {timeout}s:\n{self.out[-4000:]}")
            time.sleep(0.1)

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, sig)


@pytest.fixture
def lab(tmp_path):
    """start(flavour, args, name, env) -> Node; kills every process group in teardown."""
    started: list[Node] = []
    ckpt = make_checkpoint(tmp_path / "ckpt", shards=2, tensors_per_shard=4, shape=(8, 16))
    state = tmp_path / "state"

    def start(flavour, args, name, argv=None, **env):
        full = {k: v for k, v in os.environ.items() if not k.startswith(("LLMFLEET_SIM_", "VLLM_"))}
        full.update(GLOO_SOCKET_IFNAME="lo", LLMFLEET_SIM_STATE_DIR=str(state), **env)
        node = Node(flavour, args, full, tmp_path / f"{name}.log", argv)
        started.append(node)
        return node

    start.ckpt, start.state, start.tmp = ckpt, state, tmp_path
    yield start
    for node in started:
        node.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.p.wait(10)


def call(port, method, path, body=None, key=None, timeout=20):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    try:
        return r.status, json.loads(data) if data else None
    except ValueError:
        return r.status, data.decode(errors="replace")


def sse(port, path, body, key=None):
    """The data: payloads of an SSE stream, in order (JSON decoded except [DONE])."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request("POST", path, body=json.dumps({**body, "stream": True}), headers=headers)
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type").startswith("text/event-stream")
    raw = r.read().decode()
    conn.close()
    events = [block.removeprefix("data: ") for block in raw.split("\n\n") if block.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def chat(question, **kw):
    return {"messages": [{"role": "user", "content": question}], **kw}


def wait_healthy(port, nodes, timeout=60, path="/health"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for n in nodes:
            if n.p.poll() is not None:
                pytest.fail(f"{n.log.name} exited {n.p.returncode} before serving:\n{n.out[-4000:]}")
        with contextlib.suppress(OSError):
            if call(port, "GET", path, timeout=2)[0] == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"no 200 on :{port}{path} within {timeout}s:\n" + "\n".join(n.out[-3000:] for n in nodes))


# ---- pure functions -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "answer"),
    [(Q_ZH, "703"), (Q_EN, "703"), ("37 x 19", "703"), ("12*-3=", "-36"), ("Reply with exactly PONG.", "PONG"),
     ("只回答 OK。", "OK"), ("say exactly: “ready”", "ready"), ("hello", answers.FIXED_ANSWER)],
)  # fmt: skip
def test_deterministic_answers(text, answer):
    assert answers.answer_for(text) == answer


def test_the_api_server_takes_a_burst_of_connections_like_uvicorn():
    """A benchmark at concurrency 32 opens 32 connections at once; past socketserver's backlog of 5 each waited 1 s."""
    server = api.Server(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # nothing accepts: only the backlog
    try:
        assert burst.completed(server.server_address[1], 64) == 64
    finally:
        server.server_close()


def test_chat_generation_thinking_tools_and_length():
    cfg = {"flavour": "vllm", "context": 4096, "reasoning_parser": "qwen3", "tool_parser": "hermes", "auto_tool": True}
    g = answers.chat_gen(chat(Q_EN), cfg)
    assert g.content == "703" and g.reasoning and g.finish == "stop"
    assert g.completion_tokens == answers.ntokens(g.reasoning) + 1 and g.prompt_tokens > answers.ntokens(Q_EN)
    off = answers.chat_gen(chat(Q_EN, chat_template_kwargs={"enable_thinking": False}), cfg)
    assert off.content == "703" and off.reasoning is None and off.completion_tokens == 1
    short = answers.chat_gen(chat(Q_EN, max_tokens=3), cfg)
    assert short.finish == "length" and short.content is None and short.completion_tokens == 3
    inline = answers.chat_gen(
        chat(Q_EN, chat_template_kwargs={"enable_thinking": True}), {**cfg, "reasoning_parser": None}
    )
    assert inline.content.startswith("<think>\n") and inline.content.endswith("</think>\n\n703")
    call_ = answers.chat_gen(chat("Use get_weather for the capital of France", tools=WEATHER), cfg)
    assert call_.finish == "tool_calls" and call_.content is None
    assert json.loads(call_.tool_calls[0]["function"]["arguments"]) == {"location": "Paris", "unit": "celsius"}
    assert answers.chat_gen(chat("Use get_weather", tools=WEATHER, tool_choice="none"), cfg).tool_calls == []
    with pytest.raises(answers.RequestError, match="enable-auto-tool-choice"):
        answers.chat_gen(chat("Use get_weather", tools=WEATHER), {**cfg, "auto_tool": False})
    with pytest.raises(answers.RequestError, match="maximum context length is 4096"):
        answers.chat_gen(chat("hi", max_tokens=5000), cfg)
    assert answers.completion_gen({"prompt": "37*19="}, cfg).content == "703"


@pytest.mark.parametrize(
    "spec",
    ["crash:rank=1:phase=load:exit=3", "crash:rank=0:phase=serve:signal=SEGV:after=2.5:once", "hang:rank=2:phase=rendezvous",
     "slow_load:seconds=3", "slow_load:seconds=1:rank=1:once", "no_done", "no_done:once", "hang:rank=0:phase=serve",
     "hang:rank=0:phase=serve:after=2.5:once"],
)  # fmt: skip
def test_fault_specs_parse(spec):
    f = faults.parse_fault(spec, world=4)
    assert f.spec == spec and f.once == spec.endswith(":once")


@pytest.mark.parametrize(
    ("spec", "why"),
    [("boom:rank=1", "unknown kind"), ("crash:rank=1", "needs phase"), ("crash:rank=x:phase=load", "not an integer"),
     ("crash:rank=4:phase=load", "no such global rank"), ("crash:rank=0:phase=warmup", "phase='warmup'"),
     ("hang:rank=1:phase=serve", "rank=0 (the API's rank)"), ("hang:rank=0:phase=load:after=1", "after= is for"),
     ("hang:rank=0:phase=warmup", "phase='warmup'"), ("crash:rank=0:phase=load:signal=HUP", "SEGV"),
     ("crash:rank=0:phase=load:exit=3:signal=KILL", "exclude"), ("slow_load:rank=1", "needs seconds"),
     ("no_done:rank=1", "not valid for no_done"), ("crash:rank=0:rank=1:phase=load", "twice")],
)  # fmt: skip
def test_bad_fault_specs_are_named(spec, why):
    with pytest.raises(faults.FaultSpecError, match=re.escape(why)) as e:
        faults.parse_fault(spec, world=4)
    assert repr(spec) in str(e.value)


def test_once_marker_is_sha1_of_the_spec(tmp_path):
    f = faults.parse_fault("crash:rank=0:phase=start:once")
    import hashlib

    assert f.marker(str(tmp_path)) == tmp_path / f"fault-{hashlib.sha1(f.spec.encode()).hexdigest()}.done"  # noqa: S324


@pytest.mark.parametrize(("tp", "pp", "layers"), [(1, 1, 4), (2, 1, 4), (2, 2, 4), (1, 3, 7), (4, 2, 3)])
def test_rank_shares_partition_the_checkpoint(tp, pp, layers):
    names = [f"model.layers.{n}.w{i}.weight" for n in range(layers) for i in range(3)]
    names += ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    shares = [checkpoint.plan_share(names, layers, tp, pp, g % tp, g // tp) for g in range(tp * pp)]
    assert sorted(n for s in shares for n in s) == sorted(names)  # every tensor, exactly once
    assert "model.embed_tokens.weight" in set().union(*shares[:tp])  # stage 0
    assert "lm_head.weight" in set().union(*shares[-tp:])  # last stage
    for g, share in enumerate(shares):
        stages = {checkpoint.tensor_stage(n, layers, pp) for n in share}
        assert stages <= {g // tp}


# ---- CLI (node main only: no torch) ------------------------------------------------------------

SGLANG_FLAGS = """--model-path --served-model-name --tp-size --tensor-parallel-size --pp-size --pipeline-parallel-size
--nnodes --node-rank --dist-init-addr --dist-timeout --host --port --api-key --config --context-length
--model-loader-extra-config --mem-fraction-static --max-running-requests --max-prefill-tokens --page-size
--reasoning-parser --tool-call-parser --disable-radix-cache --enable-metrics --enable-metrics-for-all-schedulers
--enable-cache-report --kv-cache-dtype --linear-attn-prefill-backend --linear-attn-decode-backend --mamba-ssm-dtype
--mamba-full-memory-ratio --speculative-algorithm --speculative-num-steps --speculative-eagle-topk
--speculative-num-draft-tokens --trust-remote-code --log-level --disable-cuda-graph --chunked-prefill-size
--quantization --dtype --attention-backend --watchdog-timeout --random-seed""".split()
VLLM_FLAGS = """--model --served-model-name --tensor-parallel-size -tp --pipeline-parallel-size -pp --nnodes --node-rank
--master-addr --master-port --headless --distributed-timeout-seconds --host --port --api-key --max-model-len
--gpu-memory-utilization --max-num-batched-tokens --max-num-seqs --mamba-ssm-cache-dtype --reasoning-parser
--enable-auto-tool-choice --tool-call-parser --kv-cache-dtype --enable-prefix-caching --no-enable-prefix-caching
--kv-transfer-config --trust-remote-code --quantization --dtype --enforce-eager --compilation-config --load-format
--model-loader-extra-config --disable-log-requests --uvicorn-log-level --seed""".split()


def cli(flavour, *args, env=None, timeout=20):
    full = {k: v for k, v in os.environ.items() if not k.startswith("LLMFLEET_SIM_")}
    return subprocess.run([str(BIN / flavour), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**full, **(env or {})}, check=False)  # fmt: skip


@pytest.mark.parametrize(("flavour", "help_args", "flags"),
                         [("sglang", ["serve", "--help"], SGLANG_FLAGS), ("vllm", ["serve", "--help=all"], VLLM_FLAGS),
                          ("vllm", ["serve", "--help"], VLLM_FLAGS)])  # fmt: skip
def test_help_lists_every_accepted_flag(flavour, help_args, flags):
    cp = cli(flavour, *help_args)
    assert cp.returncode == 0
    listed = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", cp.stdout))
    assert set(flags) <= listed, set(flags) - listed
    assert "ENGINE SIMULATOR" in cp.stdout


def test_version_and_unknown_flags(tmp_path):
    assert cli("sglang", "--version").stdout.strip() == "sglang 0.5.23 (llmfleet simulator)"
    assert cli("vllm", "--version").stdout.strip() == "vllm 0.32.0 (llmfleet simulator)"
    cp = cli("sglang", "serve", "--model-path", tmp_path, "--tp-size", "2", "--foo", "1")
    assert cp.returncode == 2 and "error: unrecognized arguments: --foo 1" in cp.stderr
    cp = cli("vllm", "serve", tmp_path, "--tp", "2")
    assert cp.returncode == 2 and "error: unrecognized arguments: --tp 2" in cp.stderr
    cp = cli("sglang", "serve", "--model-path", tmp_path, "--port", "x")
    assert cp.returncode == 2 and "argument --port: invalid int value: 'x'" in cp.stderr
    cp = cli("vllm", "serve", tmp_path, "--kv-transfer-config", "{nope")
    assert cp.returncode == 2 and "invalid JSON" in cp.stderr


def test_startup_errors_exit_before_any_rank(tmp_path):
    cp = cli("sglang", "serve", "--model-path", tmp_path, "--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1")
    assert (
        cp.returncode == 2 and "--tp-size 3 x --pp-size 1 = 3 ranks cannot be split evenly over --nnodes 2" in cp.stderr
    )
    cp = cli("vllm", "serve", tmp_path, "-tp", "4", "-pp", "2", "--nnodes", "3")
    assert cp.returncode == 2 and "--tensor-parallel-size 4 x --pipeline-parallel-size 2 = 8 ranks" in cp.stderr
    cp = cli("sglang", "serve", "--model-path", tmp_path, "--nnodes", "2")
    assert cp.returncode == 2 and "--dist-init-addr HOST:PORT is required" in cp.stderr
    cp = cli(
        "sglang",
        "serve",
        "--model-path",
        tmp_path,
        "--tp-size",
        "2",
        env={"LLMFLEET_SIM_FAULT": "crash:rank=5:phase=load"},
    )
    assert cp.returncode == 2 and "bad LLMFLEET_SIM_FAULT spec 'crash:rank=5:phase=load'" in cp.stderr
    missing = tmp_path / "no-such-model"
    cp = cli("vllm", "serve", missing)
    assert cp.returncode == 1 and f"model path {missing} does not exist" in cp.stdout
    assert cp.stdout.startswith("llmfleet ENGINE SIMULATOR (not a real inference engine) imitating vllm 0.32.0")


# ---- real worlds ---------------------------------------------------------------------------------


@needs_torch
def test_sglang_two_nodes_tp2_pp2_serves_and_stops_on_rank0_shutdown(lab):
    dport, hport, wport = free_port(), free_port(), free_port()
    config = lab.tmp / "engine.yaml"
    config.write_text('api-key: "sekrit"\nreasoning_parser: qwen3\n')
    common = ["serve", "--model-path", lab.ckpt, "--served-model-name", "demo", "--tp-size", 2, "--pp-size", 2,
              "--nnodes", 2, "--dist-init-addr", f"127.0.0.1:{dport}", "--dist-timeout", 30, "--host", "127.0.0.1",
              "--tool-call-parser", "qwen25", "--model-loader-extra-config", '{"num_threads": 2}']  # fmt: skip
    head = lab("sglang", [*common, "--node-rank", 0, "--port", hport, "--config", config], "head")
    worker = lab("sglang", [*common, "--node-rank", 1, "--port", wport], "worker")
    wait_healthy(hport, [head, worker])
    head.wait_for("The server is fired up and ready to roll!")
    assert f"Uvicorn running on http://127.0.0.1:{hport}" in head.out
    assert "llmfleet ENGINE SIMULATOR (not a real inference engine) imitating sglang" in head.out
    # SGLang logs its arguments, the API key from --config included: what the wrapper must redact
    args_line = next(ln for ln in head.out.splitlines() if "server_args=ServerArgs(" in ln)
    assert re.match(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] server_args=ServerArgs\(model_path='", args_line)
    assert "api_key='sekrit'" in args_line and "tp_size=2" in args_line
    redact = wrapper.Redactor()
    redact.add("sekrit")
    assert "api_key='***'" in redact.text(args_line) and "sekrit" not in redact.text(args_line)
    assert "api_key=None" in next(ln for ln in worker.out.splitlines() if "server_args=" in ln)
    # every rank's phases, tagged; node 0 holds global ranks 0-1 (PP0), node 1 ranks 2-3 (PP1)
    for node, p in ((head, 0), (worker, 1)):
        for t in (0, 1):
            tag = sg_tag(t, p)
            for phrase in ("Init torch distributed begin.", "Init torch distributed ends.", "Load weight begin.",
                           "Loading safetensors checkpoint shards:  50% Completed | 1/2", "Load weight end. type=Sim",
                           "Capture cuda graph begin.", "Capture cuda graph end."):  # fmt: skip
                assert re.search(tag + re.escape(phrase), node.out), (tag, phrase, node.out)
    read = [int(n) for n in re.findall(r"Read (\d+) of 8 tensors", head.out + worker.out)]
    assert sorted(read) == [2, 2, 2, 2]  # PP splits the layers, TP round-robins within the stage
    # API key from --config
    assert call(hport, "GET", "/v1/models")[0] == 401
    assert call(hport, "POST", "/v1/chat/completions", chat(Q_ZH), key="wrong")[0] == 401
    status, models = call(hport, "GET", "/v1/models", key="sekrit")
    assert status == 200 and [m["id"] for m in models["data"]] == ["demo"]
    assert models["data"][0]["owned_by"] == "llmfleet-sim-sglang"
    status, r = call(hport, "POST", "/v1/chat/completions",
                     chat(Q_ZH, chat_template_kwargs={"enable_thinking": False}), key="sekrit")  # fmt: skip
    assert status == 200 and r["choices"][0]["message"]["content"] == "703", r
    assert r["choices"][0]["message"]["reasoning_content"] is None
    u = r["usage"]
    assert u["completion_tokens"] == 1 and u["total_tokens"] == u["prompt_tokens"] + 1
    status, r = call(hport, "POST", "/v1/chat/completions", chat(Q_EN, model="demo"), key="sekrit")
    msg = r["choices"][0]["message"]
    assert status == 200 and msg["content"] == "703" and "703" in msg["reasoning_content"]  # the parser is on
    events = sse(hport, "/v1/chat/completions", chat(Q_EN, stream_options={"include_usage": True}), key="sekrit")
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "703"
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == r["usage"]["completion_tokens"]
    status, r = call(hport, "POST", "/v1/completions", {"prompt": "37*19=", "max_tokens": 8}, key="sekrit")
    assert status == 200 and r["choices"][0]["text"] == "703" and r["object"] == "text_completion"
    status, r = call(hport, "POST", "/v1/chat/completions",
                     chat("Please call get_weather for Paris", tools=WEATHER), key="sekrit")  # fmt: skip
    assert status == 200 and r["choices"][0]["finish_reason"] == "tool_calls"
    fn = r["choices"][0]["message"]["tool_calls"][0]["function"]
    assert fn["name"] == "get_weather" and json.loads(fn["arguments"])["location"] == "Paris"
    status, r = call(hport, "POST", "/v1/chat/completions", chat(Q_EN, max_tokens=2), key="sekrit")
    assert status == 200 and r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 2
    assert call(hport, "POST", "/v1/chat/completions", chat(Q_EN, model="nope"), key="sekrit")[0] == 404
    assert call(hport, "GET", "/health_generate")[0] == 200
    # the worker node answers 200 on its dummy health server (SGLang's trap): no API there
    wait_healthy(wport, [worker])
    assert call(wport, "GET", "/health_generate")[0] == 200
    assert call(wport, "GET", "/v1/models")[0] == 404
    # systemd stops the worker first (SIGTERM to its whole cgroup): it waits for rank 0's ShutdownReq
    worker.signal_group(signal.SIGTERM)
    worker.wait_for("Received SIGTERM; waiting for rank-0 ShutdownReq", 10)
    time.sleep(1.0)
    assert worker.p.poll() is None
    assert call(hport, "POST", "/v1/chat/completions", chat(Q_ZH), key="sekrit")[0] == 200  # the world still steps
    head.p.send_signal(signal.SIGTERM)
    assert head.wait(30) == 0, head.out[-3000:]
    assert worker.wait(30) == 0, worker.out[-3000:]
    assert re.search(sg_tag(1, 1) + "Received ShutdownReq", worker.out)


@needs_torch
def test_vllm_single_node_tp2_serves_with_env_api_key_and_no_done_fault(lab):
    port = free_port()
    argv = ["serve", lab.ckpt, "--served-model-name", "m1", "m2", "-tp", 2, "--host", "127.0.0.1", "--port", port,
            "--distributed-timeout-seconds", 30, "--max-model-len", "8k"]  # fmt: skip
    node = lab("vllm", argv, "vllm", VLLM_API_KEY="k1", VLLM_CPU_KVCACHE_SPACE="1", LLMFLEET_SIM_FAULT="no_done:once")
    wait_healthy(port, [node], path="/ping")
    out = node.out
    # vLLM 0.32 (CPU build): per rank, once per node, and the API server's lines, as tests/fixtures/engines shows
    for t in (0, 1):
        for tag, phrase in (
            ("Worker", f"world_size=2 rank={t} local_rank={t} distributed_init_method=tcp://127.0.0.1:"),
            (f"Worker_TP{t}", f"Starting to load model {lab.ckpt}..."),
            (f"Worker_TP{t}", "Warming up model for the compilation..."),
            (f"Worker_TP{t}", "Warming up done."),
            (f"Worker_TP{t}", "Explicitly set (1.0/79.1) GiB for KV cache on node 0."),
        ):
            assert re.search(vl_tag(tag) + re.escape(phrase), out), (t, phrase, out)
    for once, tag in (("rank 0 in world size 2 is assigned as DP rank 0, PP rank 0, PCP rank 0, TP rank 0", "Worker"),
                      ("Initializing model took", "Worker_TP0"), ("Loading weights took", "Worker_TP0"),
                      ("CPU KV cache size: 524,288 tokens", "EngineCore"),
                      ("init engine (profile, create kv cache, warmup model) took", "EngineCore"),
                      (f"Starting vLLM server on http://127.0.0.1:{port}", "APIServer"),
                      ("non-default args: {'model_tag'", "APIServer")):  # fmt: skip
        assert len(re.findall(vl_tag(tag) + re.escape(once), out)) == 1, (once, out)
    assert re.search(r"(?m)^Loading safetensors checkpoint shards: 100% Completed \| 2/2", out)  # tqdm: untagged
    assert out.count("\nINFO:     Application startup complete.\n") == 1
    for gpu_only in ("Model loading took", "Capturing CUDA graphs", "Graph capturing finished", "Uvicorn running on"):
        assert gpu_only not in out
    obs = observed(node, ("vllm", 0, 1, 2, ["vllm", *map(str, argv)]))
    # Ranks are separate processes: TP1's "Starting to load model" may come before TP0's once-per-node
    # "assigned as" line, and phases only move forward, so dist_ready can be passed over (as with the
    # real engine). Everything else comes in this order.
    phases = [p["phase"] for p in obs.phases]
    assert obs.ready and phases in (["dist_init", "dist_ready", "loading", "loaded", "serving"],
                                    ["dist_init", "loading", "loaded", "serving"]), phases  # fmt: skip
    assert obs.first_error is None  # also when the start-up ulimit WARNING (it quotes `OSError`) was printed
    status, models = call(port, "GET", "/v1/models", key="k1")
    assert [(m["id"], m["owned_by"], m["max_model_len"]) for m in models["data"]] == [
        ("m1", "llmfleet-sim-vllm", 8000), ("m2", "llmfleet-sim-vllm", 8000)]  # fmt: skip
    assert call(port, "POST", "/v1/chat/completions", chat(Q_EN))[0] == 401
    status, r = call(port, "POST", "/v1/chat/completions", chat(Q_EN, model="m2"), key="k1")
    assert status == 200 and r["choices"][0]["message"]["content"] == "703" and r["model"] == "m2"
    status, r = call(port, "POST", "/v1/chat/completions", chat("call get_weather", tools=WEATHER), key="k1")
    assert status == 400 and "--enable-auto-tool-choice" in r["error"]["message"]
    status, r = call(port, "POST", "/v1/chat/completions", chat(Q_EN, model="other"), key="k1")
    assert status == 404 and r["error"]["message"] == "The model `other` does not exist."
    first = sse(port, "/v1/chat/completions", chat(Q_ZH), key="k1")
    assert first[-1] != "[DONE]" and first[-1]["choices"][0]["finish_reason"] == "stop"  # no_done fired once
    assert sse(port, "/v1/completions", {"prompt": "37\u00d719"}, key="k1")[-1] == "[DONE]"
    node.p.send_signal(signal.SIGTERM)
    assert node.wait(30) == 0, node.out[-3000:]


@needs_torch
def test_hang_while_serving_is_found_by_the_wrappers_health_probe(lab):
    """hang:rank=0:phase=serve: generation hangs, /health and /v1/models stay 200; the real wrapper around the
    simulator stops it after --health-failures probes, exit 69 unhealthy-while-serving, nothing left running."""
    port = free_port()
    spec = "hang:rank=0:phase=serve:after=2:once"
    rec = lab.tmp / "termination.json"
    argv = [*WRAP, "--record", str(rec), "--health-url", f"http://127.0.0.1:{port}", "--health-model", "m1",
            "--health-interval", "0.5", "--health-timeout", "1", "--health-failures", "2", "--",
            str(BIN / "vllm"), "serve", lab.ckpt, "--served-model-name", "m1", "--host", "127.0.0.1", "--port", port,
            "--distributed-timeout-seconds", 30]  # fmt: skip
    node = lab("vllm", [], "vllm-hang", LLMFLEET_SIM_FAULT=spec, argv=argv)
    wait_healthy(port, [node], path="/health")
    node.wait_for("generation requests hang from now on")
    assert call(port, "GET", "/health")[0] == 200 and call(port, "GET", "/v1/models")[0] == 200  # the port is fine
    with pytest.raises(TimeoutError):
        call(port, "POST", "/v1/chat/completions", chat(Q_EN), timeout=1)
    assert node.wait(60) == wrapper.EXIT_UNHEALTHY, node.out[-3000:]
    r = json.loads(rec.read_text())
    assert r["verdict"] == "unhealthy-while-serving" and r["stop_requested"] and r["left_over_pids"] == 0
    assert r["health"]["last_good_at"] is not None and r["health"]["failures_in_row"] == 2
    assert faults.parse_fault(spec).marker(str(lab.state)).exists()  # a restarted unit comes up healthy
    assert subprocess.run(["pgrep", "-f", lab.ckpt], capture_output=True, check=False).returncode == 1


@needs_torch
def test_vllm_headless_worker_death_head_hangs_then_exits_0_with_engine_dead(lab):
    dport, port = free_port(), free_port()
    common = ["serve", lab.ckpt, "-tp", 2, "--nnodes", 2, "--master-addr", "127.0.0.1", "--master-port", dport,
              "--distributed-timeout-seconds", 6, "--host", "127.0.0.1", "--port", port, "--enforce-eager"]  # fmt: skip
    env = {"LLMFLEET_SIM_FAULT": "crash:rank=1:phase=serve:after=3", "LLMFLEET_SIM_VLLM_EXIT_S": "2"}
    head = lab("vllm", [*common, "--node-rank", 0], "head", **env)
    worker = lab("vllm", [*common, "--node-rank", 1, "--headless"], "worker", **env)
    wait_healthy(port, [head, worker])
    assert call(port, "POST", "/v1/chat/completions", chat(Q_EN))[0] == 200
    assert worker.wait(20) == 0  # vLLM 0.32 headless: the main process exits 0 at once when its worker died
    assert re.search(vl_tag("MainProcess", src=r"serve\.py:224") + r"Launching vLLM \(v0\.32\.0\) headless", worker.out)
    assert re.search(vl_tag("Worker_TP1", "ERROR") + r"WorkerProc failed\.", worker.out)
    assert re.search(vl_tag("Worker_TP1", "ERROR") + "RuntimeError: injected fault: crash:rank=1", worker.out)
    died = vl_tag("MainProcess", "ERROR", r"multiproc_executor\.py:315") + re.escape(
        "Worker proc VllmWorker-1 died unexpectedly (exit code: 1), shutting down executor."
    )
    assert re.search(died, worker.out), worker.out[-3000:]
    assert "EngineDeadError" not in worker.out and "Warming up" not in worker.out  # headless; --enforce-eager
    # docs/real-engine.md's two-node counts, headless side: no tqdm bar (global rank 0's), no API lines
    for line, count in (("rank 1 in world size 2 is assigned as", 1), ("Loading weights took", 1),
                        ("GiB for KV cache on node 0", 1), ("Loading safetensors checkpoint shards", 0),
                        ("Starting vLLM server on", 0), ("Application startup complete", 0)):  # fmt: skip
        assert worker.out.count(line) == count, (line, worker.out)
    t0 = time.monotonic()
    head.wait_for("Watchdog: collective operation on rank 0 did not complete; waiting up to dist-timeout", 5)
    status, r = call(port, "POST", "/v1/chat/completions", chat(Q_EN))  # a broken world answers nothing
    assert status == 500 and "broken" in r["error"]["message"]
    assert call(port, "GET", "/health")[0] == 200  # the real engines' /health does not notice an NCCL hang either
    assert head.wait(20) == 0, head.out[-3000:]  # vLLM's bug: exit 0 after the engine died
    assert time.monotonic() - t0 > 2  # it waited for the distributed timeout, like NCCL's watchdog
    assert re.search(vl_tag("EngineCore", "ERROR") + "Worker proc VllmWorker-0 died unexpectedly", head.out)
    assert "Watchdog caught collective operation timeout" in head.out and "EngineDeadError" in head.out
    # both nodes through the wrapper's observer, with the READY rules the role gives them
    plan = ["vllm", *map(str, common), "--node-rank"]
    obs = observed(worker, ("vllm", 1, 2, 1, [*plan, "1", "--headless"]))
    assert obs.ready and [p["phase"] for p in obs.phases] == ["dist_init", "dist_ready", "loading", "loaded"]
    assert obs.failed_rank["tp"] == 1
    obs = observed(head, ("vllm", 0, 2, 1, [*plan, "0"]))
    assert obs.ready and obs.phase_name() == "serving" and obs.failed_rank["tp"] == 0


@needs_torch
def test_vllm_local_worker_death_while_serving_exits_0_after_shutting_down(lab):
    node = lab("vllm", ["serve", lab.ckpt, "-tp", 2, "--host", "127.0.0.1", "--port", free_port()], "vllm-crash",
               LLMFLEET_SIM_FAULT="crash:rank=1:phase=serve:after=1.5:signal=KILL", LLMFLEET_SIM_VLLM_EXIT_S="3")  # fmt: skip
    node.wait_for("died unexpectedly", 60)
    t0 = time.monotonic()
    assert node.wait(20) == 0, node.out[-3000:]
    assert time.monotonic() - t0 > 2  # the real one exits 9.4-9.7 s after the death (LLMFLEET_SIM_VLLM_EXIT_S)
    out = node.out
    died = vl_tag("EngineCore", "ERROR", r"multiproc_executor\.py:315") + re.escape(
        "Worker proc VllmWorker-1 died unexpectedly (exit code: -9), shutting down executor."
    )
    assert re.search(died, out), out[-3000:]
    assert re.search(vl_tag("EngineCore", "ERROR", r"core\.py:1512") + "EngineCore encountered a fatal error", out)
    assert out.index("Application startup complete.") < out.index("EngineDeadError") < out.index("MPClient: complete")
    assert "Engine core proc died unexpectedly" not in out  # not in 0.32
    obs = observed(node, ("vllm", 0, 1, 2, ["vllm", "serve", "-tp", "2"]))
    assert obs.failed_rank["rank"] == 1 and "VllmWorker-1 died" in obs.first_error["line"]  # SIGKILL: no traceback


@needs_torch
def test_hung_rank_fails_the_rendezvous_after_dist_timeout(lab):
    node = lab("sglang", ["serve", "--model-path", lab.ckpt, "--tp-size", 2, "--dist-timeout", 3, "--port", free_port()],
               "hang", LLMFLEET_SIM_FAULT="hang:rank=1:phase=rendezvous")  # fmt: skip
    assert node.wait(40) == -signal.SIGKILL, node.out[-3000:]
    assert re.search(sg_tag(0, 0) + r"torch\.distributed\.DistStoreError: Timed out after \d+ seconds waiting for clients\. "
                     r"1/2 clients joined\.", node.out), node.out  # fmt: skip
    assert "Init torch distributed ends" not in node.out


@needs_torch
def test_sglang_rank_crash_during_load_kills_the_node_main_by_sigkill(lab):
    node = lab("sglang", ["serve", "--model-path", lab.ckpt, "--tp-size", 2, "--dist-timeout", 30, "--port", free_port()],
               "crash", LLMFLEET_SIM_FAULT="crash:rank=1:phase=load:exit=3")  # fmt: skip
    assert node.wait(40) == -signal.SIGKILL, node.out[-3000:]
    tag = sg_tag(1, 0)
    assert re.search(tag + "Scheduler hit an exception: Traceback", node.out), node.out
    assert re.search(tag + re.escape("RuntimeError: injected fault: crash:rank=1:phase=load:exit=3"), node.out)
    assert "Child process unexpectedly failed with exitcode=3." in node.out
    assert "Uvicorn running" not in node.out


@needs_torch
def test_truncated_shard_fails_the_load_naming_the_file(lab):
    shard = lab.ckpt / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    node = lab("sglang", ["serve", "--model-path", lab.ckpt, "--port", free_port()], "bad")
    assert node.wait(40) == -signal.SIGKILL, node.out[-3000:]
    assert re.search(sg_tag(0, 0) + r"safetensors_rust\.SafetensorError: Error while deserializing header: "
                     r"MetadataIncompleteBuffer \(" + re.escape(str(shard)), node.out), node.out  # fmt: skip
    assert "Uvicorn running" not in node.out


def test_signal_crash_is_a_real_signal_death_and_vllm_still_exits_0(lab):
    node = lab("vllm", ["serve", lab.ckpt, "--port", free_port()], "segv",
               LLMFLEET_SIM_FAULT="crash:rank=0:phase=start:signal=SEGV", LLMFLEET_SIM_VLLM_EXIT_S="1")  # fmt: skip
    # the simulator's vLLM head exits 0 whenever a worker dies, also at start-up (the lab relies on it)
    assert node.wait(20) == 0
    assert "Worker proc VllmWorker-0 died unexpectedly (exit code: -11), shutting down executor." in node.out
    assert "EngineDeadError" in node.out


@needs_torch
def test_once_fault_fires_once_and_slow_load_prints_progress(lab):
    spec = "crash:rank=0:phase=start:exit=4:once"
    env = {"LLMFLEET_SIM_FAULT": f"{spec};slow_load:seconds=3"}
    port = free_port()
    args = ["serve", "--model-path", lab.ckpt, "--port", port]
    first = lab("sglang", args, "first", **env)
    assert first.wait(20) == -signal.SIGKILL
    assert "Child process unexpectedly failed with exitcode=4." in first.out
    assert faults.parse_fault(spec).marker(str(lab.state)).exists()
    second = lab("sglang", args, "second", **env)
    wait_healthy(port, [second])
    assert "already fired once" in second.out and "injected fault" not in second.out
    progress = re.findall(r"TP0 PP0\] Loading safetensors checkpoint shards: +\d+% Completed \| (\d)/2", second.out)
    assert len(progress) >= 5 and progress[-1] == "2"  # 0/2, a line per second of the slow load, 1/2, 2/2
    second.p.send_signal(signal.SIGTERM)
    assert second.wait(20) == 0


def test_the_simulated_model_multiplies_through_a_tool_and_fills_a_json_schema_with_its_answer():
    """What the demo's acceptance profile requires of the simulator (inventory/overlays/acceptance/demo-sim.yml):
    multiply(37, 19) called with the question's factors, the tool's result as the answer and no second call, and
    structured output holding the answer."""
    tool = {
        "type": "function",
        "function": {
            "name": "multiply",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
    cfg = {"flavour": "sglang", "context": 4096, "reasoning_parser": "qwen3", "tool_parser": "qwen25"}
    ask = [{"role": "user", "content": "What is 37\u00d719? Use the multiply tool."}]
    g = answers.chat_gen({"messages": ask, "tools": [tool]}, cfg)
    assert g.finish == "tool_calls" and json.loads(g.tool_calls[0]["function"]["arguments"]) == {"a": 37, "b": 19}
    back = [*ask, {"role": "assistant", "content": None, "tool_calls": g.tool_calls},
            {"role": "tool", "tool_call_id": g.tool_calls[0]["id"], "content": "703"}]  # fmt: skip
    after = answers.chat_gen({"messages": back, "tools": [tool]}, cfg)
    assert after.content == "703" and after.tool_calls == []
    schema = {"type": "object", "properties": {"product": {"type": "integer"}}, "required": ["product"]}
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}
    js = answers.chat_gen({"messages": [{"role": "user", "content": "What is 37\u00d719? Answer in JSON with the key "
                                         "product."}], "response_format": rf}, cfg)  # fmt: skip
    assert json.loads(js.content) == {"product": 703}
