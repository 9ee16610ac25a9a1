"""One node's engine plan (what the engine role's unit is built from): argv and its ExecStart and
shell lines, the READY rule, API or not, ranks per node, loader fan-out, and layout errors."""

import types

import pytest

from llmfleet import engines
from llmfleet.engine import command as engine
from llmfleet.engine.command import PlanError
from llmfleet.engine.plan import node_plan, router_plan

# 4 x 8 GPUs, TP8 x PP4 (a field deployment's layout), 2 loader threads per rank on shared storage.
SGLANG = {
    "profile": "sglang",
    "model_path": "/models/m",
    "tp": 8,
    "pp": 4,
    "nnodes": 4,
    "head_addr": "10.0.0.11",
    "dist_port": 50080,
    "port": 30000,
    "loader_threads": 2,
    "shared_storage": True,
}


def test_head_and_worker_of_a_multi_node_sglang_deployment():
    head, worker = node_plan(SGLANG, 0), node_plan(SGLANG, 2)
    for rank, p in ((0, head), (2, worker)):
        argv = engine.render_argv(SGLANG, rank)
        assert p["argv"] == argv
        assert p["exec_line"] == engine.systemd_command_line(argv) and p["shell_line"] == engine.shell_line(argv)
        assert p["ranks_per_node"] == 8 and p["nnodes"] == 4
        assert p["fanout"]["readers"] == 4 * 8 * 2 and p["fanout"]["threads_per_rank"] == 2
    assert head["serves_api"] and not worker["serves_api"]
    assert head["ready"] == {"regex": "The server is fired up and ready to roll!", "count": 1}
    assert worker["ready"] == {"regex": "Capture cuda graph end", "count": 8}  # every local rank warm


def test_vllm_pd_is_one_node_whatever_nnodes_says():
    spec = {"profile": "vllm_pd", "model_path": "/models/m", "tp": 4, "nnodes": 2, "pd_role": "decode"}
    p = node_plan(spec, "0")  # rank as a string
    assert p["nnodes"] == 1 and p["ranks_per_node"] == 4 and p["serves_api"]
    assert p["fanout"] == engine.loader_fanout("vllm_pd", 1, 4, None, False)  # default loader threads, local disk
    assert p["ready"] == {"regex": "Application startup complete", "count": 1}  # every instance serves its API


def test_router_plan():
    instances = [{"name": "node1", "role": "prefill", "url": "http://10.0.0.11:8000"},
                 {"name": "node2", "role": "decode", "url": "http://10.0.0.12:8000"}]  # fmt: skip
    p = router_plan({"command": ["/v/bin/vllm-router"], "host": "10.0.0.11", "port": 30000, "instances": instances,
                     "startup_timeout": 600})  # fmt: skip
    assert p["argv"] == engine.render_router_argv({"command": ["/v/bin/vllm-router"], "host": "10.0.0.11",
                                                   "port": 30000, "instances": instances, "startup_timeout": 600})  # fmt: skip
    assert p["exec_line"] == engine.systemd_command_line(p["argv"]) and p["shell_line"] == engine.shell_line(p["argv"])
    # READY once the router logged that every instance answered /health.
    assert p["ready"] == {"regex": "Router ready", "count": 1}
    assert (p["prefill"], p["decode"]) == (["node1"], ["node2"])
    with pytest.raises(PlanError, match="one with decode"):
        router_plan({"port": 30000, "instances": instances[:1]})


def test_defaults_and_a_read_only_mapping():
    """Unset tp/pp/nnodes/loader_threads mean 1/1/1/the engine's default; a read-only mapping will do."""
    spec = types.MappingProxyType({"profile": "vllm", "model_path": "/models/m", "tp": None, "loader_threads": None})
    p = node_plan(spec, 0)
    assert p["ranks_per_node"] == 1 and p["nnodes"] == 1
    assert p["fanout"]["threads_per_rank"] == engines.get("vllm").loader_threads


@pytest.mark.parametrize(
    ("spec", "rank", "message"),
    [
        (dict(SGLANG, tp=3, pp=1), 0, "TP3 x PP1 = 3 ranks cannot be split evenly over 4 nodes"),
        (SGLANG, 4, "node rank 4 outside 0..3"),
        (dict(SGLANG, profile="trtllm"), 0, "engine_profile='trtllm'"),
        (dict(SGLANG, model_path=""), 0, "engine_model_path is empty"),
    ],
)
def test_layout_errors_name_the_variable(spec, rank, message):
    with pytest.raises(PlanError, match=message):
        node_plan(spec, rank)
