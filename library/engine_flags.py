#!/usr/bin/python
"""Ansible module: refuse engine flags the installed engine does not know (with a did-you-mean)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: engine_flags
short_description: Check an engine command line against the engine's own --help
description:
  - Runs the engine's help once (C(sglang serve --help), C(vllm serve --help=all)) and fails naming every
    flag of I(argv) it does not list, with close matches. Read-only.
options:
  command: {description: The engine command (e.g. [sglang, serve])., type: list, elements: str, required: true}
  profile: {description: sglang, vllm, vllm_pd or custom (which help flag to pass)., type: str, required: true}
  argv: {description: The full command line the unit will run., type: list, elements: str, required: true}
  timeout: {description: Seconds the help may take (real engines import torch first)., type: float, default: 300}
author: llmfleet developers
"""

EXAMPLES = r"""
- name: Flags
  engine_flags:
    command: [sglang, serve]
    profile: sglang
    argv: [sglang, serve, --model-path, /m, --tp-size, "8"]
"""

RETURN = r"""
known_flags: {description: How many flags the help lists., returned: always, type: int}
unknown: {description: "[{flag, did_you_mean}]", returned: always, type: list}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.llmfleet.engine import PlanError, describe_unknown, help_text, parse_help_flags, unknown_flags


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "command": {"type": "list", "elements": "str", "required": True},
            "profile": {"type": "str", "required": True},
            "argv": {"type": "list", "elements": "str", "required": True},
            "timeout": {"type": "float", "default": 300},
        },
        supports_check_mode=True,
    )
    p = module.params
    try:
        text = help_text(p["command"], p["profile"], p["timeout"])
    except PlanError as e:
        module.fail_json(msg=str(e), unknown=[], known_flags=0)
    problems = unknown_flags(p["argv"], text, skip=len(p["command"]))
    known = len(parse_help_flags(text))
    if problems:
        module.fail_json(msg=describe_unknown(problems, " ".join(p["command"])), unknown=problems, known_flags=known)
    module.exit_json(changed=False, unknown=[], known_flags=known)


if __name__ == "__main__":
    main()
