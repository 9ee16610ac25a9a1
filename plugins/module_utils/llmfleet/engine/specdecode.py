"""Speculative decoding as a deployment setting (docs/speculative-decoding.md): the engine role's
engine_speculative rendered into each engine's own flags, and the engines' acceptance counters read back from a
Prometheus /metrics text into an acceptance rate, a mean accepted length and a verdict: does it pay.

Flags (each listed by the captured help texts in tests/fixtures/engines/):
  vLLM   --speculative-config '{"method": ..., "num_speculative_tokens": N, "model": DRAFT}'
  SGLang --speculative-algorithm EAGLE|EAGLE3|NEXTN|NGRAM|STANDALONE --speculative-num-steps N
         --speculative-eagle-topk K --speculative-num-draft-tokens D --speculative-draft-model-path DRAFT

Stdlib only: the engine plan (engine.render_argv) calls render_flags; the report and operators call parse_metrics.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from .. import engines

# One name per method, the engine role's (vLLM's own spellings); SGLang's --speculative-algorithm for each.
# mtp: the checkpoint's own multi-token-prediction layers (vLLM method "mtp"; SGLang NEXTN, which its
# server_args turns into EAGLE over those layers). draft_model: a separate smaller model of the same
# vocabulary (vLLM "draft_model", SGLang STANDALONE).
METHODS = ("eagle", "eagle3", "mtp", "ngram", "draft_model")
SGLANG_ALGORITHM = {"eagle": "EAGLE", "eagle3": "EAGLE3", "mtp": "NEXTN", "ngram": "NGRAM", "draft_model": "STANDALONE"}
# Methods whose draft is a separate checkpoint: vLLM raises "num_speculative_tokens was provided but without
# speculative model" for them (vllm/config/speculative.py); SGLang needs --speculative-draft-model-path.
NEEDS_DRAFT = ("eagle", "eagle3", "draft_model")
KEYS = ("method", "num_steps", "topk", "num_draft_tokens", "draft_model_path")
# Every flag render_flags may emit, per engine (the profiles'; tests check each against the captured --help).
FLAGS = {e: engines.get(e).spec_flags for e in engines.engines()}
# The two engines' own speculative settings: vLLM one JSON config of a draft chain, SGLang a draft tree in flags.
_VLLM, _SGLANG = engines.VLLM.engine, engines.SGLANG.engine


class SpecError(ValueError):
    """engine_speculative that an engine would refuse or silently change; the message names the key and the fix."""


def _positive(cfg: dict[str, Any], key: str) -> int | None:
    v = cfg.get(key)
    if v is None or v == "":
        return None
    try:
        n = int(v)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or str(v).strip() != str(n):
        raise SpecError(f"engine_speculative.{key}={v!r}: give a whole number >= 1")
    return n


def validate(cfg: dict[str, Any] | None, engine: str) -> dict[str, Any]:
    """The configuration with its defaults filled in, or SpecError naming the key and the fix. engine: vllm | sglang.
    Keys given as null or "" count as not given (Ansible's argument spec fills absent sub-options with null)."""
    if cfg is not None and not isinstance(cfg, dict):
        raise SpecError(f"engine_speculative must be a mapping (method, num_steps, ...), got {cfg!r}")
    cfg = {k: v for k, v in (cfg or {}).items() if v not in (None, "")}
    if not cfg:
        return {}
    unknown = sorted(set(cfg) - set(KEYS))
    if unknown:
        raise SpecError(f"engine_speculative has unknown keys {', '.join(unknown)}: the keys are {', '.join(KEYS)}")
    out = _method_and_steps(cfg)
    topk, draft_tokens = _positive(cfg, "topk"), _positive(cfg, "num_draft_tokens")
    if engine == _VLLM:
        # vLLM drafts one chain of num_speculative_tokens; topk / draft tokens are SGLang's tree settings.
        extra = [
            k for k, bad in (("topk", topk not in (None, 1)), ("num_draft_tokens", draft_tokens is not None)) if bad
        ]
        if extra:
            raise SpecError(
                f"engine_speculative.{extra[0]} is SGLang's (its EAGLE draft tree); vLLM drafts one chain of "
                "num_steps tokens: remove it"
            )
        return out
    out.update(_sglang_tree(out["num_steps"], topk or 1, draft_tokens))
    return out


def _method_and_steps(cfg: dict[str, Any]) -> dict[str, Any]:
    method = cfg.get("method")
    if method not in METHODS:
        raise SpecError(f"engine_speculative.method={method!r}: choose one of {', '.join(METHODS)}")
    draft = str(cfg.get("draft_model_path") or "")
    if method in NEEDS_DRAFT and not draft:
        raise SpecError(
            f"engine_speculative.method={method} needs engine_speculative.draft_model_path: the draft checkpoint, "
            "staged like the model (docs/speculative-decoding.md); or method mtp (the model's own MTP layers) or ngram"
        )
    if method == "ngram" and draft:
        raise SpecError("engine_speculative.method=ngram drafts from the prompt itself: remove draft_model_path")
    steps = _positive(cfg, "num_steps")
    if not steps:
        raise SpecError(
            "engine_speculative.num_steps is required: the tokens drafted per step (vLLM num_speculative_tokens, "
            "SGLang --speculative-num-steps), e.g. 3"
        )
    return {"method": method, "num_steps": steps, **({"draft_model_path": draft} if draft else {})}


def _sglang_tree(steps: int, topk: int, draft_tokens: int | None) -> dict[str, int]:
    # SGLang server_args: with --speculative-eagle-topk 1 it sets --speculative-num-draft-tokens to num_steps + 1
    # whatever was given (a warning only), so a different value would not be what runs.
    if topk == 1:
        if draft_tokens not in (None, steps + 1):
            raise SpecError(
                f"engine_speculative.num_draft_tokens={draft_tokens} with topk 1: SGLang replaces it with "
                f"num_steps + 1 = {steps + 1} (a chain verifies the drafted tokens plus one); set {steps + 1} or "
                "leave it out"
            )
        return {"topk": 1, "num_draft_tokens": steps + 1}
    # A tree (topk > 1) verifies num_draft_tokens of its topk x num_steps candidates; fewer than num_steps + 1
    # cannot hold one full chain, and SGLang fills the value in only for topk 1.
    if draft_tokens is None or draft_tokens <= steps:
        raise SpecError(
            f"engine_speculative.topk={topk} needs num_draft_tokens > num_steps ({steps}): the tokens SGLang verifies "
            "per step from its draft tree (SGLang's own choice for Llama: num_steps 5, topk 4, num_draft_tokens 8)"
        )
    return {"topk": topk, "num_draft_tokens": draft_tokens}


def render_flags(cfg: dict[str, Any] | None, engine: str, enabled: bool = True) -> list[str]:
    """The engine flags for engine_speculative (validated even when disabled: a switched-off setting stays
    launchable). enabled=False (engine_speculative_enabled) keeps the setting and omits the flags."""
    c = validate(cfg, engine)
    if not c or not enabled:
        return []
    if engine == _VLLM:
        doc = {"method": c["method"], "num_speculative_tokens": c["num_steps"]}
        if "draft_model_path" in c:
            doc["model"] = c["draft_model_path"]
        return ["--speculative-config", json.dumps(doc, separators=(",", ":"))]
    argv = ["--speculative-algorithm", SGLANG_ALGORITHM[c["method"]], "--speculative-num-steps", str(c["num_steps"])]
    argv += ["--speculative-eagle-topk", str(c["topk"]), "--speculative-num-draft-tokens", str(c["num_draft_tokens"])]
    if "draft_model_path" in c:
        argv += ["--speculative-draft-model-path", c["draft_model_path"]]
    return argv


# ---- what the engine measured ------------------------------------------------------------------------------------

# vLLM (v1/spec_decode/metrics.py, SpecDecodingProm): prometheus_client counters, exposed with `_total`, labels
# model_name and engine (+ position): cumulative since the engine started.
VLLM_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens",
}
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
# SGLang (srt/metrics/collector.py, SchedulerMetricsCollector): gauges of the last logging interval, one per
# scheduler (tp_rank / dp_rank labels): mean accepted length (drafts accepted + the bonus token per step)
# and accepted / drafted tokens.
SGLANG_GAUGES = {"sglang:spec_accept_length": "mean_accepted_length", "sglang:spec_accept_rate": "acceptance_rate"}

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

# The verdict (docs/speculative-decoding.md): one verify step of the target costs about one plain decode step
# at small batches, and each drafted token one draft forward of DRAFT_COST target steps (a one-layer EAGLE /
# MTP head against a 60+-layer target is a few per cent; a separate draft model more). Estimated speed-up =
# mean accepted length / (1 + num_steps x draft cost). It pays at >= PAYS, does not below 1.
DRAFT_COST = 0.05
PAYS = 1.1
MIN_DRAFTS = 100


def _samples(text: str):
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        yield m.group(1), dict(_LABEL.findall(m.group(2) or "")), value


def metrics_problem(text: str) -> str | None:
    """Why a text is not a Prometheus /metrics exposition (None when it is): empty, or no `name value` sample line
    at all (an HTML page, a log, a binary file). A counter that is negative, NaN or infinite is malformed too."""
    if not text.strip():
        return "is empty"
    samples = list(_samples(text))
    if not samples:
        return "holds no Prometheus sample line (`name{labels} value`): not an engine's /metrics text"
    for name, _, value in samples:
        if name in VLLM_COUNTERS or name == VLLM_PER_POS:
            if not math.isfinite(value) or value < 0:
                return f"has {name} = {value}: a counter is a finite number >= 0"
    return None


def parse_metrics(text: str) -> dict[str, Any] | None:
    """The spec-decode figures in one /metrics text, or None when the engine exposes none (spec decoding off, or
    SGLang without --enable-metrics). vLLM: summed over engines; SGLang: the mean over schedulers."""
    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    gauges: dict[str, list[float]] = {}
    for name, labels, value in _samples(text):
        if name in VLLM_COUNTERS:
            sums[VLLM_COUNTERS[name]] = sums.get(VLLM_COUNTERS[name], 0.0) + value
        elif name == VLLM_PER_POS and labels.get("position", "").isdigit():
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
        elif name in SGLANG_GAUGES and not math.isnan(value):
            gauges.setdefault(SGLANG_GAUGES[name], []).append(value)
    if "drafts" in sums:
        drafts, drafted, accepted = sums["drafts"], sums.get("draft_tokens", 0.0), sums.get("accepted_tokens", 0.0)
        return {
            "engine": _VLLM,
            "source": "counters since start",
            "drafts": int(drafts),
            "draft_tokens": int(drafted),
            "accepted_tokens": int(accepted),
            # vLLM's own definitions (SpecDecodingLogging.log): accepted / drafted; 1 + accepted / drafts.
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None,
            "per_position": [per_pos[p] / drafts for p in sorted(per_pos)] if drafts else [],
        }
    if gauges:
        mean = {k: sum(v) / len(v) for k, v in gauges.items()}
        return {
            "engine": _SGLANG,
            "source": "gauges of the last logging interval",
            "acceptance_rate": mean.get("acceptance_rate"),
            "mean_accepted_length": mean.get("mean_accepted_length"),
        }
    return None


def verdict(measured: dict[str, Any] | None, num_steps: int, draft_cost: float = DRAFT_COST) -> dict[str, Any]:
    """pays / marginal / does not pay / not judged, with the estimated speed-up and why."""
    if not measured or measured.get("mean_accepted_length") is None:
        return {"verdict": "not judged", "why": "the engine reported no speculative-decoding figures"}
    if measured.get("engine") == _VLLM and measured.get("drafts", 0) < MIN_DRAFTS:
        why = f"{measured.get('drafts', 0)} drafts so far (< {MIN_DRAFTS}): read it again after real traffic"
        return {"verdict": "not judged", "why": why}
    if measured.get("engine") == _SGLANG and measured["mean_accepted_length"] <= 0:
        return {"verdict": "not judged", "why": "SGLang's gauge is 0: no decode step since its last log interval"}
    length = float(measured["mean_accepted_length"])
    speedup = length / (1 + num_steps * draft_cost)
    word = "pays" if speedup >= PAYS else "marginal" if speedup >= 1 else "does not pay"
    why = (f"mean accepted length {length:.2f} of {num_steps + 1} per step, estimated speed-up {speedup:.2f}x "
           f"(length / (1 + {num_steps} x {draft_cost:g}))")  # fmt: skip
    return {"verdict": word, "speedup": round(speedup, 3), "why": why}


def summary(measured: dict[str, Any] | None, num_steps: int) -> str:
    """One line for the play and the report."""
    v = verdict(measured, num_steps)
    if not measured:
        return f"speculative decoding: {v['verdict']} ({v['why']})"
    rate = measured.get("acceptance_rate")
    parts = [f"acceptance {rate:.1%}" if rate is not None else "acceptance -"]
    if measured.get("engine") == _VLLM:
        parts.append(f"{measured['accepted_tokens']:,} of {measured['draft_tokens']:,} drafted tokens")
    return f"speculative decoding: {v['verdict']}: " + ", ".join(parts) + f"; {v['why']}"


# ---- `llmfleet specdecode` (module-level add_arguments / run: the shape cli.PLUGGED takes) --------------------------


def _steps(text: str) -> int:
    import argparse

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number (engine_speculative.num_steps, >= 1)"
        ) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: draft tokens per step is at least 1 (engine_speculative.num_steps)")
    return n


def add_arguments(p: Any) -> None:
    p.add_argument("--url", metavar="URL", help="the engine's /metrics URL (e.g. http://head:8000/metrics)")
    p.add_argument("source", nargs="?", metavar="FILE", help="instead of --url: a saved /metrics text, or - (stdin)")
    p.add_argument("--steps", type=_steps, required=True, help="draft tokens per step (engine_speculative.num_steps)")
    p.add_argument("--json", action="store_true", help="print the figures and the verdict as JSON")


def run(args: Any) -> int:
    """0 with the figures and the verdict (informational), 2 when the source cannot be read or is not a /metrics
    text (empty, an HTML page, a malformed counter): that is no "not judged"."""
    import sys
    import urllib.request

    from ..cli_grammar import deprecated_note

    if args.source and args.source.startswith(("http://", "https://")) and not args.url:
        deprecated_note("`llmfleet specdecode URL` (the URL as a positional argument)", "--url URL")
        args.url, args.source = args.source, None
    if bool(args.url) == bool(args.source):
        print("llmfleet specdecode: give --url URL (the engine's /metrics) or a FILE (- for stdin), one of them",
              file=sys.stderr)  # fmt: skip
        return 2
    args.source = args.url or args.source
    try:
        if args.source.startswith(("http://", "https://")):
            with urllib.request.urlopen(args.source, timeout=30) as r:  # noqa: S310 (an operator-given URL)
                text = r.read().decode("utf-8", "replace")
        elif args.source == "-":
            text = sys.stdin.read()
        else:
            with open(args.source, encoding="utf-8", errors="replace") as f:
                text = f.read()
    except (OSError, ValueError) as e:  # ValueError: a malformed URL (http://[x)
        print(f"llmfleet specdecode: {args.source}: {e}", file=sys.stderr)
        return 2
    bad = metrics_problem(text)
    if bad:
        print(f"llmfleet specdecode: {args.source} {bad}: give the engine's /metrics URL (http://HEAD:PORT/metrics) "
              "or a file saved from it", file=sys.stderr)  # fmt: skip
        return 2
    measured = parse_metrics(text)
    if args.json:
        print(json.dumps({"measured": measured, "verdict": verdict(measured, args.steps)}, indent=2))
    else:
        print(summary(measured, args.steps))
    return 0
