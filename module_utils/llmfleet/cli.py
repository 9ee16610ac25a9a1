"""The ``llmfleet`` command line. Exit codes: 0 good, 1 found a problem, 2 bad usage/input.

Ops-host-only dependencies (fabric, ...) are imported inside the subcommands that need them,
never at module level: node-side programs and Ansible modules import this package too."""

from __future__ import annotations

import argparse
import json
import os
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


def _cmd_checkpoint_verify(args: argparse.Namespace) -> int:
    from .checkpoint import verify

    if not os.path.isdir(args.dir):
        print(f"llmfleet checkpoint verify: {args.dir}: not a directory", file=sys.stderr)
        return 2
    if args.manifest and not os.path.isfile(args.manifest):
        print(f"llmfleet checkpoint verify: --manifest {args.manifest}: no such file", file=sys.stderr)
        return 2
    report = verify(args.dir, args.manifest, deep=not args.no_hash, threads=args.threads)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        for p in report.problems:
            print(f"PROBLEM {p}")
        for w in report.warnings:
            print(f"warning: {w}")
        verdict = "OK" if report.ok else f"{len(report.problems)} problem(s)"
        counts = f"{report.shards} shards, {report.tensors} tensors, {report.tensor_bytes} tensor bytes"
        print(f"{args.dir}: {verdict}: {counts}")
    if report.bad_input:
        return 2
    return 0 if report.ok else 1


def _cmd_checkpoint_manifest(args: argparse.Namespace) -> int:
    from .checkpoint import HEX40, build_manifest

    if not os.path.isdir(args.dir):
        print(f"llmfleet checkpoint manifest: {args.dir}: not a directory", file=sys.stderr)
        return 2
    if args.revision and not HEX40.match(args.revision):
        print(f"llmfleet checkpoint manifest: --revision {args.revision!r} is not a 40-hex commit id", file=sys.stderr)
        return 2
    manifest = build_manifest(args.dir, threads=args.threads, revision=args.revision)
    text = json.dumps(manifest, indent=2) + "\n"
    if args.output:
        tmp = args.output + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, args.output)
    else:
        sys.stdout.write(text)
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

    ck = sub.add_parser("checkpoint", help="verify a checkpoint directory or print its manifest")
    cks = ck.add_subparsers(dest="ckcmd", metavar="ACTION", required=True)
    v = cks.add_parser("verify", help="completeness + safetensors structure (+ sha256 with --manifest)")
    v.add_argument("dir", help="checkpoint directory (holds config.json and the shards)")
    v.add_argument("--manifest", help="manifest JSON to check sizes and sha256 against")
    v.add_argument("--no-hash", action="store_true", help="with --manifest: check sizes only, skip sha256")
    v.add_argument("--threads", type=int, default=4, help="files hashed in parallel (default 4)")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    v.set_defaults(func=_cmd_checkpoint_verify)
    m = cks.add_parser("manifest", help="sha256 + size of every file of the revision (JSON)")
    m.add_argument("dir", help="checkpoint directory")
    m.add_argument("--revision", help="40-hex commit to record (default: from a hub-cache snapshots/<rev> path)")
    m.add_argument("--threads", type=int, default=4, help="files hashed in parallel (default 4)")
    m.add_argument("-o", "--output", help="write to this file (atomically) instead of stdout")
    m.add_argument("--json", action="store_true", help="accepted for symmetry: the manifest is always JSON")
    m.set_defaults(func=_cmd_checkpoint_manifest)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not getattr(args, "func", None):
        ap.print_help(sys.stderr)
        return 2
    return args.func(args)
