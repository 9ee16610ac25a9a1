"""The errors of model staging. They sit below every staging module (manifest, store, transfer,
stage) so that each can raise them and a caller catches one class.

Stdlib only (runs inside Ansible modules on nodes, Python >= 3.8, and in the CLI).
"""

from __future__ import annotations


class StageError(RuntimeError):
    """Staging cannot go on; the message names the node, file and what to do."""


class DiskFullError(StageError):
    """ENOSPC while copying: no other source can help, so staging stops at once."""


class LeaseLostError(StageError):
    """This node lost its shared-storage reader lease mid-read: it stops reading the source at once
    (every copy thread), keeps what it verified, and the run fails so that a rerun resumes."""


class LockedError(StageError):
    """Another staging run of the same model holds the node's per-model lock."""
