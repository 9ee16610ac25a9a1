"""Serving benchmark of a deployed endpoint, driven through the engine's OWN load generator.

llmfleet writes no load generator: each measurement is one run of `vllm bench serve` (vLLM) or
`python -m sglang.bench_serving` (SGLang) as a subprocess, and this module builds the command lines,
runs a matrix of cases, reads the tools' result files and aggregates them (docs/measurements/bench-serving.md).

Method, the same for every case (input length I, output length O, concurrency C):
  - random token ids, no dataset download (offline clusters): vLLM `--dataset-name random
    --random-range-ratio 0`, SGLang `--dataset-name random-ids --random-range-ratio 1` (SGLang's
    `random` samples from ShareGPT and downloads it; its ratio is the lower bound, so 1 = fixed);
  - fixed input and output lengths with EOS ignored (vLLM `--ignore-eos`; SGLang's default, turned
    off only by `--disable-ignore-eos`), temperature 0, all requests at once (`--request-rate inf`)
    held to C in flight by `--max-concurrency C`, through /v1/completions;
  - a separate warm-up run per case (same shape, its own seed, not aggregated), then N rounds; each
    run gets its own seed so no two runs send the same prompts (the prefix cache stays on, as
    deployed, and never sees a repeat);
  - every run keeps its raw output: the tool's result file (`--save-result --result-dir` /
    `--output-file`) and its stdout+stderr, under OUTPUT_DIR/raw/.

Per case: median, min and max over rounds of each metric (TTFT, TPOT, ITL, E2E latency at p50/p95/p99,
output tok/s, req/s, GPU-hours per million output tokens when --gpus is given). The success rate
pools all rounds: completed / requests SENT, so a failed request stays in the denominator (vLLM
exits 0 with every request failed; SGLang's result has no failed count). Latency percentiles are the
tool's, over the requests that succeeded.

Case status: OK (all rounds ran, success rate >= --min-success-rate), FAILED (ran, too many requests
failed), NOT_EXECUTED (the tool is missing, exited non-zero, timed out or wrote no result, the
warm-up could not run or no warm-up request succeeded, or the endpoint did not answer the
preflight): each with `why`. Exit: 0 every case OK, 1 otherwise, 2 bad usage.

Standard library only, Python >= 3.8 (it runs on the ops host or on the head node, beside the engine).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from .. import engines
from ..cli_grammar import CommaList, add_url, alias, int_list

SCHEMA = "llmfleet.servebench/1"
# The engines whose serving benchmark this drives, and each one's tool (the profiles': llmfleet.engines). The
# two tools differ in flags and result files: vLLM's `vllm bench serve` (JSON), SGLang's bench_serving (JSONL).
_VLLM = engines.VLLM.engine
ENGINES = tuple(e for e in engines.engines() if engines.get(e).bench_tool)
DEFAULT_TOOL = {e: list(engines.get(e).bench_tool) for e in ENGINES}
OK, FAILED, NOT_EXECUTED = "OK", "FAILED", "NOT_EXECUTED"
LATENCIES = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (50, 95, 99)
# Normalized per-run metrics (ms for latencies); every one is aggregated as median/min/max over rounds.
METRICS = (
    "output_tok_s",
    "total_tok_s",
    "request_s",
    "duration_s",
    *[f"{m}_ms_{s}" for m in LATENCIES for s in ("mean", *[f"p{p}" for p in PERCENTILES])],
    "gpu_h_per_mtok",
)
_MATRIX_KEYS = {"input_len", "output_len", "concurrency", "num_prompts", "cases"}
_CASE_KEYS = {"input_len", "output_len", "concurrency", "num_prompts"}
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*")
_ERRORISH = re.compile(r"error|not ready|exiting|failed|refused|no module named", re.I)


class UsageError(Exception):
    """Bad input (flags, matrix file): exit 2 with this message."""


# ---- the matrix ---------------------------------------------------------------------------------------


class Case:
    """One (input length, output length, concurrency) point, with the prompts sent per round."""

    def __init__(self, input_len: int, output_len: int, concurrency: int, num_prompts: int | None = None):
        self.input_len = input_len
        self.output_len = output_len
        self.concurrency = concurrency
        self.num_prompts = num_prompts if num_prompts is not None else 10 * concurrency

    @property
    def id(self) -> str:
        return f"in{self.input_len}-out{self.output_len}-c{self.concurrency}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "concurrency": self.concurrency,
            "num_prompts": self.num_prompts,
        }

    def __repr__(self) -> str:
        return f"Case({self.id}, n={self.num_prompts})"


def _positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{what}: {value!r} is not a whole number >= 1")
    return value


def _int_list(value: Any, what: str) -> list[int]:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise UsageError(f"{what}: empty list")
    return [_positive(v, what) for v in items]


def cases_from_matrix(data: Any, num_prompts: int | None = None) -> list[Case]:  # noqa: PLR0912 (one check each)
    """Cases from a parsed matrix file: lists `input_len`, `output_len`, `concurrency` (their product,
    in that order) and/or a `cases` list of {input_len, output_len, concurrency[, num_prompts]}.
    A top-level `num_prompts` applies to the product; `num_prompts` here (the flag) overrides all."""
    if not isinstance(data, dict):
        raise UsageError("the matrix must be a mapping (input_len/output_len/concurrency lists and/or cases)")
    unknown = sorted(set(data) - _MATRIX_KEYS)
    if unknown:
        raise UsageError(f"unknown matrix key(s) {', '.join(unknown)}: use {', '.join(sorted(_MATRIX_KEYS))}")
    out: list[Case] = []
    axes = [k for k in ("input_len", "output_len", "concurrency") if k in data]
    if axes:
        if len(axes) != 3:
            missing = sorted({"input_len", "output_len", "concurrency"} - set(axes))
            raise UsageError(f"the matrix gives {', '.join(axes)} but not {', '.join(missing)}")
        top_n = _positive(data["num_prompts"], "num_prompts") if "num_prompts" in data else None
        for i, o, c in itertools.product(
            _int_list(data["input_len"], "input_len"),
            _int_list(data["output_len"], "output_len"),
            _int_list(data["concurrency"], "concurrency"),
        ):
            out.append(Case(i, o, c, num_prompts or top_n))
    elif "num_prompts" in data:
        raise UsageError("top-level num_prompts applies to input_len/output_len/concurrency lists; none given")
    cases = data.get("cases", [])
    if not isinstance(cases, list):
        raise UsageError("cases: must be a list of {input_len, output_len, concurrency[, num_prompts]}")
    for k, entry in enumerate(cases):
        if not isinstance(entry, dict):
            raise UsageError(f"cases[{k}]: must be a mapping")
        bad = sorted(set(entry) - _CASE_KEYS)
        missing = sorted({"input_len", "output_len", "concurrency"} - set(entry))
        if bad or missing:
            parts = ([f"unknown key(s) {', '.join(bad)}"] if bad else []) + (
                [f"missing {', '.join(missing)}"] if missing else []
            )
            raise UsageError(f"cases[{k}]: " + "; ".join(parts))
        n = _positive(entry["num_prompts"], f"cases[{k}].num_prompts") if "num_prompts" in entry else None
        out.append(Case(
            _positive(entry["input_len"], f"cases[{k}].input_len"),
            _positive(entry["output_len"], f"cases[{k}].output_len"),
            _positive(entry["concurrency"], f"cases[{k}].concurrency"),
            num_prompts or n,
        ))  # fmt: skip
    if not out:
        raise UsageError("the matrix has no cases")
    seen = set()
    for c in out:
        if c.id in seen:
            raise UsageError(f"case {c.id} is listed twice")
        seen.add(c.id)
    return out


def load_matrix(path: str, num_prompts: int | None = None) -> list[Case]:
    """Read a JSON or YAML matrix file (YAML needs PyYAML, imported only here)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise UsageError(f"--matrix {path}: cannot read it: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except ValueError:
        try:
            import yaml
        except ImportError:
            raise UsageError(f"--matrix {path}: not JSON, and PyYAML is not installed here: give it as JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise UsageError(f"--matrix {path}: not valid JSON or YAML: {e}") from None
    try:
        return cases_from_matrix(data, num_prompts)
    except UsageError as e:
        raise UsageError(f"--matrix {path}: {e}") from None


# ---- command lines --------------------------------------------------------------------------------------


class Settings:
    """Everything that is the same for every run of one benchmark."""

    def __init__(
        self,
        *,
        engine: str,
        base_url: str,
        model: str,
        tokenizer: str,
        tool: list[str] | None = None,
        rounds: int = 3,
        warmup_prompts: int | None = None,
        seed: int = 0,
        gpus: int | None = None,
        extra_args: list[str] | None = None,
        detailed: bool = False,
        min_success_rate: float = 1.0,
        run_timeout: float = 3600.0,
        api_key: str | None = None,
    ):
        if engine not in ENGINES:
            raise UsageError(f"engine {engine!r}: use one of {', '.join(ENGINES)}")
        self.engine = engine
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.tokenizer = tokenizer
        self.tool = list(tool) if tool else list(DEFAULT_TOOL[engine])
        self.rounds = rounds
        self.warmup_prompts = warmup_prompts
        self.seed = seed
        self.gpus = gpus
        self.extra_args = list(extra_args or [])
        self.detailed = detailed
        self.min_success_rate = min_success_rate
        self.run_timeout = run_timeout
        self.api_key = api_key

    def as_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "base_url": self.base_url,
            "model": self.model,
            "tokenizer": self.tokenizer,
            "tool": self.tool,
            "rounds": self.rounds,
            "warmup_prompts": self.warmup_prompts,
            "seed": self.seed,
            "gpus": self.gpus,
            "extra_args": self.extra_args,
            "detailed": self.detailed,
            "min_success_rate": self.min_success_rate,
            "run_timeout_s": self.run_timeout,
            "api_key": "set" if self.api_key else None,
        }


def result_name(settings: Settings, case: Case, label: str) -> str:
    """File name of one run's result under raw/: `in32-out8-c2.r1.json`, `.warmup.json` (SGLang: .jsonl)."""
    return f"{case.id}.{label}.{engines.get(settings.engine).bench_result_ext}"


def build_argv(settings: Settings, case: Case, num_prompts: int, seed: int, result_path: str) -> list[str]:
    """The tool's argv for one run of `case` writing its result to `result_path`."""
    i, o, c = str(case.input_len), str(case.output_len), str(case.concurrency)
    if settings.engine == _VLLM:
        argv = [
            *settings.tool,
            "--backend", "openai",
            "--base-url", settings.base_url,
            "--endpoint", "/v1/completions",
            "--model", settings.model,
            "--tokenizer", settings.tokenizer,
            "--dataset-name", "random",
            "--random-input-len", i,
            "--random-output-len", o,
            "--random-range-ratio", "0",
            "--ignore-eos",
            "--temperature", "0",
            "--num-prompts", str(num_prompts),
            "--max-concurrency", c,
            "--request-rate", "inf",
            "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", ",".join(str(p) for p in PERCENTILES),
            "--save-result",
            "--result-dir", os.path.dirname(result_path) or ".",
            "--result-filename", os.path.basename(result_path),
            "--disable-tqdm",
        ]  # fmt: skip
        if settings.detailed:
            argv.append("--save-detailed")
    else:
        argv = [
            *settings.tool,
            "--backend", "sglang-oai",
            "--base-url", settings.base_url,
            # --model is also what the client loads a tokenizer/chat template from: the local
            # directory, never a hub name (offline); the API name goes in --served-model-name.
            "--model", settings.tokenizer,
            "--served-model-name", settings.model,
            "--tokenizer", settings.tokenizer,
            "--dataset-name", "random-ids",
            "--random-input-len", i,
            "--random-output-len", o,
            "--random-range-ratio", "1",
            "--temperature", "0",
            "--num-prompts", str(num_prompts),
            "--max-concurrency", c,
            "--request-rate", "inf",
            "--seed", str(seed),
            "--warmup-requests", "0",
            "--output-file", result_path,
            "--disable-tqdm",
        ]  # fmt: skip
        if settings.detailed:
            argv.append("--output-details")
    return argv + settings.extra_args


def plan_runs(settings: Settings, cases: list[Case]) -> list[dict[str, Any]]:
    """Every run in order: per case a warm-up (unless 0 prompts) then the rounds, each with its own seed."""
    runs = []
    for k, case in enumerate(cases):
        base = settings.seed + 1000 * k
        warm = settings.warmup_prompts if settings.warmup_prompts is not None else 2 * case.concurrency
        if warm > 0:
            runs.append({"case": case, "kind": "warmup", "round": 0, "seed": base, "num_prompts": warm})
        for r in range(1, settings.rounds + 1):
            runs.append({"case": case, "kind": "round", "round": r, "seed": base + r, "num_prompts": case.num_prompts})
    return runs


# ---- reading the tools' results --------------------------------------------------------------------------


def _num(value: Any) -> float | None:
    """A finite number or None (SGLang writes NaN/Infinity; vLLM writes 0.0 latencies when all failed)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def parse_vllm_result(data: dict[str, Any]) -> dict[str, Any]:
    """Normalize one `vllm bench serve --save-result` JSON (0.32: keys `completed`, `failed`,
    `output_throughput`, `p50_ttft_ms`, ..., `p99_e2el_ms`)."""
    out: dict[str, Any] = {
        "completed": int(data.get("completed") or 0),
        "failed_reported": data.get("failed"),
        "total_input_tokens": data.get("total_input_tokens"),
        "total_output_tokens": data.get("total_output_tokens"),
        "duration_s": _num(data.get("duration")),
        "output_tok_s": _num(data.get("output_throughput")),
        "total_tok_s": _num(data.get("total_token_throughput")),
        "request_s": _num(data.get("request_throughput")),
    }
    for m, key in (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2e", "e2el")):
        out[f"{m}_ms_mean"] = _num(data.get(f"mean_{key}_ms"))
        for p in PERCENTILES:
            v = data.get(f"p{p}_{key}_ms")
            if v is None and p == 50:
                v = data.get(f"median_{key}_ms")
            out[f"{m}_ms_p{p}"] = _num(v)
    out["errors"] = [e for e in data.get("errors") or [] if e]
    return out


def parse_sglang_result(data: dict[str, Any]) -> dict[str, Any]:
    """Normalize one line of `sglang.bench_serving --output-file` JSONL (0.5.23: `completed` but no
    failed count, `median_*`/`p95_*`/`p99_*` for ttft/tpot/itl and `*_e2e_latency_ms`)."""
    out: dict[str, Any] = {
        "completed": int(data.get("completed") or 0),
        "failed_reported": None,
        "total_input_tokens": data.get("total_input_tokens"),
        "total_output_tokens": data.get("total_output_tokens"),
        "duration_s": _num(data.get("duration")),
        "output_tok_s": _num(data.get("output_throughput")),
        "total_tok_s": _num(data.get("total_throughput")),
        "request_s": _num(data.get("request_throughput")),
    }
    for m in ("ttft", "tpot", "itl", "e2e"):
        key = "e2e_latency" if m == "e2e" else m
        out[f"{m}_ms_mean"] = _num(data.get(f"mean_{key}_ms"))
        out[f"{m}_ms_p50"] = _num(data.get(f"median_{key}_ms"))
        for p in PERCENTILES[1:]:
            out[f"{m}_ms_p{p}"] = _num(data.get(f"p{p}_{key}_ms"))
    out["errors"] = [e for e in data.get("errors") or [] if e]
    return out


def read_result(engine: str, path: str) -> dict[str, Any]:
    """Parse a result file (raises OSError / ValueError when absent or unreadable)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if engine == _VLLM:
        data = json.loads(text)
    else:  # JSONL, appended: the last line is this run's
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if not lines:
            raise ValueError("empty result file")
        data = json.loads(lines[-1])
    if not isinstance(data, dict):
        raise ValueError("the result is not a JSON object")
    return parse_vllm_result(data) if engine == _VLLM else parse_sglang_result(data)


def finish_metrics(parsed: dict[str, Any], case: Case, requested: int, gpus: int | None) -> dict[str, Any]:
    """Counts against what was SENT, latencies blanked when nothing succeeded, the GPU cost, warnings."""
    m = dict(parsed)
    completed = m["completed"]
    m["requests"] = requested
    m["failed"] = max(requested - completed, 0)
    m["success_rate"] = completed / requested if requested else 0.0
    warnings = []
    if m.get("failed_reported") is not None and completed + int(m["failed_reported"]) != requested:
        warnings.append(f"the tool counted {completed} completed + {m['failed_reported']} failed of {requested} sent")
    if completed == 0:
        for key in METRICS:
            if "_ms_" in key:
                m[key] = None  # vLLM writes 0.0 ms when no request succeeded: not a latency
    out_tokens = m.get("total_output_tokens")
    if completed and isinstance(out_tokens, int) and out_tokens != completed * case.output_len:
        warnings.append(
            f"{out_tokens} output tokens, expected {completed} x {case.output_len} = {completed * case.output_len}: "
            "EOS not ignored or max_tokens capped by the engine"
        )
    in_tokens = m.get("total_input_tokens")
    expected_in = completed * case.input_len
    if completed and isinstance(in_tokens, int) and abs(in_tokens - expected_in) > max(1, expected_in // 100):
        warnings.append(f"{in_tokens} input tokens, expected about {expected_in} ({completed} x {case.input_len})")
    if completed and m.get("ttft_ms_p50") == 0.0:
        warnings.append(
            "TTFT p50 is 0 ms: the tool saw no text in most streams before the end (SGLang's client times the "
            "first non-empty text chunk; a model whose tokens decode to nothing shows this)"
        )
    tok_s = m.get("output_tok_s")
    m["gpu_h_per_mtok"] = gpus * 1e6 / (3600.0 * tok_s) if gpus and tok_s else None
    m["warnings"] = warnings
    return m


# ---- aggregation --------------------------------------------------------------------------------------


def spread(values: list[float | None]) -> dict[str, Any] | None:
    """Median, min, max of the values that exist (None if none do)."""
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def summarize_case(case: Case, runs: list[dict[str, Any]], min_success_rate: float) -> dict[str, Any]:
    """Status, why, pooled success rate and per-metric median/min/max over the rounds that ran."""
    warm = [r for r in runs if r["kind"] == "warmup"]
    rounds = [r for r in runs if r["kind"] == "round"]
    ran = [r for r in rounds if r["status"] == "ran"]
    requests = sum(r["metrics"]["requests"] for r in ran)
    completed = sum(r["metrics"]["completed"] for r in ran)
    summary = {k: spread([r["metrics"].get(k) for r in ran]) for k in METRICS}
    out: dict[str, Any] = {
        **case.as_dict(),
        "status": OK,
        "why": None,
        "rounds_run": len(ran),
        "requests": requests,
        "completed": completed,
        "failed": requests - completed,
        "success_rate": completed / requests if requests else None,
        "summary": summary,
        "warnings": sorted({w for r in runs for w in (r.get("metrics") or {}).get("warnings", [])}),
        "runs": [{k: v for k, v in r.items() if k != "case"} for r in runs],
    }
    not_run = [r for r in warm + rounds if r["status"] != "ran"]
    if not_run:
        tried = [r for r in not_run if r.get("argv")]
        if tried:  # the first run that was attempted and failed names the cause
            first = tried[0]
            label = "warm-up" if first["kind"] == "warmup" else f"round {first['round']} of {len(rounds)}"
            why = f"{label}: {first['why']}"
        else:  # nothing attempted: the endpoint or the tool was unusable before the first run
            why = not_run[0]["why"]
        out["status"], out["why"] = NOT_EXECUTED, why
    elif not ran:
        out["status"], out["why"] = NOT_EXECUTED, "no round ran"
    elif out["success_rate"] is not None and out["success_rate"] < min_success_rate:
        errors = [e for r in ran for e in r["metrics"].get("errors", [])]
        hint = (
            f"first error: {_clip(errors[0])}"
            if errors
            else "per-request errors are in the raw results with --detailed"
        )
        out["status"] = FAILED
        out["why"] = (
            f"{requests - completed} of {requests} requests failed (success {100.0 * completed / requests:.1f}% < "
            f"{100.0 * min_success_rate:g}%); {hint}"
        )
    return out


# ---- running --------------------------------------------------------------------------------------------


def _clip(text: str, n: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def why_from_log(text: str) -> str:
    """The line that says why a tool run failed: the last exception line, else the last error-ish line,
    else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for pattern in (_EXC_LINE, _ERRORISH):
        for ln in reversed(lines[-200:]):
            if pattern.search(ln) if pattern is _ERRORISH else pattern.match(ln):
                return _clip(ln)
    return _clip(lines[-1]) if lines else "no output"


def tool_problem(tool: list[str]) -> str | None:
    """Why the tool's program cannot be started, or None."""
    prog = tool[0] if tool else ""
    if not prog:
        return "no tool command"
    if os.sep in prog:
        if not os.path.isfile(prog) or not os.access(prog, os.X_OK):
            return f"tool not found: {prog} is not an executable file"
        return None
    if shutil.which(prog) is None:
        return f"tool not found: {prog!r} is not on PATH (give --tool with the engine venv's path)"
    return None


def run_tool(
    argv: list[str], log_path: str, timeout: float, env: dict[str, str] | None = None
) -> tuple[int | None, str]:
    """Run one tool command, stdout+stderr to log_path, in its own process group (killed whole on a
    timeout or an interrupt). Returns (exit code or None, why-not-run or "")."""
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)  # fmt: skip
        except OSError as e:
            return None, f"cannot start {argv[0]}: {e.strerror or e}"
        try:
            return proc.wait(timeout=timeout), ""
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return None, f"timed out after {timeout:g} s (--run-timeout)"
        except BaseException:
            _kill_group(proc)
            raise


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def execute(settings: Settings, run: dict[str, Any], raw_dir: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One planned run: build argv, run it, parse its result. Fills status ("ran" / NOT_EXECUTED), why, metrics."""
    case: Case = run["case"]
    label = "warmup" if run["kind"] == "warmup" else f"r{run['round']}"
    result_file = result_name(settings, case, label)
    result_path = os.path.join(raw_dir, result_file)
    log_file = f"{case.id}.{label}.log"
    argv = build_argv(settings, case, run["num_prompts"], run["seed"], result_path)
    out = dict(run, argv=argv, result_file=f"raw/{result_file}", log_file=f"raw/{log_file}",
               rc=None, wall_s=None, status=NOT_EXECUTED, why=None, metrics=None)  # fmt: skip
    problem = tool_problem(settings.tool)
    if problem:
        out["why"] = problem
        return out
    try:
        os.unlink(result_path)  # SGLang appends to its output file; a re-run must not read an old line
    except OSError:
        pass
    t0 = time.monotonic()
    rc, not_run = run_tool(argv, os.path.join(raw_dir, log_file), settings.run_timeout, env)
    out["rc"], out["wall_s"] = rc, round(time.monotonic() - t0, 3)
    if rc is None:
        out["why"] = not_run
        return out
    if rc != 0:
        try:
            with open(os.path.join(raw_dir, log_file), encoding="utf-8", errors="replace") as f:
                tail = f.read()[-20000:]
        except OSError:
            tail = ""
        out["why"] = f"{' '.join(settings.tool)} exited {rc}: {why_from_log(tail)}"
        return out
    try:
        parsed = read_result(settings.engine, result_path)
    except (OSError, ValueError) as e:
        out["why"] = f"exited 0 but wrote no readable result {out['result_file']}: {e}"
        return out
    out["status"] = "ran"
    out["metrics"] = finish_metrics(parsed, case, run["num_prompts"], settings.gpus)
    return out


def _not_run(run: dict[str, Any], why: str) -> dict[str, Any]:
    """A planned run that was never started (the endpoint or tool unusable, or the case given up)."""
    return dict(run, argv=None, result_file=None, log_file=None, rc=None, wall_s=None, status=NOT_EXECUTED,
                why=why, metrics=None)  # fmt: skip


def _http_get(url: str, api_key: str | None, timeout: float) -> Any:
    # The operator's endpoint URL; settings_from_args allows only http(s).
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})  # noqa: S310
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310
        return json.loads(resp.read().decode("utf-8", "replace"))


def preflight(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> dict[str, Any]:
    """GET /v1/models (the served names) and, best effort, /version. `error` says why it failed."""
    out: dict[str, Any] = {"models": [], "version": None, "error": None}
    try:
        data = _http_get(f"{base_url}/v1/models", api_key, timeout)
        out["models"] = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)]
    except urllib.error.HTTPError as e:
        out["error"] = f"GET {base_url}/v1/models: HTTP {e.code} {e.reason}"
        return out
    except (urllib.error.URLError, OSError, ValueError, AttributeError) as e:
        reason = getattr(e, "reason", None) or e
        out["error"] = f"GET {base_url}/v1/models: {reason}"
        return out
    try:
        v = _http_get(f"{base_url}/version", api_key, timeout)
        out["version"] = v.get("version") if isinstance(v, dict) else None
    except (urllib.error.URLError, OSError, ValueError, AttributeError):
        pass
    return out


def _write_json(path: str, data: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=False, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run_benchmark(
    settings: Settings,
    cases: list[Case],
    out_dir: str,
    *,
    endpoint: dict[str, Any] | None = None,
    command: str | None = None,
    progress: Any = None,
) -> dict[str, Any]:
    """Run the whole matrix, writing OUT_DIR/results.json after every case and report.md + chart.svg at
    the end. `endpoint` is the preflight's answer; one with an `error` marks every case NOT_EXECUTED."""
    from .serve_report import render_markdown, render_svg

    raw_dir = os.path.join(out_dir, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    env = dict(os.environ)
    if settings.api_key:
        env["OPENAI_API_KEY"] = settings.api_key  # both tools send it as a Bearer token; never in argv
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "command": command,
        "started": _now(),
        "finished": None,
        "wall_s": None,
        "settings": settings.as_dict(),
        "method": method_dict(settings),
        "endpoint": endpoint,
        "cases": [],
        "ok": False,
    }
    t0 = time.monotonic()
    plan = plan_runs(settings, cases)
    blocked = (endpoint or {}).get("error") or tool_problem(settings.tool)
    if blocked and progress:
        progress(f"every case NOT_EXECUTED: {blocked}")
    for case in cases:
        runs: list[dict[str, Any]] = []
        skip = blocked
        for run in (r for r in plan if r["case"] is case):
            if skip:
                runs.append(_not_run(run, skip))
                continue
            r = execute(settings, run, raw_dir, env)
            if r["kind"] == "warmup" and r["status"] == "ran" and r["metrics"]["completed"] == 0:
                errors = r["metrics"].get("errors") or []
                r["status"] = NOT_EXECUTED
                r["why"] = f"no warm-up request succeeded (0 of {r['metrics']['requests']})" + (
                    f": {_clip(errors[0])}" if errors else ""
                )
            runs.append(r)
            if progress:
                progress(_progress_line(plan.index(run) + 1, len(plan), r))
            if r["status"] != "ran":  # the rest of the case would fail the same way: skip it
                what = "the warm-up" if r["kind"] == "warmup" else f"round {r['round']}"
                skip = f"skipped: {what} was not executed"
        results["cases"].append(summarize_case(case, runs, settings.min_success_rate))
        results["wall_s"] = round(time.monotonic() - t0, 3)
        _write_json(os.path.join(out_dir, "results.json"), results)
    results["finished"] = _now()
    results["wall_s"] = round(time.monotonic() - t0, 3)
    results["ok"] = bool(results["cases"]) and all(c["status"] == OK for c in results["cases"])
    svg = render_svg(results)
    with open(os.path.join(out_dir, "chart.svg"), "w", encoding="utf-8") as f:
        f.write(svg)
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(render_markdown(results, svg))
    _write_json(os.path.join(out_dir, "results.json"), results)
    return results


def method_dict(settings: Settings) -> dict[str, Any]:
    tool = " ".join(settings.tool)
    if settings.engine == _VLLM:
        data = "random token ids (--dataset-name random --random-range-ratio 0: fixed lengths)"
        eos = "--ignore-eos"
    else:
        data = "random token ids (--dataset-name random-ids --random-range-ratio 1: fixed lengths)"
        eos = "ignore_eos (the tool's default)"
    return {
        "tool": tool,
        "api": "/v1/completions, streamed",
        "prompts": data,
        "eos": eos,
        "temperature": 0,
        "arrival": "all at once (--request-rate inf), at most C in flight (--max-concurrency C)",
        "warmup": "a separate run per case before its rounds, not aggregated",
        "rounds": settings.rounds,
        "aggregate": "median (min-max) over rounds; success rate = completed / sent, pooled over rounds",
    }


def _progress_line(k: int, n: int, r: dict[str, Any]) -> str:
    what = f"[{k}/{n}] {r['case'].id} {'warm-up' if r['kind'] == 'warmup' else 'round ' + str(r['round'])}"
    if r["status"] != "ran":
        return f"{what}: NOT_EXECUTED: {r['why']}"
    m = r["metrics"]
    tok = m.get("output_tok_s")
    e2e = m.get("e2e_ms_p50")
    return (
        f"{what}: {m['completed']}/{m['requests']} ok, "
        f"{'-' if tok is None else f'{tok:.1f}'} out tok/s, E2E p50 {'-' if e2e is None else f'{e2e:.1f}'} ms "
        f"({r['wall_s']:.1f} s)"
    )


# ---- command line ---------------------------------------------------------------------------------------


def _whole(low: int) -> Any:
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (give one >= {low})") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"{n} is too small: give a number >= {low}")
        return n

    return parse


def _rate(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = -1.0
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction between 0 and 1 (e.g. 0.99)")
    return x


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `llmfleet bench` options (cli.py adds the subcommand and calls run(args))."""
    p.add_argument("--engine", required=True, choices=ENGINES, help="whose benchmark tool drives the load")
    add_url(p, "the endpoint, e.g. http://10.0.0.1:8000 (no /v1)", old=("--base-url",))
    p.add_argument("--model", help="served model name (default: the first one /v1/models lists)")
    p.add_argument(
        "--tokenizer",
        required=True,
        help="the model's directory on THIS host (the tool samples token ids from its vocabulary; no download)",
    )
    p.add_argument("--matrix", metavar="FILE", help="JSON or YAML: input_len/output_len/concurrency lists and/or cases")
    lists = {"type": int_list(1), "nargs": "+", "action": CommaList, "metavar": "N,N"}
    p.add_argument("--input-len", **lists, help="input lengths (tokens), comma-separated")
    p.add_argument("--output-len", **lists, help="output lengths (tokens, EOS ignored), comma-separated")
    p.add_argument("--concurrency", **lists, help="requests in flight, comma-separated (e.g. 1,16,64)")
    p.add_argument("--num-prompts", type=_whole(1), help="requests per round (default: 10 x concurrency)")
    p.add_argument("--rounds", type=_whole(1), default=3, help="rounds per case (default 3)")
    p.add_argument(
        "--warmup-prompts",
        type=_whole(0),
        help="requests of the warm-up run per case (default: 2 x concurrency; 0: none)",
    )
    p.add_argument("--seed", type=_whole(0), default=0, help="base seed (each run gets its own; default 0)")
    p.add_argument(
        "--gpus", type=_whole(1), help="GPUs behind the endpoint, all nodes: adds GPU-hours per 1M output tokens"
    )
    p.add_argument("--tool", help="the tool command (default: 'vllm bench serve' / 'python3 -m sglang.bench_serving')")
    p.add_argument(
        "--tool-arg", action="append", default=[], metavar="ARG", help="extra argument for the tool (repeat)"
    )
    p.add_argument("--detailed", action="store_true", help="keep per-request data in the raw results (large)")
    p.add_argument("--min-success-rate", type=_rate, default=1.0, help="below it a case FAILED (default 1.0)")
    p.add_argument("--run-timeout", type=_whole(1), default=3600, help="seconds one tool run may take (default 3600)")
    p.add_argument("--api-key-file", help="file holding the endpoint's API key (sent as OPENAI_API_KEY to the tool)")
    p.add_argument("--no-preflight", action="store_true", help="do not GET /v1/models first (then --model is required)")
    p.add_argument(
        "-o",
        "--output",
        dest="output_dir",
        metavar="DIR",
        help="directory for results.json, report.md, chart.svg, raw/ (default: a new ./servebench-<UTC>, named on "
        "stderr)",
    )
    alias(p, "--output-dir", "-o/--output", "output_dir")
    p.add_argument("--check", dest="dry_run", action="store_true", help="print the tool command lines, run nothing")
    alias(p, "--dry-run", "--check", "dry_run", nargs=0)
    p.add_argument("--json", action="store_true", help="print results.json instead of the Markdown tables")


def settings_from_args(args: argparse.Namespace) -> tuple[Settings, list[Case]]:  # noqa: PLR0912 (one check each)
    """Validate what argparse cannot (raises UsageError)."""
    axes = [args.input_len, args.output_len, args.concurrency]
    if args.matrix and any(axes):
        raise UsageError("give the matrix as --matrix FILE or as --input-len/--output-len/--concurrency, not both")
    if args.matrix:
        cases = load_matrix(args.matrix, args.num_prompts)
    elif all(axes):
        cases = cases_from_matrix(
            {"input_len": args.input_len, "output_len": args.output_len, "concurrency": args.concurrency},
            args.num_prompts,
        )
    else:
        raise UsageError("give --matrix FILE, or all of --input-len, --output-len and --concurrency")
    if not args.url:
        raise UsageError("--url URL is required (e.g. --url http://10.0.0.1:8000)")
    if not re.match(r"^https?://[^/\s]+", args.url):
        raise UsageError(f"--url {args.url!r}: give http(s)://HOST:PORT (e.g. http://10.0.0.1:8000)")
    if args.url.rstrip("/").endswith("/v1"):
        raise UsageError(f"--url {args.url}: leave out /v1 (the tools add /v1/completions)")
    local = args.tokenizer.startswith(("/", "./", "../", "~"))
    if local and not os.path.isdir(os.path.expanduser(args.tokenizer)):
        raise UsageError(f"--tokenizer {args.tokenizer}: not a directory (give the model's directory on this host)")
    if args.no_preflight and not args.model:
        raise UsageError("--no-preflight needs --model (the served name)")
    try:
        tool = shlex.split(args.tool) if args.tool else None
    except ValueError as e:
        raise UsageError(f"--tool {args.tool!r}: {e}") from None
    if args.tool is not None and not tool:
        raise UsageError("--tool is empty")
    api_key = None
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                api_key = f.read().strip()
        except OSError as e:
            raise UsageError(f"--api-key-file {args.api_key_file}: {e.strerror or e}") from None
        if not api_key:
            raise UsageError(f"--api-key-file {args.api_key_file}: empty")
    settings = Settings(
        engine=args.engine,
        base_url=args.url,
        model=args.model or "",
        tokenizer=os.path.expanduser(args.tokenizer) if local else args.tokenizer,
        tool=tool,
        rounds=args.rounds,
        warmup_prompts=args.warmup_prompts,
        seed=args.seed,
        gpus=args.gpus,
        extra_args=args.tool_arg,
        detailed=args.detailed,
        min_success_rate=args.min_success_rate,
        run_timeout=float(args.run_timeout),
        api_key=api_key,
    )
    return settings, cases


def _usage(msg: str) -> int:
    print(f"llmfleet bench: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:  # noqa: PLR0912 (the subcommand's steps in order)
    """`llmfleet bench`: 0 every case OK, 1 a case FAILED or NOT_EXECUTED, 2 bad usage."""
    from .serve_report import render_tables

    try:
        settings, cases = settings_from_args(args)
    except UsageError as e:
        return _usage(str(e))
    out_dir = args.output_dir or "servebench-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    if not args.output_dir and not args.dry_run:
        print(f"llmfleet bench: writing the results to ./{out_dir}/ (give -o DIR to choose)", file=sys.stderr)
    if args.dry_run:
        if not settings.model:
            settings.model = "MODEL"
        for r in plan_runs(settings, cases):
            label = "warmup" if r["kind"] == "warmup" else f"r{r['round']}"
            path = os.path.join(out_dir, "raw", result_name(settings, r["case"], label))
            print(shlex.join(build_argv(settings, r["case"], r["num_prompts"], r["seed"], path)))
        return 0
    if os.path.isfile(os.path.join(out_dir, "results.json")):
        return _usage(f"-o {out_dir} already holds results.json: give a new directory (results are never overwritten)")
    try:
        os.makedirs(os.path.join(out_dir, "raw"), exist_ok=True)
    except OSError as e:
        return _usage(f"-o {out_dir}: cannot create it: {e.strerror or e}")
    endpoint = None
    if not args.no_preflight:
        endpoint = preflight(settings.base_url, settings.api_key)
        if not endpoint["error"]:
            if not settings.model:
                if not endpoint["models"]:
                    endpoint["error"] = f"{settings.base_url}/v1/models lists no model"
                else:
                    settings.model = endpoint["models"][0]
            elif settings.model not in endpoint["models"]:
                endpoint["error"] = (
                    f"--model {settings.model!r} is not served at {settings.base_url} "
                    f"(/v1/models lists {', '.join(map(str, endpoint['models'])) or 'nothing'})"
                )
    command = shlex.join(["llmfleet", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else None
    try:
        results = run_benchmark(settings, cases, out_dir, endpoint=endpoint, command=command,
                                progress=lambda line: print(line, file=sys.stderr, flush=True))  # fmt: skip
    except OSError as e:
        print(f"llmfleet bench: cannot write under {out_dir}: {e.strerror or e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(render_tables(results), end="")
        print(f"\n{os.path.join(out_dir, 'report.md')} (chart: chart.svg, raw outputs: raw/)")
    return 0 if results["ok"] else 1
