"""The OpenAI-compatible HTTP API, served by rank 0 of the head (its answers wait for a world step), and
SGLang's dummy health server on the other nodes."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .answers import Gen, RequestError, chat_gen, completion_gen, pieces
from .faults import mark_fired
from .logs import VERSIONS, Log

if TYPE_CHECKING:
    from .rank import Rank


class Job:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: str | None = None


class EngineState:
    """Shared by rank 0's engine loop and the HTTP threads: requests wait for a world step."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.jobs: list[Job] = []
        self.inflight: list[Job] = []
        self.wake = threading.Event()
        self.ready = False
        self.draining = False
        self.broken: str | None = None
        self.active = 0

    def serving(self) -> bool:
        """What /health reports. A broken world does not change it: like the real engines while NCCL hangs,
        the API process is alive and says so; only generation (which needs a world step) fails."""
        return self.ready and not self.draining

    def pending(self) -> bool:
        with self.lock:
            return bool(self.jobs)

    def submit(self, timeout: float) -> str | None:
        """Wait for one successful world step; the error text when there was none."""
        job = Job()
        with self.lock:
            if self.broken:
                return self.broken
            self.jobs.append(job)
        self.wake.set()
        if not job.done.wait(timeout):
            return f"no engine step within {timeout:.0f}s"
        return job.error

    def take(self) -> list[Job]:
        with self.lock:
            self.inflight, self.jobs = self.jobs, []
            return list(self.inflight)

    def finish(self, jobs: list[Job]) -> None:
        with self.lock:
            self.inflight = []
        for j in jobs:
            j.done.set()

    def fail_all(self, msg: str) -> None:
        with self.lock:
            self.broken = msg
            jobs, self.jobs, self.inflight = self.jobs + self.inflight, [], []
        for j in jobs:
            j.error = msg
            j.done.set()

    def enter(self) -> None:
        with self.lock:
            self.active += 1

    def leave(self) -> None:
        with self.lock:
            self.active -= 1


class Server(ThreadingHTTPServer):
    # uvicorn's default listen backlog (what vLLM's and SGLang's API servers run on). socketserver's 5 dropped the SYN
    # of a benchmark's burst of connections past the fifth: each waited for the kernel's 1 s retransmit.
    request_queue_size = 2048


class Api:
    def __init__(self, cfg: dict[str, Any], rank: Rank):
        self.cfg, self.rank = cfg, rank
        self.flavour = cfg["flavour"]
        self.state = EngineState()
        self.log = Log(self.flavour, role="APIServer", pid=cfg["parent_pid"])  # vLLM: the node main is the API server
        self.timeout = float(os.environ.get("LLMFLEET_SIM_REQUEST_TIMEOUT", "60"))
        self.no_done = [f for f in rank.faults if f.kind == "no_done"]
        # hang:rank=0:phase=serve: from `after` s past the API's start every generation request hangs, while the
        # port, /health and /v1/models keep answering (a stuck scheduler or collective the engine never ends).
        self.hangs = [f for f in rank.faults if f.kind == "hang" and f.phase == "serve"]
        self.started = time.monotonic()
        self.hung = threading.Event()  # set once the hang fired (its WARNING line is printed once)
        self.server: ThreadingHTTPServer | None = None
        # Generation requests being answered: /metrics shows them under the engine's own gauge names (a rollout
        # drains a replica on them).
        self.in_flight, self.in_flight_lock = 0, threading.Lock()

    def start(self) -> None:
        cfg = self.cfg
        handler = type("Handler", (ApiHandler,), {"api": self})
        if self.flavour == "vllm":
            self.state.ready = True  # vLLM's API server starts after the engine is up
        self.server = Server((cfg["host"], cfg["http_port"]), handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
        self.started = time.monotonic()
        shown = f"http://{cfg['shown_host']}:{cfg['http_port']}"
        if self.flavour == "vllm":  # vLLM 0.32 prints no `Uvicorn running on`
            self.log("Supported tasks: ['generate']", src="entry.py:136")
            self.log(f"Starting vLLM server on {shown}", src="entry.py:140")
            self.log("Available routes are:", src="launcher.py:186")
            self.log.uvicorn(f"Started server process [{cfg['parent_pid']}]")
            self.log.uvicorn("Waiting for application startup.")
            self.log.uvicorn("Application startup complete.")
        else:
            self.log.uvicorn(f"Uvicorn running on {shown} (Press CTRL+C to quit)")

    def warmup(self) -> None:
        err = self.state.submit(self.timeout)
        if err is None:
            self.state.ready = True
            self.log("The server is fired up and ready to roll!")
        else:
            self.log(f"Warmup request failed: {err}", "ERROR")

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def hang_now(self) -> bool:
        for f in self.hangs:
            if time.monotonic() - self.started >= f.after:
                if not self.hung.is_set():
                    self.hung.set()
                    mark_fired(f, self.cfg["state_dir"])
                    self.log(f"injected fault {f.spec} (LLMFLEET_SIM_FAULT): generation requests hang from now on",
                             "WARNING")  # fmt: skip
                return True
        return False

    def no_done_now(self) -> bool:
        for f in self.no_done:
            if not (f.once and f.marker(self.cfg["state_dir"]).exists()):
                mark_fired(f, self.cfg["state_dir"])
                return True
        return False

    def error_body(self, status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
        if self.flavour == "sglang":
            return {"object": "error", "message": message, "type": kind, "param": param, "code": status}
        return {"error": {"message": message, "type": kind, "param": param, "code": status}}

    def models(self) -> dict[str, Any]:
        created = int(time.time())
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": created, "owned_by": f"llmfleet-sim-{self.flavour}",
                 "root": self.cfg["model"], "parent": None, "max_model_len": self.cfg["context"]}
                for name in self.cfg["served"]
            ],
        }  # fmt: skip


class ApiHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""
    api: Api

    def log_message(self, format: str, *args: Any) -> None:
        pass  # access lines are written by _dispatch in uvicorn's format

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        api = self.api
        api.state.enter()
        status = 500
        try:
            status = self._route(method, urlsplit(self.path).path)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:
            status = self.send_json(500, api.error_body(500, f"{type(e).__name__}: {e}", "InternalServerError"))
        finally:
            api.state.leave()
        phrase = self.responses.get(status, ("",))[0]
        api.log.uvicorn(
            f'{self.client_address[0]}:{self.client_address[1]} - "{method} {self.path} HTTP/1.1" {status} {phrase}'
        )

    # responses
    def send_json(self, status: int, obj: Any) -> int:
        body = json.dumps(obj, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        return status

    def send_empty(self, status: int) -> int:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()
        return status

    def send_text(self, status: int, text: str, ctype: str = "text/plain; charset=utf-8") -> int:
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        return status

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def send_sse(self, events: list[dict[str, Any]]) -> int:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        for ev in events:
            self._chunk(f"data: {json.dumps(ev, ensure_ascii=False)}\n\n".encode())
        if not self.api.no_done_now():
            self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        self.close_connection = True
        return 200

    def error(self, status: int, message: str, kind: str, param: str | None = None) -> int:
        return self.send_json(status, self.api.error_body(status, message, kind, param))

    def _sglang_info(self, path: str) -> dict[str, Any] | None:
        """SGLang's model and server info endpoints, or None for another path. /server_info is a subset of the real
        one (SGLang 0.5 returns every ServerArgs field): sglang-router 0.3.2 reads served_model_name there when it
        registers a worker (seen: without it the router lists the worker's model as "unknown" on its /v1/models)."""
        cfg = self.api.cfg
        if path == "/get_model_info":
            return {"model_path": cfg["model"], "tokenizer_path": cfg["model"], "is_generation": True}
        if path in ("/server_info", "/get_server_info"):
            return {"model_path": cfg["model"], "served_model_name": cfg["served"][0], "tp_size": cfg.get("tp", 1),
                    "dp_size": 1, "is_generation": True}  # fmt: skip
        return None

    # routing
    def _route(self, method: str, path: str) -> int:  # noqa: PLR0911 (one return per endpoint)
        api, state, flavour = self.api, self.api.state, self.api.flavour
        health = {"sglang": ("/health", "/ready"), "vllm": ("/health", "/ping")}[flavour]
        if path in health and (method == "GET" or path == "/ping"):
            return self.send_empty(200 if state.serving() else 503)
        if path == "/health_generate" and flavour == "sglang" and method == "GET":
            if not state.serving():
                return self.send_empty(503)
            return self.send_empty(200 if state.submit(api.timeout) is None else 503)
        if path == "/version" and method == "GET":
            return self.send_json(200, {"version": VERSIONS[flavour]})
        if path == "/metrics" and method == "GET":
            ok = 1 if state.serving() else 0
            model, n = api.cfg["served"][0], api.in_flight
            # As the engines name them (vLLM 0.32 and SGLang 0.5 /metrics): requests running, requests queued.
            gauges = {"vllm": (f'vllm:num_requests_running{{engine="0",model_name="{model}"}} {float(n)}\n'
                               f'vllm:num_requests_waiting{{engine="0",model_name="{model}"}} 0.0\n'),
                      "sglang": (f'sglang:num_running_reqs{{model_name="{model}"}} {float(n)}\n'
                                 f'sglang:num_queue_reqs{{model_name="{model}"}} 0.0\n')}[flavour]  # fmt: skip
            return self.send_text(200, f"# llmfleet engine simulator\nllmfleet_sim_serving {ok}\n{gauges}")
        info = self._sglang_info(path) if flavour == "sglang" and method == "GET" else None
        if info is not None:
            return self.send_json(200, info)
        if path.startswith("/v1/"):
            key = api.cfg.get("api_key")
            if key and self.headers.get("Authorization", "") != f"Bearer {key}":
                return self.send_json(401, {"error": "Unauthorized"})
            if path == "/v1/models" and method == "GET":
                return self.send_json(200, api.models())
            if path in ("/v1/chat/completions", "/v1/completions") and method == "POST":
                with api.in_flight_lock:
                    api.in_flight += 1
                try:
                    return self._generate(path)
                finally:
                    with api.in_flight_lock:
                        api.in_flight -= 1
        if path in ("/v1/models", "/v1/chat/completions", "/v1/completions", "/health_generate", *health):
            return self.send_json(405, {"detail": "Method Not Allowed"})
        return self.send_json(404, {"detail": "Not Found"})

    def _generate(self, path: str) -> int:  # noqa: PLR0911 (one return per HTTP outcome)
        api, state = self.api, self.api.state
        try:
            n = int(self.headers.get("Content-Length") or 0)
            req = json.loads(self.rfile.read(n) or b"null")
        except ValueError as e:
            return self.error(400, f"invalid JSON body: {e}", "BadRequestError")
        if not isinstance(req, dict):
            return self.error(400, "the request body must be a JSON object", "BadRequestError")
        if state.draining:
            return self.error(503, "the server is shutting down", "ServiceUnavailableError")
        model = req.get("model")
        if model is not None and model not in api.cfg["served"]:
            return self.error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        chat = path.endswith("/chat/completions")
        try:
            gen = chat_gen(req, api.cfg) if chat else completion_gen(req, api.cfg)
        except RequestError as e:
            return self.error(e.status, e.message, e.kind, e.param)
        if api.hang_now():
            while not state.draining:  # never answered; a stop's drain ends it without an answer
                time.sleep(0.2)
            self.close_connection = True
            return 499  # uvicorn's access line for a client that got nothing
        err = state.submit(api.timeout)
        if err is not None:
            return self.error(500, err, "InternalServerError")
        base = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                "model": model or api.cfg["served"][0]}  # fmt: skip
        opts = req.get("stream_options") or {}
        usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        if chat:
            if req.get("stream"):
                return self.send_sse(chat_chunks(gen, base, usage))
            message = {"role": "assistant", "content": gen.content, "reasoning_content": gen.reasoning,
                       "tool_calls": gen.tool_calls}  # fmt: skip
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": gen.finish}
            return self.send_json(200, {**base, "object": "chat.completion", "choices": [choice], "usage": gen.usage()})
        if req.get("stream"):
            return self.send_sse(completion_chunks(gen, base, usage))
        choice = {"index": 0, "text": gen.content, "logprobs": None, "finish_reason": gen.finish}
        return self.send_json(200, {**base, "object": "text_completion", "choices": [choice], "usage": gen.usage()})


def chat_chunks(gen: Gen, base: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**base, "object": "chat.completion.chunk", "choices": [choice]}

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"reasoning_content": p}) for p in pieces(gen.reasoning)]
    out += [chunk({"content": p}) for p in pieces(gen.content)]
    for i, call in enumerate(gen.tool_calls):
        fn = call["function"]
        out.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                          "function": {"name": fn["name"], "arguments": ""}}]}))  # fmt: skip
        out.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]}))
    out.append(chunk({}, gen.finish))
    if include_usage:
        out.append({**base, "object": "chat.completion.chunk", "choices": [], "usage": gen.usage()})
    return out


def completion_chunks(gen: Gen, base: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**base, "object": "text_completion", "choices": [choice]}

    out = [chunk(p) for p in pieces(gen.content)] + [chunk("", gen.finish)]
    if include_usage:
        out.append({**base, "object": "text_completion", "choices": [], "usage": gen.usage()})
    return out


class DummyHealthHandler(BaseHTTPRequestHandler):
    """SGLang's dummy health server on non-zero node ranks: always 200, whatever the world's state."""

    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        ok = urlsplit(self.path).path in ("/health", "/health_generate", "/ping")
        body = b"" if ok else b'{"detail":"Not Found"}'
        self.send_response(200 if ok else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
