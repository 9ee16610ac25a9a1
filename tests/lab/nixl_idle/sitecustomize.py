"""Lab only: NIXL's threads at SCHED_IDLE, so the lab's two shared cores go to the engines and Ansible first.

NIXL's UCX progress thread busy-polls a whole core for as long as the agent lives, idle or not (measured:
1.00 core per agent with the progress thread, 0.00 without). A real node gives it a core of its own; the
lab's nodes share the ops host's 2 cores, so two P/D instances' spinning threads took half of them from
everything else the lab runs. Here every thread that creating a NIXL agent starts runs at SCHED_IDLE: it
still gets every idle cycle, and the KV transfer still goes through NIXL and UCX, only later in line.

tests/integration/test_real_pd.py puts this directory first on the engine's PYTHONPATH (engine_env);
nothing outside the lab loads it.
"""

import importlib.abc
import importlib.util
import os
import sys

_MODULES = {"nixl_cu12._api", "nixl_cu13._api"}


def _idle_new_threads(cls):
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        before = set(os.listdir("/proc/self/task"))
        init(self, *args, **kwargs)
        for tid in set(os.listdir("/proc/self/task")) - before:
            try:
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
            except OSError:  # the thread already ended
                pass

    cls.__init__ = __init__


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _MODULES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _idle_new_threads(module.nixl_agent)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _Finder())
