"""The end-of-run check names a test double left running, and the acceptance scenario's destroy step
(fake_openai --stop) stops the double it started - and only that process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import fake_openai, leftovers

ROOT = Path(__file__).resolve().parents[2]


def _wait_for(path: Path, seconds: float = 20) -> None:
    end = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.05)


def test_a_double_left_running_is_named_until_its_destroy_step_stops_it(tmp_path):
    since = time.time() - 1
    pid_file, port_file = tmp_path / "healthy.pid", tmp_path / "healthy.port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.fake_openai", "--lifetime", "60",
         "--port-file", str(port_file), "--pid-file", str(pid_file)],
        cwd=ROOT, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for(port_file)
        assert int(pid_file.read_text()) == proc.pid
        found = {pid: what for pid, _, what, _ in leftovers.processes(since)}
        assert found.get(proc.pid) == "the acceptance checker's test double"
        assert fake_openai.stop(str(pid_file)) == f"{pid_file}: pid {proc.pid} stopped"
        assert proc.wait(timeout=5) == 128 + 15  # SIGTERM, handled: the server was stopped on the way out
        assert proc.pid not in {pid for pid, *_ in leftovers.processes(since)}
        assert not pid_file.exists()
        assert fake_openai.stop(str(pid_file)) == f"{pid_file}: absent, nothing to stop"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stop_never_signals_a_process_that_is_not_the_double(tmp_path):
    pid_file = tmp_path / "wrong.pid"
    pid_file.write_text(str(os.getpid()))  # a pid reused since: this test's own process
    assert fake_openai.stop(str(pid_file)) == f"{pid_file}: pid {os.getpid()} has already ended"
    assert not pid_file.exists()


def test_the_check_says_which_process_was_left(capsys, monkeypatch):
    monkeypatch.setattr(
        leftovers, "processes", lambda since: [(4242, time.time() - 30, "an Ansible async task's wrapper", "x")]
    )
    assert leftovers.main(["--since", "0", "--wait", "0"]) == 1
    out = capsys.readouterr().out
    assert "1 test process(es) outlived the run" in out
    assert "pid 4242 (an Ansible async task's wrapper, started 30 s ago): x" in out
    monkeypatch.setattr(leftovers, "processes", lambda since: [])
    assert leftovers.main(["--since", "0", "--wait", "0"]) == 0
