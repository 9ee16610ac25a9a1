"""The API acceptance checker: `llmfleet accept URL --model NAME [--api-key-file F] [--profile FILE] [--json]`.

Asks a running OpenAI-compatible endpoint (the deployment's head, or its router) what its users will ask
and says, check by check, what works: three hard gates (the model listed, a deterministic question
answered exactly with no reasoning in `content`, the same over SSE with `[DONE]`, `usage` and a prompt
close) and seven capabilities reported one by one (reasoning field, reasoning_effort, multi-turn recall,
tool call with a tool-result round trip, JSON-schema output validated by the jsonschema library, a
cancelled stream the engine survives, a needle in a long prompt). Exit 0 when every hard gate and every
capability the profile marks `required` passed, 1 otherwise, 2 on bad usage or input.

Every request has a deadline (accept_http): a hung stream is a failure that says how long it hung.
The API key is read from a file, sent only in the Authorization header and never printed: it and the
profile's header values are masked in everything the checker outputs.

Runs on the ops host. Stdlib at module level; PyYAML (profiles) and jsonschema are imported when used.
The checks are in accept_checks, the profile format in accept_profile, docs/acceptance.md has both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
import sys
import time
from collections.abc import Callable
from typing import Any

from ..cli_grammar import add_url, alias, positive_seconds, require_url
from .checks import FAIL, NOT_CONFIGURED, NOT_SUPPORTED, PASS, SKIPPED, VERDICTS, Checker
from .client import Client, UrlError, split_base
from .profile import ProfileError, normalize, read_profile

MASK = "***"
SCHEMA = "llmfleet.accept/1"
# The profile's settings the report repeats (what the verdicts were reached with).
SETTINGS = (
    "timeout_s",
    "first_token_s",
    "stream_idle_s",
    "stream_close_s",
    "max_tokens",
    "thinking",
    "thinking_switch",
    "reasoning_parser",
    "tool_parser",
    "reasoning_field",
    "engine",
)


class UsageError(ValueError):
    """Bad input to the checker (exit 2): the message says what and how to fix it."""


def read_api_key(path: str) -> str:
    """The key in FILE (first line, whitespace stripped). Never taken from argv, never printed."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except OSError as e:
        raise UsageError(f"--api-key-file {path}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--api-key-file {path}: not a text file (give a file holding the key alone)") from None
    if not key:
        raise UsageError(f"--api-key-file {path}: empty (give a file holding the key alone)")
    return key


def _key_file_warning(path: str) -> str | None:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        return f"--api-key-file {path} is readable by other users (mode {stat.S_IMODE(mode):o}): chmod 600 it"
    return None


def redact(obj: Any, secrets: list[str]) -> Any:
    """`obj` with every secret (the API key, header values) replaced by *** in every string, keys included."""
    secrets = sorted({s for s in secrets if s}, key=len, reverse=True)
    if not secrets:
        return obj

    def walk(o: Any) -> Any:
        if isinstance(o, str):
            for s in secrets:
                o = o.replace(s, MASK)
            return o
        if isinstance(o, dict):
            return {walk(k): walk(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [walk(v) for v in o]
        return o

    return walk(obj)


def summarize(checks: list[dict[str, Any]]) -> dict[str, Any]:
    """accepted, what failed it, and counts of verdicts per kind."""
    failed = []
    for c in checks:
        if c["kind"] == "gate" and c["verdict"] != PASS:
            failed.append(c["name"])
        elif c["mode"] == "required" and c["verdict"] != PASS:
            failed.append(f"{c['name']} (required)")
    gates = [c for c in checks if c["kind"] == "gate"]
    caps = [c for c in checks if c["kind"] == "capability"]
    counts = {v: sum(1 for c in caps if c["verdict"] == v) for v in VERDICTS}
    gate_pass = sum(1 for c in gates if c["verdict"] == PASS)
    required = [c for c in caps if c["mode"] == "required"]
    req_pass = sum(1 for c in required if c["verdict"] == PASS)
    cap_words = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    text = f"{gate_pass}/{len(gates)} hard gates passed"
    if required:
        text += f", {req_pass}/{len(required)} required capabilities passed"
    text += f"; capabilities: {cap_words or 'none'}"
    return {
        "accepted": not failed,
        "failed": failed,
        "counts": {
            "gates": {"pass": gate_pass, "total": len(gates)},
            "required": {"pass": req_pass, "total": len(required)},
            "capabilities": counts,
        },
        "summary": ("ACCEPTED: " if not failed else f"NOT ACCEPTED ({', '.join(failed)}): ") + text,
    }


def accept(
    url: str,
    model: str,
    *,
    api_key: str | None = None,
    profile: dict[str, Any] | None = None,
    profile_path: str | None = None,
    timeout: float | None = None,
    log: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run every check against URL for MODEL; the report (a JSON-able dict, secrets masked).

    `profile` is a raw profile mapping (normalized here) or None for the defaults; `timeout` overrides its
    timeout_s. `log` gets each result row as it is done. Raises UsageError for a bad URL or profile."""
    try:
        p = normalize(profile, where=profile_path or "profile")
    except ProfileError as e:
        raise UsageError(str(e)) from None
    if p["model"] is not None and p["model"] != model:
        raise UsageError(
            f"the profile {profile_path or ''} is for model {p['model']!r}, not --model {model!r}".replace("  ", " ")
        )
    if timeout is not None:
        p["timeout_s"] = float(timeout)
        p["first_token_s"] = min(p["first_token_s"], p["timeout_s"])
    try:
        client = Client(url, api_key=api_key, headers=p["headers"], timeout=p["timeout_s"], ca_file=p["ca_file"])
    except UrlError as e:
        raise UsageError(str(e)) from None
    secrets = [api_key or "", *(v for v in p["headers"].values() if len(v) >= 4)]
    warnings = []
    if p["thinking"] and p["max_tokens"] < 512:
        warnings.append(f"max_tokens {p['max_tokens']} with thinking on: content was seen empty at 128; give 1024+")
    started = time.time()
    t0 = time.monotonic()
    masked_log = (lambda r: log(redact(r, secrets))) if log else None
    # The default max_tokens may be lowered to fit the served context; a profile's own value never is.
    checker = Checker(client, model, p, max_tokens_given=isinstance(profile, dict) and "max_tokens" in profile)
    checks = checker.run(masked_log)
    warnings += checker.notes
    report = {
        "schema": SCHEMA,
        "url": client.base,
        "model": model,
        "profile": profile_path,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "elapsed_s": round(time.monotonic() - t0, 3),
        **summarize(checks),
        "warnings": warnings,
        "settings": {**{k: p[k] for k in SETTINGS}, "headers": sorted(p["headers"])},  # header names only
        "checks": checks,
    }
    return redact(report, secrets)


# ---- output -------------------------------------------------------------------------------------------


def render_table(report: dict[str, Any]) -> str:
    """The report as a table for people: one line a check (the fix indented below a failure), then the verdict."""
    rows = [("CHECK", "MODE", "VERDICT", "TIME", "DETAIL")]
    fixes: dict[int, str] = {}
    for c in report["checks"]:
        t = f"{c['seconds']:.2f}s" if c["seconds"] else "-"
        rows.append((c["name"], c["mode"], c["verdict"].upper() if c["verdict"] == FAIL else c["verdict"], t, c["why"]))
        if c.get("fix") and c["verdict"] in (FAIL, NOT_SUPPORTED, NOT_CONFIGURED):
            fixes[len(rows) - 1] = c["fix"]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [
        f"llmfleet accept {report['url']} --model {report['model']}"
        + (f" --profile {report['profile']}" if report.get("profile") else "")
    ]
    for i, r in enumerate(rows):
        lines.append("  ".join(r[j].ljust(widths[j]) for j in range(4)) + "  " + r[4])
        if i in fixes:
            lines.append(" " * (sum(widths) + 8) + "fix: " + fixes[i])
    lines += [f"warning: {w}" for w in report.get("warnings", [])]
    lines.append(report["summary"] + f" ({report['elapsed_s']:.1f} s)")
    return "\n".join(lines)


def _write_json(path: str, report: dict[str, Any]) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2, ensure_ascii=False)
            f.write("\n")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ---- command line (wired into llmfleet.cli as `llmfleet accept`) -----------------------------------------


class _RefuseKeyInArgv(argparse.Action):
    """`--api-key VALUE` is refused (exit 2) without echoing the value: argv is visible to every user of the
    host (ps, /proc) and lands in shell history. Defined so that argparse does not take it as an
    abbreviation of --api-key-file (it would then print the key as a file name it cannot read)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        parser.error(
            f"{option_string}: never give the API key on the command line; put it in a file (chmod 600) "
            "and pass --api-key-file FILE"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `accept` subcommand's arguments. The key only ever comes from a file (--api-key-file)."""
    parser.allow_abbrev = False  # no prefix matching: `--api-key X` must never reach --api-key-file
    parser.add_argument("--api-key", "--key", nargs="?", action=_RefuseKeyInArgv, help=argparse.SUPPRESS)
    add_url(parser, "the API root, e.g. http://head:8000 (a trailing /v1 is fine)", positional=True)
    parser.add_argument("--model", required=True, metavar="NAME", help="served model name (as /v1/models lists it)")
    parser.add_argument("--api-key-file", metavar="FILE", help="file holding the API key (never pass the key itself)")
    parser.add_argument("--profile", metavar="FILE", help="per-model profile, YAML (docs/acceptance.md)")
    parser.add_argument("--request-timeout", dest="timeout", type=positive_seconds, metavar="S",
                        help="seconds each request may take (default: the profile's timeout_s, 120)")  # fmt: skip
    alias(parser, "--timeout", "--request-timeout", "timeout", type=positive_seconds)
    parser.add_argument("-o", "--output", metavar="FILE", help="also write the JSON report to FILE (atomically)")
    parser.add_argument("--json", action="store_true", help="print the JSON report instead of the table")


def run(args: argparse.Namespace) -> int:
    """`llmfleet accept`: 0 accepted, 1 a hard gate (or a required capability) failed, 2 bad usage/input."""
    if require_url("accept", args) is None:
        return 2
    try:
        split_base(args.url)
        key = read_api_key(args.api_key_file) if args.api_key_file else None
        raw = None
        if args.profile:
            raw = read_profile(args.profile)  # as written: accept() normalizes it and knows which keys it sets
        if args.output:
            parent = os.path.dirname(os.path.abspath(args.output))
            if os.path.isdir(args.output) or not os.path.isdir(parent):
                raise UsageError(f"-o {args.output}: give a file name in an existing directory")
    except (UsageError, ProfileError, UrlError) as e:
        print(f"llmfleet accept: {e}", file=sys.stderr)
        return 2
    warn = _key_file_warning(args.api_key_file) if args.api_key_file else None
    if warn:
        print(f"llmfleet accept: warning: {warn}", file=sys.stderr)

    def progress(r: dict[str, Any]) -> None:
        print(f"  {r['name']}: {r['verdict']}", file=sys.stderr, flush=True)

    try:
        report = accept(
            args.url,
            args.model,
            api_key=key,
            profile=raw,
            profile_path=args.profile,
            timeout=args.timeout,
            log=None if args.json else progress,
        )
    except UsageError as e:
        print(f"llmfleet accept: {e}", file=sys.stderr)
        return 2
    if warn:
        report["warnings"].append(warn)
    if args.output:
        try:
            _write_json(args.output, report)
        except OSError as e:
            print(f"llmfleet accept: -o {args.output}: cannot write it: {e.strerror or e}", file=sys.stderr)
            return 2
    print(json.dumps(report, indent=2, ensure_ascii=False) if args.json else render_table(report))
    return 0 if report["accepted"] else 1


__all__ = [
    "FAIL",
    "NOT_CONFIGURED",
    "NOT_SUPPORTED",
    "PASS",
    "SKIPPED",
    "UsageError",
    "accept",
    "add_arguments",
    "read_api_key",
    "redact",
    "render_table",
    "run",
    "summarize",
]
