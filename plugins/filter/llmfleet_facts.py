"""The fleet's facts for the roles: each filter asks llmfleet.facts (the package's one rule per fact) or the
staging store (where a revision is published), so the roles check and derive exactly what the code does."""

from __future__ import annotations

from collections.abc import Mapping

from ansible.errors import AnsibleFilterError


def llmfleet_revision_problem(revision, var: str = "llmfleet_model_revision") -> str:
    """'' when `revision` is a pinned 40-hex commit, else the problem naming `var` and the fix."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.facts import revision_problem

    return revision_problem(revision, var) or ""


def llmfleet_deployment_problem(name, var: str = "llmfleet_deployment") -> str:
    """'' when `name` can name a deployment (its unit, files and directories), else the problem."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.facts import deployment_problem

    return deployment_problem(name, var) or ""


def llmfleet_model_problem(model, var: str = "llmfleet_model") -> str:
    """'' when `model` can name the model's directory under the model root, else the problem."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.facts import model_problem

    return model_problem(model, var) or ""


def llmfleet_stage_range_problems(values: Mapping) -> list:
    """Every model_stage setting in `values` (variable -> value) outside its range (llmfleet.facts.STAGE_RANGES)."""
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.facts import STAGE_RANGES, range_problem

    if not isinstance(values, Mapping):
        raise AnsibleFilterError(f"llmfleet_stage_range_problems expects a mapping, got {type(values).__name__}")
    out = []
    for name, value in values.items():
        if name not in STAGE_RANGES:
            raise AnsibleFilterError(f"llmfleet_stage_range_problems: {name} is not a model_stage setting with a range")
        try:
            number = float(value)
        except (TypeError, ValueError):
            out.append(f"{name}={value!r} is not a number")
            continue
        low, high, why = STAGE_RANGES[name]
        problem = range_problem({name: int(number) if number.is_integer() else number}, {name: (low, high, None)})
        if problem:
            out.append(f"{problem} ({why})")
    return out


def llmfleet_revision_dir(root: str, model: str, revision: str) -> str:
    """The directory the staging store publishes `revision` of `model` in under `root` (what engines load):
    <root>/<model>/<revision>. A name the store would refuse fails here, naming it."""
    import os

    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.facts import model_problem, revision_problem
    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.stage.store import model_dir

    problem = model_problem(model) or revision_problem(revision)
    if problem:
        raise AnsibleFilterError(problem)
    return os.path.join(model_dir(str(root), model), revision)


def llmfleet_unit_revisions(text, model) -> list:
    """The revisions of `model` a unit file loads (<root>/<model>/<revision> in its text), each once in order: what
    the fleet contract's rule accepts as a revision (llmfleet.facts), so no second pattern is spelled here."""
    import re

    from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.facts import revision_problem

    out: list = []
    for cand in re.findall("/" + re.escape(str(model)) + "/([0-9a-f]+)", str(text or "")):
        if cand not in out and not revision_problem(cand, "revision"):
            out.append(cand)
    return out


def llmfleet_serving_units(pairs) -> str:
    """'' when no unit runs, else where each running unit runs, e.g. "node1, node2 (llmfleet-demo.service is
    running)". pairs: (host, the results of the systemd_service loop over the deployment's units on it)."""
    running: dict = {}
    for host, results in pairs or []:
        for r in results or []:
            state = ((r or {}).get("status") or {}).get("ActiveState", "inactive")
            if state in ("active", "activating", "reloading", "deactivating"):
                running.setdefault(r.get("item") or r.get("name") or "?", []).append(str(host))
    return "; ".join(f"{', '.join(hosts)} ({unit} is running)" for unit, hosts in running.items())


class FilterModule:
    def filters(self) -> dict:
        return {
            "llmfleet_revision_problem": llmfleet_revision_problem,
            "llmfleet_deployment_problem": llmfleet_deployment_problem,
            "llmfleet_model_problem": llmfleet_model_problem,
            "llmfleet_stage_range_problems": llmfleet_stage_range_problems,
            "llmfleet_revision_dir": llmfleet_revision_dir,
            "llmfleet_serving_units": llmfleet_serving_units,
            "llmfleet_unit_revisions": llmfleet_unit_revisions,
        }
