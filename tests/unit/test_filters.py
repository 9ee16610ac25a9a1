import pytest
from ansible.errors import AnsibleFilterError

from llmfleet.checks.nccl_verdict import fleet_verdict
from llmfleet.engine.plan import node_plan, router_plan
from llmfleet_filters import (
    FilterModule,
    llmfleet_duplicates,
    llmfleet_engine_plan,
    llmfleet_gpu_claim,
    llmfleet_layout_error,
    llmfleet_nccl_verdict,
    llmfleet_node_order,
    llmfleet_pair_rounds,
    llmfleet_pd_gate_nodes,
    llmfleet_router_plan,
)


@pytest.mark.parametrize(
    ("mapping", "expected"),
    [
        ({}, {}),
        ({"n1": "10.0.0.1", "n2": "10.0.0.2"}, {}),
        ({"n1": "10.0.0.1", "n2": "10.0.0.1"}, {"10.0.0.1": ["n1", "n2"]}),
        ({"n3": "a", "n1": "a", "n2": "b", "n4": "b", "n5": "c"}, {"a": ["n1", "n3"], "b": ["n2", "n4"]}),
        ({"n1": "", "n2": "", "n3": None, "n4": None}, {}),  # unset values are not duplicates
    ],
)
def test_duplicates(mapping, expected):
    assert llmfleet_duplicates(mapping) == expected


def test_duplicates_rejects_non_mapping():
    with pytest.raises(AnsibleFilterError, match="expects a mapping"):
        llmfleet_duplicates(["10.0.0.1", "10.0.0.1"])


def test_registered_name():
    assert FilterModule().filters()["llmfleet_duplicates"] is llmfleet_duplicates


def test_every_filter_name_is_registered():
    assert sorted(FilterModule().filters()) == [
        "llmfleet_accept_table",
        "llmfleet_cache_env",
        "llmfleet_duplicates",
        "llmfleet_engine_bench_tool",
        "llmfleet_engine_plan",
        "llmfleet_engine_profile",
        "llmfleet_engine_record",
        "llmfleet_failed_msg",
        "llmfleet_gate_groups",
        "llmfleet_gpu_claim",
        "llmfleet_gpu_claim_conflicts",
        "llmfleet_gpu_model",
        "llmfleet_gpu_set",
        "llmfleet_gpu_set_error",
        "llmfleet_layout_error",
        "llmfleet_nccl_cut_off",
        "llmfleet_nccl_verdict",
        "llmfleet_node_order",
        "llmfleet_pair_rounds",
        "llmfleet_pd_gate_nodes",
        "llmfleet_pick",
        "llmfleet_router_plan",
        "llmfleet_ssh_argv",
        "llmfleet_systemd_line",
        "llmfleet_timeline_table",
        "llmfleet_wrapper_args",
    ]


def test_pair_rounds_are_lists_for_jinja():
    assert llmfleet_pair_rounds(("n2", "n1", "n3")) == [[["n1", "n3"]], [["n2", "n3"]], [["n1", "n2"]]]


def test_nccl_verdict_is_the_packages():
    by_node = {"n1": {"_nccl_check_single": {"ok": True}, "_nccl_check_full": {"ranks": [{"rank": 0, "ok": True}]}}}
    assert llmfleet_nccl_verdict(by_node) == fleet_verdict(by_node)
    assert llmfleet_nccl_verdict(by_node, {"H200": 400}, 2**30, {"n1": "H200"})["ok"]


def test_engine_plan_is_the_packages_and_plan_errors_are_filter_errors():
    spec = {"profile": "vllm", "model_path": "/models/m", "tp": 2}
    assert llmfleet_engine_plan(spec, 0) == node_plan(spec, 0)
    with pytest.raises(AnsibleFilterError, match=r"TP3 x PP1 = 3 ranks cannot be split evenly over 2 nodes"):
        llmfleet_engine_plan({**spec, "tp": 3, "nnodes": 2, "head_addr": "10.0.0.1", "dist_port": 1}, 0)


PD = [{"name": "n1", "role": "prefill", "url": "http://10.0.0.1:8000"},
      {"name": "n2", "role": "decode", "url": "http://10.0.0.2:8000"}]  # fmt: skip


def test_router_plan_is_the_packages_and_plan_errors_are_filter_errors():
    spec = {"port": 30000, "instances": PD}
    assert llmfleet_router_plan(spec) == router_plan(spec)
    with pytest.raises(AnsibleFilterError, match=r"at least one node with engine_pd_role=prefill and one with decode"):
        llmfleet_router_plan({"port": 30000, "instances": PD[1:]})


def test_pd_gate_nodes_carry_each_instance_api_and_role():
    hv = {
        "n1": {"ansible_host": "10.9.0.1", "ansible_user": "ops",
               "_engine_pd_instance": dict(PD[0], api_base="http://10.9.0.1:8000")},
        "n2": {"ansible_host": "10.9.0.2", "_engine_pd_instance": dict(PD[1], api_base="http://10.9.0.2:8000")},
    }  # fmt: skip
    rows = llmfleet_pd_gate_nodes(hv, ["n1", "n2"])
    assert [(r["name"], r["rank"], r["api_base"], r["pd_role"]) for r in rows] == [
        ("n1", 0, "http://10.9.0.1:8000", "prefill"), ("n2", 1, "http://10.9.0.2:8000", "decode")]  # fmt: skip
    assert rows[0]["ssh"][-1] == "10.9.0.1" and "ops" in rows[0]["ssh"]
    with pytest.raises(AnsibleFilterError, match="n2: no P/D instance planned"):
        llmfleet_pd_gate_nodes({**hv, "n2": {"ansible_host": "10.9.0.2"}}, ["n1", "n2"])


@pytest.mark.parametrize(
    ("hosts", "heads", "expected"),
    [
        (["n1", "n2", "n3"], ["n1"], ["n1", "n2", "n3"]),
        (["n1", "n2", "n3"], ["n3"], ["n3", "n1", "n2"]),  # head first, the others keep play order
        (["n1", "n2"], ["n9"], ["n1", "n2"]),  # a head outside the play (--limit) is not added
        (["n1", "n2"], [], ["n1", "n2"]),
    ],
)
def test_node_order_is_head_first(hosts, heads, expected):
    assert llmfleet_node_order(hosts, heads) == expected


@pytest.mark.parametrize(
    ("tp", "pp", "nnodes", "gpus", "text"),
    [
        (8, 4, 4, 8, ""),
        (2, 2, 2, 2, ""),
        (4, 1, 1, 8, ""),  # fewer ranks than GPUs: a GPU subset is placeable
        (8, 4, 3, 8, "32 ranks cannot be split evenly over 3 nodes"),
        (8, 2, 1, 8, "16 ranks per node, but llmfleet_gpus_per_node=8"),
        (0, 1, 1, 8, "llmfleet_tp_size=0"),
        ("x", 1, 1, 8, "invalid literal"),
    ],
)
def test_layout_error_is_the_engine_plans_rule(tp, pp, nnodes, gpus, text):
    got = llmfleet_layout_error(tp, pp, nnodes, gpus)
    assert (text in got) if text else got == ""
    if not text:  # what validation accepts, the engine plan accepts
        from llmfleet.engine.command import check_layout

        assert check_layout(tp, pp, nnodes, gpus) == tp * pp // nnodes


def test_gpu_claim_is_gpuset_claim_for_jinja():
    got = llmfleet_gpu_claim("demo", {"named": True, "indexes": [2, 3]}, {"api": "30000", "dist": 0, "link": 50082})
    assert got == {"deployment": "demo", "gpus": [2, 3], "ports": {"api": 30000, "link": 50082}}
    assert llmfleet_gpu_claim("demo", {"named": False, "indexes": [0, 1]}, {})["gpus"] == "all"
