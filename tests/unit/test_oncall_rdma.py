"""`llmfleet rdma-proof`: HCA port counters before and after, on a fake sysfs tree the nodes read."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
from test_oncall_fakes import Fakes

from llmfleet.oncall import rdma as oncall_rdma
from llmfleet.oncall.rdma import hca_filter, rails

PORTS = [("mlx5_0", "1"), ("mlx5_1", "1"), ("mlx5_10", "1"), ("mlx5_bond_0", "1"), ("mlx5_1", "2")]


@pytest.mark.parametrize(
    ("env", "want", "missing"),
    [
        ({"NCCL_IB_HCA": "mlx5_0"}, {("mlx5_0", "1")}, []),
        ({"NCCL_IB_HCA": "mlx5_1"}, {("mlx5_1", "1"), ("mlx5_10", "1"), ("mlx5_1", "2")}, []),  # a prefix
        ({"NCCL_IB_HCA": "=mlx5_1"}, {("mlx5_1", "1"), ("mlx5_1", "2")}, []),
        ({"NCCL_IB_HCA": "=mlx5_1:2,mlx5_9"}, {("mlx5_1", "2")}, ["mlx5_9 (NCCL_IB_HCA)"]),
        ({"NCCL_IB_HCA": "^mlx5_bond,mlx5_1"}, {("mlx5_0", "1")}, []),
        ({"NCCL_IB_HCA": "^=mlx5_1"}, {("mlx5_0", "1"), ("mlx5_10", "1"), ("mlx5_bond_0", "1")}, []),
        ({"UCX_NET_DEVICES": "mlx5_0:1,eth0,mlx5_7:1"}, {("mlx5_0", "1")}, ["mlx5_7:1 (UCX_NET_DEVICES)"]),
        ({"UCX_NET_DEVICES": "all"}, set(), []),
        ({}, set(), []),
    ],
)
def test_rails_follow_ncclsyntax(env, want, missing):
    assert rails(env, PORTS) == (want, missing)


def test_hca_filter():
    assert hca_filter("^=mlx5_0:1, mlx5_1") == (True, True, [("mlx5_0", "1"), ("mlx5_1", None)])


def _sysfs(root: Path, words: dict[str, tuple[int, int]]) -> None:
    for hca, (x, r) in words.items():
        d = root / "class" / "infiniband" / hca / "ports" / "1"
        (d / "counters").mkdir(parents=True, exist_ok=True)
        (d / "counters" / "port_xmit_data").write_text(f"{x}\n")
        (d / "counters" / "port_rcv_data").write_text(f"{r}\n")
        (d / "state").write_text("4: ACTIVE\n")
        (d / "link_layer").write_text("Ethernet\n")


def _bump(tmp_path: Path, sysfs: Path, words: dict[str, tuple[int, int]], rc: int = 0) -> str:
    """A CMD that moves the counters (as a benchmark over the fabric would) and exits rc."""
    script = tmp_path / "traffic.py"
    body = "".join(
        f"open({str(sysfs / 'class/infiniband' / h / 'ports/1/counters' / f)!r}, 'w').write('{v}')\n"
        for h, (x, r) in words.items()
        for f, v in (("port_xmit_data", x), ("port_rcv_data", r))
    )
    script.write_text(f"#!{sys.executable}\nprint('traffic')\n{body}raise SystemExit({rc})\n")
    script.chmod(0o755)
    return str(script)


@pytest.fixture
def fleet(tmp_path):
    f = Fakes(tmp_path, ["node1", "node2"])
    (tmp_path / "node1" / "fabric.env").write_text("NCCL_IB_HCA==mlx5_0,mlx5_1\n")
    (tmp_path / "node2" / "fabric.env").write_text("NCCL_IB_HCA=mlx5_0\nUCX_NET_DEVICES=mlx5_1:1\n")
    _sysfs(tmp_path / "sys", {"mlx5_0": (100, 100), "mlx5_1": (7, 7), "mlx5_2": (0, 0)})
    return f


def _proof(f: Fakes, capsys, *argv: str) -> tuple[int, str, str]:
    p = argparse.ArgumentParser()
    oncall_rdma.add_arguments(p)
    args = p.parse_args(["-i", str(f.inventory), "--sysfs-root", str(f.root / "sys"), *argv])
    rc = oncall_rdma.run(args, transport=f.transport())
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_every_rail_carried_traffic(fleet, tmp_path, capsys):
    cmd = _bump(tmp_path, tmp_path / "sys", {"mlx5_0": (1100, 600), "mlx5_1": (8, 7)})
    rc, out, _ = _proof(fleet, capsys, "--", cmd)
    assert rc == 0, out
    assert "traffic" in out  # CMD's own output, passed through
    row = next(ln.split() for ln in out.splitlines() if ln.startswith("node1  mlx5_0:1"))
    assert row[2:7] == ["yes", "3.91", "KiB", "1.95", "KiB"]  # (1100-100) words x 4 bytes = 4000 B
    assert "node1  mlx5_2:1  -" in out and out.rstrip().endswith("every rail carried traffic")


def test_a_silent_rail_is_called_out(fleet, tmp_path, capsys):
    cmd = _bump(tmp_path, tmp_path / "sys", {"mlx5_0": (1100, 600)})
    rc, out, err = _proof(fleet, capsys, "--json", "--", cmd)
    doc = json.loads(out)  # stdout stays JSON: CMD's output went to stderr
    assert "traffic" in err
    assert rc == 1 and doc["ok"] is False and doc["word_bytes"] == 4
    assert doc["called_out"] == [
        "node1: mlx5_1:1 carried no traffic although the fabric env selects it",
        "node2: mlx5_1:1 carried no traffic although the fabric env selects it",  # UCX_NET_DEVICES (KV path)
    ]
    p0 = doc["nodes"][0]["ports"][0]
    assert p0 == {"port": "mlx5_0:1", "rail": True, "state": "4: ACTIVE", "link_layer": "Ethernet",
                  "xmit_bytes": 4000, "rcv_bytes": 2000}  # fmt: skip


def test_sleep_without_rails_is_only_reported(tmp_path, capsys):
    f = Fakes(tmp_path, ["node1"])
    _sysfs(tmp_path / "sys", {"mlx5_0": (1, 1)})
    rc, out, _ = _proof(f, capsys, "--duration", "0.2")
    assert rc == 0 and "over a sleep" in out and "no NCCL_IB_HCA in the fabric env of node1" in out


def test_rail_the_node_lacks_and_a_failing_cmd(fleet, tmp_path, capsys):
    (tmp_path / "node2" / "fabric.env").write_text("NCCL_IB_HCA=mlx5_0,mlx5_7\n")
    cmd = _bump(tmp_path, tmp_path / "sys", {"mlx5_0": (200, 200), "mlx5_1": (9, 9)}, rc=3)
    rc, out, _ = _proof(fleet, capsys, "--", cmd)
    assert rc == 1
    assert "CALLED OUT: node2: the fabric env names mlx5_7 (NCCL_IB_HCA), but" in out
    assert f"CALLED OUT: CMD exited 3: {cmd}" in out


def test_counter_reset_is_not_a_zero(fleet, tmp_path, capsys):
    cmd = _bump(tmp_path, tmp_path / "sys", {"mlx5_0": (5, 5), "mlx5_1": (8, 8)})
    rc, out, _ = _proof(fleet, capsys, "--", cmd)
    assert rc == 0 and "counter went backwards" in out


def test_unreadable_node(tmp_path, capsys):
    f = Fakes(tmp_path, ["node1", "node2"], unreachable=("node2",))
    _sysfs(tmp_path / "sys", {"mlx5_0": (1, 1)})
    rc, out, _ = _proof(f, capsys, "--duration", "0.1")
    assert rc == 1 and "node2  UNREADABLE: ssh" in out


def test_cmd_not_found_is_bad_input(fleet, capsys):
    rc, _, err = _proof(fleet, capsys, "--", "no-such-benchmark", "--x")
    assert rc == 2 and "CMD 'no-such-benchmark': not found on this host" in err
    assert fleet.calls() == []


def test_remainder_keeps_cmd_flags():
    p = argparse.ArgumentParser()
    oncall_rdma.add_arguments(p)
    args = p.parse_args(["-i", "inv", "--duration", "3", "--", "ansible-playbook", "-i", "x", "--tags", "nccl"])
    assert args.command[args.command[:1] == ["--"] :] == ["ansible-playbook", "-i", "x", "--tags", "nccl"]
    assert args.inventory == ["inv"] and args.duration == 3.0
