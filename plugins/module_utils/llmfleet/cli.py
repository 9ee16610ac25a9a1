"""The ``llmfleet`` command line. Exit codes: 0 good, 1 found a problem, 2 bad usage/input.

Ops-host-only dependencies (fabric, ...) are imported inside the subcommands that need them,
never at module level: node-side programs and Ansible modules import this package too."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import ipaddress
import json
import os
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

from . import __version__
from .cli_grammar import EXIT_CODES, alias, at_least, completion_script, stamp_schema
from .facts import revision_problem

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# ---- argument types: a bad value is an argparse error (usage line + one error line, exit 2) ----------


def _var_value(text: str) -> tuple[str, str]:
    name, eq, value = text.partition("=")
    if not eq or not ENV_NAME.match(name):
        raise argparse.ArgumentTypeError(f"{text!r} is not VAR=VALUE (e.g. NCCL_IB_GID_INDEX=3)")
    return name, value


def _ipv4(text: str) -> str:
    try:
        return str(ipaddress.IPv4Address(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IPv4 address (e.g. 10.10.0.11)") from None


def _ifname_ipv4(text: str) -> tuple[str, str]:
    name, eq, ip = text.partition("=")
    if not eq or not name or "/" in name:
        raise argparse.ArgumentTypeError(f"{text!r} is not IFNAME=IPV4 (e.g. ens1np0=10.10.0.11)")
    try:
        return name, _ipv4(ip)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: {ip!r} is not an IPv4 address (IFNAME=IPV4)") from None


def _commit(text: str) -> str:
    if revision_problem(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a 40-hex commit id: branch and tag names move; pin the commit"
        )
    return text


def _usage_error(cmd: str, msg: str) -> int:
    print(f"llmfleet {cmd}: {msg}", file=sys.stderr)
    return 2


def _input_problem(directory: str, what_dir: str, manifest: str | None = None, manifest_hint: str = "") -> str | None:
    """What is wrong with a command's input directory and optional --manifest file, or None."""
    if not os.path.isdir(directory):
        return f"{directory}: not a directory ({what_dir})"
    if manifest and not os.path.isfile(manifest):
        return f"--manifest {manifest}: no such file{manifest_hint}"
    return None


def _output_problem(path: str) -> str | None:
    """Why PATH cannot receive a file written atomically (tmp + rename beside it), or None."""
    parent = os.path.dirname(os.path.abspath(path))
    if path.endswith(os.sep) or os.path.isdir(path):
        return f"-o {path} names a directory: give a file name (e.g. {os.path.join(path, 'manifest.json')})"
    if not os.path.isdir(parent):
        return f"-o {path}: directory {parent} does not exist: create it first (mkdir -p {parent}) or write elsewhere"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"-o {path}: directory {parent} is not writable by this user: write elsewhere"
    return None


def _read_error(e: OSError) -> str:
    what = f"{e.filename}: " if e.filename else ""
    return f"cannot read {what}{e.strerror or e}: the revision is incomplete or unreadable; download or copy it again"


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
    from .stage.checkpoint import verify

    problem = _input_problem(args.dir, "give the one holding config.json", args.manifest)
    if problem:
        return _usage_error("checkpoint verify", problem)
    try:
        report = verify(args.dir, args.manifest, deep=not args.no_hash, threads=args.threads)
    except OSError as e:
        print(f"llmfleet checkpoint verify: {_read_error(e)}", file=sys.stderr)
        return 1
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
    from .stage.errors import StageError
    from .stage.manifest import build_manifest

    problem = _input_problem(args.dir, "give the one holding config.json") or (
        args.output and _output_problem(args.output)
    )
    if problem:  # before reading the revision, not after an hour of hashing
        return _usage_error("checkpoint manifest", problem)
    try:
        manifest = build_manifest(args.dir, threads=args.threads, revision=args.revision)
    except (OSError, StageError) as e:  # StageError: a link out of the source, a FIFO or device in it
        print(f"llmfleet checkpoint manifest: {_read_error(e) if isinstance(e, OSError) else e}", file=sys.stderr)
        return 1
    text = json.dumps(manifest, indent=2) + "\n"
    if not args.output:
        sys.stdout.write(text)
        return 0
    tmp = args.output + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, args.output)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return _usage_error("checkpoint manifest", f"-o {args.output}: cannot write it: {e.strerror or e}")
    return 0


def _cmd_stage(args: argparse.Namespace) -> int:
    import tempfile

    from .stage.errors import StageError
    from .stage.manifest import load_manifest
    from .stage.staging import StageRequest, plan, resolve_source, sizes_manifest, stage
    from .stage.store import model_dir
    from .stage.transfer import LocalSource

    problem = _input_problem(
        args.source, "is the shared storage mounted?", args.manifest, " (leave it out to build the manifest)"
    )
    if problem:
        return _usage_error("stage", problem)
    try:
        model_dir(args.root, args.model)
    except StageError as e:
        return _usage_error("stage", f"--model: {e}")
    try:
        src = resolve_source(args.source, args.revision)
        manifest = load_manifest(args.manifest) if args.manifest else sizes_manifest(src, args.revision)
        if not args.manifest and not args.check:
            print(f"no --manifest: building the manifest from the copy of {src} (one read)", file=sys.stderr)
        with tempfile.TemporaryDirectory() as tmp:
            req = StageRequest(
                root=args.root,
                model=args.model,
                revision=args.revision,
                manifest=manifest,
                threads=args.threads,
                keep=args.keep_revisions,
                deep_verify=args.deep_verify,
                check_mode=args.check,
                progress_path=os.path.join(tmp, "progress.json"),
                build_from="" if args.manifest else src,
            )
            if args.check:
                pl = plan(req)
                todo = sum(e["size"] for e in pl["todo"])
                print(f"{pl['state']}: would copy {len(pl['todo'])} files, {todo} bytes of {pl['total_bytes']}")
                return 0
            with StageProgress(req.progress_path, sys.stderr):
                result = stage(req, lambda rel: [LocalSource(src)])
    except (StageError, OSError, ValueError) as e:
        print(f"llmfleet stage: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else f"{result['path']}: copied {result['bytes_copied']} bytes")
    return 0


PLAIN_EVERY_S = 10.0  # `stage` progress lines when stderr is not a terminal


class StageProgress:
    """`stage`'s progress from its progress file: on a terminal a bar redrawn in place (twice a second);
    otherwise (a log, a pipe) a plain line every PLAIN_EVERY_S, so a log holds no carriage returns. Both with ETA."""

    def __init__(self, path: str, stream: Any) -> None:
        self.path, self.stream = path, stream
        self.tty = stream.isatty()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def show(self) -> None:
        from .stage.progress import progress_line

        try:
            with open(self.path, encoding="utf-8") as f:
                snap = json.load(f)
        except (OSError, ValueError):
            return
        line = progress_line(snap) + eta_text(snap)
        print("\r" + line if self.tty else line, end="" if self.tty else "\n", file=self.stream, flush=True)

    def _loop(self) -> None:
        waited = 0.0
        while not self.stop.wait(0.5):
            waited += 0.5
            if self.tty or waited >= PLAIN_EVERY_S:
                waited = 0.0
                self.show()

    def __enter__(self) -> StageProgress:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.show()  # the final state
        if self.tty:
            print(file=self.stream)


def eta_text(snap: dict) -> str:
    """' ETA 1m05s' from a progress snapshot ('' when done or no rate yet)."""
    left = snap.get("total_bytes", 0) - snap.get("done_bytes", 0)
    rate = snap.get("rate_bytes_per_s", 0)
    if left <= 0 or rate <= 0:
        return ""
    s = int(left / rate)
    return f" ETA {s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f" ETA {s // 60}m{s % 60:02d}s"


def _cmd_completion(args: argparse.Namespace) -> int:
    print(completion_script(build_parser(), args.shell), end="")
    return 0


def _cmd_topology(args: argparse.Namespace) -> int:
    from .checks.topology import OverrideError, TopologyError, render_env_file, report

    if not os.path.isdir(args.sysfs_root):
        return _usage_error("topology", f"--sysfs-root {args.sysfs_root}: not a directory")
    overrides = dict(args.override or [])
    addresses = None
    if args.address:
        addresses = {}
        for name, ip in args.address:
            addresses.setdefault(name, []).append(ip)
    try:
        out = report(args.sysfs_root, node_ip=args.node_ip, overrides=overrides, use_nvml=not args.no_nvml,
                     addresses=addresses)  # fmt: skip
    except OverrideError as e:
        return _usage_error("topology", f"--{e}" if str(e).startswith("override") else str(e))
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
        print(
            f"GPU{g['index']} {g['bdf']} {model} numa={g['numa_node']} nearest={near['hca']} ({near['level']})"
            f" rail={g.get('hca') or '-'}"
        )
    for h in t["hcas"]:
        for p, i in h["ports"].items():
            gid = i.get("roce_v2_gid")
            nd = ",".join(h.get("upper_netdevs", []) + h["netdevs"]) or "-"
            kind = "rail" if h.get("rail") else "not-a-rail"
            print(f"{h['name']}:{p} {i['state']} {i['link_layer']} {i['rate']} netdev={nd} roce_v2_gid={gid} {kind}")
    for h in t.get("non_rail_hcas", []):
        print(f"not a rail: {h['hca']} ({h['reason']})")
    for w in out["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    print(render_env_file(out["env"]), end="")
    return 0


# Subcommands whose module brings its own arguments and runner (add_arguments, run), named relative to this
# package (`module:attribute` for an object): imported only for the command that runs, or when the whole parser is
# built (completion). The ops-host tools (OPS_HOST) are not in a node's runtime package.
PLUGGED = (
    ("accept", "accept.run", "the API acceptance gate against a running endpoint (docs/acceptance.md)"),
    ("bench", "bench.serve", "serving benchmark with the engine's own tool (docs/measurements/bench-serving.md)"),
    ("warmup", "accept.warmup", "warm a ready endpoint over input lengths x concurrencies, timed (docs/warmup.md)"),
    ("specdecode", "engine.specdecode", "speculative decoding's acceptance from the engine's /metrics; does it pay"),
    ("precompile", "engine.precompile", "a kernel precompile, once per fingerprint (a unit's ExecStartPre, stamped)"),
    # On-call (docs/runbook.md): over SSH with the inventory Ansible reads.
    ("status", "oncall.status", "is it serving: a line per node (unit, record, phase, API port, GPU memory), over SSH"),
    ("logs", "oncall.logs", "journal tails per node; --first-failed: the node and rank that failed first, and why"),
    ("bundle", "oncall.bundle", "collect an incident bundle (journals, kernel log, systemctl show, records) for `why`"),
    ("why", "oncall.why", "why did it die: triage of an incident bundle or of a deployment over SSH (docs/runbook.md)"),
    ("stop", "oncall.stop", "stop a deployment in order (router, head, workers), bounded; says what it had to kill"),
    ("restart", "oncall.restart", "stop in order, start in rank order, wait until every unit is READY"),
    ("rdma-proof", "oncall.rdma", "HCA port byte counters on all nodes around CMD (or a sleep); names silent rails"),
    ("fit", "engine.fit_cli:fit_command", "will it fit: GPU memory per rank, and does the engine know the model"),
    ("startscan", "engine.fit_cli:scan_command", "a start log's fallbacks (untuned MoE, attention backend) and memory"),
    ("report", "report.cli", "the deployment report: HTML page + markdown from this run's records, pass/fail per step"),
)
# Subpackages of the ops host's install only (pip install llmfleet there); roles ship the rest to nodes.
OPS_HOST = ("accept", "oncall", "report")


def _plugged(path: str) -> Any:
    module, _, attr = path.partition(":")
    mod = importlib.import_module(f".{module}", __package__)
    return getattr(mod, attr) if attr else mod


def _ops_host_only(name: str) -> Callable[[argparse.Namespace], int]:
    def run(_args: argparse.Namespace) -> int:
        print(f"llmfleet {name} runs on the ops host (pip install llmfleet there): this node's llmfleet runtime "
              "holds only what nodes run", file=sys.stderr)  # fmt: skip
        return 2

    return run


INV = "-i inventory/prod --deployment demo"
# One example per subcommand, at the end of its --help (with its exit codes).
EXAMPLES = {
    "node-info": "llmfleet node-info --json",
    "checkpoint": "llmfleet checkpoint verify /mnt/nvme/models/m/current --manifest manifest.json",
    "checkpoint verify": "llmfleet checkpoint verify /mnt/nvme/models/m/current --manifest manifest.json",
    "checkpoint manifest": "llmfleet checkpoint manifest /mnt/shared/models/m -o manifest.json",
    "topology": "llmfleet topology --node-ip 10.10.0.11",
    "stage": "llmfleet stage /mnt/shared/hub/models--org--m --model m --revision <40-hex commit> --check",
    "accept": "llmfleet accept --url http://head:8000 --model m --profile m.yml -o accept.json",
    "bench": "llmfleet bench --engine vllm --url http://head:8000 --tokenizer /mnt/nvme/models/m/current "
    "--input-len 1024 --output-len 128 --concurrency 1,16,64 -o bench-m",
    "warmup": "llmfleet warmup --url http://127.0.0.1:8000 --model m --lengths 128,2048 --concurrency 1,16",
    "specdecode": "llmfleet specdecode --url http://head:8000/metrics --steps 3",
    "precompile": "llmfleet precompile --stamp /var/cache/llmfleet/.precompiled -- python3 -m my.precompile",
    "status": f"llmfleet status {INV}",
    "logs": f"llmfleet logs {INV} --first-failed",
    "bundle": f"llmfleet bundle {INV} -o incident-1",
    "why": f"llmfleet why {INV}    (or: llmfleet why --bundle incident-1)",
    "stop": f"llmfleet stop {INV} --stop-timeout 60",
    "restart": f"llmfleet restart {INV}",
    "rdma-proof": "llmfleet rdma-proof -i inventory/prod -- ./allreduce.sh",
    "fit": "llmfleet fit /mnt/nvme/models/m/current --engine vllm --tp 8 --gpu-memory-gib 140",
    "startscan": "llmfleet startscan --engine vllm --unit llmfleet-demo.service",
    "report": "llmfleet report --dir reports --deployment demo",
    "completion": "llmfleet completion bash > ~/.local/share/bash-completion/completions/llmfleet",
    "exec": "llmfleet exec --help",
}
# Where a command's exit codes say more than the common three.
EXIT_NOTES = {
    "specdecode": "exit codes: 0 the figures (a measurement, not a gate), 2 bad usage or /metrics unreadable",
    "startscan": "exit codes: 0 scanned (its findings are warnings), 2 bad usage or input",
    "completion": "exit codes: 0 printed, 2 bad usage",
}
TOP_EPILOG = f"""{EXIT_CODES};
141 when the reader of stdout went away (`| head`).

One grammar for every command:
  --url URL            the endpoint (accept, bench, warmup, specdecode)
  N,N,...              a list (--concurrency 1,16,64)
  -o/--output          a FILE where the command writes one file, a DIR where it writes several (bench, bundle, why)
  --check              say what would be done, do nothing
  --deployment NAME    the deployment (on-call commands, report)
  --*-timeout S        named for what it bounds (--request-timeout, --node-timeout, --stop-timeout, --run-timeout)
  --json               one JSON document with "schema": "llmfleet.<command>/N"
Older spellings (--base-url, --keep, --dry-run, --timeout, a positional URL or deployment) still work
for now and say so on stderr.

example: llmfleet accept --url http://head:8000 --model m
shell completion: llmfleet completion bash|zsh
"""


def _help_end(name: str) -> dict:
    """add_parser keywords: the help ends with the command's exit codes and one example."""
    text = f"{EXIT_NOTES.get(name, EXIT_CODES)}\n\nexample: {EXAMPLES[name]}"
    return {"epilog": text, "formatter_class": argparse.RawDescriptionHelpFormatter}


def _add_node_commands(sub: Any) -> None:
    """The commands that look at this node: node-info, checkpoint, topology, stage."""
    p = sub.add_parser("node-info", help="identity and capacity of this node", **_help_end("node-info"))
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--nvme", default="/mnt/nvme", help="node staging disk (default: /mnt/nvme)")
    p.add_argument("--shared", default="/mnt/shared", help="shared-storage mount (default: /mnt/shared)")
    p.set_defaults(func=_cmd_node_info)

    ck = sub.add_parser(
        "checkpoint", help="verify a checkpoint directory or print its manifest", **_help_end("checkpoint")
    )
    cks = ck.add_subparsers(dest="ckcmd", metavar="ACTION", required=True)
    v = cks.add_parser(
        "verify",
        help="completeness + safetensors structure (+ sha256 with --manifest)",
        **_help_end("checkpoint verify"),
    )
    v.add_argument("dir", help="checkpoint directory (holds config.json and the shards)")
    v.add_argument("--manifest", help="manifest JSON to check sizes and sha256 against")
    v.add_argument("--no-hash", action="store_true", help="with --manifest: check sizes only, skip sha256")
    v.add_argument("--threads", type=at_least(1), default=4, help="files hashed in parallel (default 4)")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    v.set_defaults(func=_cmd_checkpoint_verify, schema_name="checkpoint-verify")
    m = cks.add_parser(
        "manifest", help="sha256 + size of every file of the revision (JSON)", **_help_end("checkpoint manifest")
    )
    m.add_argument("dir", help="checkpoint directory")
    m.add_argument(
        "--revision", type=_commit, help="40-hex commit to record (default: from a hub-cache snapshots/<rev> path)"
    )
    m.add_argument("--threads", type=at_least(1), default=4, help="files hashed in parallel (default 4)")
    m.add_argument("-o", "--output", metavar="FILE", help="write to this file (atomically) instead of stdout")
    m.add_argument("--json", action="store_true", help="accepted for symmetry: the manifest is always JSON")
    m.set_defaults(func=_cmd_checkpoint_manifest, schema_name=None)  # a manifest names its own "format"

    tp = sub.add_parser(
        "topology", help="GPUs, HCAs, GIDs, NUMA of this node and the fabric env to export", **_help_end("topology")
    )
    tp.add_argument("--sysfs-root", default="/sys", help="sysfs to read (tests use fake trees)")
    tp.add_argument("--node-ip", type=_ipv4, help="this node's fabric IP (picks the socket interface; single-rail GID)")
    tp.add_argument(
        "--override", action="append", type=_var_value, metavar="VAR=VALUE", help="force a value (validated)"
    )
    tp.add_argument("--no-nvml", action="store_true", help="do not use NVML even when installed")
    tp.add_argument(
        "--address",
        action="append",
        type=_ifname_ipv4,
        metavar="IFNAME=IPV4",
        help="interface addresses to use (for a copied sysfs tree)",
    )
    tp.add_argument("--json", action="store_true")
    tp.set_defaults(func=_cmd_topology)

    st = sub.add_parser(
        "stage", help="stage a pinned revision onto this node's NVMe (with progress and ETA)", **_help_end("stage")
    )
    st.add_argument("source", help="checkpoint dir, hub-cache models--org--name dir, or snapshots/<rev> dir")
    st.add_argument("--model", required=True, help="model name (directory under --root)")
    st.add_argument("--revision", required=True, type=_commit, help="40-hex commit of the revision")
    st.add_argument("--root", default="/mnt/nvme/models", help="staging root (default /mnt/nvme/models)")
    st.add_argument("--manifest", help="manifest JSON (default: build it from the copy itself: one read of the source)")
    st.add_argument("--threads", type=at_least(1), default=4, help="concurrent file copies (default 4)")
    st.add_argument(
        "--keep-revisions",
        type=at_least(1),
        default=2,
        metavar="N",
        help="published revisions to keep (default 2; the current one is always kept)",
    )
    alias(st, "--keep", "--keep-revisions", "keep_revisions", type=at_least(1))
    st.add_argument("--deep-verify", action="store_true", help="re-hash a published revision")
    st.add_argument("--check", action="store_true", help="say what would be copied, change nothing")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=_cmd_stage)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `command`, only that plugged command's module is imported (the others are listed for
    --help), so a node runs its commands without the ops-host tools; None imports every one (completion)."""
    ap = argparse.ArgumentParser(
        prog="llmfleet",
        description="Bare-metal GPU nodes to a verified LLM endpoint.",
        epilog=TOP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", action="version", version=f"llmfleet {__version__}")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")
    _add_node_commands(sub)

    for name, path, text in PLUGGED:
        if command is not None and command != name:
            sub.add_parser(name, help=text)
            continue
        try:
            mod = _plugged(path)
        except ModuleNotFoundError as e:
            if path.split(".")[0] not in OPS_HOST or not (e.name or "").startswith(f"{__package__}."):
                raise
            # Not in this runtime: whatever its arguments (no option is one: no prefix characters), say where it runs.
            pp = sub.add_parser(name, help=text, add_help=False, prefix_chars="\0")
            pp.add_argument("args", nargs="*")
            pp.set_defaults(func=_ops_host_only(name))
            continue
        pp = sub.add_parser(name, help=text, **_help_end(name))
        mod.add_arguments(pp)
        pp.set_defaults(func=mod.run)

    cp = sub.add_parser("completion", help="print a shell completion script (bash or zsh)", **_help_end("completion"))
    cp.add_argument("shell", choices=("bash", "zsh"), help="the shell to complete for")
    cp.set_defaults(func=_cmd_completion)

    # Listed for --help only: main() hands `exec` its raw argv (everything after `--` is the engine's).
    sub.add_parser(
        "exec", help="run an engine as a unit's main process (llmfleet exec [options] -- CMD...)", **_help_end("exec")
    )
    return ap


def _run_json(args: argparse.Namespace, name: str) -> int:
    """Run a --json command; its document gets "schema": "llmfleet.<name>/1" unless it names its own."""
    # A real text stream: Ansible's display (loading the inventory) reconfigures stdout and needs .buffer.
    buf = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    try:
        with contextlib.redirect_stdout(buf):
            rc = args.func(args)
    finally:
        buf.flush()
        text = buf.buffer.getvalue().decode("utf-8")
        try:
            doc = json.loads(text)
        except ValueError:  # not one document (an error, or nothing): as it was
            doc = None
        if isinstance(doc, dict) and "schema" not in doc:
            text = json.dumps(stamp_schema(doc, name), indent=2, ensure_ascii=False, default=str) + "\n"
        sys.stdout.write(text)
    return rc


def _stdout_gone() -> int:
    """The reader of stdout went away (`| head`): no traceback, and none at exit when Python flushes stdout."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 141  # as a shell reports a process SIGPIPE ended


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "exec":
        from .wrapper.run import main as exec_main

        return exec_main(argv[1:])
    ap = build_parser(next((a for a in argv if not a.startswith("-")), ""))
    try:
        args = ap.parse_args(argv)
        if not getattr(args, "func", None):
            ap.print_help(sys.stderr)
            return 2
        name = getattr(args, "schema_name", args.cmd)
        rc = _run_json(args, name) if getattr(args, "json", False) and name else args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        return _stdout_gone()
    return rc


if __name__ == "__main__":  # python -m llmfleet.cli
    sys.exit(main())
