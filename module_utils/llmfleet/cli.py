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


def _bar(p: dict, width: int = 30) -> str:
    total, done = p.get("total_bytes", 0), p.get("done_bytes", 0)
    frac = done / total if total else 1.0
    fill = int(frac * width)
    return (
        f"[{'#' * fill}{'.' * (width - fill)}] {frac * 100:5.1f}% {done / 2**30:.2f}/{total / 2**30:.2f} GiB "
        f"{p.get('rate_bytes_per_s', 0) / 2**20:.0f} MiB/s {p.get('phase', '')}"
    )


def _cmd_stage(args: argparse.Namespace) -> int:
    import tempfile
    import threading

    from .checkpoint import build_manifest, load_manifest
    from .stage import LocalSource, StageError, StageRequest, plan, resolve_source, stage

    try:
        src = resolve_source(args.source, args.revision)
        manifest = load_manifest(args.manifest) if args.manifest else None
        if manifest is None:
            print(f"building the manifest of {src} (reads it once)...", file=sys.stderr)
            manifest = build_manifest(src, threads=args.threads, revision=args.revision)
        with tempfile.TemporaryDirectory() as tmp:
            req = StageRequest(
                root=args.root,
                model=args.model,
                revision=args.revision,
                manifest=manifest,
                threads=args.threads,
                keep=args.keep,
                deep_verify=args.deep_verify,
                check_mode=args.check,
                progress_path=os.path.join(tmp, "progress.json"),
            )
            if args.check:
                pl = plan(req)
                todo = sum(e["size"] for e in pl["todo"])
                print(f"{pl['state']}: would copy {len(pl['todo'])} files, {todo} bytes of {pl['total_bytes']}")
                return 0
            stop = threading.Event()

            def show() -> None:
                try:
                    with open(req.progress_path, encoding="utf-8") as f:
                        print("\r" + _bar(json.load(f)), end="", file=sys.stderr, flush=True)
                except (OSError, ValueError):
                    pass

            def loop() -> None:
                while not stop.wait(0.5):
                    show()

            t = threading.Thread(target=loop, daemon=True)
            t.start()
            try:
                result = stage(req, lambda rel: [LocalSource(src)])
            finally:
                stop.set()
                t.join()
                show()  # the final state
                print(file=sys.stderr)
    except (StageError, OSError, ValueError) as e:
        print(f"llmfleet stage: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else f"{result['path']}: copied {result['bytes_copied']} bytes")
    return 0


def _cmd_topology(args: argparse.Namespace) -> int:
    from .topology import TopologyError, render_env_file, report

    overrides = dict(kv.split("=", 1) for kv in args.override or [])
    addresses = None
    if args.address:
        addresses = {}
        for kv in args.address:
            name, _, ip = kv.partition("=")
            addresses.setdefault(name, []).append(ip)
    try:
        out = report(args.sysfs_root, node_ip=args.node_ip, overrides=overrides, use_nvml=not args.no_nvml,
                     addresses=addresses)  # fmt: skip
    except TopologyError as e:
        print(f"llmfleet topology: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    t = out["topology"]
    for g in t["gpus"]:
        near = g["nearest_hcas"][0] if g["nearest_hcas"] else {"hca": "-", "level": "-"}
        model = g.get("model") or ""
        print(f"GPU{g['index']} {g['bdf']} {model} numa={g['numa_node']} nearest={near['hca']} ({near['level']})")
    for h in t["hcas"]:
        for p, i in h["ports"].items():
            gid = i.get("roce_v2_gid")
            nd = ",".join(h["netdevs"]) or "-"
            print(f"{h['name']}:{p} {i['state']} {i['link_layer']} {i['rate']} netdev={nd} roce_v2_gid={gid}")
    for w in out["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    print(render_env_file(out["env"]), end="")
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

    tp = sub.add_parser("topology", help="GPUs, HCAs, GIDs, NUMA of this node and the fabric env to export")
    tp.add_argument("--sysfs-root", default="/sys", help="sysfs to read (tests use fake trees)")
    tp.add_argument("--node-ip", help="this node's fabric IP (picks the socket interface; single-rail GID)")
    tp.add_argument("--override", action="append", metavar="VAR=VALUE", help="force a value (validated)")
    tp.add_argument("--no-nvml", action="store_true", help="do not use NVML even when installed")
    tp.add_argument(
        "--address", action="append", metavar="IFNAME=IPV4", help="interface addresses to use (for a copied sysfs tree)"
    )
    tp.add_argument("--json", action="store_true")
    tp.set_defaults(func=_cmd_topology)

    st = sub.add_parser("stage", help="stage a pinned revision onto this node's NVMe (with a progress bar)")
    st.add_argument("source", help="checkpoint dir, hub-cache models--org--name dir, or snapshots/<rev> dir")
    st.add_argument("--model", required=True, help="model name (directory under --root)")
    st.add_argument("--revision", required=True, help="40-hex commit of the revision")
    st.add_argument("--root", default="/mnt/nvme/models", help="staging root (default /mnt/nvme/models)")
    st.add_argument("--manifest", help="manifest JSON (default: build it, reading the source once)")
    st.add_argument("--threads", type=int, default=4)
    st.add_argument("--keep", type=int, default=2, help="published revisions to keep")
    st.add_argument("--deep-verify", action="store_true", help="re-hash a published revision")
    st.add_argument("--check", action="store_true", help="say what would be copied, change nothing")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=_cmd_stage)

    # Listed for --help only: main() hands `exec` its raw argv (everything after `--` is the engine's).
    sub.add_parser("exec", help="run an engine as a unit's main process (llmfleet exec [options] -- CMD...)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "exec":
        from .wrapper import main as exec_main

        return exec_main(argv[1:])
    ap = build_parser()
    args = ap.parse_args(argv)
    if not getattr(args, "func", None):
        ap.print_help(sys.stderr)
        return 2
    return args.func(args)
