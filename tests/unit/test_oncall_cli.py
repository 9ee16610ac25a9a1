"""The on-call commands plugged into the real `llmfleet` parser (cli.PLUGGED, as cli.py wires them)."""

from __future__ import annotations

import pytest

from llmfleet import cli
from llmfleet.oncall import bundle as oncall_bundle
from llmfleet.oncall import logs as oncall_logs
from llmfleet.oncall import rdma as oncall_rdma
from llmfleet.oncall import restart as oncall_restart
from llmfleet.oncall import status as oncall_status
from llmfleet.oncall import stop as oncall_stop

ONCALL = (
    ("status", oncall_status, "is it serving: one line per node"),
    ("logs", oncall_logs, "journal tails per node"),
    ("bundle", oncall_bundle, "collect an incident bundle"),
    ("stop", oncall_stop, "stop a deployment in order"),
    ("restart", oncall_restart, "stop, start in rank order, wait for READY"),
    ("rdma-proof", oncall_rdma, "HCA port counters around CMD"),
)


@pytest.fixture
def plugged(monkeypatch):
    have = {name for name, _, _ in cli.PLUGGED}
    monkeypatch.setattr(cli, "PLUGGED", cli.PLUGGED + tuple(p for p in ONCALL if p[0] not in have))


def test_arguments_through_the_top_level_parser(plugged):
    ap = cli.build_parser()
    a = ap.parse_args(
        ["status", "-i", "inv", "-i", "inv2", "--deployment", "demo", "--json", "-e", "lab_operator=root"]
    )
    assert (a.inventory, a.deployment, a.json, a.extra_vars, a.timeout) == (
        ["inv", "inv2"], "demo", True, ["lab_operator=root"], 30.0)  # fmt: skip
    a = ap.parse_args(["logs", "--first-failed", "-n", "80"])
    assert a.first_failed and a.lines == 80 and a.inventory is None and a.deployment is None
    a = ap.parse_args(["bundle", "-o", "/tmp/b", "--since=-2h"])  # a leading - needs the = form
    assert a.output == "/tmp/b" and a.since == "-2h"
    a = ap.parse_args(["restart", "--deployment", "demo", "--stop-timeout", "30", "--ready-timeout", "900"])
    assert (a.timeout, a.ready_timeout) == (30.0, 900.0)
    a = ap.parse_args(["rdma-proof", "--duration", "5", "--", "ansible-playbook", "-i", "x", "--tags", "nccl"])
    assert a.command[a.command[:1] == ["--"] :] == ["ansible-playbook", "-i", "x", "--tags", "nccl"]


@pytest.mark.parametrize("argv", [["stop", "--timeout", "0"], ["logs", "-n", "x"], ["bundle"], ["status", "a", "b"]])
def test_usage_errors_exit_2(plugged, argv):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2


@pytest.mark.parametrize("cmd", ["status", "logs", "stop", "restart", "rdma-proof"])
def test_no_inventory_is_exit_2_through_main(plugged, capsys, cmd):
    assert cli.main([cmd, "-i", "/nonexistent/inventory"]) == 2
    err = capsys.readouterr().err
    assert err == f"llmfleet {cmd}: inventory /nonexistent/inventory: no such file or directory\n"
