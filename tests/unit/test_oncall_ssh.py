"""SSH for the on-call commands: Fabric set up from the inventory the way Ansible's ssh would reach a node.

First without connecting (the lab's ssh_config as tests/lab/labctl.py writes it), then real SSH rounds against
an in-process paramiko server that runs the command it is given (the probe on stdin, its answer on stdout).
"""

from __future__ import annotations

import contextlib
import json
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import paramiko
import pytest
from test_oncall_fakes import lab_inventory

from llmfleet.fleet_inventory import load_fleet
from llmfleet.oncall.common import call_probe
from llmfleet.oncall.ssh import SshTransport, TransportError, connection


def test_lab_ssh_config_is_honoured_without_connecting(tmp_path):
    inv, lab = lab_inventory(tmp_path)
    node = load_fleet([str(inv)]).nodes[1]
    conn = connection(node)
    assert (conn.host, conn.port) == ("10.99.0.12", 22)
    assert conn.user == "ops"  # ansible_user ({{ lab_operator }}) wins over the ssh_config's `User root`
    assert conn.connect_timeout == 5  # ConnectTimeout 5
    assert str(lab.key) in conn.connect_kwargs["key_filename"]  # IdentityFile
    assert conn.connect_kwargs["allow_agent"] is False and conn.connect_kwargs["look_for_keys"] is False
    assert isinstance(conn.client._policy, paramiko.RejectPolicy)  # StrictHostKeyChecking yes
    known = conn.client._system_host_keys  # UserKnownHostsFile: the lab's known_hosts, read-only
    assert known.lookup("10.99.0.12") is not None and known.lookup("node2") is not None
    assert conn.client._host_keys_filename is None  # nothing is ever written back


def test_lab_as_root_without_become(tmp_path):
    inv, _ = lab_inventory(tmp_path)
    node = load_fleet([str(inv)], extra_vars={"lab_operator": "root"}).nodes[0]
    assert connection(node).user == "root" and node.probe_argv("S") == ["/usr/bin/python3", "-I", "-S", "-", "S"]


def test_host_key_checking_off(tmp_path):
    inv, _ = lab_inventory(tmp_path)
    node = load_fleet([str(inv)], extra_vars={"ansible_host_key_checking": "false"}).nodes[0]
    assert isinstance(connection(node).client._policy, paramiko.AutoAddPolicy)
    node = load_fleet([str(inv)], extra_vars={"ansible_ssh_extra_args": "-o StrictHostKeyChecking=no"}).nodes[0]
    assert isinstance(connection(node).client._policy, paramiko.AutoAddPolicy)


# ---- a real SSH peer ------------------------------------------------------------------------------------------


class _Server(paramiko.ServerInterface):
    def __init__(self, user: str, key: paramiko.PKey) -> None:
        self.user, self.key, self.command = user, key, None
        self.exec_event = threading.Event()

    def get_allowed_auths(self, username):
        return "publickey"

    def check_auth_publickey(self, username, key):
        ok = username == self.user and key == self.key
        return paramiko.AUTH_SUCCESSFUL if ok else paramiko.AUTH_FAILED

    def check_channel_request(self, kind, chanid):
        return paramiko.OPEN_SUCCEEDED if kind == "session" else paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

    def check_channel_exec_request(self, channel, command):
        self.command = command.decode()
        self.exec_event.set()
        return True


class SshPeer:
    """Accepts SSH connections on 127.0.0.1 and runs each exec request as sshd would (through a shell), with
    `sudo -n -u root --` taken off the front (passwordless sudo). commands: what it was asked to run."""

    def __init__(self, user: str = "ops", exit_status_first: bool = False) -> None:
        self.exit_status_first = exit_status_first
        self.host_key = paramiko.ECDSAKey.generate()
        self.client_key = paramiko.ECDSAKey.generate()
        self.user, self.commands = user, []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                s, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(s,), daemon=True).start()

    def _serve(self, s):
        t = paramiko.Transport(s)
        t.add_server_key(self.host_key)
        server = _Server(self.user, self.client_key)
        try:
            t.start_server(server=server)
        except (paramiko.SSHException, EOFError):
            return
        while t.is_active():
            chan = t.accept(1)
            if chan is None:
                continue
            server.exec_event.wait(5)
            server.exec_event.clear()
            self.commands.append(server.command)
            argv = shlex.split(server.command)
            if argv[:5] == ["sudo", "-n", "-u", "root", "--"]:
                argv = argv[5:]
            sh = ["/bin/sh", "-c", shlex.join(argv)]  # as sshd: the user's shell runs the command line
            p = subprocess.Popen(sh, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            data = b""
            while True:
                chunk = chan.recv(65536)
                if not chunk:
                    break
                data += chunk
            out, err = p.communicate(data)
            if self.exit_status_first:
                # OpenSSH's sshd sends exit-status when it reaps the child, which under load can be before it
                # has drained the child's stdout pipe: the output follows, then EOF and close
                chan.send_exit_status(p.returncode)
                time.sleep(1.5)  # past the client's 1 s select tick
            chan.sendall(out)
            chan.sendall_stderr(err)
            if not self.exit_status_first:
                chan.send_exit_status(p.returncode)
            chan.close()

    def known_hosts(self, path: Path, key: paramiko.PKey | None = None) -> None:
        k = key or self.host_key
        path.write_text(f"[127.0.0.1]:{self.port} {k.get_name()} {k.get_base64()}\n")

    def close(self):
        # close() alone leaves the socket listening while the accept thread blocks in it (Linux): connections
        # kept being accepted under load. shutdown() wakes accept and stops listening.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


@pytest.fixture
def peer():
    p = SshPeer()
    yield p
    p.close()


def _inventory(tmp_path: Path, peer: SshPeer, **extra) -> Path:
    """A lab-format ssh_config (Host/HostName/User/IdentityFile/UserKnownHostsFile/StrictHostKeyChecking)."""
    key = tmp_path / "id_ecdsa"
    peer.client_key.write_private_key_file(str(key))
    peer.known_hosts(tmp_path / "known_hosts")
    (tmp_path / "ssh_config").write_text(
        "Host node1 127.0.0.1\n  HostName 127.0.0.1\n"
        f"  User root\n  IdentityFile {key}\n  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {tmp_path / 'known_hosts'}\n  StrictHostKeyChecking yes\n  ConnectTimeout 5\n"
    )
    host = {"ansible_host": "127.0.0.1", "ansible_port": peer.port, "ansible_python_interpreter": sys.executable}
    inv = {
        "all": {
            "children": {"llmfleet_nodes": {"children": {"head": {"hosts": {"node1": host}}}}},
            "vars": {"operator": "ops", "ansible_user": "{{ operator }}", "llmfleet_deployment": "demo",
                     "ansible_ssh_common_args": f"-F {tmp_path / 'ssh_config'}", **extra},
        }
    }  # fmt: skip
    (tmp_path / "hosts.yml").write_text(json.dumps(inv))
    return tmp_path / "hosts.yml"


def _counters(node, transport, tmp_path):
    spec = {"op": "counters", "sysfs_root": str(tmp_path / "nosys"), "fabric_env": str(tmp_path / "fabric.env")}
    return call_probe(transport, node, spec, 20)


def test_probe_over_real_ssh(tmp_path, peer):
    (tmp_path / "fabric.env").write_text("NCCL_IB_HCA=mlx5_0\n")
    node = load_fleet([str(_inventory(tmp_path, peer))]).head
    t = SshTransport()
    try:
        got = _counters(node, t, tmp_path)
        again = _counters(node, t, tmp_path)  # the connection is reused
    finally:
        t.close()
    assert got["env"] == {"NCCL_IB_HCA": "mlx5_0"} and got["hcas"] == {} and again["probe"] == 1
    cmd = shlex.split(peer.commands[0])
    assert cmd[:4] == [sys.executable, "-I", "-S", "-"] and json.loads(cmd[4])["op"] == "counters"


def test_output_after_the_exit_status_is_still_read(tmp_path):
    """The answer arriving after the exit status is read, not lost as `probe failed: exit 0, no answer`."""
    late = SshPeer(exit_status_first=True)
    try:
        node = load_fleet([str(_inventory(tmp_path, late))]).head
        t = SshTransport()
        try:
            got = _counters(node, t, tmp_path)
        finally:
            t.close()
    finally:
        late.close()
    assert got["probe"] == 1 and got["hcas"] == {}


def test_become_runs_the_probe_through_sudo(tmp_path, peer):
    node = load_fleet([str(_inventory(tmp_path, peer, ansible_become=True))]).head
    t = SshTransport()
    try:
        _counters(node, t, tmp_path)
    finally:
        t.close()
    assert shlex.split(peer.commands[0])[:6] == ["sudo", "-n", "-u", "root", "--", sys.executable]


def _error(tmp_path, peer, **extra) -> str:
    node = load_fleet([str(_inventory(tmp_path, peer, **extra))]).head
    with pytest.raises(TransportError) as e:
        _counters(node, SshTransport(), tmp_path)
    return str(e.value)


def test_unknown_host_key_is_refused(tmp_path, peer):
    inv = _inventory(tmp_path, peer)
    (tmp_path / "known_hosts").write_text("")
    node = load_fleet([str(inv)]).head
    with pytest.raises(TransportError, match=r"ssh ops@127.0.0.1:\d+: host key unknown"):
        _counters(node, SshTransport(), tmp_path)
    assert peer.commands == []


def test_changed_host_key_is_refused(tmp_path, peer):
    inv = _inventory(tmp_path, peer)
    peer.known_hosts(tmp_path / "known_hosts", key=paramiko.ECDSAKey.generate())
    node = load_fleet([str(inv)]).head
    with pytest.raises(TransportError, match="host key CHANGED"):
        _counters(node, SshTransport(), tmp_path)


def test_strict_host_key_checking_no_accepts_an_unknown_key(tmp_path, peer):
    inv = _inventory(tmp_path, peer, ansible_ssh_extra_args="-o StrictHostKeyChecking=no")
    (tmp_path / "known_hosts").write_text("")
    assert _counters(load_fleet([str(inv)]).head, SshTransport(), tmp_path)["probe"] == 1
    assert (tmp_path / "known_hosts").read_text() == ""  # nothing written back


def test_wrong_user_is_an_authentication_failure(tmp_path, peer):
    assert "authentication failed" in _error(tmp_path, peer, operator="mallory")


def test_connection_refused(tmp_path, peer):
    peer.close()
    assert "connection refused" in _error(tmp_path, peer)


def test_probe_that_does_not_answer_in_time(tmp_path, peer):
    node = load_fleet([str(_inventory(tmp_path, peer))]).head
    t = SshTransport()
    try:
        with pytest.raises(TransportError, match=r"no answer within 0.5 s"):
            t.run(node, ["sleep", "5"], b"", 0.5, 1 << 20)
    finally:
        t.close()


def test_missing_python_on_the_node_is_explained(tmp_path, peer):
    inv = _inventory(tmp_path, peer)
    node = load_fleet([str(inv)], extra_vars={"ansible_python_interpreter": "/nonexistent/python3"}).head
    with pytest.raises(TransportError, match=r"is /nonexistent/python3 there\? set ansible_python_interpreter"):
        _counters(node, SshTransport(), tmp_path)
