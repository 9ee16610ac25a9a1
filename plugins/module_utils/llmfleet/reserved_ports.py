"""The node's reserved local ports: no outgoing connection may take a port a deployment listens on.

Linux hands outgoing connections a local port from net.ipv4.ip_local_port_range (32768-60999 by default), which
holds the engine's default rendezvous and link ports (50080, 50082). A connection that got one - open, or closed
less than 60 s ago (TIME_WAIT) - makes the engine's bind fail with "Address already in use", at random: any HTTP
fetch, SSH session or NFS transfer of the node can be that connection. Ports listed in
net.ipv4.ip_local_reserved_ports are never handed out; llmfleet keeps every port of the deployments' claims there
(the union of <claim_dir>/*.json's "ports"), next to whatever the site reserved itself, and persists the list in a
sysctl.d file so that a reboot keeps it.

Stdlib only, Python >= 3.8 (runs on the nodes as root).
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Callable

from .safefs import write_file

SYSCTL = "/proc/sys/net/ipv4/ip_local_reserved_ports"
KEY = "net.ipv4.ip_local_reserved_ports"
OURS_MARK = "# llmfleet's ports: "
TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
              "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN",
              "0B": "CLOSING"}  # fmt: skip


class PortsError(Exception):
    """Bad input or a port that stays held: the message names the file or port and the fix."""


def parse_ranges(text: str) -> set[int]:
    """The kernel's list syntax ("50080,50082,60000-60010") as a set of ports."""
    out: set[int] = set()
    for part in text.replace("\n", ",").split(","):
        part = part.strip()
        if not part:
            continue
        lo, hi = part.partition("-")[::2]
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise PortsError(f"{part!r} is not a port or a port range") from None
        if not 0 < a <= b <= 65535:
            raise PortsError(f"{part!r} is not a port or a port range (1-65535)")
        out.update(range(a, b + 1))
    return out


def format_ranges(ports: set[int]) -> str:
    """The kernel's list syntax, ranges merged ("" for none)."""
    out, run = [], []
    for p in sorted(ports):
        if run and p == run[-1] + 1:
            run.append(p)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [p]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


def _read(path: str) -> str | None:
    """A root-owned file's text, never through a symlink (None when absent)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise PortsError(f"{path}: cannot be read ({e.strerror}): it must be a regular file root owns") from None
    with os.fdopen(fd, encoding="utf-8") as f:
        return f.read()


def claimed_ports(claim_dir: str) -> dict[int, str]:
    """Port -> "<deployment> <what>" for every port of every claim in claim_dir (none when it does not exist)."""
    try:
        names = sorted(n for n in os.listdir(claim_dir) if n.endswith(".json"))
    except FileNotFoundError:
        return {}
    out: dict[int, str] = {}
    for name in names:
        path = os.path.join(claim_dir, name)
        try:
            data = json.loads(_read(path) or "{}")
            ports = data.get("ports") or {}
            items = [(str(what), int(port)) for what, port in ports.items()]
        except (ValueError, AttributeError, TypeError) as e:
            raise PortsError(f"{path} is not a deployment claim ({e}): the engine role writes it; remove it only if "
                             "no deployment of that name is installed on the node") from None  # fmt: skip
        for what, port in items:
            if 0 < port <= 65535:
                out.setdefault(port, f"{name[: -len('.json')]} {what}")
    return out


def ours_in_file(text: str | None) -> set[int]:
    """The ports llmfleet reserved (the site had not), as its sysctl.d file says (none without the file)."""
    for line in (text or "").splitlines():
        if line.startswith(OURS_MARK):
            return parse_ranges(line[len(OURS_MARK) :])
    return set()


def file_text(reserved: set[int], owned: set[int]) -> str:
    return (
        "# Written by llmfleet (the engine role): the local ports no outgoing connection may take, so that the\n"
        "# deployments' listeners can always bind theirs (docs/engine.md, \"Reserved ports\"). The list is the node's whole\n"
        "# reservation as llmfleet last set it, the site's own entries included; the ports llmfleet added (and\n"
        "# releases when no deployment claims them) are on the next line.\n"
        f"{OURS_MARK}{format_ranges(owned)}\n"
        f"{KEY} = {format_ranges(reserved)}\n"
    )


def listening(tables: tuple[str, ...] = TCP_TABLES) -> set[int]:
    """Local ports a TCP socket of the node listens on."""
    return {s["port"] for s in tcp_sockets(tables) if s["state"] == "LISTEN"}


def tcp_sockets(tables: tuple[str, ...] = TCP_TABLES) -> list[dict]:
    """Every TCP socket of the node: {port (local), state, remote (ip:port as the kernel writes it, hex)}."""
    out = []
    for table in tables:
        try:
            with open(table, encoding="ascii") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 4:
                continue
            local, remote, st = cols[1], cols[2], cols[3]
            out.append({"port": int(local.rsplit(":", 1)[1], 16), "state": TCP_STATES.get(st, st),
                        "remote": _addr(remote)})  # fmt: skip
    return out


def _addr(hexaddr: str) -> str:
    ip, port = hexaddr.rpartition(":")[::2]
    try:
        if len(ip) == 8:
            text = socket.inet_ntop(socket.AF_INET, bytes.fromhex(ip)[::-1])
        else:
            raw = bytes.fromhex(ip)
            text = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
        return f"{text}:{int(port, 16)}"
    except (ValueError, OSError):
        return hexaddr


def bindable(port: int) -> bool:
    """Whether a listener could bind the port on every address now (SO_REUSEADDR, as servers set it)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))  # noqa: S104 (a test bind, closed at once)
        return True
    except OSError:
        return False
    finally:
        s.close()


def wait_released(
    ports: set[int],
    wait: float,
    *,
    tables: tuple[str, ...] | None = None,
    probe: Callable[[int], bool] = bindable,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Wait (at most `wait` s) until a listener could bind each of `ports` that nothing listens on: a port just
    reserved may still belong to a connection made before (a closed one is released 60 s after it closed). Returns
    the seconds waited; PortsError names what still holds a port at the deadline."""
    tables = tables or TCP_TABLES
    t0 = clock()
    listen = listening(tables)
    todo = sorted(p for p in ports if p not in listen)
    while True:
        todo = [p for p in todo if not probe(p)]
        if not todo or clock() - t0 >= wait:
            break
        sleep(1.0)
    waited = round(clock() - t0, 1)
    if todo:
        held = [s for s in tcp_sockets(tables) if s["port"] in todo]
        what = "; ".join(f"{s['port']}: {s['state']} to {s['remote']}" for s in held) or "no TCP socket shows it"
        raise PortsError(
            f"port {', '.join(map(str, todo))} is reserved now, but after {waited:.0f} s a connection still holds it "
            f"({what}): the engine could not listen there. End that connection (or give the deployment another "
            "port: engine_port, engine_dist_port, engine_link_port) and run again."
        )
    return waited


def converge(
    claim_dir: str,
    extra: set[int],
    file: str,
    *,
    check: bool = False,
    sysctl: str | None = None,
) -> dict:
    """Make the kernel's reservation hold every claimed port (and `extra`), release the ports llmfleet reserved
    that no claim holds any more, and keep the file in step (removed when llmfleet reserves nothing).
    Returns {changed, ports, reserved, before, added, released, file_changed}."""
    sysctl = sysctl or SYSCTL
    claimed = claimed_ports(claim_dir)
    ours = set(claimed) | set(extra)
    text = _read(sysctl)
    if text is None:
        raise PortsError(f"{sysctl} does not exist: this kernel cannot reserve local ports (Linux >= 2.6.35 can)")
    before = parse_ranges(text)
    have_file = _read(file)
    previous = ours_in_file(have_file)
    reserved = (before - (previous - ours)) | ours
    # What llmfleet added, and only that, is released when no claim holds it: a port the site had reserved itself
    # before a deployment claimed it stays reserved after.
    owned = (previous & ours) | (ours - before)
    want_file = file_text(reserved, owned) if ours else None
    file_changed = want_file != have_file
    changed = reserved != before or file_changed
    if changed and not check:
        if reserved != before:
            with open(sysctl, "w", encoding="ascii") as f:
                f.write(format_ranges(reserved) + "\n")
        if want_file is None:
            if have_file is not None:
                os.unlink(file)
        elif file_changed:
            write_file(file, want_file.encode(), mode=0o644, create_dirs=True, fsync=True)
    return {"changed": changed, "ports": sorted(ours), "reserved": format_ranges(reserved),
            "before": format_ranges(before), "added": sorted(reserved - before), "released": sorted(before - reserved),
            "file_changed": file_changed, "claimed": {str(k): v for k, v in sorted(claimed.items())}}  # fmt: skip
