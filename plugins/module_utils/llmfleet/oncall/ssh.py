"""SSH for the on-call commands: Fabric's Connection, set up the way Ansible's ssh connection would reach the
node (ansible_host/port/user, ansible_ssh_private_key_file, and ansible_ssh_common_args' -F file and -o options),
with host keys checked against the known_hosts files that ssh would read.

Fabric accepts any host key (AutoAddPolicy) and reads no known_hosts file; this module loads the ssh config's
UserKnownHostsFile/GlobalKnownHostsFile and rejects unknown hosts unless StrictHostKeyChecking=no or Ansible's
host_key_checking is off - as ssh under Ansible does. The probe is written to the exec channel's stdin and the
channel is read until the exit status or the deadline.

Ops host only: fabric and paramiko are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shlex
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..fleet_inventory import Node

CONNECT_TIMEOUT = 10.0  # when the ssh config sets no ConnectTimeout


class TransportError(Exception):
    """The node could not be reached or did not answer in time: one line saying which and why."""


@dataclass
class Done:
    rc: int
    stdout: bytes
    stderr: bytes


DEFAULT_USER_CONFIG = "~/.ssh/config"
DEFAULT_SYSTEM_CONFIG = "/etc/ssh/ssh_config"
DEFAULT_KNOWN = "~/.ssh/known_hosts ~/.ssh/known_hosts2"
DEFAULT_GLOBAL_KNOWN = "/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2"


def ssh_config_text(node: Node) -> str:
    """One ssh_config text in ssh's precedence: the -o options first (first value wins), then the -F file, or
    without -F the user's and the system's files. paramiko's SSHConfig has no Include."""
    opts = "".join(f"  {k} {v}\n" for k, v in node.ssh.options.items())
    parts = [f"Host *\n{opts}"] if opts else []
    files = [node.ssh.config_file] if node.ssh.config_file else [DEFAULT_USER_CONFIG, DEFAULT_SYSTEM_CONFIG]
    for path in map(os.path.expanduser, files):
        try:
            with open(path, encoding="utf-8") as f:
                parts.append(f.read())
        except FileNotFoundError:
            if node.ssh.config_file:
                raise TransportError(f"ssh config {path} (-F): no such file") from None
        except OSError as e:
            raise TransportError(f"ssh config {path}: {e.strerror}") from None
    return "\n".join(parts)


def _paths(text: str) -> list[str]:
    return [os.path.expanduser(p) for p in text.split()]


def connection(node: Node) -> Any:
    """A Fabric Connection for the node, not yet connected, host keys handled as ssh would."""
    from fabric import Config, Connection
    from paramiko import SSHConfig

    cfg = SSHConfig.from_text(ssh_config_text(node))
    lookup = cfg.lookup(node.ssh.host)
    kwargs: dict[str, Any] = {"banner_timeout": CONNECT_TIMEOUT, "auth_timeout": CONNECT_TIMEOUT * 3}
    if node.ssh.key_files:
        kwargs["key_filename"] = list(node.ssh.key_files)
    if str(lookup.get("identitiesonly", "no")).lower() == "yes" and (node.ssh.key_files or lookup.get("identityfile")):
        kwargs.update(allow_agent=False, look_for_keys=False)  # as ssh: only the named keys
    conn = Connection(
        node.ssh.host,
        user=node.ssh.user,  # ansible_user wins over the config's User (Ansible passes -o User=...)
        port=node.ssh.port,
        config=Config(ssh_config=cfg),
        connect_timeout=None if "connecttimeout" in lookup else int(CONNECT_TIMEOUT),
        connect_kwargs=kwargs,
    )
    _host_keys(conn, node.ssh.host_key_checking)
    return conn


def _host_keys(conn: Any, ansible_checking: bool) -> None:
    """Known hosts from the config's files; unknown hosts rejected unless checking is off (for a jump host too)."""
    from fabric import Connection
    from paramiko import AutoAddPolicy, RejectPolicy

    strict = str(conn.ssh_config.get("stricthostkeychecking", "ask")).lower()
    checking = ansible_checking and strict not in ("no", "off")
    client = conn.client
    if checking:
        for path in _paths(conn.ssh_config.get("userknownhostsfile", DEFAULT_KNOWN)) + _paths(
            conn.ssh_config.get("globalknownhostsfile", DEFAULT_GLOBAL_KNOWN)
        ):
            if os.path.isfile(path):
                client.load_system_host_keys(path)  # read-only: nothing is ever written back
        client.set_missing_host_key_policy(RejectPolicy())
    else:
        client.set_missing_host_key_policy(AutoAddPolicy())  # in memory only (no known_hosts file is set)
    if isinstance(conn.gateway, Connection):
        _host_keys(conn.gateway, ansible_checking)


def explain(node: Node, e: BaseException, conn: Any = None) -> str:  # noqa: PLR0911 (one line per cause)
    """One line: why the node could not be reached, and what to do."""
    import paramiko

    host = conn.host if conn is not None else node.ssh.host
    port = conn.port if conn is not None else (node.ssh.port or 22)
    user = conn.user if conn is not None else node.ssh.user
    at = f"ssh {user}@{host}:{port}"
    if isinstance(e, paramiko.BadHostKeyException):
        return f"{at}: host key CHANGED (not the one in known_hosts): verify the node before you trust it"
    if isinstance(e, paramiko.PasswordRequiredException):
        return f"{at}: the private key is encrypted: load it into ssh-agent (no passphrase is asked for here)"
    # paramiko tries each key type on each key file and raises the last error, often a type mismatch
    if isinstance(e, paramiko.AuthenticationException) or re.search(r"encountered \S+ key, expected", str(e)):
        return f"{at}: authentication failed (key: {', '.join(node.ssh.key_files) or 'from ssh config/agent'})"
    if isinstance(e, paramiko.SSHException) and "known_hosts" in str(e):
        return (f"{at}: host key unknown (not in the known_hosts files ssh would read): connect once with ssh "
                "to check and add it, or add it with ssh-keyscan")  # fmt: skip
    if isinstance(e, socket.gaierror):
        return f"{at}: cannot resolve {host}: {e.strerror}"
    if isinstance(e, (TimeoutError, socket.timeout)):
        return f"{at}: connect timed out"
    if isinstance(e, paramiko.ssh_exception.NoValidConnectionsError):
        return f"{at}: connection refused (sshd down or the wrong port?)"
    if isinstance(e, OSError) and e.strerror:
        return f"{at}: {e.strerror}"
    return f"{at}: {type(e).__name__}: {e}"


class SshTransport:
    """One Fabric connection per node, opened on first use and reused for later rounds (restart polls)."""

    def __init__(self) -> None:
        self._conns: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _open(self, node: Node) -> Any:
        with self._lock:
            conn = self._conns.get(node.name)
        if conn is not None and conn.is_connected:
            return conn
        try:
            conn = connection(node)
        except TransportError:
            raise
        except Exception as e:  # a config paramiko cannot read
            raise TransportError(f"ssh config for {node.name}: {e}") from None
        try:
            conn.open()
        except Exception as e:
            raise TransportError(explain(node, e, conn)) from None
        with self._lock:
            self._conns[node.name] = conn
        return conn

    def run(self, node: Node, argv: list[str], stdin: bytes, timeout: float, max_output: int) -> Done:
        deadline = time.monotonic() + timeout
        conn = self._open(node)
        try:
            chan = conn.create_session()
            chan.exec_command(shlex.join(argv))
            chan.sendall(stdin)
            chan.shutdown_write()
            out, err = bytearray(), bytearray()
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    chan.close()
                    raise TransportError(f"no answer within {timeout:g} s")
                select.select([chan], [], [], min(left, 1.0))
                while chan.recv_ready():
                    out += chan.recv(1 << 16)
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(1 << 16)
                    del err[: -(1 << 16)]
                if len(out) > max_output:
                    chan.close()
                    raise TransportError(f"answer larger than {max_output} bytes")
                # the output is whole at EOF, not at the exit status: sshd sends exit-status when it reaps the
                # child, which under load can be before it has drained the child's stdout pipe
                ended = chan.exit_status_ready() and (chan.eof_received or chan.closed)
                if ended and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
            return Done(chan.recv_exit_status(), bytes(out), bytes(err))
        except TransportError:
            raise
        except Exception as e:
            raise TransportError(explain(node, e, conn)) from None

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            with contextlib.suppress(Exception):  # closing is best effort
                c.close()
