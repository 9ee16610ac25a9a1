"""Replicas behind the engine's own router (llmfleet.engine.replicas): the fleet contract's check of
llmfleet_replicas, the engine role's expansion of it into one deployment per replica, and the router's argv."""

from __future__ import annotations

from ansible.errors import AnsibleFilterError


def llmfleet_replicas_problem(replicas, shape) -> str:
    """'' when llmfleet_replicas can be placed on the nodes, else every problem (replica, node, fix). shape:
    deployment, nodes, tp, pp, gpus_per_node, port (llmfleet.engine.replicas.expand)."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine import replicas as r

    try:
        r.expand(replicas, shape)
    except r.ReplicaError as e:
        return str(e)
    return ""


def llmfleet_replicas(replicas, shape) -> list:
    """Each replica as the engine role launches it: {index, name, deployment, nodes, gpus, port}."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine import replicas as r

    try:
        return r.expand(replicas, shape)
    except r.ReplicaError as e:
        raise AnsibleFilterError(str(e)) from None


def llmfleet_replica_router_argv(spec) -> list:
    """The replicas' router argv (vllm-router or sglang-router) from the role's router spec."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine import replicas as r

    try:
        return r.router_argv(spec)
    except r.ReplicaError as e:
        raise AnsibleFilterError(str(e)) from None


def llmfleet_replica_router_kind(router, engine) -> str:
    """engine_replica_router, or the engine's own router."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine import replicas as r

    try:
        return r.router_kind(router, engine)
    except r.ReplicaError as e:
        raise AnsibleFilterError(str(e)) from None


def llmfleet_replica_router_exec(w, argv) -> list:
    """The replicas' router unit's `llmfleet exec` command line (after the CLI's path)."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine import replicas as r

    try:
        return r.router_exec(w, argv)
    except r.ReplicaError as e:
        raise AnsibleFilterError(str(e)) from None


def llmfleet_in_flight(metrics) -> int | None:
    """The requests a replica still answers or holds queued, from its /metrics text; None when the text has
    none of the engines' gauges (a rollout then cannot wait for the replica to drain)."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine import replicas as r

    return r.in_flight(metrics)


def llmfleet_router_unit_change(old, new) -> str:
    """none | workers | restart: what a new text of the replicas' router unit asks of the running router."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine import replicas as r

    return r.router_unit_change(old, new)


def llmfleet_router_listed(doc) -> list:
    """The worker URLs in a replicas' router's worker list (vllm-router's or sglang-router's answer)."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine import replicas as r

    return r.listed_urls(doc)


class FilterModule:
    def filters(self) -> dict:
        return {
            "llmfleet_replicas_problem": llmfleet_replicas_problem,
            "llmfleet_replicas": llmfleet_replicas,
            "llmfleet_replica_router_argv": llmfleet_replica_router_argv,
            "llmfleet_replica_router_kind": llmfleet_replica_router_kind,
            "llmfleet_replica_router_exec": llmfleet_replica_router_exec,
            "llmfleet_in_flight": llmfleet_in_flight,
            "llmfleet_router_unit_change": llmfleet_router_unit_change,
            "llmfleet_router_listed": llmfleet_router_listed,
        }
