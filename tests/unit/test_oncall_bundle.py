"""`llmfleet bundle`: the documented incident bundle layout from fake nodes."""

from __future__ import annotations

import argparse
import json
import os
import stat

import pytest
from test_oncall_fakes import Fakes, three_nodes

from llmfleet.oncall import bundle as oncall_bundle

UNIT = "llmfleet-demo.service"


@pytest.fixture
def fakes(tmp_path):
    f = three_nodes(tmp_path)
    for n in f.names:
        f.journal(n, f"2026-11-29T10:00:00+0000 {n} llmfleet-demo[1]: hello\n")
        f.kernel(n, f"2026-11-29T10:00:01+0000 {n} kernel: Memory cgroup out of memory: Killed process 9\n")
    return f


def _bundle(f: Fakes, out, *argv: str) -> int:
    p = argparse.ArgumentParser()
    oncall_bundle.add_arguments(p)
    return oncall_bundle.run(p.parse_args(["-i", str(f.inventory), "-o", str(out), *argv]), transport=f.transport())


def test_layout(fakes, tmp_path, capsys):
    fakes.record("node2", verdict="exit-code")
    fakes.record("node2", "termination.json.1", verdict="signal")
    fakes.set_unit("node1", unit=fakes.router)
    out = tmp_path / "incident"
    assert _bundle(fakes, out) == 0
    text = capsys.readouterr().out
    assert f"bundle {out}: 3 node(s)" in text and f"next: llmfleet why --bundle {out}" in text
    node2 = sorted(os.listdir(out / "node2"))
    assert node2 == sorted([f"journal-{UNIT}.txt", "kernel.txt", f"status-{UNIT}.json", f"termination-{UNIT}.json",
                            f"termination-{UNIT}.json.1", f"unit-{UNIT}.show", "nvidia-smi.txt"])  # fmt: skip
    assert (out / "node2" / f"journal-{UNIT}.txt").read_text().endswith("llmfleet-demo[1]: hello\n")
    assert "Memory cgroup out of memory" in (out / "node2" / "kernel.txt").read_text()
    show = dict(ln.split("=", 1) for ln in (out / "node2" / f"unit-{UNIT}.show").read_text().splitlines())
    assert show["ActiveState"] == "active" and show["Id"] == UNIT
    assert json.loads((out / "node2" / f"termination-{UNIT}.json").read_text())["verdict"] == "exit-code"
    assert json.loads((out / "node2" / f"termination-{UNIT}.json.1").read_text())["verdict"] == "signal"
    assert "nvidia-smi.txt" not in os.listdir(out / "node3")  # no nvidia-smi there
    assert "journal-llmfleet-demo-router.service.txt" in os.listdir(out / "node1")  # the head's router
    assert not any(n.startswith("journal-llmfleet-demo-router") for n in os.listdir(out / "node2"))
    doc = json.loads((out / "bundle.json").read_text())
    assert doc["schema"] == "llmfleet.bundle/1" and doc["deployment"] == "demo" and doc["errors"] == []
    assert [n["node"] for n in doc["nodes"]] == ["node1", "node2", "node3"] and doc["nodes"][0]["head"]
    assert doc["inventory"] == [str(fakes.inventory)]
    # private: logs can hold sensitive data
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(out / "node2" / "kernel.txt").st_mode) == 0o600
    assert [p for p in os.listdir(tmp_path) if p.startswith(".incident")] == []


def test_journal_cap_keeps_the_newest_whole_lines(fakes, tmp_path, capsys):
    line = "2026-11-29T10:00:00+0000 node1 llmfleet-demo[1]: " + "x" * 60 + " {}\n"
    text = "".join(line.format(i) for i in range(40000))  # ~4.3 MiB
    fakes.journal("node1", text)
    out = tmp_path / "b"
    assert _bundle(fakes, out, "--max-mib", "1") == 0
    data = (out / "node1" / f"journal-{UNIT}.txt").read_bytes()
    assert len(data) <= 1 << 20 and data.endswith(b" 39999\n") and data.startswith(b"2026-11-29T10:00:00+0000 ")
    doc = json.loads((out / "bundle.json").read_text())
    f = next(x for x in doc["nodes"][0]["files"] if x["name"] == f"journal-{UNIT}.txt")
    assert f["dropped_bytes"] + f["bytes"] == len(text) and f["dropped_bytes"] > 3 << 20
    assert f"journal-{UNIT}.txt (kept the newest 1.0 MiB, dropped 3.4 MiB)" in capsys.readouterr().out


def test_unreachable_node_is_recorded_not_half_written(tmp_path, capsys):
    f = Fakes(tmp_path, ["node1", "node2"], unreachable=("node2",))
    f.set_unit("node1")
    out = tmp_path / "b"
    assert _bundle(f, out) == 1
    doc = json.loads((out / "bundle.json").read_text())
    assert doc["nodes"][1]["dir"] is None and "connection refused" in doc["nodes"][1]["error"]
    assert doc["errors"] == [f"node2: nothing collected: {doc['nodes'][1]['error']}"]
    assert sorted(os.listdir(out)) == ["bundle.json", "node1"]
    assert "node2: NOT COLLECTED" in capsys.readouterr().out


def test_since_reaches_journalctl(fakes, tmp_path):
    assert _bundle(fakes, tmp_path / "b", "--since", "2026-11-29 09:00") == 0
    calls = [c for c in fakes.calls() if c[2] == "journalctl"]
    assert calls and all(c[c.index("--since") + 1] == "2026-11-29 09:00" for c in calls)
    assert any("-k" in c for c in calls)


def test_existing_empty_dir_is_fine(fakes, tmp_path):
    (tmp_path / "b").mkdir()
    assert _bundle(fakes, tmp_path / "b") == 0 and (tmp_path / "b" / "bundle.json").exists()


@pytest.mark.parametrize(
    ("setup", "msg"),
    [
        ("nonempty", "directory is not empty"),
        ("file", "exists and is not a directory"),
        ("noparent", "does not exist: create it first"),
    ],
)
def test_bad_output_is_exit_2_before_touching_a_node(fakes, tmp_path, capsys, setup, msg):
    out = tmp_path / "b"
    if setup == "nonempty":
        out.mkdir()
        (out / "x").write_text("keep me")
    elif setup == "file":
        out.write_text("a file")
    else:
        out = tmp_path / "no" / "b"
    assert _bundle(fakes, out) == 2
    assert msg in capsys.readouterr().err
    assert fakes.calls() == []  # refused before any node was asked
    if setup == "nonempty":
        assert (out / "x").read_text() == "keep me"


def test_bad_since(fakes, tmp_path, capsys):
    assert _bundle(fakes, tmp_path / "b", "--since", "$(reboot)") == 2
    assert "--since '$(reboot)'" in capsys.readouterr().err


def test_unknown_deployment(fakes, tmp_path, capsys):
    p = argparse.ArgumentParser()
    oncall_bundle.add_arguments(p)
    args = p.parse_args(["-i", str(fakes.inventory), "other", "-o", str(tmp_path / "b")])
    assert oncall_bundle.run(args, transport=fakes.transport()) == 2
    assert "no node has llmfleet-other.service" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_json(fakes, tmp_path, capsys):
    assert _bundle(fakes, tmp_path / "b", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["path"] == str(tmp_path / "b") and len(doc["nodes"]) == 3


def test_why_reads_what_bundle_writes(fakes, tmp_path):
    """The contract between `bundle` and `why` (docs/architecture.md): a crash collected here is found there."""
    triage = pytest.importorskip("llmfleet.oncall.triage.verdict")
    fakes.set_unit(
        "node2", ActiveState="failed", SubState="failed", Result="exit-code", ExecMainCode=1, ExecMainStatus=1
    )
    fakes.journal("node2", "".join(f"2026-11-29T10:00:00+0000 node2 llmfleet-demo[1]: {m}\n" for m in (
        "Traceback (most recent call last):", '  File "engine.py", line 7, in step', "TypeError: unsupported operand")))  # fmt: skip
    fakes.record("node2", verdict="exit-code", exit_code=1, ended_at=1795946401.0,
                 first_error={"line": "TypeError: unsupported operand", "at": 1795946400.0})  # fmt: skip
    assert _bundle(fakes, tmp_path / "b") == 0
    report = triage.analyse(str(tmp_path / "b"))
    assert report["first_failure"]["node"] == "node2" and "TypeError" in report["first_failure"]["label"]


def test_progress_is_a_line_per_node_on_stderr_collected_or_failed_with_bytes(tmp_path, capsys):
    """Off a terminal (capsys is not one): one line per node as it answers, collected with its files and bytes or
    FAILED with why, and the fleet's count; stdout keeps the summary alone."""
    f = Fakes(tmp_path, ["node1", "node2"], unreachable=("node2",))
    f.set_unit("node1")
    f.journal("node1", "x" * 3000 + "\n")
    assert _bundle(f, tmp_path / "b") == 1
    cap = capsys.readouterr()
    err = cap.err.splitlines()
    assert err[0] == "bundle: collecting from 2 node(s), up to 300 s each", err
    one = next(x for x in err if " node1: " in x)
    two = next(x for x in err if " node2: " in x)
    assert one.startswith("bundle: [") and "node1: collected " in one and " MiB" in one and "/2]" in one
    assert "node2: FAILED: " in two and "connection refused" in two
    assert len(err) == 3 and "bundle:" not in cap.out
    # the bytes said are what the bundle holds
    size = sum(p.stat().st_size for p in (tmp_path / "b" / "node1").iterdir())
    assert f"{size / (1 << 20):.1f} MiB" in one
