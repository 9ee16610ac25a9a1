"""What the engine's process group shows in /proc while it runs: which of its processes are workers, and of which
rank, and the /dev/shm segments it maps.

Why: a vLLM worker killed early in start-up is named by no log line (the executor watches its workers only once all
are ready; the engine core's ``WorkerProc initialization failed`` names none, and fails some 14 s later). Its process
is named, though: vLLM sets its title (setproctitle) to ``VLLM::Worker`` and, once the parallel groups exist,
``VLLM::Worker_TP1`` (``_PP1_TP0``, ``_DP0_TP1_EP1``, ...), and its first log lines carry its multiprocessing name
``(VllmWorker-1 pid=P)`` (the global rank). A worker seen in the group that vanishes names its rank.

And: SIGKILL of vLLM's group (a stop deadline) leaves its POSIX shared memory in /dev/shm (measured 2026-12-04 on the
CPU build, TP2: ~700 MiB of ``psm_*`` message queues, ``sem.mp-*``, ``vllm_dist_*-cpushm_*``), which nothing else
removes: RAM lost at every heal. The segments the group mapped are noted while it runs and removed once it is dead.

Captured titles: tests/fixtures/vllm-procs/. Stdlib only, Python >= 3.8 (copied to nodes).
"""

from __future__ import annotations

import os
import re
import stat
import threading
from typing import Any

from .process import pids_in_group

SHM_DIR = "/dev/shm"  # noqa: S108 (read and cleaned, never created in: POSIX shared memory lives there)
# The title's rank part: upper-case group names and numbers joined by '_' (vLLM's setup_proc_title_and_log_prefix).
_WORKER_TITLE = re.compile(r"VLLM::Worker(?:_((?:[A-Z]+\d+_)*[A-Z]+\d+))?")
_RANK_PART = re.compile(r"([A-Z]+)(\d+)")
_TAG = re.compile(r"\(VllmWorker-(\d+) pid=(\d+)\)")  # the worker's multiprocessing name, on its first lines


def read_title(pid: int, proc: str = "/proc") -> str | None:
    """The process's title (its cmdline, NULs as spaces); None when it is gone."""
    try:
        with open(os.path.join(proc, str(pid), "cmdline"), "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace").strip()


def worker_of(title: str | None) -> dict[str, Any] | None:
    """A vLLM worker's title -> {"title", "tp", "pp", ...: its ranks in each parallel group, None when the title names
    none yet}; None for any other process."""
    m = _WORKER_TITLE.match(title or "")
    if not m or (len(title) > m.end() and not title[m.end()].isspace()):
        return None
    out: dict[str, Any] = {"title": m.group(0), "tp": None, "pp": None}
    for name, num in _RANK_PART.findall(m.group(1) or ""):
        out[name.lower()] = int(num)
    return out


def rank_tag(line: str) -> tuple[int, int] | None:
    """(pid, global rank) from a vLLM worker's first log lines ``(VllmWorker-1 pid=12388) ...``."""
    m = _TAG.search(line)
    return (int(m.group(2)), int(m.group(1))) if m else None


def shm_mapped(pid: int, proc: str = "/proc", shm_dir: str = SHM_DIR) -> set[tuple[int, int, int]]:
    """(device major, minor, inode) of the files in shm_dir that the process maps (POSIX shared memory and
    semaphores). By inode, not name: glibc's sem_open creates a semaphore under a temporary name, maps it, links it
    to its real name and unlinks the temporary one, so its creator's maps show ``sem.XXXXXX (deleted)``."""
    keys = set()
    prefix = shm_dir.rstrip("/") + "/"
    try:
        with open(os.path.join(proc, str(pid), "maps"), encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split(None, 5)  # address perms offset dev inode path
                if len(fields) < 6 or not fields[5].startswith(prefix):
                    continue
                major, _sep, minor = fields[3].partition(":")
                try:
                    keys.add((int(major, 16), int(minor, 16), int(fields[4])))
                except ValueError:
                    continue
    except OSError:
        pass
    return keys


def describe(worker: dict[str, Any]) -> str:
    """``rank 1 (VLLM::Worker_TP1, pid 12388)``: the global rank when a log line gave it, else the title's."""
    title = worker.get("title") or "a vLLM worker"
    if worker.get("rank") is not None:
        who = f"rank {worker['rank']}"
    elif worker.get("title") and "_" in worker["title"]:
        who = f"rank {worker['title'].split('_', 1)[1]}"
    else:
        who = "a worker of unknown rank"
    return f"{who} ({title}, pid {worker['pid']})"


class GroupWatch:
    """The engine group's workers and shared memory, from scans of /proc (scan) and the engine's lines (note_line).

    Thread-safe: the output readers call note_line, a watcher thread and the main thread call scan."""

    def __init__(self, proc: str = "/proc", shm_dir: str = SHM_DIR) -> None:
        self.proc, self.shm_dir = proc, shm_dir
        self.lock = threading.Lock()
        self.tags: dict[int, int] = {}  # pid -> global rank, from the log
        self.workers: dict[int, dict[str, Any]] = {}  # worker processes seen alive in the group
        self.shm: set[tuple[int, int, int]] = set()  # (device major, minor, inode) of what the group mapped
        self.gone: dict[str, Any] | None = None  # the first worker that vanished

    def note_line(self, line: str) -> bool:
        """Learn a worker's rank from its line; whether the line named a pid not known before (worth a scan now)."""
        tag = rank_tag(line)
        if tag is None:
            return False
        with self.lock:
            new = tag[0] not in self.tags
            self.tags[tag[0]] = tag[1]
            if tag[0] in self.workers:
                self.workers[tag[0]]["rank"] = tag[1]
        return new

    def scan(self, pgid: int, now: float, *, workers: bool = True, shm: bool = True) -> dict[str, Any] | None:
        """Look at the group now; the first worker found vanished (once), else None. A process counts as a worker
        once seen alive in the group with a worker title or a rank tag (a tag alone, e.g. a replayed log, is not)."""
        live = pids_in_group(pgid, self.proc)
        seen: dict[int, dict[str, Any]] = {}
        keys: set[tuple[int, int, int]] = set()
        for pid in live:
            if workers:
                w = worker_of(read_title(pid, self.proc))
                if w is not None or pid in self.tags:
                    seen[pid] = w or {"title": None, "tp": None, "pp": None}
            if shm:
                keys |= shm_mapped(pid, self.proc, self.shm_dir)
        with self.lock:
            self.shm |= keys
            if not workers:
                return None
            for pid, w in seen.items():
                known = self.workers.setdefault(pid, {"pid": pid, "rank": self.tags.get(pid), "seen_at": now})
                if w.get("title"):
                    known.update(w)
                known.setdefault("title", None)
            vanished = sorted(p for p in self.workers if p not in live)
            if self.gone is None and vanished:
                self.gone = dict(self.workers[vanished[0]], vanished_at=now)
                return dict(self.gone)
        return None

    def remove_shm(self) -> tuple[int, int]:
        """After the group is dead: remove the files in shm_dir that it mapped (same device and inode) and that are
        this account's own regular files (never another account's, never through a link); (files removed, bytes)."""
        count = size = 0
        with self.lock:
            seen = set(self.shm)
        if not seen:
            return 0, 0
        try:
            names = sorted(os.listdir(self.shm_dir))
        except OSError:
            return 0, 0
        for name in names:
            path = os.path.join(self.shm_dir, name)
            try:
                st = os.lstat(path)
                key = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
                if key not in seen or not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    continue
                os.unlink(path)
            except OSError:
                continue
            count, size = count + 1, size + st.st_size
        return count, size
