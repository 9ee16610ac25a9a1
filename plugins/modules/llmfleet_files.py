#!/usr/bin/python
"""Ansible module: a role's directories and small root-owned files on a node, in one module run."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_files
short_description: Create a role's directories and write its small root-owned files in one module run
description:
  - Creates I(directories) in order (missing parents root's, mode 0755) and gives each its owner, group and mode; then
    writes I(files), each only when its content, mode or owner differ (a private temporary name beside it, renamed
    over). What C(ansible.builtin.file) in a loop and C(ansible.builtin.copy)/C(ansible.builtin.template) do, in one
    module run per node instead of one per item.
  - Root never follows a symlink another user could have planted, in a directory's path or at a file's name (a link
    there is replaced by the file, its target untouched).
  - Not for secrets (the content is a module argument and appears in a diff); credentials have tasks of their own
    with C(no_log).
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
options:
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
  files:
    description: Files to write after the directories, owned by root.
    type: list
    elements: dict
    default: []
    suboptions:
      path:
        description: Absolute path; its directory must exist (or be in I(directories)).
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
    description: Says which paths would change and changes nothing.
    support: full
  diff_mode:
    description: The old and new content of every file that changes (would change).
    support: full
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
- name: The deployment's directories and environment file
  llmfleet.fleet.llmfleet_files:
    directories:
      - {path: /var/lib/llmfleet/engine/qwen, owner: llmfleet, group: llmfleet, mode: "0750"}
    files:
      - {path: /etc/llmfleet/engine/qwen.env, content: "NCCL_DEBUG=WARN\n"}
  register: _files
"""

RETURN = r"""
changed_paths:
  description: Directories and files that were created or changed (would be, in check mode), in the order given.
  returned: success
  type: list
  elements: str
diff:
  description: C(before_header), C(after_header), C(before) and C(after) of each file that changed (would change).
  returned: in diff mode, when a file changed
  type: list
  elements: dict
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.nodefiles import Refused, ensure_dir, ensure_file
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.safefs import UnsafePathError


def argument_spec() -> dict:
    return {
        "directories": {"type": "list", "elements": "dict", "default": [], "options": {
            "path": {"type": "path", "required": True}, "owner": {"type": "str", "required": True},
            "group": {"type": "str", "required": True}, "mode": {"type": "str", "required": True}}},
        "files": {"type": "list", "elements": "dict", "default": [], "options": {
            "path": {"type": "path", "required": True}, "content": {"type": "str", "required": True},
            "mode": {"type": "str", "default": "0644"}}},
    }  # fmt: skip


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)


def run(module: AnsibleModule) -> None:
    p, check = module.params, module.check_mode
    changed: list[str] = []
    diffs: list[dict] | None = [] if module._diff else None
    try:
        for d in p["directories"]:
            if ensure_dir(d, check):
                changed.append(d["path"])
        for f in p["files"]:
            if ensure_file(f, check, diffs):
                changed.append(f["path"])
    except (Refused, UnsafePathError) as e:
        module.fail_json(msg=f"{e}; nothing after it was changed", changed_paths=changed)
    except OSError as e:
        module.fail_json(
            msg=f"{e.filename or ''}: {e.strerror or e}; nothing after it was changed", changed_paths=changed
        )
    module.exit_json(changed=bool(changed), changed_paths=changed, **({"diff": diffs} if diffs else {}))


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
