"""llmfleet_nccl_check: options -> the rank spec handed to nccl_check.run_node_worlds."""

import pytest

import llmfleet_nccl_check as mod
from tests.unit.modules.util import Recorder, fail, job_result, run, undocumented

pytestmark = pytest.mark.usefixtures("module_exits")


def base(tmp_path, **over):
    env = tmp_path / "fabric.env"
    env.write_text("# fabric\nNCCL_SOCKET_IFNAME=eth1\nGLOO_SOCKET_IFNAME = eth1\n")
    return {"python": "/opt/engine/bin/python", "env_file": str(env), "world": 4, "master": "10.0.0.11",
            "port": 29600, "ranks": [[2, 0], ["3", "1"]], **over}  # fmt: skip


def test_options_become_the_rank_spec(monkeypatch, tmp_path):
    ranks = Recorder([[{"rank": 2, "ok": True}, {"rank": 3, "ok": True}]])
    monkeypatch.setattr(mod, "run_node_worlds", ranks)
    res = run(mod, base(tmp_path, backend="nccl", ops=["all_reduce"], sizes=["1M", "8"], iters=3, timeout=10,
                        op_timeout=20, deadline=60, corrupt_rank=3, delay_ranks={3: 1.5}, numa_nodes=[1, ""],
                        unreachable_after=4, hosts=["10.0.0.11", "10.0.0.12"], run_as="llmfleet"))  # fmt: skip
    (spec,) = ranks.args
    assert spec == {
        "python": "/opt/engine/bin/python",
        "run_as": "llmfleet",  # the ranks run as the engine's account
        "pythonpath": "/opt/llmfleet/lib",
        "env": {"NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1"},
        "world": 4,
        "master": "10.0.0.11",
        "port": 29600,
        "ranks": [[2, 0], [3, 1]],
        "args": "--backend nccl --ops all_reduce --sizes 1M,8 --iters 3 --warmup 1 --timeout 10.0 --unreachable-after 4.0 "
        "--op-timeout 20.0 --corrupt-rank 3".split(),
        "deadline": 60.0,
        "hosts": ["10.0.0.11", "10.0.0.12"],
        "delay_ranks": {"3": 1.5},
        "numa_nodes": [1, None],
    }
    assert res["ok"] is True and res["changed"] is False and len(res["ranks"]) == 2
    assert not undocumented(mod, res)


def test_defaults_and_a_failed_rank(monkeypatch, tmp_path):
    ranks = Recorder([[{"rank": 2, "ok": True}, {"rank": 3, "ok": False}]])
    monkeypatch.setattr(mod, "run_node_worlds", ranks)
    res = run(mod, base(tmp_path, env_file=str(tmp_path / "missing.env")))
    (spec,) = ranks.args
    assert spec["env"] == {} and spec["numa_nodes"] == [] and spec["delay_ranks"] == {}
    assert spec["args"][:6] == "--backend gloo --ops all_reduce,broadcast,sendrecv,all_gather --sizes 8,64K,1M".split()
    assert res["ok"] is False


def test_check_mode_runs_no_rank(monkeypatch, tmp_path):
    ranks = Recorder([])
    monkeypatch.setattr(mod, "run_node_worlds", ranks)
    res = run(mod, base(tmp_path), check=True)
    assert ranks.calls == [] and res == {"changed": False, "ranks": [], "ok": True, "skipped_in_check_mode": True}
    assert not undocumented(mod, res)


THEN = {"world": 8, "master": "10.0.0.10", "port": 29601, "ranks": [[4, 0], [5, 1]], "deadline": 90}

BAD = [
    ({"master": None, "port": None}, "missing required arguments: master, port"),
    ({"backend": "mpi"}, "value of backend must be one of: nccl, gloo, got: mpi"),
    ({"world": "four"}, "argument 'world' is of type str and we were unable to convert to int"),
    ({"ranks": [[0]]}, "ranks: [0] is not a [global_rank, local_rank] pair of whole numbers (fix the nccl_check role's rank layout)"),
    ({"ranks": [["a", 1]]}, "ranks: ['a', 1] is not a [global_rank, local_rank] pair"),
    ({"numa_nodes": ["node0"]}, "numa_nodes: 'node0' is not a NUMA node number (or empty)"),
    ({"then": {**THEN, "ranks": [[5]]}}, "then.ranks: [5] is not a [global_rank, local_rank] pair"),
    ({"then": {**THEN, "ranks": [[4, 0], [5, 2]]}}, "then.ranks [[4, 0], [5, 2]]: not the local ranks of ranks [[2, 0], [3, 1]]"),
    ({"then": {**THEN, "world": 20000}}, "then.world: a world of 20000 ranks cannot be checked"),
    ({"then": {k: v for k, v in THEN.items() if k != "port"}}, "missing required arguments: port found in then"),
]  # fmt: skip


@pytest.mark.parametrize(("over", "text"), BAD)
@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
def test_bad_options_fail_naming_them(monkeypatch, tmp_path, over, text, check):
    ranks = Recorder([])
    monkeypatch.setattr(mod, "run_node_worlds", ranks)
    args = {k: v for k, v in base(tmp_path, **over).items() if v is not None}
    assert text in fail(mod, args, check=check)["msg"]
    assert ranks.calls == []


def test_a_python_that_cannot_start_is_a_failure(monkeypatch, tmp_path):
    monkeypatch.setattr(mod, "run_node_worlds", Recorder(raises=FileNotFoundError(2, "No such file or directory")))
    msg = fail(mod, base(tmp_path))["msg"]
    assert msg.startswith("cannot start the NCCL check ranks with /opt/engine/bin/python:")
    assert "check llmfleet_engine_python" in msg


def test_a_chained_world_gets_its_own_rank_layout_and_faults(monkeypatch, tmp_path):
    worlds = Recorder(
        [[{"rank": 2, "ok": True}, {"rank": 3, "ok": True}], [{"rank": 4, "ok": True}, {"rank": 5, "ok": False}]]
    )
    monkeypatch.setattr(mod, "run_node_worlds", worlds)
    then = {**THEN, "ranks": [["4", 0], [5, "1"]], "corrupt_rank": 5, "delay_ranks": {4: 2},
            "hosts": ["10.0.0.10", "10.0.0.11", "10.0.0.12", "10.0.0.13"]}  # fmt: skip
    res = run(mod, base(tmp_path, corrupt_rank=3, then=then))
    (spec,) = worlds.args
    assert spec["then"] == {
        "world": 8,
        "master": "10.0.0.10",
        "port": 29601,
        "ranks": [[4, 0], [5, 1]],
        "hosts": ["10.0.0.10", "10.0.0.11", "10.0.0.12", "10.0.0.13"],
        "deadline": 90.0,
        "deadline_factor": 3.0,
        "args": ["--corrupt-rank", "5"],
        "delay_ranks": {"4": 2},
    }
    assert spec["args"][-2:] == ["--corrupt-rank", "3"]  # the first world's own
    assert res["ok"] is True and res["then_ok"] is False and [r["rank"] for r in res["then_ranks"]] == [4, 5]
    assert not undocumented(mod, res)


def test_detach_returns_a_job_whose_file_gets_the_modules_result(monkeypatch, tmp_path):

    worlds = Recorder([[{"rank": 2, "ok": True}, {"rank": 3, "ok": True}]])
    monkeypatch.setattr(mod, "run_node_worlds", worlds)
    monkeypatch.setenv("ANSIBLE_ASYNC_DIR", str(tmp_path / "async"))
    res = run(mod, base(tmp_path, detach=True))
    assert res["started"] is True and res["finished"] is False and res["changed"] is False
    assert res["results_file"] == str(tmp_path / "async" / res["ansible_job_id"])
    assert not undocumented(mod, res)
    data = job_result(res["results_file"])  # what the module returns (or fails with) without detach
    assert data == {"changed": False, "ranks": [{"rank": 2, "ok": True}, {"rank": 3, "ok": True}], "ok": True}
