"""The deployment report (llmfleet.report.build): collected from the record sets of tests/fixtures/reports (real lab
records and records shaped by the package's own code), rendered, published atomically; every section present,
each missing, a bad record, a record from another run, a failed engine at the top, escaping, no external
reference, the markdown twin's numbers, the CLI."""

import argparse
import datetime as dt
import json
import os
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from llmfleet.checks import nccl_verdict
from llmfleet.engine import gate
from llmfleet.report import build as report
from llmfleet.report import cli as report_cli
from llmfleet.report import sections as rs
from llmfleet.report import svg as report_svg

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests/fixtures/reports"
# The real lab records have no generated_at: their file time is the run's (before the engine's gate).
RUN_TIME = dt.datetime(2026, 12, 1, 1, 5, tzinfo=dt.UTC).timestamp()
NOW = dt.datetime(2026, 12, 1, 9, 15, 0, tzinfo=dt.UTC)


def records(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    shutil.copytree(FIX / name, d, ignore=shutil.ignore_patterns("*.py", "*.md"))
    for p in d.rglob("*"):
        os.utime(p, (RUN_TIME, RUN_TIME))
    return d


def by_id(model: dict) -> dict:
    return {s["id"]: s for s in model["sections"]}


def edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    os.utime(path, (RUN_TIME, RUN_TIME))


class Tags(HTMLParser):
    """Every start tag with its attributes, and the text of <style> blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.style = ""
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self.style += data


def tags(html: str) -> Tags:
    t = Tags()
    t.feed(html)
    return t


# ---- every section present ----------------------------------------------------------------------------------


FULL = {
    "inventory": "warn",  # the open-API warning the engine role kept for the fleet summary
    "preflight": "warn",  # the lab has no GPUs: warnings, not failures
    "topology": "warn",  # NCCL_IB_DISABLE=1 on sockets
    "staging": "pass",
    "nccl": "pass",
    "engine": "pass",
    "timeline": "pass",
    "speculative": "pass",  # off: engine_speculative not set in that run
    "acceptance": "pass",
    "bench": "pass",
    "metrics": "pass",
}


def test_lab_run_every_section_present_and_passing(tmp_path):
    m = report.collect(records(tmp_path, "lab-vllm"), "demo", now=NOW)
    s = by_id(m)
    assert m["status"] == "pass" and m["failure"] is None and m["problems"] == []
    assert {k: v["status"] for k, v in s.items()} == FULL
    assert s["inventory"]["deployment"]["revision"] == "7037037037037037037037037037037037037037"
    assert [n["node"] for n in s["staging"]["nodes"]] == ["node1", "node2"]
    assert s["staging"]["source_ratio"] == 1.0 and not s["staging"]["seconds_recorded"]  # the real record has none
    assert s["timeline"]["gates"][0]["first_correct_answer"] == 32.2
    assert s["timeline"]["gates"][0]["rows"][0]["events"] == {
        "unit_start": 0.0, "weights_loaded": 24.81, "node_ready": 31.62, "port_open": 31.9, "models_listed": 31.98,
        "first_correct_answer": 32.2,
    }  # fmt: skip
    assert [c["id"] for c in s["bench"]["cases"]] == ["in32-out8-c1", "in32-out8-c2", "in64-out8-c1", "in64-out8-c2"]
    assert s["metrics"]["targets"][0]["url"] == "http://10.77.0.11:8000/metrics"
    assert m["verdict"].startswith("PASS: first correct answer 32.2 s after the first unit start; ACCEPTED")
    html, md = report.render(m)
    for sid in s:
        assert f'id="{sid}"' in html and f"## {s[sid]['title']}" in md
    assert "data-not-run" not in html and "NOT RUN" not in md
    # every section says when its record was written (the record's own time, else the file's)
    for sec in s.values():
        assert sec["generated_at"] and f'data-generated-at="{sec["generated_at"]}"' in html
    assert s["nccl"]["generated_at"] == "2026-12-01T01:07:58Z" and s["nccl"]["time_source"] == "generated_at"
    assert s["preflight"]["time_source"] == "file time" and "(file time)" in html
    assert s["acceptance"]["generated_at"] == "2026-12-01T01:09:49Z"  # its own started_at


def test_a_revision_already_on_every_node_is_said_so_not_read_0x():
    """make demo on a lab whose nodes kept the revision: nothing copied anywhere. "shared storage read 0.00x" read
    like a fault; the summary says why nothing was read."""
    node = {"total_bytes": 8 << 20, "bytes_copied": 0, "source_bytes_read": 0, "peer_bytes_read": 0}
    sec = rs.staging({"model": "demo-model", "revision": "5eed" * 10, "nodes": {"node1": node, "node2": node}})
    assert sec["status"] == "pass" and sec["source_ratio"] == 0
    assert sec["summary"].endswith("8.00 MiB each; already on every node: nothing copied, shared storage not read")
    copied = {**node, "bytes_copied": 8 << 20, "source_bytes_read": 8 << 20}
    sec = rs.staging({"model": "demo-model", "revision": "5eed" * 10, "nodes": {"node1": copied, "node2": node}})
    assert sec["summary"].endswith("shared storage read 1.00x the revision")


def test_h20_numbers_derived_from_the_records(tmp_path):
    m = report.collect(records(tmp_path, "h20-engine-failed"), "qwen", now=NOW)
    s = by_id(m)
    b01 = s["staging"]["nodes"][0]
    assert (b01["node"], b01["seconds"], b01["source_bytes"], b01["peer_bytes"]) == ("gpu-b01", 412.6, 190834012160, 0)
    assert b01["gib_s"] == pytest.approx(190834012160 / 412.6 / 2**30)  # 0.43 GiB/s
    assert s["staging"]["nodes"][1]["peer_bytes"] == 190834012160 and s["staging"]["source_ratio"] == 1.0
    n = {x["node"]: x for x in s["nccl"]["nodes"]}
    assert (n["gpu-b01"]["busbw"], n["gpu-b01"]["floor"], n["gpu-b01"]["bytes"]) == (361.4, 300.0, 2**30)
    assert n["gpu-b01"]["ratio"] == pytest.approx(361.4 / 300) and n["gpu-b01"]["busbw_source"] == "single-node world"
    topo = {x["node"]: x for x in s["topology"]["nodes"]}
    assert topo["gpu-b01"]["gid_indexes"] == ["3"] and topo["gpu-b02"]["gid_indexes"] == ["5"]
    assert len(topo["gpu-b01"]["ports"]) == 8 and topo["gpu-b01"]["env"]["NCCL_IB_GID_INDEX"] == "3"
    assert topo["gpu-b01"]["numa"] == {"0": 96, "1": 96}
    pre = {(r["check"], c["node"]): c for r in s["preflight"]["table"] for c in r["cells"]}
    assert pre[("persistence_mode", "gpu-b02")]["status"] == "warn" and not pre[("persistence_mode", "gpu-b02")]["odd"]
    tl = s["timeline"]["gates"][0]
    assert [r["node"] for r in tl["rows"] if r["failed"]] == ["gpu-b02"] and tl["first_correct_answer"] is None
    assert s["inventory"]["deployment"]["engine_version"] == "0.32.0"


# ---- failures at the top ------------------------------------------------------------------------------------------


def test_failed_engine_puts_verdict_node_rank_and_log_tail_at_the_top(tmp_path):
    m = report.collect(records(tmp_path, "h20-engine-failed"), "qwen", now=NOW)
    f = m["failure"]
    assert m["status"] == "fail" and f["step"] == "engine"
    assert (f["node"], f["rank"]) == ("gpu-b02", "rank 11")
    assert "VllmWorker-11 died unexpectedly" in f["first_error"]
    assert f["log_tail"][-1].endswith("Consumed 4h 2min 11.314s CPU time, 61.2G memory peak, 0B memory swap peak.")
    assert m["verdict"] == (
        "FAIL at engine on gpu-b02 (rank 11): unrequested-exit-0: unit failed (Result=exit-code, main process 1/70)"
    )
    html, md = report.render(m)
    top = html.index('id="failure"')
    assert top < html.index('id="steps"') < html.index('id="inventory"')
    assert 'data-node="gpu-b02"' in html[top:] and 'data-rank="rank 11"' in html[top:]
    assert html.index("Failed with result &#39;exit-code&#39;") < html.index('id="steps"')
    assert md.index("## What failed first: Engine") < md.index("## Steps")
    assert "Failed with result 'exit-code'" in md[: md.index("## Steps")]
    lines = report.summary_lines(m)
    assert lines[0].startswith("deployment qwen: FAIL at engine on gpu-b02 (rank 11): unrequested-exit-0: unit failed")
    assert any(x.split()[:2] == ["engine/cold", "start"] and "FAIL" in x and "gpu-b02 rank 11" in x for x in lines)
    assert any(x.split()[0] == "acceptance" and "NOT RUN" in x for x in lines)


def test_failure_is_derived_from_the_gate_when_the_record_has_no_summary(tmp_path):
    d = records(tmp_path, "h20-engine-failed")
    edit(d / "engine-qwen.json", lambda e: e.update(failure=None))
    f = report.collect(d, "qwen", now=NOW)["failure"]
    assert (f["node"], f["rank"]) == ("gpu-b02", "rank 11")
    assert f["verdict"].startswith("unit failed (Result=exit-code, main process 1/70) (termination record: ")
    assert len(f["log_tail"]) == 20 and "VllmWorker-11 died" in f["first_error"]


def test_the_odd_node_is_highlighted_and_the_first_failed_step_is_the_verdict(tmp_path):
    m = report.collect(records(tmp_path, "h20-preflight-nccl-failed"), "qwen", now=NOW)
    s = by_id(m)
    assert [f["step"] for f in m["failures"]] == ["preflight", "nccl"]
    assert m["failure"]["node"] == "gpu-b02" and "driver_version" in m["failure"]["details"][0]
    assert s["preflight"]["odd_nodes"] == [
        {"node": "gpu-b02", "why": ["driver_version: differs from the other nodes ('570.172.08')"]}
    ]
    odd = [(r["check"], c["node"]) for r in s["preflight"]["table"] for c in r["cells"] if c["odd"]]
    assert odd == [("driver_version", "gpu-b02")]
    assert s["preflight"]["table"][0]["check"] == "driver_version"  # problems first
    assert {n["node"]: bool(n["slow"]) for n in s["nccl"]["nodes"]} == {"gpu-b01": False, "gpu-b02": True}
    html, md = report.render(m)
    cells = [a for t, a in tags(html).tags if t == "td" and a.get("data-odd") == "true"]
    assert [(c["data-node"], c["data-status"]) for c in cells] == [("gpu-b02", "fail")]
    assert "**FAIL** 570.133.20" in md and "**Odd node gpu-b02**" in md
    assert "Also failed:" in html and "Also failed: Collective check." in md


# ---- missing, stale and bad records ------------------------------------------------------------------------------

MISSING = [
    ("fleet-summary.json", None),  # the inventory still has preflight's versions and the engine's model
    ("preflight.json", "preflight"),
    ("topology.json", "topology"),
    ("stage-det-model.json", "staging"),
    ("nccl-check.json", "nccl"),
    ("engine-demo.json", "engine"),
    ("acceptance-demo.json", "acceptance"),
    ("bench-demo", "bench"),
]


@pytest.mark.parametrize(("name", "sid"), MISSING, ids=[m[0] for m in MISSING])
def test_each_missing_record_is_a_section_not_run(tmp_path, name, sid):
    d = records(tmp_path, "lab-vllm")
    shutil.rmtree(d / name) if (d / name).is_dir() else (d / name).unlink()
    m = report.collect(d, "demo", now=NOW)
    s = by_id(m)
    html, md = report.render(m)
    if sid:
        assert s[sid]["status"] == "not-run" and name.split("-")[0] in s[sid]["reason"]
        block = html[html.index(f'<section id="{sid}"') :]
        assert "Not run in this report: no " in block[: block.index("</section>")]
        assert f"## {s[sid]['title']}: NOT RUN" in md
    # The timeline and speculative-decoding sections read the engine record too.
    affected = {sid or "inventory", *(("timeline", "speculative") if sid == "engine" else (sid,))}
    assert {k: v["status"] for k, v in s.items() if k not in affected} == {
        k: v for k, v in FULL.items() if k not in affected
    }
    if not sid:  # the inventory without the fleet summary: preflight's versions, the engine's model
        assert s["inventory"]["nodes"][0]["node"] == "node1" and s["inventory"]["deployment"]["model"] == "det-model"
    assert m["status"] == ("incomplete" if sid in ("engine", "acceptance") else "pass")


def test_an_empty_directory_is_a_report_of_nothing_run(tmp_path):
    m = report.collect(tmp_path, "demo", now=NOW)
    assert {s["status"] for s in m["sections"]} == {"not-run"} and m["status"] == "incomplete"
    html, md = report.render(m)
    assert html.count('data-not-run="true"') == len(m["sections"]) and md.count("Not run in this report") == 11
    assert all("NOT RUN" in x for x in report.summary_lines(m)[1:])


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"rows": [', "is not valid JSON (Expecting value: line 1 column 11 (char 10))"),
        ("[1, 2]", "holds a JSON list, not the object this report reads"),
        (b"\xff\xfe{}", "cannot be read (UnicodeDecodeError"),
    ],
)
def test_a_bad_record_is_named_not_a_traceback(tmp_path, text, error):
    d = records(tmp_path, "lab-vllm")
    p = d / "preflight.json"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    m = report.collect(d, "demo", now=NOW)
    pre = by_id(m)["preflight"]
    assert pre["status"] == "error" and pre["summary"].startswith("preflight.json " + error)
    assert m["problems"] == [{"file": "preflight.json", "error": pre["summary"][len("preflight.json ") :]}]
    assert m["status"] == "incomplete" and "unreadable record for preflight" in m["verdict"]
    html, md = report.render(m)
    assert 'id="problems"' in html and "preflight.json" in html[html.index('id="problems"') :][:500]
    assert "## Unreadable records" in md
    assert by_id(m)["inventory"]["status"] == "warn"  # the other sections are still there
    assert any("record problem: preflight.json" in x for x in report.summary_lines(m))


def test_a_record_of_an_unexpected_shape_is_a_section_error(tmp_path):
    d = records(tmp_path, "lab-vllm")
    edit(d / "nccl-check.json", lambda v: v.update(pairs=[{"pair": "node1"}], ranks=7))
    edit(d / "acceptance-demo.json", lambda a: a.pop("checks"))
    s = by_id(report.collect(d, "demo", now=NOW))
    assert s["nccl"]["status"] == "pass"  # odd values it can skip are skipped
    assert s["acceptance"]["status"] == "error"
    assert s["acceptance"]["summary"] == (
        "acceptance-demo.json: unexpected content (KeyError: 'checks'); docs/report.md gives the shape this version reads"
    )


def test_records_of_another_run_are_not_reported_as_this_one(tmp_path):
    d = records(tmp_path, "lab-vllm")
    # acceptance ran before this engine gate (an earlier start), preflight two days earlier
    edit(d / "acceptance-demo.json", lambda a: a.update(started_at="2026-12-01T00:59:00Z"))
    old = dt.datetime(2026, 11, 29, 1, 0, tzinfo=dt.UTC).timestamp()
    os.utime(d / "preflight.json", (old, old))
    s = by_id(report.collect(d, "demo", now=NOW))
    assert s["acceptance"]["status"] == "not-run"
    assert s["acceptance"]["reason"] == (
        "acceptance-demo.json is from 2026-12-01T00:59:00Z (started_at), before this deployment's engine gate "
        "(2026-12-01T01:09:30Z): it tested an earlier start"
    )
    assert (
        s["preflight"]["status"] == "not-run"
        and "48 h before this deployment's engine gate" in s["preflight"]["reason"]
    )
    assert s["inventory"]["nodes"][0]["driver"] is None  # the stale preflight's values are not borrowed either
    assert report.collect(d, "demo", now=NOW, max_age_s=72 * 3600)["sections"][1]["status"] == "warn"


def test_acceptance_and_bench_of_another_endpoint_are_another_run(tmp_path):
    d = records(tmp_path, "lab-vllm")
    edit(d / "endpoint-demo.json", lambda e: e.update(url="http://10.77.0.11:30000", model="demo-model"))
    s = by_id(report.collect(d, "demo", now=NOW))
    assert s["acceptance"]["reason"] == (
        "acceptance-demo.json tested http://10.77.0.11:8000, this deployment's endpoint is http://10.77.0.11:30000: "
        "another deployment's run"
    )
    assert s["bench"]["reason"].startswith("bench-demo/results.json measured model det-model, this deployment serves ")


def test_a_fleet_record_newer_than_the_engine_record_is_said(tmp_path):
    d = records(tmp_path, "lab-vllm")
    edit(d / "nccl-check.json", lambda v: v.update(generated_at="2026-12-01T02:00:00Z"))
    s = by_id(report.collect(d, "demo", now=NOW))
    assert s["engine"]["warnings"] == [
        "nccl-check.json is newer than this engine record: the engine was not started after it"
    ]


# ---- what the page may hold -----------------------------------------------------------------------------------------

URL_ATTRS = {"src", "href", "xlink:href", "action", "data", "poster", "srcset", "formaction", "background"}


@pytest.mark.parametrize(("name", "dep"), [("lab-vllm", "demo"), ("h20-engine-failed", "qwen"),
                                          ("lab-replicas-rollback", "demo")])  # fmt: skip
def test_the_page_references_nothing_outside_itself(tmp_path, name, dep):
    html, _ = report.render(report.collect(records(tmp_path, name), dep, now=NOW))
    t = tags(html)
    assert {tag for tag, _ in t.tags} & {"script", "link", "img", "iframe", "object", "embed", "base", "meta"} <= {
        "meta"
    }
    refs = [(tag, k, v) for tag, a in t.tags for k, v in a.items() if k in URL_ATTRS]
    assert refs and all(v.startswith("#") for _, _, v in refs), refs  # only links to its own sections
    assert not any(k.startswith("on") for _, a in t.tags for k in a)
    assert "url(" not in t.style and "@import" not in t.style and t.style.strip()
    if name == "lab-vllm":  # record text (the endpoint's URL) is shown as text, never loaded
        assert "<code>http://10.77.0.11:8000/metrics</code>" in html


def test_record_text_is_escaped_in_the_page_and_the_markdown(tmp_path):
    d = records(tmp_path, "h20-engine-failed")
    evil = '<script>alert("x")</script><img src=x onerror=alert(1)>'

    def inject(e):
        e["failure"]["log_tail"].append(f"engine said {evil}")
        e["failure"]["first_error"] = f"first {evil} | pipe"
        tl = e["gates"][0]["timeline"]["nodes"]
        tl["<b>gpu-b03</b>"] = dict(tl["gpu-b02"], rank=2)

    edit(d / "engine-qwen.json", inject)
    html, md = report.render(report.collect(d, "qwen", now=NOW))
    t = tags(html)
    assert not any(tag in ("script", "img", "b") for tag, _ in t.tags)  # in the SVG too
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in html and "&lt;b&gt;gpu-b03&lt;/b&gt;" in html
    assert "<script" not in html.lower() and "onerror=alert" not in html.replace("onerror=alert(1)&gt;", "")
    top = md[: md.index("## Steps")]
    assert (
        '- first error: first &lt;script&gt;alert("x")&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt; \\| pipe' in top
    )
    fence = re.search(r"\n(`{3,})\n(.*?)\n\1\n", top, re.S)
    assert fence and f"engine said {evil}" in fence.group(2)  # a log line inside a code block stays literal


def test_a_log_line_cannot_close_the_markdown_fence():
    assert report._fence(["a ```` b", "c"]) == "`````\na ```` b\nc\n`````"
    assert report._md("a|b\n<c>") == "a\\|b &lt;c&gt;"


@pytest.mark.parametrize(("name", "dep"), [("lab-vllm", "demo"), ("h20-engine-failed", "qwen")])
def test_the_markdown_twin_holds_the_same_numbers(tmp_path, name, dep):
    m = report.collect(records(tmp_path, name), dep, now=NOW)
    s = by_id(m)
    html, md = report.render(m)
    nums = [report._fmt(n["seconds"], 1) for n in s["staging"]["nodes"]]
    nums += [report._fmt(n["gib_s"], 2) for n in s["staging"]["nodes"]]
    nums += [rs.size_text(n["bytes_copied"]) for n in s["staging"]["nodes"]]
    nums += [report._fmt(n["busbw"], 1, "GB/s") for n in s["nccl"]["nodes"]]
    nums += [f"{v:.2f}" for g in s["timeline"]["gates"] for r in g["rows"] for v in r["events"].values()]
    nums += [report._fmt(c["out_tok_s"]["median"], 1) for c in s["bench"].get("cases", [])]
    nums += [report._fmt(c["gpu_h_per_mtok"], 2) for c in s["bench"].get("cases", [])]
    nums += [c["verdict"] for c in s["acceptance"].get("checks", [])]
    assert len(nums) > 10
    for n in nums:
        assert n in html and n in md, n
    assert [x for x in re.findall(r"\d+\.\d\d", md) if x not in html] == []


def test_the_timeline_chart_marks_every_event_at_its_second(tmp_path):
    html, _ = report.render(report.collect(records(tmp_path, "lab-vllm"), "demo", now=NOW))
    marks = [(a["data-node"], a["data-event"], a["data-seconds"]) for t, a in tags(html).tags
             if t == "circle" and "data-event" in a]  # fmt: skip
    assert ("node1", "first_correct_answer", "32.20") in marks and ("node2", "weights_loaded", "24.70") in marks
    assert len(marks) == 6 + 3
    bars = [a["data-median"] for t, a in tags(html).tags if t == "rect" and "data-median" in a]
    assert len(bars) == 4


# ---- publishing ----------------------------------------------------------------------------------------------------


def test_publish_writes_a_whole_report_dir_and_swaps_latest(tmp_path):
    d = records(tmp_path, "lab-vllm")
    m = report.collect(d, "demo", now=NOW)
    out = report.publish(d, "demo", m, now=NOW)
    assert out == d / "demo" / "20261201T091500Z"
    assert sorted(p.name for p in out.iterdir()) == ["report.html", "report.json", "report.md"]
    assert json.loads((out / "report.json").read_text()) == m
    assert os.readlink(d / "demo" / "latest") == "20261201T091500Z"  # relative: the tree can be moved
    assert (out.stat().st_mode & 0o777) == 0o755
    again = report.publish(d, "demo", m, now=NOW)  # the same second: a new name, never over the first
    assert again.name == "20261201T091500Z-2" and os.readlink(d / "demo" / "latest") == again.name
    assert sorted(p.name for p in (d / "demo").iterdir()) == ["20261201T091500Z", "20261201T091500Z-2", "latest"]


def test_a_failed_publish_leaves_no_half_report_and_latest_untouched(tmp_path, monkeypatch):
    d = records(tmp_path, "lab-vllm")
    m = report.collect(d, "demo", now=NOW)
    first = report.publish(d, "demo", m, now=NOW)
    real = report._write

    def full_disk(path, text):
        if path.name == "report.md":
            raise OSError(28, "No space left on device")
        real(path, text)

    monkeypatch.setattr(report, "_write", full_disk)
    with pytest.raises(OSError, match="No space left"):
        report.publish(d, "demo", m, now=NOW + dt.timedelta(hours=1))
    assert sorted(p.name for p in (d / "demo").iterdir()) == [first.name, "latest"]
    assert os.readlink(d / "demo" / "latest") == first.name


def test_publish_refuses_a_latest_that_is_not_a_link_and_bad_names(tmp_path):
    d = records(tmp_path, "lab-vllm")
    m = report.collect(d, "demo", now=NOW)
    (d / "demo" / "latest").mkdir(parents=True)
    with pytest.raises(report.ReportError, match=r"demo/latest is not a symbolic link: move it away"):
        report.publish(d, "demo", m, now=NOW)
    with pytest.raises(report.ReportError, match=r"deployment '\.\./x': 1-42 lowercase letters"):
        report.collect(d, "../x")
    with pytest.raises(report.ReportError, match=r"report directory /\S+/missing does not exist: give --dir"):
        report.collect(tmp_path / "missing", "demo")


# ---- the fixtures keep the code's shapes ------------------------------------------------------------------------------


def test_fixture_shapes_are_the_modules_return_shapes():
    """The hand-made records hold the keys the code returns (RETURN docs and the verdict function), so a change
    of shape there shows here: rebuild them with tests/fixtures/reports/build.py."""
    doc = (ROOT / "library/llmfleet_topology_facts.py").read_text()
    ret = yaml.safe_load(doc.split('RETURN = r"""', 1)[1].split('"""', 1)[0])
    text = " ".join(ret["ansible_facts"]["contains"]["llmfleet_topology"]["description"])
    keys = set(re.search(r"C\(\{([^}]*)\}\)", text).group(1).replace(" ", "").split(","))
    for name in ("lab-vllm", "h20-engine-failed"):
        topo = json.loads((FIX / name / "topology.json").read_text())
        assert all(set(t) == keys for t in topo["nodes"].values())
    verdict = nccl_verdict.fleet_verdict({"n": {"_nccl_check_single": {"ok": True, "ranks": []}}})
    extra = {"generated_at", "floors", "reference_bytes", "models", "single_ranks"}
    for name in ("lab-vllm", "h20-engine-failed", "h20-preflight-nccl-failed"):
        assert set(json.loads((FIX / name / "nccl-check.json").read_text())) == set(verdict) | extra
    doc = (ROOT / "library/llmfleet_engine_ready.py").read_text()
    gate_keys = set(yaml.safe_load(doc.split('RETURN = r"""', 1)[1].split('"""', 1)[0]))
    for name, dep in (("lab-vllm", "demo"), ("h20-engine-failed", "qwen")):
        eng = json.loads((FIX / name / f"engine-{dep}.json").read_text())
        # as the engine role writes it: gate.deployment_record over the gates, with the role's meta keys
        meta = {k: v for k, v in eng.items() if k not in ("ok", "gates", "failure")}
        assert {"generated_at", "deployment", "engine", "profile", "model", "model_path"} <= set(meta)
        assert gate.deployment_record(eng["gates"], **meta) == eng
        assert all(set(g) <= gate_keys | {"failed", "msg"} for g in eng["gates"])
        assert set(eng["gates"][0]["timeline"]["nodes"]["gpu-b01" if dep == "qwen" else "node1"]) == {
            "rank", "unit", "phase", "unit_start", "weights_loaded", "node_ready"
        }  # fmt: skip


# ---- the command ------------------------------------------------------------------------------------------------------


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="llmfleet report")
    report_cli.add_arguments(p)
    return report_cli.run(p.parse_args(argv))


def test_cli_writes_the_report_and_prints_its_path_and_steps(tmp_path, capsys):
    d = records(tmp_path, "h20-engine-failed")
    assert cli(["--dir", str(d)]) == 0  # a failed deployment's report is still a report: exit 0
    out = capsys.readouterr().out.splitlines()
    latest = d / "qwen" / "latest"
    assert out[0] == str(d / "qwen" / os.readlink(latest) / "report.html") and Path(out[0]).is_file()
    assert out[1].startswith("deployment qwen: FAIL at engine on gpu-b02 (rank 11)")
    assert [x.split()[0] for x in out[2:]] == ["preflight", "topology", "staging", "nccl", "engine/cold", "acceptance",
                                               "bench"]  # fmt: skip
    assert cli(["--dir", str(d), "--deployment", "qwen", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["status"] == "fail" and res["failure"]["node"] == "gpu-b02" and Path(res["paths"]["html"]).is_file()
    assert res["paths"]["latest"] == str(latest) and os.readlink(latest) == Path(res["paths"]["html"]).parent.name


@pytest.mark.parametrize(
    ("argv", "msg"),
    [
        (["--dir", "{missing}"], "llmfleet report: report directory {missing} does not exist: give --dir"),
        (["--dir", "{d}", "--deployment", "Bad_Name"], "llmfleet report: deployment 'Bad_Name': 1-42 lowercase"),
        (["--dir", "{d}", "--max-age", "0"], "llmfleet report: --max-age 0: give a number of hours above 0"),
        (
            ["--dir", "{empty}"],
            "no endpoint-, engine-, acceptance- or bench- record of any deployment: give --deployment",
        ),
        (["--dir", "{two}"], "holds records of several deployments (demo, other): give --deployment NAME"),
    ],
)
def test_cli_bad_input_exits_2_with_a_clear_message(tmp_path, capsys, argv, msg):
    d = records(tmp_path, "lab-vllm")
    (tmp_path / "empty").mkdir()
    two = records(tmp_path / "t", "lab-vllm")
    (two / "endpoint-other.json").write_text("{}")
    paths = {"d": str(d), "empty": str(tmp_path / "empty"), "two": str(two), "missing": str(tmp_path / "missing")}
    assert cli([a.format(**paths) for a in argv]) == 2
    err = capsys.readouterr().err
    assert msg.format(**paths) in err and "Traceback" not in err


def test_cli_says_when_the_deployment_has_no_record_of_its_own(tmp_path, capsys):
    d = records(tmp_path, "h20-preflight-nccl-failed")
    (d / "endpoint-qwen2.json").write_text("{}")
    assert cli(["--dir", str(d), "--deployment", "qwen"]) == 0
    err = capsys.readouterr().err
    assert "note: no endpoint, engine, acceptance or bench record of qwen in" in err and "with records: qwen2" in err


# ---- timeline shapes of P/D and of several gates -------------------------------------------------------------------


def test_pd_timeline_puts_each_instances_api_on_its_row_and_the_deployments_on_the_routers():
    """gate.Gate._timeline of a P/D gate: the router's unit is a row of its own, `instances` the instances'."""
    gate = {"ready": True, "timeline": {
        "t0": 100.0,
        "nodes": {"node1": {"rank": 0, "unit_start": 0.0, "weights_loaded": 20.0, "node_ready": 40.0},
                  "node2": {"rank": 1, "unit_start": 0.5, "weights_loaded": 19.0, "node_ready": 38.0},
                  "node1/router": {"rank": 0, "unit_start": 1.0, "weights_loaded": None, "node_ready": 3.0}},
        "head": {"all_units_active": 40.5, "port_open": 41.0, "models_listed": 41.1, "first_correct_answer": 86.0,
                 "kv_transfer_proven": 86.2},
        "instances": {"node1": {"port_open": 40.6, "models_listed": 40.7, "first_correct_answer": 85.9},
                      "node2": {"port_open": 38.2, "models_listed": 38.3, "first_correct_answer": 67.0}},
    }}  # fmt: skip
    tl = rs.timeline({"gates": [gate]})
    rows = {r["node"]: r["events"] for r in tl["gates"][0]["rows"]}
    assert rows["node2"]["first_correct_answer"] == 67.0 and "kv_transfer_proven" not in rows["node2"]
    assert rows["node1/router"] == {"unit_start": 1.0, "node_ready": 3.0, "port_open": 41.0, "models_listed": 41.1,
                                    "first_correct_answer": 86.0, "kv_transfer_proven": 86.2}  # fmt: skip
    assert tl["gates"][0]["columns"][-1] == "kv_transfer_proven" and tl["summary"].startswith("first correct answer 86")


def test_several_gates_share_one_clock_from_the_first_unit_start():
    def gate(t0, answer):
        return {"ready": True, "timeline": {"t0": t0, "nodes": {f"n{t0}": {"rank": 0, "unit_start": 0.0}},
                                            "head": {"first_correct_answer": answer}}}  # fmt: skip

    tl = rs.timeline({"gates": [gate(1000.0, 30.0), gate(1004.5, 28.0)]})
    assert [g["first_correct_answer"] for g in tl["gates"]] == [30.0, 32.5]
    assert tl["gates"][1]["rows"][0]["events"]["unit_start"] == 4.5
    svg = report_svg.timeline_svg(tl["gates"][1])
    assert 'data-event="first_correct_answer" data-seconds="32.50"' in svg


def test_a_bare_nccl_verdict_gives_the_full_worlds_busbw_and_no_floor(tmp_path):
    """nccl-check.json as the verdict alone (no floors, models, single_ranks): busbw per host of the full world."""
    d = records(tmp_path, "h20-engine-failed")
    edit(d / "nccl-check.json", lambda v: [v.pop(k) for k in ("floors", "models", "single_ranks", "reference_bytes")])
    m = report.collect(d, "qwen", now=NOW)
    nodes = by_id(m)["nccl"]["nodes"]
    assert [(n["node"], n["busbw"], n["busbw_source"], n["floor"]) for n in nodes] == [
        ("gpu-b01", 41.2, "full world", None), ("gpu-b02", 41.2, "full world", None)
    ]  # fmt: skip
    html, md = report.render(m)
    assert "41.2 GB/s (full world)" in html and "41.2 GB/s (full world)" in md and "no floor at this size" in md


def test_a_summary_line_cut_to_the_terminal_says_so(tmp_path):
    m = report.collect(records(tmp_path, "h20-engine-failed"), "qwen", now=NOW)
    lines = report.summary_lines(m, width=60)
    assert all(len(x) <= 60 for x in lines)
    cut = [x for x in lines if x.endswith("...")]
    assert cut and all(len(x) > 50 for x in cut), lines


def test_the_warm_up_after_the_gate_is_part_of_the_timeline():
    """The engine role adds `warmup` (engine_warmup_lengths) to the record: its time and outcome; a failed one warns."""
    gate = {"ready": True, "timeline": {"t0": 1.0, "nodes": {"n1": {"rank": 0, "unit_start": 0.0}},
                                        "head": {"first_correct_answer": 30.0}}}  # fmt: skip
    assert rs.timeline({"gates": [gate]})["warmup"] is None
    ok = rs.timeline({"gates": [gate], "warmup": {"ok": True, "wall_s": 12.34, "summary": "WARMED UP 4/4 cells"}})
    assert ok["status"] == "pass"
    assert (
        ok["summary"]
        == "first correct answer 30.0 s after the first unit start; then warm-up 12.3 s: WARMED UP 4/4 cells"
    )
    bad = rs.timeline({"gates": [gate], "warmup": {"ok": False, "wall_s": 3.0, "summary": "WARM-UP FAILED (1 of 4)"}})
    assert bad["status"] == "warn" and bad["summary"].endswith("WARM-UP FAILED (1 of 4)")


# ---- a deployment of replicas -------------------------------------------------------------------------------


def test_a_rolled_back_rollout_is_the_verdict_with_its_replica_nodes_and_why(tmp_path):
    """The lab's rollout to a bad revision (Day 2 of tests/integration/test_replicas.py): replica r0 failed its gate
    on the new revision and went back; r1 was not reached. The run stopped in the engine role of the installed
    collection (llmfleet.fleet.engine): the step is the engine's, and the replicas section is the verdict."""
    m = report.collect(records(tmp_path, "lab-replicas-rollback"), "demo", now=NOW)
    s = by_id(m)
    assert m["status"] == "fail"
    assert m["verdict"].startswith("FAIL at replicas and rollout on node1, node2: the rollout to c0c0c0c0c0c0 "
                                   "stopped at replica r0 (node1, node2), back on b0b0b0b0b0b0: engine not ready: "
                                   "first failed node node2"), m["verdict"]  # fmt: skip
    assert m["verdict"].endswith("; not reached: r1")
    assert m["run"]["stopped"]["step"] == "engine" and m["run"]["stopped"]["role"] == "engine"
    rep = s["replicas"]
    assert rep["router"] == {"kind": "sglang-router", "node": "node1", "url": "http://10.77.0.11:30000"}
    assert [(r["deployment"], r["nodes"], r["ready"]) for r in rep["replicas"]] == [
        ("demo-r0", ["node1", "node2"], True), ("demo-r1", [], None)]  # fmt: skip
    assert rep["replicas"][0]["revision"] == "b0" * 20  # back on the revision it ran
    step = rep["rollout"]["steps"][0]
    assert (step["outcome"], step["from"], step["to"]) == ("rolled back", "b0" * 20, "c0" * 20)
    # r1's engine record is an earlier run's: left out, the engine section is r0's gate (the roll-back's)
    assert s["engine"]["status"] == "pass" and [g["label"] for g in s["engine"]["gates"]] == ["demo-r0: node1,node2"]
    assert s["engine"]["sources"] == ["engine-demo-r0.json"]
    assert [st["id"] for st in m["steps"]][4:6] == ["timeline", "replicas"]
    html, md = report.render(m)
    assert 'id="rollout"' in html and 'data-outcome="rolled back"' in html and 'data-replica="demo-r1"' in html
    assert "### Rolling change to `" + "c0" * 20 + "`" in md and "| **rolled back** |" in md
    assert "Not reached (they keep the revision they ran): r1." in md and "| demo-r1 | — | `—` | no record of" in md


def test_a_complete_rollout_passes_with_every_replicas_gate(tmp_path):
    d = records(tmp_path, "lab-replicas-rollback")
    rid = json.loads((d / "run-demo.json").read_text())["run_id"]
    edit(d / "run-demo.json", lambda r: r.update(outcome="completed", stopped=None))
    edit(d / "engine-demo-r1.json", lambda r: r.update(run_id=rid))

    def rolled(r):
        first = r["steps"][0]
        r["steps"] = [{**first, "outcome": "rolled", "runs": first["to"], "error": ""},
                      {**first, "replica": "r1", "deployment": "demo-r1", "nodes": ["node3", "node4"],
                       "outcome": "already there", "seconds": 0}]  # fmt: skip
        r.update(not_reached=[], complete=True)

    edit(d / "rollout-demo.json", rolled)
    s = by_id(report.collect(d, "demo", now=NOW))
    assert s["replicas"]["status"] == "pass", s["replicas"]["summary"]
    assert s["replicas"]["summary"] == ("2 replica(s) behind sglang-router on node1; rollout to c0c0c0c0c0c0: 1 rolled, "
                                        "1 already there; revision b0b0b0b0b0b0")  # fmt: skip
    assert [g["label"] for g in s["engine"]["gates"]] == ["demo-r0: node1,node2", "demo-r1: node3,node4"]
    assert s["engine"]["sources"] == ["engine-demo-r0.json, engine-demo-r1.json"]
    # a replica whose gate failed fails the section, and the engine's
    edit(d / "engine-demo-r1.json", lambda r: r.update(ok=False))
    s = by_id(report.collect(d, "demo", now=NOW))
    assert s["replicas"]["status"] == "fail" and "demo-r1 failed its gate" in s["replicas"]["summary"]
    assert s["engine"]["status"] == "fail"


def test_a_deployment_of_one_instance_has_no_replicas_section(tmp_path):
    m = report.collect(records(tmp_path, "lab-vllm"), "demo", now=NOW)
    assert "replicas" not in by_id(m) and "replicas" not in [st["id"] for st in m["steps"]]


def test_prometheus_scrapes_each_replica_not_the_routers_port(tmp_path):
    """The router's port serves no /metrics (its listener is on its node's loopback): the scrape targets of a
    deployment of replicas are the replicas' own APIs, from the router's endpoint record."""
    d = records(tmp_path, "lab-replicas-rollback")
    s = by_id(report.collect(d, "demo", now=NOW))
    assert s["metrics"]["status"] == "warn" and "written by an older llmfleet" in s["metrics"]["targets"][0]["what"]
    heads = [{"deployment": "demo-r0", "url": "http://10.77.0.11:8000", "head": "node1"},
             {"deployment": "demo-r1", "url": "http://10.77.0.13:8000", "head": "node3"}]  # fmt: skip
    edit(d / "endpoint-demo.json", lambda e: e.update(replica_endpoints=heads))
    s = by_id(report.collect(d, "demo", now=NOW))
    assert s["metrics"]["status"] == "pass"
    assert s["metrics"]["summary"] == "http://10.77.0.11:8000/metrics, http://10.77.0.13:8000/metrics"
    assert "loopback" in s["metrics"]["targets"][2]["what"]
