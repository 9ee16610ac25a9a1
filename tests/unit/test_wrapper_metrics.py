"""`llmfleet exec --metrics-dir`: real wrapper processes around tiny children; the .prom file they leave is
parsed with prometheus_client's parser. A metrics problem is one warning line, never another exit code."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from llmfleet.metrics import engine_textfile_name
from llmfleet.wrapper.run import unit_of

PY = sys.executable
WRAP = [PY, "-m", "llmfleet", "exec"]
# The wrapper names its file after its systemd unit; a test run outside a service: after --deployment.
UNIT = unit_of(Path("/proc/self/cgroup").read_text()) or ""
FILE = engine_textfile_name(UNIT, "demo")


def env():
    return {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "CREDENTIALS_DIRECTORY", "INVOCATION_ID")}


def wrap(opts, code):
    return subprocess.run([*WRAP, *opts, "--", PY, "-c", code], capture_output=True, text=True, timeout=60,
                          env=env(), stdin=subprocess.DEVNULL, check=False)  # fmt: skip


def samples(path: Path) -> dict:
    out = {}
    for fam in text_string_to_metric_families(path.read_text()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def one(parsed, name, **labels):
    hits = [v for lab, v in parsed[name] if all(lab.get(k) == x for k, x in labels.items())]
    assert len(hits) == 1, (name, labels, parsed.get(name))
    return hits[0]


def test_exit_3_then_sigkill_counts_both_and_keeps_the_last(tmp_path):
    d = tmp_path / "textfile"
    d.mkdir()
    opts = [
        "--record",
        str(tmp_path / "rec.json"),
        "--metrics-dir",
        str(d),
        "--deployment",
        "demo",
        "--link-node",
        "node1",
    ]
    p = wrap(opts, "import sys; print('Load weight begin.'); sys.exit(3)")
    assert p.returncode == 3 and "warning" not in p.stderr
    m = samples(d / FILE)
    lab = {"deployment": "demo", "node": "node1"}
    assert one(m, "llmfleet_engine_last_termination_info", verdict="exit-code", **lab) == 1
    assert one(m, "llmfleet_engine_last_exit_code", **lab) == 3
    assert one(m, "llmfleet_engine_terminations_total", verdict="exit-code", **lab) == 1
    rec = json.loads((tmp_path / "rec.json").read_text())
    assert one(m, "llmfleet_engine_last_termination_timestamp_seconds") == rec["ended_at"]

    p = wrap(opts, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert p.returncode == 137
    m = samples(d / FILE)
    assert one(m, "llmfleet_engine_last_termination_info", verdict="signal") == 1
    assert [lab for lab, _ in m["llmfleet_engine_last_termination_info"]] == [
        {**lab, "unit": UNIT, "verdict": "signal"}
    ]
    assert one(m, "llmfleet_engine_last_signal") == 9 and one(m, "llmfleet_engine_last_exit_code") == 137
    assert one(m, "llmfleet_engine_terminations_total", verdict="exit-code") == 1
    assert one(m, "llmfleet_engine_terminations_total", verdict="signal") == 1
    assert one(m, "llmfleet_engine_terminations_total", verdict="clean-stop") == 0
    assert stat.S_IMODE((d / FILE).stat().st_mode) == 0o644
    assert sorted(os.listdir(d)) == [FILE]  # no temporary file left


def test_a_metrics_failure_is_one_warning_and_changes_nothing_else(tmp_path):
    rec = tmp_path / "rec.json"
    missing = tmp_path / "no-such-dir"
    p = wrap(["--record", str(rec), "--metrics-dir", str(missing), "--deployment", "demo"], "import sys; sys.exit(3)")
    assert p.returncode == 3
    warnings = [ln for ln in p.stderr.splitlines() if "warning" in ln]
    assert warnings == [f"llmfleet exec: warning: metrics not written to {missing}: metrics directory {missing} "
                        "does not exist: create it (node_exporter's --collector.textfile.directory) or set "
                        "llmfleet_metrics_dir to the directory it reads"]  # fmt: skip
    assert json.loads(rec.read_text())["verdict"] == "exit-code" and not missing.exists()
    if UNIT:
        return  # the rest needs a wrapper outside any systemd service
    # Not in a unit and no --deployment: no name for the file, said once; the exit code stays the engine's.
    d = tmp_path / "textfile"
    d.mkdir()
    p = wrap(["--metrics-dir", str(d)], "import sys; sys.exit(4)")
    assert p.returncode == 4 and "no --deployment: no name for the metrics file" in p.stderr
    assert os.listdir(d) == []


def test_without_metrics_dir_nothing_is_written(tmp_path):
    p = wrap(["--record", str(tmp_path / "rec.json")], "pass")
    assert p.returncode == 70 and sorted(os.listdir(tmp_path)) == ["rec.json"]
