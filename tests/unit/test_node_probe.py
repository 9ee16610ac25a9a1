"""The node probe: a stdlib-only program piped to `python3 -` on a node. Its parsers in-process, and the
program itself run the way a node runs it."""

from __future__ import annotations

import ast
import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmfleet.oncall import node_probe
from llmfleet.oncall.common import PROBE_SOURCE_PATH

# `systemctl show -p ExecStart` of a real engine unit (systemd 252): the argv is not quoted.
EXEC_START = (
    "{ path=/usr/local/bin/llmfleet ; argv[]=/usr/local/bin/llmfleet exec --record "
    "/var/lib/llmfleet/engine/glm/termination.json --status /var/lib/llmfleet/engine/glm/status.json --ready-count 8 "
    "-- /opt/sglang/venv/bin/sglang serve --model-path /mnt/nvme/m --port 30001 --host 0.0.0.0 ; ignore_errors=no ; "
    "start_time=[Sat 2026-11-28 10:00:00 UTC] ; stop_time=[n/a] ; pid=4242 ; code=(null) ; status=0/0 }"
)


def test_exec_argv_and_options():
    argv = node_probe.exec_argv(EXEC_START)
    assert argv[:2] == ["/usr/local/bin/llmfleet", "exec"] and argv[-2:] == ["--host", "0.0.0.0"]  # noqa: S104
    assert node_probe.opt(argv, "--record") == "/var/lib/llmfleet/engine/glm/termination.json"
    assert node_probe.opt(argv, "--port") == "30001"
    assert node_probe.opt(["--port=1", "--port", "2"], "--port") == "2"
    assert node_probe.opt(["--portx", "3"], "--port") is None
    assert node_probe.exec_argv("") == [] and node_probe.exec_argv("{ path=/x ; }") == []


def test_read_file_refuses_links_and_special_files(tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text("root:secret")
    (tmp_path / "termination.json").symlink_to(secret)  # planted by the engine's user in its own directory
    data, err = node_probe.read_file(str(tmp_path / "termination.json"))
    assert data is None and "termination.json" in err
    os.mkfifo(tmp_path / "fifo")  # would block a plain open()
    assert node_probe.read_file(str(tmp_path / "fifo")) == (None, f"{tmp_path / 'fifo'}: not a regular file")
    assert node_probe.read_file(str(tmp_path / "missing")) == (None, None)
    (tmp_path / "big").write_bytes(b"x" * 100)
    assert node_probe.read_file(str(tmp_path / "big"), cap=10) == (b"x" * 10, None)


def test_read_json_of_garbage(tmp_path):
    (tmp_path / "r.json").write_text("{not json")
    rec, err = node_probe.read_json(str(tmp_path / "r.json"))
    assert rec is None and "not JSON" in err


def test_run_keeps_the_newest_whole_lines():
    rc, out, dropped, _ = node_probe.run(
        [sys.executable, "-c", "for i in range(1000): print(f'line {i:04d}')"], cap=100
    )
    lines = out.decode().splitlines()
    assert rc == 0 and lines[-1] == "line 0999" and all(ln.startswith("line ") for ln in lines)
    assert dropped + len(out) == 1000 * 10 and len(out) <= 100


def test_run_timeout_and_missing_command():
    rc, *_ = node_probe.run([sys.executable, "-c", "import time; time.sleep(10)"], timeout=0.3)
    assert rc == "timeout"
    rc, out, _, err = node_probe.run(["/nonexistent/systemctl"])
    assert rc is None and out == b"" and "No such file" in err


@pytest.mark.parametrize(
    ("lines", "cg", "expect"),
    [
        ("0::/system.slice/llmfleet-demo.service\n", "/system.slice/llmfleet-demo.service", True),
        ("0::/system.slice/llmfleet-demo.service/engine/x\n", "/system.slice/llmfleet-demo.service", True),
        ("0::/system.slice/llmfleet-demo-router.service\n", "/system.slice/llmfleet-demo.service", False),
        ("0::/system.slice/llmfleet-demo.service2\n", "/system.slice/llmfleet-demo.service", False),
        # hybrid hosts: v1 hierarchies and the unified one
        (
            "12:memory:/system.slice/llmfleet-demo.service\n1:name=systemd:/system.slice/llmfleet-demo.service\n0::/\n",
            "/system.slice/llmfleet-demo.service",
            True,
        ),
        ("0::/user.slice/user-0.slice/session-3.scope\n", "/system.slice/llmfleet-demo.service", False),
        # a stopped unit has no ControlGroup: its name in the path decides
        ("0::/system.slice/llmfleet-demo.service/x\n", "", True),
        ("0::/system.slice/llmfleet-demo-router.service\n", "", False),
    ],
)
def test_in_unit(tmp_path, monkeypatch, lines, cg, expect):
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "cgroup").write_text(lines)
    monkeypatch.setattr(node_probe, "PROC", str(tmp_path))
    assert node_probe.in_unit(77, cg, "llmfleet-demo.service") is expect


def test_hca_counters_and_fabric_env(tmp_path):
    d = tmp_path / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    (d / "counters").mkdir(parents=True)
    (d / "counters" / "port_xmit_data").write_text("123\n")
    (d / "counters" / "port_rcv_data").write_text("oops\n")
    (d / "state").write_text("4: ACTIVE\n")
    (tmp_path / "fabric.env").write_text("# managed\nNCCL_IB_HCA='=mlx5_0:1'\nNCCL_SOCKET_IFNAME=eth0\n")
    out = node_probe.op_counters({"sysfs_root": str(tmp_path), "fabric_env": str(tmp_path / "fabric.env")})
    assert out["hcas"] == {"mlx5_0": {"1": {"xmit": 123, "rcv": None, "state": "4: ACTIVE", "link_layer": None}}}
    assert out["env"] == {"NCCL_IB_HCA": "=mlx5_0:1"} and out["env_error"] is None
    out = node_probe.op_counters({"sysfs_root": str(tmp_path / "none"), "fabric_env": str(tmp_path / "nope")})
    assert out["hcas"] == {} and "no such file" in out["env_error"]


def _run_probe(spec, python=sys.executable, cwd="/", env=None) -> dict:
    src = Path(PROBE_SOURCE_PATH).read_bytes()
    p = subprocess.run([python, "-", json.dumps(spec)], input=src, capture_output=True, cwd=cwd, env=env, check=False)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_runs_alone_from_stdin_without_the_package(tmp_path):
    """As on a node: `python3 -I -` from stdin, no llmfleet importable, no PYTHONPATH."""
    env = {"PATH": os.environ["PATH"]}
    out = _run_probe({"op": "counters", "sysfs_root": str(tmp_path)}, cwd=str(tmp_path), env=env)
    assert out["probe"] == node_probe.VERSION and out["hcas"] == {} and "euid" in out


def test_a_bad_spec_is_an_answer_not_a_traceback():
    assert _run_probe({"op": "nope"})["error"] == "KeyError: 'nope'"
    src = Path(PROBE_SOURCE_PATH).read_bytes()
    p = subprocess.run([sys.executable, "-", "{not json"], input=src, capture_output=True, check=False)
    assert p.returncode == 0 and json.loads(p.stdout)["error"].startswith("JSONDecodeError")


def test_stdlib_only_and_no_package_imports():
    tree = ast.parse(Path(PROBE_SOURCE_PATH).read_text(), feature_version=(3, 8))  # nodes may run Python 3.8
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, "the probe runs alone on the node: no relative import"
            assert node.module == "__future__" or node.module in sys.stdlib_module_names
        elif isinstance(node, ast.Import):
            assert all(a.name.split(".")[0] in sys.stdlib_module_names for a in node.names)


def _old_pythons() -> list[str]:
    found = [shutil.which(f"python3.{m}") for m in (8, 9)]
    found += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.[89].*/bin/python3")))
    return [p for p in found if p and subprocess.run([p, "-c", "1"], capture_output=True, check=False).returncode == 0]


@pytest.mark.skipif(not _old_pythons(), reason="no Python 3.8/3.9 on this host")
@pytest.mark.parametrize("python", _old_pythons() or ["none"])
def test_runs_on_old_node_pythons(tmp_path, python):
    (tmp_path / "f.env").write_text("NCCL_IB_HCA=mlx5\n")
    out = _run_probe({"op": "counters", "sysfs_root": str(tmp_path), "fabric_env": str(tmp_path / "f.env")}, python)
    assert out["env"] == {"NCCL_IB_HCA": "mlx5"}


def test_journal_up_to_a_time_never_combines_lines_with_until_alone():
    """journalctl 252 answers "-- No entries --" to `-n 15 --until @T` (found on the lab): the probe reads the
    hour before T and keeps the last lines itself."""
    from llmfleet.oncall import node_probe

    argv = node_probe.journal_argv({"until": 1000000, "lines": 15}, "u.service")
    assert "-n" not in argv and argv[argv.index("--since") + 1] == "@996400" and "@1000000" in argv
    assert node_probe.journal_argv({"lines": 15}, "u.service")[-2:] == ["-n", "15"]
    assert node_probe.last_lines(b"a\nb\nc\n", 2) == b"b\nc\n"
    assert node_probe.last_lines(b"a\n", 2) == b"a\n"
