"""NCCL check verdicts: what the ranks' JSON results (from llmfleet.nccl_check) say about one
world, and, on the ops host, about the fleet after the three phases (every node alone, the full
world, pairwise rounds): culprit ranks, ranks that never arrived, bad or slow nodes, bad links.

Pure functions over plain data (stdlib only): the rank program's local launcher judges its world
with judge(), and the nccl_check role's filters call the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def judge(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Verdict for one world: ok, the culprit ranks (wrong contribution), ranks that never arrived
    or stalled, and one line saying so."""
    bad_values = sorted({c for r in ranks for c in r.get("culprit_ranks", [])})
    wrong_ranks = sorted(r["rank"] for r in ranks if r.get("wrong"))
    missing: set[int] = set()
    for r in ranks:
        for k, v in (r.get("stalled") or {}).items():
            if v == "missing":
                missing.add(int(k))
    errored = sorted(r["rank"] for r in ranks if r.get("error"))
    ok = all(r.get("ok") for r in ranks) and len(ranks) > 0
    if ok:
        line = f"PASS: {len(ranks)} ranks, every element exact"
    elif bad_values:
        line = f"FAIL: wrong values on ranks {wrong_ranks}; the contribution of rank(s) {bad_values} is wrong"
    elif missing:
        line = f"FAIL: rank(s) {sorted(missing)} never arrived; ranks {errored} gave up"
    elif wrong_ranks:
        line = f"FAIL: wrong values on ranks {wrong_ranks} (no single rank's contribution is at fault: check links)"
    else:
        line = (
            f"FAIL: ranks {errored} failed: "
            + "; ".join(str(r.get("error"))[:120] for r in ranks if r.get("error"))[:400]
        )
    return {"ok": ok, "culprit_ranks": bad_values, "missing_ranks": sorted(missing), "failed_ranks": errored,
            "verdict": line}  # fmt: skip


def slow_nodes(single: dict[str, list[dict[str, Any]]], floors: dict[str, float], models: dict[str, str | None],
               ref_bytes: int) -> dict[str, str]:  # fmt: skip
    """Nodes whose single-node all_reduce busbw at the reference size is below the floor for their
    GPU model: {node: reason}. A model with no floor (or no measurement at that size) is not judged."""
    out = {}
    for node, ranks in single.items():
        model = models.get(node) or ""
        # longest name first: "H200" must not be judged by the "H20" floor
        names = sorted((n for n in floors if n), key=len, reverse=True)
        floor = next((floors[n] for n in names if n.lower() in model.lower()), None)
        if floor is None or not ranks:
            continue
        got = [x["busbw_GBps"] for x in ranks[0].get("results", []) if x.get("op") == "all_reduce"
               and x.get("bytes") == ref_bytes and "busbw_GBps" in x]  # fmt: skip
        if got and min(got) < floor:
            out[node] = f"all_reduce busbw {min(got):.0f} GB/s at {ref_bytes} B < floor {floor:.0f} GB/s for {model}"
    return out


def pair_rounds(nodes: list[str]) -> list[list[tuple[str, str]]]:
    """Every pair of nodes exactly once, in rounds where each node is in at most one pair
    (circle method), so a round's pairs run in parallel."""
    ns = list(nodes) + ([None] if len(nodes) % 2 else [])
    n = len(ns)
    rounds = []
    for _ in range(n - 1):
        pairs = [(ns[i], ns[n - 1 - i]) for i in range(n // 2)]
        rounds.append([tuple(sorted(p)) for p in pairs if None not in p])
        ns = [ns[0], ns[-1], *ns[1:-1]]
    return [r for r in rounds if r]


def isolate(single: dict[str, bool], pairs: dict[tuple[str, str], bool]) -> dict[str, Any]:
    """Name the bad node(s) / link(s) from single-node results and pairwise results: a node that
    fails alone, or that fails with every partner while those partners pass elsewhere, is bad; a
    failing pair of otherwise-good nodes is a bad link."""
    bad_nodes = {n for n, ok in single.items() if not ok}
    nodes = [n for n in single if single[n]]
    for n in nodes:
        mine = [ok for (a, b), ok in pairs.items() if n in (a, b)]
        others_ok = any(ok for (a, b), ok in pairs.items() if n not in (a, b))
        if mine and not any(mine) and others_ok:
            bad_nodes.add(n)
    bad_links = sorted(
        f"{a}<->{b}" for (a, b), ok in pairs.items() if not ok and a not in bad_nodes and b not in bad_nodes
    )
    return {"bad_nodes": sorted(bad_nodes), "bad_links": bad_links}


def fleet_verdict(by_node: Mapping, floors: Mapping | None = None, ref_bytes: int = 0,
                  models: Mapping | None = None) -> dict:  # fmt: skip
    """Verdict of the three phases from every node's results: {node: {_nccl_check_single,
    _nccl_check_full, _nccl_check_pairs}} -> ok, culprit ranks, bad/slow nodes, bad links, one line each.
    floors: {GPU model substring: GB/s} for the single-node all_reduce busbw at ref_bytes."""
    single = {n: bool((v.get("_nccl_check_single") or {}).get("ok")) for n, v in by_node.items()}
    full_ranks = [r for v in by_node.values() for r in (v.get("_nccl_check_full") or {}).get("ranks", [])]
    full = judge(full_ranks)
    pairs: dict = {}
    for v in by_node.values():
        for p in v.get("_nccl_check_pairs") or []:
            key = tuple(sorted(p["pair"]))
            pairs[key] = pairs.get(key, True) and bool(p["ok"])
    iso = (
        isolate(single, pairs)
        if pairs
        else {"bad_nodes": sorted(n for n, ok in single.items() if not ok), "bad_links": []}
    )
    slow = slow_nodes(
        {n: (v.get("_nccl_check_single") or {}).get("ranks", []) for n, v in by_node.items()},
        dict(floors or {}),
        dict(models or {}),
        int(ref_bytes),
    )
    ok = all(single.values()) and full["ok"] and not slow
    lines = [
        "phase 1 (each node alone): " + ", ".join(f"{n} {'PASS' if o else 'FAIL'}" for n, o in sorted(single.items())),
        f"phase 2 (full world, {len(full_ranks)} ranks): {full['verdict']}",
    ]
    if pairs:
        lines.append(
            "phase 3 (pairs): " + ", ".join(f"{a}+{b} {'PASS' if o else 'FAIL'}" for (a, b), o in sorted(pairs.items()))
        )
    culprits = []
    if full["culprit_ranks"]:
        culprits.append(f"rank(s) {full['culprit_ranks']} contribute wrong values")
    if iso["bad_nodes"]:
        culprits.append(f"bad node(s): {', '.join(iso['bad_nodes'])}")
    if iso["bad_links"]:
        culprits.append(f"bad link(s): {', '.join(iso['bad_links'])}")
    if full["missing_ranks"]:
        culprits.append(f"rank(s) {full['missing_ranks']} never arrived")
    for n, why in sorted(slow.items()):
        culprits.append(f"slow node {n}: {why}")
    verdict = "PASS: every phase exact" if ok else "FAIL: " + ("; ".join(culprits) or full["verdict"])
    lines.append("verdict: " + verdict)
    return {"ok": ok, "verdict": verdict, "lines": lines, "single": single, "full": full, "slow_nodes": slow,
            "pairs": [{"pair": list(k), "ok": v} for k, v in sorted(pairs.items())], **iso,
            "ranks": full_ranks}  # fmt: skip
