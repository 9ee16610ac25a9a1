"""Prometheus text files for node_exporter's textfile collector: one file per writer, in the text
exposition format 0.0.4, written atomically; docs/metrics.md lists every metric and an alert per
failure mode.

A tiny model (Family of Samples), render() and write_textfile(), the metric definitions (SPECS: one
HELP and type per name, so every file that writes a name says the same thing, as node_exporter
requires), and one builder per source, each from the record a role or process already has:

    stage_families          one node's result of llmfleet_model_stage
    nccl_check_families     the nccl_check verdict (nccl_verdict.fleet_verdict) + this node's phase results
    engine_ready_families   the llmfleet_engine_ready result (its timeline) for one node
    engine_termination_families / write_engine_metrics
                            the engine wrapper's termination record (llmfleet exec --metrics-dir)
    acceptance_families     the `llmfleet accept --json` report
    bench_families          the `llmfleet bench` results.json

No sample carries an explicit timestamp (the textfile collector refuses them); times are values of
`*_timestamp_seconds` gauges. Stdlib only, Python >= 3.8: shipped to nodes as module_utils and
imported by the engine wrapper.
"""

from __future__ import annotations

import calendar
import contextlib
import math
import os
import re
import stat
import time
from dataclasses import dataclass, field
from typing import Any

from .checks import nccl_verdict

NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
LABEL_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
# A plain file name in the collector's directory; the collector reads only *.prom.
FILE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@-]*\.prom\Z")
TYPES = ("gauge", "counter")
# Labels with a meaning of their own in Prometheus, so never on a gauge or counter.
RESERVED_LABELS = {"quantile": "summaries", "le": "histograms"}
MODE = 0o644

# Every metric llmfleet writes: name -> (type, help). docs/metrics.md has the same list (a test keeps them equal).
SPECS: dict[str, tuple[str, str]] = {
    # staging (model_stage role, llmfleet_stage_<model>.prom)
    "llmfleet_stage_ok": (
        "gauge",
        "1 when the revision is published on this node and verified, 0 when staging failed.",
    ),
    "llmfleet_stage_revision_bytes": ("gauge", "Bytes in the staged revision (sum of the manifest's file sizes)."),
    "llmfleet_stage_copied_bytes": ("gauge", "Bytes written on this node by the last staging run that copied files."),
    "llmfleet_stage_read_bytes": ("gauge", "Bytes that run read, by source (shared storage or peers)."),
    "llmfleet_stage_served_bytes": ("gauge", "Bytes that run served to peers."),
    "llmfleet_stage_shared_read_seconds": ("gauge", "Seconds that run held a shared-storage reader lease."),
    "llmfleet_stage_seconds": ("gauge", "Wall-clock seconds of that run on this node."),
    "llmfleet_stage_timestamp_seconds": ("gauge", "Unix time that run ended (when its metrics were written)."),
    # collective check (nccl_check role, llmfleet_nccl_check.prom)
    "llmfleet_collective_busbw_bytes_per_second": (
        "gauge",
        "Bus bandwidth (nccl-tests formula) of the slowest local rank at the reference message size.",
    ),
    "llmfleet_collective_message_bytes": ("gauge", "Message size the busbw of the same labels was measured at."),
    "llmfleet_collective_op_ok": ("gauge", "1 when every local rank got exact values for the op in the phase."),
    "llmfleet_collective_phase_ok": ("gauge", "1 when the phase passed for this node (full: the whole world)."),
    "llmfleet_collective_floor_bytes_per_second": ("gauge", "The all_reduce busbw floor for this node's GPU model."),
    "llmfleet_collective_below_floor": ("gauge", "1 when this node's all_reduce busbw is below its floor."),
    "llmfleet_collective_node_ok": ("gauge", "1 when the verdict names this node neither bad nor slow."),
    "llmfleet_collective_ok": ("gauge", "1 when the whole check passed (every phase, every node)."),
    "llmfleet_collective_timestamp_seconds": ("gauge", "Unix time this node wrote the check's metrics (its run)."),
    # readiness gate (engine role, llmfleet_engine_ready_<deployment>.prom)
    "llmfleet_engine_gate_ok": ("gauge", "1 when the readiness gate got the correct answer from the deployment."),
    "llmfleet_engine_node_ready": ("gauge", "1 when this node's engine reported READY to the wrapper."),
    "llmfleet_engine_node_failed": ("gauge", "1 when the gate found this node's unit failed."),
    "llmfleet_engine_ready_timestamp_seconds": ("gauge", "Unix time this node's engine reported READY."),
    "llmfleet_engine_cold_start_seconds": ("gauge", "Seconds from this node's unit start to its READY."),
    "llmfleet_engine_weights_loaded_seconds": ("gauge", "Seconds from this node's unit start to weights loaded."),
    "llmfleet_engine_deployment_ready_timestamp_seconds": (
        "gauge",
        "Unix time the last node of the deployment was READY.",
    ),
    "llmfleet_engine_deployment_cold_start_seconds": (
        "gauge",
        "Seconds from the deployment's first unit start to its last node READY.",
    ),
    # engine wrapper (llmfleet exec --metrics-dir, llmfleet_engine_<unit>.prom)
    "llmfleet_engine_last_termination_info": ("gauge", "Verdict of the engine's last termination (value always 1)."),
    "llmfleet_engine_last_exit_code": ("gauge", "The wrapper's exit code at the last termination."),
    "llmfleet_engine_last_signal": (
        "gauge",
        "Signal number that killed the engine at the last termination, 0 if none.",
    ),
    "llmfleet_engine_last_ready": ("gauge", "1 when the last run reached READY before it ended."),
    "llmfleet_engine_last_start_timestamp_seconds": ("gauge", "Unix time the last run started."),
    "llmfleet_engine_last_termination_timestamp_seconds": ("gauge", "Unix time the last run ended."),
    "llmfleet_engine_last_run_seconds": ("gauge", "Seconds the last run lasted."),
    "llmfleet_engine_last_failed_rank_info": (
        "gauge",
        "The first rank that logged an error in the last run (value 1).",
    ),
    "llmfleet_engine_terminations_total": ("counter", "Engine runs ended, by the wrapper's verdict."),
    # serving health (llmfleet exec --health-url --metrics-dir, llmfleet_health_<unit>.prom, after each probe)
    "llmfleet_engine_health_last_good_timestamp_seconds": (
        "gauge",
        "Unix time of the last health probe answered correctly (absent before the first good one).",
    ),
    "llmfleet_engine_health_last_good_latency_seconds": ("gauge", "Seconds the last good health probe took."),
    "llmfleet_engine_health_failures": ("gauge", "Health probes failed in a row (0 after a good one)."),
    "llmfleet_engine_health_last_probe_timestamp_seconds": ("gauge", "Unix time of the last health probe."),
    # the deployment link's barrier (llmfleet exec --link-peers/--link-head --metrics-dir, llmfleet_link_<unit>.prom)
    "llmfleet_engine_link_missing_seconds": (
        "gauge",
        'Seconds this node has waited at the deployment link for the node in `missing` (0, missing="": none).',
    ),
    # acceptance (acceptance role, llmfleet_acceptance_<deployment>.prom)
    "llmfleet_acceptance_ok": ("gauge", "1 when every hard gate and required capability passed."),
    "llmfleet_acceptance_check_state": ("gauge", "1 for the verdict a check got, 0 for the other verdicts."),
    "llmfleet_acceptance_check_seconds": ("gauge", "Seconds a check took."),
    "llmfleet_acceptance_seconds": ("gauge", "Seconds the whole acceptance run took."),
    "llmfleet_acceptance_timestamp_seconds": ("gauge", "Unix time the acceptance run started."),
    # serving benchmark (bench role, llmfleet_bench_<deployment>.prom)
    "llmfleet_bench_ok": ("gauge", "1 when every benchmark case ran and succeeded."),
    "llmfleet_bench_case_status": ("gauge", "1 for the status a case got, 0 for the other statuses."),
    "llmfleet_bench_output_tokens_per_second": ("gauge", "Output token throughput of a case (median over rounds)."),
    "llmfleet_bench_requests_per_second": ("gauge", "Completed requests per second of a case (median over rounds)."),
    "llmfleet_bench_ttft_seconds": ("gauge", "Time to first token at a percentile (median over rounds)."),
    "llmfleet_bench_tpot_seconds": ("gauge", "Time per output token at a percentile (median over rounds)."),
    "llmfleet_bench_e2e_latency_seconds": ("gauge", "End-to-end request latency at a percentile (median over rounds)."),
    "llmfleet_bench_success_ratio": ("gauge", "Completed / sent requests of a case, pooled over rounds."),
    "llmfleet_bench_gpu_seconds_per_output_token": ("gauge", "GPU seconds spent per output token of a case."),
    "llmfleet_bench_seconds": ("gauge", "Wall-clock seconds of the whole benchmark."),
    "llmfleet_bench_timestamp_seconds": ("gauge", "Unix time the benchmark finished."),
}

# Names the previous release wrote, now written under the new name (pass/fail is `_ok` everywhere): the
# `llmfleet-renamed` group of contrib/prometheus/llmfleet.rules.yml records the old names from the new ones for
# one release, so that dashboards and alerts that use them keep working; the text files carry only the new names.
RENAMED = {
    "llmfleet_stage_verified": "llmfleet_stage_ok",
    "llmfleet_collective_pass": "llmfleet_collective_op_ok",
    "llmfleet_collective_phase_pass": "llmfleet_collective_phase_ok",
    "llmfleet_engine_ready": "llmfleet_engine_gate_ok",
    "llmfleet_acceptance_accepted": "llmfleet_acceptance_ok",
}

# The wrapper's verdicts (docs/wrapper.md): the termination counter starts every one at 0, so that
# increase() sees the first of each.
VERDICTS = (
    "clean-stop", "stop-timeout", "exit-code", "unrequested-exit-0", "peer-failed", "deployment-stopped",
    "link-failed", "core-dump", "oom-kill", "signal", "exec-failed", "unhealthy-while-serving", "rank-died",
)  # fmt: skip
ACCEPT_VERDICTS = ("pass", "fail", "not-supported", "not-configured", "skipped")  # accept_checks.VERDICTS
BENCH_STATUSES = ("OK", "FAILED", "NOT_EXECUTED")  # servebench
SOURCES = ("stage", "nccl_check", "engine_ready", "acceptance", "bench")


# ---- the model and the exposition format ----------------------------------------------------------------


@dataclass
class Sample:
    labels: dict[str, str]
    value: float


@dataclass
class Family:
    name: str
    help: str
    type: str = "gauge"
    samples: list[Sample] = field(default_factory=list)

    def add(self, value: Any, **labels: Any) -> Family:
        self.samples.append(Sample({k: str(v) for k, v in labels.items()}, value))
        return self


def family(name: str) -> Family:
    """An empty family of one of llmfleet's metrics, with its documented type and help."""
    kind, text = SPECS[name]
    return Family(name, text, kind)


def check_name(name: str) -> None:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(f"metric name {name!r} is not valid: it must match [a-zA-Z_:][a-zA-Z0-9_:]*")


def check_label_name(name: str, where: str = "") -> None:
    if not isinstance(name, str) or not LABEL_RE.match(name) or name.startswith("__"):
        raise ValueError(
            f"label name {name!r}{where} is not valid: it must match [a-zA-Z_][a-zA-Z0-9_]* and not start with '__'"
        )


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: Any) -> str:
    """A sample value as Prometheus reads it (Go's ParseFloat): integers plain, +Inf/-Inf/NaN spelled so."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    f = float(value)
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    if f.is_integer() and abs(f) < 2**53:
        return str(int(f))
    return repr(f)


def render(families: list[Family]) -> str:
    """The families in the text exposition format 0.0.4. Raises ValueError naming a bad metric or label
    name, a type other than gauge/counter, `_total` on a gauge or missing on a counter, a `quantile` or `le`
    label (summaries' and histograms' own), a family given twice, or a series given twice."""
    out = []
    seen = set()
    for fam in families:
        check_name(fam.name)
        if fam.type not in TYPES:
            raise ValueError(f"metric {fam.name}: type {fam.type!r} is not one of {', '.join(TYPES)}")
        if (fam.type == "counter") != fam.name.endswith("_total"):
            raise ValueError(f"metric {fam.name}: `_total` is for counters, and every counter ends in it")
        if fam.name in seen:
            raise ValueError(f"metric {fam.name} is given twice")
        seen.add(fam.name)
        out.append(f"# HELP {fam.name} {escape_help(fam.help)}")
        out.append(f"# TYPE {fam.name} {fam.type}")
        series = set()
        for s in fam.samples:
            for k in s.labels:
                check_label_name(k, f" of metric {fam.name}")
                if k in RESERVED_LABELS:
                    raise ValueError(
                        f"metric {fam.name}: the label {k!r} belongs to {RESERVED_LABELS[k]} (Prometheus reads it "
                        "so); name the dimension otherwise (e.g. percentile)"
                    )
            key = tuple(sorted(s.labels.items()))
            if key in series:
                raise ValueError(f"metric {fam.name}: the series {dict(key)} is given twice")
            series.add(key)
            try:
                value = format_value(s.value)
            except (TypeError, ValueError):
                raise ValueError(f"metric {fam.name}{dict(key)}: value {s.value!r} is not a number") from None
            labels = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in s.labels.items())
            out.append(f"{fam.name}{{{labels}}} {value}" if labels else f"{fam.name} {value}")
    return "\n".join(out) + "\n" if out else ""


def with_labels(families: list[Family], labels: dict[str, Any]) -> list[Family]:
    """The families with constant labels added to every sample (first, in the given order). A constant
    label a sample already has with another value is a ValueError naming both."""
    const = {}
    for k, v in (labels or {}).items():
        check_label_name(k, " (a constant label)")
        if v is None or isinstance(v, (dict, list)):
            raise ValueError(f"constant label {k}: value {v!r} is not a string")
        const[k] = str(v)
    out = []
    for fam in families:
        new = Family(fam.name, fam.help, fam.type)
        for s in fam.samples:
            for k, v in const.items():
                if k in s.labels and s.labels[k] != v:
                    raise ValueError(
                        f"metric {fam.name}: constant label {k}={v!r} contradicts the record's {k}={s.labels[k]!r}"
                    )
            new.samples.append(Sample({**const, **s.labels}, s.value))
        out.append(new)
    return out


_SAMPLE_LINE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)[ \t]*\Z")
_LABEL_PAIR = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(?:,|\Z)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of each sample line of a file render() wrote; lines it cannot read are skipped
    (a damaged previous file only means counters start again, which Prometheus reads as a reset)."""
    out = []
    for line in (text or "").splitlines():
        m = _SAMPLE_LINE.match(line.strip())
        if not m or line.startswith("#"):
            continue
        labels, body, pos = {}, m.group(2) or "", 0
        while pos < len(body):
            lm = _LABEL_PAIR.match(body, pos)
            if not lm:
                break
            labels[lm.group(1)] = re.sub(r"\\[\\\"n]", lambda e: _UNESCAPE[e.group(0)], lm.group(2))
            pos = lm.end()
        if pos < len(body):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.append((m.group(1), labels, value))
    return out


# ---- the file --------------------------------------------------------------------------------------------


def check_file_name(name: str) -> None:
    if not isinstance(name, str) or not FILE_RE.match(name):
        raise ValueError(
            f"metrics file name {name!r} is not valid: a plain file name ending in .prom (the textfile collector "
            "reads only *.prom), letters, digits and _ . : @ - only"
        )


def target_path(directory: str, name: str) -> str:
    """DIRECTORY/NAME after checking the name; ValueError when the directory is missing."""
    check_file_name(name)
    if not os.path.isdir(directory):
        raise ValueError(
            f"metrics directory {directory} does not exist: create it (node_exporter's "
            "--collector.textfile.directory) or set llmfleet_metrics_dir to the directory it reads"
        )
    return os.path.join(directory, name)


def read_textfile(directory: str, name: str) -> str | None:
    """The current content of DIRECTORY/NAME, or None when there is none (or it is not a regular file)."""
    path = os.path.join(directory, name)
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return None
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
        return f.read()


def write_textfile(directory: str, name: str, text: str) -> str:
    """Write TEXT to DIRECTORY/NAME atomically: a hidden temporary file in the same directory (never read
    by the collector: it ends in .tmp), fsynced, mode 0644, renamed over the target. Refuses a target
    that is a symlink or not a regular file; creates nothing outside DIRECTORY. Returns the path."""
    path = target_path(directory, name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise ValueError(f"{path} is a symlink: refusing to replace it (remove it; metrics files are plain files)")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} exists and is not a regular file: remove it")
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), MODE)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), MODE)  # whatever the umask: node_exporter runs as its own user
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)  # rename never follows a link planted at path meanwhile: it replaces it
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself durable (best effort: not every fs allows it)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return path


# ---- helpers for the builders ----------------------------------------------------------------------------


def _num(value: Any) -> float | None:
    """A finite-or-infinite number, or None for anything else (missing, text, bool is a number)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _iso_epoch(text: Any) -> float | None:
    """Unix time of an ISO-8601 UTC time like 2026-12-01T01:09:49Z (what accept and bench write)."""
    if not isinstance(text, str):
        return None
    try:
        return float(calendar.timegm(time.strptime(text.rstrip("Z")[:19], "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


def _need_dict(record: Any, source: str) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise ValueError(f"{source}: the record must be a dict (the registered result), not {type(record).__name__}")
    return record


def _nonempty(families: list[Family]) -> list[Family]:
    return [f for f in families if f.samples]


# ---- staging ---------------------------------------------------------------------------------------------

# What the run did (as opposed to the revision's state): kept from the last run that copied (see stage_families).
_STAGE_RUN = (
    "llmfleet_stage_copied_bytes",
    "llmfleet_stage_read_bytes",
    "llmfleet_stage_served_bytes",
    "llmfleet_stage_shared_read_seconds",
    "llmfleet_stage_seconds",
    "llmfleet_stage_timestamp_seconds",
)


def stage_families(
    record: dict[str, Any],
    *,
    model: str | None = None,
    revision: str | None = None,
    previous: str | None = None,
    now: float | None = None,
) -> list[Family]:
    """One node's llmfleet_model_stage result (what llmfleet_model_stage_wait returns).

    A run that found the revision already published copied nothing: its run metrics (bytes copied and read,
    seconds) would say 0 and replace what staging the revision cost, so they are kept from the previous
    file (`previous`, same model and revision) when it has them; a rerun then writes the same file. A failed
    run (`failed`) writes ok 0 and keeps the previous run metrics of the revision. `now` (default: the clock)
    is the run's end: the metrics are written right after it."""
    record = _need_dict(record, "stage")
    # The record's own names first (a result's path is <root>/<model>/<revision>); the labels fill in.
    path = record.get("path")
    from_path = os.path.basename(os.path.dirname(path.rstrip("/"))) if isinstance(path, str) and path else None
    model = record.get("model") or from_path or model
    revision = record.get("revision") or revision
    if not model or not revision:
        raise ValueError(
            "stage: the record names no model or revision (a failed result has neither): give them as labels "
            "(labels: {model: ..., revision: ...})"
        )
    lab = {"model": model, "revision": revision}
    fams = {n: family(n) for n in SPECS if n.startswith("llmfleet_stage_")}
    failed = bool(record.get("failed"))
    fams["llmfleet_stage_ok"].add(0 if failed else 1, **lab)
    if not failed and _num(record.get("total_bytes")) is not None:
        fams["llmfleet_stage_revision_bytes"].add(record["total_bytes"], **lab)
    copied_now = not failed and record.get("state_before") != "published"
    kept = [
        (n, labels, v)
        for n, labels, v in parse_samples(previous or "")
        if n in _STAGE_RUN and labels.get("model") == model and labels.get("revision") == revision
    ]
    if copied_now or (not failed and not kept):
        fams["llmfleet_stage_copied_bytes"].add(record.get("bytes_copied") or 0, **lab)
        fams["llmfleet_stage_read_bytes"].add(record.get("source_bytes_read") or 0, **lab, source="shared")
        fams["llmfleet_stage_read_bytes"].add(record.get("peer_bytes_read") or 0, **lab, source="peer")
        fams["llmfleet_stage_served_bytes"].add(record.get("served_bytes") or 0, **lab)
        intervals = [
            iv for iv in record.get("reader_intervals") or [] if isinstance(iv, (list, tuple)) and len(iv) == 2
        ]
        fams["llmfleet_stage_shared_read_seconds"].add(round(sum(float(b) - float(a) for a, b in intervals), 3), **lab)
        secs = _num(record.get("elapsed_s"))
        if secs is not None:  # the stage module's wall time under the model's lock
            fams["llmfleet_stage_seconds"].add(secs, **lab)
        # The same result again (the task rerun on the same record) is the same run and keeps that run's time; two
        # real copies differ at least in elapsed_s (ms).
        run = sorted((n, lb.get("source", ""), v) for n, lb, v in kept if n != "llmfleet_stage_timestamp_seconds")
        new = sorted((f.name, x.labels.get("source", ""), float(x.value)) for f in fams.values()
                     if f.name in _STAGE_RUN for x in f.samples)  # fmt: skip
        same = [v for n, _, v in kept if n == "llmfleet_stage_timestamp_seconds"] if run and run == new else []
        fams["llmfleet_stage_timestamp_seconds"].add(
            same[0] if same else round(time.time() if now is None else now, 3), **lab
        )
    else:
        for n, labels, v in kept:
            extra = {k: x for k, x in labels.items() if k == "source"}
            fams[n].add(v, **lab, **extra)
    return _nonempty(list(fams.values()))


# ---- collective check ------------------------------------------------------------------------------------


def floor_for(gpu_model: str | None, floors: dict[str, Any] | None) -> float | None:
    """The busbw floor (GB/s) of a GPU model, by the check's own rule (nccl_verdict.floor_for)."""
    floor = nccl_verdict.floor_for(gpu_model, floors)
    return None if floor is None else float(floor)


def _busbw(ranks: list[dict[str, Any]], phase: str, ref_bytes: int | None, fams: dict[str, Family]) -> None:
    """busbw (slowest local rank) and exactness per op of one phase's local rank results."""
    by: dict[tuple[str, str], dict[int, list[float]]] = {}
    exact: dict[str, bool] = {}
    reporters: dict[str, int] = {}
    for r in ranks:
        seen = set()
        for x in r.get("results") or []:
            if "op" not in x or "skipped" in x:
                continue
            op = x["op"]
            seen.add(op)
            ok = not x.get("wrong") and x.get("contribution_ok", True) is not False
            exact[op] = exact.get(op, True) and ok
            if _num(x.get("busbw_GBps")) is not None and _num(x.get("bytes")) is not None:
                by.setdefault((op, x.get("dtype") or ""), {}).setdefault(int(x["bytes"]), []).append(x["busbw_GBps"])
        for op in seen:
            reporters[op] = reporters.get(op, 0) + 1
    for op in sorted(exact):
        # An op some local rank never reported (it failed or timed out before it) did not pass either.
        passed = exact[op] and reporters.get(op, 0) == len(ranks) and not any(r.get("error") for r in ranks)
        fams["llmfleet_collective_op_ok"].add(1 if passed else 0, phase=phase, op=op)
    for (op, dtype), sizes in sorted(by.items()):
        size = ref_bytes if ref_bytes in sizes else max(sizes)
        labels = {"phase": phase, "op": op, "dtype": dtype}
        fams["llmfleet_collective_busbw_bytes_per_second"].add(round(min(sizes[size]) * 1e9), **labels)
        fams["llmfleet_collective_message_bytes"].add(size, **labels)


def _ranks_of(value: Any, node: str) -> list[dict[str, Any]] | None:
    """Rank results given as a list, a module result ({ranks: [...]}) or per node ({node: [...]})."""
    if isinstance(value, dict) and isinstance(value.get("ranks"), list):
        return value["ranks"]
    if isinstance(value, dict):
        value = value.get(node)
    return value if isinstance(value, list) else None


def nccl_check_families(record: dict[str, Any], *, node: str, now: float | None = None) -> list[Family]:
    """One node's view of the NCCL check.

    record: the fleet verdict (the llmfleet_nccl_verdict filter's result; either the record itself or its
    `verdict` key) with, beside it, what the verdict does not keep of this node: `single_ranks` and
    `full_ranks` (this node's rank results of phase 1 and 2: a list, the llmfleet_nccl_check result, or
    {node: list}), `floors` ({GPU model: GB/s} as judged; empty when not judged), `models` ({node: GPU
    name}) or `gpu_model`, `reference_bytes` (the floor's message size). Without full_ranks, the verdict's
    `ranks` whose `host` is the node name are taken (true when hostnames are the inventory names). `now`
    (default: the clock) is the run's time: the role writes the file right after the verdict."""
    record = _need_dict(record, "nccl_check")
    verdict = record.get("verdict") if isinstance(record.get("verdict"), dict) else record
    if "ok" not in verdict or "single" not in verdict:
        raise ValueError(
            "nccl_check: the record is not a verdict (no ok / single): give the llmfleet_nccl_verdict result, "
            "with single_ranks, full_ranks, floors, models and reference_bytes beside it"
        )
    if not node:
        raise ValueError("nccl_check: give node (this node's inventory name: the verdict is the fleet's)")
    fams = {n: family(n) for n in SPECS if n.startswith("llmfleet_collective_")}
    ref = record.get("reference_bytes")
    ref = int(ref) if _num(ref) is not None else None
    single_ranks = _ranks_of(record.get("single_ranks"), node)
    full_ranks = _ranks_of(record.get("full_ranks"), node)
    if full_ranks is None:
        full_ranks = [r for r in verdict.get("ranks") or [] if isinstance(r, dict) and r.get("host") == node]
    for phase, ranks in (("single", single_ranks), ("full", full_ranks)):
        if ranks:
            _busbw(ranks, phase, ref, fams)
    single = verdict.get("single") or {}
    if node in single:
        fams["llmfleet_collective_phase_ok"].add(1 if single[node] else 0, phase="single")
    full = verdict.get("full") or {}
    if "ok" in full:
        fams["llmfleet_collective_phase_ok"].add(1 if full["ok"] else 0, phase="full")
    mine = [p["ok"] for p in verdict.get("pairs") or [] if node in p.get("pair", [])]
    if mine:
        fams["llmfleet_collective_phase_ok"].add(1 if all(mine) else 0, phase="pairs")
    gpu = record.get("gpu_model") or (record.get("models") or {}).get(node)
    floor = floor_for(gpu, record.get("floors"))
    if floor is not None:
        fams["llmfleet_collective_floor_bytes_per_second"].add(round(floor * 1e9))
    slow = node in (verdict.get("slow_nodes") or {})
    if floor is not None or slow:
        fams["llmfleet_collective_below_floor"].add(1 if slow else 0)
    fams["llmfleet_collective_node_ok"].add(0 if slow or node in (verdict.get("bad_nodes") or []) else 1)
    fams["llmfleet_collective_ok"].add(1 if verdict["ok"] else 0)
    fams["llmfleet_collective_timestamp_seconds"].add(round(time.time() if now is None else now, 3))
    return _nonempty(list(fams.values()))


# ---- readiness gate --------------------------------------------------------------------------------------


def _gate_result(record: dict[str, Any], node: str) -> dict[str, Any]:
    """The gate result whose timeline has the node: the record itself, or one of a looped task's results."""
    results = record.get("results") if isinstance(record.get("results"), list) else [record]
    for r in results:
        if isinstance(r, dict) and node in ((r.get("timeline") or {}).get("nodes") or {}):
            return r
    names = sorted(n for r in results if isinstance(r, dict) for n in ((r.get("timeline") or {}).get("nodes") or {}))
    raise ValueError(
        f"engine_ready: node {node!r} is not in the gate's timeline (nodes: {', '.join(names) or 'none'}): "
        "give node as the gate named it (inventory_hostname), and the gate's result as record"
    )


_READY_NAMES = (
    "llmfleet_engine_gate_ok",
    "llmfleet_engine_node_ready",
    "llmfleet_engine_node_failed",
    "llmfleet_engine_ready_timestamp_seconds",
    "llmfleet_engine_cold_start_seconds",
    "llmfleet_engine_weights_loaded_seconds",
    "llmfleet_engine_deployment_ready_timestamp_seconds",
    "llmfleet_engine_deployment_cold_start_seconds",
)


def engine_ready_families(record: dict[str, Any], *, node: str) -> list[Family]:
    """One node's readiness from the llmfleet_engine_ready result (or the registered loop of them).

    The times come from the timeline the gate read from each node's wrapper (unit start, weights loaded,
    READY), not from when the gate asked: a rerun of the gate against running units writes the same values.
    The gate's first correct answer is not exported for that reason (on a rerun it is when the gate asked)."""
    record = _need_dict(record, "engine_ready")
    if not node:
        raise ValueError("engine_ready: give node (this node's inventory name, as the gate's timeline names it)")
    res = _gate_result(record, node)
    tl = res["timeline"]
    t0 = _num(tl.get("t0"))
    row = tl["nodes"][node] or {}
    fams = {n: family(n) for n in _READY_NAMES}
    fams["llmfleet_engine_gate_ok"].add(1 if res.get("ready") else 0)
    ready_rel = _num(row.get("node_ready"))
    fams["llmfleet_engine_node_ready"].add(0 if ready_rel is None else 1)
    fams["llmfleet_engine_node_failed"].add(1 if node in (res.get("failed_nodes") or []) else 0)
    start = _num(row.get("unit_start"))
    if t0 is not None and ready_rel is not None:
        fams["llmfleet_engine_ready_timestamp_seconds"].add(round(t0 + ready_rel, 3))
    if start is not None and ready_rel is not None:
        fams["llmfleet_engine_cold_start_seconds"].add(round(ready_rel - start, 3))
    loaded = _num(row.get("weights_loaded"))
    if start is not None and loaded is not None:
        fams["llmfleet_engine_weights_loaded_seconds"].add(round(loaded - start, 3))
    readies = [_num((r or {}).get("node_ready")) for r in tl["nodes"].values()]
    if res.get("ready") and t0 is not None and readies and None not in readies:
        fams["llmfleet_engine_deployment_ready_timestamp_seconds"].add(round(t0 + max(readies), 3))
        fams["llmfleet_engine_deployment_cold_start_seconds"].add(round(max(readies), 3))
    return _nonempty(list(fams.values()))


# ---- engine termination (the wrapper) ---------------------------------------------------------------------


def engine_textfile_name(unit: str | None, deployment: str | None) -> str:
    """llmfleet_engine_<unit without llmfleet- and .service>.prom (e.g. llmfleet_engine_demo.prom and
    llmfleet_engine_demo-router.prom on a P/D head); outside a unit, from the deployment."""
    stem = unit or deployment or ""
    if stem.endswith(".service"):
        stem = stem[: -len(".service")]
    if stem.startswith("llmfleet-"):
        stem = stem[len("llmfleet-") :]
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", stem)
    if not stem:
        raise ValueError("not in a systemd service and no --deployment: no name for the metrics file")
    return f"llmfleet_engine_{stem}.prom"


def deployment_of(unit: str | None) -> str:
    """The deployment a unit llmfleet-<deployment>.service belongs to (the router's unit: <deployment>-router;
    the engine role passes --deployment)."""
    m = re.match(r"llmfleet-(.+)\.service\Z", unit or "")
    return m.group(1) if m else ""


def engine_termination_families(
    record: dict[str, Any], *, deployment: str = "", node: str = "", previous: str | None = None
) -> list[Family]:
    """The wrapper's termination record as metrics. The counter of terminations by verdict is carried over
    from the previous file of the same unit (`previous`): the metrics file is its own state, so a deleted or
    unreadable file starts the counters again at 0, which Prometheus' rate()/increase() read as a reset."""
    record = _need_dict(record, "engine")
    verdict = record.get("verdict")
    if not isinstance(verdict, str) or not verdict:
        raise ValueError("engine: the termination record has no verdict")
    unit = record.get("unit") or ""
    node = node or (record.get("link") or {}).get("node") or record.get("host") or ""
    lab = {"deployment": deployment or deployment_of(unit), "node": node, "unit": unit}
    counts = dict.fromkeys(VERDICTS, 0.0)
    for name, labels, value in parse_samples(previous or ""):
        if name == "llmfleet_engine_terminations_total" and labels.get("unit", "") == unit and "verdict" in labels:
            counts[labels["verdict"]] = value
    counts[verdict] = counts.get(verdict, 0.0) + 1
    fams = [
        family("llmfleet_engine_last_termination_info").add(1, **lab, verdict=verdict),
        family("llmfleet_engine_last_exit_code").add(int(record.get("exit_code") or 0), **lab),
        family("llmfleet_engine_last_signal").add(int((record.get("child") or {}).get("signal") or 0), **lab),
        family("llmfleet_engine_last_ready").add(1 if record.get("ready") else 0, **lab),
    ]
    for name, key in (
        ("llmfleet_engine_last_start_timestamp_seconds", "started_at"),
        ("llmfleet_engine_last_termination_timestamp_seconds", "ended_at"),
        ("llmfleet_engine_last_run_seconds", "duration_s"),
    ):
        if _num(record.get(key)) is not None:
            fams.append(family(name).add(record[key], **lab))
    fr = record.get("failed_rank")
    if isinstance(fr, dict):
        fams.append(
            family("llmfleet_engine_last_failed_rank_info").add(
                1, **lab, **{k: "" if fr.get(k) is None else fr.get(k) for k in ("rank", "tp", "pp")}
            )
        )
    total = family("llmfleet_engine_terminations_total")
    for v in sorted(counts):
        total.add(counts[v], **lab, verdict=v)
    fams.append(total)
    return fams


def health_families(health: dict[str, Any], *, unit: str | None, deployment: str = "", node: str = "") -> list[Family]:
    """The wrapper's serving health (HealthProbe.snapshot()) as metrics."""
    lab = {"deployment": deployment or deployment_of(unit), "node": node, "unit": unit or ""}
    fams = [family("llmfleet_engine_health_failures").add(int(health.get("failures_in_row") or 0), **lab)]
    last = health.get("last") or {}
    for name, value in (
        ("llmfleet_engine_health_last_good_timestamp_seconds", health.get("last_good_at")),
        ("llmfleet_engine_health_last_good_latency_seconds", health.get("last_good_latency_s")),
        ("llmfleet_engine_health_last_probe_timestamp_seconds", last.get("at")),
    ):
        if _num(value) is not None:
            fams.append(family(name).add(value, **lab))
    return fams


def write_health_metrics(
    directory: str, health: dict[str, Any], *, unit: str | None, deployment: str = "", node: str = ""
) -> str:
    """llmfleet_health_<unit>.prom beside the termination file, rewritten after each probe."""
    name = "llmfleet_health_" + engine_textfile_name(unit, deployment)[len("llmfleet_engine_") :]
    return write_textfile(directory, name, render(health_families(health, unit=unit, deployment=deployment, node=node)))


def link_families(barrier: dict[str, Any], *, unit: str | None, deployment: str = "", node: str = "") -> list[Family]:
    """The deployment link's barrier (DeploymentLink.barrier() while it waits, {} once every node joined)."""
    lab = {"deployment": deployment or deployment_of(unit), "node": node, "unit": unit or ""}
    fam = family("llmfleet_engine_link_missing_seconds")
    missing = [] if barrier.get("complete") else list(barrier.get("missing") or [])
    for peer in missing:
        fam.add(round(float(barrier.get("waiting_s") or 0), 1), **lab, missing=peer)
    if not missing:
        fam.add(0, **lab, missing="")
    return [fam]


def write_link_metrics(
    directory: str, barrier: dict[str, Any], *, unit: str | None, deployment: str = "", node: str = ""
) -> str:
    """llmfleet_link_<unit>.prom beside the termination file, rewritten while the barrier waits and when it ends."""
    name = "llmfleet_link_" + engine_textfile_name(unit, deployment)[len("llmfleet_engine_") :]
    return write_textfile(directory, name, render(link_families(barrier, unit=unit, deployment=deployment, node=node)))


def write_engine_metrics(directory: str, record: dict[str, Any], *, deployment: str = "", node: str = "") -> str:
    """The wrapper's metrics file for one termination record, written atomically; returns its path."""
    name = engine_textfile_name(record.get("unit"), deployment)
    previous = read_textfile(directory, name) if os.path.isdir(directory) else None
    text = render(engine_termination_families(record, deployment=deployment, node=node, previous=previous))
    return write_textfile(directory, name, text)


# ---- acceptance ------------------------------------------------------------------------------------------


def acceptance_families(record: dict[str, Any]) -> list[Family]:
    """The `llmfleet accept --json` report: accepted, each check's verdict as a state set and its seconds."""
    record = _need_dict(record, "acceptance")
    if "accepted" not in record or not isinstance(record.get("checks"), list):
        raise ValueError(
            "acceptance: the record is not an acceptance report (no accepted / checks): give the "
            "`llmfleet accept --json` output"
        )
    lab = {"model": record.get("model") or ""}
    state, secs = family("llmfleet_acceptance_check_state"), family("llmfleet_acceptance_check_seconds")
    for c in record["checks"]:
        check = {"check": c.get("name", ""), "kind": c.get("kind", ""), "mode": c.get("mode", "")}
        for v in ACCEPT_VERDICTS:
            state.add(1 if c.get("verdict") == v else 0, **lab, **check, verdict=v)
        if _num(c.get("seconds")) is not None:
            secs.add(c["seconds"], **lab, check=check["check"])
    fams = [family("llmfleet_acceptance_ok").add(1 if record["accepted"] else 0, **lab), state, secs]
    if _num(record.get("elapsed_s")) is not None:
        fams.append(family("llmfleet_acceptance_seconds").add(record["elapsed_s"], **lab))
    started = _iso_epoch(record.get("started_at"))
    if started is not None:
        fams.append(family("llmfleet_acceptance_timestamp_seconds").add(started, **lab))
    return _nonempty(fams)


# ---- serving benchmark -----------------------------------------------------------------------------------

# The label is `percentile`, not `quantile`: Prometheus reserves `quantile` for summaries (and `le` for
# histograms); these are gauges of one case's percentiles as the benchmark tool computed them.
PERCENTILES = (("p50", "50"), ("p95", "95"), ("p99", "99"))


def bench_families(record: dict[str, Any]) -> list[Family]:
    """`llmfleet bench` results.json: per case (input_len, output_len, concurrency) its status as a state
    set, throughput, TTFT / TPOT / end-to-end latency percentiles (the median over rounds), success ratio,
    GPU seconds per output token; the whole run's ok, seconds and finish time."""
    record = _need_dict(record, "bench")
    if not isinstance(record.get("cases"), list):
        raise ValueError(
            "bench: the record is not a benchmark result (no cases): give the results.json of llmfleet bench"
        )
    model = (record.get("settings") or {}).get("model") or ""
    names = [n for n in SPECS if n.startswith("llmfleet_bench_")]
    fams = {n: family(n) for n in names}

    def med(case: dict[str, Any], key: str) -> float | None:
        s = (case.get("summary") or {}).get(key)
        return _num(s.get("median")) if isinstance(s, dict) else None

    for c in record["cases"]:
        lab = {"model": model, "input_len": c.get("input_len"), "output_len": c.get("output_len"),
               "concurrency": c.get("concurrency")}  # fmt: skip
        for s in BENCH_STATUSES:
            fams["llmfleet_bench_case_status"].add(1 if c.get("status") == s else 0, **lab, status=s)
        for name, key, scale in (
            ("llmfleet_bench_output_tokens_per_second", "output_tok_s", 1.0),
            ("llmfleet_bench_requests_per_second", "request_s", 1.0),
            ("llmfleet_bench_gpu_seconds_per_output_token", "gpu_h_per_mtok", 3600.0 / 1e6),
        ):
            v = med(c, key)
            if v is not None:
                fams[name].add(v * scale, **lab)
        for name, key in (("llmfleet_bench_ttft_seconds", "ttft_ms"), ("llmfleet_bench_tpot_seconds", "tpot_ms"),
                          ("llmfleet_bench_e2e_latency_seconds", "e2e_ms")):  # fmt: skip
            for suffix, pct in PERCENTILES:
                v = med(c, f"{key}_{suffix}")
                if v is not None:
                    fams[name].add(v / 1000.0, **lab, percentile=pct)
        if _num(c.get("success_rate")) is not None:
            fams["llmfleet_bench_success_ratio"].add(c["success_rate"], **lab)
    fams["llmfleet_bench_ok"].add(1 if record.get("ok") else 0, model=model)
    if _num(record.get("wall_s")) is not None:
        fams["llmfleet_bench_seconds"].add(record["wall_s"], model=model)
    finished = _iso_epoch(record.get("finished"))
    if finished is not None:
        fams["llmfleet_bench_timestamp_seconds"].add(finished, model=model)
    return _nonempty([fams[n] for n in names])


# ---- one entry point for the Ansible module -----------------------------------------------------------------


def build(source: str, record: Any, *, labels: dict[str, Any] | None = None, node: str = "",
          previous: str | None = None, now: float | None = None) -> str:  # fmt: skip
    """The file content for one source: the builder's families, the constant labels (and node) added,
    rendered. Raises ValueError with what is wrong and how to fix it."""
    labels = dict(labels or {})
    if source == "stage":
        fams = stage_families(
            record, model=labels.get("model"), revision=labels.get("revision"), previous=previous, now=now
        )
    elif source == "nccl_check":
        fams = nccl_check_families(record, node=node, now=now)
    elif source == "engine_ready":
        fams = engine_ready_families(record, node=node)
    elif source == "acceptance":
        fams = acceptance_families(record)
    elif source == "bench":
        fams = bench_families(record)
    else:
        raise ValueError(f"source {source!r} is not one of {', '.join(SOURCES)}")
    if node:
        labels.setdefault("node", node)
    return render(with_labels(fams, labels))


def _check_target(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"{path} is a symlink: refusing to replace it (remove it; metrics files are plain files)")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} exists and is not a regular file: remove it")


def textfile(
    directory: str,
    name: str,
    source: str,
    record: Any,
    *,
    labels: dict[str, Any] | None = None,
    node: str = "",
    create: bool = False,
    check_mode: bool = False,
) -> dict[str, Any]:
    """What llmfleet_metrics_textfile does: build the file, compare it with the one there, write it when it
    differs (not in check mode). `create` makes DIRECTORY itself (mode 0755; never its parents). Returns
    path, changed, created (the directory), before, after, families, series. ValueError on bad input."""
    check_file_name(name)
    path = os.path.join(directory, name)
    have_dir = os.path.isdir(directory)
    if not have_dir and not create:
        target_path(directory, name)  # raises the message naming the directory and the fix
    if not have_dir and not os.path.isdir(os.path.dirname(os.path.abspath(directory))):
        raise ValueError(
            f"metrics directory {directory}: its parent does not exist either; create only makes the directory "
            "itself: check llmfleet_metrics_dir for a typo"
        )
    if have_dir:
        _check_target(path)
    before = read_textfile(directory, name) if have_dir else None
    after = build(source, record, labels=labels, node=node, previous=before)
    changed = after != before
    if changed and not check_mode:
        if not have_dir:
            os.mkdir(directory, 0o755)
            os.chmod(directory, 0o755)  # noqa: S103 (node_exporter, another user, reads it; nothing secret)
        write_textfile(directory, name, after)
    lines = after.splitlines()
    return {
        "path": path,
        "changed": changed,
        "created": not have_dir and changed,
        "before": before or "",
        "after": after,
        "families": [ln.split()[2] for ln in lines if ln.startswith("# TYPE ")],
        "series": sum(1 for ln in lines if ln and not ln.startswith("#")),
    }
