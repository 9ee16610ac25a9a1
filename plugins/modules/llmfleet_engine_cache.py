#!/usr/bin/python
"""Ansible module: fingerprint an engine launch and prepare its compile-cache directory on this node."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_engine_cache
short_description: Fingerprint an engine launch and prepare its compile-cache directory
description:
  - Collects what JIT and compile caches are valid for (engine and kernel-library versions as the engine's
    Python sees them, torch's CUDA, the GPU driver and compute capability, TP/PP, the model revision and
    quantization) and hashes it into a 16-hex-digit fingerprint.
  - Creates I(cache_root)/<fingerprint> owned by I(owner):I(group) and removes older fingerprint directories
    beyond I(keep) unless a running process has them open. Directories are opened without following
    symlinks; a planted link fails the task.
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
  - llmfleet.fleet.llmfleet_no_diff
options:
  engine_python:
    description:
      - The engine's Python (asked for the engine and kernel-library versions). It runs as I(owner), never as root,
        so a venv the engine account can write gains it nothing.
    type: path
    required: true
  engine:
    description: Engine name (the engine role's profile, e.g. C(sglang), C(vllm)).
    type: str
    required: true
  engine_version:
    description: Version to hash instead of the installed package's (e.g. an image digest).
    type: str
  model_path:
    description: The model directory the engine loads; its revision and quantization are hashed.
    type: path
    required: true
  revision:
    description:
      - The revision hashed, the fleet contract's C(llmfleet_model_revision). Omitted, it is the name of the directory
        I(model_path) resolves to (an C(engine_model_path) override).
    type: str
  tp:
    description: Tensor-parallel size.
    type: int
    required: true
  pp:
    description: Pipeline-parallel size.
    type: int
    required: true
  extra:
    description: More fingerprint inputs (kernel parameters), hashed as given.
    type: raw
  cache_root:
    description: Per-deployment cache root on the node-local NVMe.
    type: path
    required: true
  keep:
    description: Fingerprint directories kept (the current one counts).
    type: int
    default: 2
  owner:
    description: User the engine runs as; owns the cache directories.
    type: str
    required: true
  group:
    description: Group of I(owner).
    type: str
    required: true
attributes:
  check_mode:
    support: full
    details: Reports the fingerprint and which directories would be created, chowned or removed.
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
- name: Fingerprint the launch and prepare its compile-cache directory
  llmfleet.fleet.llmfleet_engine_cache:
    engine_python: /opt/sglang/bin/python
    engine: sglang
    model_path: /mnt/nvme/models/qwen/current
    tp: 8
    pp: 4
    cache_root: /mnt/nvme/llmfleet/cache/qwen
    owner: llmfleet
    group: llmfleet
  register: _engine_cache
"""

RETURN = r"""
fingerprint:
  description: 16 hex digits identifying the launch.
  returned: success
  type: str
  sample: 0123456789abcdef
inputs:
  description: What was hashed (engine, engine_version, kernel_libs, cuda, driver, compute_capability, tp, pp,
    model_revision, quantization, extra).
  returned: success
  type: dict
model_real_path:
  description: I(model_path) with symlinks resolved.
  returned: success
  type: str
cache_dir:
  description: The directory for this fingerprint.
  returned: success
  type: str
created:
  description: The fingerprint directory was created (would be, in check mode).
  returned: success
  type: bool
chowned:
  description: Cache directories whose owner was set to I(owner):I(group).
  returned: success
  type: list
  elements: str
removed:
  description: Old fingerprint directories removed (and symlinks named like one, unlinked).
  returned: success
  type: list
  elements: str
remove_failed:
  description: Old fingerprint directories that could not be removed, with the error.
  returned: success
  type: list
  elements: str
"""

import grp
import os
import pwd

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet import engines
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.command import PlanError, fingerprint
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.node import (
    engine_versions,
    gpu_facts,
    model_identity,
    prepare_cache,
)
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.safefs import UnsafePathError
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.store import paths_in_use


def fingerprint_dirs_in_use(root: str) -> set[str]:
    """Fingerprint directories (root/<fp>) that a running process uses: never GC those."""
    real = os.path.realpath(root)
    return {os.path.join(root, os.path.relpath(p, real).split(os.sep)[0]) for p in paths_in_use(root)}


def argument_spec() -> dict:
    """The options (a fresh dict each call: AnsibleModule stores defaults by reference)."""
    return {
        "engine_python": {"type": "path", "required": True},
        "engine": {"type": "str", "required": True},
        "engine_version": {"type": "str"},
        "model_path": {"type": "path", "required": True},
        "revision": {"type": "str"},
        "tp": {"type": "int", "required": True},
        "pp": {"type": "int", "required": True},
        "extra": {"type": "raw"},
        "cache_root": {"type": "path", "required": True},
        "keep": {"type": "int", "default": 2},
        "owner": {"type": "str", "required": True},
        "group": {"type": "str", "required": True},
    }


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)


def run(module: AnsibleModule) -> None:
    p = module.params
    try:
        uid, gid = pwd.getpwnam(p["owner"]).pw_uid, grp.getgrnam(p["group"]).gr_gid
    except KeyError as e:
        module.fail_json(msg=f"engine user/group not found on this node: {e}; run the base role first")
    if not os.path.isdir(p["model_path"]):
        module.fail_json(msg=f"engine_model_path {p['model_path']} is not a directory on this node; stage it first")
    try:
        vers = engine_versions(p["engine_python"], run_as=p["owner"])
        gpu = gpu_facts()
    except PlanError as e:
        module.fail_json(msg=str(e))
    ident = model_identity(p["model_path"], p["revision"])
    pkg = engines.kind(p["engine"]) or p["engine"]  # the engine package behind the profile (its version)
    inputs = {
        "engine": p["engine"],
        "engine_version": p["engine_version"] or vers["versions"].get(pkg) or "unknown",
        "kernel_libs": {k: v for k, v in sorted(vers["versions"].items()) if k != pkg},
        "cuda": vers.get("cuda") or "none",
        "driver": gpu["driver"],
        "compute_capability": gpu["compute_capability"],
        "tp": p["tp"],
        "pp": p["pp"],
        "model_revision": ident["model_revision"],
        "quantization": ident["quantization"],
        "extra": p["extra"],
    }
    fp = fingerprint(inputs)
    in_use = fingerprint_dirs_in_use(p["cache_root"])
    try:
        cache = prepare_cache(p["cache_root"], fp, p["keep"], uid=uid, gid=gid, in_use=in_use, check=module.check_mode)
    except UnsafePathError as e:
        module.fail_json(msg=f"compile cache {p['cache_root']}: {e}", fingerprint=fp)
    except (OSError, PlanError) as e:
        module.fail_json(msg=f"cannot prepare the compile cache under {p['cache_root']}: {e}", fingerprint=fp)
    if cache["remove_failed"]:
        module.warn(f"old compile caches not removed: {'; '.join(cache['remove_failed'])}")
    module.exit_json(
        changed=bool(cache["created"] or cache["chowned"] or cache["removed"]),
        fingerprint=fp,
        inputs=inputs,
        model_real_path=ident["model_real_path"],
        **cache,
    )


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
