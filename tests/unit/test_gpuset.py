"""A deployment's GPUs on a node (llmfleet_gpus) and the claims that keep several deployments on one node apart."""

import json

import pytest

from llmfleet.checks.nccl_check import group_argv, numa_groups, visible_env
from llmfleet.engine import gpuset
from llmfleet.engine.command import PlanError
from llmfleet.engine.plan import node_plan
from tests.unit.test_engine_role import play

# An 8-GPU HGX node as the topology facts give it: GPUs 0-3 on NUMA node 0, 4-7 on node 1, UUIDs from NVML.
TOPO = [{"index": i, "uuid": f"GPU-{i:08x}-aaaa", "numa_node": 0 if i < 4 else 1} for i in range(8)]


def test_unnamed_is_the_whole_node_and_the_engines_first_gpus():
    s = gpuset.resolve([], 8, TOPO, 8)
    assert s == {"named": False, "indexes": list(range(8)), "visible": "", "numa_nodes": [0] * 4 + [1] * 4}


def test_indexes_and_uuids_resolve_in_the_order_given():
    s = gpuset.resolve([4, "5", "GPU-00000006-aaaa", 7], 8, TOPO, 4)
    assert s == {"named": True, "indexes": [4, 5, 6, 7], "visible": "4,5,6,7", "numa_nodes": [1, 1, 1, 1]}


def test_without_topology_indexes_are_checked_against_the_declared_count():
    assert gpuset.resolve([2, 3], 4, [], 2)["visible"] == "2,3"
    with pytest.raises(gpuset.GpuSetError, match=r"names GPU 4, but this node has GPUs 0-3"):
        gpuset.resolve([3, 4], 4, [], 2)


@pytest.mark.parametrize(
    ("gpus", "rpn", "msg"),
    [
        ([0, 0, 1, 2], 4, r"names GPU 0 twice"),
        ([0, 1], 4, r"names 2 GPUs \(\[0, 1\]\), but the deployment runs 4 ranks per node"),
        ([0, 8, 1, 2], 4, r"names GPU 8, but this node has GPUs 0-7"),
        (["GPU-ffffffff-bbbb", 1], 2, r"names GPU-ffffffff-bbbb, which is not a GPU of this node"),
        (["gpu0", 1], 2, r"'gpu0' is neither a GPU index \(0, 1, \.\.\.\) nor a UUID"),
        ([True, 1], 2, r"True is neither a GPU index nor a UUID"),
        ([0, "GPU-00000000-aaaa"], 2, r"names GPU 0 twice"),
    ],
)
def test_bad_gpu_sets_are_refused_with_the_fix(gpus, rpn, msg):
    with pytest.raises(gpuset.GpuSetError, match=msg):
        gpuset.resolve(gpus, 8, TOPO, rpn)


def test_uuids_without_nvml_say_to_use_indexes():
    sysfs_only = [{"index": i, "uuid": None, "numa_node": 0} for i in range(2)]
    with pytest.raises(gpuset.GpuSetError, match="NVML gave no UUIDs here, name the GPUs by index"):
        gpuset.resolve(["GPU-00000000-aaaa"], 2, sysfs_only, 1)


def claim(name, gpus, **ports):
    named = gpus != "all"
    return gpuset.claim(name, {"named": named, "indexes": gpus if named else list(range(8))}, ports)


def test_disjoint_deployments_share_a_node():
    a, b = claim("a", [0, 1, 2, 3], api=30000, dist=50080, link=50082), claim("b", [4, 5, 6, 7], api=30001, dist=50090)
    assert gpuset.conflicts(b, [a]) == [] and gpuset.conflicts(a, [b, a]) == []
    assert b == {"deployment": "b", "gpus": [4, 5, 6, 7], "ports": {"api": 30001, "dist": 50090}}


def test_overlapping_gpus_and_ports_are_named_with_their_owner_and_the_variable_to_change():
    a = claim("a", [0, 1, 2, 3], api=30000, dist=50080)
    msgs = gpuset.conflicts(claim("b", [3, 4, 5, 6], api=30000, dist=50081), [a])
    assert msgs == [
        "GPU 3 already belongs to deployment a (its GPUs: 0, 1, 2, 3): choose others in llmfleet_gpus",
        "port 30000 (api here) is deployment a's api port: set this deployment's engine_port to a free port",
    ]


def test_a_deployment_that_names_no_gpus_owns_the_node():
    whole = claim("whole", "all", api=30000)
    assert whole["gpus"] == "all"
    assert "this deployment names no GPUs" in gpuset.conflicts(whole, [claim("a", [0], api=1)])[0]
    assert "whole names none" in gpuset.conflicts(claim("a", [0], api=1), [whole])[0]


def test_the_plan_hands_the_engine_its_gpus_and_binds_ranks_to_their_numa_nodes():
    spec = {"profile": "vllm", "model_path": "/m/r", "tp": 4, "nnodes": 1, "gpus_per_node": 8, "numa_bind": "auto",
            "gpu_numa_nodes": [t["numa_node"] for t in TOPO], "topo_gpus": TOPO}  # fmt: skip
    # Half a node on one NUMA node: nothing to bind across.
    upper = node_plan({**spec, "gpus": [4, 5, 6, 7]}, 0)
    assert upper["gpus"]["visible"] == "4,5,6,7" and "--numa-bind" not in upper["argv"]
    # Straddling both: each visible GPU's own node, in visible order.
    mixed = node_plan({**spec, "gpus": [2, 3, 4, 5]}, 0)
    i = mixed["argv"].index("--numa-bind-nodes")
    assert mixed["argv"][i + 1 : i + 5] == ["0", "0", "1", "1"]
    with pytest.raises(PlanError, match="names 2 GPUs"):
        node_plan({**spec, "gpus": [0, 1]}, 0)


def test_the_nccl_check_runs_on_the_deployments_gpus():
    env = visible_env("4, 5")
    assert env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "4,5"} and visible_env("") == {}
    spec = {"python": "py", "world": 2, "master": "m", "port": 1, "deadline": 9, "ranks": [[0, 0], [1, 1]],
            "numa_nodes": [1, 1]}  # fmt: skip
    assert numa_groups(spec) == {1: [(0, 0), (1, 1)]}  # both GPUs on NUMA node 1: one process forks both ranks
    argv = group_argv(spec, [(0, 0), (1, 1)], 1, "/usr/bin/numactl")
    assert argv[:3] == ["/usr/bin/numactl", "--cpunodebind=1", "--membind=1"]


def test_the_role_refuses_a_gpu_another_deployment_claimed_on_the_node(tmp_path):
    """The engine role's plan reads the node's claims (one file per deployment) before anything is installed."""
    claims = tmp_path / "etc" / "gpus"
    claims.mkdir(parents=True)
    (claims / "other.json").write_text(json.dumps({"deployment": "other", "gpus": [1], "ports": {"api": 8000}}))
    common = {"llmfleet_config_dir": str(tmp_path / "etc"), "llmfleet_gpus_per_node": 2, "llmfleet_tp_size": 1}
    rc, out, _ = play(tmp_path, llmfleet_gpus=[1], engine_port=8000, **common)
    assert rc == 2, out[-3000:]
    assert ("localhost: deployment demo cannot start here: GPU 1 already belongs to deployment other (its GPUs: 1): "
            "choose others in llmfleet_gpus; port 8000 (api here) is deployment other's api port: set this "
            "deployment's engine_port to a free port") in out  # fmt: skip
    rc, out, _ = play(tmp_path, llmfleet_gpus=[0], engine_port=8001, **common)
    assert rc == 0, out[-3000:]
    rc, out, _ = play(tmp_path, llmfleet_gpus=[0, 1], **common)
    assert rc == 2 and "localhost: llmfleet_gpus names 2 GPUs ([0, 1]), but the deployment runs 1 ranks per node" in out
