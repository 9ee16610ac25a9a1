#!/usr/bin/python
"""Ansible module: the manifest (size + sha256 per file) of a pinned model revision."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_model_manifest
short_description: Build or reuse the manifest of a pinned model revision on shared storage
description:
  - Resolves the revision's directory (plain checkpoint dir, hub-cache C(models--org--name) dir, or a
    C(snapshots/<rev>) dir), then reuses the cached manifest (C(<cache_dir>/manifests/<model>/<rev>.json)),
    or the one shipped with the source (C(.llmfleet-manifest.json)), or builds it by reading every file once
    while holding a fleet-wide shared-storage reader lease, and caches it.
  - Refuses a cached manifest whose sizes, or recorded mtimes, no longer match the source (a pinned revision
    must not change).
  - Compares the manifest with what the source itself says of its files, without reading the large ones,
    and fails naming each file that disagrees - the hub-cache blob names (C(snapshots/<rev>/<file>) ->
    C(blobs/<sha256>) for LFS files, the git blob id for the others), the Git LFS pointers of a git checkout's
    HEAD (which must be the revision; needs git, not git-lfs), C(<file>.sha256) files and sha256sum lists
    (C(SHA256SUMS), C(SHA256SUMS.txt), C(sha256sums.txt), C(checksums.sha256)). A cached or shipped manifest
    is also checked by re-hashing the source's small files (up to 16 MiB).
  - With I(expected_sha256) (the operator's pin), the manifest must have that digest.
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
  - llmfleet.fleet.llmfleet_no_diff
  - llmfleet.fleet.llmfleet_model_source
options:
  source:
    description: Model directory on shared storage.
    type: path
    required: true
  model:
    description: Model name (directory name under the staging root).
    type: str
    required: true
  cache_dir:
    description: Writable directory on the shared storage for manifests.
    type: path
    required: true
  lease_dir:
    description: Writable directory on the shared storage for reader leases.
    type: path
    required: true
  lease_timeout:
    description: Seconds to wait for a reader slot (>= 0).
    type: float
    default: 3600
  threads:
    description: Files hashed in parallel (>= 1).
    type: int
    default: 4
  expected_sha256:
    description:
      - The manifest digest the revision must have (C(manifest_sha256) of an earlier run, kept where nodes cannot
        write it, e.g. the inventory); a cached manifest that a node or user rewrote is then refused.
      - Unset, the checks against the source are all there is.
    type: str
attributes:
  check_mode:
    support: full
    details: >-
      Never reads file contents (so only sizes and mtimes are checked); reports C(origin='would build') with sizes from
      C(stat) when no manifest exists yet.
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
- name: Manifest of the revision
  llmfleet.fleet.llmfleet_model_manifest:
    source: /mnt/shared/models--Qwen--Qwen3.8
    model: qwen3.8
    revision: d2dc35658bcf77e66643428cb52e774cc3b5bd29
    cache_dir: /mnt/shared/.llmfleet
    lease_dir: /mnt/shared/.llmfleet/leases
  run_once: true
"""

RETURN = r"""
manifest_path:
  description: The cached manifest file (where it will be, in check mode).
  returned: success
  type: str
source_dir:
  description: Resolved directory holding the revision's files.
  returned: success
  type: str
origin:
  description: Where the manifest came from.
  returned: success
  type: str
  choices: [cache, shipped, built, would build]
files:
  description: Number of files in the revision.
  returned: success
  type: int
total_bytes:
  description: Bytes in the revision.
  returned: success
  type: int
manifest_sha256:
  description: The manifest's digest (sha256 of its revision and file list); pin it with I(expected_sha256).
  returned: success, when a manifest exists (not for C(would build))
  type: str
trust:
  description: What the manifest was checked against (null in check mode).
  returned: success
  type: dict
  contains:
    upstream_checked:
      description: Files whose sha256 a digest of the source's own confirms.
      type: int
      returned: always
    upstream_kinds:
      description: Where those digests came from (C(hub blob), C(git-lfs pointer), C(<file>.sha256), a list name).
      type: list
      returned: always
      elements: str
    rehashed:
      description: Small files re-hashed from the source.
      type: int
      returned: always
    unverified:
      description: Files whose sha256 only the manifest itself vouches for.
      type: int
      returned: always
    notes:
      description: What could not be checked and why (e.g. git missing on the node).
      type: list
      returned: always
      elements: str
"""

import socket

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.facts import option_ranges, range_problem
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.errors import StageError
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.lease import Lease, LeaseTimeout
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.manifest import (
    build_manifest,
    digest_problem,
    obtain_manifest,
    source_options,
    stat_manifest,
)
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.staging import resolve_source
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.swarm import lease_check

# Numeric options: a model_stage role variable's name (its bounds, llmfleet.facts.STAGE_RANGES), or (lowest,
# highest or None).
RANGES = option_ranges(
    {
        "max_source_readers": "model_stage_max_source_readers",
        "threads": "model_stage_threads",
        "lease_timeout": (0, None),
    }
)


def argument_spec() -> dict:
    """The options (a fresh dict each call: AnsibleModule stores defaults by reference)."""
    return {
        **source_options(),
        "source": {"type": "path", "required": True},
        "model": {"type": "str", "required": True},
        "cache_dir": {"type": "path", "required": True},
        "lease_dir": {"type": "path", "required": True},
        "lease_timeout": {"type": "float", "default": 3600},
        "threads": {"type": "int", "default": 4},
        "expected_sha256": {"type": "str"},
    }


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)


def run(module: AnsibleModule) -> None:
    p = module.params
    bad = range_problem(p, RANGES) or digest_problem(
        p["expected_sha256"],
        "expected_sha256",
        " (set by the role variable model_stage_manifest_sha256) is not a sha256: give the 64 lowercase hex digits "
        "of manifest_sha256",
    )
    if bad:
        module.fail_json(msg=f"llmfleet_model_manifest: {bad}")
    try:
        src = resolve_source(p["source"], p["revision"])
        allow = p["source_allow_links_into"]

        def build():
            lease = Lease(p["lease_dir"], p["max_source_readers"], host=socket.gethostname(), label="manifest")
            lease.acquire(p["lease_timeout"])
            try:
                check = lease_check(lease, socket.gethostname())
                return build_manifest(
                    src, threads=p["threads"], revision=p["revision"], check=check, allow_links_into=allow
                )
            finally:
                lease.release()

        got = obtain_manifest(
            src,
            p["model"],
            p["revision"],
            p["cache_dir"],
            build=build,
            check_mode=module.check_mode,
            expected_sha256=p["expected_sha256"],
            allow_links_into=allow,
        )
    except (StageError, LeaseTimeout, OSError, ValueError) as e:  # ValueError: a malformed manifest file
        module.fail_json(msg=f"{socket.gethostname()}: manifest of {p['model']}@{p['revision']}: {e}")
    try:
        manifest = got["manifest"] or stat_manifest(src, p["source_allow_links_into"])
    except (StageError, OSError) as e:
        module.fail_json(msg=f"{socket.gethostname()}: manifest of {p['model']}@{p['revision']}: {e}")
    result = {
        "changed": got["origin"] in ("built", "shipped", "would build"),
        "manifest_path": got["path"],
        "source_dir": src,
        "origin": got["origin"],
        "files": len(manifest["files"]),
        "total_bytes": manifest.get("total_bytes", sum(e["size"] for e in manifest["files"])),
        "trust": got.get("trust"),
    }
    if got.get("sha256"):
        result["manifest_sha256"] = got["sha256"]
    module.exit_json(**result)


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
