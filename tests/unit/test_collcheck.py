"""Collective check: exact values, nccl-tests formulas, verdicts, and real gloo worlds on this host
(one process per rank) with a corrupting rank and a rank that never arrives."""

import itertools
import json
import subprocess
import sys
import time

import pytest

from llmfleet import collcheck


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8, 16, 31, 32, 63, 64])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_values_are_exact_in_the_dtype(world, dtype):
    torch = pytest.importorskip("torch")
    assert collcheck.check_exactness(world, dtype)
    tdt = torch.float32 if dtype == "fp32" else torch.bfloat16
    # simulate the sum in the dtype itself, rank by rank, as a reduction would
    idx = torch.arange(1024)
    acc = torch.zeros(1024, dtype=tdt)
    for r in range(world):
        acc = acc + (((idx + r) % collcheck.PATTERN) + 1).to(tdt)
    want = torch.tensor(collcheck.allreduce_expected(world), dtype=tdt)[idx % collcheck.PATTERN]
    assert torch.equal(acc, want)
    assert torch.equal(((idx % 251) + 1).to(tdt).to(torch.int64), (idx % 251) + 1)  # broadcast pattern


def test_bf16_would_break_beyond_the_design_limit():
    """The check above can fail: at 128 ranks the bf16 sum is no longer exact."""
    assert not collcheck.check_exactness(128, "bf16")


@pytest.mark.parametrize(
    ("op", "world", "factor"),
    [("all_reduce", 8, 2 * 7 / 8), ("all_reduce", 32, 2 * 31 / 32), ("all_gather", 8, 7 / 8),
     ("broadcast", 8, 1.0), ("sendrecv", 8, 1.0), ("all_reduce", 1, 0.0)],
)  # fmt: skip
def test_bus_factor_is_nccl_tests(op, world, factor):
    assert collcheck.bus_factor(op, world) == pytest.approx(factor)


@pytest.mark.parametrize(("text", "n"), [("8", 8), ("1K", 1024), ("64M", 64 * 2**20), ("1G", 2**30), ("4KB", 4096)])
def test_parse_size(text, n):
    assert collcheck.parse_size(text) == n


def test_default_sweeps():
    gpu = collcheck.size_sweep(8, 2**30)
    assert gpu[0] == 8 and gpu[-2:] == [2**29, 2**30]
    assert all(b == a * 4 for a, b in itertools.pairwise(gpu[:-1]))


def test_judge_verdicts():
    ok = collcheck.judge([{"rank": 0, "ok": True}, {"rank": 1, "ok": True}])
    assert ok["ok"] and ok["verdict"].startswith("PASS")
    bad = collcheck.judge([{"rank": 0, "ok": False, "wrong": 3, "culprit_ranks": [1]},
                           {"rank": 1, "ok": False, "wrong": 3, "culprit_ranks": [1]}])  # fmt: skip
    assert bad["culprit_ranks"] == [1] and "contribution of rank(s) [1]" in bad["verdict"]
    missing = collcheck.judge([{"rank": 0, "ok": False, "error": "timeout", "stalled": {"0": "rendezvous", "1": "missing"}},
                               {"rank": 1, "ok": False, "error": "no result"}])  # fmt: skip
    assert missing["missing_ranks"] == [1] and "rank(s) [1] never arrived" in missing["verdict"]


def local(*args, timeout=180):
    cp = subprocess.run([sys.executable, "-m", "llmfleet.collcheck", "local", "--backend", "gloo", "--compact",
                         "--iters", "2", "--warmup", "1", *args], capture_output=True, text=True, timeout=timeout,
                        check=False)  # fmt: skip
    return cp.returncode, json.loads(cp.stdout)


def test_gloo_world_passes_with_exact_values():
    pytest.importorskip("torch")
    rc, out = local("--nproc", "4", "--sizes", "8,4K,256K", "--deadline", "120")
    assert rc == 0 and out["ok"], out["verdict"]
    r0 = out["ranks"][0]["results"]
    assert {(x["op"], x["dtype"]) for x in r0} == {(o, d) for o in collcheck.OPS for d in collcheck.DTYPES}
    assert all(x["wrong"] == 0 for x in r0) and all(x["busbw_GBps"] >= 0 for x in r0)


@pytest.mark.parametrize("op", ["all_reduce", "sendrecv", "all_gather"])
def test_a_corrupting_rank_is_named(op):
    pytest.importorskip("torch")
    rc, out = local("--nproc", "3", "--ops", op, "--sizes", "1K", "--corrupt-rank", "2", "--deadline", "120")
    assert rc == 1 and not out["ok"]
    assert out["culprit_ranks"] == [2], out["verdict"]
    assert any(r.get("wrong") for r in out["ranks"])


def test_a_rank_that_never_arrives_is_named_without_hanging():
    pytest.importorskip("torch")
    port = str(collcheck.free_port())
    common = ["--world", "3", "--master", "127.0.0.1", "--port", port, "--backend", "gloo", "--ops", "all_reduce",
              "--sizes", "8", "--iters", "1", "--warmup", "0", "--timeout", "5", "--op-timeout", "5", "--deadline", "40"]  # fmt: skip
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "llmfleet.collcheck", "rank", "--rank", str(r), *common],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for r in (0, 1)]  # fmt: skip
    outs = [p.communicate(timeout=60)[0] for p in procs]
    elapsed = time.monotonic() - t0
    ranks = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert all(p.returncode in (collcheck.EXIT_ERROR, collcheck.EXIT_TIMEOUT) for p in procs)
    verdict = collcheck.judge(ranks)
    assert verdict["missing_ranks"] == [2], (verdict, ranks)
    assert elapsed < 40, f"took {elapsed:.0f}s: the timeouts did not bound it"


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9])
def test_pair_rounds_cover_every_pair_once_and_run_in_parallel(n):
    nodes = [f"n{i}" for i in range(n)]
    rounds = collcheck.pair_rounds(nodes)
    pairs = [p for r in rounds for p in r]
    assert len(pairs) == len(set(pairs)) == n * (n - 1) // 2
    for r in rounds:
        flat = [x for p in r for x in p]
        assert len(flat) == len(set(flat))  # a node is in at most one pair per round
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)


@pytest.mark.parametrize(
    ("single", "pairs", "nodes", "links"),
    [
        ({"a": True, "b": True, "c": True, "d": True},
         {("a", "b"): True, ("a", "c"): False, ("a", "d"): True, ("b", "c"): False, ("b", "d"): True, ("c", "d"): False},
         ["c"], []),
        ({"a": True, "b": True, "c": True},
         {("a", "b"): True, ("a", "c"): True, ("b", "c"): False}, [], ["b<->c"]),
        ({"a": True, "b": False, "c": True}, {("a", "c"): True}, ["b"], []),
        ({"a": True, "b": True}, {("a", "b"): False}, [], ["a<->b"]),
    ],
)  # fmt: skip
def test_isolate_names_bad_nodes_and_links(single, pairs, nodes, links):
    assert collcheck.isolate(single, pairs) == {"bad_nodes": nodes, "bad_links": links}


def test_verdict_filter():
    from llmfleet_filters import llmfleet_collcheck_verdict

    ok_rank = {"ok": True, "wrong": 0}
    by_node = {
        "n1": {"_nccl_check_single": {"ok": True}, "_nccl_check_full": {"ranks": [{"rank": 0, **ok_rank}]},
               "_nccl_check_pairs": []},
        "n2": {"_nccl_check_single": {"ok": True}, "_nccl_check_full": {"ranks": [{"rank": 1, **ok_rank}]},
               "_nccl_check_pairs": []},
    }  # fmt: skip
    v = llmfleet_collcheck_verdict(by_node)
    assert v["ok"] and v["verdict"] == "PASS: every phase exact" and len(v["ranks"]) == 2
    by_node["n2"]["_nccl_check_full"] = {"ranks": [{"rank": 1, "ok": False, "error": "timeout"}]}
    by_node["n1"]["_nccl_check_full"] = {"ranks": [{"rank": 0, "ok": False, "error": "timeout",
                                                    "stalled": {"0": "rendezvous", "1": "missing"}}]}  # fmt: skip
    v = llmfleet_collcheck_verdict(by_node)
    assert not v["ok"] and "rank(s) [1] never arrived" in v["verdict"]


def test_ranks_are_bound_to_their_gpus_numa_node_when_known():
    spec = {"python": "/py", "world": 16, "master": "10.0.0.1", "port": 29600, "deadline": 60, "args": ["--backend", "nccl"],
            "numa_nodes": [0, 0, 0, 0, 1, 1, 1, 1]}  # fmt: skip
    argv = collcheck.rank_argv(spec, 13, 5, "/usr/bin/numactl")
    assert argv[:3] == ["/usr/bin/numactl", "--cpunodebind=1", "--membind=1"]
    assert argv[3:9] == ["/py", "-m", "llmfleet.collcheck", "rank", "--rank", "13"]
    assert collcheck.rank_argv(spec, 13, 5, None)[0] == "/py"  # no numactl: unbound, not an error
    assert collcheck.rank_argv({**spec, "numa_nodes": []}, 1, 1, "/usr/bin/numactl")[0] == "/py"
    assert collcheck.rank_argv({**spec, "numa_nodes": [None]}, 0, 0, "/usr/bin/numactl")[0] == "/py"


def _single(busbw):
    return [{"results": [{"op": "all_reduce", "bytes": 2**30, "busbw_GBps": busbw, "wrong": 0}]}]


def test_slow_node_is_named_by_its_models_floor():
    floors = {"H20": 300, "H200": 400}
    single = {"n1": _single(455.0), "n2": _single(380.0), "n3": _single(310.0), "n4": _single(100.0)}
    models = {"n1": "NVIDIA H200", "n2": "NVIDIA H200", "n3": "NVIDIA H20", "n4": "Tesla T4"}
    slow = collcheck.slow_nodes(single, floors, models, 2**30)
    assert list(slow) == ["n2"]  # H200 judged by its own floor, not H20's; a model without a floor is not judged
    assert "380 GB/s" in slow["n2"] and "floor 400" in slow["n2"]
    assert collcheck.slow_nodes(single, {}, models, 2**30) == {}


def test_verdict_fails_on_a_slow_node():
    from llmfleet_filters import llmfleet_collcheck_verdict

    ok = {"ok": True, "wrong": 0}
    by_node = {n: {"_nccl_check_single": {"ok": True, "ranks": _single(b)}, "_nccl_check_full": {"ranks": [{"rank": i, **ok}]},
                   "_nccl_check_pairs": []} for i, (n, b) in enumerate((("n1", 450.0), ("n2", 250.0)))}  # fmt: skip
    v = llmfleet_collcheck_verdict(by_node, {"H200": 400}, 2**30, {"n1": "NVIDIA H200", "n2": "NVIDIA H200"})
    assert not v["ok"] and list(v["slow_nodes"]) == ["n2"] and "slow node n2" in v["verdict"]
