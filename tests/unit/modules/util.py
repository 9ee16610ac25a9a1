"""Run one library/ module in-process and check that what it returned is documented."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest
import yaml

from tests.unit.module_utils import AnsibleExitJson, AnsibleFailJson, set_module_args

ROOT = Path(__file__).resolve().parents[3]
LIBRARY = ROOT / "library"
ACTIONS = ROOT / "action_plugins"
MODULES = sorted(p.stem for p in LIBRARY.glob("*.py"))
ACTION_NAMES = sorted(p.stem for p in ACTIONS.glob("*.py"))

# Keys Ansible adds or every module may return; RETURN documents the rest.
COMMON = {"changed", "failed", "msg", "invocation", "warnings", "deprecations"}


def run(module, args: dict, *, check: bool = False) -> dict:
    """exit_json's result (the test fails if the module failed)."""
    with set_module_args({**args, "_ansible_check_mode": check}), pytest.raises(AnsibleExitJson) as e:
        module.main()
    return e.value.args[0]


def fail(module, args: dict, *, check: bool = False) -> dict:
    """fail_json's result (the test fails if the module succeeded)."""
    with set_module_args({**args, "_ansible_check_mode": check}), pytest.raises(AnsibleFailJson) as e:
        module.main()
    return e.value.args[0]


def undocumented(module, result: dict) -> set[str]:
    """Keys of a result that the module's RETURN does not list."""
    return set(result) - COMMON - set(yaml.safe_load(module.RETURN))


class Recorder:
    """Stands in for a package function: records its calls and returns what it was given."""

    def __init__(self, result=None, raises: BaseException | None = None):
        self.calls: list[tuple[tuple, dict]] = []
        self.result, self.raises = result, raises

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if self.raises is not None:
            raise self.raises
        return self.result(*args, **kwargs) if callable(self.result) else self.result

    @property
    def kwargs(self) -> dict:
        assert len(self.calls) == 1, f"called {len(self.calls)} times"
        return self.calls[0][1]

    @property
    def args(self) -> tuple:
        assert len(self.calls) == 1, f"called {len(self.calls)} times"
        return self.calls[0][0]


def real_spec(name: str) -> tuple[dict, dict]:
    """(argument_spec, other AnsibleModule keyword arguments) of a module, captured from build_module();
    for a documentation stub of an action plugin, the spec the action validates its arguments with."""
    if name in ACTION_NAMES:
        spec = importlib.util.spec_from_file_location(f"_action_{name}", ACTIONS / f"{name}.py")
        action = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(action)
        return action.argument_spec(), {"supports_check_mode": action.ActionModule._supports_check_mode}
    module = importlib.import_module(name)
    seen: dict = {}

    class Capture:
        def __init__(self, **kwargs):
            seen.update(kwargs)

    original = module.AnsibleModule
    module.AnsibleModule = Capture
    try:
        module.build_module()
    finally:
        module.AnsibleModule = original
    assert module.argument_spec() == seen["argument_spec"], f"{name}: build_module() does not use argument_spec()"
    return seen.pop("argument_spec"), seen


def job_result(path: str, seconds: float = 20) -> dict:
    """A detached job's file (llmfleet.jobs) once it no longer says running, as llmfleet_job_wait reads it."""
    import json
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        with open(path) as f:
            data = json.loads(f.read())
        if "started" not in data:
            return data
        time.sleep(0.05)
    pytest.fail(f"{path} still says running after {seconds} s")
