"""Documentation fragment: a module that only reads (check mode runs it the same; there is never a diff).
A module may say more in its own C(attributes.check_mode.details), which wins over this one."""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
---
attributes:
  check_mode:
    support: full
    details: Read-only; runs the same in check mode.
  diff_mode:
    support: none
    details: Changes nothing.
"""
