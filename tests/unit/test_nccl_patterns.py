"""The NCCL check's values are exact for every world it accepts: the four collectives simulated on the
CPU in the dtype itself (every partial sum rounded, in several reduction orders) at 128 and 1,024
ranks, every element compared by the rank's own checker; the limit refused before any rank starts."""

import pytest

from llmfleet.checks import nccl_check
from llmfleet.checks.nccl_check import MAX_WORLD, Pattern

torch = pytest.importorskip("torch")

DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def contributions(op, world, n, dtype):
    return torch.stack([Pattern(op, r, world, n).contribution(torch, dtype) for r in range(world)])


def reduce_in_order(c, order):
    """Sum the rows of c in `order`, rounding to c's dtype after every addition (as each hop of a ring does)."""
    acc = torch.zeros_like(c[0])
    for r in order:
        acc = acc + c[r]
    return acc


def reduce_tree(c):
    while c.shape[0] > 1:
        odd = c[-1:] if c.shape[0] % 2 else c[:0]
        c = torch.cat([c[0 : c.shape[0] - len(odd) : 2] + c[1 : c.shape[0] - len(odd) : 2], odd])
    return c[0]


def reduce_ring(c):
    """NCCL's ring reduce-scatter: chunk k starts at rank k + 1 and collects one rank per hop."""
    world, n = c.shape
    pos = torch.arange(n)
    start = (pos * world // n + 1) % world
    acc = torch.zeros_like(c[0])
    for hop in range(world):
        acc = acc + c[(start + hop) % world, pos]
    return acc


def results(op, world, n, dtype, receivers):
    """Each receiver's result of a correct collective, simulated."""
    c = contributions(op, world, n, dtype)
    if op == "all_reduce":
        gen = torch.Generator().manual_seed(world)
        sums = [reduce_in_order(c, range(world)), reduce_in_order(c, reversed(range(world))),
                reduce_in_order(c, torch.randperm(world, generator=gen).tolist()), reduce_tree(c), reduce_ring(c)]  # fmt: skip
        assert all(torch.equal(s, sums[0]) for s in sums)  # the order does not matter: every partial sum is exact
        return {q: sums[2] for q in receivers}
    if op == "broadcast":
        return {q: c[0].clone() for q in receivers}
    if op == "all_gather":
        return {q: c.reshape(-1).clone() for q in receivers}
    return {q: c[(q - 1) % world].clone() for q in receivers}


@pytest.mark.parametrize("world", [2, 3, 128, 1024])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("op", nccl_check.OPS)
def test_every_element_is_exact_at_any_world_size(op, dtype, world):
    assert nccl_check.check_exactness(world, dtype)
    n = 2 * world + 5  # every rank owns all_reduce positions; not a multiple of the world
    receivers = sorted({0, 1, world // 2, world - 1})
    for q, got in results(op, world, n, DT[dtype], receivers).items():
        assert Pattern(op, q, world, n).count_wrong(torch, got) == (0, {}, [])


def test_the_old_pattern_lost_integers_at_128_ranks():
    """What the simulation above catches: the old ((i + rank) % 4) + 1 sums 256 < sum <= 512 in bf16."""
    idx = torch.arange(8)
    c = torch.stack([(((idx + r) % 4) + 1).to(torch.bfloat16) for r in range(128)])
    got = reduce_in_order(c, range(128))
    assert got.tolist() != [320.0] * 8 and 306 <= min(got.tolist()) <= max(got.tolist()) < 320


def test_signatures_are_exact_and_distinct_for_every_accepted_rank():
    src = torch.arange(MAX_WORLD).repeat_interleave(nccl_check.PERIOD)
    idx = torch.arange(nccl_check.PERIOD).repeat(MAX_WORLD)
    v = nccl_check.signature(torch, src, idx)
    assert torch.equal(v.to(torch.bfloat16).to(torch.float32), v)  # 8 significant bits
    assert bool((v >= torch.finfo(torch.bfloat16).tiny).all())  # normal numbers, never zero
    # at every index, the ranks' values differ: data of one rank never passes for another's
    per_index = v.reshape(MAX_WORLD, nccl_check.PERIOD)
    for i in (0, 1, 126):
        assert torch.unique(per_index[:, i]).numel() == MAX_WORLD


@pytest.mark.parametrize("shift", [2**k for k in range(12)])
def test_data_moved_by_a_power_of_two_differs_in_every_element(shift):
    pos = torch.arange(4096)
    v = nccl_check.signature(torch, 5, pos)
    assert bool((nccl_check.signature(torch, 5, pos + shift) != v).all())


def test_a_damaged_element_is_counted_for_the_rank_whose_data_it_carries():
    world, n = 1024, 3000
    got = results("all_reduce", world, n, torch.bfloat16, [7])[7]
    got[517] = got[517] * 2 + 1
    got[1024 + 900] = 0  # lost: the owner's term never arrived
    wrong, per_src, first = Pattern("all_reduce", 7, world, n).count_wrong(torch, got)
    assert (wrong, per_src) == (2, {517: 1, 900: 1})
    assert first[0]["index"] == 517 and first[0]["from"] == 517 and first[1]["got"] == 0.0
    ag = results("all_gather", 8, 16, torch.float32, [3])[3]
    ag[5 * 16 + 2] += 1
    assert Pattern("all_gather", 3, 8, 16).count_wrong(torch, ag)[:2] == (1, {5: 1})


def test_the_comparison_is_chunked_and_still_sees_every_element(monkeypatch):
    monkeypatch.setattr(nccl_check, "CHUNK", 7)
    got = results("sendrecv", 4, 50, torch.float32, [2])[2]
    got[49] = -1
    got[0] = float("nan")
    assert Pattern("sendrecv", 2, 4, 50).count_wrong(torch, got)[:2] == (2, {1: 2})


@pytest.mark.parametrize(("op", "src", "positions"),
                         [("all_reduce", 3, [3]), ("all_reduce", None, [0, 1, 2, 3]), ("all_gather", 2, [20]),
                          ("broadcast", None, [0]), ("broadcast", 1, []), ("sendrecv", 0, [0]), ("sendrecv", 2, [])])  # fmt: skip
def test_in_transit_damage_lands_on_data_of_the_named_source(op, src, positions):
    assert Pattern(op, 1, 4, 10).corrupt_positions(src) == positions


@pytest.mark.parametrize(
    "cmd", [["local", "--nproc"], ["rank", "--rank", "0", "--master", "h", "--port", "1", "--world"]]
)
def test_a_world_too_large_to_be_exact_is_refused_before_any_rank_starts(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        nccl_check.main([*cmd, str(MAX_WORLD + 1), "--backend", "gloo"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{cmd[-1]} {MAX_WORLD + 1}: a world of {MAX_WORLD + 1} ranks cannot be checked" in err
    assert "split the fleet into smaller worlds" in err
    assert nccl_check.world_error(MAX_WORLD) is None and not nccl_check.check_exactness(0, "fp32")


def test_a_rank_outside_its_world_is_refused(capsys):
    with pytest.raises(SystemExit):
        nccl_check.main(["rank", "--rank", "4", "--world", "4", "--master", "h", "--port", "1", "--backend", "gloo"])
    assert "--rank 4: must be 0 to 3 in a world of 4" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "parsed"), [("1:2", (1, 2)), ("*:0", (None, 0)), ("3:*", (3, None)), ("", None)])
def test_parse_transit(text, parsed):
    assert nccl_check.parse_transit(text) == parsed


def test_parse_transit_names_the_bad_value():
    with pytest.raises(Exception, match="'1-2': expected RECEIVER:SOURCE"):
        nccl_check.parse_transit("1-2")


def test_the_module_refuses_such_a_world_before_starting_ranks(monkeypatch, tmp_path, module_exits):
    import llmfleet_nccl_check as mod
    from tests.unit.modules.util import Recorder, fail

    ranks = Recorder([])
    monkeypatch.setattr(mod, "run_node_worlds", ranks)
    args = {"python": "/py", "env_file": str(tmp_path / "none"), "world": MAX_WORLD + 1, "master": "10.0.0.1",
            "port": 29600, "ranks": [[0, 0]]}  # fmt: skip
    assert (
        fail(mod, args)["msg"] == f"world: a world of {MAX_WORLD + 1} ranks cannot be checked: values are exact "
        f"for 1 to {MAX_WORLD} ranks (split the fleet into smaller worlds)"
    )
    assert ranks.calls == []


@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "sendrecv", "all_gather"])
@pytest.mark.parametrize(("world", "n"), [(1, 1), (3, 5), (8, 300), (130, 7), (254, 1000)])
def test_repeated_periods_are_the_formula_at_every_position(op, world, n):
    """expected_values() copies one period instead of computing each element: the same values, bit for bit,
    over any range (all_gather's ranges crossing source blocks)."""
    pat = Pattern(op, world - 1, world, n)
    total = pat.out_numel()
    for dtype in (torch.float32, torch.bfloat16):
        want = pat.expected(torch, torch.arange(total), dtype)[0]
        for lo, hi in ((0, total), (total // 3, total), (1, max(1, total - 1))):
            got = pat.expected_values(torch, lo, hi, dtype, "cpu")
            assert torch.equal(got, want[lo:hi]), (op, world, n, lo, hi, dtype)
