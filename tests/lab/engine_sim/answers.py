"""Deterministic answers and token accounting: what a chat or completion request gets, without a model."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

TOKEN_RE = re.compile(r"[A-Za-z0-9_]+|\S")
MUL_RE = re.compile(r"(-?\d+)\s*(?:\u00d7|\u2715|\*|x|X)\s*(-?\d+)")
EXACT_RES = (
    re.compile(
        r"(?:reply|respond|answer|say)\s+(?:with\s+)?exactly\s*[:\uff1a]?\s*[\"'`\u201c\u2018\u300c]?([^\s\"'\u201c\u201d\u2018\u2019`\u300c\u300d]+)",
        re.I,
    ),
    re.compile(
        r"(?:只回答|只回复|只输出|仅回答)\s*[:\uff1a]?\s*[\"'\u201c\u2018\u300c]?([^\s\"'\u201c\u201d\u2018\u2019`\u300c\u300d\u3002\uff0c,\uff01!\uff1f?]+)"
    ),
)
# stripped from an exact token: ASCII and CJK full-width punctuation, closing quotes
TRAILING_PUNCT = ".,!?;:\"'" + "\u3002\uff0c\uff01\uff1f\uff1b\uff1a\u201d\u2019"
FIXED_ANSWER = "This is a simulated reply from the llmfleet engine simulator; no model was run."


def ntokens(text: str | None) -> int:
    return len(TOKEN_RE.findall(text or ""))


def cut_tokens(text: str, budget: int) -> tuple[str, int]:
    """The first `budget` tokens of text (whitespace kept) and how many tokens that is."""
    ends = [m.end() for m in TOKEN_RE.finditer(text)]
    if len(ends) <= budget:
        return text, len(ends)
    return (text[: ends[budget - 1]] if budget > 0 else ""), max(budget, 0)


def pieces(text: str | None) -> list[str]:
    """Stream pieces: one token each, with the whitespace before it."""
    out, pos = [], 0
    for m in TOKEN_RE.finditer(text or ""):
        out.append(text[pos : m.end()])
        pos = m.end()
    return out


def answer_for(text: str) -> str:
    m = MUL_RE.search(text)
    if m:
        return str(int(m.group(1)) * int(m.group(2)))
    for rx in EXACT_RES:
        m = rx.search(text)
        if m:
            token = m.group(1).rstrip(TRAILING_PUNCT)
            if token:
                return token
    return FIXED_ANSWER


def reasoning_for(answer: str) -> str:
    return f"Simulated reasoning: the question has a deterministic answer, which is {answer}."


def plausible(name: str, schema: Any) -> Any:  # noqa: PLR0911 (one return per JSON type)
    """A plausible argument value for a JSON-schema parameter."""
    schema = schema if isinstance(schema, dict) else {}
    if schema.get("enum"):
        return schema["enum"][0]
    if "default" in schema:
        return schema["default"]
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    low = name.lower()
    if kind == "integer":
        return 1
    if kind == "number":
        return 1.5
    if kind == "boolean":
        return True
    if kind == "array":
        return [plausible(name, schema.get("items", {}))]
    if kind == "object":
        props = schema.get("properties", {}) or {}
        return {k: plausible(k, props.get(k, {})) for k in schema.get("required", []) or []}
    for key, value in (("city", "Paris"), ("location", "Paris"), ("unit", "celsius"), ("date", "2025-01-01"),
                       ("email", "user@example.com"), ("url", "https://example.com"), ("lang", "en")):  # fmt: skip
        if key in low:
            return value
    return f"example {name}"


def tool_arguments(params: dict[str, Any], user: str) -> dict[str, Any]:
    """A call's arguments: a function of two numbers asked about a product (multiply(a, b) for "37 times 19") gets the
    product's factors, as a model that can multiply would; anything else a plausible value per parameter."""
    props = params.get("properties") or {}
    required = params.get("required") or []
    numeric = [k for k in required if (props.get(k) or {}).get("type") in ("integer", "number")]
    m = MUL_RE.search(user)
    if m and len(numeric) == 2:
        factors = dict(zip(numeric, (int(m.group(1)), int(m.group(2))), strict=True))
        return {k: factors.get(k, plausible(k, props.get(k, {}))) for k in required}
    return {k: plausible(k, props.get(k, {})) for k in required}


def structured(schema: Any, answer: str) -> Any:
    """Structured output (response_format json_schema): a document valid against the schema, each number in it
    the question's answer where that is a number ({"product": 703} for "37 times 19? Answer in JSON")."""
    schema = schema if isinstance(schema, dict) else {}
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties") or {}
        keys = schema.get("required") or list(props)
        return {k: structured(props.get(k, {}), answer) for k in keys}
    if kind in ("integer", "number") and re.fullmatch(r"-?\d+", answer):
        return int(answer)
    if kind == "string":
        return answer
    return plausible("value", schema)


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p)
    return ""


class RequestError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


@dataclass
class Gen:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def _budget(req: dict[str, Any], cfg: dict[str, Any], prompt_tokens: int) -> int:
    mt = req.get("max_completion_tokens", req.get("max_tokens"))
    if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
        raise RequestError(400, f"max_tokens must be a positive integer, got {mt!r}", param="max_tokens")
    ctx = cfg["context"]
    if prompt_tokens + (mt or 0) > ctx:
        raise RequestError(
            400,
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{prompt_tokens + (mt or 0)} tokens ({prompt_tokens} in the messages, {mt or 0} in the completion). "
            "Please reduce the length of the messages or completion.",
        )
    return mt if mt is not None else ctx - prompt_tokens


def _pick_tool(req: dict[str, Any], cfg: dict[str, Any], user: str) -> dict[str, Any] | None:
    tools = req.get("tools") or []
    choice = req.get("tool_choice", "auto" if tools else "none")
    if not tools or choice == "none":
        return None
    funcs = [t.get("function", {}) for t in tools if isinstance(t, dict)]
    if cfg["flavour"] == "vllm" and choice == "auto" and not (cfg.get("auto_tool") and cfg.get("tool_parser")):
        raise RequestError(
            400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        )
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        return next((f for f in funcs if f.get("name") == name), None)
    hit = next((f for f in funcs if f.get("name") and f["name"] in user), None)
    if hit is None and choice == "required" and funcs:
        hit = funcs[0]
    return hit


def chat_gen(req: dict[str, Any], cfg: dict[str, Any]) -> Gen:
    msgs = req.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise RequestError(400, "messages must be a non-empty list of message objects", param="messages")
    prompt_tokens = 3 + sum(4 + ntokens(text_of(m.get("content"))) for m in msgs)
    budget = _budget(req, cfg, prompt_tokens)
    user = next((text_of(m.get("content")) for m in reversed(msgs) if m.get("role") == "user"), "")
    if msgs[-1].get("role") == "tool":
        # The call's result came back: the model answers with it and calls nothing more.
        answer = text_of(msgs[-1].get("content")).strip() or FIXED_ANSWER
        content, used = cut_tokens(answer, budget)
        return Gen(content, None, [], "length" if used < ntokens(answer) else "stop", prompt_tokens, used)
    rf = req.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "json_schema":
        doc = json.dumps(structured((rf.get("json_schema") or {}).get("schema"), answer_for(user)))
        content, used = cut_tokens(doc, budget)
        return Gen(content, None, [], "length" if used < ntokens(doc) else "stop", prompt_tokens, used)
    func = _pick_tool(req, cfg, user)
    if func is not None:
        params = func.get("parameters") or {}
        args = tool_arguments(params, user)
        call_args = json.dumps(args, ensure_ascii=False)
        if cfg["flavour"] == "sglang" and not cfg.get("tool_parser"):
            raw = f'<tool_call>\n{{"name": "{func["name"]}", "arguments": {call_args}}}\n</tool_call>'
            return Gen(raw, prompt_tokens=prompt_tokens, completion_tokens=ntokens(raw))
        tid = "call_" + hashlib.sha256(f"{func['name']}{call_args}{user}".encode()).hexdigest()[:24]
        call = {"id": tid, "type": "function", "function": {"name": func["name"], "arguments": call_args}}
        return Gen(None, None, [call], "tool_calls", prompt_tokens, ntokens(func["name"]) + ntokens(call_args))
    answer = answer_for(user)
    kwargs = req.get("chat_template_kwargs") or {}
    enable = kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None
    thinking = enable is True or (bool(cfg.get("reasoning_parser")) and enable is not False)
    if thinking and cfg.get("reasoning_parser"):
        reasoning, r_used = cut_tokens(reasoning_for(answer), budget)
        content, c_used = cut_tokens(answer, budget - r_used)
        finish = "length" if r_used + c_used < ntokens(reasoning_for(answer)) + ntokens(answer) else "stop"
        return Gen(content or None, reasoning, [], finish, prompt_tokens, r_used + c_used)
    full = f"<think>\n{reasoning_for(answer)}\n</think>\n\n{answer}" if thinking else answer
    content, used = cut_tokens(full, budget)
    return Gen(content, None, [], "length" if used < ntokens(full) else "stop", prompt_tokens, used)


def completion_gen(req: dict[str, Any], cfg: dict[str, Any]) -> Gen:
    prompt = req.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else ""
    if isinstance(prompt, list):  # token ids
        prompt_text, prompt_tokens = "", len(prompt)
    elif isinstance(prompt, str):
        prompt_text, prompt_tokens = prompt, ntokens(prompt)
    else:
        raise RequestError(400, "prompt must be a string, a list of strings or token ids", param="prompt")
    budget = _budget(req, cfg, prompt_tokens)
    answer = answer_for(prompt_text)
    text, used = cut_tokens(answer, budget)
    return Gen(text, None, [], "length" if used < ntokens(answer) else "stop", prompt_tokens, used)
