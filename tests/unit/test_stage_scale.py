"""bench/stage_scale.py: the staging scale model - bytes conserved, the source read once by the fan-out
and N times by the naive copy, wall time monotonic in every bandwidth, closed-form cases (symmetric
naive copies, one file store-and-forward vs cut-through, the seeds' NIC egress bound) and the
bottleneck named in constructed cases; bad limits give a one-line error."""

import importlib.util
import itertools
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("stage_scale", ROOT / "bench/stage_scale.py")
sc = importlib.util.module_from_spec(spec)
sys.modules["stage_scale"] = sc  # dataclasses look their module up there
spec.loader.exec_module(sc)

GB = sc.GB
# Small enough to simulate quickly, with files of unequal size (the last one holds the remainder).
SMALL = sc.Limits(size=103 * GB, shard=5 * GB)
SIMULATED = ("naive", "llmfleet", "pipelined")


@pytest.mark.parametrize("strategy", SIMULATED)
@pytest.mark.parametrize("nodes", [1, 3, 5, 16])
def test_every_node_receives_the_revision_once_and_bytes_are_conserved(strategy, nodes):
    r = sc.simulate(strategy, replace(SMALL, nodes=nodes))
    assert r.received == pytest.approx(nodes * SMALL.size, rel=1e-9)
    assert r.source_bytes + r.peer_bytes == pytest.approx(nodes * SMALL.size, rel=1e-9)
    assert sum(r.shares.values()) == pytest.approx(nodes * SMALL.size, rel=1e-9)
    assert r.wall_s > 0


@pytest.mark.parametrize("strategy", ["llmfleet", "pipelined", "ideal"])
@pytest.mark.parametrize("nodes", [1, 2, 4, 32])
def test_fan_out_reads_the_source_once(strategy, nodes):
    r = sc.simulate(strategy, replace(SMALL, nodes=nodes))
    assert r.source_bytes == pytest.approx(SMALL.size, rel=1e-9)
    assert r.peer_bytes == pytest.approx((nodes - 1) * SMALL.size, rel=1e-9)


@pytest.mark.parametrize("nodes", [1, 4, 32])
def test_naive_reads_the_source_n_times(nodes):
    r = sc.simulate("naive", replace(SMALL, nodes=nodes))
    assert r.source_bytes == pytest.approx(nodes * SMALL.size, rel=1e-9)
    assert r.peer_bytes == 0


@pytest.mark.parametrize("strategy", sc.STRATEGIES)
@pytest.mark.parametrize("knob", list(sc.KNOBS))
@pytest.mark.parametrize("nodes", [4, 16])
def test_wall_time_never_grows_with_more_bandwidth(strategy, knob, nodes):
    lim = replace(SMALL, nodes=nodes)
    walls = [sc.simulate(strategy, sc._scaled(lim, knob, k)).wall_s for k in (0.25, 0.5, 1, 2, 4, 8)]
    assert all(b <= a * (1 + 1e-9) for a, b in itertools.pairwise(walls)), walls


def test_naive_on_a_slow_shared_storage_is_n_times_the_revision_over_its_bandwidth():
    lim = replace(SMALL, nodes=8, source_bw=1 * GB)
    r = sc.simulate("naive", lim)
    assert r.wall_s == pytest.approx(8 * SMALL.size / (1 * GB), rel=1e-9)
    assert sc.bottleneck("naive", lim, r)[0] == "shared storage read"


def test_one_file_store_and_forward_then_cut_through():
    # One seed, one peer, one 8 GB file, the source the only slow limit: the peer fetches only after
    # the seed verified the whole file (and the next status poll); cut-through follows one chunk behind.
    lim = sc.Limits(nodes=2, size=8 * GB, shard=8 * GB, source_bw=1 * GB, readers=1, poll_s=0.5)
    peer_rate = lim.core_hash_bw  # one copy thread hashing is the peer fetch's limit here
    saf = sc.simulate("llmfleet", lim)
    assert saf.wall_s == pytest.approx(8 + 0.5 + 8 * GB / peer_rate, rel=1e-9)
    cut = sc.simulate("pipelined", lim)
    assert cut.wall_s == pytest.approx(8 + sc.CHUNK / peer_rate, rel=1e-6)
    assert cut.source_bytes == saf.source_bytes == pytest.approx(8 * GB)


def test_llmfleet_is_bound_by_the_seeds_nic_when_many_nodes_fetch_from_them():
    lim = replace(SMALL, nodes=32, nic_bw=1 * GB, source_bw=100 * GB)
    r = sc.simulate("llmfleet", lim)
    seeds = lim.readers
    # every other node fetches every file from its owning seed: (N-1) x S over the seeds' egress
    assert r.wall_s >= (lim.nodes - 1) * lim.size / (seeds * lim.nic_bw)
    assert r.wall_s <= 1.1 * (lim.nodes - 1) * lim.size / (seeds * lim.nic_bw)
    assert sc.bottleneck("llmfleet", lim, r)[0] == "NIC out (seeds serving peers)"
    # the ideal relays: each node sends about S, so the same NIC allows ~N/seeds times faster
    assert sc.simulate("ideal", lim).wall_s < r.wall_s / 10


@pytest.mark.parametrize(
    ("strategy", "limits", "expected"),
    [
        ("naive", {"nodes": 1, "nvme_bw": 0.5 * GB}, "NVMe write"),
        ("llmfleet", {"nodes": 1, "core_hash_bw": 0.1 * GB}, "sha256"),
        ("llmfleet", {"nodes": 4, "source_bw": 0.5 * GB}, "shared storage read"),
        ("pipelined", {"nodes": 4, "source_bw": 0.5 * GB}, "shared storage read"),
        ("ideal", {"nodes": 4, "source_bw": 0.5 * GB}, "shared storage read"),
        ("ideal", {"nodes": 4, "nvme_bw": 0.5 * GB}, "NVMe write"),
        ("naive", {"nodes": 4, "source_bw": 4 * GB, "nvme_bw": 1 * GB}, "shared storage read + NVMe write"),
    ],
)
def test_bottleneck_is_named_in_constructed_cases(strategy, limits, expected):
    assert sc.bottleneck(strategy, replace(SMALL, **limits))[0] == expected


def test_ideal_is_the_source_once_plus_the_pipeline_fill():
    lim = replace(SMALL, nodes=8, fanout=2)
    r = sc.simulate("ideal", lim)
    hops = 1 + 3  # the source, then log2(8) relay levels
    assert r.wall_s == pytest.approx((lim.size + hops * sc.CHUNK) / lim.source_bw)
    for s in SIMULATED:
        assert sc.simulate(s, lim).wall_s >= r.wall_s


def test_reader_cap_bounds_the_seeds():
    # one reader: a single seed reads everything, so the source rate is its NIC's and thread's at most
    lim = replace(SMALL, nodes=4, readers=1, source_bw=100 * GB, nic_bw=2 * GB)
    assert sc.simulate("llmfleet", lim).wall_s >= lim.size / lim.nic_bw
    two = sc.simulate("llmfleet", replace(lim, readers=2)).wall_s
    assert two < sc.simulate("llmfleet", lim).wall_s


def test_bad_limits_fail_with_one_line():
    with pytest.raises(ValueError, match=r"nodes=0"):
        sc.simulate("llmfleet", replace(SMALL, nodes=0))
    with pytest.raises(ValueError, match="unknown strategy 'torrent'"):
        sc.simulate("torrent", SMALL)
    cp = subprocess.run(
        [sys.executable, str(ROOT / "bench/stage_scale.py"), "--threads", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert cp.returncode != 0
    assert "threads=0" in cp.stderr and "--threads" in cp.stderr
    assert "Traceback" not in cp.stderr and len(cp.stderr.strip().splitlines()) == 1


def test_cli_prints_a_table_per_strategy(tmp_path):
    out = tmp_path / "scale.md"
    cp = subprocess.run(
        [sys.executable, str(ROOT / "bench/stage_scale.py"), "--nodes", "2", "4", "--tib", "0.05", "--out", str(out)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    text = out.read_text()
    assert text.strip() == cp.stdout.strip()
    for s in sc.STRATEGIES:
        assert f"**{s}**" in text
    rows = [line for line in text.splitlines() if line.startswith(("| 2 |", "| 4 |"))]
    assert len(rows) == 2 * len(sc.STRATEGIES)
    naive4 = next(r for r in rows if r.startswith("| 4 |"))
    assert "| 4.00x |" in naive4  # the naive table comes first: 4 nodes read the revision 4 times
