"""Documentation fragment: a module run by its action plugin on the controller (never with the async keyword)."""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
---
attributes:
  action:
    description: >-
      Indicates this has a corresponding action plugin so some parts of the options can be executed on the
      controller.
    support: full
  async:
    description: Supports being used with the C(async) keyword.
    support: none
"""
