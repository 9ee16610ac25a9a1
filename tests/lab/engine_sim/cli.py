"""The command line per engine: the real flags (a small subset of each), SGLang's --config file, the checks
that exit 2 as argparse does, the config every rank gets, and the argument lines the engines log."""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

from .logs import version_string

DEFAULT_PORTS = {"sglang": 30000, "vllm": 8000}
DEFAULT_TIMEOUT = 600  # both engines' default for the distributed timeout (seconds)
STATE_DIR_DEFAULT = "/var/tmp/llmfleet-sim"


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def human_int(text: str) -> int:
    """vLLM's --max-model-len: 32768, 32k (x1000) or 32K (x1024)."""
    m = re.fullmatch(r"(\d+)([kKmM]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"invalid length {text!r}")
    mult = {"": 1, "k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}[m.group(2)]
    return int(m.group(1)) * mult


class HelpAll(argparse.Action):
    """vLLM's --help[=all|GROUP]: the simulator prints every flag whatever the value."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None):
        parser.print_help()
        parser.exit()


def add_sglang_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--model-path", required=True, help="checkpoint directory (local only in the simulator)")
    a("--served-model-name", help="name in /v1/models (default: the model path)")
    a("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    a("--pp-size", "--pipeline-parallel-size", dest="pp_size", type=int, default=1)
    a("--nnodes", type=int, default=1)
    a("--node-rank", type=int, default=0)
    a("--dist-init-addr", help="HOST:PORT of the torch.distributed rendezvous (rank 0's node)")
    a("--dist-timeout", type=int, help=f"seconds for rendezvous and collectives (default {DEFAULT_TIMEOUT})")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=DEFAULT_PORTS["sglang"])
    a("--api-key")
    a("--config", help="YAML file of flag: value (CLI flags override it)")
    a("--context-length", type=int)
    a("--model-loader-extra-config", type=json_object, default={},
      help='JSON, e.g. {"enable_multithread_load": true, "num_threads": 8}')  # fmt: skip
    a("--mem-fraction-static", type=float)
    a("--max-running-requests", type=int)
    a("--max-prefill-tokens", type=int)
    a("--page-size", type=int)
    a("--reasoning-parser")
    a("--tool-call-parser")
    a("--disable-radix-cache", action="store_true")
    a("--enable-metrics", action="store_true")
    a("--enable-metrics-for-all-schedulers", action="store_true")
    a("--enable-cache-report", action="store_true")
    a("--kv-cache-dtype")
    a("--linear-attn-prefill-backend")
    a("--linear-attn-decode-backend")
    a("--mamba-ssm-dtype")
    a("--mamba-full-memory-ratio", type=float)
    a("--speculative-algorithm")
    a("--speculative-num-steps", type=int)
    a("--speculative-eagle-topk", type=int)
    a("--speculative-num-draft-tokens", type=int)
    a("--trust-remote-code", action="store_true")
    a("--log-level")
    a("--disable-cuda-graph", action="store_true")
    a("--chunked-prefill-size", type=int)
    a("--quantization")
    a("--dtype")
    a("--attention-backend")
    a("--watchdog-timeout", type=float)
    a("--random-seed", type=int)


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("model_tag", nargs="?", help="checkpoint directory (local only in the simulator)")
    a("--model", help="the same as the positional MODEL")
    a("--served-model-name", nargs="+", help="name(s) in /v1/models (default: the model path)")
    a("--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=int, default=1)
    a("--pipeline-parallel-size", "-pp", dest="pipeline_parallel_size", type=int, default=1)
    a("--nnodes", type=int, default=1)
    a("--node-rank", type=int, default=0)
    a("--master-addr", default="127.0.0.1")
    a("--master-port", type=int, help="torch.distributed rendezvous port (default 29501 multi-node, free port single)")
    a("--headless", action="store_true", help="run this node's workers only, no API server")
    a("--distributed-timeout-seconds", type=int, help=f"default {DEFAULT_TIMEOUT}")
    a("--host", help="default: all interfaces")
    a("--port", type=int, default=DEFAULT_PORTS["vllm"])
    a("--api-key", help="or env VLLM_API_KEY")
    a("--max-model-len", type=human_int)
    a("--gpu-memory-utilization", type=float)
    a("--max-num-batched-tokens", type=int)
    a("--max-num-seqs", type=int)
    a("--mamba-ssm-cache-dtype")
    a("--reasoning-parser")
    a("--enable-auto-tool-choice", action="store_true")
    a("--tool-call-parser")
    a("--kv-cache-dtype")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    a("--kv-transfer-config", type=json_object)
    a("--trust-remote-code", action="store_true")
    a("--quantization", "-q")
    a("--dtype")
    a("--enforce-eager", action="store_true")
    a("--compilation-config", "-O")
    a("--load-format")
    a("--model-loader-extra-config", type=json_object, default={})
    a("--disable-log-requests", action="store_true")
    a("--uvicorn-log-level")
    a("--seed", type=int)


def build_parser(flavour: str) -> argparse.ArgumentParser:
    what = f"llmfleet ENGINE SIMULATOR (not a real inference engine) imitating {flavour}"
    top = argparse.ArgumentParser(prog=flavour, description=what)
    top.add_argument("--version", action="version", version=version_string(flavour))
    sub = top.add_subparsers(dest="command", required=True, metavar="{serve}")
    if flavour == "sglang":
        p = sub.add_parser("serve", help="start the (simulated) server", description=what)
        add_sglang_args(p)
    else:
        p = sub.add_parser("serve", help="start the (simulated) server", description=what, add_help=False)
        p.add_argument("-h", "--help", nargs="?", const="all", metavar="all", action=HelpAll,
                       help="show every flag and exit (--help=all)")  # fmt: skip
        add_vllm_args(p)
    p.add_argument("--version", action="version", version=version_string(flavour))
    return top


def load_config_file(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        import yaml

        data = yaml.safe_load(text)
    except ImportError:
        data = {}
        for line in text.splitlines():
            if not line.strip() or line.lstrip().startswith("#") or ":" not in line:
                continue
            key, _, val = line.partition(":")
            val = val.strip()
            if len(val) >= 2 and val[0] == val[-1] and val[0] in "\"'":
                val = val[1:-1]
            data[key.strip()] = {"true": True, "false": False}.get(val.lower(), val)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError("not a mapping of flag: value")
    return data


def expand_config(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """sglang --config FILE: the file's key: value pairs become flags placed before the CLI's own."""
    path = None
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
    if path is None:
        return argv
    try:
        data = load_config_file(path)
    except (OSError, ValueError) as e:
        parser.error(f"--config: cannot read {path}: {e}")
    extra: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--config" or value is False or value is None:
            continue
        if value is True:
            extra.append(flag)
        elif isinstance(value, list):
            extra += [flag, *map(str, value)]
        else:
            extra += [flag, str(value)]
    return argv[:1] + extra + argv[1:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_config(flavour: str, args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Validate the flags (parser.error exits 2) and build what every rank needs."""
    if flavour == "sglang":
        model, tp, pp = args.model_path, args.tp_size, args.pp_size
        served = [args.served_model_name or model]
        timeout = args.dist_timeout or DEFAULT_TIMEOUT
        api_key = args.api_key
        context = args.context_length
        headless = False
        host, shown_host = args.host, args.host
        if args.dist_init_addr:
            addr, _, port = args.dist_init_addr.rpartition(":")
            if not addr or not port.isdigit():
                parser.error(f"--dist-init-addr {args.dist_init_addr!r}: expected HOST:PORT")
            addr, dist_port = addr.strip("[]"), int(port)
        elif args.nnodes > 1:
            parser.error("--dist-init-addr HOST:PORT is required when --nnodes > 1")
        else:
            addr, dist_port = "127.0.0.1", _free_port()
        tool_parser, auto_tool = args.tool_call_parser, bool(args.tool_call_parser)
    else:
        model = args.model_tag or args.model
        if not model:
            parser.error("the following arguments are required: model_tag (or --model)")
        tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
        served = args.served_model_name or [model]
        timeout = args.distributed_timeout_seconds or DEFAULT_TIMEOUT
        api_key = args.api_key or os.environ.get("VLLM_API_KEY") or None
        context = args.max_model_len
        headless = args.headless or args.node_rank > 0
        host = args.host or "0.0.0.0"  # noqa: S104 (vLLM's default: all interfaces)
        shown_host = host
        addr = args.master_addr
        dist_port = args.master_port or (29501 if args.nnodes > 1 else _free_port())
        tool_parser, auto_tool = args.tool_call_parser, args.enable_auto_tool_choice
    names = (
        ("--tp-size", "--pp-size") if flavour == "sglang" else ("--tensor-parallel-size", "--pipeline-parallel-size")
    )
    for flag, value in ((names[0], tp), (names[1], pp), ("--nnodes", args.nnodes)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank {args.node_rank} must be in [0, --nnodes {args.nnodes})")
    world = tp * pp
    if world % args.nnodes:
        parser.error(
            f"{names[0]} {tp} x {names[1]} {pp} = {world} ranks cannot be split evenly over --nnodes {args.nnodes} "
            "(ranks per node must be a whole number)"
        )
    extra = args.model_loader_extra_config or {}
    threads = int(extra.get("num_threads", 8)) if extra.get("enable_multithread_load", True) else 1
    if threads < 1:
        parser.error(f"--model-loader-extra-config: num_threads must be >= 1, got {threads}")
    return {
        "flavour": flavour,
        "model": os.path.abspath(model),
        "model_arg": model,
        "served": served,
        "tp": tp,
        "pp": pp,
        "world": world,
        "nnodes": args.nnodes,
        "node_rank": args.node_rank,
        "rpn": world // args.nnodes,
        "addr": addr,
        "dist_port": dist_port,
        "timeout": timeout,
        "host": host,
        "shown_host": shown_host,
        "http_port": args.port,
        "api_key": api_key,
        "context": context,
        "threads": threads,
        "reasoning_parser": args.reasoning_parser,
        "tool_parser": tool_parser,
        "auto_tool": auto_tool,
        "headless": headless,
        "enforce_eager": bool(getattr(args, "enforce_eager", False)),
        "is_head": args.node_rank == 0 and not headless,
        "state_dir": os.environ.get("LLMFLEET_SIM_STATE_DIR") or STATE_DIR_DEFAULT,
    }


def server_args_repr(args: argparse.Namespace) -> str:
    """SGLang's `server_args=ServerArgs(model_path='...', ..., api_key='...', ...)` (a dataclass repr)."""
    fields = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    fields = {"model_path": fields.pop("model_path"), "tokenizer_path": args.model_path, **fields}
    return "ServerArgs(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"


def vllm_non_default_args(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's `non-default args: {...}` (what differs from the parser's defaults; `model` mirrors the tag)."""
    defaults = vars(build_parser("vllm").parse_args(["serve"]))
    out = {k: v for k, v in vars(args).items() if k != "command" and v != defaults.get(k)}
    if out.get("model_tag") and "model" not in out:
        out["model"] = out["model_tag"]
    return out
