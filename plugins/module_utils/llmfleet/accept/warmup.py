"""Warm-up of a ready engine over the shapes its traffic will bring: `llmfleet warmup` and the
llmfleet_engine_warmup module (docs/warmup.md).

The first requests at each (input length x concurrency) shape pay the engine's lazy work: JIT
compilation of kernels for that batch shape, CUDA-graph capture, allocator growth. In the field that was
P95 TTFT 10-13 s and P99 23 s on the first shapes. After the readiness gate this sends the operator's
matrix (every input length crossed with every concurrency), `concurrency` streaming requests at once per
cell and `rounds` times, and records per request the time to first token and the total time, per cell
the wall time, and for the whole run its start, end and duration.

Prompts are sized with the engine's own tokenizer where it has `POST /tokenize`, by the acceptance
checker's needle-in-a-haystack builder (accept_checks.Checker.haystack; else its documented 4 characters
a token). Each request gets its own number in the prompt's first sentence, so no two prompts share more
than the chat template's header and a few words: the prefix cache cannot turn the warm-up into a no-op.

Every wait has a deadline (accept_http streams: per request `timeout`, all of it `deadline`); a failure
is recorded in its cell and the run says which cells failed, never a traceback. The API key goes only
into the Authorization header; every output is masked with accept.redact. Stdlib only (runs on nodes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..cli_grammar import add_url, alias, require_url
from .checks import Checker, from_stream
from .client import Client, StreamResult, UrlError, split_base
from .profile import normalize
from .run import UsageError as KeyFileError
from .run import _key_file_warning, _RefuseKeyInArgv, read_api_key, redact

SCHEMA = "llmfleet.warmup/1"
ENV_KEY = "LLMFLEET_API_KEY"  # the key for the CLI when no --api-key-file is given (never argv)
OK, FAILED, NOT_RUN = "ok", "failed", "not-run"
MIN_LENGTH = 64  # the haystack's question and needle take ~30 tokens (as accept's long_context lengths)
MAX_LENGTH = 1 << 20
MAX_CONCURRENCY = 512  # two threads of this process per request in flight
MAX_ROUNDS = 100
DEFAULTS = {"max_tokens": 8, "rounds": 1, "timeout": 120.0, "deadline": 900.0}
PLACEHOLDER = "0" * 10  # the needle while sizing; each request gets its own 10-digit number in its place
GRACE_S = 5.0  # a request thread returns by its stream's deadline; this is only the bound on joining it


class WarmupError(ValueError):
    """Bad input (exit 2 / fail_json): `option` is the setting's name (lengths, concurrency, ...)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


# ---- settings -------------------------------------------------------------------------------------------


def parse_list(text: str, option: str) -> list[int]:
    """`128,2048` -> [128, 2048]; raises WarmupError naming `option`."""
    items = [t.strip() for t in str(text).split(",")]
    if not any(items):
        raise WarmupError(option, "empty: give comma-separated whole numbers, e.g. 128,2048")
    out = []
    for t in items:
        try:
            out.append(int(t))
        except ValueError:
            raise WarmupError(option, f"{t!r} is not a whole number (give e.g. 128,2048)") from None
    return out


def _whole_list(values: Any, option: str, low: int, high: int) -> list[int]:
    if not isinstance(values, (list, tuple)) or not values:
        raise WarmupError(option, f"give a non-empty list of whole numbers, not {values!r}")
    seen: list[int] = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise WarmupError(option, f"{v!r} is not a whole number")
        if not low <= v <= high:
            raise WarmupError(option, f"{v} is out of range: give {low}..{high}")
        if v in seen:
            raise WarmupError(option, f"{v} is given twice")
        seen.append(v)
    return seen


def check_settings(  # noqa: PLR0917 (the matrix and its limits)
    url: str,
    lengths: Any,
    concurrency: Any,
    max_tokens: Any = DEFAULTS["max_tokens"],
    rounds: Any = DEFAULTS["rounds"],
    timeout: Any = DEFAULTS["timeout"],
    deadline: Any = DEFAULTS["deadline"],
) -> dict[str, Any]:
    """The settings, checked; raises WarmupError naming the bad one (the caller names its flag/option)."""
    try:
        split_base(url)
    except UrlError as e:
        raise WarmupError("url", str(e)) from None
    out: dict[str, Any] = {
        "lengths": _whole_list(lengths, "lengths", MIN_LENGTH, MAX_LENGTH),
        "concurrency": _whole_list(concurrency, "concurrency", 1, MAX_CONCURRENCY),
    }
    for name, value, high in (("max_tokens", max_tokens, 1 << 16), ("rounds", rounds, MAX_ROUNDS)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
            raise WarmupError(name, f"{value!r} is out of range: give a whole number 1..{high}")
        out[name] = value
    for name, value in (("timeout", timeout), ("deadline", deadline)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise WarmupError(name, f"{value!r} is not a number of seconds > 0")
        out[name] = float(value)
    return out


def cells_of(lengths: list[int], concurrency: list[int]) -> list[dict[str, int]]:
    """The matrix in the order it is sent: every length (as given) crossed with every concurrency."""
    return [{"input_len": n, "concurrency": c} for n in lengths for c in concurrency]


# ---- numbers and words ------------------------------------------------------------------------------------


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)


def _stats(values: list[float | None]) -> dict[str, float | None]:
    got = [v for v in values if v is not None]
    if not got:
        return {"p50": None, "max": None}
    return {"p50": round(statistics.median(got), 1), "max": round(max(got), 1)}


def duration(ms: float | None) -> str:
    """12.3 ms, 850 ms, 10.4 s, or - (no value)."""
    if ms is None:
        return "-"
    if ms < 100:
        return f"{ms:.1f} ms"
    if ms < 1000:
        return f"{ms:.0f} ms"
    return f"{ms / 1000:.1f} s"


def _iso(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def hung_message(s: StreamResult, cut_by_deadline: bool) -> str:
    """A stream cut at a deadline, in words (which wait, how long, which limit)."""
    h = s.hung or {}
    waited, limit, phase = h.get("waited_s", 0.0), h.get("limit_s", 0.0), h.get("phase")
    which = "what was left of the overall deadline" if cut_by_deadline else "the per-request timeout"
    if phase == "first token":
        what = f"no token {waited:.1f} s after sending"
    elif phase == "between chunks":
        what = f"the stream hung: no data for {waited:.1f} s after {len(s.chunks)} chunk(s)"
    elif phase == "close":
        what = f"the response was still open {waited:.1f} s after its last token"
    else:
        what = f"not finished {waited:.1f} s after sending"
    return f"{what} ({which}, {limit:g} s)"


# ---- one request, one round -------------------------------------------------------------------------------


def _request_row(s: StreamResult, limit: float, cut_by_deadline: bool) -> dict[str, Any]:
    a = from_stream(s)
    error = None
    if s.hung:
        error = hung_message(s, cut_by_deadline)
    elif s.status != 200 and s.status:
        error = f"HTTP {s.status}: {s.error or 'no message'}"
    elif s.error:
        error = s.error
    elif s.done_s is None and s.closed_s is None:
        error = "the stream ended without an answer"
    usage = a.usage or {}
    return {
        "ok": error is None,
        "error": error,
        "status": s.status,
        "ttft_ms": _ms(s.first_token_s),
        "e2e_ms": _ms(s.closed_s if s.closed_s is not None else s.seconds),
        "prompt_tokens": usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else None,
        "completion_tokens": usage.get("completion_tokens")
        if isinstance(usage.get("completion_tokens"), int)
        else None,
        "limit_s": round(limit, 3),
    }


class Warmup:
    """One warm-up run against one endpoint and model (settings as check_settings returns them)."""

    def __init__(
        self,
        url: str,
        model: str,
        settings: dict[str, Any],
        *,
        api_key: str | None = None,
        log: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.model, self.s, self.api_key, self.log = model, settings, api_key, log
        self.client = Client(url, api_key=api_key, timeout=settings["timeout"])
        self.rng = random.SystemRandom()
        self.needles: set[str] = set()
        self.end = 0.0
        self.sizing: dict[str, Any] = {"method": None, "lengths": {}}
        self._prompts: dict[int, Any] = {}  # length -> (messages with the placeholder, measured tokens)

    def left(self) -> float:
        return self.end - time.monotonic()

    def _checker(self) -> Checker:
        """The acceptance checker's requests, limited by the per-request timeout and what the deadline leaves."""
        limit = max(0.1, min(self.s["timeout"], self.left()))
        return Checker(self.client, self.model, normalize({"timeout_s": limit}))

    def preflight(self) -> dict[str, Any]:
        c = self._checker()
        r = c.check_models()
        return {"ok": r["verdict"] == "pass", "why": r["why"], "fix": r["fix"], "max_model_len": c.max_model_len,
                "seconds": r["seconds"]}  # fmt: skip

    def prompt(self, length: int) -> Any:
        """(messages, measured tokens) of `length` tokens, sized once per length with the placeholder needle."""
        if length not in self._prompts:
            t = time.monotonic()
            msgs, size, method = self._checker().haystack(length, 0.0, PLACEHOLDER)
            self.sizing["method"] = method
            self.sizing["lengths"][str(length)] = {"measured": size, "seconds": round(time.monotonic() - t, 3)}
            self._prompts[length] = (msgs, size)
        return self._prompts[length]

    def distinct(self, msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The sized messages with this request's own number in the first sentence."""
        # A random number, not a counter: prompts then differ from their first digits on (a tokenizer that
        # writes one token a digit would otherwise share a whole KV block), and a second warm-up differs too.
        needle = PLACEHOLDER
        while needle == PLACEHOLDER or needle in self.needles:
            needle = f"{self.rng.randrange(10**10):010d}"
        self.needles.add(needle)
        return [{**m, "content": str(m["content"]).replace(PLACEHOLDER, needle, 1)} for m in msgs]

    def body(self, msgs: list[dict[str, Any]]) -> dict[str, Any]:
        # ignore_eos (vLLM and SGLang): every request decodes max_tokens, so decode shapes are warmed too.
        return {"model": self.model, "messages": msgs, "max_tokens": self.s["max_tokens"], "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip

    def round(self, length: int, concurrency: int) -> dict[str, Any]:
        """`concurrency` streaming requests sent at once; each thread's stream ends by its own deadline."""
        msgs, _ = self.prompt(length)
        bodies = [self.body(self.distinct(msgs)) for _ in range(concurrency)]
        limit = min(self.s["timeout"], self.left())
        cut_by_deadline = limit < self.s["timeout"]
        results: list[StreamResult | None] = [None] * concurrency
        go = threading.Event()

        def send(i: int) -> None:
            if go.wait(limit + GRACE_S):
                results[i] = self.client.stream("/v1/chat/completions", bodies[i], first_token_s=limit,
                                                idle_s=limit, close_s=limit, total_s=limit)  # fmt: skip

        threads = [threading.Thread(target=send, args=(i,), daemon=True, name=f"warmup-{i}") for i in
                   range(concurrency)]  # fmt: skip
        for t in threads:
            t.start()
        t0 = time.monotonic()
        go.set()
        for t in threads:
            t.join(max(0.0, t0 + limit + GRACE_S - time.monotonic()))
        wall = time.monotonic() - t0
        rows = []
        for s in results:
            if s is None:  # never expected: Client.stream returns by its deadline
                rows.append({"ok": False, "error": f"no result {limit + GRACE_S:.1f} s after sending", "status": 0,
                             "ttft_ms": None, "e2e_ms": None, "prompt_tokens": None, "completion_tokens": None,
                             "limit_s": round(limit, 3)})  # fmt: skip
            else:
                rows.append(_request_row(s, limit, cut_by_deadline))
        ttft = _stats([r["ttft_ms"] for r in rows])
        # Per request only its TTFT (the list stays small in a registered Ansible result); the cell keeps the rest.
        return {"wall_s": round(wall, 3), "ttft_ms_p50": ttft["p50"], "ttft_ms_max": ttft["max"],
                "ttft_ms": [r["ttft_ms"] for r in rows], "errors": sum(not r["ok"] for r in rows),
                "_rows": rows}  # fmt: skip

    def cell(self, length: int, concurrency: int, max_model_len: int | None) -> dict[str, Any]:
        cell: dict[str, Any] = {"input_len": length, "concurrency": concurrency, "status": NOT_RUN, "why": None,
                                "fix": None, "prompt_tokens": None, "requests": 0, "errors": 0, "wall_s": 0.0,
                                "ttft_ms_p50": None, "ttft_ms_max": None, "e2e_ms_p50": None, "e2e_ms_max": None,
                                "usage_prompt_tokens": None, "error_samples": [], "rounds": []}  # fmt: skip
        if max_model_len and length + self.s["max_tokens"] > max_model_len:
            cell.update(status=FAILED, why=f"input_len {length} + max_tokens {self.s['max_tokens']} does not fit "
                        f"max_model_len {max_model_len}: the engine would refuse it (HTTP 400); nothing sent",
                        fix="drop this length from the matrix, or serve a longer context")  # fmt: skip
            return cell
        if self.left() <= 0:
            cell["why"] = f"the overall deadline ({self.s['deadline']:g} s) passed before this cell"
            cell["fix"] = "raise the deadline, or warm fewer shapes"
            return cell
        _, cell["prompt_tokens"] = self.prompt(length)
        rows: list[dict[str, Any]] = []
        for _ in range(self.s["rounds"]):
            if self.left() <= 0:
                break
            r = self.round(length, concurrency)
            rows += r.pop("_rows")
            cell["rounds"].append(r)
        cell["wall_s"] = round(sum(r["wall_s"] for r in cell["rounds"]), 3)
        cell["requests"], cell["errors"] = len(rows), sum(not r["ok"] for r in rows)
        ttft, e2e = _stats([r["ttft_ms"] for r in rows]), _stats([r["e2e_ms"] for r in rows])
        cell.update(ttft_ms_p50=ttft["p50"], ttft_ms_max=ttft["max"], e2e_ms_p50=e2e["p50"], e2e_ms_max=e2e["max"])
        used = [r["prompt_tokens"] for r in rows if r["prompt_tokens"] is not None]
        cell["usage_prompt_tokens"] = [min(used), max(used)] if used else None
        if len(cell["rounds"]) >= 2:
            first, last = cell["rounds"][0]["ttft_ms_p50"], cell["rounds"][-1]["ttft_ms_p50"]
            cell["first_round_ttft_ms_p50"], cell["last_round_ttft_ms_p50"] = first, last
        errors = [r["error"] for r in rows if r["error"]]
        cell["error_samples"] = list(dict.fromkeys(errors))[:3]
        if errors:
            cell["status"] = FAILED
            cell["why"] = f"{len(errors)} of {len(rows)} request(s) failed: {errors[0]}"
            cell["fix"] = self.fix(rows)
        elif len(cell["rounds"]) < self.s["rounds"]:
            cell["status"] = FAILED
            cell["why"] = (f"the overall deadline ({self.s['deadline']:g} s) passed after "
                           f"{len(cell['rounds'])} of {self.s['rounds']} round(s)")  # fmt: skip
            cell["fix"] = "raise the deadline, or warm fewer shapes"
        else:
            cell["status"] = OK
        return cell

    def fix(self, rows: list[dict[str, Any]]) -> str:
        bad = next(r for r in rows if r["error"])
        status = bad["status"]
        if status in (401, 403):
            return (
                "give the key the engine was started with (CLI: --api-key-file or $LLMFLEET_API_KEY; module: api_key)"
            )
        if status >= 500:
            return (
                "read the engine's log at this time: it failed at this shape (out of memory at this length x "
                "concurrency: warm only what the deployment is sized for, or change its memory settings)"
            )
        if status >= 400:
            return (
                "the engine refused the request: see its message (a prompt over the served context, or a field "
                "it does not accept, e.g. ignore_eos behind a proxy)"
            )
        if "deadline" in (bad["error"] or ""):
            return "raise the deadline, or warm fewer shapes"
        return (
            "the first request at a new shape can take long (JIT compilation, CUDA-graph capture): raise the "
            "per-request timeout if the engine is known to be slow here; else read the engine's log at this time"
        )

    def run(self) -> dict[str, Any]:
        started = time.time()
        t0 = time.monotonic()
        self.end = t0 + self.s["deadline"]
        cells = cells_of(self.s["lengths"], self.s["concurrency"])
        pre = self.preflight()
        out: list[dict[str, Any]] = []
        for c in cells:
            if not pre["ok"]:
                row = {**c, "status": NOT_RUN, "why": "not sent: /v1/models failed (see preflight)", "fix": None,
                       "requests": 0, "errors": 0, "wall_s": 0.0, "error_samples": [], "rounds": []}  # fmt: skip
            else:
                row = self.cell(c["input_len"], c["concurrency"], pre["max_model_len"])
            out.append(row)
            if self.log:
                self.log(redact(row, [self.api_key or ""]))
        ended = time.time()
        failed = [] if pre["ok"] else ["preflight"]
        failed += [f"{c['input_len']}x{c['concurrency']}" for c in out if c["status"] != OK]
        sent = sum(c["requests"] for c in out)
        good = sum(c["status"] == OK for c in out)
        words = f"{good}/{len(out)} cells ok, {sent} request(s) in {time.monotonic() - t0:.1f} s"
        if not pre["ok"]:
            summary = f"WARM-UP FAILED ({pre['why']}): {words}"
        elif failed:
            summary = f"WARM-UP FAILED ({', '.join(failed[:6])}{', ...' if len(failed) > 6 else ''}): {words}"
        else:
            summary = f"WARMED UP: {words}"
        report = {
            "schema": SCHEMA,
            "url": self.client.base,
            "model": self.model,
            "settings": dict(self.s),
            "started_at": _iso(started),
            "ended_at": _iso(ended),
            "wall_s": round(time.monotonic() - t0, 3),
            "preflight": pre,
            "sizing": self.sizing,
            "ok": not failed,
            "failed_cells": failed,
            "summary": summary,
            "cells": out,
        }
        return redact(report, [self.api_key or ""])


def warmup(url: str, model: str, settings: dict[str, Any], *, api_key: str | None = None,
           log: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Run the warm-up (settings from check_settings); the JSON-able report, the key masked."""
    return Warmup(url, model, settings, api_key=api_key, log=log).run()


# ---- output -----------------------------------------------------------------------------------------------


def render_table(report: dict[str, Any]) -> list[str]:
    """The report for people: one line a cell, then the verdict line."""
    s = report["settings"]
    how = {"tokenize": "sized with the engine's /tokenize", "tokenize-text": "sized with the engine's /tokenize (text)",
           "approximate": "sized by approximation (4 characters a token: no /tokenize)"}.get(
               report["sizing"].get("method") or "", "nothing sized")  # fmt: skip
    lines = [f"llmfleet warmup {report['url']} --model {report['model']}: max_tokens {s['max_tokens']}, "
             f"{s['rounds']} round(s) a cell; {how}"]  # fmt: skip
    if not report["preflight"]["ok"]:
        lines.append(report["preflight"]["why"])
        if report["preflight"].get("fix"):
            lines.append(f"  fix: {report['preflight']['fix']}")
    rounds = s["rounds"] >= 2
    head = ["INPUT", "TOKENS", "CONC", "STATUS", "REQ", "ERR", "TTFT p50", "TTFT max", "E2E max", "WALL"]
    head += ["1st/last TTFT p50"] if rounds else []
    rows = [head]
    notes: dict[int, list[str]] = {}
    for c in report["cells"]:
        r = [str(c["input_len"]), str(c.get("prompt_tokens") or "-"), str(c["concurrency"]), c["status"],
             str(c["requests"]), str(c["errors"]), duration(c.get("ttft_ms_p50")), duration(c.get("ttft_ms_max")),
             duration(c.get("e2e_ms_max")), duration(c["wall_s"] * 1000) if c["requests"] else "-"]  # fmt: skip
        if rounds:
            first, last = c.get("first_round_ttft_ms_p50"), c.get("last_round_ttft_ms_p50")
            r.append(f"{duration(first)} / {duration(last)}" if "first_round_ttft_ms_p50" in c else "-")
        rows.append(r)
        if c["status"] != OK and c.get("why") and report["preflight"]["ok"]:  # else the preflight line says it
            notes[len(rows) - 1] = [c["why"]] + ([f"fix: {c['fix']}"] if c.get("fix") else [])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for i, r in enumerate(rows):
        lines.append("  ".join(v.rjust(w) if j not in (3,) else v.ljust(w) for j, (v, w) in
                               enumerate(zip(r, widths))).rstrip())  # fmt: skip
        lines += ["    " + n for n in notes.get(i, [])]
    lines.append(f"{report['summary']} ({report['started_at']} - {report['ended_at']})")
    return lines


# ---- command line (wired into llmfleet.cli as `llmfleet warmup`) ------------------------------------------

FLAGS = {"url": "--url", "lengths": "--lengths", "concurrency": "--concurrency", "max_tokens": "--max-tokens",
         "rounds": "--rounds", "timeout": "--request-timeout", "deadline": "--deadline"}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `warmup` subcommand's arguments. The key comes from --api-key-file or $LLMFLEET_API_KEY, never argv."""
    parser.allow_abbrev = False  # no prefix matching: `--api-key X` must never reach --api-key-file
    parser.add_argument("--api-key", "--key", nargs="?", action=_RefuseKeyInArgv, help=argparse.SUPPRESS)
    add_url(parser, "the API root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    parser.add_argument("--model", required=True, metavar="NAME", help="served model name (as /v1/models lists it)")
    parser.add_argument("--api-key-file", metavar="FILE", help=f"file holding the API key (else ${ENV_KEY})")
    parser.add_argument("--lengths", required=True, metavar="N,N..", help="input lengths in tokens, e.g. 128,2048,8192")
    parser.add_argument("--concurrency", default="1", metavar="N,N..", help="requests at once per cell (default 1)")
    parser.add_argument("--max-tokens", default=str(DEFAULTS["max_tokens"]), metavar="N",
                        help=f"output tokens per request (default {DEFAULTS['max_tokens']})")  # fmt: skip
    parser.add_argument("--rounds", default=str(DEFAULTS["rounds"]), metavar="N",
                        help="rounds per cell (default 1; 2+ compares the first round with the last)")  # fmt: skip
    parser.add_argument("--request-timeout", dest="timeout", default=str(DEFAULTS["timeout"]), metavar="S",
                        help=f"seconds each request may take, whole (default {DEFAULTS['timeout']:g})")  # fmt: skip
    alias(parser, "--timeout", "--request-timeout", "timeout")
    parser.add_argument("--deadline", default=str(DEFAULTS["deadline"]), metavar="S",
                        help=f"the whole warm-up's limit (default {DEFAULTS['deadline']:g})")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the JSON report instead of the table")


def _number(text: str, option: str, kind: Callable[[str], Any]) -> Any:
    try:
        return kind(text)
    except ValueError:
        word = "a whole number" if kind is int else "a number of seconds"
        raise WarmupError(option, f"{text!r} is not {word}") from None


def run(args: argparse.Namespace) -> int:
    """`llmfleet warmup`: 0 every cell ok, 1 a cell (or /v1/models) failed, 2 bad usage or input."""
    if require_url("warmup", args) is None:
        return 2
    try:
        settings = check_settings(
            args.url,
            parse_list(args.lengths, "lengths"),
            parse_list(args.concurrency, "concurrency"),
            _number(args.max_tokens, "max_tokens", int),
            _number(args.rounds, "rounds", int),
            _number(args.timeout, "timeout", float),
            _number(args.deadline, "deadline", float),
        )
    except WarmupError as e:
        print(f"llmfleet warmup: {FLAGS[e.option]} {e}", file=sys.stderr)
        return 2
    key = None
    try:
        if args.api_key_file:
            key = read_api_key(args.api_key_file)
            warn = _key_file_warning(args.api_key_file)
            if warn:
                print(f"llmfleet warmup: warning: {warn}", file=sys.stderr)
        elif os.environ.get(ENV_KEY, "").strip():
            key = os.environ[ENV_KEY].strip()
    except KeyFileError as e:
        print(f"llmfleet warmup: {e}", file=sys.stderr)
        return 2

    def progress(c: dict[str, Any]) -> None:
        what = f"{c['status']}" + (f": {c['why']}" if c.get("why") else "")
        print(f"  {c['input_len']} x {c['concurrency']}: {what}", file=sys.stderr, flush=True)

    report = warmup(args.url, args.model, settings, api_key=key, log=None if args.json else progress)
    print(json.dumps(report, indent=2, ensure_ascii=False) if args.json else "\n".join(render_table(report)))
    return 0 if report["ok"] else 1


__all__ = [
    "DEFAULTS",
    "ENV_KEY",
    "SCHEMA",
    "WarmupError",
    "add_arguments",
    "cells_of",
    "check_settings",
    "parse_list",
    "render_table",
    "run",
    "warmup",
]
