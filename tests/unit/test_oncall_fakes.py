"""Fake nodes for the on-call command tests: an Ansible inventory of `ansible_connection: local` hosts, and per
node a PATH with fake systemctl / journalctl / nvidia-smi (Python scripts reading and writing JSON state under
<root>/<node>/), a fake /proc for cgroup lookups and a state directory holding the wrapper's records. The real
node probe runs against them through LocalTransport (`python3 - SPEC`, the probe on stdin), as on a node.

Imported by the other test_oncall*.py files (tests/unit is on sys.path: no __init__.py there).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from llmfleet.oncall.common import AutoTransport, LocalTransport

SYSTEMCTL = r"""
import json, os, sys, time
root, node = os.environ["FAKE_ROOT"], os.environ["FAKE_NODE"]
units = os.path.join(root, node, "units")
with open(os.path.join(root, "calls.log"), "a") as f:
    f.write(json.dumps([time.time(), node, "systemctl"] + sys.argv[1:]) + "\n")
args = [a for a in sys.argv[1:] if not a.startswith("--") or a.startswith("--property=")]
verb, rest = args[0], args[1:]

def load(u):
    try:
        with open(os.path.join(units, u + ".json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None

def save(u, d):
    with open(os.path.join(units, u + ".json"), "w") as f:
        json.dump(d, f)

def mono_us(epoch):
    return int((time.monotonic() - (time.time() - epoch)) * 1e6) if epoch else 0

if verb == "show":
    props = [a.split("=", 1)[1] for a in rest if a.startswith("--property=")]
    blocks = []
    for unit in [a for a in rest if not a.startswith("--")]:
        d = load(unit)
        if d is None:
            d = {"LoadState": "not-found", "ActiveState": "inactive", "SubState": "dead", "Result": "success"}
        if d.get("show_fails"):
            print("Failed to connect to bus: No such file or directory", file=sys.stderr)
            sys.exit(1)
        argv = d.get("argv")
        vals = {
            "LoadState": d.get("LoadState", "loaded"), "ActiveState": d.get("ActiveState", "active"),
            "SubState": d.get("SubState", "running"), "Result": d.get("Result", "success"),
            "ExecMainCode": str(d.get("ExecMainCode", 0)), "ExecMainStatus": str(d.get("ExecMainStatus", 0)),
            "ExecMainPID": str(d.get("MainPID", 0)), "MainPID": str(d.get("MainPID", 0)),
            "NRestarts": str(d.get("NRestarts", 0)),
            "ActiveEnterTimestampMonotonic": str(mono_us(d.get("ActiveEnterEpoch"))),
            "StateChangeTimestampMonotonic": str(mono_us(d.get("StateChangeEpoch", d.get("ActiveEnterEpoch")))),
            "ControlGroup": d.get("ControlGroup", "") if d.get("ActiveState", "active") != "inactive" else "",
            "InvocationID": d.get("InvocationID", "abc"),
            "ExecStart": ("{ path=%s ; argv[]=%s ; ignore_errors=no ; start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; "
                          "code=(null) ; status=0/0 }" % (argv[0], " ".join(argv))) if argv else "",
            "Description": "fake unit", "Id": unit,
        }
        blocks.append("".join(f"{k}={vals.get(k, '')}\n" for k in props or list(vals)))
    sys.stdout.write("\n".join(blocks))  # systemctl separates units by a blank line
elif verb == "stop":
    d = load(rest[0])
    if d.get("stop") == "denied":
        print(f"Failed to stop {rest[0]}: Access denied", file=sys.stderr)
        sys.exit(4)
    if d.get("stop") == "hang":
        d.update(ActiveState="deactivating", SubState="stop-sigterm")
    else:
        d.update(ActiveState="inactive", SubState="dead", StateChangeEpoch=time.time())
    save(rest[0], d)
elif verb == "kill":
    d = load(rest[0])
    d.update(ActiveState="failed", SubState="failed", Result="signal", ExecMainCode=2, ExecMainStatus=9)
    save(rest[0], d)
elif verb == "start":
    d = load(rest[0])
    if d.get("start") == "fail":
        d.update(ActiveState="failed", SubState="failed", Result="exit-code", ExecMainCode=1, ExecMainStatus=1)
    elif d.get("start") == "slow":
        d.update(ActiveState="activating", SubState="start")
    else:
        d.update(ActiveState="active", SubState="running", ActiveEnterEpoch=time.time())
    save(rest[0], d)
elif verb == "reset-failed":
    pass
elif verb in ("list-units", "list-unit-files"):
    for name in sorted(os.listdir(units)):
        print(name[:-5] + (" loaded active running x" if verb == "list-units" else " disabled enabled"))
else:
    print(f"fake systemctl: unknown verb {verb}", file=sys.stderr)
    sys.exit(1)
"""

JOURNALCTL = r"""
import json, os, sys, time
root, node = os.environ["FAKE_ROOT"], os.environ["FAKE_NODE"]
with open(os.path.join(root, "calls.log"), "a") as f:
    f.write(json.dumps([time.time(), node, "journalctl"] + sys.argv[1:]) + "\n")
a = sys.argv[1:]
name = "kernel.txt" if "-k" in a else a[a.index("-u") + 1] + ".txt"
path = os.path.join(root, node, "journal", name)
lines = open(path).read().splitlines(True) if os.path.exists(path) else ["-- No entries --\n"]
if "-n" in a and "--until" in a and "--since" not in a:
    lines = ["-- No entries --\n"]  # what journalctl 252 really prints for this combination (seen on the lab)
elif "-n" in a:
    lines = lines[-int(a[a.index("-n") + 1]):]
sys.stdout.write("".join(lines))
"""

NVIDIA_SMI = r"""
import os, sys
d = os.path.join(os.environ["FAKE_ROOT"], os.environ["FAKE_NODE"], "nvidia")
name = "apps.csv" if any(a.startswith("--query-compute-apps") for a in sys.argv) else "q.txt"
sys.stdout.write(open(os.path.join(d, name)).read())
"""


def _script(path: Path, body: str) -> None:
    path.write_text(f"#!{sys.executable} -S\n{body}")  # -S: no site import, a faster start
    path.chmod(0o755)


class Fakes:
    """A fleet of fake nodes. nodes: names in inventory order, the first is the head."""

    def __init__(self, root: Path, nodes: list[str], deployment: str = "demo", gpu_nodes: tuple = (),
                 unreachable: tuple = (), **group_vars):  # fmt: skip
        self.root, self.names, self.deployment = root, nodes, deployment
        self.unit = f"llmfleet-{deployment}.service"
        self.router = f"llmfleet-{deployment}-router.service"
        self.unreachable = set(unreachable)
        (root / "ssh_config").write_text("Host *\n  ConnectTimeout 2\n")
        for n in nodes:
            for d in ("bin", "units", "journal", "nvidia", "proc", f"state/engine/{deployment}"):
                (root / n / d).mkdir(parents=True, exist_ok=True)
            _script(root / n / "bin" / "systemctl", SYSTEMCTL)
            _script(root / n / "bin" / "journalctl", JOURNALCTL)
            if n in gpu_nodes:
                _script(root / n / "bin" / "nvidia-smi", NVIDIA_SMI)
                (root / n / "nvidia" / "apps.csv").write_text("")
                (root / n / "nvidia" / "q.txt").write_text("==============NVSMI LOG==============\n")
        hosts = {
            "head": {"hosts": {nodes[0]: self._hostvars(nodes[0])}},
            "worker": {"hosts": {n: self._hostvars(n) for n in nodes[1:]}},
        }
        inv = {"all": {"children": {"llmfleet_nodes": {"children": hosts}},
                       "vars": {"llmfleet_deployment": deployment, **group_vars}}}  # fmt: skip
        self.inventory = root / "inventory"
        self.inventory.mkdir()
        (self.inventory / "hosts.yml").write_text(json.dumps(inv, indent=1))
        (root / "calls.log").write_text("")

    def _hostvars(self, n: str) -> dict:
        if n in self.unreachable:  # real SSH to a closed local port: connection refused, at once
            return {"ansible_host": "127.0.0.1", "ansible_port": closed_port(),
                    "ansible_ssh_common_args": f"-F {self.root / 'ssh_config'}"}  # fmt: skip
        return {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "llmfleet_state_dir": str(self.root / n / "state"),
            "llmfleet_fabric_env": str(self.root / n / "fabric.env"),
        }

    def state_dir(self, n: str) -> Path:
        return self.root / n / "state" / "engine" / self.deployment

    def set_unit(self, n: str, unit: str | None = None, **fields) -> None:
        unit = unit or self.unit
        path = self.root / n / "units" / f"{unit}.json"
        d = json.loads(path.read_text()) if path.exists() else {
            "ActiveState": "active", "SubState": "running", "ActiveEnterEpoch": time.time() - UNIT_AGE_S,
            "ControlGroup": f"/system.slice/{unit}", "MainPID": 4242,
            "argv": ["/usr/local/bin/llmfleet", "exec", "--record", str(self.state_dir(n) / "termination.json"),
                     "--status", str(self.state_dir(n) / "status.json"), "--", "/opt/sglang", "serve",
                     "--port", "1"],
        }  # fmt: skip
        d.update(fields)
        path.write_text(json.dumps(d))

    def unit_state(self, n: str, unit: str | None = None) -> dict:
        return json.loads((self.root / n / "units" / f"{unit or self.unit}.json").read_text())

    def record(self, n: str, name: str = "termination.json", **fields) -> None:
        rec = {"schema": "llmfleet.termination/1", "host": n, "unit": self.unit, "stop_requested": False,
               "verdict": "exit-code", "exit_code": 1, "reason": "the engine exited with code 1",
               "started_at": time.time() - 600, "ended_at": time.time() - 60, "phase": "serving",
               "failed_rank": None, "first_error": None, "tail": ["x"] * 3}  # fmt: skip
        rec.update(fields)
        (self.state_dir(n) / name).write_text(json.dumps(rec))

    def status_file(self, n: str, **fields) -> None:
        st = {"phase": "serving", "running": True, "ready": True}
        st.update(fields)
        (self.state_dir(n) / "status.json").write_text(json.dumps(st))

    def journal(self, n: str, text: str, unit: str | None = None) -> None:
        (self.root / n / "journal" / f"{unit or self.unit}.txt").write_text(text)

    def kernel(self, n: str, text: str) -> None:
        (self.root / n / "journal" / "kernel.txt").write_text(text)

    def gpu_apps(self, n: str, rows: list[tuple[int, int]]) -> None:
        (self.root / n / "nvidia" / "apps.csv").write_text("".join(f"{p}, {m}\n" for p, m in rows))

    def proc(self, n: str, pid: int, cgroup: str, comm: str = "python3") -> None:
        d = self.root / n / "proc" / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup").write_text(f"0::{cgroup}\n")
        (d / "comm").write_text(comm + "\n")
        (d / "cmdline").write_text(f"{comm}\0-m\0engine\0")

    def calls(self) -> list[list]:
        return [json.loads(ln) for ln in (self.root / "calls.log").read_text().splitlines()]

    def env_for(self, node) -> dict:
        return {
            "PATH": f"{self.root / node.name / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            "FAKE_ROOT": str(self.root),
            "FAKE_NODE": node.name,
            "LLMFLEET_PROBE_PROC_ROOT": str(self.root / node.name / "proc"),
        }

    def transport(self) -> AutoTransport:
        return AutoTransport(local=LocalTransport(env_for=self.env_for))


def lab_inventory(tmp_path: Path, n: int = 3, **host_key) -> tuple[Path, object]:
    """An inventory exactly as tests/lab/labctl.py writes it (hosts.yml + the ssh_config it points to), with the
    repository's inventory/lab/group_vars beside it: the format the lab's runs use. Returns (dir, lab)."""
    import shutil

    from tests.lab import labctl

    lab = labctl.Lab(name="t", subnet="10.99.0", state_root=tmp_path / "state", inventory_dir=tmp_path / "lab")
    nodes = [lab.node(i) for i in range(1, n + 1)]
    for nd in nodes:
        nd.dir.mkdir(parents=True)
        (nd.dir / "ssh_host_ed25519_key.pub").write_text(host_key.get(nd.name, ED25519_PUB) + f" root@{nd.name}\n")
    lab.state.mkdir(parents=True, exist_ok=True)
    lab.write_inventory(nodes)
    shutil.copytree(ROOT / "inventory" / "lab" / "group_vars", tmp_path / "lab" / "group_vars")
    return tmp_path / "lab", lab


def _ed25519_pub() -> str:
    import base64
    import struct

    def field(b: bytes) -> bytes:
        return struct.pack(">I", len(b)) + b

    return "ssh-ed25519 " + base64.b64encode(field(b"ssh-ed25519") + field(bytes(range(32)))).decode()


ROOT = Path(__file__).resolve().parents[2]
# How long ago the fake healthy unit became active: an hour, but never before this machine booted (systemd's
# timestamps are CLOCK_MONOTONIC; a fresh CI machine may be up for minutes only).
UNIT_AGE_S = min(3600.0, time.monotonic() / 2)
ED25519_PUB = _ed25519_pub()


def listening_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s, s.getsockname()[1]


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def three_nodes(tmp_path: Path) -> Fakes:
    """node1 (head) .. node3, each unit active/running and serving; GPUs (nvidia-smi) on node1 and node2."""
    f = Fakes(tmp_path, ["node1", "node2", "node3"], gpu_nodes=("node1", "node2"))
    for n in f.names:
        f.set_unit(n)
        f.status_file(n)
    return f


@pytest.fixture
def fakes(tmp_path):
    return three_nodes(tmp_path)


def test_fake_systemctl_prints_what_systemd_prints(fakes):
    """The probe parses `systemctl show` and ExecStart the way systemd prints them: the fake must agree."""
    import subprocess

    from llmfleet.oncall.node_probe import exec_argv

    env = fakes.env_for(type("N", (), {"name": "node1"})())
    out = subprocess.run(["systemctl", "show", fakes.unit, "--property=ExecStart", "--property=LoadState"],
                         capture_output=True, text=True, env=env, check=True).stdout  # fmt: skip
    props = dict(line.split("=", 1) for line in out.splitlines())
    assert props["LoadState"] == "loaded"
    assert exec_argv(props["ExecStart"])[-2:] == ["--port", "1"]
