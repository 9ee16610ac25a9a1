"""`llmfleet logs` and `logs --first-failed` against fake nodes."""

from __future__ import annotations

import argparse
import json
import time

import pytest
from test_oncall_fakes import Fakes, three_nodes

from llmfleet.oncall import logs as oncall_logs
from llmfleet.oncall.logs import INCIDENT_GAP_S, journal_time

NOW = time.time()


@pytest.fixture
def fakes(tmp_path):
    f = three_nodes(tmp_path)
    for n in f.names:
        f.journal(
            n, "".join(f"{_ts(NOW - 300 + i)} {n} llmfleet-demo[9]: [2026 TP0] INFO step {i}\n" for i in range(100))
        )
    return f


def _ts(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S+0000", time.gmtime(t))


def _logs(f: Fakes, capsys, *argv: str) -> tuple[int, str]:
    p = argparse.ArgumentParser()
    oncall_logs.add_arguments(p)
    rc = oncall_logs.run(p.parse_args(["-i", str(f.inventory), *argv]), transport=f.transport())
    return rc, capsys.readouterr().out


@pytest.mark.parametrize(
    ("line", "epoch", "msg"),
    [
        ("2026-11-29T10:00:00+0000 node1 llmfleet-demo[12]: hello: world", 1795946400.0, "hello: world"),
        ("2026-11-29T11:00:00+01:00 node1 llmfleet-demo[12]: x", 1795946400.0, "x"),
        ("2026-11-29T10:00:00.250000Z node1 kernel: y", 1795946400.25, "y"),
        ("-- No entries --", None, "-- No entries --"),
    ],
)
def test_journal_time(line, epoch, msg):
    t, m = journal_time(line)
    assert (t, m) == (epoch, msg)


def test_tails_per_node(fakes, capsys):
    fakes.set_unit("node1", unit=fakes.router)
    fakes.journal("node1", f"{_ts(NOW)} node1 llmfleet-demo-router[3]: router says hi\n", unit=fakes.router)
    rc, out = _logs(fakes, capsys, "-n", "3")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0] == "==> node1 (node rank 0, head) llmfleet-demo-router.service: last 1 line(s) <=="
    assert lines[2] == "==> node1 (node rank 0, head) llmfleet-demo.service: last 3 line(s) <=="
    assert lines[3].endswith("step 97") and lines[5].endswith("step 99")
    assert "==> node3 (node rank 2) llmfleet-demo.service: last 3 line(s) <==" in lines
    journalctl = [c for c in fakes.calls() if c[2] == "journalctl"]
    assert all(c[3:] == ["-o", "short-iso", "--no-pager", "-u", c[7], "-n", "3"] for c in journalctl)


def test_tails_json_and_unreachable(tmp_path, capsys):
    f = Fakes(tmp_path, ["node1", "node2"], unreachable=("node2",))
    f.set_unit("node1")
    f.journal("node1", "a\nb\n")
    rc, out = _logs(f, capsys, "--json")
    doc = json.loads(out)
    assert rc == 1
    assert doc["nodes"][0]["units"]["llmfleet-demo.service"]["lines"] == ["a", "b"]
    assert "connection refused" in doc["nodes"][1]["error"]


def _failure(f: Fakes, node: str, name: str, at: float, **kw) -> None:
    f.record(node, name, first_error={"line": kw.pop("line", f"error on {node}"), "at": at}, ended_at=at + 5, **kw)


def test_first_failed_from_records(fakes, capsys):
    # an old incident (a day ago, earlier than everything) must not win; an operator's stop is no failure
    _failure(fakes, "node1", "termination.json.3", NOW - 86400, verdict="exit-code")
    _failure(fakes, "node2", "termination.json.1", NOW - 200, verdict="signal", stop_requested=True)
    _failure(fakes, "node3", "termination.json.1", NOW - 120, verdict="exit-code",
             failed_rank={"tp": 1, "pp": 2, "rank": 5}, line="[2026 TP1 PP2] RuntimeError: boom")  # fmt: skip
    _failure(fakes, "node1", "termination.json.1", NOW - 90, verdict="unrequested-exit-0",
             line="(EngineCore pid=1) ERROR remote process exited or there was a network error")  # fmt: skip
    fakes.record("node2", "termination.json", verdict="clean-stop", stop_requested=True)
    rc, out = _logs(fakes, capsys, "--first-failed", "-n", "4")
    assert rc == 1
    lines = out.splitlines()
    assert lines[0].startswith("first failed: node3 (node rank 2), rank 5 (TP1 PP2), llmfleet-demo.service, at ")
    assert "rotated termination record (.1) (exit-code, exit 1)" in lines[1]
    assert "2 failure record(s) on 2 node(s) (node1, node3); next: node1 +30.0 s (unrequested-exit-0)" in lines[1]
    assert lines[2] == "first error: [2026 TP1 PP2] RuntimeError: boom"
    assert lines[3] == "==> node3 llmfleet-demo.service: journal up to 10 s after the failure <=="
    assert len(lines) == 4 + 4
    second = [c for c in fakes.calls() if c[2] == "journalctl"][-1]
    until = int(NOW - 120 + 10)
    assert second[1] == "node3" and second[-4:] == ["--since", f"@{until - 3600}", "--until", f"@{until}"]


def test_first_failed_json(fakes, capsys):
    _failure(fakes, "node2", "termination.json", NOW - 60, verdict="oom-kill", failed_rank=None,
             line="(VllmWorker rank=3 pid=77) ERROR CUDA out of memory")  # fmt: skip
    rc, out = _logs(fakes, capsys, "--first-failed", "--json", "-n", "2")
    doc = json.loads(out)
    ff = doc["first_failed"]
    assert rc == 1 and ff["source"] == "record" and ff["node"] == "node2" and ff["verdict"] == "oom-kill"
    assert ff["rank"] == {"tp": None, "pp": None, "rank": 3}  # from the error line's vLLM tag
    assert len(doc["lines"]) == 2 and doc["unreachable"] == []


def test_incident_gap():
    fails = [{"t": t} for t in (0.0, 100.0, 100.0 + INCIDENT_GAP_S + 1, 100.0 + INCIDENT_GAP_S + 50)]
    assert [f["t"] for f in oncall_logs.latest_incident(fails)] == [fails[2]["t"], fails[3]["t"]]


def test_first_failed_from_journals_without_records(fakes, capsys):
    fakes.journal("node1", f"{_ts(NOW - 50)} node1 llmfleet-demo[1]: [2026 TP0] INFO fine\n"
                           f"{_ts(NOW - 40)} node1 llmfleet-demo[1]: Traceback (most recent call last):\n")  # fmt: skip
    fakes.journal("node2", f"{_ts(NOW - 70)} node2 llmfleet-demo[1]: (APIServer pid=1) WARNING 11-29 10:00:00 [api_server.py:1] Found ulimit, OSError: [Errno 24]\n"
                           f"{_ts(NOW - 45)} node2 llmfleet-demo[1]: (Worker_PP1_TP1 pid=5) ERROR 11-29 10:00:01 [multiproc_executor.py:9] NCCL error: x\n")  # fmt: skip
    rc, out = _logs(fakes, capsys, "--first-failed")
    assert rc == 1
    assert out.splitlines()[0].startswith("first failed: node2 (node rank 1), rank ? (TP1 PP1)")
    assert "no termination record shows a failure" in out and "(Worker_PP1_TP1 pid=5) ERROR 11-29 10:00:01" in out


def test_first_failed_nothing(fakes, capsys):
    rc, out = _logs(fakes, capsys, "--first-failed")
    assert rc == 0 and out.startswith("no failure found")


def test_bad_count(fakes):
    p = argparse.ArgumentParser()
    oncall_logs.add_arguments(p)
    with pytest.raises(SystemExit) as e:
        p.parse_args(["-n", "0"])
    assert e.value.code == 2


def test_first_failed_never_picks_a_node_the_link_stopped(fakes, capsys):
    """The link stops node1 within the second node3's engine failed, and node1's own log may show an error line
    earlier (its ranks lost their peer): node3 is still the first failure."""
    _failure(fakes, "node1", "termination.json.1", NOW - 61, verdict="peer-failed",
             line="(EngineCore pid=1) ERROR remote process exited or there was a network error")  # fmt: skip
    _failure(fakes, "node3", "termination.json.1", NOW - 60, verdict="signal")
    rc, out = _logs(fakes, capsys, "--first-failed", "-n", "2")
    assert rc == 1 and out.startswith("first failed: node3 "), out
