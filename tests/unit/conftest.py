"""How `make unit` spreads the unit tests over its two xdist workers (`pytest -n 2`).

xdist's `load` distribution hands each worker long runs of consecutive tests up front (a quarter of the
suite at the start, then half of what is left) and never moves them again: the worker that drew the
ansible-playbook tests ran on alone for minutes after the other one had finished (measured: 435 s of a
1330 s run). Here, unless --maxschedchunk is given, a worker gets one test more whenever it is down to
two, and the suite starts with the modules whose tests take seconds each: the slow tests are spread over
both workers as they free up, the last ones handed out are the short ones, and both finish together.

Only the order of the tests and which worker runs them change: every test still runs, on its own.

`make` exports PYTHONDONTWRITEBYTECODE=1 (no __pycache__ in the tree), so every Python the tests start -
`python -m llmfleet ...`, the wrapper, the node stubs, ansible-playbook's plugins - compiled the package
from source again: 0.3 s of the 0.5 s a `python -m llmfleet` run takes. The run keeps its bytecode in its
own temporary directory instead (PYTHONPYCACHEPREFIX), outside the tree, for every process it starts.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.helpers import ansible_cache

HERE = Path(__file__).resolve().parent

# Modules whose tests take seconds each (ansible-playbook runs, gloo worlds of torch processes, simulated
# engines, contention loops, large checkpoints), longest first as measured with
# `pytest -n 2 --durations=0 tests/unit`. Every other module follows, in collection order.
SLOW_FIRST = (
    "test_engine_role.py",
    "test_engine_role_checks.py",
    "test_gpuset.py",
    "test_precompile.py",
    "test_nccl_check.py",
    "test_lease_stress.py",
    "test_lease_exact.py",
    "test_engine_sim.py",
    "test_nccl_attribution.py",
    "test_fit_cli.py",
    "test_roles.py",
    "test_fit.py",
    "test_stage_bench.py",
    "test_wrapper.py",
    "test_wrapper_link.py",
    "test_oncall_stop.py",
    "test_checkpoint.py",
    "test_oncall_bundle.py",
    "test_accept.py",
    "test_oncall_logs.py",
    "test_warmup.py",
)


def pytest_collection_modifyitems(config, items):
    """Slow modules first (a stable sort: the order inside a module, and of the other modules, is kept).

    Every xdist worker collects and sorts the same way, as xdist requires."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}

    def key(item):
        path = Path(item.path)
        return rank.get(path.name, len(SLOW_FIRST)) if path.parent == HERE else len(SLOW_FIRST)

    items.sort(key=key)


@pytest.hookimpl(trylast=True)  # after the tmpdir plugin's: the run's temporary directory
def pytest_configure(config):
    if hasattr(config, "workerinput"):
        return  # the controller schedules, and the workers inherit its environment
    ansible_cache.enable()
    if getattr(config.option, "dist", "no") == "load" and getattr(config.option, "maxschedchunk", 0) is None:
        config.option.maxschedchunk = 1
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTHONPYCACHEPREFIX"):
        prefix = config._tmp_path_factory.getbasetemp() / "pycache"
        prefix.mkdir(exist_ok=True)
        seed_bytecode_cache(str(prefix))
        del os.environ["PYTHONDONTWRITEBYTECODE"]
        os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix = str(prefix)
        sys.dont_write_bytecode = False


def seed_bytecode_cache(prefix: str) -> None:
    """With a cache prefix Python reads bytecode from the prefix alone: link the standard library's and the
    venv's own compiled files in (1 s of CPU), or each run would compile torch, ansible... again, in every process
    that imports them before the first one has written them back."""
    tag = f".{sys.implementation.cache_tag}.pyc"
    paths = sysconfig.get_paths()
    for root in {paths["stdlib"], paths["purelib"], paths["platlib"]}:
        for cache, dirs, files in os.walk(root):
            if os.path.basename(cache) != "__pycache__":
                continue
            dirs.clear()
            mirror = prefix + os.path.dirname(cache)  # where Python looks: <prefix><source directory>/<name>
            os.makedirs(mirror, exist_ok=True)
            for name in files:
                if name.endswith(tag):
                    with contextlib.suppress(OSError):
                        os.symlink(os.path.join(cache, name), os.path.join(mirror, name))
