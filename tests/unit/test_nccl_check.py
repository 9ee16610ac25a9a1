"""NCCL check, the rank program: nccl-tests formulas, the command line, the ranks' argv, and real
gloo worlds on this host (one process per rank) with a corrupting rank and a rank that never arrives.
Exact values at any world size: test_nccl_patterns.py; data damaged in transit:
test_nccl_attribution.py; what the results mean: test_nccl_verdict.py."""

import argparse
import contextlib
import itertools
import json
import subprocess
import sys
import time

import pytest

from llmfleet.checks import nccl_check, nccl_verdict


@pytest.mark.parametrize(
    ("op", "world", "factor"),
    [("all_reduce", 8, 2 * 7 / 8), ("all_reduce", 32, 2 * 31 / 32), ("all_gather", 8, 7 / 8),
     ("broadcast", 8, 1.0), ("sendrecv", 8, 1.0), ("all_reduce", 1, 0.0)],
)  # fmt: skip
def test_bus_factor_is_nccl_tests(op, world, factor):
    assert nccl_check.bus_factor(op, world) == pytest.approx(factor)


@pytest.mark.parametrize(("text", "n"), [("8", 8), ("1K", 1024), ("64M", 64 * 2**20), ("1G", 2**30), ("4KB", 4096)])
def test_parse_size(text, n):
    assert nccl_check.parse_size(text) == n


def test_default_sweeps():
    gpu = nccl_check.size_sweep(8, 2**30)
    assert gpu[0] == 8 and gpu[-2:] == [2**29, 2**30]
    assert all(b == a * 4 for a, b in itertools.pairwise(gpu[:-1]))


def test_module_entry_point_checks_its_arguments_without_torch():
    """`python -m llmfleet.checks.nccl_check` is the command every node runs: bad ops/dtypes fail as usage errors."""
    cp = subprocess.run([sys.executable, "-m", "llmfleet.checks.nccl_check", "local", "--nproc", "1", "--backend", "gloo",
                         "--ops", "all_reduce,nope"], capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert cp.returncode == 2 and "unknown op/dtype ['nope']" in cp.stderr
    cp = subprocess.run([sys.executable, "-m", "llmfleet.checks.nccl_check", "rank", "--help"], capture_output=True, text=True,
                        timeout=60, check=False)  # fmt: skip
    assert cp.returncode == 0 and "--corrupt-rank" in cp.stdout
    # The forked launcher checks every rank's arguments as the rank command does, before any rank starts.
    for spec, why in (("{", "--spec: not JSON"), ('{"a": 1}', "--spec: a non-empty JSON list"),
                      ('[["--rank", "5", "--world", "2", "--master", "m", "--port", "1"]]', "--rank 5: must be 0 to 1")):  # fmt: skip
        cp = subprocess.run([sys.executable, "-m", "llmfleet.checks.nccl_check", "ranks", "--spec", spec], capture_output=True,
                            text=True, timeout=60, check=False)  # fmt: skip
        assert cp.returncode == 2 and why in cp.stderr, cp.stderr


def local(*args, timeout=180):
    cp = subprocess.run([sys.executable, "-m", "llmfleet.checks.nccl_check", "local", "--backend", "gloo", "--compact",
                         "--iters", "2", "--warmup", "1", *args], capture_output=True, text=True, timeout=timeout,
                        check=False)  # fmt: skip
    return cp.returncode, json.loads(cp.stdout)


def test_gloo_world_passes_with_exact_values():
    pytest.importorskip("torch")
    rc, out = local("--nproc", "4", "--sizes", "8,4K,256K", "--deadline", "120")
    assert rc == 0 and out["ok"], out["verdict"]
    r0 = out["ranks"][0]["results"]
    assert {(x["op"], x["dtype"]) for x in r0} == {(o, d) for o in nccl_check.OPS for d in nccl_check.DTYPES}
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
    port = str(nccl_check.free_port())
    common = ["--world", "3", "--master", "127.0.0.1", "--port", port, "--backend", "gloo", "--ops", "all_reduce",
              "--sizes", "8", "--iters", "1", "--warmup", "0", "--timeout", "5", "--op-timeout", "5", "--deadline", "40"]  # fmt: skip
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "llmfleet.checks.nccl_check", "rank", "--rank", str(r), *common],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for r in (0, 1)]  # fmt: skip
    outs = [p.communicate(timeout=60)[0] for p in procs]
    elapsed = time.monotonic() - t0
    ranks = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert all(p.returncode in (nccl_check.EXIT_ERROR, nccl_check.EXIT_TIMEOUT) for p in procs)
    verdict = nccl_verdict.judge(ranks)
    assert verdict["missing_ranks"] == [2], (verdict, ranks)
    assert elapsed < 40, f"took {elapsed:.0f}s: the timeouts did not bound it"


def test_ranks_are_bound_to_their_gpus_numa_node_when_known():
    spec = {"python": "/py", "world": 16, "master": "10.0.0.1", "port": 29600, "deadline": 60, "args": ["--backend", "nccl"],
            "numa_nodes": [0, 0, 0, 0, 1, 1, 1, 1], "ranks": [[8 + i, i] for i in range(8)]}  # fmt: skip
    # One process per NUMA node imports torch once and forks that node's ranks.
    groups = nccl_check.numa_groups(spec)
    assert groups == {0: [(8, 0), (9, 1), (10, 2), (11, 3)], 1: [(12, 4), (13, 5), (14, 6), (15, 7)]}
    argv = nccl_check.group_argv(spec, groups[1], 1, "/usr/bin/numactl")
    assert argv[:3] == ["/usr/bin/numactl", "--cpunodebind=1", "--membind=1"]
    assert argv[3:7] == ["/py", "-m", "llmfleet.checks.nccl_check", "ranks"]
    ranks = json.loads(argv[argv.index("--spec") + 1])
    assert [r[:6] for r in ranks] == [
        ["--rank", str(g), "--world", "16", "--local-rank", str(lr)] for g, lr in groups[1]
    ]
    assert ranks[0][ranks[0].index("--timing") + 1] == "eager"  # half the world on this node: across nodes
    assert nccl_check.group_argv(spec, groups[1], 1, None)[0] == "/py"  # no numactl: unbound, not an error
    assert nccl_check.numa_groups({**spec, "numa_nodes": []}) == {None: [(8 + i, i) for i in range(8)]}
    assert nccl_check.group_argv(spec, groups[0], None, "/usr/bin/numactl")[0] == "/py"
    assert nccl_check.rank_args({**spec, "delay_ranks": {"13": 200}}, 13, 5)[-2:] == ["--delay-start", "200"]


def test_each_rank_result_carries_its_wall_time_and_gpu():
    """Phases 2 and 3 derive their deadline from phase 1's wall times (nccl_check_deadline_factor)."""
    from llmfleet.checks.nccl_check import run_node_ranks

    # /bin/false as the Python: no rank runs, and the result still says how long it took and where it was placed.
    spec = {"python": "/bin/false", "world": 1, "master": "127.0.0.1", "port": 1, "deadline": 5,
            "ranks": [[0, 0]], "env": {"CUDA_VISIBLE_DEVICES": "3"}}  # fmt: skip
    (res,) = run_node_ranks(spec)
    assert res["ok"] is False and res["exit"] == 1 and 0 <= res["wall_s"] < 5 and res["gpu"] == "3"


def node_spec(**more):
    from pathlib import Path

    spec = {"python": sys.executable, "pythonpath": str(Path(nccl_check.__file__).resolve().parents[1]), "world": 3,
            "master": "127.0.0.1", "port": nccl_check.free_port(), "deadline": 60, "ranks": [[0, 0], [1, 1], [2, 2]],
            "args": ["--backend", "gloo", "--ops", "all_reduce,sendrecv", "--sizes", "8,1K", "--iters", "1",
                     "--warmup", "0", "--timeout", "10", "--op-timeout", "10"]}  # fmt: skip
    spec.update(more)
    return spec


def test_a_nodes_ranks_are_forked_from_one_import_and_each_is_judged():
    pytest.importorskip("torch")
    ranks = nccl_check.run_node_ranks(node_spec(args=[*node_spec()["args"], "--corrupt-rank", "1"]))
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2]
    assert len({r["forked_from"] for r in ranks}) == 1  # one process imported torch for the node's three ranks
    assert all(r["exit"] == nccl_check.EXIT_WRONG and r["culprit_ranks"] == [1] for r in ranks), ranks
    assert all(r["wall_s"] > 0 and r["node"] for r in ranks)


def test_a_forked_rank_that_never_arrives_is_named_by_its_peers_and_its_watchdog():
    pytest.importorskip("torch")
    ranks = nccl_check.run_node_ranks(node_spec(deadline=15, delay_ranks={"2": 100}))
    by = {r["rank"]: r for r in ranks}
    assert by[2]["exit"] == nccl_check.EXIT_TIMEOUT and "watchdog" in by[2]["error"], by[2]
    assert nccl_verdict.judge(ranks)["missing_ranks"] == [2], ranks


def test_chained_worlds_fork_from_one_import_and_share_the_slowest_previous_wall():
    """Phase 2 starts on each node as soon as its phase 1 has ended, from the same import; its deadline is the
    one the role would derive from every node's phase 1, agreed once every rank has arrived."""
    pytest.importorskip("torch")
    import math
    import threading

    full_port = nccl_check.free_port()

    def node(index: int, delay: dict) -> dict:
        spec = node_spec(world=1, ranks=[[0, 0]], port=nccl_check.free_port(), delay_ranks=delay)
        spec["then"] = {"world": 2, "master": "127.0.0.1", "port": full_port, "ranks": [[index, 0]], "deadline": 60,
                        "deadline_factor": 2, "args": ["--corrupt-rank", "1"], "delay_ranks": {}}  # fmt: skip
        return spec

    got: dict[int, list] = {}
    # node 1's phase 1 is slow: its rank starts 3 s late
    threads = [threading.Thread(target=lambda i=i, d=d: got.__setitem__(i, nccl_check.run_node_worlds(node(i, d))))
               for i, d in ((0, {}), (1, {"0": 3}))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    (single0,), (full0,) = got[0]
    (single1,), (full1,) = got[1]
    assert single0["ok"] and single1["ok"] and single1["wall_s"] >= 3
    assert full0["forked_from"] == single0["forked_from"] and full1["forked_from"] == single1["forked_from"]
    # the then-world's own args (corrupt rank 1) apply to it only, and both ranks judge it
    assert full0["culprit_ranks"] == [1] == full1["culprit_ranks"] and not full0["ok"]
    slowest = max(single0["wall_s"], single1["wall_s"])
    assert full0["deadline_s"] == full1["deadline_s"] == min(60, math.ceil(slowest * 2 + 10)), (full0, full1)


@contextlib.contextmanager
def silent(ip="127.0.0.2", port=0):
    """An address that gives no TCP answer at all, as a node whose fabric is down: a listener whose accept queue
    (backlog 0) is full, so the kernel drops every further SYN. (Public test addresses are no use: a sandbox's
    gateway may accept or refuse anything.)"""
    import socket

    with socket.socket() as full, socket.socket() as filler:
        full.bind((ip, port))
        full.listen(0)
        filler.connect(full.getsockname())  # handshake done, never accepted: the queue is full
        yield full.getsockname()


def test_a_probe_tells_an_answer_from_silence():
    import socket

    with socket.socket() as listening, socket.socket() as closed, silent() as quiet:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: the kernel refuses connections
        addrs = [listening.getsockname(), closed.getsockname(), quiet]
        got = nccl_check.probe(addrs, 1.0)
    assert got == dict(zip(addrs, ["open", "refused", "silent"], strict=True))
    silence = nccl_check.Silence()
    silence.update({("a", 1): "silent", ("b", 1): "refused"}, 10.0)
    silence.update({("a", 1): "silent"}, 12.5)
    assert silence.silent_for(("a", 1), 13.0) == 3.0 and silence.silent_for(("b", 1), 13.0) == 0.0
    silence.update({("a", 1): "refused"}, 14.0)  # an answer ends the silence
    assert silence.silent_for(("a", 1), 15.0) == 0.0


def test_a_rank_on_a_silent_node_is_named_by_rank_0_long_before_the_rendezvous_timeout(monkeypatch):
    """Rank 2's node gives no TCP answer at all: rank 0 names it after --unreachable-after (1 s here) and every
    rank that arrived ends with that reason and the phases it read, not at the 60 s rendezvous timeout. Ranks 0
    and 1 run their real rendezvous over a real TCPStore (threads of this process); only rank 2's node's silence
    is simulated (the store listens on every address at the world's port, so no local listener can be silent
    there): the lab's fabric-down test drops its packets for real."""
    pytest.importorskip("torch")
    import threading

    real_probe = nccl_check.probe
    asked = []

    def probe(addrs, seconds):
        asked.extend(a for a in addrs if a[0] == "10.0.0.3")
        return {**real_probe([a for a in addrs if a[0] != "10.0.0.3"], seconds),
                **{a: "silent" for a in addrs if a[0] == "10.0.0.3"}}  # fmt: skip

    monkeypatch.setattr(nccl_check, "probe", probe)
    port = nccl_check.free_port()
    out: dict[int, BaseException] = {}

    def rank(r: int) -> None:
        a = argparse.Namespace(
            rank=r, world=3, local_rank=r, master="127.0.0.1", port=port, backend="gloo", timing="eager", timeout=60.0,
            unreachable_after=1.0, hosts=["127.0.0.1", "127.0.0.1", "10.0.0.3"], prev_wall=None, deadline_factor=0,
            deadline=45)  # fmt: skip
        try:
            nccl_check.Rank(a).init()
        except BaseException as e:
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    why = (f"rendezvous: rank(s) [2] cut off: their node(s) 10.0.0.3 gave rank 0 no answer at all for 1s (unreachable "
           f"over the fabric, or a firewall drops port {port})")  # fmt: skip
    assert {r: (type(e).__name__, str(e)) for r, e in out.items()} == {r: ("RendezvousCut", why) for r in (0, 1)}
    # rank 1 read every phase before it left rank 0's store; rank 0 reads its own (run_rank's _stalled)
    assert out[1].stalled == {"0": "rendezvous", "1": "rendezvous", "2": "missing"}
    assert asked and set(asked) == {("10.0.0.3", port)}  # rank 0 probed the missing rank's node, nobody else's


def test_a_rank_whose_head_is_silent_says_so_long_before_the_rendezvous_timeout():
    pytest.importorskip("torch")
    args = [*node_spec()["args"], "--unreachable-after", "1", "--timeout", "60"]
    with silent() as (ip, port):
        (r,) = nccl_check.run_node_ranks(node_spec(world=2, ranks=[[1, 0]], master=ip, port=port, deadline=45,
                                                   args=args))  # fmt: skip
    assert r["exit"] == nccl_check.EXIT_TIMEOUT and r["store_unreachable"] is True, r
    assert r["error"] == (f"rank 0's node 127.0.0.2 gave no answer at all (no connection, no refusal) to port {port} "
                          "for 1s: it cannot be reached over the fabric from here, or a firewall drops that port")  # fmt: skip
