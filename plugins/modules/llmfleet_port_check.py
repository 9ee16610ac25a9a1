#!/usr/bin/python
"""Ansible module: listen on, or probe, TCP ports between nodes (rendezvous reachability)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_port_check
short_description: Listen on TCP ports for a while, or probe peers' ports
description:
  - C(mode=listen) binds I(bind):I(ports) and accepts connections for I(duration) seconds (run it async on every
    node first). A port already in use counts as listening (something serves it).
  - C(mode=probe) connects to every target's ports and reports C(open), C(refused) or C(timeout).
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
  - llmfleet.fleet.llmfleet_read_only
options:
  mode:
    description: Listen on the ports, or probe the targets' ports.
    type: str
    choices: [listen, probe]
    required: true
  ports:
    description: TCP ports.
    type: list
    elements: int
    required: true
  bind:
    description: Address to listen on (the role passes the fabric IP).
    type: str
    default: 0.0.0.0
  duration:
    description: Seconds to keep listening.
    type: float
    default: 30
  targets:
    description: Node name -> IP to probe.
    type: dict
    default: {}
  timeout:
    description: Seconds per connection attempt.
    type: float
    default: 3
  ready_file:
    description:
      - C(mode=listen) - a file written once every port is bound (wait for it before probing); removing it stops
        the listener early. The module removes it when it stops.
    type: path
attributes:
  check_mode:
    details:
      - Runs the same in check mode; it changes no managed state. C(mode=listen) still binds the ports for
        I(duration) and writes and removes I(ready_file).
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
- name: Probe the peers
  llmfleet.fleet.llmfleet_port_check:
    mode: probe
    ports: [50080]
    targets: {node2: 10.0.0.12}
"""

RETURN = r"""
reachability:
  description: "C({node: {port: open|refused|timeout}})."
  returned: when I(mode=probe)
  type: dict
listening:
  description: C([{port, state}]) - C(listening), C(in use) or C(error...) per port.
  returned: when I(mode=listen)
  type: list
  elements: dict
"""

import json
import os
import socket
import time

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.checks.preflight import probe_ports


def listen(bind: str, ports: list[int], duration: float, ready_file: str | None = None) -> list[dict]:
    socks, out = [], []
    for port in ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind, port))
            s.listen(64)
            s.setblocking(False)
            socks.append(s)
            out.append({"port": port, "state": "listening"})
        except OSError as e:
            s.close()
            out.append({"port": port, "state": "in use" if e.errno == 98 else f"error: {e}"})
    if ready_file:
        with open(ready_file, "w", encoding="utf-8") as f:
            f.write(json.dumps(out))
    end = time.monotonic() + duration
    while time.monotonic() < end and socks and (not ready_file or os.path.exists(ready_file)):
        for s in socks:
            try:
                conn, _ = s.accept()
                conn.close()
            except BlockingIOError:
                pass
        time.sleep(0.05)
    for s in socks:
        s.close()
    if ready_file and os.path.exists(ready_file):
        os.unlink(ready_file)
    return out


def argument_spec() -> dict:
    """The options (a fresh dict each call: AnsibleModule stores defaults by reference)."""
    return {
        "mode": {"type": "str", "choices": ["listen", "probe"], "required": True},
        "ports": {"type": "list", "elements": "int", "required": True},
        "bind": {"type": "str", "default": "0.0.0.0"},  # noqa: S104 (the role passes the fabric IP)
        "duration": {"type": "float", "default": 30},
        "targets": {"type": "dict", "default": {}},
        "timeout": {"type": "float", "default": 3},
        "ready_file": {"type": "path"},
    }


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)


def run(module: AnsibleModule) -> None:
    p = module.params
    if p["mode"] == "listen":
        module.exit_json(changed=False, listening=listen(p["bind"], p["ports"], p["duration"], p["ready_file"]))
    module.exit_json(changed=False, reachability=probe_ports(p["targets"], p["ports"], p["timeout"]))


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
