"""NCCL check verdicts: one world's (judge), pairwise rounds, bad node / bad link isolation,
busbw floors per GPU model, and the fleet's verdict after every phase."""

import pytest

from llmfleet import nccl_verdict
from llmfleet.nccl_verdict import fleet_verdict


def test_judge_verdicts():
    ok = nccl_verdict.judge([{"rank": 0, "ok": True}, {"rank": 1, "ok": True}])
    assert ok["ok"] and ok["verdict"].startswith("PASS")
    bad = nccl_verdict.judge([{"rank": 0, "ok": False, "wrong": 3, "culprit_ranks": [1]},
                             {"rank": 1, "ok": False, "wrong": 3, "culprit_ranks": [1]}])  # fmt: skip
    assert bad["culprit_ranks"] == [1] and "contribution of rank(s) [1]" in bad["verdict"]
    missing = nccl_verdict.judge([{"rank": 0, "ok": False, "error": "timeout", "stalled": {"0": "rendezvous", "1": "missing"}},
                                 {"rank": 1, "ok": False, "error": "no result"}])  # fmt: skip
    assert missing["missing_ranks"] == [1] and "rank(s) [1] never arrived" in missing["verdict"]


@pytest.mark.parametrize(
    ("ranks", "verdict"),
    [
        ([], "FAIL: ranks [] failed: "),  # no rank reported: never a pass
        ([{"rank": 0, "ok": False, "wrong": 2}, {"rank": 1, "ok": True}],
         "FAIL: wrong values on ranks [0] (no single rank's contribution is at fault: check links)"),
        ([{"rank": 0, "ok": False, "error": "RuntimeError: " + "x" * 200}, {"rank": 1, "ok": False, "error": "boom"}],
         "FAIL: ranks [0, 1] failed: RuntimeError: " + "x" * 106 + "; boom"),
    ],
)  # fmt: skip
def test_judge_without_culprits_or_missing_ranks(ranks, verdict):
    v = nccl_verdict.judge(ranks)
    assert not v["ok"] and v["verdict"] == verdict and v["culprit_ranks"] == v["missing_ranks"] == []


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9])
def test_pair_rounds_cover_every_pair_once_and_run_in_parallel(n):
    nodes = [f"n{i}" for i in range(n)]
    rounds = nccl_verdict.pair_rounds(nodes)
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
    assert nccl_verdict.isolate(single, pairs) == {"bad_nodes": nodes, "bad_links": links}


def _single(busbw):
    return [{"results": [{"op": "all_reduce", "bytes": 2**30, "busbw_GBps": busbw, "wrong": 0}]}]


def test_slow_node_is_named_by_its_models_floor():
    floors = {"H20": 300, "H200": 400}
    single = {"n1": _single(455.0), "n2": _single(380.0), "n3": _single(310.0), "n4": _single(100.0)}
    models = {"n1": "NVIDIA H200", "n2": "NVIDIA H200", "n3": "NVIDIA H20", "n4": "Tesla T4"}
    slow = nccl_verdict.slow_nodes(single, floors, models, 2**30)
    assert list(slow) == ["n2"]  # H200 judged by its own floor, not H20's; a model without a floor is not judged
    assert "380 GB/s" in slow["n2"] and "floor 400" in slow["n2"]
    assert nccl_verdict.slow_nodes(single, {}, models, 2**30) == {}


def test_fleet_verdict_passes_then_names_a_rank_that_never_arrived():
    ok_rank = {"ok": True, "wrong": 0}
    by_node = {
        "n1": {"_nccl_check_single": {"ok": True}, "_nccl_check_full": {"ranks": [{"rank": 0, **ok_rank}]},
               "_nccl_check_pairs": []},
        "n2": {"_nccl_check_single": {"ok": True}, "_nccl_check_full": {"ranks": [{"rank": 1, **ok_rank}]},
               "_nccl_check_pairs": []},
    }  # fmt: skip
    v = fleet_verdict(by_node)
    assert v["ok"] and v["verdict"] == "PASS: every phase exact" and len(v["ranks"]) == 2
    assert v["lines"] == ["phase 1 (each node alone): n1 PASS, n2 PASS",
                          "phase 2 (full world, 2 ranks): PASS: 2 ranks, every element exact",
                          "verdict: PASS: every phase exact"]  # fmt: skip
    by_node["n2"]["_nccl_check_full"] = {"ranks": [{"rank": 1, "ok": False, "error": "timeout"}]}
    by_node["n1"]["_nccl_check_full"] = {"ranks": [{"rank": 0, "ok": False, "error": "timeout",
                                                    "stalled": {"0": "rendezvous", "1": "missing"}}]}  # fmt: skip
    v = fleet_verdict(by_node)
    assert not v["ok"] and "rank(s) [1] never arrived" in v["verdict"]


def test_fleet_verdict_fails_on_a_slow_node():
    ok = {"ok": True, "wrong": 0}
    by_node = {n: {"_nccl_check_single": {"ok": True, "ranks": _single(b)}, "_nccl_check_full": {"ranks": [{"rank": i, **ok}]},
                   "_nccl_check_pairs": []} for i, (n, b) in enumerate((("n1", 450.0), ("n2", 250.0)))}  # fmt: skip
    v = fleet_verdict(by_node, {"H200": 400}, 2**30, {"n1": "NVIDIA H200", "n2": "NVIDIA H200"})
    assert not v["ok"] and list(v["slow_nodes"]) == ["n2"] and "slow node n2" in v["verdict"]


def test_fleet_verdict_names_a_bad_link_from_the_pairwise_rounds():
    """Both ends report a pair; it passes only if both say so."""
    failed = {"ranks": [{"rank": 0, "ok": False, "error": "timeout"}]}
    by_node = {
        "a": {"_nccl_check_single": {"ok": True}, "_nccl_check_full": failed,
              "_nccl_check_pairs": [{"pair": ["a", "b"], "ok": True}, {"pair": ["c", "a"], "ok": True}]},
        "b": {"_nccl_check_single": {"ok": True}, "_nccl_check_full": {},
              "_nccl_check_pairs": [{"pair": ["a", "b"], "ok": True}, {"pair": ["b", "c"], "ok": True}]},
        "c": {"_nccl_check_single": {"ok": True}, "_nccl_check_pairs": [{"pair": ["c", "b"], "ok": False}]},
    }  # fmt: skip
    v = fleet_verdict(by_node)
    assert not v["ok"]
    assert v["pairs"] == [{"pair": ["a", "b"], "ok": True}, {"pair": ["a", "c"], "ok": True},
                          {"pair": ["b", "c"], "ok": False}]  # fmt: skip
    assert v["bad_nodes"] == [] and v["bad_links"] == ["b<->c"]
    assert v["verdict"] == "FAIL: bad link(s): b<->c"
    assert v["lines"][2] == "phase 3 (pairs): a+b PASS, a+c PASS, b+c FAIL"
    assert v["lines"][-1] == "verdict: FAIL: bad link(s): b<->c"
