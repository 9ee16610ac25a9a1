"""bench/stage_bench.py, one-node part: the by-hand baselines really copy and really check (a damaged
copy is caught by the sha256sum and the openssl step), and the table has every row with its parallelism, run on a
small real revision."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from tests.helpers.once import once

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("stage_bench", ROOT / "bench/stage_bench.py")
sb = importlib.util.module_from_spec(spec)
sys.modules["stage_bench"] = sb
spec.loader.exec_module(sb)


@pytest.fixture(scope="module")
def revision(tmp_path_factory):
    """One revision for the run (2.8 s of CPU to write): the tests read it, and copy and damage copies only."""
    d, _ = once(tmp_path_factory, "stage-bench-revision", lambda d: str(sb.make_revision(d / "src", 4 * 2**20, 20)))
    src = d / "src"
    return src, sb.build_manifest(str(src), revision=sb.REV)


@pytest.mark.parametrize("tool", sorted(sb.HASHERS))
def test_parallel_cp_then_hash_copies_every_file(tmp_path, revision, tool):
    src, manifest = revision
    dst = tmp_path / "dst"
    sb.par_cp(src, dst, 3)
    assert sorted(p.name for p in dst.iterdir()) == sorted(p.name for p in src.iterdir())
    assert all((dst / p.name).read_bytes() == p.read_bytes() for p in src.iterdir())
    sb.par_sha256(dst, 3, manifest, tool)  # raises on a mismatch


@pytest.mark.parametrize("tool", sorted(sb.HASHERS))
def test_hash_step_catches_a_damaged_copy(tmp_path, revision, tool):
    src, manifest = revision
    dst = tmp_path / "dst"
    sb.par_cp(src, dst, 2)
    shard = sorted(dst.glob("*.safetensors"))[3]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match=f"{tool} of the copies in .* does not match the manifest"):
        sb.par_sha256(dst, 2, manifest, tool)


def test_one_node_table_has_every_method_with_its_parallelism(tmp_path, monkeypatch):
    monkeypatch.setattr(sb, "WORK", tmp_path)
    # Test double: the real drop_caches() empties the whole machine's page cache, which the timings of
    # everything else running here depend on; the table's content does not.
    monkeypatch.setattr(sb, "drop_caches", lambda: None)
    text, rows = sb.bench_single(0.01, threads=3, repeat=2)
    lines = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert [line.split(" | ")[1] for line in lines] == [
        "1 process",
        "1 process",
        "3 processes",
        "3 + 3 processes",
        "3 + 3 processes",
        f"3 + {os.cpu_count()} processes",  # the best by hand: openssl on every core
        "3 threads",
        "3 threads",
        "3 threads",
        "3 threads (build, then copy)",
    ]
    assert lines[0].endswith("| 1.00x |")
    assert "xargs -P 3 cp + sync, then xargs -P 3 sha256sum vs manifest" in text
    assert "xargs -P 3 cp + sync, then xargs -P 3 openssl dgst -sha256 vs manifest" in text
    assert "median of 2 interleaved runs" in text
    assert "**llmfleet stage / best by hand (xargs -P 3 cp + sync, then xargs -P" in text
    assert "; cold, manifest built from the copy " in text and "(built first: " in text
    assert rows["llmfleet stage, manifest built first (cold, two reads)"] > 0
    assert rows["llmfleet stage, no manifest: built from the copy (cold, one read)"] > 0
    assert not (tmp_path / "dst").exists()


def test_goal_only_keeps_the_rows_of_the_goal_line(tmp_path, monkeypatch):
    monkeypatch.setattr(sb, "WORK", tmp_path)
    monkeypatch.setattr(sb, "drop_caches", lambda: None)  # test double, as above
    text, rows = sb.bench_single(0.01, threads=2, repeat=1, goal_only=True)
    assert len(rows) == 5  # size + 4 rows
    assert "ratio to best by hand" in text and "(best by hand) |" in text and "cp -r + sync" not in text
