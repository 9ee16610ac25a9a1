"""``llmfleet why``: why did it die. Either an incident bundle on disk (``--bundle DIR``, what ``llmfleet bundle``
writes or a ticket carries), or the deployment now (``-i INVENTORY``, the default): a bundle collected over SSH
into a private temporary directory (``--keep DIR`` keeps it), then the same triage (triage.py).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from typing import Any

from ..cli_grammar import alias
from . import bundle as oncall_bundle
from . import common
from .common import UsageError
from .triage import verdict as triage


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_fleet_arguments(p, timeout=300.0)
    p.add_argument("--bundle", metavar="DIR", help="an incident bundle directory (`llmfleet bundle -o DIR` writes "
                   "one); without it, one is collected from the inventory's nodes now")  # fmt: skip
    p.add_argument("--since", metavar="T", help="collecting: journal entries since T (as journalctl takes it)")
    p.add_argument(
        "-o", "--output", dest="keep", metavar="DIR", help="collecting: keep the bundle in DIR (new or empty)"
    )
    alias(p, "--keep", "-o/--output", "keep")
    common.add_replica_argument(p)


def run(args: argparse.Namespace, transport: Any = None) -> int:
    if args.bundle:
        if args.inventory or args.keep or args.since:
            print("llmfleet why: --bundle reads a bundle on disk; -i/-o/--since collect one: give one or the other",
                  file=sys.stderr)  # fmt: skip
            return 2
        return triage.run(args)
    return common.guarded("why", lambda: _collect_and_analyse(args, transport))


def _collect_and_analyse(args: argparse.Namespace, transport: Any) -> int:
    """One bundle and its verdict; a deployment of replicas gets one per replica (--replica: that one), each verdict
    under a line that names the replica, so that a failure says which replica it is."""
    fleet = common.fleet_of(args)
    if not fleet.replicas:
        if getattr(args, "replica", None):
            common.replica_target(args, "why")  # names the mistake (one instance)
        return _collect_one(args, transport)
    names = [args.replica] if args.replica else list(common.replicas_by_name(fleet))
    if args.json and len(names) > 1:
        raise UsageError(f"{fleet.deployment} runs as replicas ({', '.join(names)}): --json answers for one, "
                         "name it with --replica NAME")  # fmt: skip
    codes = []
    for name in names:
        rargs = argparse.Namespace(**vars(args))
        rargs.replica = name
        sub = common.replica_target(rargs, "why")
        if args.keep and len(names) > 1:
            rargs.keep = os.path.join(args.keep, name)
        if not args.json:
            print(f"replica {name} ({sub.deployment} on {', '.join(n.name for n in sub.nodes)}):", flush=True)
        codes.append(_collect_one(rargs, transport))
    return max(codes)


def _collect_one(args: argparse.Namespace, transport: Any) -> int:
    with tempfile.TemporaryDirectory(prefix="llmfleet-why-") as tmp:  # mode 0700: journals may hold secrets
        out = args.keep or os.path.join(tmp, "bundle")
        bargs = argparse.Namespace(**vars(args))
        bargs.output, bargs.max_mib, bargs.json = out, 16, True
        # A real text stream (Ansible's display, loading the inventory, reconfigures stdout and needs .buffer).
        quiet = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
        with contextlib.redirect_stdout(quiet):
            rc = oncall_bundle.run(bargs, transport)
        quiet.flush()
        said = quiet.buffer.getvalue().decode("utf-8", "replace")
        if rc == 2:
            return 2  # bad input: the bundle command said why on stderr
        if not os.path.isdir(out):
            raise UsageError(f"no bundle was collected: {said.strip()[-500:]}")
        for line in _bundle_errors(said):
            print(f"llmfleet why: not collected: {line}", file=sys.stderr)
        args.bundle = out
        code = triage.run(args)
        if args.keep and not args.json:
            print(f"(the bundle is kept in {out})")
        return code


def _bundle_errors(text: str) -> list[str]:
    try:
        return [str(e) for e in json.loads(text).get("errors", [])]
    except ValueError:
        return []
