#!/usr/bin/python
"""Ansible module: read, in one round trip, what the engine role needs to know about a node before it plans."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_engine_probe
short_description: Read the node state the engine role plans from, in one round trip
description:
  - Read-only. Resolves the model directory the units would load, reads the other deployments' GPU and port
    claims, looks for numactl, reads the fabric environment the topology role wrote, lists this deployment's
    credential files and, when asked, says whether a P/D router unit file of this deployment is left on the node.
  - One module call instead of a stat, find or slurp task each (the engine role ran ten of them on every node
    and every converge).
  - Files are opened without following a final symlink; the claims and credentials directories are root's.
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
  - llmfleet.fleet.llmfleet_read_only
options:
  model_path:
    description:
      - The model directory the units would load - the fleet contract's revision directory, or the inventory's
        I(engine_model_path) override, whose links are resolved (the deprecated C(current) link among them).
    type: path
    required: true
  claim_dir:
    description: The directory of the deployments' claims on the node (one C(<deployment>.json) each).
    type: path
    required: true
  claim_path:
    description: This deployment's own claim (left out of I(claims)).
    type: path
    required: true
  fabric_env:
    description: The fabric environment file the topology role writes.
    type: path
    required: true
  credentials_dir:
    description: The root-only directory of the engine credentials.
    type: path
    required: true
  deployment:
    description: The deployment whose credential files are listed (C(<deployment>.api-key), C(<deployment>.env-*)).
    type: str
    required: true
  router_unit:
    description: A P/D router unit whose unit file to look for in /etc/systemd/system; omitted, it is not looked for.
    type: str
  engine_user:
    description:
      - The engine's service account. With I(engine_python), I(engine_run_as) says which account the role runs the
        engine's Python as (never root from a path another account can change).
    type: str
  engine_python:
    description: The engine's Python, checked with I(engine_user).
    type: path
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
- name: Read the node's model revision, claims, fabric environment and credentials
  llmfleet.fleet.llmfleet_engine_probe:
    model_path: /mnt/nvme/models/demo-model/5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed
    claim_dir: /etc/llmfleet/gpus
    claim_path: /etc/llmfleet/gpus/demo.json
    fabric_env: /etc/llmfleet/fabric.env
    credentials_dir: /etc/llmfleet/credentials
    deployment: demo
  register: _engine_probe
"""

RETURN = r"""
model:
  description: The model path as the units would load it. C(present) is true when it resolves to a directory;
    C(dir) is the resolved path (the revision directory behind C(current)).
  returned: success
  type: dict
  sample: {present: true, dir: /mnt/nvme/models/demo-model/5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed}
claims:
  description: The other deployments' claims on the node, as their files hold them.
  returned: success
  type: list
  elements: dict
numactl:
  description: /usr/bin/numactl exists.
  returned: success
  type: bool
fabric_env:
  description: The fabric environment file's text; null when the file is missing.
  returned: success
  type: str
credentials:
  description: This deployment's credential files on the node.
  returned: success
  type: list
  elements: str
router_unit_file:
  description: With I(router_unit), whether its unit file is in /etc/systemd/system (a link counts).
  returned: when router_unit is given
  type: bool
engine_user_exists:
  description: Whether the I(engine_user) account exists on the node (the base role creates it).
  returned: when engine_user is given
  type: bool
engine_run_as:
  description:
    - The account to run the engine's Python as (C(runuser -u)) - I(engine_user) when the module runs as root and
      the account exists on the node. Empty - run it as the connecting account, which is root only when the engine
      account does not exist (yet) and no account but root can change what the Python executes; otherwise the task
      fails naming the path and its owner.
  returned: when engine_user and engine_python are given
  type: str
"""

import json
import os
import pwd
import stat

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine_env import EngineEnvError, popen_kwargs
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.oncall.node_probe import read_file

UNIT_DIR = "/etc/systemd/system"
NUMACTL = "/usr/bin/numactl"
MAX_READ = 1 << 20  # claims and fabric.env are a few hundred bytes


def argument_spec() -> dict:
    """The options (a fresh dict each call: AnsibleModule stores defaults by reference)."""
    return {
        "model_path": {"type": "path", "required": True},
        "claim_dir": {"type": "path", "required": True},
        "claim_path": {"type": "path", "required": True},
        "fabric_env": {"type": "path", "required": True},
        "credentials_dir": {"type": "path", "required": True},
        "deployment": {"type": "str", "required": True},
        "router_unit": {"type": "str"},
        "engine_user": {"type": "str"},
        "engine_python": {"type": "path"},
    }


class ProbeError(Exception):
    pass


def read_text(path: str) -> str | None:
    """A regular file's text, never through a final symlink (node_probe.read_file); None when it is missing."""
    data, err = read_file(path, cap=MAX_READ + 1)
    if err:
        raise ProbeError(err)
    if data is not None and len(data) > MAX_READ:
        raise ProbeError(f"{path} is larger than {MAX_READ} bytes")
    return None if data is None else data.decode("utf-8", errors="replace")


def model(path: str) -> dict:
    real = os.path.realpath(path)
    return {"present": os.path.isdir(real), "dir": real}


def claims(claim_dir: str, own: str) -> list[dict]:
    """The other deployments' claims (*.json regular files); a file that is not a JSON object is named."""
    try:
        names = sorted(os.listdir(claim_dir))
    except FileNotFoundError:
        return []  # no deployment has claimed anything on this node yet
    except OSError as e:
        raise ProbeError(f"cannot list the claims in {claim_dir}: {e.strerror}") from e
    out = []
    for name in names:
        path = os.path.join(claim_dir, name)
        if not name.endswith(".json") or path == own or not stat.S_ISREG(os.lstat(path).st_mode):
            continue
        text = read_text(path)
        try:
            claim = json.loads(text or "")
        except ValueError:
            claim = None
        if not isinstance(claim, dict):
            raise ProbeError(f"claim {path} is not a JSON object: remove it if its deployment is gone")
        out.append(claim)
    return out


def credentials(cred_dir: str, deployment: str) -> list[str]:
    try:
        names = os.listdir(cred_dir)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise ProbeError(f"cannot list {cred_dir}: {e.strerror}") from e
    mine = [n for n in names if n == f"{deployment}.api-key" or n.startswith(f"{deployment}.env-")]
    return sorted(os.path.join(cred_dir, n) for n in mine)


def probe(p: dict) -> dict:
    result = {
        "model": model(p["model_path"]),
        "claims": claims(p["claim_dir"], p["claim_path"]),
        "numactl": os.path.exists(NUMACTL),
        "fabric_env": read_text(p["fabric_env"]),
        "credentials": credentials(p["credentials_dir"], p["deployment"]),
    }
    if p["router_unit"]:
        result["router_unit_file"] = os.path.lexists(os.path.join(UNIT_DIR, p["router_unit"]))
    if p["engine_user"]:
        result["engine_user_exists"] = user_exists(p["engine_user"])
    if p["engine_user"] and p["engine_python"]:
        result["engine_run_as"] = engine_run_as(p["engine_user"], p["engine_python"])
    return result


def user_exists(user: str) -> bool:
    try:
        pwd.getpwnam(user)
    except KeyError:
        return False
    return True


def engine_run_as(user: str, python: str) -> str:
    """The account to drop to before running the engine's Python ("" for none: engine_env.popen_kwargs decides)."""
    try:
        kw = popen_kwargs(python, user, what="the engine's Python")
    except EngineEnvError as e:
        raise ProbeError(str(e)) from None
    return user if "user" in kw or "preexec_fn" in kw else ""


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)


def main() -> None:
    module = build_module()
    try:
        result = probe(module.params)
    except ProbeError as e:
        module.fail_json(msg=f"{os.uname().nodename}: {e}")
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
