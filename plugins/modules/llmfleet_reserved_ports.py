#!/usr/bin/python
"""Ansible module: keep the deployments' ports out of the node's ephemeral port range."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_reserved_ports
short_description: Reserve the ports the node's deployments listen on, so that no outgoing connection takes one
description:
  - Linux gives outgoing connections a local port from C(net.ipv4.ip_local_port_range) (32768-60999 by default),
    which holds the engine's default rendezvous and link ports. A connection that got one (open, or closed less than
    60 s ago) makes the engine's bind fail with C(Address already in use), at random.
  - Makes C(net.ipv4.ip_local_reserved_ports) hold every port of the deployments' claims in I(claim_dir) (and
    I(ports)), releases the ports it reserved earlier that no claim holds any more, and keeps the site's own entries.
    The list persists in I(file) (read by systemd-sysctl at boot), removed when llmfleet reserves nothing.
  - A port it has just reserved may still belong to a connection made before; it waits (at most I(wait) seconds)
    until a listener could bind it, and fails naming the connection when one still holds it.
  - Root reads the claims and writes I(file) without following a symlink another user could have planted.
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
options:
  claim_dir:
    description: The deployments' claims on the node (C(<deployment>.json), their C(ports)); absent = none.
    type: path
    required: true
  ports:
    description:
      - Ports to reserve besides the claims' (the role passes its deployment's, so that check mode sees them before
        the claim is written).
    type: list
    elements: int
    default: []
  file:
    description: The sysctl.d file that keeps the reservation across reboots.
    type: path
    default: /etc/sysctl.d/60-llmfleet-reserved-ports.conf
  wait:
    description:
      - Seconds to wait for connections that still hold a port this run reserved (a closed connection holds its port
        60 s); 0 does not wait or check.
    type: float
    default: 75
attributes:
  check_mode:
    description: Says what it would reserve and release; writes nothing and does not wait.
    support: full
  diff_mode:
    description: The node's reservation before and after.
    support: full
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
- name: Reserve the deployments' ports
  llmfleet.fleet.llmfleet_reserved_ports:
    claim_dir: /etc/llmfleet/gpus
    ports: [8000, 50080, 50082]
"""

RETURN = r"""
ports:
  description: The ports llmfleet reserves on the node (every claim's and I(ports)).
  returned: always
  type: list
  elements: int
reserved:
  description: The node's whole reservation after the run (the kernel's syntax, e.g. C(8000,50080-50082)).
  returned: always
  type: str
before:
  description: The reservation before the run.
  returned: always
  type: str
added:
  description: Ports reserved by this run.
  returned: always
  type: list
  elements: int
released:
  description: Ports this run released (llmfleet's, no claim holds them now).
  returned: always
  type: list
  elements: int
file_changed:
  description: Whether I(file) was (would be) written or removed.
  returned: always
  type: bool
claimed:
  description: Port -> C(<deployment> <what>) for every claimed port.
  returned: always
  type: dict
waited:
  description: Seconds waited for connections that held a port just reserved.
  returned: always
  type: float
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.reserved_ports import (
    PortsError,
    converge,
    wait_released,
)
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.safefs import UnsafePathError


def argument_spec() -> dict:
    """The options (a fresh dict each call: AnsibleModule stores defaults by reference)."""
    return {
        "claim_dir": {"type": "path", "required": True},
        "ports": {"type": "list", "elements": "int", "default": []},
        "file": {"type": "path", "default": "/etc/sysctl.d/60-llmfleet-reserved-ports.conf"},
        "wait": {"type": "float", "default": 75},
    }


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)


def run(module: AnsibleModule) -> None:
    p = module.params
    bad = [x for x in p["ports"] if not 0 < x <= 65535]
    if bad:
        module.fail_json(msg=f"ports: {', '.join(map(str, bad))} is not a TCP port (1-65535)")
    try:
        res = converge(p["claim_dir"], set(p["ports"]), p["file"], check=module.check_mode)
        waited = 0.0
        if res["added"] and p["wait"] > 0 and not module.check_mode:
            waited = wait_released(set(res["added"]), p["wait"])
    except (PortsError, UnsafePathError) as e:
        module.fail_json(msg=str(e))
    except OSError as e:
        module.fail_json(msg=f"cannot reserve the deployments' ports: {e}: the module runs as root (become)")
    res["waited"] = waited
    if module._diff:
        res["diff"] = {"before": f"{res['before']}\n", "after": f"{res['reserved']}\n",
                       "before_header": "net.ipv4.ip_local_reserved_ports",
                       "after_header": "net.ipv4.ip_local_reserved_ports"}  # fmt: skip
    module.exit_json(**res)


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
