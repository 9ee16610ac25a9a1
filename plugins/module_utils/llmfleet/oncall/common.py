"""What the on-call commands (status, logs, bundle, stop, restart, rdma-proof) share: the arguments, the
inventory, the transports that run the node probe, the parallel fan-out, and output helpers.

Ops host only. Fabric/paramiko (SSH) and ansible (inventory) are imported lazily, inside the functions that
use them; nothing a module imports imports this file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .. import engines
from ..cli_grammar import add_deployment, alias, positive_seconds, settle_deployment
from ..fleet_inventory import Fleet, InventoryError, Node, load_fleet, parse_extra_vars
from .ssh import Done, SshTransport, TransportError

PROBE_SOURCE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "node_probe.py")
MAX_WORKERS = 64  # like ansible.cfg's forks


class UsageError(Exception):
    """Bad input found after parsing (exit 2)."""


@dataclass
class NodeResult:
    node: Node
    data: dict[str, Any] | None = None
    error: str | None = None
    seconds: float = 0.0


def probe_source() -> bytes:
    with open(PROBE_SOURCE_PATH, "rb") as f:
        return f.read()


class LocalTransport:
    """Runs the probe with a local process: `ansible_connection: local` hosts, and tests (env_for gives each
    node its environment: PATH with fake systemctl/journalctl/nvidia-smi)."""

    def __init__(self, env_for: Callable[[Node], dict[str, str]] | None = None) -> None:
        self.env_for = env_for

    def run(self, node: Node, argv: list[str], stdin: bytes, timeout: float, max_output: int) -> Done:
        env = self.env_for(node) if self.env_for else None
        try:
            p = subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout, env=env, check=False)
        except subprocess.TimeoutExpired:
            raise TransportError(f"no answer within {timeout:g} s") from None
        except OSError as e:
            raise TransportError(f"cannot run {argv[0]}: {e.strerror}") from None
        if len(p.stdout) > max_output:
            raise TransportError(f"answer larger than {max_output} bytes")
        return Done(p.returncode, p.stdout, p.stderr)

    def close(self) -> None:
        pass


class AutoTransport:
    """SSH for ssh hosts, a local process for `ansible_connection: local` hosts."""

    def __init__(self, local: LocalTransport | None = None, ssh: Any = None) -> None:
        self.local = local or LocalTransport()
        self.ssh = ssh
        self._lock = threading.Lock()

    def _ssh(self) -> Any:
        with self._lock:
            if self.ssh is None:
                self.ssh = SshTransport()
            return self.ssh

    def run(self, node: Node, argv: list[str], stdin: bytes, timeout: float, max_output: int) -> Done:
        t = self.local if node.ssh.connection == "local" else self._ssh()
        return t.run(node, argv, stdin, timeout, max_output)

    def close(self) -> None:
        self.local.close()
        if self.ssh is not None:
            self.ssh.close()


def call_probe(transport: Any, node: Node, spec: dict, timeout: float, max_output: int = 64 << 20) -> dict:
    """One SSH round: the probe's answer, or TransportError saying what went wrong on which node."""
    argv = node.probe_argv(json.dumps(spec, separators=(",", ":")))
    done = transport.run(node, argv, probe_source(), timeout, max_output)
    err = done.stderr.decode("utf-8", "replace").strip()
    try:
        data = json.loads(done.stdout.decode("utf-8", "replace"))
    except ValueError:
        data = None
    if not isinstance(data, dict):
        first = err.splitlines()[-1] if err else f"exit {done.rc}, no answer"
        if "password is required" in err or "a terminal is required" in err:
            first += f" (become needs passwordless sudo for {node.ssh.user or 'the ssh user'}: NOPASSWD)"
        elif done.rc == 127 or "No such file" in err:
            first += f" (is {node.python} there? set ansible_python_interpreter)"
        raise TransportError(f"probe failed: {first}")
    if data.get("error"):
        raise TransportError(f"probe failed on the node: {data['error']}")
    return data


def fan_out(fleet_nodes: list[Node], fn: Callable[[Node], dict], workers: int = MAX_WORKERS) -> list[NodeResult]:
    """fn(node) on every node in parallel; results in node order. A node that fails is a result with an error
    line (TransportError, or any exception: one line, never a traceback)."""

    def one(node: Node) -> NodeResult:
        t0 = time.monotonic()
        try:
            return NodeResult(node, data=fn(node), seconds=time.monotonic() - t0)
        except TransportError as e:
            return NodeResult(node, error=str(e), seconds=time.monotonic() - t0)
        except Exception as e:  # a bug or an odd answer on one node must not hide the others
            return NodeResult(node, error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - t0)

    if not fleet_nodes:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(fleet_nodes)))) as ex:
        return list(ex.map(one, fleet_nodes))


# ---- arguments and setup ----------------------------------------------------------------------------


def add_fleet_arguments(p: argparse.ArgumentParser, deployment: bool = True, timeout: float | None = 30.0) -> None:
    p.add_argument(
        "-i",
        "--inventory",
        action="append",
        metavar="INVENTORY",
        help="Ansible inventory (file or directory; repeatable; default: the one ansible.cfg names)",
    )
    p.add_argument(
        "-e", "--extra-vars", action="append", metavar="KEY=VALUE", help="override an inventory variable, as -e does"
    )
    p.add_argument(
        "-l",
        "--limit",
        metavar="PATTERN",
        help="only these nodes (an Ansible host pattern, as ansible-playbook --limit; the head must be in it)",
    )
    if deployment:
        add_deployment(p, "deployment name (default: the inventory's llmfleet_deployment)", positional=True)
    if timeout is not None:
        p.add_argument(
            "--node-timeout",
            dest="timeout",
            type=positive_seconds,
            default=timeout,
            metavar="S",
            help=f"seconds each node's probe may take (default {timeout:g})",
        )
        alias(p, "--timeout", "--node-timeout", "timeout", type=positive_seconds)
    p.add_argument("--json", action="store_true", help="machine-readable output")


def add_stop_timeout(p: argparse.ArgumentParser) -> None:
    """`stop`/`restart`: the grace a unit gets to stop before SIGKILL (dest `timeout`)."""
    p.add_argument(
        "--stop-timeout",
        dest="timeout",
        type=positive_seconds,
        default=120.0,
        metavar="S",
        help="seconds a unit gets to stop before SIGKILL (default 120)",
    )
    alias(p, "--timeout", "--stop-timeout", "timeout", type=positive_seconds)


def fleet_of(args: argparse.Namespace) -> Fleet:
    """The fleet the arguments name; InventoryError (exit 2) when they do not name one."""
    problem = settle_deployment(getattr(args, "cmd", None) or "", args)
    if problem:
        raise UsageError(problem)
    extra = parse_extra_vars(getattr(args, "extra_vars", None))
    return load_fleet(args.inventory, getattr(args, "deployment", None), extra, getattr(args, "limit", None))


def replica_fleets(fleet: Fleet) -> list[Fleet]:
    """Each replica of llmfleet_replicas as the engine role runs it (those listed with state: absent are being
    removed): a deployment of its own, <deployment>-<name>, on its nodes (the fleet's head first when the replica holds it, then the order given)."""
    out = []
    by_name = {n.name: n for n in fleet.nodes}
    for r in fleet.replicas:
        if not isinstance(r, dict) or not r.get("name") or r.get("state") == "absent":
            continue
        names = [str(x) for x in r.get("nodes") or [] if str(x) in by_name]
        names = [x for x in names if x == fleet.head.name] + [x for x in names if x != fleet.head.name]
        dep = f"{fleet.deployment}-{r['name']}"
        nodes = [
            dataclasses.replace(
                by_name[x], rank=i, head=i == 0, engine_dir=f"{by_name[x].engine_dir.rsplit('/', 1)[0]}/{dep}"
            )
            for i, x in enumerate(names)
        ]
        if nodes:
            out.append(dataclasses.replace(fleet, deployment=dep, nodes=nodes, replicas=[]))
    return out


def replicas_by_name(fleet: Fleet) -> dict[str, Fleet]:
    """Each replica's own fleet (replica_fleets) by its name in llmfleet_replicas, in the inventory's order."""
    return {f.deployment[len(fleet.deployment) + 1 :]: f for f in replica_fleets(fleet)}


def add_replica_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", metavar="NAME",
                   help="one replica of llmfleet_replicas (its own deployment <deployment>-<name>, on its nodes); "
                   "a deployment of replicas takes one at a time, the others keep serving")  # fmt: skip


def replica_target(args: argparse.Namespace, cmd: str) -> Fleet:
    """The fleet a stop or restart acts on: the deployment, or with --replica one of its replicas. A deployment of
    replicas needs --replica (all at once would stop serving); UsageError (exit 2) names the replicas."""
    fleet = fleet_of(args)
    name = getattr(args, "replica", None)
    subs = replicas_by_name(fleet)
    if name is None and subs:
        raise UsageError(
            f"{fleet.deployment} runs as replicas ({', '.join(subs)}) behind {fleet.router_unit()}: name one with "
            f"--replica NAME ({cmd} one at a time, the others keep serving); to stop them all, "
            "ansible-playbook playbooks/engine_stop.yml (the router first)"
        )
    if name is None:
        return fleet
    if not subs:
        raise UsageError(f"--replica {name}: {fleet.deployment} has no llmfleet_replicas (it is one instance)")
    if name not in subs:
        raise UsageError(f"--replica {name}: {fleet.deployment} has no such replica: name one of {', '.join(subs)}")
    return subs[name]


def guarded(cmd: str, body: Callable[[], int]) -> int:
    """Run a command's body: bad input is one line on stderr and exit 2, never a traceback."""
    try:
        return body()
    except (InventoryError, UsageError) as e:
        print(f"llmfleet {cmd}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"llmfleet {cmd}: interrupted", file=sys.stderr)
        return 130


def api_port(node: Node, router: bool = False) -> int:
    """The API port when the unit's ExecStart does not say (--port): the inventory's, else the engine's default."""
    if router:
        return node.router_port
    if node.engine_port > 0:
        return node.engine_port
    return _profile(node).default_port


def serves_api(node: Node) -> bool:
    """The head serves the API; with vllm_pd every node runs its own instance with one."""
    return node.head or _profile(node).separate_instances


def has_router(node: Node) -> bool:
    """Whether the node's profile runs a router on the head (vllm_pd)."""
    return _profile(node).router is not None


def _profile(node: Node) -> engines.Profile:
    """The node's engine profile; one this version does not know reads as custom (no router, port 8000) rather
    than a traceback in the middle of an incident."""
    return engines.PROFILES.get(str(node.profile), engines.CUSTOM)


def unit_specs(fleet: Fleet, node: Node, router: bool = True) -> list[dict]:
    """The units the probe looks at on a node: the engine, and the P/D router on the head (probed always: a
    leftover router from an earlier profile still counts), with the inventory's record/status paths."""
    d = node.engine_dir
    specs = [
        {"unit": fleet.unit(), "record": f"{d}/termination.json", "status": f"{d}/status.json",
         "default_port": api_port(node), "host": node.engine_host, "role": "engine"},
    ]  # fmt: skip
    if router and node.head:
        specs.insert(0, {"unit": fleet.router_unit(), "record": f"{d}/router-termination.json",
                         "status": f"{d}/router-status.json", "default_port": api_port(node, True),
                         "host": "", "role": "router"})  # fmt: skip
    return specs


def check_deployment_known(fleet: Fleet, results: list[NodeResult], unit_key: str = "units") -> None:
    """UsageError when no reachable node has the deployment's unit: a misspelt name, or the wrong inventory."""
    reachable = [r for r in results if r.data is not None]
    if not reachable:
        return
    if any(
        ((r.data[unit_key].get(fleet.unit()) or {}).get("show") or {}).get("LoadState") == "loaded" for r in reachable
    ):
        return
    seen = sorted({u for r in reachable for u in r.data.get("llmfleet_units") or []})
    known = sorted({u[len("llmfleet-") : -len(".service")] for u in seen if not u.endswith("-router.service")})
    raise UsageError(
        f"no node has {fleet.unit()}: deployment {fleet.deployment!r} is not installed on "
        f"{', '.join(r.node.name for r in reachable)}"
        + (f"; deployments there: {', '.join(known)}" if known else "; no llmfleet unit there at all")
        + " (give the DEPLOYMENT argument, or -i the inventory of that deployment)"
    )


def emit_json(doc: dict) -> None:
    print(json.dumps(doc, indent=2, sort_keys=False, default=str))


def iso(t: float | None) -> str:
    if not t:
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def ago(t: float | None, now: float | None = None) -> str:
    if not t:
        return ""
    s = int((now or time.time()) - t)
    if s < 0:
        return "in the future (clock skew?)"
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{d}d{h:02d}h" if d else f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def table(rows: list[list[str]]) -> list[str]:
    """Columns aligned on the widest cell; the last column is left ragged."""
    if not rows:
        return []
    n = max(len(r) for r in rows)
    widths = [max([len(r[i]) for r in rows if i < len(r) - 1] or [0]) for i in range(n)]
    return ["  ".join(c.ljust(widths[i]) if i < len(r) - 1 else c for i, c in enumerate(r)).rstrip() for r in rows]


def short(text: Any, n: int = 100) -> str:
    s = " ".join(str(text or "").split())
    return s if len(s) <= n else s[: n - 3] + "..."


def describe(node: Node) -> str:
    return f"{node.name} (node rank {node.rank}{', head' if node.head else ''})"


def where(fleet: Fleet) -> str:
    return f"inventory {', '.join(fleet.sources)}"


def quote(argv: list[str]) -> str:
    return shlex.join(argv)
