#!/usr/bin/python
"""Ansible module (with the action plugin of the same name): install the llmfleet node runtime in one module run.

The action plugin (action_plugins/llmfleet_runtime.py) packs the package on the ops host and runs this module
with the archive's sha256; only when the node's package differs does it send the archive and run it again."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_runtime
short_description: Install the llmfleet node runtime (package, command, environment file, directories)
description:
  - One task for what the base role did in about twenty - each of them a module run on every node. In order, it
    checks that I(python) is a Python 3.8 or newer; creates I(directories) (owner, group and mode set, a symlink
    in their path refused unless only root could have made it); gives I(metrics_dir) to I(metrics_group) with mode
    01775; writes I(files) (root-owned, atomically, only when their content or mode differ); and installs the
    package from I(src).
  - The package is packed on the ops host into a deterministic archive (sorted names, fixed times, root owners).
    Its sha256 is compared with the one recorded beside the package on the node; only when they differ is the
    archive sent, extracted beside the old package, compiled with I(python) and swapped in (no file of a removed
    module stays behind). An unchanged package costs one module run and no transfer.
  - An action plugin (C(action_plugins/llmfleet_runtime.py)) with a module of the same name that runs on the node.
options:
  src:
    description:
      - Directory on the ops host holding the llmfleet package (the project's C(module_utils/llmfleet)); it must
        hold C(__init__.py).
    type: path
    required: true
  lib_dir:
    description:
      - Directory on the node the package goes into, as C(lib_dir/llmfleet); it must exist (list it in
        I(directories)), be root-owned and writable by nobody else.
    type: path
    required: true
  python:
    description: The node's Python that runs the package (3.8 or newer); it compiles the package.
    type: path
    required: true
  directories:
    description: Directories to create (with their parents) in this order, and the owner, group and mode to give them.
    type: list
    elements: dict
    default: []
    suboptions:
      path:
        description: Absolute path.
        type: path
        required: true
      owner:
        description: User name of the owner.
        type: str
        required: true
      group:
        description: Group name.
        type: str
        required: true
      mode:
        description: Octal mode, e.g. C("0750").
        type: str
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
  files:
    description: Small root-owned files to write, such as the C(llmfleet) command and the runtime environment file.
    type: list
    elements: dict
    default: []
    suboptions:
      path:
        description: Absolute path; its directory must exist.
        type: path
        required: true
      content:
        description: The whole content.
        type: str
        required: true
      mode:
        description: Octal mode.
        type: str
        default: "0644"
attributes:
  check_mode:
    description: Says what would change and changes nothing; the archive is not sent.
    support: full
  diff_mode:
    description: No diff.
    support: none
author: llmfleet developers
"""

EXAMPLES = r"""
- name: Install the llmfleet runtime
  llmfleet_runtime:
    src: "{{ playbook_dir }}/../module_utils/llmfleet"
    lib_dir: /opt/llmfleet/lib
    python: /usr/bin/python3
    directories:
      - {path: /opt/llmfleet/lib, owner: root, group: root, mode: "0755"}
    files:
      - {path: /etc/llmfleet/runtime.env, content: "PYTHONPATH=/opt/llmfleet/lib\n"}
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
  description: Directories and files that were created or changed (would be, in check mode).
  returned: success
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.llmfleet.runtime_install import Refused, UnsafePathError, run


def argument_spec() -> dict:
    """The node side's options: the action's without src, with the archive's sha256 and path it adds."""
    return {
        "lib_dir": {"type": "path", "required": True},
        "python": {"type": "path", "required": True},
        "directories": {"type": "list", "elements": "dict", "default": [], "options": {
            "path": {"type": "path", "required": True}, "owner": {"type": "str", "required": True},
            "group": {"type": "str", "required": True}, "mode": {"type": "str", "required": True}}},
        "metrics_dir": {"type": "path", "default": ""},
        "metrics_group": {"type": "str", "default": ""},
        "files": {"type": "list", "elements": "dict", "default": [], "options": {
            "path": {"type": "path", "required": True}, "content": {"type": "str", "required": True},
            "mode": {"type": "str", "default": "0644"}}},
        "archive_sha256": {"type": "str", "required": True},
        "archive": {"type": "path", "default": ""},
    }  # fmt: skip


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
