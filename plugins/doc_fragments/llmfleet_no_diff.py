"""Documentation fragment: a module that shows no diff (what it changes, it says in its result)."""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
---
attributes:
  diff_mode:
    support: none
"""
