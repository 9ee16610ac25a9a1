"""The checks of the API acceptance checker (`llmfleet accept`); each returns one result row.

Hard gates (any failure fails the acceptance): `models` (/v1/models lists the served name), `answer`
(a deterministic question answered exactly, the content free of reasoning), `stream` (the same over
SSE: tokens, the right answer, `usage`, `data: [DONE]` and the response closed soon after the last token).

Capabilities, each `pass`, `fail`, `not-supported` (the server refused the request: the fix says what to
start it with) or `not-configured` (off in the profile), never folded into one verdict: `reasoning`,
`reasoning_effort`, `multi_turn`, `tools`, `json_schema`, `long_context`, `cancel`. A capability the
profile marks `required` fails the acceptance unless it passes. After a failed `models` gate nothing
else is asked (`skipped`): every request would fail the same way.

Answers are compared the way the readiness gate does (llmfleet.engine.gate.chat_check): content stripped of
whitespace and a final full stop must equal the expected text. Reasoning text in `content` is a
failure, never stripped: clients would show it to users.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any

from .. import engines
from .client import Client, Reply, StreamResult, error_message
from .profile import CAPABILITIES

PASS, FAIL, NOT_SUPPORTED, NOT_CONFIGURED, SKIPPED = "pass", "fail", "not-supported", "not-configured", "skipped"
VERDICTS = (PASS, FAIL, NOT_SUPPORTED, NOT_CONFIGURED, SKIPPED)
GATES = ("models", "answer", "stream")
THINK_TAG = re.compile(r"</?think>", re.I)
# Tool calls written as text: hermes/Qwen `<tool_call>`, Mistral `[TOOL_CALLS]`, DeepSeek's full-width marker, JSON.
TOOL_TEXT = re.compile(r"<tool_call>|\[TOOL_CALLS\]|<\uff5ctool|\"name\"\s*:\s*\"", re.I)
REFUSED = (400, 404, 405, 422, 501)  # a capability the server will not do (vs 5xx: it broke trying)
FILLER = (
    "The grass in the meadow is green.",
    "The sky above the hills is blue.",
    "A river flows slowly to the sea.",
    "The old clock in the hall ticks.",
    "Bread is baked early in the morning.",
    "Snow covers the mountain peaks.",
    "The library opens at nine o'clock.",
    "Birds sing in the tall oak trees.",
    "The market sells fresh apples.",
    "A cold wind blows from the north.",
    "The train leaves the station at noon.",
    "Lamps light the narrow street.",
)
CHARS_PER_TOKEN = 4.0  # the approximation when the server has no /tokenize (English text, BPE tokenizers)


def row(  # noqa: PLR0917 (one result row's fields)
    name: str,
    kind: str,
    mode: str,
    verdict: str,
    why: str,
    fix: str | None = None,
    details: dict[str, Any] | None = None,
    seconds: float = 0.0,
) -> dict[str, Any]:
    return {
        "name": name,
        "kind": kind,
        "mode": mode,
        "verdict": verdict,
        "why": why,
        "fix": fix,
        "seconds": round(seconds, 3),
        "details": details or {},
    }


def got(a: Answer) -> str:
    """The reply's content in words: quoted, or why it is empty (the reasoning field took it, max_tokens)."""
    if a.content.strip():
        return short(a.content)
    if a.reasoning:
        return f"empty content (the reply went to `{a.reasoning_field}`: {short(a.reasoning, 60)})"
    return f"empty content (finish_reason {a.finish})"


def norm(text: str) -> str:
    return text.strip().rstrip(".\u3002 ")


def short(text: Any, n: int = 120) -> str:
    s = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False)
    return repr(s if len(s) <= n else s[:n] + "...")


class Answer:
    """One assistant reply, from a chat completion or put together from a stream's deltas."""

    def __init__(self) -> None:
        self.content = ""
        self.content_null = True
        self.reasoning = ""
        self.reasoning_fields: list[str] = []  # the fields that held reasoning text
        self.tool_calls: list[dict[str, Any]] = []
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    @property
    def reasoning_field(self) -> str | None:
        return self.reasoning_fields[0] if self.reasoning_fields else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "content": self.content[:500],
            "reasoning_field": self.reasoning_field,
            "reasoning_chars": len(self.reasoning),
            "tool_calls": self.tool_calls,
            "finish_reason": self.finish,
            "usage": self.usage,
        }


def _add_reasoning(a: Answer, src: dict[str, Any]) -> None:
    for field in ("reasoning_content", "reasoning"):
        v = src.get(field)
        if isinstance(v, str) and v:
            a.reasoning += v
            if field not in a.reasoning_fields:
                a.reasoning_fields.append(field)


def from_completion(body: Any) -> Answer | None:
    """The reply in a chat.completion body, or None when it has no choices[0].message."""
    try:
        choice = body["choices"][0]
        msg = choice["message"]
    except (KeyError, IndexError, TypeError):
        return None
    if not isinstance(msg, dict):
        return None
    a = Answer()
    content = msg.get("content")
    a.content_null = content is None
    a.content = content if isinstance(content, str) else ""
    _add_reasoning(a, msg)
    a.tool_calls = [t for t in msg.get("tool_calls") or [] if isinstance(t, dict)]
    a.finish = choice.get("finish_reason")
    a.usage = body.get("usage") if isinstance(body.get("usage"), dict) else None
    return a


def from_stream(s: StreamResult) -> Answer:
    """The reply a stream's deltas add up to (tool calls merged by index, as OpenAI clients do)."""
    a = Answer()
    calls: dict[int, dict[str, Any]] = {}
    for chunk in s.chunks:
        if isinstance(chunk.get("usage"), dict):
            a.usage = chunk["usage"]
        for ch in chunk.get("choices") or []:
            if not isinstance(ch, dict):
                continue
            delta = ch.get("delta") or {}
            if isinstance(delta, dict):
                if isinstance(delta.get("content"), str):
                    a.content += delta["content"]
                    a.content_null = a.content_null and not delta["content"]
                _add_reasoning(a, delta)
                for tc in delta.get("tool_calls") or []:
                    if not isinstance(tc, dict):
                        continue
                    cur = calls.setdefault(
                        int(tc.get("index") or 0),
                        {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                    )
                    cur["id"] = tc.get("id") or cur["id"]
                    fn = tc.get("function") or {}
                    cur["function"]["name"] += fn.get("name") or ""
                    cur["function"]["arguments"] += fn.get("arguments") or ""
            if ch.get("finish_reason"):
                a.finish = ch["finish_reason"]
    a.tool_calls = [calls[i] for i in sorted(calls)]
    return a


PROMPT_ROOM = 256  # tokens of max_model_len the checks' prompts may need beside max_tokens


class Checker:
    """Runs the checks against one endpoint and model with one profile (accept_profile.normalize)."""

    def __init__(self, client: Client, model: str, profile: dict[str, Any], max_tokens_given: bool = True) -> None:
        self.c, self.model, self.p = client, model, profile
        self.max_tokens_given = max_tokens_given  # False: the default, lowered to fit the served context
        self.notes: list[str] = []  # for the report's warnings
        self.max_model_len: int | None = None
        self.stop: str | None = None  # set by a failed `models` gate: nothing else is asked
        self._sizing: str | None = None  # how prompts are counted, once known (count_tokens)

    # -- requests ---------------------------------------------------------------------------------

    def body(
        self, messages: list[dict[str, Any]], *, thinking: bool | None = None, stream: bool = False, **extra: Any
    ) -> dict[str, Any]:
        p = self.p
        b: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": 0, "max_tokens": p["max_tokens"]}
        b.update(p["request_extra"])
        kwargs = dict(p["chat_template_kwargs"])
        if p["thinking_switch"]:
            kwargs[p["thinking_switch"]] = bool(p["thinking"] if thinking is None else thinking)
        if kwargs:
            b["chat_template_kwargs"] = kwargs
        if stream:
            b["stream"] = True
            b["stream_options"] = {"include_usage": True}
        b.update(extra)
        return b

    def chat(self, messages: list[dict[str, Any]], **kw: Any) -> tuple[Reply, Answer | None]:
        r = self.c.post("/v1/chat/completions", self.body(messages, **kw), self.p["timeout_s"])
        return r, (from_completion(r.body) if r.ok else None)

    def stream(self, messages: list[dict[str, Any]], stop_after_first_chunk: bool = False, **kw: Any) -> StreamResult:
        p = self.p
        return self.c.stream(
            "/v1/chat/completions",
            self.body(messages, stream=True, **kw),
            first_token_s=p["first_token_s"],
            idle_s=p["stream_idle_s"],
            close_s=p["stream_close_s"],
            total_s=p["timeout_s"],
            stop_after_first_chunk=stop_after_first_chunk,
        )

    # -- fixes the messages name ------------------------------------------------------------------

    def fix_reasoning(self) -> str:
        parser = self.p["reasoning_parser"] or "PARSER (the model's: e.g. qwen3, deepseek_r1)"
        return f"start the engine with --reasoning-parser {parser} (vLLM and SGLang) so reasoning goes to its own field"

    def fix_tools(self) -> str:
        tp = self.p["tool_parser"] or "PARSER (the model's: e.g. hermes for <tool_call> JSON)"
        # The named engine's flags, else every engine's (the profiles').
        named = [self.p["engine"]] if self.p["engine"] in engines.engines() else list(engines.engines())
        fixes = [engines.get(e) for e in named]
        if len(fixes) == 1:
            return f"start the engine with {fixes[0].label}: {fixes[0].tool_parser_flags} {tp}"
        return "start the engine with " + "; ".join(f"{p.label}: {p.tool_parser_flags} {tp}" for p in fixes)

    def http_fix(self, r: Reply) -> str:
        msg = error_message(r.body).lower() if r.status else ""
        if r.status == 0:
            return "check the URL and that the engine is up and reachable from this host (port, firewall, proxy)"
        if r.status in (401, 403):
            return (
                "give the key the engine was started with (vLLM --api-key or VLLM_API_KEY, SGLang --api-key) "
                "in a file: --api-key-file FILE"
            )
        if r.status == 404 and "model" in msg:
            return f"use a name /v1/models lists, or start the engine with --served-model-name {self.model}"
        if "max_tokens" in msg or "context length" in msg or "max_model_len" in msg:
            return "lower max_tokens in the profile: it must fit the served context (max_model_len) with the prompt"
        if r.status >= 500:
            return "read the engine's log at this time: it failed on the request (the message above is its answer)"
        return (
            "see the server's message; the profile's request_extra / chat_template_kwargs may hold a field it rejects"
        )

    # -- judging an answer --------------------------------------------------------------------------

    def judge(self, a: Answer, prompt: str, expect: str) -> tuple[str, str] | None:
        """None when the content is exactly the answer; else (what is wrong, the fix)."""
        mt = self.p["max_tokens"]
        if THINK_TAG.search(a.content):
            return (
                f"reasoning left in content ({short(a.content, 80)}): clients would show it to users",
                self.fix_reasoning(),
            )
        if not a.content.strip():
            if a.finish == "length":
                thinking = f" while thinking ({len(a.reasoning)} characters of reasoning)" if a.reasoning else ""
                return (
                    f"content empty: generation stopped at max_tokens={mt} (finish_reason length){thinking}",
                    "raise max_tokens in the profile (thinking needs room: content was seen empty at 128)",
                )
            if a.reasoning:
                return (
                    f"content empty; the answer went to `{a.reasoning_field}` ({short(a.reasoning, 80)}): the "
                    "reasoning parser took the whole reply",
                    "a model that thinks by default: set thinking: true in the profile; qwen3-style templates: "
                    "send the switch (thinking_switch: enable_thinking); deepseek_r1 reads a reply without "
                    "</think> as reasoning: use it for models that always think",
                )
            return (f"content empty (finish_reason {a.finish})", "read the engine's log for this request")
        if norm(a.content) != expect:
            hint = (
                "a deterministic question answered wrong: a wrong or damaged checkpoint (revision, shards), a bad "
                "TP/PP layout or dtype; compare with a single-node run, or set answer.prompt/expect for this model"
            )
            if expect in a.content:
                hint = (
                    f"the answer is there with more text: set answer.prompt/expect in the profile to a question "
                    f"this model answers exactly (now {short(prompt, 60)})"
                )
            return f"asked {short(prompt, 80)}, expected {expect!r}, got {short(a.content)}", hint
        return None

    # -- hard gates ---------------------------------------------------------------------------------

    def check_models(self) -> dict[str, Any]:
        t = time.monotonic()
        r = self.c.get("/v1/models", self.p["timeout_s"])
        dt = time.monotonic() - t
        if not r.ok:
            self.stop = "/v1/models failed"
            return row("models", "gate", "gate", FAIL, f"/v1/models: {r.problem()}", self.http_fix(r), seconds=dt)
        data = r.body.get("data") if isinstance(r.body, dict) else None
        if not isinstance(data, list):
            self.stop = "/v1/models gave no list"
            return row(
                "models",
                "gate",
                "gate",
                FAIL,
                f"/v1/models: no `data` list in {short(r.body)}",
                "this is not an OpenAI-compatible API root: check the URL (http://HEAD:PORT)",
                seconds=dt,
            )
        ids = [m.get("id") for m in data if isinstance(m, dict)]
        if self.model not in ids:
            self.stop = f"/v1/models does not list {self.model}"
            return row(
                "models",
                "gate",
                "gate",
                FAIL,
                f"/v1/models does not list {self.model!r}; it serves {ids}",
                f"pass --model one of {ids}, or start the engine with --served-model-name {self.model}",
                {"served": ids},
                dt,
            )
        entry = next(m for m in data if isinstance(m, dict) and m.get("id") == self.model)
        mml = entry.get("max_model_len")
        self.max_model_len = mml if isinstance(mml, int) and mml > 0 else None
        why = f"{self.model} listed" + (f" (max_model_len {mml})" if self.max_model_len else "")
        fitted = self.fit_max_tokens()
        if fitted:
            why += f"; {fitted}"
        return row("models", "gate", "gate", PASS, why, None, {"served": ids, "max_model_len": self.max_model_len}, dt)

    def fit_max_tokens(self) -> str | None:
        """Default max_tokens lowered to fit max_model_len (a prompt needs room too), said; a profile's own value is
        never changed: a warning says it cannot fit. Returns what was lowered, or None."""
        mml, mt = self.max_model_len, self.p["max_tokens"]
        if not mml or mt + PROMPT_ROOM <= mml:
            return None
        if self.max_tokens_given:
            self.notes.append(
                f"max_tokens {mt} from the profile leaves under {PROMPT_ROOM} tokens of max_model_len {mml} for the "
                "prompt: requests may be refused; lower max_tokens in the profile"
            )
            return None
        self.p["max_tokens"] = max(16, mml // 2)
        said = f"max_tokens lowered from the default {mt} to {self.p['max_tokens']} to fit max_model_len {mml}"
        self.notes.append(f"{said} (set max_tokens in the profile to choose)")
        return said

    def check_answer(self) -> dict[str, Any]:
        q = self.p["answer"]
        r, a = self.chat([{"role": "user", "content": q["prompt"]}])
        if a is None:
            why = f"chat completion: {r.problem()}" if not r.ok else f"no choices[0].message in {short(r.body)}"
            return row("answer", "gate", "gate", FAIL, why, self.http_fix(r), {"status": r.status}, r.seconds)
        bad = self.judge(a, q["prompt"], q["expect"])
        if bad:
            return row("answer", "gate", "gate", FAIL, bad[0], bad[1], a.as_dict(), r.seconds)
        return row("answer", "gate", "gate", PASS, f"{a.content.strip()!r}", None, a.as_dict(), r.seconds)

    def stream_problems(self, s: StreamResult, a: Answer) -> list[tuple[str, str]]:
        """What is wrong with a stream as a transport: hangs, no [DONE], no usage, events that are not JSON."""
        p, out = self.p, []
        if s.hung:
            h = s.hung
            waited, limit = h["waited_s"], h["limit_s"]
            if h["phase"] == "first token":
                out.append(
                    (
                        f"no token {waited:.1f} s after sending (first_token_s {limit:g}); {len(s.chunks)} "
                        "chunk(s) before it gave none",
                        "the engine is slow to start generating (first-request JIT, queued prefill) or stuck: read "
                        "its log; raise first_token_s in the profile if this model is known to be slow",
                    )
                )
            elif h["phase"] == "between chunks":
                out.append(
                    (
                        f"the stream hung: no data for {waited:.1f} s after {len(s.chunks)} chunk(s) "
                        f"(stream_idle_s {limit:g})",
                        "the engine stalled mid-generation (a dead rank, a stuck collective): read its log",
                    )
                )
            elif h["phase"] == "close":
                got = "[DONE] came, but" if s.done_s is not None else "no [DONE], and"
                out.append(
                    (
                        f"the stream did not close: {got} the response was still open {waited:.1f} s after the "
                        f"last token (stream_close_s {limit:g}); clients waiting for the end hang",
                        "ask the engine directly, not through a proxy, to tell which one keeps SSE responses "
                        "open (proxy buffering/keep-alive settings, or an engine bug)",
                    )
                )
            else:
                out.append(
                    (
                        f"the stream took longer than timeout_s ({limit:g} s), still sending",
                        "raise timeout_s in the profile if the answer is long, or lower max_tokens",
                    )
                )
            return out
        if s.done_s is None:
            out.append(
                (
                    f"the stream ended without `data: [DONE]` after {len(s.chunks)} chunk(s): OpenAI clients "
                    "treat it as cut off",
                    "ask the engine directly, not through a proxy, to tell which one drops the last event "
                    "(a proxy timeout or buffer, or an engine bug)",
                )
            )
        if a.usage is None:
            out.append(
                (
                    "no `usage` in the stream although the request set stream_options.include_usage: token "
                    "accounting gets nothing",
                    "use an engine version that honours stream_options (vLLM and SGLang do), or a proxy that "
                    "passes the usage chunk through",
                )
            )
        if s.bad_events:
            out.append(
                (
                    f"{len(s.bad_events)} `data:` event(s) were not JSON: {short(s.bad_events[0], 80)}",
                    "the engine or a proxy writes events that are not OpenAI chunks: ask the engine directly",
                )
            )
        del p
        return out

    def check_stream(self) -> dict[str, Any]:
        q = self.p["answer"]
        s = self.stream([{"role": "user", "content": q["prompt"]}])
        details = s.as_dict()
        if s.hung is None and s.status != 200:
            r = Reply(s.status, s.body, s.error, s.seconds)
            return row(
                "stream",
                "gate",
                "gate",
                FAIL,
                f"streamed chat completion: {r.problem()}",
                self.http_fix(r),
                details,
                s.seconds,
            )
        a = from_stream(s)
        details["answer"] = a.as_dict()
        problems = self.stream_problems(s, a)
        if not s.hung:
            bad = self.judge(a, q["prompt"], q["expect"])
            if bad:
                problems.append(bad)
        if problems:
            fixes = list(dict.fromkeys(f for _, f in problems))
            return row(
                "stream", "gate", "gate", FAIL, "; ".join(w for w, _ in problems), "; ".join(fixes), details, s.seconds
            )
        u = a.usage or {}
        closed = (s.closed_s or 0) - (s.last_token_s or 0)
        why = (
            f"{a.content.strip()!r}; [DONE]; usage {u.get('prompt_tokens')}+{u.get('completion_tokens')} tokens; "
            f"first token {s.first_token_s:.2f} s; closed {closed:.2f} s after the last token"
        )
        return row("stream", "gate", "gate", PASS, why, None, details, s.seconds)

    # -- capabilities -------------------------------------------------------------------------------

    def cap_reasoning(self, o: dict[str, Any]) -> tuple[str, str, str | None, dict[str, Any]]:
        q = self.p["answer"]
        prompt, expect = o["prompt"] or q["prompt"], o["expect"] or q["expect"]
        msgs = [{"role": "user", "content": prompt}]
        r, a = self.chat(msgs, thinking=True)
        if a is None:
            return self._refusal("a chat completion with thinking on", r)
        details: dict[str, Any] = {"completion": a.as_dict()}
        verdict = self._judge_reasoning(a, prompt, expect, "")
        if verdict[0] != PASS:
            return (*verdict, details)
        s = self.stream(msgs, thinking=True)
        sa = from_stream(s)
        details["stream"] = {**s.as_dict(), "answer": sa.as_dict()}
        problems = self.stream_problems(s, sa)
        if problems:
            return FAIL, "over SSE: " + problems[0][0], problems[0][1], details
        sv = self._judge_reasoning(sa, prompt, expect, "over SSE: ")
        if sv[0] != PASS:
            return (*sv, details)
        return PASS, f"{verdict[1]}; the same over SSE", None, details

    def _judge_reasoning(self, a: Answer, prompt: str, expect: str, where: str) -> tuple[str, str, str | None]:
        want = self.p["reasoning_field"]
        if THINK_TAG.search(a.content):
            return FAIL, f"{where}reasoning left in content ({short(a.content, 80)})", self.fix_reasoning()
        if not a.reasoning:
            bad = self.judge(a, prompt, expect)
            if bad:
                return FAIL, where + bad[0], bad[1]
            switch = self.p["thinking_switch"]
            asked = (
                f"asked with {switch}: true" if switch else "asked without a thinking switch (thinking_switch: null)"
            )
            return (
                NOT_SUPPORTED,
                f"{where}no reasoning in the reply (neither reasoning_content nor reasoning), only the answer "
                f"{a.content.strip()!r}; {asked}: the model did not think, or the engine has no reasoning parser",
                f"if this model thinks: {self.fix_reasoning()}; if it does not, set capabilities.reasoning: off",
            )
        if want != "auto" and want not in a.reasoning_fields:
            return (
                FAIL,
                f"{where}the reasoning is in `{a.reasoning_field}`, but this deployment's clients read "
                f"`{want}` (reasoning_field in the profile)",
                "vLLM 0.32 names the field `reasoning` (older vLLM and SGLang: `reasoning_content`): match the "
                "engine version to the clients, or set reasoning_field to what the engine sends",
            )
        bad = self.judge(a, prompt, expect)
        if bad:
            return FAIL, where + bad[0], bad[1]
        return (
            PASS,
            f"reasoning in `{a.reasoning_field}` ({len(a.reasoning)} chars), content {a.content.strip()!r}",
            None,
        )

    def cap_reasoning_effort(self, o: dict[str, Any]) -> tuple[str, str, str | None, dict[str, Any]]:
        q = self.p["answer"]
        prompt, expect = o["prompt"] or q["prompt"], o["expect"] or q["expect"]
        think = True if self.p["capabilities"]["reasoning"]["mode"] != "off" else None
        levels: dict[str, Any] = {}
        refused, wrong = [], []
        for level in o["levels"]:
            r, a = self.chat([{"role": "user", "content": prompt}], thinking=think, reasoning_effort=level)
            if a is None:
                levels[level] = {"status": r.status, "problem": r.problem()}
                (refused if r.status in REFUSED else wrong).append((level, r.problem(), self.http_fix(r)))
                continue
            u = a.usage or {}
            levels[level] = {
                "completion_tokens": u.get("completion_tokens"),
                "reasoning_chars": len(a.reasoning),
                "content": a.content[:100],
            }
            bad = self.judge(a, prompt, expect)
            if bad:
                wrong.append((level, bad[0], bad[1]))
        details = {"levels": levels}
        if refused and len(refused) == len(o["levels"]):
            return (
                NOT_SUPPORTED,
                f"the server refused reasoning_effort: {refused[0][1]}",
                "an engine or model without reasoning_effort: set capabilities.reasoning_effort: off",
                details,
            )
        if wrong or refused:
            by_why: dict[str, list[str]] = {}
            for lv, why, _ in wrong + refused:
                by_why.setdefault(why, []).append(lv)
            bits = [f"reasoning_effort={', '.join(lvs)}: {why}" for why, lvs in by_why.items()]
            return FAIL, "; ".join(bits), (wrong + refused)[0][2], details
        toks = [levels[lv]["completion_tokens"] for lv in o["levels"]]
        why = f"answers correct at {', '.join(o['levels'])} (completion tokens {'/'.join(str(t) for t in toks)})"
        if len(o["levels"]) > 1 and len(set(toks)) == 1:
            why += "; the length did not change with the level (the template or engine may ignore reasoning_effort)"
        return PASS, why, None, details

    def cap_multi_turn(self, o: dict[str, Any]) -> tuple[str, str, str | None, dict[str, Any]]:
        n = str(o["number"])
        msgs = [
            {"role": "user", "content": f"Remember this number: {n}. Reply with only OK."},
            {"role": "assistant", "content": "OK"},
            {"role": "user", "content": "What is the capital of France? Reply with only the city."},
            {"role": "assistant", "content": "Paris"},
            {"role": "user", "content": "What number did I ask you to remember? Reply with only the number."},
        ]
        r, a = self.chat(msgs)
        if a is None:
            return (
                FAIL,
                f"a five-message conversation: {r.problem()}",
                "the chat template or server rejects a conversation with assistant turns: check the template",
                {"status": r.status},
            )
        details = {"answer": a.as_dict()}
        if THINK_TAG.search(a.content):
            return FAIL, f"reasoning left in content ({short(a.content, 80)})", self.fix_reasoning(), details
        if not re.search(rf"(?<!\d){n}(?!\d)", a.content):
            return (
                FAIL,
                f"turn 5 asked for the number given in turn 1 ({n}); got {got(a)}: the reply did "
                "not use the conversation",
                "a model that cannot recall earlier turns is not fit for chat; if it should, check that the chat "
                "template renders every turn and that no proxy trims messages",
                details,
            )
        return PASS, f"recalled {n} from turn 1 in turn 5", None, details

    def cap_tools(self, o: dict[str, Any]) -> tuple[str, str, str | None, dict[str, Any]]:  # noqa: PLR0911, PLR0912 (one return per step of the round trip)
        tool = o["tool"]
        fn_name = tool["function"]["name"]
        params = tool["function"].get("parameters") or {}
        tools = [tool]
        msgs: list[dict[str, Any]] = [{"role": "user", "content": o["prompt"]}]
        r, a = self.chat(msgs, tools=tools, tool_choice=o["tool_choice"])
        if a is None:
            if r.status in REFUSED and "tool" in error_message(r.body).lower():
                return NOT_SUPPORTED, f"the server refused tools: {r.problem()}", self.fix_tools(), {"status": r.status}
            return FAIL, f"a chat completion with tools: {r.problem()}", self.http_fix(r), {"status": r.status}
        details: dict[str, Any] = {"call": a.as_dict()}
        if not a.tool_calls:
            if TOOL_TEXT.search(a.content):
                return (
                    FAIL,
                    f"the tool call was left in content as text ({short(a.content, 100)}): the server did not parse it",
                    self.fix_tools() + " (the parser must match the model's tool-call format)",
                    details,
                )
            return (
                FAIL,
                f"no tool call: the reply was {got(a)} (finish_reason {a.finish})",
                "check that the chat template renders `tools` and that the tool parser matches the model: "
                + self.fix_tools(),
                details,
            )
        call = a.tool_calls[0]
        fn = call.get("function") or {}
        if fn.get("name") != fn_name:
            return (
                FAIL,
                f"called {fn.get('name')!r}, expected {fn_name!r}",
                "the model picked the wrong function: check the tools the template renders",
                details,
            )
        raw = fn.get("arguments")
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError as e:
            return (
                FAIL,
                f"malformed tool-call arguments (not JSON: {e.msg} at character {e.pos}): {short(raw, 100)}",
                "the tool parser cut or mangled the arguments: check that --tool-call-parser matches the model "
                f"({self.p['tool_parser'] or 'e.g. hermes'}) and that max_tokens left room",
                details,
            )
        if not isinstance(args, dict):
            return (
                FAIL,
                f"tool-call arguments are not a JSON object: {short(raw, 100)}",
                "the tool parser must return the arguments as a JSON object string",
                details,
            )
        problem = schema_problem(args, params)
        if problem:
            return (
                FAIL,
                f"tool-call arguments {short(args)} do not match the tool's parameters: {problem}",
                "the model or parser produced arguments outside the schema; check the parser",
                details,
            )
        if o["expect_arguments"] is not None and args != o["expect_arguments"]:
            return (
                FAIL,
                f"tool-call arguments {json.dumps(args)}, expected {json.dumps(o['expect_arguments'])}",
                "the model called the tool with the wrong values (or set tools.expect_arguments for this model)",
                details,
            )
        if not call.get("id"):
            return (
                FAIL,
                "the tool call has no id: the tool result cannot refer to it",
                "an engine that gives tool calls ids (vLLM, SGLang) is needed for tool round trips",
                details,
            )
        # The round trip: the call as the client sends it back, then the tool's result.
        msgs += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call["id"], "type": "function", "function": {"name": fn_name, "arguments": raw}}],
            },
            {"role": "tool", "tool_call_id": call["id"], "content": str(o["result"])},
        ]
        r2, a2 = self.chat(msgs, tools=tools)
        if a2 is None:
            return FAIL, f"the tool-result round trip: {r2.problem()}", self.http_fix(r2), details
        details["after_result"] = a2.as_dict()
        if a2.tool_calls:
            return (
                FAIL,
                f"after the tool result the model called {a2.tool_calls[0].get('function', {}).get('name')!r} "
                "again instead of answering",
                "check that the chat template renders tool results (role tool) and the assistant's tool_calls",
                details,
            )
        if THINK_TAG.search(a2.content):
            return (
                FAIL,
                f"after the tool result: reasoning left in content ({short(a2.content, 80)})",
                self.fix_reasoning(),
                details,
            )
        if o["expect"] is not None and str(o["expect"]) not in a2.content:
            return (
                FAIL,
                f"after the tool result {o['result']!r} the answer was {got(a2)}, expected it to "
                f"contain {o['expect']!r}",
                "check that the chat template renders tool results (role tool)",
                details,
            )
        why = f"{fn_name}({json.dumps(args)}), finish_reason {a.finish}; after the result: {a2.content.strip()[:60]!r}"
        return PASS, why, None, details

    def cap_json_schema(self, o: dict[str, Any]) -> tuple[str, str, str | None, dict[str, Any]]:  # noqa: PLR0911
        try:
            import jsonschema  # noqa: F401 (checked here so a missing library is said once, plainly)
        except ImportError:
            return (
                NOT_CONFIGURED,
                "the jsonschema library is not installed on this host, so nothing can be validated",
                "pip install jsonschema (llmfleet's dependencies include it)",
                {},
            )
        rf = {"type": "json_schema", "json_schema": {"name": "acceptance", "schema": o["schema"], "strict": True}}
        r, a = self.chat([{"role": "user", "content": o["prompt"]}], response_format=rf)
        if a is None:
            if r.status in REFUSED:
                return (
                    NOT_SUPPORTED,
                    f"the server refused response_format json_schema: {r.problem()}",
                    "structured output: vLLM has it on by default (--structured-outputs-config), SGLang needs "
                    "--grammar-backend (xgrammar)",
                    {"status": r.status},
                )
            return (
                FAIL,
                f"a chat completion with response_format json_schema: {r.problem()}",
                self.http_fix(r) + " (vLLM logs grammar backend errors there, e.g. `grammar rejected tokens`)",
                {"status": r.status},
            )
        details: dict[str, Any] = {"answer": a.as_dict()}
        text = a.content.strip()
        try:
            value = json.loads(text)
        except ValueError:
            fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.S)
            how = "wrapped in a markdown fence" if fenced else "not JSON"
            if not text:
                return (
                    FAIL,
                    f"no JSON: {got(a)}",
                    "a reasoning parser that takes the whole reply leaves nothing for "
                    "the schema: ask with thinking as the model needs (profile thinking)",
                    details,
                )
            return (
                FAIL,
                f"content is {how} ({short(text, 100)}): the engine ignored response_format",
                "structured output must be on: vLLM --structured-outputs-config / SGLang --grammar-backend",
                details,
            )
        details["value"] = value
        problem = schema_problem(value, o["schema"])
        if problem:
            return (
                FAIL,
                f"content {short(value)} does not match the schema: {problem}",
                "the grammar backend did not hold the output to the schema: check the engine's structured output",
                details,
            )
        if o["expect"] is not None and value != o["expect"]:
            return (
                FAIL,
                f"valid JSON for the schema, but {json.dumps(value)} is not {json.dumps(o['expect'])}",
                "the model answered wrong inside the schema (or set json_schema.expect for this model)",
                details,
            )
        return PASS, f"{json.dumps(value)} parsed and valid against the schema", None, details

    def count_tokens(self, messages: list[dict[str, Any]]) -> tuple[int, str]:
        """Prompt tokens of `messages` and how they were counted: the server's POST /tokenize (vLLM, SGLang) with
        the chat template, then with the text alone, else CHARS_PER_TOKEN (an approximation)."""
        timeout = min(self.p["timeout_s"], 60)
        text = "\n".join(str(m.get("content") or "") for m in messages)
        bodies = {
            "tokenize": {"model": self.model, "messages": messages, "add_generation_prompt": True},
            "tokenize-text": {"model": self.model, "prompt": text},
        }
        for method, body in bodies.items():
            if self._sizing in (None, method):
                r = self.c.post("/tokenize", body, timeout)
                if r.ok and isinstance(r.body, dict) and isinstance(r.body.get("count"), int):
                    self._sizing = method
                    return r.body["count"], method
        self._sizing = "approximate"  # asked once: a server without /tokenize is not asked again
        return math.ceil(len(text) / CHARS_PER_TOKEN) + 8 * len(messages), "approximate"

    def haystack(self, tokens: int, depth: float, needle: str) -> tuple[list[dict[str, Any]], int, str]:
        """A user message of about `tokens` tokens with the needle at `depth`, its measured size and the method."""

        def build(n: int) -> list[dict[str, Any]]:
            sentences = [FILLER[i % len(FILLER)] for i in range(n)]
            sentences.insert(round(depth * n), f"The secret number for the vault is {needle}.")
            question = "What is the secret number for the vault? Reply with only the number."
            return [{"role": "user", "content": " ".join(sentences) + "\n\n" + question}]

        base, method = self.count_tokens(build(0))
        probe = 64
        with_probe, _ = self.count_tokens(build(probe))
        per = max((with_probe - base) / probe, 0.5)
        n = max(1, round((tokens - base) / per))
        size, method = self.count_tokens(build(n))
        if method != "approximate" and abs(size - tokens) > max(8, tokens * 0.02):
            n = max(1, n + round((tokens - size) / per))
            size, method = self.count_tokens(build(n))
        return build(n), size, method

    def cap_long_context(self, o: dict[str, Any]) -> tuple[str, str, str | None, dict[str, Any]]:
        room = 64  # the answer's tokens
        cases, failed = [], []
        skipped = []
        method = None
        for length in o["lengths"]:
            if self.max_model_len and length + room > self.max_model_len:
                skipped.append(length)
                continue
            for i, depth in enumerate(o["depths"]):
                needle = str(int(o["needle"]) + 1111 * i)
                msgs, size, method = self.haystack(length, depth, needle)
                room_left = (self.max_model_len or 10**9) - size - 8
                r, a = self.chat(msgs, max_tokens=max(16, min(self.p["max_tokens"], room_left)))
                case: dict[str, Any] = {"tokens": length, "measured": size, "depth": depth, "seconds": r.seconds}
                if a is None:
                    case.update(ok=False, problem=r.problem())
                    failed.append(f"{length} tokens at depth {depth:g}: {r.problem()}")
                else:
                    ok = bool(re.search(rf"(?<!\d){needle}(?!\d)", a.content)) and not THINK_TAG.search(a.content)
                    case.update(ok=ok, content=a.content[:100])
                    if not ok:
                        failed.append(f"{length} tokens at depth {depth:g}: got {got(a)}, not {needle}")
                cases.append(case)
        how = {
            "tokenize": "sized with the server's /tokenize (chat template applied)",
            "tokenize-text": "sized with the server's /tokenize (text only; the template adds a few tokens)",
            "approximate": f"sized by approximation ({CHARS_PER_TOKEN:g} characters a token: no /tokenize)",
            None: "nothing sized",
        }[method]
        details = {"cases": cases, "sizing": method, "max_model_len": self.max_model_len, "skipped_lengths": skipped}
        note = f" (skipped {skipped}: longer than max_model_len {self.max_model_len})" if skipped else ""
        if not cases:
            return (
                NOT_SUPPORTED,
                f"no length fits the served context: lengths {o['lengths']}, max_model_len {self.max_model_len}",
                "set long_context.lengths below max_model_len",
                details,
            )
        if failed:
            return (
                FAIL,
                f"needle not found in {len(failed)} of {len(cases)} case(s): "
                + "; ".join(failed[:4])
                + note
                + f"; {how}",
                "a model or deployment that loses facts in long prompts: check the served context (rope scaling, "
                "max_model_len) against the model card, or lower the lengths to what the model is meant for",
                details,
            )
        return PASS, f"needle found in all {len(cases)} case(s){note}; {how}", None, details

    def cap_cancel(self, o: dict[str, Any]) -> tuple[str, str, str | None, dict[str, Any]]:
        q = self.p["answer"]
        s = self.stream([{"role": "user", "content": o["prompt"]}], stop_after_first_chunk=True)
        details: dict[str, Any] = {"stream": s.as_dict()}
        if not s.cancelled:
            if s.hung:
                return (
                    FAIL,
                    f"no first chunk to cancel after: waited {s.hung['waited_s']:.1f} s",
                    "the engine did not start streaming: read its log",
                    details,
                )
            r = Reply(s.status, s.body, s.error, s.seconds)
            return FAIL, f"the stream to cancel: {r.problem()}", self.http_fix(r), details
        time.sleep(o["settle_s"])
        path = self.p["health_path"]
        h = self.c.get(path, min(self.p["timeout_s"], 30))
        if h.status == 404:
            path = "/v1/models"
            h = self.c.get(path, min(self.p["timeout_s"], 30))
        details["health"] = {"path": path, "status": h.status, "seconds": h.seconds}
        if not h.ok:
            return (
                FAIL,
                f"after a stream was cancelled at its first chunk, {path} answered {h.problem()}: the engine "
                "did not survive a client disconnect",
                "read the engine's log at the cancel (the abort path); clients cancel all the time",
                details,
            )
        r, a = self.chat([{"role": "user", "content": q["prompt"]}])
        if a is None:
            return (
                FAIL,
                f"after the cancel, {path} said 200 but the next chat completion failed: {r.problem()}",
                "read the engine's log at the cancel (the abort path)",
                details,
            )
        bad = self.judge(a, q["prompt"], q["expect"])
        if bad:
            return FAIL, f"after the cancel: {bad[0]}", bad[1], details
        return (
            PASS,
            f"cancelled after the first chunk ({s.first_chunk_s:.2f} s); {path} 200; the next answer "
            f"{a.content.strip()!r}",
            None,
            details,
        )

    def _refusal(self, what: str, r: Reply) -> tuple[str, str, str | None, dict[str, Any]]:
        if r.status in REFUSED:
            return NOT_SUPPORTED, f"the server refused {what}: {r.problem()}", self.http_fix(r), {"status": r.status}
        return FAIL, f"{what}: {r.problem()}", self.http_fix(r), {"status": r.status}

    # -- running ------------------------------------------------------------------------------------

    def capability(self, name: str) -> dict[str, Any]:
        o = self.p["capabilities"][name]
        mode = o["mode"]
        if mode == "off":
            return row(name, "capability", mode, NOT_CONFIGURED, "off in the profile")
        if self.stop:
            return row(name, "capability", mode, SKIPPED, f"not asked: {self.stop}")
        t = time.monotonic()
        verdict, why, fix, details = getattr(self, f"cap_{name}")(o)
        return row(name, "capability", mode, verdict, why, fix, details, time.monotonic() - t)

    def gate(self, name: str) -> dict[str, Any]:
        if self.stop:
            return row(name, "gate", "gate", SKIPPED, f"not asked: {self.stop}")
        return getattr(self, f"check_{name}")()

    def run(self, log: Any = None) -> list[dict[str, Any]]:
        out = []
        for name in GATES:
            out.append(self.gate(name))
            if log:
                log(out[-1])
        for name in CAPABILITIES:
            out.append(self.capability(name))
            if log:
                log(out[-1])
        return out


def schema_problem(value: Any, schema: dict[str, Any]) -> str | None:
    """The most relevant JSON Schema error of `value` (jsonschema's best_match), or None when valid. Without the
    jsonschema library nothing is checked (None)."""
    try:
        import jsonschema
    except ImportError:
        return None
    cls = jsonschema.validators.validator_for(schema)
    err = jsonschema.exceptions.best_match(cls(schema).iter_errors(value))
    if err is None:
        return None
    where = "/".join(str(p) for p in err.absolute_path)
    return f"{err.message}" + (f" (at {where})" if where else "")
