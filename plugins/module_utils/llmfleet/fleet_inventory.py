"""The fleet as Ansible sees it, for the on-call commands: nodes in node-rank order, how to reach each one
(host, port, user, key, ``-F``/``-o`` of ansible_ssh_common_args, become) and the few role variables they need.

Read with ansible-core's own InventoryManager + VariableManager, and every value used goes through a Templar, so
``ansible_user: "{{ lab_operator }}"`` resolves exactly as in a play. Only the variables used are templated: a
vaulted variable the on-call commands do not need (the API key) is never decrypted.

Ops host only: ansible is imported lazily (the package's node-side core is stdlib-only).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import engines
from .facts import DEPLOYMENT_RE, DEPLOYMENT_RULE

# Role defaults the on-call commands rely on when the inventory does not set them (roles/llmfleet and
# roles/engine defaults; tests/unit/test_fleet_inventory.py fails when these drift from the roles').
DEFAULTS: dict[str, Any] = {
    "llmfleet_node_group": "llmfleet_nodes",
    "llmfleet_head_group": "head",
    "llmfleet_deployment": "main",
    "llmfleet_config_dir": "/etc/llmfleet",
    "llmfleet_state_dir": "/var/lib/llmfleet",
    "llmfleet_fabric_env": "{{ llmfleet_config_dir }}/fabric.env",
    "engine_state_dir": "{{ llmfleet_state_dir }}/engine",
    "engine_profile": engines.DEFAULT,
    "engine_host": "0.0.0.0",  # noqa: S104 (the role default, read; nothing binds here)
    "engine_port": 0,
    "engine_pd_router_port": 30000,
    "engine_ready_deadline": 0,
    "engine_start_timeout": 3600,
}
DEFAULT_PYTHON = "/usr/bin/python3"


class InventoryError(Exception):
    """Bad input: no inventory, no such group, a variable that does not resolve (exit 2)."""


@dataclass
class Ssh:
    """How to reach one node, as Ansible's ssh connection would."""

    host: str
    port: int | None = None
    user: str | None = None
    key_files: list[str] = field(default_factory=list)
    config_file: str | None = None  # -F FILE: replaces ~/.ssh/config and /etc/ssh/ssh_config, as in ssh
    options: dict[str, str] = field(default_factory=dict)  # -o Key=Value (lower-case keys), -J, ...
    host_key_checking: bool = True
    connection: str = "ssh"  # or "local" (ansible_connection: local)


@dataclass
class Node:
    name: str
    rank: int
    head: bool
    ssh: Ssh
    become: bool
    become_user: str
    python: str
    engine_dir: str  # <engine_state_dir>/<deployment>: termination.json, status.json
    fabric_env: str
    profile: str
    engine_host: str
    engine_port: int
    router_port: int
    ready_deadline: float

    def probe_argv(self, spec: str) -> list[str]:
        """The command that runs the node probe (its source on stdin), through sudo when Ansible would become.
        -I -S: the probe is stdlib only, so no PYTHON* variables, user site or site-packages .pth files (a node's
        site import alone can cost more than the probe's whole work)."""
        sudo = ["sudo", "-n", "-u", self.become_user, "--"] if self.become else []
        return [*sudo, self.python, "-I", "-S", "-", spec]


@dataclass
class Fleet:
    sources: list[str]
    deployment: str
    node_group: str
    head_group: str
    nodes: list[Node]
    # llmfleet_replicas as the inventory gives it ([] = one instance): `status` shows each replica's deployment.
    replicas: list = field(default_factory=list)

    @property
    def head(self) -> Node:
        return self.nodes[0]

    def unit(self) -> str:
        return f"llmfleet-{self.deployment}.service"

    def router_unit(self) -> str:
        return f"llmfleet-{self.deployment}-router.service"


def node_order(hosts: list, head_hosts: list) -> list:
    """Node order = node rank: the head first, then the others in inventory order. Same rule as
    filter_plugins' llmfleet_node_order (a test keeps the two equal; that file imports ansible at load)."""
    heads = [h for h in head_hosts or [] if h in hosts]
    return heads + [h for h in hosts if h not in heads]


def parse_extra_vars(items: list[str] | None) -> dict[str, str]:
    """-e KEY=VALUE (repeatable), like ansible-playbook's simplest form."""
    out = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            raise InventoryError(f"-e {item!r}: give KEY=VALUE (e.g. -e lab_operator=root)")
        out[key] = value
    return out


def parse_ssh_args(text: str) -> tuple[str | None, dict[str, str], list[str]]:
    """(-F file, options, -i keys) from ansible_ssh_common_args / ansible_ssh_extra_args. -o, -p, -l, -J and -i
    become ssh_config options (lower-case keys); other ssh flags do not change how a node is reached and are ignored."""
    try:
        words = shlex.split(text or "")
    except ValueError as e:
        raise InventoryError(f"ansible_ssh_common_args {text!r}: {e}") from None
    config_file, options, keys = None, {}, []
    flag_option = {"-p": "port", "-l": "user", "-J": "proxyjump"}
    i = 0
    while i < len(words):
        w = words[i]
        flag, glued = w[:2], w[2:]
        if flag in ("-F", "-o", "-i", *flag_option) and w.startswith("-"):
            value = glued if glued else (words[i + 1] if i + 1 < len(words) else None)
            i += 1 if glued else 2
            if value is None:
                raise InventoryError(f"ansible_ssh_common_args {text!r}: {flag} needs a value")
            if flag == "-F":
                config_file = os.path.expanduser(value)
            elif flag == "-i":
                keys.append(os.path.expanduser(value))
            elif flag == "-o":
                key, sep, val = value.partition("=")
                if not sep:
                    key, _, val = value.partition(" ")
                options.setdefault(key.strip().lower(), val.strip())  # first value wins, as in ssh
            else:
                options.setdefault(flag_option[flag], value)
            continue
        i += 1
    return config_file, options, keys


def _bool(value: Any, what: str) -> bool:
    from ansible.module_utils.parsing.convert_bool import boolean

    try:
        return boolean(value, strict=True)
    except TypeError:
        raise InventoryError(f"{what}: {value!r} is not a boolean (true/false)") from None


def _int(value: Any, what: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InventoryError(f"{what}: {value!r} is not a whole number") from None


class _Vars:
    """One host's variables, templated on demand (inventory < role defaults below it; -e above it)."""

    def __init__(self, loader: Any, name: str, hostvars: Mapping, extra: Mapping) -> None:
        from ansible.template import Templar, trust_as_template

        defaults = {k: trust_as_template(v) if isinstance(v, str) else v for k, v in DEFAULTS.items()}
        self.name = name
        self.raw = {**defaults, **hostvars, **extra}
        self.templar = Templar(loader=loader, variables=self.raw)

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self.raw:
            return default
        try:
            return self.templar.template(self.raw[key])
        except Exception as e:  # AnsibleError and friends: name the host and the variable
            raise InventoryError(f"host {self.name}: cannot resolve {key}: {e}") from None


def default_sources() -> list[str]:
    """The inventory Ansible itself would read (ansible.cfg's `inventory`, ANSIBLE_INVENTORY, ...)."""
    from ansible import constants as C

    return list(C.DEFAULT_HOST_LIST or [])


def load_fleet(
    sources: list[str] | None,
    deployment: str | None = None,
    extra_vars: Mapping | None = None,
    limit: str | None = None,
) -> Fleet:
    """The fleet of an inventory, narrowed to `limit` (a host pattern, as ansible-playbook's --limit) when given.
    Raises InventoryError (bad input) with what to fix."""
    from ansible import constants as C
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.vars.manager import VariableManager

    given = bool(sources)
    sources = [os.path.abspath(os.path.expanduser(s)) for s in (sources or default_sources())]
    missing = [s for s in sources if not os.path.exists(s)]
    if missing or not sources:
        hint = "" if given else " (none given: pass -i INVENTORY or run from a directory whose ansible.cfg names one)"
        raise InventoryError(f"inventory {', '.join(missing) or '(none)'}: no such file or directory{hint}")
    if deployment is not None and not DEPLOYMENT_RE.match(deployment):
        raise InventoryError(
            f"deployment {deployment!r}: {DEPLOYMENT_RULE} (the unit is llmfleet-<deployment>.service)"
        )
    extra = dict(extra_vars or {})
    loader = DataLoader()
    inv = InventoryManager(loader=loader, sources=sources)
    vm = VariableManager(loader=loader, inventory=inv)
    where = ", ".join(sources)
    if not inv.hosts:
        raise InventoryError(f"inventory {where}: no hosts (is it an Ansible inventory? see inventory/example-h20)")
    first = inv.get_hosts(pattern="all")[0]  # the group names come from group_vars/all: any host has them
    probe = _Vars(loader, first.name, vm.get_vars(host=first), extra)
    node_group = str(probe.get("llmfleet_node_group"))
    head_group = str(probe.get("llmfleet_head_group"))
    groups = sorted(g for g in inv.groups if g not in ("all", "ungrouped"))
    if node_group not in inv.groups:
        raise InventoryError(
            f"inventory {where}: no group {node_group!r} (llmfleet_node_group); groups: {', '.join(groups) or 'none'}"
        )
    hosts = [h.name for h in inv.get_hosts(pattern=node_group)]
    heads = [h.name for h in inv.get_hosts(pattern=head_group)] if head_group in inv.groups else []
    heads_in = [h for h in heads if h in hosts]
    if not hosts:
        raise InventoryError(f"inventory {where}: group {node_group!r} has no hosts")
    if limit:
        hosts = _limited(inv, limit, hosts, heads_in, node_group, head_group, where)
    if len(heads_in) != 1:
        raise InventoryError(
            f"inventory {where}: group {head_group!r} (llmfleet_head_group) must hold exactly one host of "
            f"{node_group!r}; it holds {heads_in or 'none'}"
        )
    hk_default = bool(C.HOST_KEY_CHECKING)
    nodes, deployments = [], {}
    for rank, name in enumerate(node_order(hosts, heads_in)):
        v = _Vars(loader, name, vm.get_vars(host=inv.get_host(name)), extra)
        dep = deployment or str(v.get("llmfleet_deployment"))
        deployments.setdefault(dep, []).append(name)
        nodes.append(_node(v, name, rank, rank == 0, dep, hk_default))
    if len(deployments) > 1:
        split = "; ".join(f"{d}: {', '.join(ns)}" for d, ns in deployments.items())
        raise InventoryError(f"inventory {where}: nodes disagree on llmfleet_deployment ({split}): fix the inventory")
    dep = next(iter(deployments))
    if not DEPLOYMENT_RE.match(dep):
        raise InventoryError(
            f"inventory {where}: llmfleet_deployment {dep!r} is not a valid deployment name: {DEPLOYMENT_RULE}"
        )
    head_vars = _Vars(loader, nodes[0].name, vm.get_vars(host=inv.get_host(nodes[0].name)), extra)
    replicas = head_vars.get("llmfleet_replicas", []) or []
    return Fleet(sources, dep, node_group, head_group, nodes, replicas if isinstance(replicas, list) else [])


def _limited(inv: Any, limit: str, hosts: list, heads_in: list, node_group: str, head_group: str, where: str) -> list:  # noqa: PLR0917
    """The node group's hosts a host pattern keeps (ansible-playbook's --limit). The head decides node ranks, so
    it must stay in: a limit that drops it names another fleet."""
    inv.subset(limit)
    kept = {h.name for h in inv.get_hosts(pattern=node_group)}
    if not kept:
        raise InventoryError(f"--limit {limit!r} matches no host of {node_group!r} in {where}")
    if heads_in and heads_in[0] not in kept:
        raise InventoryError(
            f"--limit {limit!r} leaves out the head {heads_in[0]} ({head_group}): the on-call commands act on "
            "a whole deployment; include the head"
        )
    return [h for h in hosts if h in kept]


def _node(v: _Vars, name: str, rank: int, head: bool, deployment: str, hk_default: bool) -> Node:  # noqa: PLR0917
    conn = str(v.get("ansible_connection") or "ssh")
    if conn in ("smart", "paramiko", "ansible.builtin.ssh", "ansible.builtin.paramiko_ssh", "paramiko_ssh"):
        conn = "ssh"
    elif conn == "ansible.builtin.local":
        conn = "local"
    if conn not in ("ssh", "local"):
        raise InventoryError(f"host {name}: ansible_connection {conn!r} is not supported by the on-call commands")
    config_file, options, keys = None, {}, []
    for var in ("ansible_ssh_common_args", "ansible_ssh_extra_args"):
        f, o, k = parse_ssh_args(str(v.get(var) or ""))
        config_file = config_file or f
        for key, val in o.items():
            options.setdefault(key, val)
        keys += k
    if config_file and not os.path.isfile(config_file):
        raise InventoryError(f"host {name}: ssh config {config_file} (-F in ansible_ssh_common_args): no such file")
    key = v.get("ansible_ssh_private_key_file") or v.get("ansible_private_key_file")
    keys = [os.path.expanduser(str(key)), *keys] if key else keys
    port = v.get("ansible_port", v.get("ansible_ssh_port"))
    user = v.get("ansible_user", v.get("ansible_ssh_user"))
    hkc = v.get("ansible_host_key_checking", v.get("ansible_ssh_host_key_checking", hk_default))
    ssh = Ssh(
        host=str(v.get("ansible_host") or v.get("ansible_ssh_host") or name),
        port=_int(port, f"host {name}: ansible_port") if port not in (None, "") else None,
        user=str(user) if user else None,
        key_files=keys,
        config_file=config_file,
        options=options,
        host_key_checking=_bool(hkc, f"host {name}: ansible_host_key_checking"),
        connection=conn,
    )
    become = _bool(v.get("ansible_become", _default_become()), f"host {name}: ansible_become")
    method = str(v.get("ansible_become_method") or "sudo")
    if become and method != "sudo":
        raise InventoryError(
            f"host {name}: ansible_become_method {method!r}: the on-call commands become with `sudo -n` only "
            "(passwordless sudo for the ansible_user)"
        )
    python = str(v.get("ansible_python_interpreter") or "")
    if not python.startswith("/") or "{" in python:  # auto, auto_silent, python3: the usual node path
        python = DEFAULT_PYTHON
    port_ = _int(v.get("engine_port"), f"host {name}: engine_port")
    ready = _int(v.get("engine_ready_deadline"), f"host {name}: engine_ready_deadline")
    return Node(
        name=name,
        rank=rank,
        head=head,
        ssh=ssh,
        become=become,
        become_user=str(v.get("ansible_become_user") or "root"),
        python=python,
        engine_dir=f"{str(v.get('engine_state_dir')).rstrip('/')}/{deployment}",
        fabric_env=str(v.get("llmfleet_fabric_env")),
        profile=str(v.get("engine_profile")),
        engine_host=str(v.get("engine_host") or ""),
        engine_port=port_,
        router_port=_int(v.get("engine_pd_router_port"), f"host {name}: engine_pd_router_port"),
        ready_deadline=float(ready if ready > 0 else _int(v.get("engine_start_timeout"), "engine_start_timeout")),
    )


def _default_become() -> bool:
    """ansible.cfg's [privilege_escalation] become (ANSIBLE_BECOME), for hosts that do not set ansible_become."""
    from ansible import constants as C

    return bool(C.DEFAULT_BECOME)
