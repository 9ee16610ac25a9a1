"""Lab only: NIXL's progress thread polls every millisecond instead of spinning.

vLLM's NixlConnector creates its NIXL agent with a progress thread, and NIXL's Python API always sets that
thread's delay between polls (`pthrDelay`) to 0: it busy-polls a whole core for as long as the agent lives,
idle or not (measured here: 0.83 core per agent with delay 0, 0.014 with 1000 us). A real node gives it a
core of its own; the lab's nodes share the ops host's 2 cores, so the P/D pair's two spinning threads took
them from everything else the lab runs (Ansible tasks 3-5x slower while the instances idled). Here the delay
is LLMFLEET_LAB_NIXL_POLL_US (default 1000 us): the KV transfer still goes through NIXL and UCX, each step
noticed up to a millisecond later.

Why not SCHED_IDLE for the thread (tried, docs/lab.md): this kernel groups threads by session for scheduling
(sched_autogroup), and an idle thread's session still gets its full share against every other session.

tests/integration/test_real_pd.py puts this directory first on the engine's PYTHONPATH (engine_env);
nothing outside the lab loads it.
"""

import importlib.abc
import importlib.util
import os
import sys

_MODULES = {"nixl_cu12._api", "nixl_cu13._api"}


def _delay_us() -> int:
    # Every Python on this PYTHONPATH imports this file (the wrapper too): a bad value must not break them.
    raw = os.environ.get("LLMFLEET_LAB_NIXL_POLL_US", "1000")
    if raw.isdigit():
        return int(raw)
    print(f"llmfleet lab: LLMFLEET_LAB_NIXL_POLL_US={raw!r} is not a whole number of microseconds; using 1000",
          file=sys.stderr, flush=True)  # fmt: skip
    return 1000


_DELAY_US = _delay_us()


def _patch(api):
    bindings = api.nixlBind
    create = bindings.nixlAgent

    def nixl_agent_with_delay(name, config):
        if config.useProgThread:
            config.pthrDelay = _DELAY_US
            print(f"llmfleet lab: NIXL agent {name}: progress thread polls every {_DELAY_US} us (tests/lab/nixl_poll)",
                  file=sys.stderr, flush=True)  # fmt: skip
        return create(name, config)

    bindings.nixlAgent = nixl_agent_with_delay


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
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _Finder())
