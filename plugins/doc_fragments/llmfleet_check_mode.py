"""Documentation fragment: what the check_mode and diff_mode attributes mean (each module says its support)."""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
---
attributes:
  check_mode:
    description: Can run in check_mode and return changed status prediction without modifying target.
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in --diff mode).
"""
