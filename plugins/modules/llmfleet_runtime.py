#!/usr/bin/python
"""Ansible module (with the action plugin of the same name): install the llmfleet node runtime in one module run.

The action plugin (action_plugins/llmfleet_runtime.py) packs the package on the ops host and runs this module
with the archive's sha256; only when the node's package differs does it send the archive and run it again."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_runtime
short_description: Install the llmfleet node runtime package (sent only when the node's differs)
description:
  - Checks that I(python) is a Python 3.8 or newer; gives I(metrics_dir) to I(metrics_group) with mode 01775; and
    installs the llmfleet package from I(src) into I(lib_dir). Its directories, the C(llmfleet) command and
    C(runtime.env) are written by M(llmfleet.fleet.llmfleet_files) (the base role runs both).
  - The package is packed on the ops host into a deterministic archive (sorted names, fixed times, root owners),
    without the ops host's tools (its C(accept), C(oncall) and C(report) subpackages) - on a node,
    C(llmfleet status) and the other on-call, report and acceptance commands say they run on the ops host.
    Its sha256 is compared with the one recorded beside the package on the node; only when they differ is the
    archive sent, extracted beside the old package, compiled with I(python) (with the path it will have) and
    swapped in (no file of a removed module stays behind, and a package that does not compile is never swapped
    in). An unchanged package costs one module run and no transfer.
  - An action plugin (C(action_plugins/llmfleet_runtime.py)) with a module of the same name that runs on the node.
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
  - llmfleet.fleet.llmfleet_no_diff
options:
  src:
    description:
      - Directory on the ops host holding the llmfleet package (the project's C(module_utils/llmfleet)); it must
        hold C(__init__.py).
    type: path
    required: true
  lib_dir:
    description:
      - Directory on the node the package goes into, as C(lib_dir/llmfleet); it must exist, be root-owned and
        writable by nobody else.
    type: path
    required: true
  python:
    description: The node's Python that runs the package (3.8 or newer); it compiles the package.
    type: path
    required: true
  metrics_dir:
    description:
      - node_exporter's textfile directory, which must already exist (its package makes it; a missing one is a typo
        or a node without node_exporter). It gets I(metrics_group) and mode 01775 so the engine's wrapper can write
        its own file there and, with the sticky bit, no other. Empty for none.
    type: path
    default: ""
  metrics_group:
    description: The group that may write into I(metrics_dir) (required with it).
    type: str
    default: ""
attributes:
  check_mode:
    description: Says what would change and changes nothing; the archive is not sent.
    support: full
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
- name: Install the llmfleet runtime
  llmfleet.fleet.llmfleet_runtime:
    src: "{{ playbook_dir }}/../module_utils/llmfleet"
    lib_dir: /opt/llmfleet/lib
    python: /usr/bin/python3
"""

RETURN = r"""
python_version:
  description: The version of I(python), C(major.minor).
  returned: success
  type: str
package_files:
  description: Files in the package.
  returned: success
  type: int
sha256:
  description: sha256 of the package's archive, recorded on the node beside the package.
  returned: success
  type: str
installed:
  description: The package was installed (would be, in check mode) because the node's differed or was missing.
  returned: success
  type: bool
changed_paths:
  description: The metrics directory and the package directory when they changed (would change, in check mode).
  returned: success
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.runtime_install import (
    Refused,
    UnsafePathError,
    run,
)


def argument_spec() -> dict:
    """The node side's options: the action's without src, with the archive's sha256 and path it adds."""
    return {
        "lib_dir": {"type": "path", "required": True},
        "python": {"type": "path", "required": True},
        "metrics_dir": {"type": "path", "default": ""},
        "metrics_group": {"type": "str", "default": ""},
        "archive_sha256": {"type": "str", "required": True},
        "archive": {"type": "path", "default": ""},
    }


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)


def main() -> None:
    module = build_module()
    try:
        out = run(module.params, module.check_mode)
    except (Refused, UnsafePathError) as e:
        module.fail_json(msg=str(e))
    except OSError as e:
        module.fail_json(msg=f"{e.filename or ''}: {e.strerror or e}; nothing after it was changed")
    module.exit_json(changed=bool(out["changed_paths"]), **out)


if __name__ == "__main__":
    main()
