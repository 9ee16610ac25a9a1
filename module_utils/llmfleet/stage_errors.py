"""The errors of model staging. They sit below every staging module (manifest, store, transfer,
stage) so that each can raise them and a caller catches one class.

Stdlib only (runs inside Ansible modules on nodes, Python >= 3.8, and in the CLI).
"""

from __future__ import annotations


class StageError(RuntimeError):
    """Staging cannot go on; the message names the node, file and what to do."""


class DiskFullError(StageError):
    """ENOSPC while copying: no other source can help, so staging stops at once."""
