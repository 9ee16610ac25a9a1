"""The deployment report: one self-contained HTML page and its markdown twin per run, rendered from the record
files the roles write flat in the report directory (docs/report.md lists them and their shapes).

    model = collect(report_dir, deployment)      # the report model (JSON-able), from the records
    html, md = render(model)                     # one Jinja2 template set (templates/report.*.j2)
    path = publish(report_dir, deployment, model)  # <dir>/<deployment>/<UTC stamp>/, then `latest`
    summary_lines(model)                         # pass / fail per step, for the terminal

Every record a run writes carries the run's id (`run_id`); run-<deployment>.json names the newest run, the
steps it was to take and where it stopped. The report reads that run's records only: a step the run did not
reach is "not run in this run (it stopped at <step> on <node>)", a record of an earlier run (or one without a
run id, written before llmfleet kept them) is named and left out. Records without any run id are read the older
way: a missing record is a section "not run in this report", a record older than this deployment's engine gate
is another run's. A record that is not JSON, or not of the shape this version reads, is named in the report as
an error. None of them raises.

Ops host only (Jinja2); imported by the CLI, never by a module.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..facts import DEPLOYMENT_RE
from . import sections as rs

SCHEMA = "llmfleet.report/1"
TEMPLATES = Path(__file__).parent / "templates"
STAMP = "%Y%m%dT%H%M%SZ"
# Records of the steps before the engine older than this (before its gate) are an earlier run's.
MAX_AGE_S = 24 * 3600.0
# Acceptance and bench must come after the engine gate they test (same ops-host clock; file times are
# rounded by some filesystems).
CLOCK_SLACK_S = 60.0

# id, title, the question the section answers (docs/report.md says the same).
SECTIONS = (
    ("inventory", "Inventory and versions",
     "What ran where: which nodes, GPUs, driver, CUDA, NCCL, engine and model revision?"),
    ("preflight", "Preflight", "Were the nodes fit and alike before anything was installed, and which node is odd?"),
    ("topology", "Fabric per node",
     "Which HCA ports carry NCCL on each node (rails, RoCE GID, NUMA), and which environment do the ranks get?"),
    ("staging", "Staging per node",
     "Did every node get the pinned revision, how fast, and from where (shared storage or peers)?"),
    ("nccl", "Collective check",
     "Are collectives exact on every node alone, every pair and the whole world, at the expected bus bandwidth?"),
    ("engine", "Engine", "Did the deployment come up and answer correctly; if not, which node and rank failed first?"),
    ("replicas", "Replicas and rollout",
     "Which replicas serve behind the router, on which revision, and how did the rolling change go?"),
    ("timeline", "Cold-start timeline", "Where did the cold start spend its time, node by node?"),
    ("speculative", "Speculative decoding",
     "Is speculative decoding on, and are enough drafts accepted for it to pay?"),
    ("acceptance", "Acceptance", "Does the API behave as clients need (hard gates, then capabilities)?"),
    ("bench", "Benchmark", "How fast does it serve, per input length, output length and concurrency?"),
    ("metrics", "Scrape targets", "Where does Prometheus scrape the engine's own metrics?"),
)  # fmt: skip
# The steps the terminal summary lists, in pipeline order (the first failed one is the verdict).
STEPS = (
    ("preflight", "preflight"),
    ("topology", "topology"),
    ("staging", "staging"),
    ("nccl", "nccl check"),
    ("timeline", "engine/cold start"),
    ("replicas", "replicas/rollout"),  # a deployment of replicas only
    ("acceptance", "acceptance"),
    ("bench", "bench"),
)
# A section's step in a run record's `steps` (what the playbook takes) and that step's tag (its role's name).
SECTION_STEP = {"preflight": "preflight", "topology": "topology", "staging": "staging", "nccl": "nccl",
                "engine": "timeline", "replicas": "timeline", "timeline": "timeline", "speculative": "timeline",
                "metrics": "timeline", "acceptance": "acceptance", "bench": "bench"}  # fmt: skip
STEP_TAG = {"preflight": "preflight", "topology": "topology", "staging": "model_stage", "nccl": "nccl_check",
            "timeline": "engine", "acceptance": "acceptance", "bench": "bench"}  # fmt: skip
# Where a run stopped, by the role of the failed task (the run record's `stopped.role`).
ROLE_STEP = {"preflight": "preflight", "base": "node runtime (base)", "topology": "topology",
             "model_stage": "staging", "nccl_check": "nccl check", "engine": "engine", "acceptance": "acceptance",
             "bench": "bench", "report": "report", "llmfleet": "the fleet contract's checks"}  # fmt: skip


def stop_step(stop: dict) -> str:
    """Where a run stopped, in the report's words: the failed task's step; a task of the fleet contract (a
    dependency of every role) names the step that pulled it in."""
    role, within = str(stop.get("role") or ""), str(stop.get("within") or "")
    step = ROLE_STEP.get(role, role or str(stop.get("task") or "?"))
    if role == "llmfleet" and within:
        return f"{ROLE_STEP.get(within, within)} ({step})"
    return step


# The sections of the engine role's step: a run that stopped in that role failed there.
ENGINE_SECTIONS = ("timeline", "replicas")
BEFORE_ENGINE = {"inventory", "preflight", "topology", "staging", "nccl"}
AFTER_ENGINE = {"acceptance", "bench"}
SHAPE_ERRORS = (KeyError, TypeError, ValueError, AttributeError, IndexError)


class ReportError(Exception):
    """Bad input (no such directory, a bad deployment name, a report directory in the way): the CLI's exit 2."""


@dataclass
class Record:
    name: str  # relative to the report directory
    data: dict | None = None
    error: str | None = None
    time: dt.datetime | None = None
    time_source: str | None = None  # "generated_at", another key of the record, or "file time"


def _utc(text: Any) -> dt.datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)


def iso(t: dt.datetime | None) -> str | None:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if t else None


def load_record(report_dir: Path, name: str, time_keys: tuple[str, ...] = ()) -> Record | None:
    """The record file `name` (None when absent). Never raises: what is wrong with it is in `error`."""
    path = report_dir / name
    if not path.is_file():
        return None
    rec = Record(name)
    try:
        text = path.read_text(encoding="utf-8")
        mtime = path.stat().st_mtime
    except (OSError, UnicodeDecodeError) as e:
        rec.error = f"cannot be read ({e.__class__.__name__}: {e})"
        return rec
    try:
        data = json.loads(text)
    except ValueError as e:
        rec.error = f"is not valid JSON ({e}): fix or remove it and run `llmfleet report` again"
        return rec
    if not isinstance(data, dict):
        rec.error = f"holds a JSON {type(data).__name__}, not the object this report reads"
        return rec
    rec.data = data
    for key in ("generated_at", *time_keys):
        t = _utc(data.get(key))
        if t:
            rec.time, rec.time_source = t, key
            break
    else:
        rec.time, rec.time_source = dt.datetime.fromtimestamp(mtime, dt.UTC), "file time"
    return rec


def _deployments(report_dir: Path) -> list[str]:
    """Deployments that have a record of their own in the directory."""
    names = set()
    for p in report_dir.iterdir():
        for prefix in ("endpoint-", "engine-", "acceptance-"):
            if p.name.startswith(prefix) and p.name.endswith(".json"):
                names.add(p.name[len(prefix) : -len(".json")])
        if p.name.startswith("bench-") and p.is_dir():
            names.add(p.name[len("bench-") :])
    return sorted(n for n in names if DEPLOYMENT_RE.match(n))


def infer_deployment(report_dir: str | os.PathLike) -> str:
    """The one deployment with records in the directory (ReportError when none or several)."""
    d = _report_dir(report_dir)
    names = _deployments(d)
    if len(names) == 1:
        return names[0]
    if not names:
        raise ReportError(f"{d}: no endpoint-, engine-, acceptance- or bench- record of any deployment: "
                          "give --deployment NAME (the inventory's llmfleet_deployment)")  # fmt: skip
    raise ReportError(f"{d} holds records of several deployments ({', '.join(names)}): give --deployment NAME")


def _report_dir(report_dir: str | os.PathLike) -> Path:
    # normalised: the roles' default is <playbook_dir>/../reports, a path no reader should have to undo
    d = Path(os.path.normpath(report_dir))
    if not d.is_dir():
        raise ReportError(f"report directory {d} does not exist: give --dir (the inventory's llmfleet_report_dir)")
    return d


def _check_name(deployment: str) -> None:
    if not isinstance(deployment, str) or not DEPLOYMENT_RE.match(deployment):
        raise ReportError(f"deployment {deployment!r}: 1-42 lowercase letters, digits and '-', starting with a "
                          "letter (the inventory's llmfleet_deployment)")  # fmt: skip


@dataclass
class Replicas:
    """A deployment of replicas (llmfleet_replicas): its endpoint record is the router's and names the replicas,
    each a deployment of its own with its engine record (engine-<deployment>-<replica>.json); the rolling change
    has its record (rollout-<deployment>.json). No names: a deployment of one instance."""

    names: list[str]
    layout: Record | None  # the router's endpoint record, whichever run wrote it (the replicas' names, the router)
    engines: list[Record | None]
    rollout: Record | None

    @classmethod
    def load(cls, d: Path, deployment: str, endpoint: Record | None) -> Replicas:
        data = (endpoint.data if endpoint else None) or {}
        listed = data.get("replicas") if isinstance(data.get("replicas"), list) else []
        names = [n for n in listed if isinstance(n, str) and DEPLOYMENT_RE.match(n)]
        if not names:
            return cls([], None, [], None)
        return cls(names, endpoint, [load_record(d, f"engine-{n}.json") for n in names],
                   load_record(d, f"rollout-{deployment}.json"))  # fmt: skip

    def records(self) -> list[Record | None]:
        return [self.rollout, *self.engines]

    def files(self) -> str:
        return ", ".join(f"engine-{n}.json" for n in self.names)

    def first_engine(self) -> Record | None:
        return next((r for r in self.engines if r is not None), None)

    def keep(self, run: Run) -> str | None:
        """Keep this run's records only; why the engine records were all left out (None when one is kept)."""
        self.rollout = run.own(self.rollout)[0]
        own = [run.own(r) for r in self.engines]
        self.engines = [kept for kept, _why in own]
        return None if any(self.engines) else "; ".join(why for _kept, why in own if why) or None

    def engine(self) -> Record | None:
        """One engine record from the replicas' (an unreadable one is the engine section's error)."""
        bad = next((r for r in self.engines if r is not None and r.error), None)
        if bad is not None:
            return bad
        present = [r for r in self.engines if r is not None and r.data is not None]
        if not present:
            return None
        newest = max(present, key=lambda r: r.time or dt.datetime.min.replace(tzinfo=dt.UTC))
        return Record(", ".join(r.name for r in present), rs.replica_engines([r.data for r in present]),
                      time=newest.time, time_source=newest.time_source)  # fmt: skip

    def section_records(self) -> list[Record | None]:
        """The replicas section's records: the router's endpoint first, unless nothing of this run describes them."""
        described = any(self.engines) or self.rollout is not None
        return [self.layout if described else None, self.rollout, *self.engines]


def _stage_record(d: Path, engine: Record | None, endpoint: Record | None) -> tuple[Record | None, str]:
    """The staging record of the deployment's model: the stage-<model>.json of the revision the engine's records
    name, else the one of the served model's name; the only one when nothing names the model."""
    revisions, names = set(), []
    for rec in (engine, endpoint):
        data = (rec.data if rec else None) or {}
        if data.get("revision"):
            revisions.add(str(data["revision"]))
        if data.get("model"):
            names.append(str(data["model"]))
    found = sorted(p.name for p in d.glob("stage-*.json"))
    for n in found if revisions else []:
        rec = load_record(d, n)
        if rec and str((rec.data or {}).get("revision")) in revisions:
            return rec, ""
    for n in names:
        rec = load_record(d, f"stage-{n}.json")
        if rec:
            return rec, ""
    if not names and len(found) == 1:
        return load_record(d, found[0]), ""
    if found:
        return None, f"no stage-<model>.json for {' or '.join(names) or 'this deployment'}'s model (found: " + (
            ", ".join(found) + ")"
        )
    return None, ""


@dataclass
class Run:
    """The newest run of a deployment: run-<deployment>.json (its id, playbook, steps, tags and where it stopped),
    or, without that record, the newest run id the records carry."""

    id: str
    data: dict
    source: str

    def label(self) -> str:
        pb = self.data.get("playbook")
        return f"run {self.id}" + (f" ({pb})" if pb else "")

    def planned(self, step: str) -> bool:
        """Whether the run was to take this step (its playbook's steps, less what --tags/--skip-tags left out)."""
        steps = self.data.get("steps")
        if not isinstance(steps, list):
            return True  # unknown: no run record
        if step not in steps:
            return False
        tag = STEP_TAG.get(step, step)
        tags = [str(t) for t in self.data.get("tags") or ["all"]]
        skip = [str(t) for t in self.data.get("skip_tags") or []]
        return ("all" in tags or tag in tags) and tag not in skip

    def stop(self) -> dict | None:
        st = self.data.get("stopped")
        if not isinstance(st, dict) or not st.get("node"):
            return None
        # A run of the installed collection names its roles in full (llmfleet.fleet.engine): the step is the role's.
        return {**st, **{k: str(st[k]).rsplit(".", 1)[-1] for k in ("role", "within") if st.get(k)}}

    def stop_text(self) -> str | None:
        st = self.stop()
        if st is None:
            return None
        return f"it stopped at {stop_step(st)} on {st['node']}"

    def why_missing(self, step: str, other: str | None) -> str:
        if not self.planned(step):
            tags = self.data.get("tags") or []
            sel = f" with --tags {','.join(map(str, tags))}" if tags and "all" not in tags else ""
            skip = self.data.get("skip_tags") or []
            sel += f" --skip-tags {','.join(map(str, skip))}" if skip else ""
            why = f"{self.data.get('playbook') or 'the run'}{sel} does not take this step"
            if step == "bench":
                why += " (playbooks/bench.yml does)"
        elif self.stop_text():
            why = self.stop_text() or ""
        elif self.data.get("outcome") == "completed":
            why = "the run completed without writing this step's record"
        elif self.data:
            why = "no record of this step from the run: it did not get this far, was interrupted, or is still running"
        else:
            why = "no record of this step carries this run's id"
        return why + (f"; {other}" if other else "")

    def own(self, rec: Record | None) -> tuple[Record | None, str | None]:
        """(rec, None) when rec is this run's (or unreadable: its error is shown), else (None, why it is left out)."""
        if rec is None or rec.data is None:
            return rec, None
        rid = rec.data.get("run_id")
        if rid == self.id:
            return rec, None
        if not rid:
            return None, f"{rec.name} has no run id: written by an earlier run, before llmfleet kept run ids"
        return None, f"{rec.name} is from an earlier run ({rid})"

    def model(self) -> dict[str, Any]:
        st = self.stop()
        return {"id": self.id, "source": self.source, "playbook": self.data.get("playbook"),
                "started_at": self.data.get("started_at"), "finished_at": self.data.get("finished_at"),
                "outcome": self.data.get("outcome"),
                "stopped": {**st, "step": stop_step(st)} if st else None,
                "steps": self.data.get("steps"), "tags": self.data.get("tags"),
                "skip_tags": self.data.get("skip_tags")}  # fmt: skip


def newest_run(d: Path, deployment: str, recs: list[Record | None]) -> Run | None:
    """The run the report is about: run-<deployment>.json's, else the newest run id of the records (ids begin
    with the run's UTC start), else None (records written before llmfleet kept run ids)."""
    rec = load_record(d, f"run-{deployment}.json")
    if rec is not None and rec.data is not None and isinstance(rec.data.get("run_id"), str) and rec.data["run_id"]:
        return Run(rec.data["run_id"], rec.data, rec.name)
    ids = sorted(str(r.data["run_id"]) for r in recs if r is not None and r.data and r.data.get("run_id"))
    return Run(ids[-1], {}, "the newest run id of the records") if ids else None


def _stale_reason(sid: str, rec: Record, anchor: Record | None, max_age_s: float, endpoint: dict | None) -> str | None:
    """Why a record is from another run than this deployment's (None when it is not): acceptance or bench
    of another endpoint or model, a test older than the engine gate it should have tested, a step before the
    engine more than max_age_s older than its gate."""
    data, ep = rec.data or {}, endpoint or {}
    if sid == "acceptance" and ep.get("url") and data.get("url") and data["url"].rstrip("/") != ep["url"].rstrip("/"):
        return f"{rec.name} tested {data['url']}, this deployment's endpoint is {ep['url']}: another deployment's run"
    if sid == "bench":
        settings = data.get("settings") if isinstance(data.get("settings"), dict) else {}
        if ep.get("model") and settings.get("model") and settings["model"] != ep["model"]:
            return (f"{rec.name} measured model {settings['model']}, this deployment serves {ep['model']}: "
                    "another deployment's run")  # fmt: skip
    if anchor is None or rec.time is None or anchor.time is None or rec is anchor:
        return None
    age = (anchor.time - rec.time).total_seconds()
    when = f"{rec.name} is from {iso(rec.time)} ({rec.time_source})"
    if sid in AFTER_ENGINE and age > CLOCK_SLACK_S:
        return f"{when}, before this deployment's engine gate ({iso(anchor.time)}): it tested an earlier start"
    if sid in BEFORE_ENGINE and age > max_age_s:
        return f"{when}, {age / 3600:.0f} h before this deployment's engine gate ({iso(anchor.time)}): an earlier run's"
    return None


def _section(
    sid: str,
    recs: list[Record | None],
    build: Callable[..., dict[str, Any]],
    *,
    missing: str,
    anchor: Record | None = None,
    max_age_s: float = MAX_AGE_S,
    endpoint: dict | None = None,
    optional: bool = False,
    run: Run | None = None,
) -> dict[str, Any]:
    """One section from its records (the first is the one it cannot do without unless `optional`). With a run,
    the records are that run's already (the others left out and said in `missing`)."""
    title, question = next((t, q) for i, t, q in SECTIONS if i == sid)
    sec: dict[str, Any] = {"id": sid, "title": title, "question": question, "status": "not-run", "reason": "",
                           "summary": "not run in this run" if run else "not run in this report", "warnings": [],
                           "sources": [], "generated_at": None, "time_source": None}  # fmt: skip
    present = [r for r in recs if r is not None]
    main = recs[0]
    if main is None and (not optional or not present):
        sec["reason"] = missing
        return sec
    bad = [r for r in present if r.error]
    if main is not None and main.error:
        sec.update(status="error", summary=f"{main.name} {main.error}", sources=[main.name])
        return sec
    stale = _stale_reason(sid, main, anchor, max_age_s, endpoint) if main is not None and run is None else None
    if stale:
        sec["reason"] = stale
        return sec
    sec["sources"] = [r.name for r in present if not r.error]
    timed = main if main is not None else present[0]
    sec["generated_at"], sec["time_source"] = iso(timed.time), timed.time_source
    sec["warnings"] = [f"{r.name} {r.error}" for r in bad]
    try:
        body = build(*[r.data if r is not None and not r.error else None for r in recs])
    except SHAPE_ERRORS as e:
        sec.update(status="error", summary=f"{timed.name}: unexpected content ({type(e).__name__}: {e}); "
                   "docs/report.md gives the shape this version reads")  # fmt: skip
        return sec
    sec["warnings"] += body.pop("warnings", [])
    sec.update(body)
    return sec


def _missing(d: Path, deployment: str, stage_why: str, reps: Replicas) -> dict[str, str]:
    """Why each section has no record, when it has none (a run's reasons replace these)."""
    missing = {
        "inventory": f"no fleet-summary.json, preflight.json or {deployment} record in {d}",
        "preflight": f"no preflight.json in {d}",
        "topology": f"no topology.json in {d}",
        "staging": stage_why or f"no stage-<model>.json in {d}",
        "nccl": f"no nccl-check.json in {d}",
        "engine": f"no engine-{deployment}.json in {d}",
        "acceptance": f"no acceptance-{deployment}.json in {d}",
        "bench": f"no bench-{deployment}/results.json in {d}",
        "metrics": f"no endpoint-{deployment}.json or engine-{deployment}.json in {d}",
    }
    if reps.names:
        missing["engine"] = missing["replicas"] = f"no engine record of its replicas ({reps.files()}) in {d}"
    for k in ("timeline", "speculative"):
        missing[k] = missing["engine"]
    return missing


def collect(
    report_dir: str | os.PathLike, deployment: str, *, max_age_s: float = MAX_AGE_S, now: dt.datetime | None = None
) -> dict[str, Any]:
    """The report model of one deployment from the records in report_dir (JSON-able; report.json is this)."""
    _check_name(deployment)
    d = _report_dir(report_dir)
    now = now or dt.datetime.now(dt.UTC)
    fleet = load_record(d, "fleet-summary.json")
    pre = load_record(d, "preflight.json")
    topo = load_record(d, "topology.json")
    nccl = load_record(d, "nccl-check.json")
    endpoint = load_record(d, f"endpoint-{deployment}.json")
    reps = Replicas.load(d, deployment, endpoint)
    # Beside the replicas', an engine-<deployment>.json is from before the deployment had them.
    engine = None if reps.names else load_record(d, f"engine-{deployment}.json")
    accept = load_record(d, f"acceptance-{deployment}.json", ("started_at",))
    bench = load_record(d, f"bench-{deployment}/results.json", ("finished", "started"))
    stage, stage_why = _stage_record(d, reps.first_engine() if reps.names else engine, endpoint)
    run = newest_run(d, deployment, [fleet, pre, topo, nccl, endpoint, engine, accept, bench, stage, *reps.records()])
    # records of this deployment in the directory, of whichever run (the CLI's note when there are none)
    has_own_records = any(r is not None for r in (endpoint, engine, accept, bench))
    missing = _missing(d, deployment, stage_why, reps)
    if run is not None:
        # This run's records only: the others are left out, and each section says why.
        left: dict[str, str] = {}
        kept = {}
        for key, rec in (("fleet", fleet), ("pre", pre), ("topo", topo), ("nccl", nccl), ("endpoint", endpoint),
                         ("engine", engine), ("accept", accept), ("bench", bench), ("stage", stage)):  # fmt: skip
            kept[key], why = run.own(rec)
            if why:
                left[key] = why
        fleet, pre, topo, nccl = kept["fleet"], kept["pre"], kept["topo"], kept["nccl"]
        endpoint, engine, accept, bench, stage = (kept[k] for k in ("endpoint", "engine", "accept", "bench", "stage"))
        if reps.names:
            left["engine"] = reps.keep(run) or ""
        own_key = {"inventory": "fleet", "preflight": "pre", "topology": "topo", "staging": "stage", "nccl": "nccl",
                   "engine": "engine", "replicas": "engine", "timeline": "engine", "speculative": "engine",
                   "acceptance": "accept", "bench": "bench", "metrics": "endpoint"}  # fmt: skip
        for sid, key in own_key.items():
            step = SECTION_STEP.get(sid)
            if step is None:  # the inventory: whatever this run recorded
                missing[sid] = f"no record of this run ({run.id}) describes the nodes"
            else:
                missing[sid] = run.why_missing(step, left.get(key) or (missing[sid] if key == "stage" and stage_why
                                                                      else None))  # fmt: skip
    if reps.names:
        engine = reps.engine()
    anchor = engine if engine is not None and engine.data is not None and run is None else None
    ep = endpoint.data if endpoint is not None else None
    common = {"anchor": anchor, "max_age_s": max_age_s, "endpoint": ep, "run": run}

    def ok(rec: Record | None) -> Record | None:  # records another section borrows from: only this run's
        if rec is None or rec.error:
            return None
        sid = "preflight" if rec.name == "preflight.json" else "inventory"
        return None if run is None and _stale_reason(sid, rec, anchor, max_age_s, ep) else rec

    sections = [
        _section("inventory", [fleet, ok(pre), endpoint, engine, ok(stage)], rs.inventory, optional=True,
                 missing=missing["inventory"], **common),
        _section("preflight", [pre], rs.preflight, missing=missing["preflight"], **common),
        _section("topology", [topo], rs.topology, missing=missing["topology"], **common),
        _section("staging", [stage], rs.staging, missing=missing["staging"], **common),
        _section("nccl", [nccl], rs.nccl, missing=missing["nccl"], **common),
        _section("engine", [engine], rs.engine, missing=missing["engine"], **common),
        *([_section("replicas", reps.section_records(), rs.replicas, missing=missing["replicas"], **common)]
          if reps.names else []),
        _section("timeline", [engine], rs.timeline, missing=missing["timeline"], **common),
        _section("speculative", [engine], rs.speculative, missing=missing["speculative"], **common),
        _section("acceptance", [accept], rs.acceptance, missing=missing["acceptance"], **common),
        _section("bench", [bench], rs.bench, missing=missing["bench"], **common),
        _section("metrics", [endpoint, engine], rs.scrape_targets, optional=True, missing=missing["metrics"],
                 **common),
    ]  # fmt: skip
    by_id = {s["id"]: s for s in sections}
    if by_id["engine"]["status"] in ("pass", "fail"):
        for sid in ("preflight", "topology", "staging", "nccl"):
            s = by_id[sid]
            if s["generated_at"] and anchor and anchor.time and _utc(s["generated_at"]) > anchor.time:
                by_id["engine"]["warnings"].append(
                    f"{s['sources'][0]} is newer than this engine record: the engine was not started after it"
                )
    records = [r for r in (fleet, pre, topo, stage, nccl, endpoint, engine, accept, bench, reps.rollout) if r]
    model: dict[str, Any] = {
        "schema": SCHEMA,
        "deployment": deployment,
        "generated_at": iso(now),
        "report_dir": str(d.resolve()),
        "problems": [{"file": r.name, "error": r.error} for r in records if r.error],
        "sections": sections,
        "steps": [_step(by_id, sid, name) for sid, name in STEPS if sid in by_id],
        "other_deployments": [n for n in _deployments(d) if n != deployment],
        "has_own_records": has_own_records,
        "run": run.model() if run else None,
    }
    model.update(_verdict(by_id, run))
    return model


def _step(by_id: dict[str, dict[str, Any]], sid: str, name: str) -> dict[str, Any]:
    sec = by_id[sid]
    if sid == "timeline" and by_id["engine"]["status"] != "pass":
        sec = by_id["engine"]  # a failed start: the first failed node says more than the phases reached
    return {"id": sid, "name": name, "status": sec["status"], "summary": sec["summary"], "reason": sec["reason"]}


def _failure_box(sec: dict[str, Any]) -> dict[str, Any]:
    """What the top of the page says about a failed step: the verdict, the node (and rank) and evidence."""
    box: dict[str, Any] = {"step": sec["id"], "title": sec["title"], "verdict": sec["summary"], "node": None,
                           "rank": None, "first_error": None, "log_tail": [], "details": []}  # fmt: skip
    sid = sec["id"]
    if sid in ("engine", "timeline") and sec.get("failure"):
        f = sec["failure"]
        box.update({k: f.get(k) for k in ("node", "rank", "first_error")}, log_tail=f.get("log_tail") or [])
        box["verdict"] = f.get("verdict") or sec["summary"]
    elif sid == "preflight":
        box["node"] = ", ".join(o["node"] for o in sec.get("odd_nodes", [])) or None
        box["details"] = [f"{o['node']}: {w}" for o in sec.get("odd_nodes", []) for w in o["why"]]
    elif sid == "nccl":
        box["node"] = ", ".join(sec.get("bad_nodes") or [n["node"] for n in sec.get("nodes", []) if n["slow"]]) or None
        box["details"] = sec.get("lines", [])
    elif sid == "staging":
        failed = [n for n in sec.get("nodes", []) if n["failed"]]
        box["node"] = ", ".join(n["node"] for n in failed) or None
        box["first_error"] = failed[0]["message"] if failed else None
    elif sid == "replicas" and sec.get("failed_step"):
        st = sec["failed_step"]
        box["verdict"] = sec["summary"].removeprefix("FAIL: ")
        box["node"] = ", ".join(st["nodes"]) or None
        box["first_error"] = st["error"] or None
        box["details"] = [f"rollout step {x['replica']}: {x['outcome']}" + (f": {x['error']}" if x["error"] else "")
                          for x in sec["rollout"]["steps"]]  # fmt: skip
    elif sid == "acceptance":
        box["details"] = [f"{c['name']}: {c['verdict']}: {c['why']}" + (f" (fix: {c['fix']})" if c["fix"] else "")
                          for c in sec.get("checks", []) if c["verdict"] == "fail" and c["kind"] == "gate"]  # fmt: skip
    elif sid == "bench":
        box["details"] = [f"{c['id']}: {c['status']}: {c['why']}" for c in sec.get("cases", []) if c["status"] != "OK"]
    return box


def _stop_box(run: Run) -> dict[str, Any] | None:
    """The failure at the top of the page from where the run stopped (a failed task with no record of its own
    step, e.g. the engine's flag check): the step, node, task and message."""
    st = run.stop()
    if st is None:
        return None
    role = str(st.get("role") or "")
    step = stop_step(st)
    where = f"{run.label()}: it stopped at {step} on {st.get('node')}"
    return {"step": role or "run", "title": step, "verdict": str(st.get("message") or "failed"),
            "node": st.get("node"), "rank": None, "first_error": None, "log_tail": [],
            "details": [f"task: {st.get('task')}", where]}  # fmt: skip


def _verdict(by_id: dict[str, dict[str, Any]], run: Run | None = None) -> dict[str, Any]:
    """pass: no step failed and the engine answered correctly and acceptance passed; fail: a step failed (or the
    run stopped at a failed task); incomplete: nothing failed but the engine or acceptance did not run here, or a
    record is unreadable."""
    order = ["preflight", "topology", "staging", "nccl", "engine", "replicas", "acceptance", "bench"]
    failed = [by_id[s] for s in order if s in by_id and by_id[s]["status"] == "fail"]
    stop = _stop_box(run) if run else None
    if failed or stop:
        boxes = [_failure_box(s) for s in failed]
        if stop and not any(b["step"] == stop["step"] or (stop["step"] == "engine" and b["step"] in ENGINE_SECTIONS)
                            for b in boxes):  # fmt: skip
            boxes.insert(0, stop)  # the run stopped before any failed record: the stop comes first
        first = boxes[0]
        where = f" on {first['node']}" + (f" ({first['rank']})" if first["rank"] else "") if first["node"] else ""
        return {"status": "fail", "verdict": f"FAIL at {first['title'].lower()}{where}: {first['verdict']}",
                "failure": first, "failures": boxes}  # fmt: skip
    missing = [by_id[s]["title"].lower() for s in ("engine", "acceptance") if by_id[s]["status"] != "pass"]
    errors = [s["title"].lower() for s in by_id.values() if s["status"] == "error"]
    if missing or errors:
        why = []
        if missing:
            why.append(f"{' and '.join(missing)} not run in this " + ("run" if run else "report"))
            if run and run.data and not run.data.get("outcome"):
                why.append(f"{run.label()} has not ended (interrupted, or still running)")
        if errors:
            why.append(f"unreadable record for {', '.join(errors)}")
        return {"status": "incomplete", "verdict": "INCOMPLETE: no step failed, but " + "; ".join(why),
                "failure": None, "failures": []}  # fmt: skip
    return {"status": "pass", "verdict": f"PASS: {by_id['timeline']['summary']}; {by_id['acceptance']['summary']}",
            "failure": None, "failures": []}  # fmt: skip


# ---- rendering ---------------------------------------------------------------------------------------------


def _fmt(v: Any, digits: int = 1, unit: str = "") -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "—"
    return f"{v:.{digits}f}{(' ' + unit) if unit else ''}"


def _md(text: Any) -> str:
    """A markdown table cell: record text is data, never markup (HTML escaped, pipes and newlines neutral)."""
    s = "" if text is None else str(text)
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return s.replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def _fence(lines: list[str]) -> str:
    """A fenced code block longer than any backtick run in the lines (a log line cannot close it)."""
    run = best = 0
    for ch in "\n".join(lines):
        run = run + 1 if ch == "`" else 0
        best = max(best, run)
    fence = "`" * max(3, best + 1)
    return f"{fence}\n" + "\n".join(lines) + f"\n{fence}"


@functools.cache
def _env() -> Any:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        # the page escapes everything; the markdown twin escapes record text itself (the md filter)
        autoescape=jinja2.select_autoescape(enabled_extensions=("html.j2",), default=False),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(size=rs.size_text, fmt=_fmt, md=_md, fence=_fence)
    return env


def render(model: dict[str, Any]) -> tuple[str, str]:
    """(HTML page, markdown twin) of a report model; the page's charts are inline SVG."""
    from markupsafe import Markup

    from .svg import bench_svg, timeline_svg

    if not (TEMPLATES / "report.html.j2").is_file():
        raise ReportError(f"{TEMPLATES}/report.html.j2 is missing: the llmfleet package was installed without its "
                          "templates (package-data templates/*.j2); reinstall it")  # fmt: skip
    by_id = {s["id"]: s for s in model["sections"]}
    # report_svg escapes every record text it draws: the charts are markup of our own.
    gates, cases = by_id["timeline"].get("gates", []), by_id["bench"].get("cases", [])
    charts = {
        "timeline": [Markup(timeline_svg(g)) for g in gates],  # noqa: S704 (escaped in report_svg)
        "bench": Markup(bench_svg(cases)) if cases else None,  # noqa: S704 (escaped in report_svg)
    }
    ctx = {"m": model, "s": by_id, "charts": charts, "labels": rs.EVENT_LABELS}
    env = _env()
    html = env.get_template("report.html.j2").render(**ctx)
    md = env.get_template("report.md.j2").render(**ctx)
    return html, md


# ---- publishing ----------------------------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(
    report_dir: str | os.PathLike, deployment: str, model: dict[str, Any], now: dt.datetime | None = None
) -> Path:
    """Write report.html, report.md and report.json into <report_dir>/<deployment>/<UTC stamp>/ and point
    `latest` there. The directory appears whole (written under a private temporary name in the same parent,
    then renamed) and `latest` is swapped by renaming a new link over it: a reader never sees half a report.
    Returns the report's directory."""
    _check_name(deployment)
    base = _report_dir(report_dir) / deployment
    now = now or dt.datetime.now(dt.UTC)
    html, md = render(model)
    try:
        base.mkdir(exist_ok=True)
    except OSError as e:
        raise ReportError(f"cannot create {base}: {e}") from None
    if not base.is_dir():
        raise ReportError(f"{base} is in the way (not a directory): move it, the reports of {deployment} go there")
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=base))
    try:
        _write(tmp / "report.html", html)
        _write(tmp / "report.md", md)
        _write(tmp / "report.json", json.dumps(model, indent=2, sort_keys=False) + "\n")
        # mkdtemp's 0700 was for while it was incomplete; reports are for everyone who reads the report directory
        os.chmod(tmp, 0o755)  # noqa: S103
        stamp = now.astimezone(dt.UTC).strftime(STAMP)
        final = None
        for k in range(1, 1000):  # two reports in the same second get -2, -3, …
            cand = base / (stamp if k == 1 else f"{stamp}-{k}")
            if cand.exists() or cand.is_symlink():
                continue
            try:
                os.rename(tmp, cand)
            except OSError:  # appeared meanwhile (a concurrent publish): the next name
                continue
            final = cand
            break
        if final is None:
            raise ReportError(f"{base}: no free report name for {stamp}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _swap_latest(base, final.name)
    _fsync_dir(base)
    return final


def _swap_latest(base: Path, target: str) -> None:
    latest = base / "latest"
    if latest.exists() and not latest.is_symlink():
        raise ReportError(f"{latest} is not a symbolic link: move it away; `latest` points at the newest report")
    tmp = base / f".latest-{os.getpid()}-{target}"
    if tmp.is_symlink():
        tmp.unlink()
    os.symlink(target, tmp)  # relative: the tree can move or be copied
    os.replace(tmp, latest)


# ---- terminal ---------------------------------------------------------------------------------------------------


def summary_lines(model: dict[str, Any], width: int = 118) -> list[str]:
    """A few lines for the terminal: the verdict, then pass/fail per step (a cut line ends in '...')."""

    def fit(line: str) -> str:
        return line if len(line) <= width else line[: width - 3].rstrip() + "..."

    out = [fit(f"deployment {model['deployment']}: {model['verdict']}")]
    run = model.get("run")
    if run:
        started = f", started {run['started_at']}" if run.get("started_at") else ""
        out.append(fit(f"  run {run['id']}" + (f" ({run['playbook']}{started})" if run.get("playbook") else "")))
    for st in model["steps"]:
        status = {"not-run": "not run"}.get(st["status"], st["status"]).upper()
        text = st["reason"] if st["status"] == "not-run" else st["summary"]
        if st["status"] == "not-run":
            text = ("not run in this run" if run else "not run in this report") + (f" ({text})" if text else "")
        out.append(fit(f"  {st['name']:<18} {status:<8} {text}"))
    out += [fit(f"  record problem: {p['file']} {p['error']}") for p in model["problems"]]
    return out
