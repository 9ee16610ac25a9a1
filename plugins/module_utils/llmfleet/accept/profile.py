"""Per-model profiles of the API acceptance checker (`llmfleet accept --profile FILE`): YAML (or JSON).

A profile says how to ask one served model (thinking on or off and the chat-template switch for it,
max_tokens, extra headers and request fields, the question and its exact answer), what the deployment
was started with (reasoning and tool parsers, for the fixes the messages name), and, per capability,
whether it is `required` (a failure fails the acceptance, like a hard gate), `check` (run and reported,
exit code unaffected) or `off` (reported not-configured). Every key is optional; unknown keys are an
error (a typo must not silently turn a check off). docs/acceptance.md has the format and an example.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from .. import engines

TIMES = "\u00d7"
# The readiness gate's question (gate.DEFAULT_PROMPT): the deterministic model answers it exactly.
DEFAULT_PROMPT = f"What is 37{TIMES}19? Reply with only the number."
DEFAULT_EXPECT = "703"
TOOL_PROMPT = f"What is 37{TIMES}19? Use the multiply tool."
MULTIPLY_TOOL = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers and return the product.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
PRODUCT_SCHEMA = {
    "type": "object",
    "properties": {"product": {"type": "integer"}},
    "required": ["product"],
    "additionalProperties": False,
}

# In the order they run: cancel last (an engine that dies of a disconnect fails nothing after it).
CAPABILITIES = ("reasoning", "reasoning_effort", "multi_turn", "tools", "json_schema", "long_context", "cancel")
MODES = ("required", "check", "off")
ENGINES = engines.engines()  # whose flag names the fixes use (the profiles')
REASONING_FIELDS = ("auto", "reasoning", "reasoning_content")

CAPABILITY_OPTIONS: dict[str, dict[str, Any]] = {
    "reasoning": {"prompt": None, "expect": None},  # None: the answer's prompt and expect
    "reasoning_effort": {"levels": ["low", "medium", "high"], "prompt": None, "expect": None},
    "multi_turn": {"number": "4817"},
    "tools": {
        "prompt": TOOL_PROMPT,
        "tool": MULTIPLY_TOOL,
        "tool_choice": "auto",
        "expect_arguments": {"a": 37, "b": 19},  # None: only the tool's parameter schema is checked
        "result": "703",
        "expect": "703",  # what the answer after the tool result must contain; None: any content
    },
    "json_schema": {
        "prompt": f"What is 37{TIMES}19? Answer in JSON with the key product.",
        "schema": PRODUCT_SCHEMA,
        "expect": {"product": 703},  # None: only the schema is checked
    },
    "long_context": {"lengths": [1000, 4000], "depths": [0.1, 0.5, 0.9], "needle": "58213"},
    "cancel": {"prompt": "Count from 1 to 200, one number per line.", "settle_s": 0.5},
}

DEFAULTS: dict[str, Any] = {
    "model": None,  # the served name this profile is for (checked against --model when given)
    "engine": None,  # vllm | sglang: picks the flag names in fixes (both named when unset)
    "timeout_s": 120.0,  # every request's limit, whole
    "first_token_s": 60.0,  # stream: the first token's deadline after sending
    "stream_idle_s": 30.0,  # stream: the longest gap between chunks
    "stream_close_s": 5.0,  # stream: [DONE] and the end of the response after the last token
    "max_tokens": 1024,  # thinking needs room: content was seen empty at 128
    "headers": {},  # extra HTTP headers on every request (values are never printed)
    "ca_file": None,  # https: CA bundle to verify the server with
    "thinking": False,  # ask with thinking on (a model that always thinks) or off (the gate's way)
    "thinking_switch": "enable_thinking",  # the chat-template kwarg that turns thinking on/off; null: none sent
    "chat_template_kwargs": {},  # more chat-template kwargs on every chat request
    "request_extra": {},  # more request fields on every chat request (e.g. top_k, skip_special_tokens)
    "reasoning_parser": None,  # what the engine was started with (named in fixes)
    "reasoning_field": "auto",  # where clients read reasoning: reasoning_content | reasoning | auto (either)
    "tool_parser": None,  # what the engine was started with (named in fixes)
    "health_path": "/health",
    "answer": {"prompt": DEFAULT_PROMPT, "expect": DEFAULT_EXPECT},
    "capabilities": {},
}
_NUMBERS = ("timeout_s", "first_token_s", "stream_idle_s", "stream_close_s")


class ProfileError(ValueError):
    """The profile cannot be used: the message names the key and what it should be."""


def _type_name(v: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "true/false", int: "a number",
            float: "a number"}.get(type(v), type(v).__name__)  # fmt: skip


def _same_kind(default: Any, value: Any) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


def _capability(name: str, value: Any, where: str) -> dict[str, Any]:
    opts = copy.deepcopy(CAPABILITY_OPTIONS[name])
    if isinstance(value, str):
        value = {"mode": value}
    elif isinstance(value, bool):
        value = {"mode": "check" if value else "off"}
    elif not isinstance(value, dict):
        raise ProfileError(f"{where}.{name}: give a mode ({' | '.join(MODES)}) or a mapping with `mode:` and options")
    mode = value.get("mode", "check")
    if mode not in MODES:
        raise ProfileError(f"{where}.{name}.mode: {mode!r} is not one of {', '.join(MODES)}")
    for key, v in value.items():
        if key == "mode":
            continue
        if key not in opts:
            known = ", ".join(sorted(opts)) or "none"
            raise ProfileError(f"{where}.{name}.{key}: unknown option (options of {name}: {known})")
        d = opts[key]
        if v is not None and d is not None and not _same_kind(d, v):
            raise ProfileError(f"{where}.{name}.{key}: give {_type_name(d)}, not {v!r}")
        opts[key] = v
    opts["mode"] = mode
    _check_options(name, opts, where)
    return opts


def _check_options(name: str, o: dict[str, Any], where: str) -> None:
    if name == "long_context":
        if not o["lengths"] or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 64 for n in o["lengths"]
        ):
            raise ProfileError(f"{where}.long_context.lengths: give whole numbers of tokens >= 64, e.g. [1000, 4000]")
        if not o["depths"] or not all(isinstance(d, (int, float)) and 0 <= d <= 1 for d in o["depths"]):
            raise ProfileError(f"{where}.long_context.depths: give fractions of the prompt in [0, 1], e.g. [0.1, 0.5]")
        if not str(o["needle"]).isdigit():
            raise ProfileError(f"{where}.long_context.needle: give digits (the number hidden in the haystack)")
    if name == "reasoning_effort" and (not o["levels"] or not all(isinstance(x, str) for x in o["levels"])):
        raise ProfileError(f"{where}.reasoning_effort.levels: give a list of levels, e.g. [low, medium, high]")
    if name == "multi_turn" and not str(o["number"]).isdigit():
        raise ProfileError(f"{where}.multi_turn.number: give digits (what the model must recall)")
    if name == "tools":
        fn = (o["tool"] or {}).get("function") if isinstance(o["tool"], dict) else None
        if not isinstance(fn, dict) or not fn.get("name") or not isinstance(fn.get("parameters", {}), dict):
            raise ProfileError(
                f"{where}.tools.tool: give an OpenAI tool: {{type: function, function: {{name, parameters}}}}"
            )
    if name == "json_schema" and not isinstance(o["schema"], dict):
        raise ProfileError(f"{where}.json_schema.schema: give a JSON Schema mapping")


def normalize(raw: dict[str, Any] | None, where: str = "profile") -> dict[str, Any]:  # noqa: PLR0912 (a check per key)
    """Defaults filled in and every key checked; raises ProfileError naming the bad key."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: the top level must be a mapping of keys (see docs/acceptance.md)")
    out = copy.deepcopy(DEFAULTS)
    for key, value in raw.items():
        if key not in DEFAULTS:
            raise ProfileError(f"{where}: unknown key {key!r} (keys: {', '.join(DEFAULTS)})")
        d = DEFAULTS[key]
        if value is None and key in (
            "model",
            "engine",
            "reasoning_parser",
            "tool_parser",
            "thinking_switch",
            "ca_file",
        ):
            out[key] = None
            continue
        if key == "capabilities":
            continue
        if d is not None and not _same_kind(d, value):
            raise ProfileError(f"{where}.{key}: give {_type_name(d)}, not {value!r}")
        if d is None and not isinstance(value, str):
            raise ProfileError(f"{where}.{key}: give a string, not {value!r}")
        out[key] = copy.deepcopy(value)
    for key in _NUMBERS:
        if not out[key] > 0:
            raise ProfileError(f"{where}.{key}: give a number of seconds > 0, not {out[key]!r}")
        out[key] = float(out[key])
    if not isinstance(out["max_tokens"], int) or out["max_tokens"] < 1:
        raise ProfileError(f"{where}.max_tokens: give a whole number >= 1, not {out['max_tokens']!r}")
    if out["engine"] is not None and out["engine"] not in ENGINES:
        raise ProfileError(f"{where}.engine: {out['engine']!r} is not one of {', '.join(ENGINES)}")
    if out["reasoning_field"] not in REASONING_FIELDS:
        raise ProfileError(
            f"{where}.reasoning_field: {out['reasoning_field']!r} is not one of {', '.join(REASONING_FIELDS)}"
        )
    if not out["health_path"].startswith("/"):
        raise ProfileError(f"{where}.health_path: give a path starting with /, e.g. /health")
    for key in ("headers",):
        for h, v in out[key].items():
            if not isinstance(h, str) or not isinstance(v, str) or "\n" in h + v or ":" in h:
                raise ProfileError(f"{where}.headers: give header names and string values (bad: {h!r})")
            if h.lower() == "authorization":
                raise ProfileError(
                    f"{where}.headers: the Authorization header comes from --api-key-file, not a profile"
                )
    answer = out["answer"]
    if set(answer) != {"prompt", "expect"} or not all(isinstance(answer[k], str) and answer[k] for k in answer):
        raise ProfileError(f"{where}.answer: give both `prompt:` and `expect:` (strings; expect is the exact answer)")
    caps = raw.get("capabilities") or {}
    if not isinstance(caps, dict):
        raise ProfileError(f"{where}.capabilities: give a mapping of capability: mode")
    for name in caps:
        if name not in CAPABILITIES:
            raise ProfileError(f"{where}.capabilities: unknown capability {name!r} (known: {', '.join(CAPABILITIES)})")
    out["capabilities"] = {n: _capability(n, caps.get(n, "check"), f"{where}.capabilities") for n in CAPABILITIES}
    _check_schemas(out, where)
    return out


def _check_schemas(p: dict[str, Any], where: str) -> None:
    """The profile's JSON Schemas must be schemas (a bad one would fail every server)."""
    try:
        import jsonschema
    except ImportError:
        return  # the json_schema check reports the missing library itself
    caps = p["capabilities"]
    schemas = {"json_schema.schema": caps["json_schema"]["schema"],
               "tools.tool.function.parameters": caps["tools"]["tool"]["function"].get("parameters") or {}}  # fmt: skip
    for key, schema in schemas.items():
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.exceptions.SchemaError as e:
            raise ProfileError(f"{where}.capabilities.{key}: not a valid JSON Schema: {e.message}") from None


def load_profile(path: str | None) -> dict[str, Any]:
    """The profile in FILE (YAML or JSON), normalized; no path: every default."""
    if not path:
        return normalize(None)
    return normalize(read_profile(path), where=path)


def read_profile(path: str) -> Any:
    """The profile in FILE (YAML or JSON) as written (ProfileError when unreadable or not YAML)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ProfileError(f"--profile {path}: cannot read it: {e.strerror or e}") from None
    try:
        import yaml

        raw = yaml.safe_load(text)
    except ImportError:  # PyYAML is a dependency of the package; JSON still works without it
        try:
            raw = json.loads(text)
        except ValueError:
            raise ProfileError(f"--profile {path}: PyYAML is not installed and the file is not JSON") from None
    except Exception as e:  # yaml.YAMLError and its subclasses, without importing yaml at module level
        raise ProfileError(f"--profile {path}: not valid YAML: {e}") from None
    return raw
