"""Replicas: one deployment served by several TP x PP instances behind the engine's own router.

The inventory's llmfleet_replicas lists them; each replica runs as a deployment of its own, named
<deployment>-<replica> (its unit, claim, deployment link, gate and heal are that deployment's: a replica is
the fault domain), and a router unit of the base deployment's name routes to all of them. This module holds
the one rule for the shape (the fleet contract checks it, the engine role expands it) and the router's argv.
Stdlib only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..facts import deployment_problem
from .command import PlanError, check_layout
from .gpuset import GpuSetError, resolve

KEYS = ("name", "nodes", "gpus", "port", "state")
# A replica listed with state: absent is removed (scale-in), its nodes still in the inventory; present is the default.
STATES = ("present", "absent")
ROUTERS = ("vllm-router", "sglang-router")
# The router each engine ships (the simulator stands in for either engine; vllm-router routes to both).
ROUTER_OF_ENGINE = {"vllm": "vllm-router", "sglang": "sglang-router"}


class ReplicaError(ValueError):
    """An llmfleet_replicas the fleet cannot place; the message names the replica, the node and the fix."""


def _int(v: Any, default: int = 0) -> int:
    try:
        return int(v) if v not in (None, "") else default
    except (TypeError, ValueError):
        return default


def expand(replicas: Any, shape: Mapping) -> list[dict]:
    """Each replica as the engine role launches it: {index, name, deployment, nodes (head first), gpus, port, url,
    state}.

    replicas: llmfleet_replicas, a list of {name, nodes, gpus (optional, the GPU indexes each of its nodes gives
    it, as llmfleet_gpus), port (optional, its API port; the engine's port otherwise), state (optional: present, or
    absent to remove it while its nodes stay in the inventory)}. shape: deployment, nodes
    (the hosts of llmfleet_nodes), tp, pp, gpus_per_node, port (the API port every replica uses unless it names
    its own), head_hosts (the head group: a replica holding it has it first), fabric_ips (host -> the address the
    router reaches its API on; url). Raises ReplicaError listing every problem, each naming the replica, the node
    and the fix."""
    if not isinstance(replicas, list) or not replicas:
        raise ReplicaError(
            f"llmfleet_replicas={replicas!r} is not a list of replicas: give a list such as "
            "[{name: r0, nodes: [node1, node2]}, {name: r1, nodes: [node3, node4]}], or leave it out (one instance)"
        )
    group = [str(n) for n in shape.get("nodes") or []]
    problems: list[str] = []
    out: list[dict] = []
    names: list[str] = []
    for i, r in enumerate(replicas):
        one = _replica(i, r, shape, group, problems)
        if one is None:
            continue
        if one["name"] in names:
            problems.append(f"replica {one['name']}: the name is used twice in llmfleet_replicas: give each its own")
        names.append(one["name"])
        out.append(one)
    present = [r for r in out if r["state"] == "present"]
    problems += _sharing_problems(present)
    if out and not present and not problems:
        problems.append(
            "every replica is state: absent: remove the whole deployment with playbooks/reset.yml instead (its router "
            "would have no worker)"
        )
    # A node of a replica being removed (state: absent) is placed: it is in the play to have that replica removed.
    placed = {n for r in out for n in r["nodes"]}
    idle = [n for n in group if n not in placed]
    if idle and not problems:
        problems.append(
            f"{', '.join(idle)} in llmfleet_nodes but in no replica: add each to a replica's nodes, or take it out "
            "of the group"
        )
    if problems:
        raise ReplicaError("llmfleet_replicas: " + "; ".join(problems) + ".")
    return out


def _replica(i: int, r: Any, shape: Mapping, group: list, problems: list) -> dict | None:
    """One replica checked (its problems appended), or None when it has no name or nodes to go on with."""
    if not isinstance(r, Mapping):
        problems.append(f"llmfleet_replicas[{i}]={r!r} is not a mapping: give {{name: r{i}, nodes: [...]}}")
        return None
    label = f"replica {r.get('name', f'#{i}')!s}"
    extra = sorted(str(k) for k in r if k not in KEYS)
    if extra:
        problems.append(f"{label}: unknown key {', '.join(extra)} (a replica has {', '.join(KEYS)})")
    name = r.get("name")
    if not isinstance(name, str) or not name:
        problems.append(f"llmfleet_replicas[{i}] has no name: give it one such as r{i}")
        return None
    derived = f"{shape.get('deployment')}-{name}"
    bad = deployment_problem(derived, "its deployment")
    if bad:
        problems.append(f"{label}: {bad} (<llmfleet_deployment>-<replica name>): shorten or rename the replica")
    rnodes = r.get("nodes")
    if not isinstance(rnodes, list) or not rnodes or not all(isinstance(n, str) and n for n in rnodes):
        problems.append(f"{label}: nodes={rnodes!r} is not a list of node names: list the hosts it runs on")
        return None
    dup = sorted({n for n in rnodes if rnodes.count(n) > 1})
    if dup:
        problems.append(f"{label} names {', '.join(dup)} twice: a replica runs once per node")
    outside = [n for n in rnodes if n not in group]
    if outside:
        problems.append(
            f"{label}: {', '.join(outside)} not in llmfleet_nodes: add the host to the group or take it out of "
            "the replica"
        )
    gpus = r.get("gpus") or []
    if not isinstance(gpus, list):
        problems.append(f"{label}: gpus={gpus!r} is not a list of GPU indexes (as llmfleet_gpus)")
        gpus = []
    # One spelling per GPU, so that "1" and 1 on two replicas are seen as the same GPU.
    gpus = [int(g) if isinstance(g, str) and g.isdigit() else g for g in gpus]
    gpn = _int(shape.get("gpus_per_node"))
    try:
        rpn = check_layout(_int(shape.get("tp"), 1), _int(shape.get("pp"), 1), len(set(rnodes)), gpn or None)
        resolve(gpus, gpn, None, rpn)
    except (PlanError, GpuSetError) as e:
        problems.append(f"{label} ({len(set(rnodes))} nodes): {e}")
    if r.get("port") not in (None, "") and not 0 < _int(r.get("port"), -1) < 65536:
        problems.append(f"{label}: port={r.get('port')!r} is not a TCP port (1-65535)")
    port = _int(r.get("port"), _int(shape.get("port")))
    state = r.get("state") or "present"
    if state not in STATES:
        problems.append(f"{label}: state={state!r}: use present (the default) or absent (the replica is removed)")
    # Node order = node rank: the fleet's head first when the replica holds it, then the order given.
    heads = [h for h in shape.get("head_hosts") or [] if h in rnodes]
    ordered = heads + [n for n in rnodes if n not in heads]
    ip = (shape.get("fabric_ips") or {}).get(ordered[0]) or ordered[0]
    return {"index": i, "name": name, "deployment": derived, "nodes": ordered, "gpus": gpus, "port": port,
            "url": f"http://{ip}:{port}", "state": state}  # fmt: skip


def _sharing_problems(replicas: list[dict]) -> list[str]:
    """Replicas that share a node: each single-node (a multi-node replica owns its nodes: its rendezvous and link
    ports are the engine's), on disjoint GPUs named in gpus, on distinct API ports."""
    problems: list[str] = []
    on: dict[str, list[dict]] = {}
    for r in replicas:
        for n in r["nodes"]:
            on.setdefault(n, []).append(r)
    for node, rs in on.items():
        if len(rs) < 2:
            continue
        names = ", ".join(r["name"] for r in rs)
        multi = [r["name"] for r in rs if len(r["nodes"]) > 1]
        if multi:
            problems.append(
                f"{node} holds replicas {names}, and {', '.join(multi)} spans several nodes: a multi-node replica "
                "owns its nodes; give it nodes of its own, or make the replicas that share a node single-node"
            )
            continue
        whole = [r["name"] for r in rs if not r["gpus"]]
        if whole:
            problems.append(
                f"{node} holds replicas {names}, and {', '.join(whole)} names no gpus (the whole node): give each "
                "replica on a shared node its own gpus"
            )
        else:
            owner: dict[int, str] = {}
            for r in rs:
                for g in r["gpus"]:
                    if g in owner:
                        problems.append(
                            f"{node}: GPU {g} is in replicas {owner[g]} and {r['name']}: give each disjoint gpus"
                        )
                    owner.setdefault(g, r["name"])
        ports: dict[int, str] = {}
        for r in rs:
            if r["port"] in ports:
                problems.append(
                    f"{node}: replicas {ports[r['port']]} and {r['name']} would both listen on port {r['port']}: "
                    "give each replica on a shared node its own port"
                )
            ports.setdefault(r["port"], r["name"])
    return problems


def router_kind(router: Any, engine: Any) -> str:
    """The router in front of the replicas: engine_replica_router, or the engine's own (vLLM's for a custom engine,
    which vllm-router routes to as to any OpenAI-compatible server)."""
    if router:
        if router not in ROUTERS:
            raise ReplicaError(f"engine_replica_router={router!r}: use one of {', '.join(ROUTERS)}")
        return str(router)
    return ROUTER_OF_ENGINE.get(str(engine or ""), "vllm-router")


# How the router checks its workers and retries a request (docs/engine.md): a dead replica leaves the rotation
# after failure_threshold x interval seconds, and a request that met it meanwhile is retried on another.
# sglang-router 0.3.2's console scripts (one CLI): each needs its `launch` subcommand to start the router alone.
SGLANG_ROUTER_CLIS = ("sglang-router", "smg", "amg")
# The router's health check of each replica (engine_replica_router_health): a replica that fails `failures` checks in
# a row leaves the rotation until it passes `successes`. Every 1 s with a 1 s timeout, a hung replica was out 4.7 s
# after the fault behind vllm-router 0.1.17 (3.6 s for a killed rank; every 2 s with 2 s: 6.4 s), measured in the lab
# (docs/measurements/bench-rollout.md).
HEALTH = {"interval": 1, "timeout": 1, "failures": 2, "successes": 2}


def _health(given: Any) -> dict[str, int]:
    """HEALTH with the inventory's engine_replica_router_health over it (every value a whole number >= 1)."""
    if given in (None, ""):
        given = {}
    if not isinstance(given, Mapping):
        raise ReplicaError(f"engine_replica_router_health={given!r}: a mapping of {', '.join(HEALTH)}")
    out = dict(HEALTH)
    for key, value in given.items():
        if key not in HEALTH:
            raise ReplicaError(f"engine_replica_router_health.{key}: not a setting of the router's health check "
                               f"(use {', '.join(HEALTH)})")  # fmt: skip
        n = _int(value)
        if n < 1:
            raise ReplicaError(f"engine_replica_router_health.{key}={value!r}: a whole number of at least 1")
        out[key] = n
    return out


def router_argv(spec: Mapping) -> list[str]:
    """The replicas' router argv. spec: kind (vllm-router | sglang-router), command (its executable; [] = the
    kind's name), host, port, urls (each replica's head API, as the router reaches it), startup_timeout, health
    (over HEALTH), extra_args."""
    kind = str(spec.get("kind") or "vllm-router")
    if kind not in ROUTERS:
        raise ReplicaError(f"engine_replica_router={kind!r}: use one of {', '.join(ROUTERS)}")
    command = [str(c) for c in spec.get("command") or []] or [kind]
    urls = [str(u) for u in spec.get("urls") or []]
    if not urls:
        raise ReplicaError("the replicas' router has no worker: llmfleet_replicas lists no replica")
    port = _int(spec.get("port"))
    if not 0 < port < 65536:
        raise ReplicaError(f"engine_replica_router_port={spec.get('port')!r} is not a TCP port (1-65535)")
    # sglang-router's CLI has subcommands: without `launch` (a path to it as well) it prints its help and exits 0.
    launch = kind == "sglang-router" and command[-1].rsplit("/", 1)[-1] in SGLANG_ROUTER_CLIS
    argv = [*command, *(["launch"] if launch else [])]
    argv += ["--host", str(spec.get("host") or "127.0.0.1"), "--port", str(port), "--worker-urls", *urls]
    argv += ["--policy", "round_robin"]
    health = _health(spec.get("health"))
    argv += ["--health-check-interval-secs", str(health["interval"]), "--health-check-timeout-secs",
             str(health["timeout"]), "--health-failure-threshold", str(health["failures"]),
             "--health-success-threshold", str(health["successes"])]  # fmt: skip
    # The metrics listener: on the router's own address (both routers default to a port of their own).
    argv += ["--prometheus-host", str(spec.get("host") or "127.0.0.1")]
    timeout = _int(spec.get("startup_timeout"))
    argv += ["--worker-startup-timeout-secs", str(timeout)] if timeout else []
    argv += ["--worker-startup-check-interval", "2"]
    return argv + [str(a) for a in spec.get("extra_args") or []]


# The line each router logs once it can route (the wrapper's READY): vllm-router 0.1.17 logs
# `Router ready | workers: [...]` as soon as one worker answers /health (measured); sglang-router 0.3.2 is a
# fork of the same gateway and is matched on the same words.
READY_RE = {"vllm-router": r"Router ready", "sglang-router": r"Router ready|Router started|Starting server"}
# How each router is handed the API key it sends to the replicas (names only, from the unit's credential):
# vllm-router reads OPENAI_API_KEY; sglang-router takes --api-key, which it also requires from its own clients.
SECRET_ARGS = {"vllm-router": ("--secret-env", "OPENAI_API_KEY=api-key")}


def router_exec(w: Mapping, argv: list) -> list[str]:
    """The router unit's `llmfleet exec` options and argv (docs/wrapper.md): its record and status, READY on the
    router's own line, the termination metrics, the API key by credential name. w: kind, record, status,
    stop_timeout, extend_timeout, metrics_dir, deployment, node, api_key."""
    kind = str(w.get("kind") or "vllm-router")
    out = ["exec", "--record", str(w["record"]), "--status", str(w["status"]), "--ready-regex", READY_RE[kind],
           "--ready-count", "1", "--stop-timeout", str(max(1, _int(w.get("stop_timeout"), 30) - 10)),
           "--extend-timeout", str(w.get("extend_timeout") or 300)]  # fmt: skip
    if w.get("metrics_dir"):
        out += [
            "--metrics-dir",
            str(w["metrics_dir"]),
            "--deployment",
            str(w["deployment"]),
            "--link-node",
            str(w["node"]),
        ]
    if str(w.get("api_key")).strip().lower() in ("true", "yes", "1", "on"):
        if kind not in SECRET_ARGS:
            raise ReplicaError(
                f"{kind} takes the replicas' API key only on its command line (--api-key), where a secret never goes: "
                "set engine_replica_router=vllm-router (it reads the key from a credential), or run without "
                "llmfleet_api_key"
            )
        out += list(SECRET_ARGS[kind])
    return [*out, "--", *(str(a) for a in argv)]


# The gauges each engine's /metrics counts its requests in (vLLM 0.32: running, waiting; SGLang 0.5: running,
# queued), as captured from the real builds (contrib/grafana/build_dashboard.py reads the same names).
IN_FLIGHT_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "sglang:num_running_reqs",
                    "sglang:num_queue_reqs")  # fmt: skip


def in_flight(metrics: Any) -> int | None:
    """The requests a replica is still answering or holds queued, from its /metrics text (the sum of the
    engine's gauges over their label sets); None when the text has none of them (not an engine we know)."""
    total, seen = 0.0, False
    for line in str(metrics or "").splitlines():
        name, _sep, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else line.partition(" ")
        if name not in IN_FLIGHT_GAUGES:
            continue
        value = rest.rsplit("}", 1)[-1].split() if "}" in rest else rest.split()
        try:
            total += float(value[0])
        except (IndexError, ValueError):
            continue
        seen = True
    return int(total) if seen else None


def _router_unit_key(text: str) -> tuple[list[str], list[str]]:
    """A router unit's text without what only names its workers: its comment lines, and the URLs after
    --worker-urls in ExecStart (up to the next option). Returns (the rest, the worker URLs)."""
    import shlex

    rest: list[str] = []
    urls: list[str] = []
    for line in str(text or "").splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.startswith("ExecStart="):
            try:
                argv = shlex.split(line[len("ExecStart=") :])
            except ValueError:
                rest.append(line)
                continue
            kept, on = [], False
            for a in argv:
                if a == "--worker-urls":
                    on = True
                    kept.append(a)
                elif on and not a.startswith("--"):
                    urls.append(a)
                else:
                    on = False
                    kept.append(a)
            line = "ExecStart=" + " ".join(kept)
        rest.append(line)
    return rest, urls


def router_unit_change(old: Any, new: Any) -> str:
    """What a new text of the replicas' router unit asks of a running router: "none" (the same unit), "workers"
    (only its replicas differ: added and removed through the router's worker API, the router and the replicas
    routed to keep serving) or "restart" (its flags, port, key or anything else changed, or there was no unit)."""
    if not str(old or "").strip():
        return "restart"
    if str(old) == str(new):
        return "none"
    (old_rest, old_urls), (new_rest, new_urls) = _router_unit_key(old), _router_unit_key(new)
    if old_rest != new_rest:
        return "restart"
    return "workers" if old_urls != new_urls else "none"


def listed_urls(doc: Any) -> list[str]:
    """The worker URLs a replicas' router lists on its worker API: vllm-router 0.1.17's GET /list_workers
    {"urls": [...]}, sglang-router 0.3.2's GET /workers {"workers": [{"url", ...}]}; [] for anything else."""
    doc = doc if isinstance(doc, Mapping) else {}
    if isinstance(doc.get("urls"), list):
        return [str(u) for u in doc["urls"]]
    workers = doc.get("workers")
    return (
        [str(w["url"]) for w in workers if isinstance(w, Mapping) and w.get("url")] if isinstance(workers, list) else []
    )
