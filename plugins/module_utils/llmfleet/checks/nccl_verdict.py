"""NCCL check verdicts: what the ranks' JSON results (from llmfleet.checks.nccl_check) say about one
world, and, on the ops host, about the fleet after the three phases (every node alone, the full
world, pairwise rounds): culprit ranks, ranks whose data arrives damaged, bad receivers, damaged
(source -> receiver) paths, ranks that never arrived, bad or slow nodes, bad links.

Pure functions over plain data (stdlib only): the rank program's local launcher judges its world
with judge(), and the nccl_check role's filters call the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _senders(op: str, receiver: int, world: int) -> list[int]:
    """Ranks whose data lands in `receiver`'s result of `op` (the ring sends rank r to rank r + 1)."""
    if op in ("all_reduce", "all_gather"):
        return list(range(world))
    if op == "broadcast":
        return [0]
    return [(receiver - 1) % world]


def _cells(ranks: list[dict[str, Any]]) -> tuple[dict[str, dict[tuple[int, int], int]], dict[str, set[int]]]:
    """{op: {(receiver, source): wrong elements}} and {op: ranks that reported a result of it}."""
    cells: dict[str, dict[tuple[int, int], int]] = {}
    reporters: dict[str, set[int]] = {}
    for r in ranks:
        for x in r.get("results") or []:
            if "skipped" in x or "op" not in x:
                continue
            reporters.setdefault(x["op"], set()).add(int(r["rank"]))
            op_cells = cells.setdefault(x["op"], {})
            for s, c in (x.get("wrong_from") or {}).items():
                key = (int(r["rank"]), int(s))
                op_cells[key] = op_cells.get(key, 0) + int(c)
    return cells, reporters


def _attribute_op(op: str, cells: dict[tuple[int, int], int], got: set[int], world: int) -> tuple[set, set, set]:
    """(damaged sources, bad receivers, (source, receiver) paths) of one op; see attribute()."""
    damaged = set()
    for s in sorted({s for _, s in cells}):
        others = [q for q in got if q != s and s in _senders(op, q, world)]
        if len(others) >= 2 and all((q, s) in cells for q in others):
            damaged.add(s)
    rest = {k for k in cells if k[1] not in damaged}
    bad_rx = {q for q, _ in rest if len({s for qq, s in rest if qq == q}) >= 2}
    return damaged, bad_rx, {(s, q) for q, s in rest if q not in bad_rx}


def attribute(ranks: list[dict[str, Any]], culprits: frozenset[int] | set[int] = frozenset()) -> dict[str, Any]:
    """Name what the per-receiver, per-source wrong counts (`wrong_from` of each result) can honestly name:

    - a source whose data arrived wrong at every other rank that receives it (at least two), although
      its own buffer was right (not a culprit): damaged after it left the rank (its send side);
    - a receiver that got wrong data from several sources: its receive side;
    - otherwise each (source -> receiver) pair that arrived wrong: somewhere on that path (NCCL may relay
      data through other ranks, so this is a path, not necessarily a direct link).
    Damage spread over more than half the world (e.g. during a reduction) is not attributed."""
    world = max([int(r.get("world") or 0) for r in ranks] + [len(ranks), 1])
    cells, reporters = _cells(ranks)
    sources: set[int] = set()
    receivers: set[int] = set()
    transfers: set[tuple[int, int]] = set()
    lines, spread = [], []
    for op in sorted(cells):
        rem = {k: v for k, v in cells[op].items() if k[1] not in culprits}
        damaged, bad_rx, paths = _attribute_op(op, rem, reporters.get(op, set()), world)
        if max(len(damaged), len(bad_rx), len(paths)) * 2 > world > 1:
            spread.append(op)
            lines.append(f"{op}: wrong at ranks {sorted({q for q, _ in rem})} in data of "
                         f"{len({s for _, s in rem})} ranks: spread too wide to name one rank or path")  # fmt: skip
            continue
        lines += [f"{op}: rank {s}'s data arrived wrong at every other rank, though its buffer was right"
                  for s in sorted(damaged)]  # fmt: skip
        lines += [f"{op}: rank {q} received wrong data from ranks {sorted({s for qq, s in rem if qq == q})}"
                  for q in sorted(bad_rx)]  # fmt: skip
        lines += [f"{op}: rank {s}'s data arrived wrong at rank {q}" for s, q in sorted(paths)]
        sources |= damaged
        receivers |= bad_rx
        transfers |= paths
    return {"damaged_sources": sorted(sources), "bad_receivers": sorted(receivers),
            "bad_transfers": [list(p) for p in sorted(transfers)], "unattributed_ops": spread,
            "attribution": lines}  # fmt: skip


def _named(att: dict[str, Any]) -> list[str]:
    named = []
    if att["damaged_sources"]:
        named.append(f"rank(s) {att['damaged_sources']} sent data that arrived wrong everywhere (their send side)")
    if att["bad_receivers"]:
        named.append(f"rank(s) {att['bad_receivers']} received wrong data from several ranks (their receive side)")
    if att["bad_transfers"]:
        named.append("wrong on the way " + ", ".join(f"{s}->{q}" for s, q in att["bad_transfers"]))
    if att["unattributed_ops"]:
        named.append(f"{', '.join(att['unattributed_ops'])}: damage spread over most ranks, check links")
    return named


def _missing(ranks: list[dict[str, Any]]) -> list[int]:
    missing = {int(k) for r in ranks for k, v in (r.get("stalled") or {}).items() if v == "missing"}
    if 0 not in {r.get("rank") for r in ranks} and any(r.get("store_unreachable") for r in ranks):
        missing.add(0)  # rank 0 hosts the store: nobody reached it and it reported nothing
    return sorted(missing)


def judge(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Verdict for one world: ok, the culprit ranks (their buffer was wrong before the collective),
    what the wrong elements' sources say (attribute()), ranks that never arrived or stalled, and one
    line saying so."""
    bad_values = sorted({c for r in ranks for c in r.get("culprit_ranks", [])})
    wrong_ranks = sorted(r["rank"] for r in ranks if r.get("wrong"))
    missing = _missing(ranks)
    errored = sorted(r["rank"] for r in ranks if r.get("error"))
    att = attribute(ranks, set(bad_values))
    named = _named(att)
    ok = all(r.get("ok") for r in ranks) and len(ranks) > 0
    if ok:
        line = f"PASS: {len(ranks)} ranks, every element exact"
    elif bad_values:
        line = f"FAIL: wrong values on ranks {wrong_ranks}; the contribution of rank(s) {bad_values} is wrong"
        line += "".join(f"; {x}" for x in named)
    elif named:
        line = f"FAIL: wrong values on ranks {wrong_ranks}; " + "; ".join(named)
    elif missing:
        line = f"FAIL: rank(s) {missing} never arrived; ranks {errored} gave up"
    elif wrong_ranks:
        line = f"FAIL: wrong values on ranks {wrong_ranks} (no single rank's contribution is at fault: check links)"
    else:
        line = (
            f"FAIL: ranks {errored} failed: "
            + "; ".join(str(r.get("error"))[:120] for r in ranks if r.get("error"))[:400]
        )
    wrong_by_rank = {str(r["rank"]): int(r.get("wrong") or 0) for r in ranks if "rank" in r}
    return {"ok": ok, "culprit_ranks": bad_values, "missing_ranks": missing, "failed_ranks": errored,
            "wrong_ranks": wrong_ranks, "wrong_by_rank": wrong_by_rank, **att, "verdict": line}  # fmt: skip


def floor_for(model: str | None, floors: Mapping | None) -> Any:
    """The busbw floor (GB/s, as configured) of a GPU model, or None: the floor whose name is in the model's name,
    longest name first, so "H200" is not judged by the "H20" floor. The one rule of the check, the report and
    the metrics."""
    names = sorted((n for n in (floors or {}) if n), key=len, reverse=True)
    hit = next((n for n in names if n.lower() in (model or "").lower()), None)
    return None if hit is None else floors[hit]


def slow_nodes(single: dict[str, list[dict[str, Any]]], floors: dict[str, float], models: dict[str, str | None],
               ref_bytes: int) -> dict[str, str]:  # fmt: skip
    """Nodes whose single-node all_reduce busbw at the reference size is below the floor for their
    GPU model: {node: reason}. A model with no floor (or no measurement at that size) is not judged."""
    out = {}
    for node, ranks in single.items():
        model = models.get(node) or ""
        floor = floor_for(model, floors)
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


def cut_off(full: Mapping[str, list[dict[str, Any]]]) -> list[str]:
    """Nodes of the full world ({node: its ranks' results}) whose every rank could not reach rank 0's store
    while every other node's ranks did and missed only theirs: those nodes cannot reach the head over the
    fabric, named from the full world alone (no pairwise rounds needed). [] when nobody reached the store
    (the head's own side) or the others failed for any other reason."""
    cut = [n for n, ranks in full.items() if ranks and all(r.get("store_unreachable") for r in ranks)]
    met = [r for n, ranks in full.items() if n not in cut for r in ranks]
    cut_ranks = {r.get("rank") for n in cut for r in full[n]}
    missing = set(_missing(met))
    return sorted(cut) if cut and met and missing and missing <= cut_ranks else []


def _rest_lines(full_ranks: list[dict[str, Any]], cut: list[str], rest: dict[str, Any] | None, n: int) -> list[str]:
    lines = []
    if cut:
        head = next((r.get("host") for r in full_ranks if r.get("rank") == 0), None) or "rank 0's node"
        lines.append(f"cut off: {', '.join(cut)} could not reach the rendezvous store on {head}, every other node did")
    if rest:
        lines.append(f"phase 2 without {', '.join(cut)} ({n} ranks): {rest['verdict']}")
    return lines


def fleet_verdict(by_node: Mapping, floors: Mapping | None = None, ref_bytes: int = 0,
                  models: Mapping | None = None) -> dict:  # fmt: skip
    """Verdict of the three phases from every node's results: {node: {_nccl_check_single,
    _nccl_check_full, _nccl_check_pairs}} -> ok, culprit ranks, bad/slow nodes, bad links, one line each.
    floors: {GPU model substring: GB/s} for the single-node all_reduce busbw at ref_bytes."""
    single = {n: bool((v.get("_nccl_check_single") or {}).get("ok")) for n, v in by_node.items()}
    full_ranks = [r for v in by_node.values() for r in (v.get("_nccl_check_full") or {}).get("ranks", [])]
    full = judge(full_ranks)
    cut = cut_off({n: (v.get("_nccl_check_full") or {}).get("ranks", []) for n, v in by_node.items()})
    rest_ranks = [r for v in by_node.values() for r in (v.get("_nccl_check_rest") or {}).get("ranks", [])]
    rest = judge(rest_ranks) if rest_ranks else None
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
    iso["bad_nodes"] = sorted(set(iso["bad_nodes"]) | set(cut))
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
    lines += _rest_lines(full_ranks, cut, rest, len(rest_ranks))
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
    if full["damaged_sources"]:
        culprits.append(f"rank(s) {full['damaged_sources']} send data that arrives wrong (send side)")
    if full["bad_receivers"]:
        culprits.append(f"rank(s) {full['bad_receivers']} receive wrong data (receive side)")
    if full["bad_transfers"]:
        culprits.append("data damaged on the way " + ", ".join(f"{s}->{q}" for s, q in full["bad_transfers"]))
    if full["missing_ranks"]:
        culprits.append(f"rank(s) {full['missing_ranks']} never arrived")
    for n, why in sorted(slow.items()):
        culprits.append(f"slow node {n}: {why}")
    verdict = "PASS: every phase exact" if ok else "FAIL: " + ("; ".join(culprits) or full["verdict"])
    lines.append("verdict: " + verdict)
    return {"ok": ok, "verdict": verdict, "lines": lines, "single": single, "full": full, "slow_nodes": slow,
            "pairs": [{"pair": list(k), "ok": v} for k, v in sorted(pairs.items())], **iso,
            "cut_off": cut, "rest": rest, "ranks": full_ranks}  # fmt: skip
