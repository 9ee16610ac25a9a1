#!/usr/bin/env python3
"""Build contrib/grafana/llmfleet.json, the llmfleet Grafana dashboard, from code.

    python3 contrib/grafana/build_dashboard.py            # rewrite llmfleet.json
    python3 contrib/grafana/build_dashboard.py --check    # exit 1 when llmfleet.json is not what this writes

One board for a deployment: what clients see (the engines' own /metrics: vLLM's and SGLang's histograms), the
serving health and terminations the llmfleet wrapper writes, the GPUs (NVIDIA's DCGM exporter), the fabric
(node_exporter's InfiniBand and network collectors), staging and the NCCL check, and the readiness gate,
acceptance and benchmark results (llmfleet's node_exporter text files, docs/metrics.md). The targets come from the
report role's file_sd files, which label every target with `deployment` and `node` (the inventory name): the
board's variables filter on those.

Plain Python writing Grafana's dashboard JSON model (schemaVersion 39): grafana-foundation-sdk on PyPI is an alpha
whose published builders are those of Grafana 10.1. tests/unit/test_grafana_dashboard.py checks the model's
required fields, that every metric name is one the exporters really write, and (through promtool) that every
expression parses; it fails when llmfleet.json is stale.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "llmfleet.json"
UID = "llmfleet"
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
# Textfile, DCGM and node_exporter series carry the file_sd target labels; the engine's have `deployment`.
SEL = 'deployment=~"$deployment",node=~"$node"'
ENG = 'deployment=~"$deployment",model_name=~"$model"'

# Names the board reads from outside llmfleet, and where they come from (the test checks each name in use is listed
# here or, for vLLM, in the capture of its /metrics).
SGLANG_METRICS = {
    # sgl-project/sglang python/sglang/srt/metrics/collector.py (SchedulerMetricsCollector, TokenizerMetricsCollector)
    "sglang:time_to_first_token_seconds_bucket", "sglang:inter_token_latency_seconds_bucket",
    "sglang:e2e_request_latency_seconds_bucket", "sglang:num_running_reqs", "sglang:num_queue_reqs",
    "sglang:token_usage", "sglang:generation_tokens_total", "sglang:prompt_tokens_total",
}  # fmt: skip
DCGM_METRICS = {
    # NVIDIA dcgm-exporter's default counters (etc/default-counters.csv): %, MiB, W, degrees C
    "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_XID_ERRORS",
}  # fmt: skip
NODE_METRICS = {
    # prometheus/node_exporter collector/infiniband_linux.go and netdev (Linux)
    "node_infiniband_port_data_received_bytes_total", "node_infiniband_port_data_transmitted_bytes_total",
    "node_infiniband_port_errors_received_total", "node_infiniband_state_id", "node_infiniband_rate_bytes_per_second",
    "node_network_receive_bytes_total", "node_network_transmit_bytes_total", "node_textfile_scrape_error", "up",
}  # fmt: skip


class Board:
    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.y = 0
        self.x = 0
        self.row_h = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"type": "row", "title": title, "collapsed": False, "panels": [],
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}})  # fmt: skip
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_h
        self.x, self.row_h = 0, 0

    def panel(self, kind: str, title: str, description: str, targets: list[tuple[str, str]], *, unit: str = "",
              w: int = 8, h: int = 8, instant: bool = False, extra: dict | None = None) -> None:  # fmt: skip
        if self.x + w > 24:
            self._newline()
        defaults: dict = {"unit": unit} if unit else {}
        if kind == "stat":
            defaults["mappings"] = []
        panel = {
            "type": kind,
            "title": title,
            "description": description,
            "datasource": DS,
            "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {},
            "targets": [
                {
                    "refId": chr(ord("A") + i),
                    "datasource": DS,
                    "expr": expr,
                    "legendFormat": legend,
                    "range": not instant,
                    "instant": instant,
                    **({"format": "table"} if kind == "table" else {}),
                }
                for i, (expr, legend) in enumerate(targets)
            ],
        }
        if extra:
            panel.update(extra)
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


def quantiles(metric_by_engine: dict[str, str]) -> list[tuple[str, str]]:
    out = []
    for q in ("0.5", "0.99"):
        for engine, metric in metric_by_engine.items():
            expr = f"histogram_quantile({q}, sum by (le, model_name) (rate({metric}{{{ENG}}}[{RATE}])))"
            out.append((expr, f"{engine} p{int(float(q) * 100)} {{{{model_name}}}}"))
    return out


def build() -> dict:
    b = Board()

    b.row("Clients: the engines' own /metrics (vLLM, SGLang)")
    b.panel("timeseries", "Time to first token", "p50 and p99 over the rate window, per served model.",
            quantiles({"vllm": "vllm:time_to_first_token_seconds_bucket",
                       "sglang": "sglang:time_to_first_token_seconds_bucket"}), unit="s")  # fmt: skip
    b.panel("timeseries", "Time per output token",
            "vLLM: each request's mean time per output token; SGLang: the inter-token latency.",
            quantiles({"vllm": "vllm:request_time_per_output_token_seconds_bucket",
                       "sglang": "sglang:inter_token_latency_seconds_bucket"}), unit="s")  # fmt: skip
    b.panel("timeseries", "End-to-end request latency", "p50 and p99, per served model.",
            quantiles({"vllm": "vllm:e2e_request_latency_seconds_bucket",
                       "sglang": "sglang:e2e_request_latency_seconds_bucket"}), unit="s")  # fmt: skip
    b.panel("timeseries", "Requests running and waiting", "The engine's scheduler queues.", [
        (f"sum by (model_name) (vllm:num_requests_running{{{ENG}}})", "vllm running {{model_name}}"),
        (f"sum by (model_name) (vllm:num_requests_waiting{{{ENG}}})", "vllm waiting {{model_name}}"),
        (f"sum by (model_name) (sglang:num_running_reqs{{{ENG}}})", "sglang running {{model_name}}"),
        (f"sum by (model_name) (sglang:num_queue_reqs{{{ENG}}})", "sglang waiting {{model_name}}"),
    ])  # fmt: skip
    b.panel("timeseries", "Tokens per second", "Prompt and generated tokens the engine processed.", [
        (f"sum by (model_name) (rate(vllm:prompt_tokens_total{{{ENG}}}[{RATE}]))", "vllm prompt {{model_name}}"),
        (f"sum by (model_name) (rate(vllm:generation_tokens_total{{{ENG}}}[{RATE}]))", "vllm output {{model_name}}"),
        (f"sum by (model_name) (rate(sglang:prompt_tokens_total{{{ENG}}}[{RATE}]))", "sglang prompt {{model_name}}"),
        (f"sum by (model_name) (rate(sglang:generation_tokens_total{{{ENG}}}[{RATE}]))",
         "sglang output {{model_name}}"),
    ], unit="short")  # fmt: skip
    b.panel("timeseries", "KV cache in use", "vLLM: KV cache usage; SGLang: token usage of the KV pool.", [
        (f"max by (model_name) (vllm:kv_cache_usage_perc{{{ENG}}})", "vllm {{model_name}}"),
        (f"max by (model_name) (sglang:token_usage{{{ENG}}})", "sglang {{model_name}}"),
    ], unit="percentunit")  # fmt: skip

    b.row("Serving health and terminations (the llmfleet wrapper)")
    b.panel("stat", "Health probes failed in a row", "0 after a good probe; at engine_health_failures the wrapper "
            "stops the engine (exit 69, unhealthy-while-serving).",
            [(f"llmfleet_engine_health_failures{{{SEL}}}", "{{node}} {{unit}}")], w=6, instant=True)  # fmt: skip
    b.panel("timeseries", "Since the last good health probe", "Seconds since the engine last answered the "
            "readiness gate's question correctly (LlmfleetEngineUnhealthy at 600).",
            [(f"time() - llmfleet_engine_health_last_good_timestamp_seconds{{{SEL}}}", "{{node}} {{unit}}")],
            unit="s", w=6)  # fmt: skip
    b.panel("timeseries", "Health probe latency", "How long the last good probe's whole answer took.",
            [(f"llmfleet_engine_health_last_good_latency_seconds{{{SEL}}}", "{{node}} {{unit}}")], unit="s",
            w=6)  # fmt: skip
    b.panel("timeseries", "Engine terminations", "Runs ended in the last hour, by the wrapper's verdict.",
            [(f"sum by (node, unit, verdict) (increase(llmfleet_engine_terminations_total{{{SEL}}}[1h])) > 0",
              "{{node}} {{unit}} {{verdict}}")], w=6)  # fmt: skip
    b.panel("table", "Last termination", "The verdict, exit code and signal of each unit's last run.", [
        (f"llmfleet_engine_last_termination_info{{{SEL}}}", ""),
        (f"llmfleet_engine_last_exit_code{{{SEL}}}", ""),
        (f"llmfleet_engine_last_signal{{{SEL}}}", ""),
    ], w=12, h=6, instant=True)  # fmt: skip
    b.panel("timeseries", "Waiting at the deployment link", "Seconds a node has waited for the node `missing` before "
            "any engine starts again (LlmfleetLinkPeerMissing at 300).",
            [(f'llmfleet_engine_link_missing_seconds{{{SEL},missing!=""}}', "{{node}} waits for {{missing}}")],
            unit="s", w=12, h=6)  # fmt: skip

    b.row("GPUs (DCGM exporter)")
    b.panel("timeseries", "GPU utilisation", "DCGM_FI_DEV_GPU_UTIL per GPU.",
            [(f"DCGM_FI_DEV_GPU_UTIL{{{SEL}}}", "{{node}} GPU {{gpu}}")], unit="percent", w=6)  # fmt: skip
    b.panel("timeseries", "GPU memory used", "Framebuffer used (DCGM reports MiB).",
            [(f"DCGM_FI_DEV_FB_USED{{{SEL}}} * 1048576", "{{node}} GPU {{gpu}}")], unit="bytes", w=6)  # fmt: skip
    b.panel("timeseries", "GPU memory used, share", "Framebuffer used / (used + free).",
            [(f"DCGM_FI_DEV_FB_USED{{{SEL}}} / (DCGM_FI_DEV_FB_USED{{{SEL}}} + DCGM_FI_DEV_FB_FREE{{{SEL}}})",
              "{{node}} GPU {{gpu}}")], unit="percentunit", w=6)  # fmt: skip
    b.panel("timeseries", "GPU power", "DCGM_FI_DEV_POWER_USAGE per GPU.",
            [(f"DCGM_FI_DEV_POWER_USAGE{{{SEL}}}", "{{node}} GPU {{gpu}}")], unit="watt", w=6)  # fmt: skip
    b.panel("timeseries", "GPU temperature", "DCGM_FI_DEV_GPU_TEMP per GPU.",
            [(f"DCGM_FI_DEV_GPU_TEMP{{{SEL}}}", "{{node}} GPU {{gpu}}")], unit="celsius", w=12)  # fmt: skip
    b.panel("timeseries", "GPU XID errors", "The last XID error each GPU reported (0: none).",
            [(f"DCGM_FI_DEV_XID_ERRORS{{{SEL}}}", "{{node}} GPU {{gpu}}")], w=12)  # fmt: skip

    b.row("Fabric (node_exporter: InfiniBand and network)")
    b.panel("timeseries", "RDMA bytes", "InfiniBand/RoCE port data per HCA port: received up, transmitted down.", [
        (f"rate(node_infiniband_port_data_received_bytes_total{{{SEL}}}[{RATE}])", "{{node}} {{device}}/{{port}} rx"),
        (f"-rate(node_infiniband_port_data_transmitted_bytes_total{{{SEL}}}[{RATE}])",
         "{{node}} {{device}}/{{port}} tx"),
    ], unit="Bps")  # fmt: skip
    b.panel("timeseries", "RDMA port errors", "Received packets with errors per HCA port.",
            [(f"rate(node_infiniband_port_errors_received_total{{{SEL}}}[{RATE}])", "{{node}} {{device}}/{{port}}")],
            unit="pps")  # fmt: skip
    b.panel("table", "HCA ports", "Link state (4: active) and rate of each port.", [
        (f"node_infiniband_state_id{{{SEL}}}", ""),
        (f"node_infiniband_rate_bytes_per_second{{{SEL}}}", ""),
    ], instant=True)  # fmt: skip
    b.panel("timeseries", "Network bytes", "Every interface but loopback: received up, transmitted down.", [
        (f'rate(node_network_receive_bytes_total{{{SEL},device!="lo"}}[{RATE}])', "{{node}} {{device}} rx"),
        (f'-rate(node_network_transmit_bytes_total{{{SEL},device!="lo"}}[{RATE}])', "{{node}} {{device}} tx"),
    ], unit="Bps", w=24)  # fmt: skip

    b.row("Staging and the NCCL check (llmfleet)")
    b.panel("stat", "Staged and verified", "llmfleet_stage_ok per node and revision (1: published and verified).",
            [(f"llmfleet_stage_ok{{{SEL}}}", "{{node}} {{model}}")], w=6, instant=True)  # fmt: skip
    b.panel("stat", "Since the last staging run", "The last run that copied files (a rerun that found the revision "
            "published keeps its time).",
            [(f"time() - llmfleet_stage_timestamp_seconds{{{SEL}}}", "{{node}} {{model}}")], unit="s", w=6,
            instant=True)  # fmt: skip
    b.panel("table", "Staging cost", "Bytes copied, read from shared storage and peers, served, and seconds.", [
        (f"llmfleet_stage_copied_bytes{{{SEL}}}", ""),
        (f"llmfleet_stage_read_bytes{{{SEL}}}", ""),
        (f"llmfleet_stage_served_bytes{{{SEL}}}", ""),
        (f"llmfleet_stage_seconds{{{SEL}}}", ""),
    ], w=12, instant=True)  # fmt: skip
    b.panel("bargauge", "all_reduce bus bandwidth", "The slowest local rank per node, next to its GPU model's floor.", [
        (f'min by (node, phase) (llmfleet_collective_busbw_bytes_per_second{{{SEL},op="all_reduce"}})',
         "{{node}} {{phase}}"),
        (f"llmfleet_collective_floor_bytes_per_second{{{SEL}}}", "{{node}} floor"),
    ], unit="Bps", w=12, instant=True)  # fmt: skip
    b.panel("stat", "NCCL check", "The whole check (ok), this node (node_ok: neither bad nor slow).", [
        (f"llmfleet_collective_ok{{{SEL}}}", "{{node}} check"),
        (f"llmfleet_collective_node_ok{{{SEL}}}", "{{node}} node"),
    ], w=6, instant=True)  # fmt: skip
    b.panel("stat", "Since the last NCCL check", "Seconds since this node wrote the check's metrics.",
            [(f"time() - llmfleet_collective_timestamp_seconds{{{SEL}}}", "{{node}}")], unit="s", w=6,
            instant=True)  # fmt: skip

    b.row("Readiness, acceptance and the serving benchmark (llmfleet)")
    b.panel("stat", "Gate, acceptance, benchmark", "1: the readiness gate, acceptance and the benchmark passed.", [
        (f"max by (deployment) (llmfleet_engine_gate_ok{{{SEL}}})", "gate"),
        (f"max by (deployment) (llmfleet_acceptance_ok{{{SEL}}})", "acceptance"),
        (f"max by (deployment) (llmfleet_bench_ok{{{SEL}}})", "bench"),
    ], w=6, instant=True)  # fmt: skip
    b.panel("stat", "Cold start", "From the deployment's first unit start to its last node READY.",
            [(f"max by (deployment) (llmfleet_engine_deployment_cold_start_seconds{{{SEL}}})", "{{deployment}}")],
            unit="s", w=6, instant=True)  # fmt: skip
    b.panel("table", "Benchmark latency (p99)", "Per case: time to first token and per output token, p99 (the "
            "median over rounds).", [
        (f'llmfleet_bench_ttft_seconds{{{SEL},percentile="99"}}', ""),
        (f'llmfleet_bench_tpot_seconds{{{SEL},percentile="99"}}', ""),
    ], w=6, instant=True)  # fmt: skip
    b.panel("table", "Benchmark throughput", "Output tokens per second per case (the median over rounds).",
            [(f"llmfleet_bench_output_tokens_per_second{{{SEL}}}", "")], w=6, instant=True)  # fmt: skip

    for i, p in enumerate(b.panels, 1):
        p["id"] = i
    return {
        "__inputs": [
            {
                "name": "DS_PROMETHEUS",
                "label": "Prometheus",
                "type": "datasource",
                "pluginId": "prometheus",
                "pluginName": "Prometheus",
            }
        ],
        "id": None,
        "uid": UID,
        "title": "llmfleet",
        "description": "A deployment: clients' latency, serving health, GPUs, fabric, staging and the NCCL check "
        "(built by contrib/grafana/build_dashboard.py).",
        "tags": ["llmfleet", "vllm", "sglang", "dcgm", "infiniband"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "refresh": "1m",
        "schemaVersion": 39,
        "version": 1,
        "links": [],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                    "options": [],
                },
                variable("deployment", "label_values(up, deployment)"),
                variable("node", 'label_values(up{deployment=~"$deployment"}, node)'),
                variable(
                    "model",
                    'label_values({__name__=~"vllm:num_requests_running|sglang:num_running_reqs",'
                    'deployment=~"$deployment"}, model_name)',
                ),
            ]
        },
        "panels": b.panels,
    }


def variable(name: str, query: str) -> dict:
    return {"name": name, "label": name, "type": "query", "datasource": DS, "query": {"query": query, "refId": name},
            "definition": query, "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*", "current": {},
            "options": [], "sort": 1, "hide": 0}  # fmt: skip


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when llmfleet.json differs from what this builds")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python3 {Path(__file__).relative_to(HERE.parents[1])}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
