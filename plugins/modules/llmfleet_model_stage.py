#!/usr/bin/python
"""Ansible module: stage a pinned model revision onto this node's NVMe (one node of a fleet)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_model_stage
short_description: Stage a pinned model revision to node-local NVMe, verified and atomic
description:
  - Copies the files of one revision into C(<root>/<model>/.partial-<rev>/), hashing each file in the same
    pass and comparing it with the manifest, fsyncs, checks the checkpoint structure, then publishes
    C(<root>/<model>/<rev>/) read-only by rename and switches C(<root>/<model>/current) atomically.
  - Seed nodes read their share of the files from shared storage while holding a fleet-wide reader lease
    (at most I(max_source_readers) nodes at once, across playbook runs); every node serves its verified
    files to peers over HTTP on I(serve_bind):I(serve_port) and fetches the rest from peers, verifying each.
  - A rerun keeps verified files (resume); a published revision is checked by size + mtime (or sha256 with
    I(deep_verify)) and copies nothing. A damaged published revision is repaired in a new partial directory
    (intact files hard-linked, damaged ones re-fetched) and swapped in only once verified; until then the
    published revision and C(current) stay as they were.
  - One run per model and node at a time (a lock in C(<root>/<model>/.stage.lock)); a second run waits up to
    I(lock_wait) seconds, then fails naming the run that holds it (pid, host, start time, who).
  - Old revisions beyond I(keep) and abandoned partial directories are removed; never C(current), the revision
    just staged, one an installed engine unit names (I(unit_glob)) or one a process uses (open files,
    mappings, cwd, argv or environment). Writes progress JSON to I(progress_path) while running.
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
  - llmfleet.fleet.llmfleet_job
  - llmfleet.fleet.llmfleet_no_diff
  - llmfleet.fleet.llmfleet_model_source
options:
  source:
    description: Directory of the revision on shared storage (resolved like M(llmfleet.fleet.llmfleet_model_manifest)).
    type: path
    required: true
  manifest_path:
    description: Manifest from M(llmfleet.fleet.llmfleet_model_manifest) (not needed in check mode).
    type: path
  manifest_sha256:
    description:
      - The manifest's digest as M(llmfleet.fleet.llmfleet_model_manifest) returned it (C(manifest_sha256)); the manifest file
        read here must have it, so a manifest rewritten on the shared storage between the two tasks is refused.
      - Unset, the file is used as it is.
    type: str
  root:
    description: Staging root on the node-local NVMe.
    type: path
    default: /mnt/nvme/models
  model:
    description: Model name (directory under I(root)).
    type: str
    required: true
  threads:
    description: Concurrent file copies (and source reads) on this node (>= 1).
    type: int
    default: 4
  keep:
    description:
      - Published revisions to keep (>= 1). GC never removes C(current), the revision just staged, one an
        engine unit names or one a process uses.
    type: int
    default: 2
  unit_glob:
    description:
      - Installed engine units (with their C(.d/*.conf) drop-ins and C(EnvironmentFile=) files); GC keeps every
        revision whose directory C(<root>/<model>/<revision>) appears in one of them. A unit that cannot be read
        stops GC from deleting any revision.
    type: str
    default: /etc/systemd/system/llmfleet-*.service
  lock_wait:
    description: Seconds to wait for another staging run of the same model on this node to finish (>= 0).
    type: float
    default: 0
  run_by:
    description: Who started this run (recorded in the lock, shown to a second run); default the node's C(SUDO_USER) or user.
    type: str
    default: ""
  free_space_margin_bytes:
    description: Free space to leave on the NVMe beyond the revision.
    type: int
    default: 0
  deep_verify:
    description: Re-hash a published revision instead of trusting size + mtime.
    type: bool
    default: false
  activate:
    description: Point C(current) at this revision.
    type: bool
    default: true
  lease_dir:
    description: Writable shared directory for reader leases.
    type: path
    required: true
  lease_ttl:
    description: Seconds a lease lives without renewal (>= 1).
    type: float
    default: 120
  lease_timeout:
    description: Seconds to wait for a reader slot.
    type: float
    default: 3600
  me:
    description: This node's inventory name.
    type: str
    required: true
  peers:
    description: Inventory name -> C(http://fabric-ip:port) of every node staging in this run.
    type: dict
    default: {}
  seeds:
    description: Nodes that read from shared storage in this run (the files are split among them).
    type: list
    elements: str
    default: []
  peer_key_file:
    description:
      - The deployment's fabric key file (root-only, mode 0600; the llmfleet role writes it). Every request to a peer
        server proves the key, and the peer server answers nobody else (403). The module reads the file itself; the
        key is never an option's value.
      - Required when this node serves (I(serve_port)) or has peers.
    type: path
  serve_bind:
    description: Address the peer server binds (the role passes the fabric IP).
    type: str
    default: 0.0.0.0
  serve_port:
    description: Peer server port (0 = do not serve).
    type: int
    default: 0
  peer_wait:
    description: Seconds to wait for a peer to have a file before reading the source.
    type: float
    default: 3600
  peer_dead_after:
    description: Seconds without an answer after which a peer is considered gone.
    type: float
    default: 60
  finish_wait:
    description: Seconds to keep serving peers after this node is done.
    type: float
    default: 600
  progress_path:
    description: JSON progress file written while copying (read by M(llmfleet.fleet.llmfleet_job_wait)).
    type: path
  job_timeout:
    description: With I(detach), the job is killed after this many seconds, as an async task's limit would kill it.
    type: int
    default: 21600
  rate_limit_bytes_per_s:
    description: Cap on this node's copy rate (0 = unlimited).
    type: int
    default: 0
attributes:
  check_mode:
    support: full
    details: Reports the state and the files and bytes that would be copied; touches nothing.
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
- name: Start staging on every node (returns at once; the copy runs detached)
  llmfleet.fleet.llmfleet_model_stage:
    source: /mnt/shared/models--Qwen--Qwen3.8
    manifest_path: /mnt/shared/.llmfleet/manifests/qwen3.8/d2dc35658bcf77e66643428cb52e774cc3b5bd29.json
    model: qwen3.8
    revision: d2dc35658bcf77e66643428cb52e774cc3b5bd29
    lease_dir: /mnt/shared/.llmfleet/leases
    me: "{{ inventory_hostname }}"
    progress_path: /var/lib/llmfleet/stage-progress.json
    detach: true
    job_timeout: 21600
  register: _stage_job
  changed_when: false
"""

RETURN = r"""
ansible_job_id:
  description: The detached job's id, for M(llmfleet.fleet.llmfleet_job_wait).
  returned: when I(detach) is true, not in check mode
  type: str
results_file:
  description: The detached job's file on the node (async_wrapper's format) that M(llmfleet.fleet.llmfleet_job_wait) reads.
  returned: when I(detach) is true, not in check mode
  type: str
started:
  description: The detached job started.
  returned: when I(detach) is true, not in check mode
  type: bool
finished:
  description: The detached job has not finished yet (always false here).
  returned: when I(detach) is true, not in check mode
  type: bool
state:
  description: What the node has of the revision - C(absent), C(partial), C(published) or C(damaged).
  returned: check mode
  type: str
state_before:
  description: The same, before this run copied anything.
  returned: success
  type: str
revision:
  description: The staged revision.
  returned: success
  type: str
path:
  description: Published revision directory.
  returned: success
  type: str
total_bytes:
  description: Bytes in the revision.
  returned: always
  type: int
bytes_to_copy:
  description: Bytes that had to be copied at start (in check mode, that would be copied).
  returned: always
  type: int
files_to_copy:
  description: Files that had to be copied at start (in check mode, that would be copied).
  returned: always
  type: int
elapsed_s:
  description: Seconds the run spent holding the model's lock (plan, copy, verify, publish, garbage collection).
  returned: success
  type: float
bytes_copied:
  description: Bytes written on this node.
  returned: success
  type: int
source_bytes_read:
  description: Bytes this node read from shared storage.
  returned: success
  type: int
peer_bytes_read:
  description: Bytes this node fetched from peers.
  returned: success
  type: int
served_bytes:
  description: Bytes this node served to peers.
  returned: success
  type: int
peer_refused:
  description: Requests to this node's peer server refused (403) for want of proof of the fabric key.
  returned: success
  type: int
peer_refused_from:
  description: The first 10 refused requests, each the client address and port, then why (also in the node journal).
  returned: success
  type: list
  elements: str
reader_intervals:
  description: C([start, end]) epoch seconds of this node's shared-storage reading.
  returned: success
  type: list
  elements: list
source_fallback_files:
  description: Files read from shared storage because no peer had them in time.
  returned: success
  type: list
  elements: str
seed:
  description: This node was a seed (read part of the files from shared storage).
  returned: success
  type: bool
assigned_files:
  description: Files assigned to this node to read from shared storage.
  returned: success
  type: int
cpu_s:
  description: CPU seconds (user + system) the staging process used on this node (copying, hashing, serving peers).
  returned: success
  type: float
gc:
  description: What garbage collection deleted and kept after publishing (a deletion makes the task changed).
  returned: when the revision is published
  type: dict
  contains:
    removed:
      description: Revisions deleted.
      type: list
      elements: str
      returned: always
    removed_partials:
      description: Abandoned C(.partial-*) (and C(.repair-old-*)) directories deleted.
      type: list
      elements: str
      returned: always
    kept:
      description: Every revision and partial directory left, with why (newest I(keep), current, just staged, named by a unit, in use by a pid).
      type: dict
      returned: always
    kept_in_use:
      description: Revisions beyond I(keep) kept because an engine unit names them or a process uses them.
      type: list
      elements: str
      returned: always
    skipped:
      description: Why no revision was deleted (an engine unit that could not be read), or null.
      type: str
      returned: always
"""

import os
import socket

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet import jobs
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.fabric_key import FabricKeyError, load_key_file
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.facts import option_ranges, range_problem
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.errors import StageError
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.lease import LeaseTimeout
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.manifest import (
    digest_problem,
    load_manifest,
    manifest_digest,
    source_options,
    stat_manifest,
)
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.staging import (
    StageRequest,
    plan,
    resolve_source,
)
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.store import UNIT_GLOB
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.swarm import SwarmConfig, run_node

# Numeric options: a model_stage role variable's name (its bounds, llmfleet.facts.STAGE_RANGES), or (lowest,
# highest or None[, the role variable that sets it in other units]).
RANGES = option_ranges(
    {
        "threads": "model_stage_threads",
        "keep": "model_stage_keep",
        "free_space_margin_bytes": (0, None, "model_stage_free_space_margin_gb"),
        "max_source_readers": "model_stage_max_source_readers",
        "lease_ttl": (1, None),
        "lease_timeout": (0, None),
        "serve_port": "model_stage_peer_port",
        "peer_wait": (0, None),
        "peer_dead_after": (0.1, None),
        "finish_wait": (0, None, "model_stage_timeout"),
        "rate_limit_bytes_per_s": (0, None, "model_stage_rate_limit_mib_s"),
        "lock_wait": "model_stage_lock_wait",
    }
)


def argument_spec() -> dict:
    """The options (a fresh dict each call: AnsibleModule stores defaults by reference)."""
    return {
        **source_options(),
        "source": {"type": "path", "required": True},
        "manifest_path": {"type": "path"},
        "manifest_sha256": {"type": "str"},
        "root": {"type": "path", "default": "/mnt/nvme/models"},
        "model": {"type": "str", "required": True},
        "threads": {"type": "int", "default": 4},
        "keep": {"type": "int", "default": 2},
        "unit_glob": {"type": "str", "default": UNIT_GLOB},
        "lock_wait": {"type": "float", "default": 0},
        "run_by": {"type": "str", "default": ""},
        "free_space_margin_bytes": {"type": "int", "default": 0},
        "deep_verify": {"type": "bool", "default": False},
        "activate": {"type": "bool", "default": True},
        "lease_dir": {"type": "path", "required": True},
        "lease_ttl": {"type": "float", "default": 120},
        "lease_timeout": {"type": "float", "default": 3600},
        "me": {"type": "str", "required": True},
        "peers": {"type": "dict", "default": {}},
        "seeds": {"type": "list", "elements": "str", "default": []},
        "peer_key_file": {"type": "path"},
        "serve_bind": {"type": "str", "default": "0.0.0.0"},  # noqa: S104 (documented; the role passes the fabric IP)
        "serve_port": {"type": "int", "default": 0},
        "peer_wait": {"type": "float", "default": 3600},
        "peer_dead_after": {"type": "float", "default": 60},
        "finish_wait": {"type": "float", "default": 600},
        "detach": {"type": "bool", "default": False},
        "job_timeout": {"type": "int", "default": 21600},
        "progress_path": {"type": "path"},
        "rate_limit_bytes_per_s": {"type": "int", "default": 0},
    }


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)


def run(module: AnsibleModule) -> None:
    p = module.params
    host = socket.gethostname()
    bad = range_problem(p, RANGES) or digest_problem(
        p["manifest_sha256"],
        "manifest_sha256",
        " is not a sha256: give the manifest_sha256 that llmfleet_model_manifest returned",
    )
    if bad:
        module.fail_json(msg=f"llmfleet_model_stage: {bad}")
    try:
        src = resolve_source(p["source"], p["revision"])
        if p["manifest_path"] and os.path.isfile(p["manifest_path"]):
            manifest = load_manifest(p["manifest_path"])
            got = manifest_digest(manifest)
            if p["manifest_sha256"] and got != p["manifest_sha256"]:
                module.fail_json(
                    msg=f"{host} ({p['me']}): the manifest {p['manifest_path']} has digest {got}, not the "
                    f"{p['manifest_sha256']} that llmfleet_model_manifest checked: it was rewritten on the shared "
                    "storage since (a node or user can write there); rerun, and find who writes it"
                )
        elif module.check_mode:
            manifest = stat_manifest(src, p["source_allow_links_into"])
        else:
            module.fail_json(
                msg=f"{host}: manifest_path {p['manifest_path']!r} missing: run llmfleet_model_manifest first"
            )
        req = StageRequest(
            manifest=manifest,
            margin_bytes=p["free_space_margin_bytes"],
            check_mode=module.check_mode,
            **options(p, "root", "model", "revision", "threads", "keep", "deep_verify", "activate", "progress_path",
                      "rate_limit_bytes_per_s", "lock_wait", "unit_glob", "run_by"),
        )  # fmt: skip
        if module.check_mode:
            pl = plan(req)
            module.exit_json(
                changed=pl["state"] != "published",
                state=pl["state"],
                bytes_to_copy=sum(e["size"] for e in pl["todo"]),
                files_to_copy=len(pl["todo"]),
                total_bytes=pl["total_bytes"],
            )
        if p["progress_path"]:
            os.makedirs(os.path.dirname(p["progress_path"]), exist_ok=True)
        cfg = SwarmConfig(
            source_dir=src,
            peer_key=fabric_key(module, host),
            **options(p, "me", "source_allow_links_into", "lease_dir", "max_source_readers", "peers", "seeds",
                      "serve_bind", "serve_port", "lease_ttl", "lease_timeout", "peer_wait", "peer_dead_after",
                      "finish_wait"),
        )  # fmt: skip
    except (StageError, LeaseTimeout, OSError, ValueError) as e:  # ValueError: a malformed manifest file
        module.fail_json(msg=f"{host} ({p['me']}): staging {p['model']}@{p['revision']} failed: {e}")
    if p["detach"]:
        module.exit_json(
            changed=False, **jobs.start(lambda: staged(req, cfg, p, host), p["job_timeout"], name="llmfleet-stage")
        )
    result = staged(req, cfg, p, host)
    if result.get("failed"):
        module.fail_json(**result)
    module.exit_json(**result)


def options(params: dict, *names: str) -> dict:
    """The named options as keyword arguments of the same names (those the package takes as they are)."""
    return {n: params[n] for n in names}


def fabric_key(module: AnsibleModule, host: str) -> bytes:
    """The deployment's fabric key from peer_key_file, read as root from a root-only file (b"" for a lone node)."""
    p = module.params
    if not p["peer_key_file"]:
        if p["serve_port"] or any(h != p["me"] for h in p["peers"]):
            module.fail_json(
                msg=f"{host} ({p['me']}): peer_key_file is required when this node serves or has peers (the peer "
                "servers answer only the deployment's nodes): give the fabric key file the llmfleet role writes"
            )
        return b""
    try:
        return load_key_file(p["peer_key_file"])
    except FabricKeyError as e:
        module.fail_json(msg=f"{host} ({p['me']}): {e}")
        raise  # not reached: fail_json exits


def staged(req: StageRequest, cfg: SwarmConfig, p: dict, host: str) -> dict:
    """The module's result: this node's staging (run_node), or a failure naming the node, model and revision."""
    try:
        return run_node(req, cfg)
    except (StageError, LeaseTimeout, OSError, ValueError) as e:
        return {"failed": True, "changed": False,
                "msg": f"{host} ({p['me']}): staging {p['model']}@{p['revision']} failed: {e}"}  # fmt: skip


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
