"""NCCL check verdicts: one world's (judge), pairwise rounds, bad node / bad link isolation,
busbw floors per GPU model, and the fleet's verdict after every phase."""

import pytest

from llmfleet.checks import nccl_verdict
from llmfleet.checks.nccl_verdict import fleet_verdict


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


def _rank(rank, world, op="all_reduce", **wrong_from):
    """One rank's result with wrong elements from the given sources (keyword s<rank>=count)."""
    wf = {k[1:]: v for k, v in wrong_from.items()}
    res = {"op": op, "dtype": "bf16", "bytes": 1024, "wrong": sum(wf.values()), **({"wrong_from": wf} if wf else {})}
    return {
        "rank": rank,
        "world": world,
        "ok": not wf,
        "wrong": sum(wf.values()),
        "culprit_ranks": [],
        "results": [res],
    }


@pytest.mark.parametrize(
    ("ranks", "named"),
    [
        # one receiver, one source: the path between them (NCCL may relay it: a path, not a link)
        ([_rank(0, 4), _rank(1, 4, s3=5), _rank(2, 4), _rank(3, 4)],
         {"bad_transfers": [[3, 1]], "damaged_sources": [], "bad_receivers": []}),
        # every other rank got rank 2's data wrong, rank 2's own buffer was right: its send side
        ([_rank(0, 4, s2=1), _rank(1, 4, s2=1), _rank(2, 4), _rank(3, 4, s2=1)],
         {"damaged_sources": [2], "bad_transfers": [], "bad_receivers": []}),
        # one receiver, wrong data from several sources: its receive side
        ([_rank(0, 4), _rank(1, 4, s0=1, s2=1, s3=1), _rank(2, 4), _rank(3, 4)],
         {"bad_receivers": [1], "damaged_sources": [], "bad_transfers": []}),
        # the ring: rank 3 receives from rank 2 only
        ([_rank(0, 4, "sendrecv"), _rank(1, 4, "sendrecv"), _rank(2, 4, "sendrecv"), _rank(3, 4, "sendrecv", s2=9)],
         {"bad_transfers": [[2, 3]]}),
        # two ranks: one receiver of one source is a path, never "the sender" (one witness is not enough)
        ([_rank(0, 2, "all_gather"), _rank(1, 2, "all_gather", s0=4)], {"bad_transfers": [[0, 1]], "damaged_sources": []}),
    ],
)  # fmt: skip
def test_wrong_elements_name_what_their_positions_can_say(ranks, named):
    v = nccl_verdict.judge(ranks)
    assert not v["ok"] and v["culprit_ranks"] == [] and v["unattributed_ops"] == []
    assert {k: v[k] for k in named} == named, v["attribution"]


def test_damage_spread_over_most_ranks_is_not_pinned_on_anyone():
    """A partial sum damaged during a ring reduction reaches every rank in data of every rank."""
    ranks = [_rank(q, 4, s0=1, s1=1, s2=1, s3=1) for q in range(4)]
    v = nccl_verdict.judge(ranks)
    assert v["unattributed_ops"] == ["all_reduce"]
    assert v["damaged_sources"] == v["bad_receivers"] == v["bad_transfers"] == []
    assert (
        v["verdict"]
        == "FAIL: wrong values on ranks [0, 1, 2, 3]; all_reduce: damage spread over most ranks, check links"
    )


def test_a_culprits_own_data_is_explained_by_its_contribution():
    ranks = [_rank(q, 3, s1=1) for q in range(3)]
    for r in ranks:
        r["culprit_ranks"] = [1]
    v = nccl_verdict.judge(ranks)
    assert v["culprit_ranks"] == [1] and v["damaged_sources"] == [] and v["attribution"] == []
    assert v["verdict"] == "FAIL: wrong values on ranks [0, 1, 2]; the contribution of rank(s) [1] is wrong"


def test_nobody_reaching_rank_0s_store_names_rank_0():
    ranks = [{"rank": r, "ok": False, "error": "cannot reach the rendezvous store", "store_unreachable": True}
             for r in (1, 2)]  # fmt: skip
    assert nccl_verdict.judge(ranks)["missing_ranks"] == [0]
    assert nccl_verdict.judge([*ranks, {"rank": 0, "ok": False, "error": "x"}])["missing_ranks"] == []


def test_fleet_verdict_names_a_damaged_path():
    by_node = {"n1": {"_nccl_check_single": {"ok": True}, "_nccl_check_full": {"ranks": [_rank(0, 3), _rank(1, 3, s2=2)]}},
               "n2": {"_nccl_check_single": {"ok": True}, "_nccl_check_full": {"ranks": [_rank(2, 3)]}}}  # fmt: skip
    v = fleet_verdict(by_node)
    assert not v["ok"] and v["full"]["bad_transfers"] == [[2, 1]]
    assert v["verdict"] == "FAIL: data damaged on the way 2->1"


def _cut_world():
    """Four nodes, two ranks each; n3's ranks cannot reach n1's store, every other rank waits for them."""
    waiting = {"ok": False, "error": "rendezvous: not every rank arrived within 10s",
               "stalled": {**{str(r): "rendezvous" for r in range(8)}, "4": "missing", "5": "missing"}}  # fmt: skip
    unreachable = {"ok": False, "error": "cannot reach the rendezvous store of rank 0", "store_unreachable": True}
    full = {n: [{"rank": 2 * i + k, "host": n, **(unreachable if n == "n3" else waiting)} for k in (0, 1)]
            for i, n in enumerate(("n1", "n2", "n3", "n4"))}  # fmt: skip
    return full


def test_a_node_cut_off_from_the_heads_store_is_named_from_the_full_world():
    full = _cut_world()
    assert nccl_verdict.cut_off(full) == ["n3"]
    # Not when nobody reached the store (the head's own side), nor when the others also miss someone else.
    assert nccl_verdict.cut_off({n: rs for n, rs in full.items() if n == "n3"}) == []
    other = {**full, "n4": [{**r, "stalled": {"6": "missing"}} for r in full["n4"]]}
    assert nccl_verdict.cut_off(other) == []
    healthy = {n: [{"rank": r["rank"], "ok": True} for r in rs] for n, rs in full.items()}
    assert nccl_verdict.cut_off(healthy) == []


def test_fleet_verdict_names_the_cut_off_node_and_the_world_without_it():
    full = _cut_world()
    rest = {
        n: [{"rank": r, "ok": True, "wrong": 0} for r in rs]
        for n, rs in (("n1", (0, 1)), ("n2", (2, 3)), ("n4", (4, 5)))
    }
    by_node = {n: {"_nccl_check_single": {"ok": True}, "_nccl_check_full": {"ranks": full[n]},
                   "_nccl_check_rest": {"ranks": rest.get(n, [])}, "_nccl_check_pairs": []} for n in full}  # fmt: skip
    v = fleet_verdict(by_node)
    assert not v["ok"] and v["bad_nodes"] == ["n3"] and v["cut_off"] == ["n3"] and v["rest"]["ok"]
    assert "bad node(s): n3" in v["verdict"] and v["pairs"] == []
    assert "cut off: n3 could not reach the rendezvous store on n1, every other node did" in v["lines"]
    assert "phase 2 without n3 (6 ranks): PASS: 6 ranks, every element exact" in v["lines"]
