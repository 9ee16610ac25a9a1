#!/usr/bin/python
"""Ansible module: remove one deployment's files from a node (engine_state: absent, playbooks/reset.yml)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_reset
short_description: Remove one deployment's units, files, credentials, claim and (when asked) revisions and runtime
description:
  - Removes, in this order, the files systemd reads for I(units) (the unit file, its drop-in directory, the links that
    enable it, in each of I(unit_dirs)), the deployment's I(paths), every file whose name starts with one of
    I(prefixes), the metrics textfiles in I(labelled) that carry C(deployment="<deployment>"), the staged
    I(revisions), then the I(shared) paths only when no other deployment is installed on the node (a claim in
    I(claim_dir) or an C(llmfleet-<name>.service) unit file).
  - A revision stays, with the reason in I(kept), while another installed engine unit names it, a process outside
    this deployment's units uses it, or a staging run holds the model's lock; with it go its partial copy, its
    publish record, C(current) when it points there and the model directory when nothing else is left.
  - Stop the units first (the engine role does, head first) and reload systemd after (I(units_removed)).
  - Root never follows a symlink another account could have planted; directories are emptied level by level
    through file descriptors (never C(rm -rf) by path), so a link planted inside is unlinked, its target untouched.
    A path that cannot be reached that way is not removed; the module fails naming it once the rest is done.
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
options:
  deployment:
    description: >-
      The deployment's name (C(llmfleet_deployment)): the label that marks its I(labelled) textfiles, and the one
      deployment whose claim and units do not count as another's. C("") counts every installed deployment (the base
      role's runtime removal).
    type: str
    default: ""
  units:
    description: The deployment's systemd units on this node, e.g. C(llmfleet-demo.service).
    type: list
    elements: str
    default: []
  unit_dirs:
    description: Directories whose unit files, drop-ins and enablement links of I(units) are removed.
    type: list
    elements: path
    default: [/etc/systemd/system, /run/systemd/system]
  claim_dir:
    description: >-
      Directory of the deployments' claims on the node (C(<name>.json) each): the other deployments installed here.
      Required with I(shared).
    type: path
    default: ""
  paths:
    description: Files, links or directories (with everything below them) of this deployment, removed when present.
    type: list
    elements: path
    default: []
  prefixes:
    description: >-
      C(<dir>/<start>): every entry of C(<dir>) whose name starts with C(<start>) is removed, e.g.
      C(/etc/llmfleet/credentials/demo.) (the API key, the secret environment's files, the fabric key).
    type: list
    elements: path
    default: []
  labelled:
    description: >-
      Metrics textfiles one file per node holds for whichever deployment wrote it last: removed only when a sample
      carries C(deployment="<deployment>").
    type: list
    elements: path
    default: []
  revisions:
    description: Staged revision directories C(<model root>/<model>/<40-hex revision>) to remove unless another uses them.
    type: list
    elements: path
    default: []
  shared:
    description: Paths every deployment on the node uses (the runtime), removed only when no other deployment is installed.
    type: list
    elements: path
    default: []
attributes:
  check_mode:
    description: Lists what it would remove and removes nothing.
    support: full
  diff_mode:
    description: No diff.
    support: none
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
- name: Remove the deployment demo from the node
  llmfleet.fleet.llmfleet_reset:
    deployment: demo
    units: [llmfleet-demo.service, llmfleet-demo-router.service]
    claim_dir: /etc/llmfleet/gpus
    paths: [/etc/llmfleet/gpus/demo.json, /etc/llmfleet/engine/demo.env, /var/lib/llmfleet/engine/demo]
    prefixes: [/etc/llmfleet/credentials/demo.]
    labelled: [/var/lib/node_exporter/textfile_collector/llmfleet_nccl_check.prom]
  register: _reset
"""

RETURN = r"""
removed:
  description: Paths removed (that would be, in check mode), in the order they went.
  returned: always
  type: list
  elements: str
kept:
  description: Paths left in place and why (another deployment's, in use, locked).
  returned: always
  type: list
  elements: dict
  contains:
    path:
      description: The path.
      returned: always
      type: str
    why:
      description: Why it stays.
      returned: always
      type: str
refused:
  description: Paths not removed because root would have had to follow another account's link to reach them.
  returned: always
  type: list
  elements: str
units_removed:
  description: The unit files, drop-ins and enablement links among I(removed) (systemd needs a daemon-reload then).
  returned: always
  type: list
  elements: str
other_deployments:
  description: The other deployments installed on this node.
  returned: always
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.reset import reset
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.safefs import UnsafePathError
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.errors import StageError


def argument_spec() -> dict:
    paths = {"type": "list", "elements": "path", "default": []}
    return {
        "deployment": {"type": "str", "default": ""},
        "units": {"type": "list", "elements": "str", "default": []},
        "unit_dirs": {"type": "list", "elements": "path", "default": ["/etc/systemd/system", "/run/systemd/system"]},
        "claim_dir": {"type": "path", "default": ""},
        "paths": paths,
        "prefixes": paths,
        "labelled": paths,
        "revisions": paths,
        "shared": paths,
    }


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)


def run(module: AnsibleModule) -> None:
    p = module.params
    if p["labelled"] and not p["deployment"]:
        module.fail_json(msg="labelled textfiles need the deployment whose label marks them")
    if p["shared"] and not p["claim_dir"]:
        module.fail_json(msg="shared paths need claim_dir: without it the module cannot see the other deployments")
    try:
        out = reset(
            deployment=p["deployment"],
            units=p["units"],
            claim_dir=p["claim_dir"],
            paths=p["paths"],
            prefixes=p["prefixes"],
            labelled=p["labelled"],
            revisions=p["revisions"],
            shared=p["shared"],
            check=module.check_mode,
            unit_dirs=p["unit_dirs"],
        )
    except (ValueError, UnsafePathError, StageError) as e:
        module.fail_json(msg=f"{p['deployment']}: {e}; rerun after fixing it (what was removed stays removed)")
    except OSError as e:
        module.fail_json(msg=f"{p['deployment']}: {e.filename or ''}: {e.strerror or e}; rerun after fixing it")
    if out["refused"]:
        module.fail_json(
            msg=f"{p['deployment']}: not removed, root would have followed another account's link: "
            + "; ".join(out["refused"]),
            changed=bool(out["removed"]),
            **out,
        )
    module.exit_json(changed=bool(out["removed"]), **out)


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
