"""The ``llmfleet`` command line. Exit codes: 0 good, 1 found a problem, 2 bad usage/input.

Ops-host-only dependencies (fabric, ...) are imported inside the subcommands that need them,
never at module level: node-side programs and Ansible modules import this package too."""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__


def _cmd_node_info(args: argparse.Namespace) -> int:
    from .nodeinfo import gather

    info = gather(nvme=args.nvme, shared=args.shared)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    else:
        for key in sorted(info):
            print(f"{key}: {info[key]}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="llmfleet", description="Bare-metal GPU nodes to a verified LLM endpoint.")
    ap.add_argument("--version", action="version", version=f"llmfleet {__version__}")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")
    p = sub.add_parser("node-info", help="identity and capacity of this node")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--nvme", default="/mnt/nvme", help="node staging disk (default: /mnt/nvme)")
    p.add_argument("--shared", default="/mnt/shared", help="shared-storage mount (default: /mnt/shared)")
    p.set_defaults(func=_cmd_node_info)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not getattr(args, "func", None):
        ap.print_help(sys.stderr)
        return 2
    return args.func(args)
