"""`llmfleet status` while the nodes of a deployment wait at the deployment link's barrier (no engine started):
the node they wait for is named, with the nodes that wait for it (fake nodes: the real probe, fake systemctl)."""

from __future__ import annotations

import argparse
import json

import pytest
from test_oncall_fakes import Fakes, three_nodes

from llmfleet.oncall import status as oncall_status


@pytest.fixture
def fakes(tmp_path):
    return three_nodes(tmp_path)


def _status(f: Fakes, *argv: str, capsys) -> tuple[int, str]:
    p = argparse.ArgumentParser()
    oncall_status.add_arguments(p)
    rc = oncall_status.run(p.parse_args(["-i", str(f.inventory), *argv]), transport=f.transport())
    return rc, capsys.readouterr().out


def test_the_node_the_others_wait_for_is_named_first(fakes, capsys):
    """Before, status showed three nodes 'activating' and their phases; not that two of them had lost node2."""
    for node, what in (("node1", "waiting for node2 to join (here: node1, node3)"),
                       ("node3", "the head's wrapper at 10.0.0.1:50082 waits for node2 to join")):  # fmt: skip
        fakes.set_unit(node, ActiveState="activating", SubState="start")
        fakes.status_file(node, running=True, link={"role": "head" if node == "node1" else "worker", "node": node,
                          "barrier": {"missing": ["node2"], "what": what, "waiting_s": 42.0}})  # fmt: skip
    fakes.set_unit("node2", ActiveState="activating", SubState="start")
    fakes.status_file("node2", running=True, link={"role": "worker", "node": "node2", "barrier": {
        "missing": [], "what": "waiting for the head's wrapper at 10.0.0.1:50082: timed out"}})  # fmt: skip
    rc, out = _status(fakes, capsys=capsys)
    assert rc == 1
    problems = out.split("UNHEALTHY:", 1)[1].splitlines()
    assert problems[1].strip() == (
        "- node2 is missing at the deployment link: node1, node3 wait for it (down, or cut off from them)"
    ), out
    assert "node2: llmfleet-demo.service: no engine started, at the deployment link: waiting for the head's" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("node1 "))
    assert "link: waiting for node2 to join" in row, out
    rc, out = _status(fakes, "--json", capsys=capsys)
    doc = json.loads(out)
    assert doc["problems"][0].startswith("node2 is missing at the deployment link")
    assert doc["nodes"][0]["units"][0]["barrier"]["missing"] == ["node2"]
