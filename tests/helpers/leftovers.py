"""Fail when a test run left llmfleet test processes running: `make test` ends with
`python -m tests.helpers.leftovers --since EPOCH`, which names each process of this user, started at or after
EPOCH, that is one of the suite's test doubles or jobs (fake_openai, Ansible's async_wrapper, the engine
simulator, an llmfleet wrapper or command, a lab node, a detached llmfleet job) and is still there after --wait seconds (a process in the middle
of its exit gets that long). Exit 0 when none is left, 1 naming them (pid, age, command line)."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

# What the suite starts that may outlive the test that started it, by command line or process name.
PATTERNS = (
    ("the acceptance checker's test double", re.compile(r"tests[./]helpers[./]fake_openai")),
    ("an Ansible async task's wrapper", re.compile(r"async_wrapper")),
    ("the engine simulator", re.compile(r"(^|[ /])engine_sim\.py\b")),
    ("an llmfleet command (a wrapper, a job)", re.compile(r"(^|[ /])python3? -m llmfleet\b|/bin/llmfleet ")),
    ("a wrapper test's engine double", re.compile(r"print\('engine pid'")),
    ("a lab node", re.compile(r"tests/lab/node-init\.sh")),
    ("a detached llmfleet job", re.compile(r"^llmfleet-(stage|gate|nccl|job)")),
)


def _boot_time() -> float:
    with open("/proc/stat") as f:
        return next(float(line.split()[1]) for line in f if line.startswith("btime "))


def processes(since: float) -> list[tuple[int, float, str, str]]:
    """(pid, start epoch, what, command line) of this user's matching processes started at or after since."""
    boot, tick, uid, me = _boot_time(), os.sysconf("SC_CLK_TCK"), os.getuid(), os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # ended meanwhile
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] == "Z":  # a zombie holds nothing; its parent reaps it
            continue
        started = boot + int(fields[19]) / tick
        if started < since:
            continue
        for what, pattern in PATTERNS:
            if pattern.search(argv) or pattern.search(comm):
                out.append((int(entry), started, what, argv or f"[{comm}]"))
                break
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--since", type=float, required=True, help="epoch seconds the run started")
    ap.add_argument("--wait", type=float, default=15.0, help="seconds a process may take to end (default 15)")
    a = ap.parse_args(argv)
    end = time.monotonic() + a.wait
    while (left := processes(a.since)) and time.monotonic() < end:
        time.sleep(0.5)
    if not left:
        print("== nothing of the run is left running")
        return 0
    now = time.time()
    print(f"== {len(left)} test process(es) outlived the run (stop them where the test or scenario starts them):")
    for pid, started, what, cmd in sorted(left, key=lambda r: r[1]):
        print(f"  pid {pid} ({what}, started {now - started:.0f} s ago): {cmd[:300]}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
