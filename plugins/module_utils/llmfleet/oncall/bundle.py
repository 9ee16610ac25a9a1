"""`llmfleet bundle [-i INV] [DEPLOYMENT] -o DIR [--since T]`: an incident bundle in the documented layout
(docs/architecture.md), which `llmfleet why --bundle DIR` reads:

  DIR/bundle.json                         when, inventory, deployment, nodes, files, errors
  DIR/<node>/journal-<unit>.txt           journalctl -u UNIT -o short-iso [--since T]
  DIR/<node>/kernel.txt                   journalctl -k -o short-iso [--since T]
  DIR/<node>/unit-<unit>.show             systemctl show UNIT
  DIR/<node>/termination-<unit>.json      the wrapper's record (absent while a new run of the unit is going)
  DIR/<node>/termination-<unit>.json.N    the rotated records (N = 1 is the run before)
  DIR/<node>/status-<unit>.json           the wrapper's live status
  DIR/<node>/nvidia-smi.txt               nvidia-smi -q, where nvidia-smi exists

for the engine unit and, on the head, the P/D router unit when it exists. Each journal keeps its newest
--max-mib MiB (the kernel log half of that), cut at a line start; bundle.json says how much was dropped.
The bundle is written in a private temporary directory beside DIR (mode 0700, files 0600: logs can hold
sensitive data) and renamed to DIR at the end, so DIR is complete or absent; a node that could not be read
is listed in bundle.json's errors and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, TextIO

from .. import __version__
from ..fleet_inventory import Fleet
from . import common
from .common import AutoTransport, NodeResult, UsageError, where

SCHEMA = "llmfleet.bundle/1"
MIB = 1 << 20
SINCE_RE = re.compile(r"^[0-9A-Za-z :.+@-]{1,64}$")
SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
REQUIRED = ("journal-", "unit-", "kernel.txt")  # a failure to read these is an error; the rest may be absent


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_fleet_arguments(p, timeout=300.0)
    p.add_argument(
        "-o", "--output", required=True, metavar="DIR", help="bundle directory (must not exist, or be empty)"
    )
    p.add_argument(
        "--since",
        metavar="T",
        help="journal entries since T, as journalctl takes it ('2026-11-29 10:00', 'yesterday', --since=-2h)",
    )
    p.add_argument("--max-mib", type=_mib, default=16, help="newest MiB kept per unit journal (default 16)")
    common.add_replica_argument(p)


def _mib(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 4096:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole MiB between 1 and 4096")
    return int(text)


def run(args: argparse.Namespace, transport: Any = None) -> int:
    return common.guarded("bundle", lambda: _run(args, transport))


def check_output(path: str) -> str:
    """The absolute bundle path, or UsageError: it must not exist or be an empty directory in a writable parent."""
    out = os.path.abspath(path)
    if os.path.lexists(out):
        if os.path.islink(out) or not os.path.isdir(out):
            raise UsageError(f"-o {path}: exists and is not a directory: give a new directory name")
        if os.listdir(out):
            raise UsageError(f"-o {path}: directory is not empty: give a new or empty directory")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise UsageError(f"-o {path}: {parent} does not exist: create it first (mkdir -p {parent})")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"-o {path}: {parent} is not writable by this user: write the bundle elsewhere")
    return out


def _write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_bundle(tmp: str, fleet: Fleet, results: list[NodeResult], args: argparse.Namespace) -> dict:
    """The node directories and bundle.json in tmp; returns bundle.json's content."""
    now = time.time()
    doc: dict[str, Any] = {
        "schema": SCHEMA, "created_at": now,
        "created_at_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)), "tool": f"llmfleet {__version__}",
        "inventory": fleet.sources, "deployment": fleet.deployment, "units": [fleet.unit(), fleet.router_unit()],
        "since": args.since, "max_mib": args.max_mib, "nodes": [], "errors": [],
    }  # fmt: skip
    for r in results:
        n = r.node
        entry: dict[str, Any] = {"node": n.name, "rank": n.rank, "head": n.head, "host": n.ssh.host,
                                 "dir": None, "files": [], "absent": [], "error": r.error}  # fmt: skip
        doc["nodes"].append(entry)
        if r.data is None:
            doc["errors"].append(f"{n.name}: nothing collected: {r.error}")
            continue
        if not SAFE_NAME.match(n.name):
            entry["error"] = "inventory name is not a safe directory name"
            doc["errors"].append(f"{n.name}: {entry['error']}: nothing written")
            continue
        entry["dir"] = n.name
        os.mkdir(os.path.join(tmp, n.name), 0o700)
        for name, f in sorted(r.data["files"].items()):
            if "absent" in f:
                entry["absent"].append(f["absent"])
                continue
            if not SAFE_NAME.match(name):
                doc["errors"].append(f"{n.name}: odd file name {name!r} from the node: skipped")
                continue
            data = base64.b64decode(f["data"])
            if f.get("error"):
                msg = f"{n.name}/{name}: {f['error']}"
                if name.startswith(REQUIRED):
                    doc["errors"].append(msg)
                else:
                    entry["absent"].append(msg)
                if not data:
                    continue
            _write(os.path.join(tmp, n.name, name), data)
            entry["files"].append({"name": name, "bytes": len(data), "dropped_bytes": f.get("dropped", 0),
                                   "source": f.get("source")})  # fmt: skip
    _write(os.path.join(tmp, "bundle.json"), (json.dumps(doc, indent=2) + "\n").encode())
    return doc


def _collected_bytes(data: dict) -> tuple[int, int]:
    """(files, bytes) a node's answer holds: each file's base64 length read as bytes, without decoding it."""
    files = [f for f in (data.get("files") or {}).values() if isinstance(f, dict) and "absent" not in f]
    size = 0
    for f in files:
        b64 = str(f.get("data") or "")
        size += len(b64) * 3 // 4 - (len(b64) - len(b64.rstrip("=")))
    return len(files), size


class Progress:
    """Per node, as it answers: collected (files, bytes, seconds) or failed (why), with how many of the fleet are
    done, on stderr (stdout is the summary or the JSON). A line per node whether or not stderr is a terminal: a
    collection is a few answers, each worth keeping in a log."""

    def __init__(self, total: int, stream: TextIO | None = None):
        self.total, self.done, self.bytes = total, 0, 0
        self.stream = stream or sys.stderr
        self.lock = threading.Lock()
        self.t0 = time.monotonic()

    def start(self, timeout: float) -> None:
        self._line(f"bundle: collecting from {self.total} node(s), up to {timeout:g} s each")

    def node(self, name: str, data: dict | None = None, error: str | None = None) -> None:
        with self.lock:
            self.done += 1
            secs = time.monotonic() - self.t0
            if data is not None:
                files, size = _collected_bytes(data)
                self.bytes += size
                what = f"collected {files} file(s), {size / MIB:.1f} MiB"
            else:
                what = f"FAILED: {error}"
            total = f"{self.bytes / MIB:.1f} MiB in all"
            self._line(f"bundle: [{self.done}/{self.total}] {name}: {what} ({secs:.1f} s; {total})")

    def _line(self, text: str) -> None:
        try:
            print(text, file=self.stream, flush=True)
        except (OSError, ValueError):  # a closed or gone stderr never stops the collection
            pass


def _run(args: argparse.Namespace, transport: Any) -> int:
    out = check_output(args.output)
    if args.since is not None and not SINCE_RE.match(args.since):
        raise UsageError(f"--since {args.since!r}: give a time journalctl takes, e.g. '2026-11-29 10:00' or -2h")
    # --replica: that replica's own deployment (its units, records and nodes).
    fleet = common.replica_target(args, "bundle") if getattr(args, "replica", None) else common.fleet_of(args)
    caps = {"journal": args.max_mib * MIB, "kernel": max(1, args.max_mib // 2) * MIB, "record": 4 * MIB,
            "nvidia": 4 * MIB}  # fmt: skip
    t = transport or AutoTransport()

    progress = Progress(len(fleet.nodes))

    def probe(node):
        units = [dict(s, always=s["role"] == "engine") for s in common.unit_specs(fleet, node)]
        spec = {"op": "bundle", "units": units, "since": args.since, "caps": caps}
        try:
            data = common.call_probe(t, node, spec, args.timeout, max_output=(3 * args.max_mib + 64) * MIB * 4 // 3)
        except Exception as e:
            progress.node(node.name, error=str(e) or type(e).__name__)
            raise
        progress.node(node.name, data=data if isinstance(data, dict) else {})
        return data

    progress.start(args.timeout)
    try:
        results = common.fan_out(fleet.nodes, probe)
    finally:
        if transport is None:
            t.close()
    common.check_deployment_known(fleet, results)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", dir=os.path.dirname(out))
    try:
        doc = write_bundle(tmp, fleet, results, args)
        os.rename(tmp, out)  # replaces an empty DIR; the bundle appears whole or not at all
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UsageError(f"-o {args.output}: cannot write the bundle: {e.strerror or e}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        raise
    return _report(args, fleet, out, doc)


def _report(args: argparse.Namespace, fleet: Fleet, out: str, doc: dict) -> int:
    if args.json:
        common.emit_json(dict(doc, path=out))
        return 1 if doc["errors"] else 0
    files = [f for n in doc["nodes"] for f in n["files"]]
    size = sum(f["bytes"] for f in files)
    print(f"bundle {out}: {len(doc['nodes'])} node(s), {len(files)} file(s), {size / MIB:.1f} MiB "
          f"({fleet.unit()}{', since ' + args.since if args.since else ''}; {where(fleet)})")  # fmt: skip
    for n in doc["nodes"]:
        if n["dir"] is None:
            print(f"  {n['node']}: NOT COLLECTED: {n['error']}")
            continue
        cut = [f"{f['name']} (kept the newest {f['bytes'] / MIB:.1f} MiB, dropped {f['dropped_bytes'] / MIB:.1f} MiB)"
               for f in n["files"] if f["dropped_bytes"]]  # fmt: skip
        print(f"  {n['node']}: {len(n['files'])} file(s){'; ' + '; '.join(cut) if cut else ''}")
        for a in n["absent"]:
            print(f"    not there: {a}")
    for e in doc["errors"]:
        print(f"ERROR: {e}")
    print(f"next: llmfleet why --bundle {out}")
    return 1 if doc["errors"] else 0
