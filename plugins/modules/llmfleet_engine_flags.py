#!/usr/bin/python
"""Ansible module: refuse engine flags the installed engine does not know (with a did-you-mean)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_engine_flags
short_description: Check an engine command line against the engine's own --help
description:
  - Runs the engine's help once (C(sglang serve --help), C(vllm serve --help=all)) and fails naming every
    flag of I(argv) the engine would not accept, with why and close matches.
  - Reads the help as the engine's own parser reads argv (C(llmfleet.engine.helpflags)), per I(profile) - vLLM takes
    C(--max_num_seqs), dotted keys (C(-cc.mode=none)), C(-O3) and unique prefixes; SGLang unique prefixes
    (C(--tp)); an ambiguous prefix (C(--enable-metric) where C(--enable-metrics) and
    C(--enable-metrics-for-all-schedulers) exist) is refused, as the engine refuses it.
  - Changes nothing but its help cache (I(cache_dir)).
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
  - llmfleet.fleet.llmfleet_read_only
options:
  command:
    description: The engine command, e.g. C([sglang, serve]); the first I(command) words of I(argv) are not flags.
    type: list
    elements: str
    required: true
  profile:
    description:
      - Which help flag to pass and how the engine reads argv (the engine role's C(engine_profile)).
      - C(router) is vLLM's P/D router (C(vllm-router --help)); its flags must be spelled out exactly.
    type: str
    choices: [sglang, vllm, vllm_pd, custom, router]
    required: true
  argv:
    description: The full command line the unit will run.
    type: list
    elements: str
    required: true
  timeout:
    description: Seconds the help may take (real engines import torch first).
    type: float
    default: 300
  cache_dir:
    description:
      - A root-owned directory (created 0700) where the help of this exact engine install is kept, so a
        later run skips the engine's help (C(vllm serve --help=all) imports vLLM and torch, 20-30 s).
      - A cached help counts only with I(cache_key), the command, the profile and the executable's inode, size
        and mtime all unchanged, read from a directory and file no user but root can change; empty = no cache.
    type: path
    default: ""
  cache_key:
    description: What else identifies the engine install, e.g. the engine and kernel-library versions.
    type: str
    default: ""
  run_as:
    description:
      - The engine's service account (C(llmfleet_user)) - the help runs as that account, with its groups, so an
        engine environment that account can write gains it nothing.
      - Empty (or C(root)) - the help runs as root, and only when no other account can change what it executes (the
        program, the directories above it, its venv's site-packages and what is in it); otherwise the task fails
        naming the path and its owner.
    type: str
    default: ""
attributes:
  check_mode:
    details: Runs the engine's help in check mode too; reads the help cache then, never writes it.
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
- name: Check the engine flags against the engine's own --help
  llmfleet.fleet.llmfleet_engine_flags:
    command: [sglang, serve]
    profile: sglang
    argv: [sglang, serve, --model-path, /m, --tp-size, "8"]

- name: Check the P/D router's flags against vllm-router --help
  llmfleet.fleet.llmfleet_engine_flags:
    command: [/opt/vllm/bin/vllm-router]
    profile: router
    argv: [/opt/vllm/bin/vllm-router, --vllm-pd-disaggregation, --prefill, "http://10.0.0.11:8000", --decode, "http://10.0.0.12:8000"]
"""

RETURN = r"""
cached:
  description: Whether the help came from I(cache_dir) instead of running the engine.
  returned: always
  type: bool
known_flags:
  description: How many option strings the help lists.
  returned: always
  type: int
unknown:
  description:
    - The refused flags, C([{flag, why, did_you_mean}]).
    - I(why) is C(unknown), C(ambiguous), C(abbreviation) or C(malformed).
  returned: always
  type: list
  elements: dict
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet import engines
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.command import PlanError, describe_unknown
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.helpflags import (
    parse_help_flags,
    unknown_flags,
)
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.node import help_text


def argument_spec() -> dict:
    """The options (a fresh dict each call: AnsibleModule stores defaults by reference)."""
    return {
        "command": {"type": "list", "elements": "str", "required": True},
        # Every engine profile, and the P/D router (DOCUMENTATION lists the same: tests/unit/test_engines.py).
        "profile": {"type": "str", "choices": [*engines.names(), "router"], "required": True},
        "argv": {"type": "list", "elements": "str", "required": True},
        "timeout": {"type": "float", "default": 300},
        "cache_dir": {"type": "path", "default": ""},
        "cache_key": {"type": "str", "default": "", "no_log": False},  # a fingerprint, not a secret
        "run_as": {"type": "str", "default": ""},
    }


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)


def run(module: AnsibleModule) -> None:
    p = module.params
    try:
        text, cached = help_text(
            p["command"],
            p["profile"],
            p["timeout"],
            cache_dir=p["cache_dir"],
            cache_key=p["cache_key"],
            store=not module.check_mode,
            run_as=p["run_as"],
        )
    except PlanError as e:
        module.fail_json(msg=str(e), unknown=[], known_flags=0, cached=False)
    problems = unknown_flags(p["argv"], text, p["profile"], skip=len(p["command"]))
    known = len(parse_help_flags(text, p["profile"]))
    if problems:
        module.fail_json(
            msg=describe_unknown(problems, " ".join(p["command"])), unknown=problems, known_flags=known, cached=cached
        )
    module.exit_json(changed=False, unknown=[], known_flags=known, cached=cached)


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
