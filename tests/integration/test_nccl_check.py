"""The NCCL check role on the lab: real Gloo worlds across netns nodes (2 ranks per node).
Every fault ends within the configured timeouts and the verdict names the culprit. (The fleet passing with exact
values is checked on site.yml's own NCCL check, in test_collection.py: the same role on the same fresh lab.)"""

import json
import time

from tests.integration.conftest import run_ansible, ssh
from tests.lab.labctl import run


def check(lab, *extra, before=()):
    """nccl_check.yml (after the playbooks `before`, in the same ansible-playbook run): its result, verdict, seconds."""
    t0 = time.monotonic()
    cp = run_ansible("ansible-playbook", *before, "playbooks/nccl_check.yml", *extra, check=False)
    took = time.monotonic() - t0
    raw = ssh(lab, "node1", "cat /var/lib/llmfleet/checks/nccl-check-latest.json").stdout
    return cp, json.loads(raw), took


def test_a_corrupting_rank_is_named(lab):
    # The full world names the culprit; the pairwise rounds (about 100 s here) add nothing to that. The module's
    # first check runs topology.yml first, in the same run (fabric.env: GLOO_SOCKET_IFNAME=eth0).
    spec = {"nccl_check_corrupt_rank": 5, "nccl_check_pairwise": False}
    cp, v, _ = check(lab, "-e", json.dumps(spec), before=["playbooks/topology.yml"])
    assert cp.returncode != 0
    assert v["full"]["culprit_ranks"] == [5] and "rank(s) [5] contribute wrong values" in v["verdict"]


def test_a_rank_that_never_starts_is_named_without_hanging(lab):
    # The late rank's own watchdog ends it at the deadline (shortened here: the verdict is the same).
    spec = {"nccl_check_delay_ranks": {"3": 200}, "nccl_check_pairwise": False, "nccl_check_deadline": 40}
    cp, v, took = check(lab, "-e", json.dumps(spec))
    assert cp.returncode != 0
    assert 3 in v["full"]["missing_ranks"], v["lines"]
    assert took < 200, f"took {took:.0f}s"


def test_a_node_whose_fabric_is_down_is_named(lab):
    """In the lab the management and fabric networks are one link, so `ip link set down` would also cut
    Ansible off. The closest real thing: node3 drops every packet from other hosts except SSH (the
    fabric is down, the management network is up), loopback stays up."""
    ns = lab.node(3).netns
    rules = [["-A", "INPUT", "-i", "lo", "-j", "ACCEPT"], ["-A", "INPUT", "-p", "tcp", "--dport", "22", "-j", "ACCEPT"],
             ["-A", "INPUT", "-j", "DROP"]]  # fmt: skip
    for r in rules:
        run(["ip", "netns", "exec", ns, "iptables", *r])
    try:
        # The lab's 20 s rendezvous timeout: node3 is named by silence (nccl_check_unreachable_after, 5 s) first.
        cp, v, took = check(lab)
    finally:
        run(["ip", "netns", "exec", ns, "iptables", "-F", "INPUT"])
    assert cp.returncode != 0
    assert v["single"]["node3"] is True  # alone, node3 is fine: the fault is its link
    assert v["full"]["ok"] is False
    assert v["bad_nodes"] == ["node3"], v["lines"]
    assert "bad node(s): node3" in v["verdict"]
    # Named from the full world (node3's ranks alone could not reach node1's store); the other three nodes met
    # again without it and passed, so no pairwise round ran.
    assert v["cut_off"] == ["node3"] and v["rest"]["ok"] and v["pairs"] == [], v["lines"]
    assert "phase 2 without node3 (6 ranks): PASS: 6 ranks, every element exact" in v["lines"]
    # Named by silence, not by the rendezvous timeout: node3's ranks heard nothing from node1, and rank 0 nothing
    # from node3, which ended the rendezvous for everyone who had arrived.
    by_rank = {r["rank"]: r for r in v["ranks"]}
    for r in (4, 5):
        assert by_rank[r]["store_unreachable"] and "node 10.77.0.11 gave no answer at all" in by_rank[r]["error"]
    cut = ("rendezvous: rank(s) [4, 5] cut off: their node(s) 10.77.0.13 gave rank 0 no answer at all for 5s "
           "(unreachable over the fabric, or a firewall drops port 29601)")  # fmt: skip
    assert [by_rank[r]["error"] for r in (0, 1, 2, 3, 6, 7)] == [cut] * 6, v["ranks"]
    print(f"link down: verdict in {took:.0f}s")
