"""The fleet's facts, validated once: the deployment name, the model and its pinned revision, and the numeric
ranges of staging. One rule per fact, called by the fleet contract (roles/llmfleet, through
filter_plugins/llmfleet_facts.py), by the modules, by the staging code and by the CLI, so a rule cannot drift
between them. Each check returns the problem as a sentence naming the variable and the fix, or None.

Stdlib only, imports nothing of the package (every layer may import it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# A pinned revision is a commit id: branch and tag names move, so what they name cannot be verified or reproduced.
HEX40 = re.compile(r"^[0-9a-f]{40}\Z")  # \Z, not $: "$" also matches before a final newline
# The same, inside a longer text (a unit file naming <model dir>/<revision>).
HEX40_IN_TEXT = r"[0-9a-f]{40}(?![0-9a-f])"
# The deployment name: the unit llmfleet-<name>.service, its env file, credentials, state and cache directories.
DEPLOYMENT_RE = re.compile(r"^[a-z](?:[-a-z0-9]{0,40}[a-z0-9])?\Z")
DEPLOYMENT_RULE = "1-42 lowercase letters, digits and '-', starting with a letter and not ending with '-'"

# The model_stage role's numeric settings: variable -> (lowest, highest or None, what it is). The role checks the
# inventory's values against this table before anything runs; the staging modules check their options against
# the same bounds (option_ranges).
STAGE_RANGES: dict[str, tuple[float, float | None, str]] = {
    "model_stage_max_source_readers": (1, None, "at least one node must read the shared storage"),
    "model_stage_threads": (1, None, "concurrent copies per node"),
    "model_stage_storage_max_readers": (1, None, "concurrent reads the shared storage was sized for"),
    "model_stage_keep": (1, None, "published revisions kept per model"),
    "model_stage_free_space_margin_gb": (0, None, "GiB, 0 = no margin"),
    "model_stage_peer_port": (0, 65535, "a TCP port, 0 = derived"),
    "model_stage_rate_limit_mib_s": (0, None, "MiB/s, 0 = unlimited"),
    "model_stage_timeout": (1, None, "seconds"),
    "model_stage_progress_interval": (1, None, "seconds"),
    "model_stage_lock_wait": (0, None, "seconds, 0 = fail at once"),
}


def revision_problem(revision: Any, var: str = "llmfleet_model_revision") -> str | None:
    """Why `revision` is not a pinned 40-hex commit id (None when it is)."""
    if isinstance(revision, str) and HEX40.match(revision):
        return None
    return (
        f"{var}={revision!r} is not a 40-hex commit id: branch and tag names move; pin the commit "
        '(e.g. from the hub\'s "Files and versions" page or refs/main in the cache)'
    )


def deployment_problem(name: Any, var: str = "llmfleet_deployment") -> str | None:
    """Why `name` cannot name a deployment (None when it can)."""
    if isinstance(name, str) and DEPLOYMENT_RE.match(name):
        return None
    return f"{var}={name!r} is not a deployment name: use {DEPLOYMENT_RULE} (the unit is llmfleet-<name>.service)"


def model_problem(model: Any, var: str = "llmfleet_model") -> str | None:
    """Why `model` cannot name the model's directory under the model root (None when it can)."""
    if isinstance(model, str) and model and "/" not in model and not model.startswith(".") and "\0" not in model:
        return None
    return (
        f"{var}={model!r} is not a model directory name: use a plain name such as glm-5 (no '/', not hidden); "
        "it names <model root>/<model>/ on every node and the stage-<model>.json report"
    )


def range_problem(
    values: Mapping[str, Any], ranges: Mapping[str, tuple[float, float | None, str | None]]
) -> str | None:
    """The first value outside its range, as a sentence naming it and the fix. `ranges` maps a name to
    (lowest, highest or None, where it is set or what it is, or None); a missing or None value is not checked."""
    for name, (low, high, note) in ranges.items():
        v = values.get(name)
        if v is None or (v >= low and (high is None or v <= high)):
            continue
        want = f">= {low}" if high is None else f"between {low} and {high}"
        return f"{name}={v} is out of range{f' ({note})' if note else ''}: it must be {want}"
    return None


def option_ranges(options: Mapping[str, Any]) -> dict[str, tuple[float, float | None, str | None]]:
    """A module's option ranges for range_problem: an option set by a model_stage role variable with the same
    bounds names just that variable (its bounds are STAGE_RANGES'); any other gives (lowest, highest or None) and,
    when a role variable sets it in other units, that variable's name."""
    out = {}
    for option, how in options.items():
        if isinstance(how, str):
            low, high, _ = STAGE_RANGES[how]
            var = how
        else:
            low, high, var = (*how, None)[:3]
        out[option] = (low, high, f"set by the role variable {var}" if var else None)
    return out
