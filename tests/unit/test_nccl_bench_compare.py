"""bench/device/nccl_compare.py: nccl-tests' text output parsed, matched with the check's results by op,
dtype and size, and the issue-17 goals judged (met and missed) - so the device run's table is right."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("nccl_compare", ROOT / "bench/device/nccl_compare.py")
cmp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cmp)


def nccl_tests_line(size, op_name, oop_us, ip_us, typ="float", busbw=1.0):
    """One data row as nccl-tests 2.19 prints it (writeBenchmarkLinePreamble + two writeBenchmarkLineBody)."""
    return (
        f"{size:12d}  {size // 4:12d}  {typ:>8s}  {op_name:>6s}  {-1:6d}"
        f"  {oop_us:7.2f}  {0.0:6.2f}  {busbw:6.2f}  {0:6g}  {ip_us:7.2f}  {0.0:6.2f}  {busbw:6.2f}  {0:6g}"
    )


HEADER = """# nccl-tests version 2.19.6 nccl-headers=22809 nccl-library=22809
#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)
"""


def test_nccl_tests_output_is_parsed_per_placement():
    text = HEADER + nccl_tests_line(8, "sum", 20.5, 18.25) + "\n" + nccl_tests_line(65536, "sum", 30.0, 29.0) + "\n"
    text += "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 0.5\n"
    rows = cmp.parse_nccl_tests(text)
    assert rows[8]["oop_time_us"] == 20.5 and rows[8]["ip_time_us"] == 18.25 and rows[65536]["ip_wrong"] == "0"
    assert set(rows) == {8, 65536}


def write_case(tmp_path, ours_us):
    nt = tmp_path / "nt"
    nt.mkdir()
    sizes = [8, 64 * 1024, 16 * 2**20]
    for mode, us in (("eager", (10.0, 20.0, 100.0)), ("graph", (8.0, 19.0, 99.0))):
        text = HEADER + "\n".join(nccl_tests_line(s, "sum", 99.0, t) for s, t in zip(sizes, us, strict=True)) + "\n"
        (nt / f"all_reduce-float-{mode}.txt").write_text(text)
    results = [{"op": "all_reduce", "dtype": "fp32", "bytes": s, "time_us": t, "busbw_GBps": 1.0, "wrong": 0,
                "timing": "graph"} for s, t in zip(sizes, ours_us, strict=True)]  # fmt: skip
    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps({"ranks": [{"rank": 0, "results": results}]}))
    return nt, ours


def test_goals_met(tmp_path):
    nt, ours = write_case(tmp_path, (9.0, 21.0, 101.0))
    rows, lines = cmp.compare(nt, cmp.ours(ours), {})
    assert [round(r["ratio"], 3) for r in rows] == [round(10 / 9, 3), round(20 / 21, 3), round(100 / 101, 3)]
    assert rows[0]["ntg_us"] == 8.0 and rows[0]["nt_us"] == 10.0  # in-place column for all_reduce
    assert lines[:3] == ["all_reduce: busbw >= 0.9x nccl-tests from 64 KiB: met (worst 0.95x at 65536 B fp32)",
                         "all_reduce: busbw >= 0.95x nccl-tests from 16384 KiB: met (worst 0.99x at 16777216 B fp32)",
                         "all_reduce: latency at 8 B <= 1.5x nccl-tests: met (worst 0.90x)"]  # fmt: skip
    assert lines[3] == "broadcast: no side-by-side numbers"
    assert "| all_reduce | fp32 | 8 | 10.00 | 8.00 | 9.00 |" in cmp.table(rows)


def test_goals_missed_say_the_figure(tmp_path):
    nt, ours = write_case(tmp_path, (16.0, 23.0, 110.0))
    _, lines = cmp.compare(nt, cmp.ours(ours), {})
    assert lines[0] == "all_reduce: busbw >= 0.9x nccl-tests from 64 KiB: MISSED (worst 0.87x at 65536 B fp32)"
    assert lines[1].startswith("all_reduce: busbw >= 0.95x nccl-tests from 16384 KiB: MISSED (worst 0.91x")
    assert lines[2] == "all_reduce: latency at 8 B <= 1.5x nccl-tests: MISSED (worst 1.60x)"


def test_a_lab_rerun_keeps_the_device_runs_section(tmp_path):
    spec = importlib.util.spec_from_file_location("nccl_check_bench", ROOT / "bench/nccl_check_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench-nccl-check.md"
    assert bench.kept_device_runs(out) == ""
    out.write_text("## lab table\n| old |\n\n<!-- Device runs below: kept -->\n## GPU\n| ratio |\n")
    assert bench.kept_device_runs(out) == "\n<!-- Device runs below: kept -->\n## GPU\n| ratio |\n"
