"""llmfleet_replicas: the shape the fleet contract checks and the engine role expands (one deployment per
replica), and the argv of the router in front of them."""

import pytest

from llmfleet.engine import replicas
from llmfleet.engine.replicas import ReplicaError, expand, router_argv, router_exec, router_kind

NODES = ["node1", "node2", "node3", "node4"]


def shape(replicas, nodes=NODES, tp=2, pp=1, gpn=2, port=30000):
    return expand(
        replicas, {"deployment": "demo", "nodes": nodes, "tp": tp, "pp": pp, "gpus_per_node": gpn, "port": port}
    )


def refused(replicas, **kw):
    with pytest.raises(ReplicaError) as e:
        shape(replicas, **kw)
    return str(e.value)


def test_two_replicas_of_two_nodes_each_become_two_deployments():
    out = shape([{"name": "r0", "nodes": ["node1", "node2"]}, {"name": "r1", "nodes": ["node3", "node4"]}])
    assert out == [
        {"index": 0, "name": "r0", "deployment": "demo-r0", "nodes": ["node1", "node2"], "gpus": [], "port": 30000,
         "url": "http://node1:30000", "state": "present"},
        {"index": 1, "name": "r1", "deployment": "demo-r1", "nodes": ["node3", "node4"], "gpus": [], "port": 30000,
         "url": "http://node3:30000", "state": "present"},
    ]  # fmt: skip


def test_a_replica_being_removed_keeps_its_nodes_placed_and_shares_nothing():
    """state: absent (scale-in with its nodes still in the inventory): its nodes are not idle, and a present replica
    may take its GPUs or port."""
    out = shape([{"name": "r0", "nodes": NODES[:2]}, {"name": "r1", "nodes": NODES[2:], "state": "absent"}])
    assert [(r["name"], r["state"]) for r in out] == [("r0", "present"), ("r1", "absent")]
    out = shape([{"name": "a", "nodes": ["node1"], "gpus": [0, 1], "state": "absent"},
                 {"name": "b", "nodes": ["node1"], "gpus": [0, 1]}], tp=2, nodes=["node1"])  # fmt: skip
    assert [r["state"] for r in out] == ["absent", "present"]


def test_the_head_leads_its_replica_and_the_router_reaches_it_on_the_fabric():
    out = expand(
        [{"name": "r0", "nodes": ["node2", "node1"]}, {"name": "r1", "nodes": ["node4", "node3"]}],
        {"deployment": "demo", "nodes": NODES, "tp": 2, "pp": 1, "gpus_per_node": 2, "port": 8000,
         "head_hosts": ["node1"], "fabric_ips": {"node1": "10.0.0.1", "node4": "10.0.0.4"}},
    )  # fmt: skip
    assert [(r["nodes"], r["url"]) for r in out] == [
        (["node1", "node2"], "http://10.0.0.1:8000"),
        (["node4", "node3"], "http://10.0.0.4:8000"),
    ]


def test_several_single_node_replicas_per_node_on_disjoint_gpus_and_ports():
    out = shape(
        [
            {"name": "a", "nodes": ["node1"], "gpus": [0, 1], "port": 8001},
            {"name": "b", "nodes": ["node1"], "gpus": ["2", "3"], "port": 8002},
        ],
        nodes=["node1"], tp=2, gpn=4,
    )  # fmt: skip
    assert [(r["deployment"], r["gpus"], r["port"]) for r in out] == [
        ("demo-a", [0, 1], 8001),
        ("demo-b", [2, 3], 8002),
    ]


@pytest.mark.parametrize(
    ("replicas", "says"),
    [
        (None, "is not a list of replicas"),
        ([], "is not a list of replicas"),
        (["r0"], "llmfleet_replicas[0]='r0' is not a mapping"),
        ([{"nodes": NODES}], "llmfleet_replicas[0] has no name"),
        ([{"name": "r0", "nodes": NODES[:2], "gpu": [0]}, {"name": "r1", "nodes": NODES[2:]}], "replica r0: unknown key gpu"),
        ([{"name": "r0", "nodes": NODES[:2]}, {"name": "r0", "nodes": NODES[2:]}], "replica r0: the name is used twice"),
        ([{"name": "R_0", "nodes": NODES[:2]}, {"name": "r1", "nodes": NODES[2:]}], "replica R_0: its deployment='demo-R_0'"),
        ([{"name": "r0", "nodes": "node1"}], "replica r0: nodes='node1' is not a list of node names"),
        ([{"name": "r0", "nodes": ["node1", "node1"]}, {"name": "r1", "nodes": NODES[1:]}], "replica r0 names node1 twice"),
        ([{"name": "r0", "nodes": ["node1", "node9"]}, {"name": "r1", "nodes": NODES[1:]}], "replica r0: node9 not in llmfleet_nodes"),
        ([{"name": "r0", "nodes": NODES[:3]}, {"name": "r1", "nodes": NODES[3:]}], "replica r0 (3 nodes): TP2 x PP1 = 2 ranks cannot be split evenly over 3 nodes"),
        ([{"name": "r0", "nodes": NODES[:2]}], "node3, node4 in llmfleet_nodes but in no replica"),
        ([{"name": "r0", "nodes": NODES[:2], "port": 70000}, {"name": "r1", "nodes": NODES[2:]}], "replica r0: port=70000 is not a TCP port"),
        ([{"name": "r0", "nodes": NODES[:2], "gpus": "0"}, {"name": "r1", "nodes": NODES[2:]}], "replica r0: gpus='0' is not a list"),
        ([{"name": "r0", "nodes": NODES[:2], "state": "gone"}, {"name": "r1", "nodes": NODES[2:]}], "replica r0: state='gone': use present"),
        ([{"name": "r0", "nodes": NODES[:2], "state": "absent"}, {"name": "r1", "nodes": NODES[2:], "state": "absent"}], "every replica is state: absent"),
    ],
)  # fmt: skip
def test_refusals_name_the_replica_and_the_fix(replicas, says):
    assert says in refused(replicas)


def test_a_replica_needs_one_gpu_per_rank_and_its_nodes_gpus():
    msg = refused([{"name": "r0", "nodes": ["node1"], "gpus": [0, 1, 2]}], nodes=["node1"], tp=2, gpn=4)
    assert "replica r0 (1 nodes): llmfleet_gpus names 3 GPUs" in msg
    msg = refused([{"name": "r0", "nodes": ["node1"], "gpus": [3, 4]}], nodes=["node1"], tp=2, gpn=4)
    assert "llmfleet_gpus names GPU 4, but this node has GPUs 0-3" in msg
    msg = refused([{"name": "r0", "nodes": ["node1"]}], nodes=["node1"], tp=8, gpn=4)
    assert "8 ranks per node, but llmfleet_gpus_per_node=4" in msg


def test_replicas_sharing_a_node_need_disjoint_gpus():
    msg = refused(
        [{"name": "a", "nodes": ["node1"], "gpus": [0, 1], "port": 1}, {"name": "b", "nodes": ["node1"], "gpus": [1, 2], "port": 2}],
        nodes=["node1"], gpn=4,
    )  # fmt: skip
    assert "node1: GPU 1 is in replicas a and b: give each disjoint gpus" in msg


def test_replicas_sharing_a_node_name_their_gpus():
    msg = refused([{"name": "a", "nodes": ["node1"], "port": 1}, {"name": "b", "nodes": ["node1"], "gpus": [2, 3], "port": 2}],
                  nodes=["node1"], gpn=4)  # fmt: skip
    assert "node1 holds replicas a, b, and a names no gpus (the whole node)" in msg


def test_replicas_sharing_a_node_need_their_own_ports():
    msg = refused([{"name": "a", "nodes": ["node1"], "gpus": [0, 1]}, {"name": "b", "nodes": ["node1"], "gpus": [2, 3]}],
                  nodes=["node1"], gpn=4)  # fmt: skip
    assert (
        "node1: replicas a and b would both listen on port 30000: give each replica on a shared node its own port"
        in msg
    )


def test_a_multi_node_replica_owns_its_nodes():
    msg = refused(
        [{"name": "a", "nodes": ["node1", "node2"], "gpus": [0]}, {"name": "b", "nodes": ["node2"], "gpus": [1], "port": 9}],
        nodes=["node1", "node2"], tp=1, pp=2,
    )  # fmt: skip
    assert "node2 holds replicas a, b, and a spans several nodes: a multi-node replica owns its nodes" in msg


def test_every_problem_is_listed_at_once():
    msg = refused(
        [{"name": "r0", "nodes": ["node9"]}, {"name": "r0", "nodes": ["node1"], "x": 1}], nodes=["node1"], tp=1
    )
    assert "node9 not in llmfleet_nodes" in msg and "used twice" in msg and "unknown key x" in msg


def test_the_router_is_the_engines_own_unless_named():
    assert router_kind("", "vllm") == "vllm-router"
    assert router_kind("", "sglang") == "sglang-router"
    assert router_kind("", "") == "vllm-router"
    assert router_kind("vllm-router", "sglang") == "vllm-router"
    with pytest.raises(ReplicaError, match="engine_replica_router='nginx': use one of vllm-router, sglang-router"):
        router_kind("nginx", "vllm")


def test_router_argv_lists_every_replica_and_checks_them_often():
    argv = router_argv({"kind": "vllm-router", "command": ["/v/bin/vllm-router"], "host": "10.0.0.9", "port": 30000,
                        "urls": ["http://10.0.0.1:8000", "http://10.0.0.3:8000"], "startup_timeout": 300})  # fmt: skip
    assert argv[:7] == [
        "/v/bin/vllm-router",
        "--host",
        "10.0.0.9",
        "--port",
        "30000",
        "--worker-urls",
        "http://10.0.0.1:8000",
    ]
    assert argv[7] == "http://10.0.0.3:8000"
    assert argv[argv.index("--health-check-interval-secs") + 1] == "1"
    assert argv[argv.index("--health-check-timeout-secs") + 1] == "1"
    assert argv[argv.index("--health-failure-threshold") + 1] == "2"
    assert argv[argv.index("--prometheus-host") + 1] == "10.0.0.9"
    assert argv[argv.index("--worker-startup-timeout-secs") + 1] == "300"
    s = router_argv({"kind": "sglang-router", "port": 30000, "urls": ["http://a:1"]})
    assert s[:6] == ["sglang-router", "launch", "--host", "127.0.0.1", "--port", "30000"]


def test_router_health_settings_from_the_inventory():
    argv = router_argv({"kind": "sglang-router", "port": 30000, "urls": ["http://a:1"],
                        "health": {"timeout": 3, "failures": "4"}})  # fmt: skip
    assert argv[argv.index("--health-check-interval-secs") + 1] == "1"
    assert argv[argv.index("--health-check-timeout-secs") + 1] == "3"
    assert argv[argv.index("--health-failure-threshold") + 1] == "4"


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (
            {"kind": "vllm-router", "port": 30000, "urls": ["http://a:1"], "health": {"every": 1}},
            "engine_replica_router_health.every: not a setting",
        ),
        (
            {"kind": "vllm-router", "port": 30000, "urls": ["http://a:1"], "health": {"timeout": 0}},
            "engine_replica_router_health.timeout=0: a whole number of at least 1",
        ),
        ({"kind": "vllm-router", "port": 30000, "urls": []}, "has no worker"),
        ({"kind": "vllm-router", "port": 0, "urls": ["http://a:1"]}, "engine_replica_router_port=0 is not a TCP port"),
        ({"kind": "haproxy", "port": 1, "urls": ["http://a:1"]}, "engine_replica_router='haproxy'"),
    ],
)
def test_router_argv_refusals(spec, says):
    with pytest.raises(ReplicaError, match=None) as e:
        router_argv(spec)
    assert says in str(e.value)


def test_router_exec_runs_under_the_wrapper_with_the_key_by_credential_name_only():
    w = {"kind": "vllm-router", "record": "/s/r.json", "status": "/s/st.json", "stop_timeout": 20, "extend_timeout": 600,
         "metrics_dir": "/m", "deployment": "demo", "node": "node1", "api_key": True}  # fmt: skip
    out = router_exec(w, ["vllm-router", "--port", "30000"])
    assert out[:9] == ["exec", "--record", "/s/r.json", "--status", "/s/st.json", "--ready-regex", "Router ready",
                       "--ready-count", "1"]  # fmt: skip
    assert out[out.index("--secret-env") + 1] == "OPENAI_API_KEY=api-key"
    assert out[out.index("--") :] == ["--", "vllm-router", "--port", "30000"]
    with pytest.raises(ReplicaError, match="sglang-router takes the replicas' API key only on its command line"):
        router_exec({**w, "kind": "sglang-router"}, ["sglang-router"])
    assert "--secret-env" not in router_exec({**w, "kind": "sglang-router", "api_key": False}, ["sglang-router"])


# What the real engines' /metrics show (vLLM 0.32 CPU build, SGLang 0.5 names as in contrib/grafana): the rollout
# drains a replica until these are 0.
VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="det-model"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="det-model"} 1.0
# HELP vllm:num_requests_running_created a counter's companion, not a gauge of ours
vllm:request_success_total{engine="0",finished_reason="stop",model_name="det-model"} 40.0
"""


@pytest.mark.parametrize(
    ("text", "left"),
    [
        (VLLM_METRICS, 3),
        (VLLM_METRICS.replace("2.0", "0.0").replace("} 1.0", "} 0.0"), 0),
        ('sglang:num_running_reqs{model_name="m"} 4.0\nsglang:num_queue_reqs{model_name="m"} 0.0\n', 4),
        ("vllm:num_requests_running 1\n", 1),  # no labels
        ("# llmfleet engine simulator\nllmfleet_sim_serving 1\n", None),  # no gauge we know: nothing to wait for
        ("", None),
        (None, None),
        ('vllm:num_requests_running{engine="0"} not-a-number\n', None),
    ],
)
def test_in_flight_sums_the_engines_request_gauges(text, left):
    assert replicas.in_flight(text) == left


ROUTER_UNIT = """# {managed}
# llmfleet replicas' router demo: vllm-router in front of the replicas {names}
[Unit]
Description=llmfleet replicas' router demo (vllm-router)

[Service]
ExecStart=/opt/llmfleet/bin/llmfleet exec --record /r.json -- /v/bin/vllm-router --host 127.0.0.1 --port {port} \
--worker-urls {urls} --policy round_robin
"""


def router_unit(urls=("http://10.0.0.1:8000", "http://10.0.0.3:8000"), port=30000, names="demo-r0, demo-r1"):
    return ROUTER_UNIT.format(managed="Ansible managed", names=names, port=port, urls=" ".join(urls))


@pytest.mark.parametrize(
    ("old", "new", "change"),
    [
        (router_unit(), router_unit(), "none"),
        # A replica added or removed: through the router's worker API, no restart (its comment lines follow).
        (router_unit(), router_unit(urls=("http://10.0.0.1:8000",), names="demo-r0"), "workers"),
        (
            router_unit(),
            router_unit(urls=("http://10.0.0.1:8000", "http://10.0.0.3:8000", "http://10.0.0.5:8000")),
            "workers",
        ),
        # Only a comment differs: nothing for the running router.
        (router_unit(), router_unit(names="demo-r0 and demo-r1"), "none"),
        # Its own settings: a restart.
        (router_unit(), router_unit(port=30001), "restart"),
        (router_unit(), router_unit(urls=("http://10.0.0.1:8000",), port=30001), "restart"),
        ("", router_unit(), "restart"),
    ],
)
def test_a_router_unit_that_changes_only_its_replicas_keeps_the_router_running(old, new, change):
    assert replicas.router_unit_change(old, new) == change


@pytest.mark.parametrize(
    ("doc", "urls"),
    [
        ({"urls": ["http://a:8000", "http://b:8000"]}, ["http://a:8000", "http://b:8000"]),  # vllm-router 0.1.17
        ({"workers": [{"id": "x", "url": "http://a:8000", "is_healthy": True}], "total": 1}, ["http://a:8000"]),
        ({}, []),
        (None, []),
        ({"workers": "?"}, []),
    ],
)
def test_the_urls_a_router_lists_from_either_routers_worker_api(doc, urls):
    assert replicas.listed_urls(doc) == urls
