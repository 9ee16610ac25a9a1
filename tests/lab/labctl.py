#!/usr/bin/env python3
"""The llmfleet lab: N fake bare-metal hosts on this machine, each with its own network
namespace + IP on a private bridge, its own real systemd as PID 1, its own sshd, an overlay
root (node writes never reach the host), a private /mnt/nvme, /mnt/shared (read-only) and the
project (with its venv) bind-mounted read-only at the same path.

    labctl.py up N [--wipe-nvme]   bring nodes 1..N up (idempotent; extra nodes are stopped)
    labctl.py down                  stop every node, remove netns/links/cgroups (idempotent)
    labctl.py status [--json]       what is running
    labctl.py shell NODE [CMD...]   a shell (or a command) inside a node, via nsenter

Facts this relies on were proven on this machine kind: see ../shared/docs/lab.md. The one rule
that must never be broken: a node's systemd is PID 1 and re-executes on SIGTERM, so nodes are
stopped with `systemctl poweroff` (SIGKILL only as a last resort after a deadline).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parent.parent
INIT_SCRIPT = HERE / "node-init.sh"
CGROUP_ROOT = Path("/sys/fs/cgroup/unified")
DEFAULT_STATE = Path(os.environ.get("LLMFLEET_LAB_STATE", "/var/tmp/llmfleet-lab"))
BOOT_TIMEOUT = float(os.environ.get("LLMFLEET_LAB_BOOT_TIMEOUT", "90"))
STOP_TIMEOUT = 30.0
NODE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class LabError(RuntimeError):
    """A lab operation failed; the message says which node and what to do."""


def run(argv: list[str], check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    if "input" not in kw:
        kw["stdin"] = subprocess.DEVNULL
    cp = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if check and cp.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed (exit {cp.returncode}): {cp.stderr.strip() or cp.stdout.strip()}")
    return cp


def _proc_state(pid: int) -> str | None:
    """Process state letter, or None if the pid does not exist (zombies count as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    state = stat.rsplit(")", 1)[1].split()[0]
    return None if state in ("Z", "X") else state


def _cgroup_pids(cg: Path) -> list[int]:
    """Pids in a cgroup tree. Sub-cgroups vanish while a node powers off: tolerate that."""
    pids: list[int] = []
    for top, _dirs, files in os.walk(cg):  # os.walk ignores directories that disappear
        if "cgroup.procs" in files:
            with contextlib.suppress(OSError):
                pids += [int(p) for p in Path(top, "cgroup.procs").read_text().split()]
    return pids


def _rmdir_tree(cg: Path) -> None:
    """Remove a cgroup directory tree bottom-up (cgroupfs dirs are removed with rmdir only).
    Directories may vanish underneath us (a node's systemd removes its own while powering off)."""
    for _ in range(50):
        if not cg.is_dir():
            return
        try:
            for top, dirs, _files in os.walk(cg, topdown=False):
                for d in dirs:
                    with contextlib.suppress(FileNotFoundError):
                        os.rmdir(os.path.join(top, d))
            cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY: a process is still leaving the cgroup
            time.sleep(0.1)
    raise LabError(f"cannot remove cgroup {cg}: processes {_cgroup_pids(cg)} are still in it")


@dataclass
class Node:
    lab: Lab
    index: int

    @property
    def name(self) -> str:
        return f"node{self.index}"

    @property
    def ip(self) -> str:
        return f"{self.lab.subnet}.{10 + self.index}"

    @property
    def netns(self) -> str:
        return f"{self.lab.name}-{self.name}"

    @property
    def veth(self) -> str:
        return f"{self.lab.name}-{self.name}"

    @property
    def dir(self) -> Path:
        return self.lab.state / self.name

    @property
    def cgroup(self) -> Path:
        return self.lab.cgroup / self.name

    def launcher_pid(self) -> int | None:
        try:
            pid = int((self.dir / "launcher.pid").read_text())
        except (FileNotFoundError, ValueError):
            return None
        return pid if _proc_state(pid) and pid in _cgroup_pids(self.cgroup) else None

    def systemd_pid(self) -> int | None:
        """Host pid of the node's PID 1 (the launcher's only child, once it exec'd systemd)."""
        lp = self.launcher_pid()
        if lp is None:
            return None
        try:
            children = Path(f"/proc/{lp}/task/{lp}/children").read_text().split()
        except OSError:
            return None
        for c in children:
            try:
                if Path(f"/proc/{c}/comm").read_text().strip() == "systemd":
                    return int(c)
            except OSError:
                continue
        return None

    def nsenter(
        self, *cmd: str, timeout: float = 30, check: bool = False, input: str | None = None
    ) -> subprocess.CompletedProcess:
        pid = self.systemd_pid()
        if pid is None:
            raise LabError(f"{self.name} is not running: run `labctl.py up N` first")
        kw = {} if input is None else {"input": input}
        return run(["nsenter", "-t", str(pid), "-a", *cmd], check=check, timeout=timeout, **kw)

    def ssh_ok(self) -> bool:
        try:
            with socket.create_connection((self.ip, 22), timeout=1) as s:
                s.settimeout(2)
                return s.recv(4).startswith(b"SSH-")
        except OSError:
            return False


@dataclass
class Lab:
    name: str = "lab"
    subnet: str = "10.77.0"
    state_root: Path = DEFAULT_STATE
    inventory_dir: Path | None = field(default=None)
    project: Path = PROJECT

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9]{0,4}", self.name):
            raise LabError(f"lab name {self.name!r}: use 1-5 lowercase letters/digits (it prefixes 15-char link names)")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", self.subnet):
            raise LabError(f"lab subnet {self.subnet!r}: give the first three octets of a /24, e.g. 10.77.0")

    @property
    def state(self) -> Path:
        return self.state_root / self.name

    @property
    def bridge(self) -> str:
        return f"{self.name}-br0"

    @property
    def cgroup(self) -> Path:
        return CGROUP_ROOT / f"llmfleet-{self.name}"

    @property
    def shared(self) -> Path:
        return self.state / "shared"

    @property
    def shared_rw(self) -> Path:
        """The writable area of the shared storage (leases, manifest cache): /mnt/shared-rw."""
        return self.state / "shared-rw"

    @property
    def key(self) -> Path:
        return self.state / "id_ed25519"

    @property
    def ssh_config(self) -> Path:
        return self.state / "ssh_config"

    def project_identity(self) -> str:
        """The checkout a node mounts: its path and inode (a checkout removed and cloned again at the
        same path is another directory; a node still mounting the old one sees none of the new files)."""
        st = self.project.stat()
        return f"{self.project} {st.st_dev}:{st.st_ino}"

    def node(self, i: int) -> Node:
        return Node(self, i)

    def known_nodes(self) -> list[Node]:
        """Every node that has any trace: state dir, netns, link or cgroup."""
        idx: set[int] = set()
        for base in (self.state, self.cgroup):
            if base.is_dir():
                idx |= {int(m.group(1)) for p in base.iterdir() if (m := re.fullmatch(r"node(\d+)", p.name))}
        netns = run(["ip", "netns", "list"], check=False).stdout
        idx |= {int(m) for m in re.findall(rf"^{re.escape(self.name)}-node(\d+)\b", netns, re.M)}
        links = run(["ip", "-o", "link", "show"], check=False).stdout
        idx |= {int(m) for m in re.findall(rf"\d+: {re.escape(self.name)}-node(\d+)[@:]", links)}
        return [self.node(i) for i in sorted(idx)]

    # ---- bring-up -------------------------------------------------------------------------
    def _preflight(self) -> None:
        if os.geteuid() != 0:
            raise LabError("the lab needs root (network namespaces, mounts, cgroups)")
        if not Path("/usr/sbin/sshd").exists():
            raise LabError("sshd is missing: apt-get install -y openssh-server (make test does this)")
        if not (CGROUP_ROOT / "cgroup.procs").exists():
            raise LabError(f"{CGROUP_ROOT} is not a cgroup2 mount: the lab needs the hybrid/unified hierarchy")

    def _ensure_common(self, n: int) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        self.shared.mkdir(exist_ok=True)
        self.shared_rw.mkdir(exist_ok=True)
        self.cgroup.mkdir(exist_ok=True)
        if not self.key.exists():
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"llmfleet-{self.name}", "-f", str(self.key)])
        if run(["ip", "link", "show", self.bridge], check=False).returncode != 0:
            run(["ip", "link", "add", self.bridge, "type", "bridge"])
            run(["ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge])
        run(["ip", "link", "set", self.bridge, "up"])
        hosts = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback", f"{self.subnet}.1 ops"]
        hosts += [f"{self.node(i).ip} {self.node(i).name}" for i in range(1, n + 1)]
        (self.state / "hosts").write_text("\n".join(hosts) + "\n")

    def hosts_for(self, node: Node) -> str:
        """/etc/hosts as Debian writes it: the node's own name on 127.0.1.1 (the real-cluster
        trap that makes Gloo/NCCL pick loopback without *_SOCKET_IFNAME), the others by IP."""
        own = f"{node.ip} {node.name}"
        lines = [ln for ln in (self.state / "hosts").read_text().splitlines() if ln != own]
        return "\n".join([*lines, f"127.0.1.1 {node.name}"]) + "\n"

    def _start(self, node: Node) -> None:
        d = node.dir
        (d / "nvme").mkdir(parents=True, exist_ok=True)
        (d / "hosts").write_text(self.hosts_for(node))
        shutil.copy(self.key.with_suffix(".pub"), d / "authorized_keys")
        hk = d / "ssh_host_ed25519_key"
        if not hk.exists():
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", node.name, "-f", str(hk)])
        (d / "console.log").write_text("")
        ns = node.netns
        run(["ip", "netns", "add", ns])
        run(["ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
        run(["ip", "link", "set", node.veth, "master", self.bridge, "up"])
        run(["ip", "-n", ns, "link", "set", "lo", "up"])
        run(["ip", "-n", ns, "addr", "add", f"{node.ip}/24", "dev", "eth0"])
        run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        run(["ip", "-n", ns, "route", "add", "default", "via", f"{self.subnet}.1"])
        node.cgroup.mkdir(exist_ok=True)
        # The launcher joins the node's cgroup before unsharing, so --cgroup makes that cgroup the
        # node's root; setsid -f detaches it from us (the host's init reaps it when the node stops).
        launcher = (
            f'echo $$ > "{node.cgroup}/cgroup.procs" && echo $$ > "{d}/launcher.pid" && exec ip netns exec {ns} '
            f"unshare --pid --fork --kill-child --mount --uts --ipc --cgroup --propagation private "
            f'"{INIT_SCRIPT}" "{d}" {node.name} "{self.shared}" "{self.project}" >>"{d}/init.log" 2>&1 </dev/null'
        )
        (d / "launcher.pid").unlink(missing_ok=True)
        (d / "project").write_text(self.project_identity())
        run(["setsid", "-f", "/bin/sh", "-c", launcher])

    def _wait_booted(self, node: Node, deadline: float) -> None:
        while time.monotonic() < deadline:
            if node.systemd_pid() is not None:
                state = node.nsenter("systemctl", "is-system-running", timeout=10).stdout.strip()
                if state in ("running", "degraded") and node.ssh_ok():
                    if state == "degraded":
                        failed = node.nsenter("systemctl", "--failed", "--plain", "--no-legend").stdout
                        print(f"warning: {node.name} booted degraded: {failed.strip()}", file=sys.stderr)
                    return
            elif (node.dir / "launcher.pid").exists() and node.launcher_pid() is None:
                log = (node.dir / "init.log").read_text()[-2000:]
                raise LabError(f"{node.name}: init script exited before systemd started:\n{log}")
            time.sleep(0.2)
        raise LabError(
            f"{node.name} did not boot within {BOOT_TIMEOUT:.0f}s (systemd + sshd on {node.ip}:22); "
            f"see {node.dir}/init.log and {node.dir}/console.log"
        )

    def up(self, n: int, wipe_nvme: bool = False, fresh: bool = False) -> list[Node]:
        """N running nodes. Running nodes of this checkout are reused unless `fresh`: then every node
        boots anew (an empty overlay: no units, users or files left by an earlier run, e.g. `make demo`)."""
        if not 1 <= n <= 240:
            raise LabError(f"node count {n}: use 1..240")
        self._preflight()
        for node in self.known_nodes():
            if node.index > n:
                self._stop(node)
        self._ensure_common(n)
        wanted = [self.node(i) for i in range(1, n + 1)]
        to_start = []
        for node in wanted:
            # A running node is reused only if it mounts this checkout: another clone's lab would
            # show that clone's files (and venv) at a path this checkout's inventory does not use.
            mounted = node.dir / "project"
            same_project = mounted.exists() and mounted.read_text() == self.project_identity()
            if not fresh and same_project and node.systemd_pid() is not None and node.ssh_ok():
                hosts = self.hosts_for(node)
                if (node.dir / "hosts").read_text() != hosts:  # the node count changed: update in place
                    node.nsenter("sh", "-c", "cat > /etc/hosts", input=hosts, check=True)
                    (node.dir / "hosts").write_text(hosts)
                continue
            self._stop(node)
            to_start.append(node)
        if wipe_nvme:
            for node in wanted:
                self.wipe_nvme(node)
            # the shared storage's writable area holds leases and manifest caches of earlier runs
            for p in self.shared_rw.iterdir():
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        for node in to_start:
            self._start(node)
        deadline = time.monotonic() + BOOT_TIMEOUT
        try:
            with ThreadPoolExecutor(max_workers=16) as ex:
                list(ex.map(lambda nd: self._wait_booted(nd, deadline), to_start))
        except LabError:
            self.down()  # never leave a half-built lab behind
            raise
        self.write_inventory(wanted)
        return wanted

    def wipe_nvme(self, node: Node) -> None:
        nv = node.dir / "nvme"
        if node.systemd_pid() is not None:
            node.nsenter("sh", "-c", "find /mnt/nvme -mindepth 1 -delete", check=True)
        elif nv.exists():
            shutil.rmtree(nv)
            nv.mkdir()

    def write_inventory(self, nodes: list[Node]) -> None:
        known = self.state / "known_hosts"
        lines = []
        for nd in nodes:
            pub = (nd.dir / "ssh_host_ed25519_key.pub").read_text().split()
            lines.append(f"{nd.name},{nd.ip} {pub[0]} {pub[1]}")
        known.write_text("\n".join(lines) + "\n")
        inv = self.inventory_dir or self.state / "inventory"
        inv.mkdir(parents=True, exist_ok=True)
        ssh_config = self.ssh_config  # not in the inventory dir: ansible would try to parse it
        ssh_config.write_text(
            "# Written by tests/lab/labctl.py: lab nodes are reachable only from this machine.\n"
            + "".join(f"Host {nd.name}\n  HostName {nd.ip}\n" for nd in nodes)
            + f"Host {' '.join(nd.name for nd in nodes)} {self.subnet}.*\n"
            f"  User root\n  IdentityFile {self.key}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {known}\n  StrictHostKeyChecking yes\n  ConnectTimeout 5\n"
        )
        hosts: dict = {
            "all": {
                "children": {
                    "llmfleet_nodes": {
                        "children": {
                            "head": {"hosts": {nodes[0].name: None}},
                            "worker": {"hosts": {nd.name: None for nd in nodes[1:]}},
                        }
                    }
                },
                "vars": {"ansible_ssh_common_args": f"-F {ssh_config}"},
            }
        }
        for nd in nodes:
            grp = "head" if nd is nodes[0] else "worker"
            hosts["all"]["children"]["llmfleet_nodes"]["children"][grp]["hosts"][nd.name] = {
                "ansible_host": nd.ip,
                "llmfleet_fabric_ip": nd.ip,
            }
        text = "# Written by tests/lab/labctl.py (`up`); do not edit, it is rewritten on every bring-up.\n"
        text += json.dumps(hosts, indent=2) + "\n"  # JSON is valid YAML and needs no yaml module here
        (inv / "hosts.yml").write_text(text)

    # ---- teardown -------------------------------------------------------------------------
    def _stop(self, node: Node) -> None:
        spid = node.systemd_pid()
        if spid is not None:
            run(["nsenter", "-t", str(spid), "-a", "systemctl", "poweroff", "--no-block"], check=False, timeout=15)
        deadline = time.monotonic() + STOP_TIMEOUT
        while time.monotonic() < deadline and _cgroup_pids(node.cgroup):
            time.sleep(0.1)
        leftovers = _cgroup_pids(node.cgroup)
        if leftovers:
            # Last resort after the deadline: SIGKILL (never SIGTERM: PID 1 systemd re-executes on it).
            print(
                f"warning: {node.name} did not power off in {STOP_TIMEOUT:.0f}s; SIGKILL {leftovers}", file=sys.stderr
            )
            for pid in leftovers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + 10
            while time.monotonic() < end and _cgroup_pids(node.cgroup):
                time.sleep(0.1)
        _rmdir_tree(node.cgroup)
        run(["ip", "netns", "del", node.netns], check=False)
        run(["ip", "link", "del", node.veth], check=False)
        (node.dir / "launcher.pid").unlink(missing_ok=True)

    def down(self) -> None:
        nodes = self.known_nodes()
        with ThreadPoolExecutor(max_workers=16) as ex:
            list(ex.map(self._stop, nodes))
        run(["ip", "link", "del", self.bridge], check=False)
        _rmdir_tree(self.cgroup)
        inv = self.inventory_dir or self.state / "inventory"
        (inv / "hosts.yml").unlink(missing_ok=True)
        self.ssh_config.unlink(missing_ok=True)

    # ---- inspection -----------------------------------------------------------------------
    def status(self) -> list[dict]:
        out = []
        for node in self.known_nodes():
            spid = node.systemd_pid()
            state = None
            if spid is not None:
                state = node.nsenter("systemctl", "is-system-running", timeout=10).stdout.strip() or "starting"
            out.append(
                {"node": node.name, "ip": node.ip, "systemd_pid": spid, "state": state or "down", "ssh": node.ssh_ok()}
            )
        return out

    def leftovers(self) -> dict[str, list[str]]:
        """Everything of this lab that still exists on the host (empty lists after a clean down)."""
        netns = run(["ip", "netns", "list"], check=False).stdout
        links = run(["ip", "-o", "link", "show"], check=False).stdout
        mounts = Path("/proc/self/mountinfo").read_text()
        procs = []
        for p in Path("/proc").iterdir():
            # Zombies are ignored: they hold nothing, and the host's init reaps them (after a delay).
            if p.name.isdigit() and _proc_state(int(p.name)):
                try:
                    if f"llmfleet-{self.name}/" in (p / "cgroup").read_text():
                        procs.append(p.name)
                except OSError:
                    pass
        return {
            "netns": re.findall(rf"^({re.escape(self.name)}-node\d+)", netns, re.M),
            "links": re.findall(rf"\d+: ({re.escape(self.name)}-[\w]+)[@:]", links),
            "processes": procs,
            "cgroups": [str(self.cgroup)] if self.cgroup.exists() else [],
            "mounts": [ln for ln in mounts.splitlines() if str(self.state) in ln or f"/{self.name}-node" in ln],
        }


def default_lab() -> Lab:
    return Lab(inventory_dir=PROJECT / "inventory" / "lab")


def _cmd_up(lab: Lab, a: argparse.Namespace) -> int:
    t0 = time.monotonic()
    nodes = lab.up(a.n, wipe_nvme=a.wipe_nvme, fresh=a.fresh)
    inv = lab.inventory_dir or lab.state / "inventory"
    print(f"lab {lab.name}: {len(nodes)} nodes up in {time.monotonic() - t0:.1f}s; inventory {inv}/hosts.yml")
    print(f"  ssh -F {lab.ssh_config} node1")
    return 0


def _cmd_down(lab: Lab, a: argparse.Namespace) -> int:
    lab.down()
    left = {k: v for k, v in lab.leftovers().items() if v}
    if left:
        print(f"lab {lab.name}: leftovers after down: {left}", file=sys.stderr)
        return 1
    print(f"lab {lab.name}: down, nothing left behind")
    return 0


def _cmd_status(lab: Lab, a: argparse.Namespace) -> int:
    st = lab.status()
    if a.json:
        print(json.dumps(st, indent=2))
        return 0
    for s in st:
        print(f"{s['node']:8} {s['ip']:15} pid={s['systemd_pid']} state={s['state']} ssh={'ok' if s['ssh'] else 'no'}")
    if not st:
        print(f"lab {lab.name}: no nodes")
    return 0


def _cmd_info(lab: Lab, a: argparse.Namespace) -> int:
    print(json.dumps({
        "name": lab.name,
        "state": str(lab.state),
        "shared": str(lab.shared),
        "shared_rw": str(lab.shared_rw),
        "ssh_config": str(lab.ssh_config),
        "inventory": str((lab.inventory_dir or lab.state / "inventory") / "hosts.yml"),
    }, indent=2))  # fmt: skip
    return 0


def _cmd_shell(lab: Lab, a: argparse.Namespace) -> int:
    m = re.fullmatch(r"(?:node)?(\d+)", a.node)
    if not m:
        raise LabError(f"node {a.node!r}: give nodeN or N")
    pid = lab.node(int(m.group(1))).systemd_pid()
    if pid is None:
        raise LabError(f"{a.node} is not running (labctl.py status)")
    env = [f"PATH={NODE_PATH}", f"TERM={os.environ.get('TERM', 'xterm')}"]
    return subprocess.call(["nsenter", "-t", str(pid), "-a", "env", "-i", *env, *(a.command or ["/bin/bash", "-l"])])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="labctl.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", default="lab", help="lab name (prefixes netns/links; default: lab)")
    ap.add_argument("--subnet", default="10.77.0", help="first three octets of the lab /24")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="bring nodes 1..N up")
    p_up.add_argument("n", type=int)
    p_up.add_argument("--wipe-nvme", action="store_true", help="empty every node's /mnt/nvme and /mnt/shared-rw")
    p_up.add_argument("--fresh", action="store_true", help="reboot running nodes too (nothing left by earlier runs)")
    p_up.set_defaults(func=_cmd_up)
    sub.add_parser("down", help="stop all nodes and remove every trace").set_defaults(func=_cmd_down)
    p_st = sub.add_parser("status")
    p_st.add_argument("--json", action="store_true")
    p_st.set_defaults(func=_cmd_status)
    sub.add_parser("info", help="paths of the lab (state, shared storage, ssh config) as JSON").set_defaults(
        func=_cmd_info
    )
    p_sh = sub.add_parser("shell", help="a shell or command inside a node")
    p_sh.add_argument("node")
    p_sh.add_argument("command", nargs=argparse.REMAINDER)
    p_sh.set_defaults(func=_cmd_shell)
    a = ap.parse_args(argv)
    try:
        lab = default_lab() if a.name == "lab" else Lab(name=a.name, subnet=a.subnet)
        lab.subnet = a.subnet
        return a.func(lab, a)
    except LabError as e:
        print(f"labctl: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
