"""llmfleet.metrics: the exposition format (parsed back with prometheus_client's own parser), the atomic
write, and every builder on real records (reports/, tests/fixtures/, docs/measurements/device-runs/)."""

from __future__ import annotations

import ast
import copy
import json
import math
import os
import re
import stat
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import llmfleet
from llmfleet import metrics
from llmfleet.accept import checks as accept_checks
from llmfleet.bench import serve as servebench
from llmfleet.checks import nccl_verdict
from llmfleet.metrics import Family, family, render

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures"
DEVICE = ROOT / "docs" / "measurements" / "device-runs" / "2026-11-29-h200x2-nccl-check"
REV = "5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed"


def parse(text: str) -> dict[str, list[tuple[dict, float]]]:
    """{sample name: [(labels, value)]} through prometheus_client's parser (raises on invalid text)."""
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(parsed: dict, name: str, **labels) -> float:
    hits = [v for lab, v in parsed[name] if all(lab.get(k) == str(x) for k, x in labels.items())]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples in {parsed.get(name)}"
    return hits[0]


def load(path: Path) -> dict:
    return json.loads(path.read_text())


# ---- format ------------------------------------------------------------------------------------------------


def test_render_escapes_label_values_and_help_and_parses_back():
    nasty = 'a\\b "quoted"\nnext line'
    fam = Family("llmfleet_x", "help with \\ and\nnewline").add(1, check=nasty)
    text = render([fam])
    assert text == (
        "# HELP llmfleet_x help with \\\\ and\\nnewline\n# TYPE llmfleet_x gauge\n"
        'llmfleet_x{check="a\\\\b \\"quoted\\"\\nnext line"} 1\n'
    )
    (f,) = text_string_to_metric_families(text)
    assert f.documentation == "help with \\ and\nnewline"
    assert f.samples[0].labels == {"check": nasty}


@pytest.mark.parametrize(
    ("v", "text", "check"),
    [
        (float("inf"), "+Inf", lambda x: x == math.inf),
        (float("-inf"), "-Inf", lambda x: x == -math.inf),
        (float("nan"), "NaN", math.isnan),
        (True, "1", lambda x: x == 1),
        (3.0, "3", lambda x: x == 3),
        (2**60, str(2**60), lambda x: x == 2**60),
        (1e-05, "1e-05", lambda x: x == 1e-05),
        (1796086132.55, "1796086132.55", lambda x: x == 1796086132.55),
    ],
)
def test_values_are_valid_for_prometheus(v, text, check):
    out = render([Family("llmfleet_v", "v").add(v)])
    assert out.splitlines()[-1] == f"llmfleet_v {text}"
    assert check(parse(out)["llmfleet_v"][0][1])


@pytest.mark.parametrize(
    ("fams", "msg"),
    [
        ([Family("llmfleet-x", "h").add(1)], "metric name 'llmfleet-x' is not valid"),
        ([Family("0x", "h").add(1)], "metric name '0x' is not valid"),
        ([Family("llmfleet_x", "h").add(1, **{"bad-label": "v"})], "label name 'bad-label' of metric llmfleet_x"),
        ([Family("llmfleet_x", "h").add(1, __name="v")], "label name '__name' of metric llmfleet_x"),
        ([Family("llmfleet_x", "h", "histogram").add(1)], "type 'histogram' is not one of gauge, counter"),
        ([Family("llmfleet_x", "h", "counter").add(1)], "llmfleet_x: `_total` is for counters"),
        ([Family("llmfleet_x_total", "h").add(1)], "llmfleet_x_total: `_total` is for counters"),
        ([Family("llmfleet_x", "h").add(1, a="1").add(2, a="1")], "the series {'a': '1'} is given twice"),
        ([Family("llmfleet_x", "h").add(1), Family("llmfleet_x", "h").add(2)], "metric llmfleet_x is given twice"),
        ([Family("llmfleet_x", "h").add("fast")], "value 'fast' is not a number"),
        ([Family("llmfleet_x", "h").add(None)], "value None is not a number"),
    ],
)
def test_bad_names_and_shapes_are_value_errors_naming_them(fams, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        render(fams)


@pytest.mark.parametrize(("label", "owner"), [("quantile", "summaries"), ("le", "histograms")])
def test_gauges_and_counters_never_carry_the_labels_summaries_and_histograms_own(label, owner):
    with pytest.raises(ValueError, match=rf"llmfleet_x: the label '{label}' belongs to {owner}"):
        render([Family("llmfleet_x", "h").add(1, **{label: "0.5"})])


def test_bench_percentiles_are_not_a_quantile_label():
    out = render(metrics.bench_families(load(FIX / "metrics" / "bench-vllm-cpu-0.32.0.results.json")))
    assert "quantile=" not in out and 'percentile="99"' in out


def test_pass_fail_is_ok_everywhere_and_the_old_names_are_gone():
    for name, (_, text) in metrics.SPECS.items():
        assert not re.search(r"_(pass|passed|verified|accepted|success)$", name), name
        if name.endswith("_ready"):  # the engine's READY state (sd_notify), not a check's verdict
            assert "READY" in text, name
    for old, new in metrics.RENAMED.items():
        assert old not in metrics.SPECS and new in metrics.SPECS and new.endswith("_ok")


def test_constant_labels_are_checked_and_may_not_contradict():
    fam = family("llmfleet_stage_ok").add(1, model="m")
    assert 'deployment="d",model="m"' in render(metrics.with_labels([fam], {"deployment": "d", "model": "m"}))
    with pytest.raises(ValueError, match="constant label model='x' contradicts the record's model='m'"):
        metrics.with_labels([fam], {"model": "x"})
    with pytest.raises(ValueError, match=r"label name '__x' \(a constant label\)"):
        metrics.with_labels([fam], {"__x": "1"})


def test_parse_samples_reads_back_what_render_wrote():
    nasty = 'x\\y "z"\nw'
    text = render([family("llmfleet_engine_terminations_total").add(4, unit=nasty, verdict="signal")])
    assert metrics.parse_samples(text) == [
        ("llmfleet_engine_terminations_total", {"unit": nasty, "verdict": "signal"}, 4.0)
    ]
    assert metrics.parse_samples('garbage {{{\nllmfleet_a{b="c" 1\nllmfleet_ok 2\n') == [("llmfleet_ok", {}, 2.0)]


def test_every_defined_metric_follows_the_conventions():
    for name, (kind, text) in metrics.SPECS.items():
        metrics.check_name(name)
        assert name.startswith("llmfleet_") and kind in metrics.TYPES and text.endswith(".")
        assert (kind == "counter") == name.endswith("_total"), name
        # base units only: no milliseconds, GB/s, GiB, percent
        assert not re.search(r"_(ms|millis|gbps|gb|gib|mib|percent|minutes|hours)(_|$)", name), name


def test_node_side_module_is_python38_syntax():
    ast.parse((Path(llmfleet.__file__).parent / "metrics.py").read_text(), feature_version=(3, 8))


# ---- the file ------------------------------------------------------------------------------------------------


def test_write_is_atomic_0644_and_replaces(tmp_path):
    old = os.umask(0o077)
    try:
        path = metrics.write_textfile(str(tmp_path), "llmfleet_a.prom", "llmfleet_a 1\n")
        first_inode = os.stat(path).st_ino
        metrics.write_textfile(str(tmp_path), "llmfleet_a.prom", "llmfleet_a 2\n")
    finally:
        os.umask(old)
    assert Path(path).read_text() == "llmfleet_a 2\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert os.stat(path).st_ino != first_inode  # a new file renamed over the old one, not rewritten in place
    assert sorted(os.listdir(tmp_path)) == ["llmfleet_a.prom"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    metrics.write_textfile(str(tmp_path), "llmfleet_a.prom", "old\n")

    def boom(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(metrics.os, "fsync", boom)
    with pytest.raises(OSError, match="No space left"):
        metrics.write_textfile(str(tmp_path), "llmfleet_a.prom", "new\n")
    assert (tmp_path / "llmfleet_a.prom").read_text() == "old\n"
    assert sorted(os.listdir(tmp_path)) == ["llmfleet_a.prom"]


def test_a_symlinked_target_is_refused_and_its_target_untouched(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    d = tmp_path / "collector"
    d.mkdir()
    (d / "llmfleet_a.prom").symlink_to(outside)
    with pytest.raises(ValueError, match=r"llmfleet_a.prom is a symlink: refusing to replace it"):
        metrics.write_textfile(str(d), "llmfleet_a.prom", "x 1\n")
    assert outside.read_text() == "precious\n" and (d / "llmfleet_a.prom").is_symlink()
    assert sorted(os.listdir(d)) == ["llmfleet_a.prom"]
    assert metrics.read_textfile(str(d), "llmfleet_a.prom") is None  # never read through a link either


@pytest.mark.parametrize("name", ["llmfleet_a.txt", "../llmfleet_a.prom", "sub/llmfleet_a.prom", ".hidden.prom", ""])
def test_bad_file_names_are_refused(tmp_path, name):
    with pytest.raises(ValueError, match=r"a plain file name ending in \.prom"):
        metrics.write_textfile(str(tmp_path), name, "x 1\n")
    assert os.listdir(tmp_path) == []


def test_a_missing_directory_says_how_to_fix_it(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist: create it .* or set llmfleet_metrics_dir"):
        metrics.write_textfile(str(tmp_path / "nope"), "llmfleet_a.prom", "x 1\n")
    assert not (tmp_path / "nope").exists()


def test_a_directory_in_the_way_is_refused(tmp_path):
    (tmp_path / "llmfleet_a.prom").mkdir()
    with pytest.raises(ValueError, match="exists and is not a regular file"):
        metrics.write_textfile(str(tmp_path), "llmfleet_a.prom", "x 1\n")


# ---- staging -------------------------------------------------------------------------------------------------


@pytest.fixture
def stage_report():
    return load(FIX / "metrics" / "stage-demo-model.json")  # a lab run: node1 read shared storage, node2 peers


def test_stage_seed_and_peer_nodes(stage_report):
    seed = parse(metrics.build("stage", stage_report["nodes"]["node1"], labels={"deployment": "demo"}, node="node1"))
    lab = {"model": "demo-model", "revision": REV, "node": "node1", "deployment": "demo"}
    assert value(seed, "llmfleet_stage_ok", **lab) == 1
    assert value(seed, "llmfleet_stage_revision_bytes", **lab) == 8394252
    assert value(seed, "llmfleet_stage_read_bytes", source="shared", **lab) == 8394252
    assert value(seed, "llmfleet_stage_read_bytes", source="peer", **lab) == 0
    assert value(seed, "llmfleet_stage_served_bytes", **lab) == 8394252
    assert value(seed, "llmfleet_stage_shared_read_seconds", **lab) == pytest.approx(0.092, abs=1e-3)
    assert "llmfleet_stage_seconds" not in seed  # this record predates elapsed_s
    peer = parse(metrics.build("stage", stage_report["nodes"]["node2"], node="node2"))
    assert value(peer, "llmfleet_stage_read_bytes", source="peer") == 8394252
    assert value(peer, "llmfleet_stage_shared_read_seconds") == 0


def test_stage_and_nccl_runs_have_a_timestamp(stage_report):
    out = parse(metrics.build("stage", stage_report["nodes"]["node1"], now=1796090000.25))
    assert value(out, "llmfleet_stage_timestamp_seconds") == 1796090000.25
    v = {"ok": True, "single": {"a": True}, "full": {"ok": True}}
    assert value(parse(metrics.build("nccl_check", v, node="a", now=1796090001)),
                 "llmfleet_collective_timestamp_seconds") == 1796090001  # fmt: skip
    # the clock when not given
    assert value(parse(metrics.build("nccl_check", v, node="a")), "llmfleet_collective_timestamp_seconds") > 1.7e9


def test_stage_same_record_again_keeps_its_time_a_new_copy_gets_a_new_one(stage_report):
    rec = stage_report["nodes"]["node2"]
    first = metrics.build("stage", rec, node="node2", now=1796090000)
    assert metrics.build("stage", rec, node="node2", previous=first, now=1796099999) == first
    again = dict(rec, elapsed_s=3.5)  # another run that copied
    out = parse(metrics.build("stage", again, node="node2", previous=first, now=1796099999))
    assert value(out, "llmfleet_stage_timestamp_seconds") == 1796099999


def test_stage_seconds_from_elapsed(stage_report):
    rec = dict(stage_report["nodes"]["node1"], elapsed_s=12.5)
    assert value(parse(metrics.build("stage", rec)), "llmfleet_stage_seconds") == 12.5


def test_stage_rerun_that_copied_nothing_writes_the_same_file(stage_report):
    first = metrics.build("stage", stage_report["nodes"]["node2"], node="node2", now=1796090000)
    rerun = dict(stage_report["nodes"]["node2"], state_before="published", bytes_copied=0, peer_bytes_read=0,
                 bytes_to_copy=0, files_to_copy=0, changed=False, elapsed_s=0.04)  # fmt: skip
    assert metrics.build("stage", rerun, node="node2", previous=first, now=1796099999) == first
    # Without a previous file the rerun's own (zero) figures are all there is.
    alone = parse(metrics.build("stage", rerun, node="node2"))
    assert value(alone, "llmfleet_stage_copied_bytes") == 0 and value(alone, "llmfleet_stage_seconds") == 0.04


def test_stage_failure_is_unverified_and_keeps_the_last_copy(stage_report):
    first = metrics.build("stage", stage_report["nodes"]["node2"], node="node2")
    failed = {"failed": True, "msg": "node2: disk full"}
    with pytest.raises(ValueError, match=r"names no model or revision .* \(labels: \{model: ..., revision: ...\}\)"):
        metrics.build("stage", failed, node="node2", previous=first)
    out = parse(metrics.build("stage", failed, labels={"model": "demo-model", "revision": REV}, node="node2",
                              previous=first))  # fmt: skip
    assert value(out, "llmfleet_stage_ok") == 0
    assert value(out, "llmfleet_stage_copied_bytes") == 8394252  # what staging this revision cost, kept
    assert "llmfleet_stage_revision_bytes" not in out


def test_stage_new_revision_drops_the_old_one(stage_report):
    first = metrics.build("stage", stage_report["nodes"]["node2"], node="node2")
    new = dict(stage_report["nodes"]["node2"], revision="a" * 40, state_before="published", bytes_copied=0)
    out = parse(metrics.build("stage", new, node="node2", previous=first))
    assert {lab["revision"] for samples in out.values() for lab, _ in samples} == {"a" * 40}
    assert value(out, "llmfleet_stage_copied_bytes") == 0


# ---- collective check -------------------------------------------------------------------------------------------


def h200_verdict(run: str, floors: dict) -> tuple[dict, list]:
    """fleet_verdict over a real 2x H200 run of the rank program (one node: phase 1 and 2 are the same world)."""
    ranks = load(DEVICE / run)["ranks"]
    by_node = {"vm": {"_nccl_check_single": {"ok": all(r["ok"] for r in ranks), "ranks": ranks},
                      "_nccl_check_full": {"ranks": ranks}}}  # fmt: skip
    return nccl_verdict.fleet_verdict(by_node, floors, 2**30, {"vm": "NVIDIA H200"}), ranks


def test_nccl_real_h200_busbw_floor_and_pass():
    floors = {"H100": 400, "H200": 400, "H20": 300}
    v, ranks = h200_verdict("nccl_check-nccl.json", floors)
    rec = {**v, "single_ranks": ranks, "full_ranks": {"ranks": ranks}, "floors": floors,
           "models": {"vm": "NVIDIA H200"}, "reference_bytes": 2**30}  # fmt: skip
    out = parse(metrics.build("nccl_check", rec, labels={"deployment": "d"}, node="vm"))
    # The slower of the two ranks at 1 GiB (324.723 and 324.241 GB/s).
    assert (
        value(out, "llmfleet_collective_busbw_bytes_per_second", phase="single", op="all_reduce", dtype="fp32")
        == 324.241e9
    )
    assert value(out, "llmfleet_collective_message_bytes", phase="full", op="all_reduce", dtype="fp32") == 2**30
    assert value(out, "llmfleet_collective_floor_bytes_per_second") == 400e9  # H200's, not H20's
    assert value(out, "llmfleet_collective_below_floor") == 1 and v["slow_nodes"] == {"vm": v["slow_nodes"]["vm"]}
    assert value(out, "llmfleet_collective_node_ok") == 0 and value(out, "llmfleet_collective_ok") == 0
    assert {lab["op"] for lab, x in out["llmfleet_collective_op_ok"] if x == 1} == {
        "all_reduce", "broadcast", "sendrecv", "all_gather"}  # fmt: skip
    assert value(out, "llmfleet_collective_phase_ok", phase="single") == 1


def test_nccl_real_corrupting_rank_fails_the_op_not_the_others():
    v, ranks = h200_verdict("nccl_check-nccl-corrupt.json", {})
    out = parse(metrics.build("nccl_check", {"verdict": v, "single_ranks": {"vm": ranks}}, node="vm"))
    assert value(out, "llmfleet_collective_op_ok", phase="single", op="all_reduce") == 0
    assert value(out, "llmfleet_collective_op_ok", phase="single", op="broadcast") == 1
    assert value(out, "llmfleet_collective_phase_ok", phase="full") == 0
    assert "llmfleet_collective_floor_bytes_per_second" not in out and "llmfleet_collective_below_floor" not in out
    # No full_ranks given: the verdict's ranks of this host are taken (hostname "vm" here).
    assert value(out, "llmfleet_collective_op_ok", phase="full", op="all_reduce") == 0


def test_nccl_rank_that_never_reported_an_op_fails_it_and_world_of_one_skips_sendrecv():
    ok = {"rank": 0, "ok": True, "results": [{"op": "all_reduce", "dtype": "fp32", "bytes": 8, "busbw_GBps": 1.0, "wrong": 0},
                                              {"op": "sendrecv", "dtype": "fp32", "bytes": 8, "skipped": "world of 1"}]}  # fmt: skip
    dead = {"rank": 1, "ok": False, "error": "watchdog", "results": []}
    v = {"ok": False, "single": {"n1": False}, "full": {"ok": False}, "bad_nodes": ["n1"]}
    out = parse(metrics.build("nccl_check", {"verdict": v, "single_ranks": [ok, dead]}, node="n1"))
    assert value(out, "llmfleet_collective_op_ok", phase="single", op="all_reduce") == 0
    assert [lab["op"] for lab, _ in out["llmfleet_collective_op_ok"]] == ["all_reduce"]
    assert value(out, "llmfleet_collective_node_ok") == 0


def test_nccl_pairs_phase_and_bad_input():
    v = {"ok": True, "single": {"a": True, "b": True}, "full": {"ok": True},
         "pairs": [{"pair": ["a", "b"], "ok": True}, {"pair": ["b", "c"], "ok": False}]}  # fmt: skip
    assert value(parse(metrics.build("nccl_check", v, node="b")), "llmfleet_collective_phase_ok", phase="pairs") == 0
    assert value(parse(metrics.build("nccl_check", v, node="a")), "llmfleet_collective_phase_ok", phase="pairs") == 1
    with pytest.raises(ValueError, match="give node"):
        metrics.build("nccl_check", v)
    with pytest.raises(ValueError, match="not a verdict"):
        metrics.build("nccl_check", {"ranks": []}, node="a")


@pytest.mark.parametrize("model", ["NVIDIA H200", "NVIDIA H20", "NVIDIA H100 80GB HBM3", "NVIDIA A100", None])
def test_floor_for_agrees_with_the_verdict(model):
    floors = {"H100": 400, "H200": 410, "H20": 300}
    ranks = [{"results": [{"op": "all_reduce", "bytes": 8, "busbw_GBps": 305.0}]}]
    slow = nccl_verdict.slow_nodes({"n": ranks}, floors, {"n": model}, 8)
    floor = metrics.floor_for(model, floors)
    assert ("n" in slow) == (floor is not None and 305.0 < floor)


# ---- readiness -----------------------------------------------------------------------------------------------------


@pytest.fixture
def gate():
    return load(FIX / "metrics" / "engine-ready-lab-vllm.json")  # the gate of the lab's vLLM TP2 over two nodes


def test_engine_ready_per_node_from_the_wrappers_timeline(gate):
    t0 = gate["timeline"]["t0"]
    n2 = parse(metrics.build("engine_ready", gate, labels={"deployment": "demo"}, node="node2"))
    assert value(n2, "llmfleet_engine_gate_ok", node="node2", deployment="demo") == 1
    assert value(n2, "llmfleet_engine_ready_timestamp_seconds") == pytest.approx(t0 + 25.13)
    assert value(n2, "llmfleet_engine_cold_start_seconds") == pytest.approx(25.13 - 0.42)
    assert value(n2, "llmfleet_engine_weights_loaded_seconds") == pytest.approx(24.7 - 0.42)
    assert value(n2, "llmfleet_engine_deployment_cold_start_seconds") == pytest.approx(31.62)  # node1 was last
    assert value(n2, "llmfleet_engine_deployment_ready_timestamp_seconds") == pytest.approx(t0 + 31.62)
    assert value(n2, "llmfleet_engine_node_failed") == 0


def test_engine_ready_rerun_of_the_gate_writes_the_same_file(gate):
    again = dict(gate, reported_at=gate["reported_at"] + 3600, elapsed_s=0.4,
                 timeline=dict(gate["timeline"], head={k: v + 3600 for k, v in gate["timeline"]["head"].items()}))  # fmt: skip
    assert metrics.build("engine_ready", again, node="node1") == metrics.build("engine_ready", gate, node="node1")


def test_engine_ready_from_the_registered_loop_and_a_failed_gate(gate):
    failed = copy.deepcopy(gate)
    failed.update(ready=False, failed=True, failed_nodes=["node2"])
    failed["timeline"]["nodes"]["node2"]["node_ready"] = None
    other = {"ready": True, "timeline": {"t0": 1.0, "nodes": {"node9": {"unit_start": 0.0, "node_ready": 1.0}}}}
    out = parse(metrics.build("engine_ready", {"results": [other, failed]}, node="node2"))
    assert value(out, "llmfleet_engine_gate_ok") == 0 and value(out, "llmfleet_engine_node_ready") == 0
    assert value(out, "llmfleet_engine_node_failed") == 1
    for absent in ("llmfleet_engine_ready_timestamp_seconds", "llmfleet_engine_deployment_cold_start_seconds"):
        assert absent not in out
    with pytest.raises(ValueError, match=r"node 'node7' is not in the gate's timeline \(nodes: node1, node2, node9\)"):
        metrics.build("engine_ready", {"results": [other, failed]}, node="node7")


# ---- engine terminations (records the wrapper wrote) ---------------------------------------------------------------

RECORDS = sorted((FIX / "bundles").glob("*/*/termination-*.json*"))


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: "/".join(p.parts[-3:-1]))
def test_real_termination_records(path):
    rec = load(path)
    out = parse(metrics.render(metrics.engine_termination_families(rec, node="n")))
    lab = {"unit": rec["unit"], "node": "n", "deployment": rec["unit"][len("llmfleet-") : -len(".service")]}
    assert value(out, "llmfleet_engine_last_termination_info", verdict=rec["verdict"], **lab) == 1
    assert value(out, "llmfleet_engine_last_exit_code", **lab) == rec["exit_code"]
    assert value(out, "llmfleet_engine_last_signal", **lab) == (rec["child"]["signal"] or 0)
    assert value(out, "llmfleet_engine_last_termination_timestamp_seconds", **lab) == rec["ended_at"]
    assert value(out, "llmfleet_engine_terminations_total", verdict=rec["verdict"], **lab) == 1
    assert sum(v for _, v in out["llmfleet_engine_terminations_total"]) == 1
    assert len(out["llmfleet_engine_terminations_total"]) == len(metrics.VERDICTS)  # every verdict starts at 0
    if rec["failed_rank"]:
        ((labels, _),) = out["llmfleet_engine_last_failed_rank_info"]
        assert labels["tp"] == ("" if rec["failed_rank"]["tp"] is None else str(rec["failed_rank"]["tp"]))


def test_counters_persist_across_wrapper_records_in_the_file(tmp_path):
    crash = load(FIX / "bundles/xid79/gpu-c01/termination-llmfleet-glm.service.json.1")  # unrequested-exit-0
    after = load(FIX / "bundles/xid79/gpu-c01/termination-llmfleet-glm.service.json")  # exit-code
    d = str(tmp_path)
    for rec in (crash, after, crash):
        path = metrics.write_engine_metrics(d, rec, node="gpu-c01")
    assert os.path.basename(path) == "llmfleet_engine_glm.prom"
    out = parse(Path(path).read_text())
    assert value(out, "llmfleet_engine_terminations_total", verdict="unrequested-exit-0") == 2
    assert value(out, "llmfleet_engine_terminations_total", verdict="exit-code") == 1
    assert value(out, "llmfleet_engine_last_termination_info", verdict="unrequested-exit-0") == 1
    assert value(out, "llmfleet_engine_last_failed_rank_info", tp=4, pp="", rank="") == 1
    # A damaged file only restarts the counters (a reset for rate()/increase()).
    Path(path).write_text("not prometheus {{{\n")
    metrics.write_engine_metrics(d, after, node="gpu-c01")
    assert value(parse(Path(path).read_text()), "llmfleet_engine_terminations_total", verdict="exit-code") == 1
    assert sorted(os.listdir(d)) == ["llmfleet_engine_glm.prom"]


@pytest.mark.parametrize(
    ("unit", "deployment", "name"),
    [
        ("llmfleet-demo.service", "", "llmfleet_engine_demo.prom"),
        ("llmfleet-demo-router.service", "demo", "llmfleet_engine_demo-router.prom"),
        ("vllm@a:b.service", "", "llmfleet_engine_vllm_a_b.prom"),
        (None, "demo", "llmfleet_engine_demo.prom"),
    ],
)
def test_engine_file_names(unit, deployment, name):
    assert metrics.engine_textfile_name(unit, deployment) == name
    metrics.check_file_name(name)


def test_engine_file_name_needs_a_unit_or_a_deployment():
    with pytest.raises(ValueError, match="not in a systemd service and no --deployment"):
        metrics.engine_textfile_name(None, "")


def test_verdicts_are_those_of_the_wrapper_doc():
    doc = (ROOT / "docs" / "wrapper.md").read_text()
    table = doc[doc.index("## Exit codes") : doc.index("## sd_notify")]
    documented = {
        m for row in table.splitlines() if row.startswith("|") for m in re.findall(r"`([a-z0-9-]+)`", row.split("|")[3])
    }
    assert documented == set(metrics.VERDICTS)


# ---- acceptance and bench --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [FIX / "metrics" / "acceptance-demo.json", *sorted((FIX / "accept").glob("*.accept.json"))],
    ids=lambda p: p.name,
)
def test_real_acceptance_reports(path):
    rep = load(path)
    out = parse(metrics.build("acceptance", rep, labels={"deployment": "demo"}, node="node1"))
    assert value(out, "llmfleet_acceptance_ok") == (1 if rep["accepted"] else 0)
    states = out["llmfleet_acceptance_check_state"]
    assert len(states) == len(rep["checks"]) * len(metrics.ACCEPT_VERDICTS)
    for c in rep["checks"]:
        assert value(out, "llmfleet_acceptance_check_state", check=c["name"], verdict=c["verdict"]) == 1
        assert sum(v for lab, v in states if lab["check"] == c["name"]) == 1  # one state per check
        assert value(out, "llmfleet_acceptance_check_seconds", check=c["name"]) == c["seconds"]
    assert value(out, "llmfleet_acceptance_seconds") == rep["elapsed_s"]


def test_acceptance_timestamp_and_bad_record():
    rep = load(FIX / "metrics" / "acceptance-demo.json")  # started_at 2026-12-01T01:09:49Z
    assert value(parse(metrics.build("acceptance", rep)), "llmfleet_acceptance_timestamp_seconds") == 1796087389
    with pytest.raises(ValueError, match="not an acceptance report"):
        metrics.build("acceptance", {"checks": "x"})


def test_real_bench_results():
    res = load(FIX / "metrics" / "bench-vllm-cpu-0.32.0.results.json")  # vLLM 0.32 CPU, its own bench tool
    out = parse(metrics.build("bench", res, labels={"deployment": "demo"}, node="node1"))
    assert value(out, "llmfleet_bench_ok") == 1
    for c in res["cases"]:
        lab = {"input_len": c["input_len"], "output_len": c["output_len"], "concurrency": c["concurrency"]}
        s = c["summary"]
        assert value(out, "llmfleet_bench_case_status", status="OK", **lab) == 1
        assert value(out, "llmfleet_bench_output_tokens_per_second", **lab) == s["output_tok_s"]["median"]
        assert value(out, "llmfleet_bench_ttft_seconds", percentile="99", **lab) == pytest.approx(
            s["ttft_ms_p99"]["median"] / 1000
        )
        assert value(out, "llmfleet_bench_tpot_seconds", percentile="50", **lab) == pytest.approx(
            s["tpot_ms_p50"]["median"] / 1000
        )
        assert value(out, "llmfleet_bench_gpu_seconds_per_output_token", **lab) == pytest.approx(
            s["gpu_h_per_mtok"]["median"] * 3600 / 1e6
        )
    assert len(out["llmfleet_bench_case_status"]) == len(res["cases"]) * len(metrics.BENCH_STATUSES)


def test_bench_not_executed_case_has_a_status_and_no_latency():
    res = load(FIX / "metrics" / "bench-vllm-cpu-0.32.0.results.json")
    res["cases"][0].update(status="NOT_EXECUTED", summary={}, success_rate=None)
    res["ok"] = False
    out = parse(metrics.build("bench", res))
    lab = {k: res["cases"][0][k] for k in ("input_len", "output_len", "concurrency")}
    assert value(out, "llmfleet_bench_case_status", status="NOT_EXECUTED", **lab) == 1
    assert not [x for lab2, x in out["llmfleet_bench_ttft_seconds"] if lab2["input_len"] == str(lab["input_len"])
                and lab2["concurrency"] == str(lab["concurrency"]) and lab2["output_len"] == str(lab["output_len"])]  # fmt: skip
    assert value(out, "llmfleet_bench_ok") == 0


def test_state_sets_cover_the_producers_states():
    assert metrics.ACCEPT_VERDICTS == accept_checks.VERDICTS
    assert set(metrics.BENCH_STATUSES) == {servebench.OK, servebench.FAILED, servebench.NOT_EXECUTED}


def test_unknown_source():
    with pytest.raises(ValueError, match="source 'foo' is not one of stage, nccl_check"):
        metrics.build("foo", {})


# ---- textfile(): what the module does ------------------------------------------------------------------------------


def test_textfile_create_makes_only_the_directory(tmp_path, stage_report):
    rec = stage_report["nodes"]["node1"]
    with pytest.raises(ValueError, match="its parent does not exist either"):
        metrics.textfile(str(tmp_path / "a" / "b"), "llmfleet_stage_m.prom", "stage", rec, create=True)
    res = metrics.textfile(str(tmp_path / "a"), "llmfleet_stage_m.prom", "stage", rec, create=True)
    assert res["created"] and res["changed"] and stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o755
    assert res["series"] == 8 and res["families"][0] == "llmfleet_stage_ok"


# ---- docs/metrics.md -------------------------------------------------------------------------------------------------

DOC = (ROOT / "docs" / "metrics.md").read_text()


def test_the_doc_lists_every_metric_and_no_other():
    rows = set(re.findall(r"^\| `(llmfleet_[a-z0-9_]+)` \| (gauge|counter) \|", DOC, re.M))
    assert rows == {(n, kind) for n, (kind, _) in metrics.SPECS.items()}
