"""The stop deadlines of `llmfleet exec`: a stop the deployment needs because something already failed (a peer, a
rank) SIGKILLs the engine after the short --link-stop-timeout (default 1.5 s), a stop on request waits the graceful
--stop-timeout. Real wrapper processes around a double that ignores SIGTERM; no timing is asserted: the record's
reason names the deadline the wrapper applied."""

import json
import os
import signal
import subprocess

from tests.unit.test_wrapper_link import ENGINE, EXIT_PEER_FAILED, PY, WAIT, Node, free_port

# Ignores SIGTERM (a rank stuck in a collective, or a shutdown that waits for peers that are gone).
STUBBORN = [PY, "-c", "import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('engine pid', os.getpid(), flush=True)\ntime.sleep(600)"]  # fmt: skip
DIED = ("(EngineCore pid=7) ERROR 12-04 15:40:02 [multiproc_executor.py:315] Worker proc VllmWorker-1 died "
        "unexpectedly (exit code: -9), shutting down executor.")  # fmt: skip


def test_a_peer_failed_stop_kills_a_stubborn_engine_at_the_short_default_deadline(tmp_path):
    """Before: the default was 5 s, and on the real engine node2's headless vLLM was still shutting down at it."""
    addr = f"127.0.0.1:{free_port()}"
    head = Node(tmp_path, "head", ["--link-listen", addr, "--stop-timeout", "60"], STUBBORN)
    worker = None
    try:
        head.engine_pid()
        worker = Node(tmp_path, "w1", ["--link-head", addr, "--link-wait", "20"], ENGINE)
        os.kill(worker.engine_pid(), signal.SIGKILL)
        assert head.wait() == EXIT_PEER_FAILED
        rec = head.rec()
        assert rec["verdict"] == "peer-failed" and rec["killed_after_timeout"], rec["reason"]
        assert "child ignored SIGTERM for 1.5 s" in rec["reason"], rec["reason"]
        assert "(--link-stop-timeout: a peer failed or a rank died" in rec["reason"], rec["reason"]
    finally:
        head.kill()
        if worker:
            worker.kill()


def test_a_rank_died_stop_kills_a_stubborn_engine_at_the_short_default_deadline(tmp_path):
    code = f"import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint({DIED!r}, flush=True)\n" \
           "time.sleep(600)"  # fmt: skip
    rec = tmp_path / "r.json"
    p = subprocess.run([PY, "-m", "llmfleet", "exec", "--record", str(rec), "--stop-timeout", "60", "--", PY, "-c",
                        code], capture_output=True, text=True, timeout=WAIT, check=False)  # fmt: skip
    r = json.loads(rec.read_text())
    assert p.returncode == 70 and r["verdict"] == "rank-died" and r["killed_after_timeout"], p.stderr[-2000:]
    assert "child ignored SIGTERM for 1.5 s" in r["reason"], r["reason"]


def test_a_stop_on_request_keeps_the_graceful_deadline(tmp_path):
    """systemctl stop on a linked head: the engine gets --stop-timeout (3 s here), not the link's 1.5 s."""
    addr = f"127.0.0.1:{free_port()}"
    head = Node(tmp_path, "head", ["--link-listen", addr, "--stop-timeout", "3"], STUBBORN)
    try:
        head.engine_pid()
        head.p.send_signal(signal.SIGTERM)
        assert head.wait() == 128 + signal.SIGKILL
        rec = head.rec()
        assert rec["verdict"] == "stop-timeout" and "child ignored SIGTERM for 3 s" in rec["reason"], rec["reason"]
        assert "raise --stop-timeout and TimeoutStopSec" in rec["reason"], rec["reason"]
    finally:
        head.kill()


def test_the_link_stop_timeout_is_at_most_the_stop_timeout(tmp_path):
    """A site that sets --stop-timeout below the link's deadline gets its own value for every stop."""
    code = f"import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint({DIED!r}, flush=True)\n" \
           "time.sleep(600)"  # fmt: skip
    rec = tmp_path / "r.json"
    subprocess.run([PY, "-m", "llmfleet", "exec", "--record", str(rec), "--stop-timeout", "1", "--", PY, "-c", code],
                   capture_output=True, text=True, timeout=WAIT, check=False)  # fmt: skip
    assert "child ignored SIGTERM for 1 s" in json.loads(rec.read_text())["reason"]
