#!/usr/bin/env python3
"""Scale model of model staging: wall time and shared-storage read volume for N nodes x S bytes,
for four strategies, under the limits that decide them (shared-storage read bandwidth, per-node
NVMe write, NIC in/out, sha256 rate per node and per copy thread, the reader cap, copy threads):

- naive:     every node copies the whole revision from shared storage (N x S read);
- llmfleet:  what model_stage did until 2026-12-03 (swarm.py / stage.py / transfer.py / roles/model_stage):
             min(N, readers) seed nodes (0020-plan.yml: the first nodes needing the revision) split the
             files by bytes (stage.assign_files, imported here, so the split is the code's); every node
             runs `threads` copy threads over all files largest first (transfer.copy_all); a seed reads its
             own files from shared storage; every other file is fetched, once it is verified and
             journaled at its owner (store and forward per file; StatusBoard polls every 0.5 s), from
             the owning seed (swarm.sources sorts the owner first and it always has the file): a star
             from the seeds, whose NIC egress serves every other node;
- pipelined: the same star, but a peer fetch of a file may start one 16 MiB chunk (transfer.CHUNK)
             behind the owner's read of it (cut-through), never getting ahead of it;
- ideal:     the source read once, relayed through striped trees (every node forwards what it receives
             while receiving: egress about 1 x S per node), a pipeline of `fanout`-ary depth. Since
             2026-12-03 model_stage works this way (swarm.relay_parent: a binary tree per file, rotated by
             file; cut-through; status long polls): this bound is what the code aims at, the fluid
             simulation of the tree as coded is not written yet.

naive/llmfleet/pipelined are a deterministic fluid simulation: flows share every resource by
weighted max-min fairness (progressive filling), re-solved at every event (a file finished, a
waiting thread's file became available, a cut-through fetch caught up with its upstream). Nodes in
the same role move in lock step, so each role is simulated once with a multiplicity. ideal is a
closed-form bound. Not modelled: Ansible orchestration (plan, manifest check, async start, progress
polling, linger), the manifest build, TCP/NFS dynamics, disk caches, failures and fallbacks.

    .venv/bin/python bench/stage_scale.py [--nodes 4 32 128] [--tib 2.3] [--source-gbs 2] [--out F]
    .venv/bin/python bench/stage_scale.py --lab-check   # the model against the lab's measured 4-node run
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmfleet.stage.staging import assign_files  # noqa: E402
from llmfleet.stage.transfer import CHUNK  # noqa: E402

GB = 1e9
GiB = 1024**3
TiB = 1024**4
EPS = 1e-9
BYTE = 1.0  # byte positions closer than this are equal (float sums of terabytes are not exact)
STRATEGIES = ("naive", "llmfleet", "pipelined", "ideal")
# What bounded a flow's rate, as printed.
KINDS = {
    "source": "shared storage read",
    "out": "NIC out (seeds serving peers)",
    "in": "NIC in",
    "nvme": "NVMe write",
    "hash": "sha256 (node)",
    "thread": "sha256 (one copy thread)",
    "upstream": "the owner's read (cut-through)",
}


@dataclass(frozen=True)
class Limits:
    """Bandwidths in bytes/s. Defaults: a real cluster's order of magnitude (2 GB/s shared storage,
    one Gen4 NVMe, 200 Gb/s NIC), sha256 per core from the lab (docs/measurements/bench-stage.md)."""

    nodes: int = 4
    size: float = 2.3 * TiB
    shard: float = 5 * GB  # file size; the last file holds the remainder
    source_bw: float = 2 * GB  # shared storage, aggregate read
    nvme_bw: float = 4 * GB  # per node, write
    nic_bw: float = 25 * GB  # per node, each direction
    core_hash_bw: float = 1.44 * GB  # sha256 of one copy thread (one core)
    hash_bw: float = 0.0  # per node, all threads; 0: threads x core_hash_bw (enough cores)
    threads: int = 4  # model_stage_threads
    readers: int = 2  # model_stage_max_source_readers
    poll_s: float = 0.5  # StatusBoard refresh: a finished file is seen by peers this much later
    storage_via_nic: bool = True  # shared-storage reads cross the reader's NIC in
    fanout: int = 2  # ideal: degree of the relay trees (pipeline depth = ceil(log_fanout N))
    one_host: bool = False  # lab: all nodes share one machine's disk and CPUs (nvme_bw, hash_bw machine-wide)

    def check(self) -> None:
        bad = [
            f"{k}={getattr(self, k)}"
            for k in ("nodes", "size", "shard", "source_bw", "nvme_bw", "nic_bw", "core_hash_bw", "threads", "readers")
            if not getattr(self, k) > 0
        ]
        if bad or self.fanout < 2 or self.hash_bw < 0 or self.poll_s < 0:
            raise ValueError(
                f"stage_scale: limits must be positive (fanout >= 2): {', '.join(bad) or 'fanout/hash_bw/poll_s'}"
            )

    @property
    def node_hash_bw(self) -> float:
        return self.hash_bw or self.threads * self.core_hash_bw

    def files(self) -> list[dict]:
        n = max(1, math.ceil(self.size / self.shard - EPS))
        sizes = [self.shard] * (n - 1) + [self.size - self.shard * (n - 1)]
        return [{"path": f"model-{i + 1:05d}-of-{n:05d}.safetensors", "size": s} for i, s in enumerate(sizes)]


@dataclass
class Result:
    strategy: str
    wall_s: float
    source_bytes: float  # read from shared storage, all nodes
    peer_bytes: float  # received from peers, all nodes
    received: float  # written to NVMe, all nodes (= nodes x size)
    most_bytes_bound_by: str  # the resource that bounded the most bytes (see bottleneck() for the wall time)
    shares: dict[str, float] = field(default_factory=dict)  # bytes bounded by each resource kind
    wait_s: float = 0.0  # thread-seconds (per node of each role, summed) spent waiting for a peer's file


@dataclass
class _Role:
    name: str
    mult: int  # nodes in lock step in this role
    order: list[int]  # file indices, in the order the copy threads take them
    owner: dict[int, str]  # file -> role that reads it from shared storage ("" = this role itself)
    hashes: bool = True  # sha256 while copying (llmfleet); `cp` does not
    nxt: int = 0
    done_at: dict[int, float] = field(default_factory=dict)


@dataclass
class _Flow:
    role: _Role
    f: int
    left: float
    size: float
    src: str  # "" = shared storage, else the serving role's name
    up: _Flow | None = None  # cut-through: the owner's flow of the same file
    rate: float = 0.0
    kind: str = ""

    @property
    def done(self) -> float:
        return self.size - self.left


def _resources(fl: _Flow, lim: Limits) -> list[tuple[str, float]]:
    """(resource, weight) of a flow: a shared resource carries the flow once per node it stands for."""
    r, m = fl.role.name, fl.role.mult
    node = "host" if lim.one_host else r  # lab: one machine's disk and CPUs
    w = m if lim.one_host else 1
    out = [(f"nvme:{node}", w)]
    if fl.role.hashes:
        out += [(f"hash:{node}", w), (f"thread:{id(fl)}", 1)]
    if fl.src:
        out += [(f"in:{r}", 1), (f"out:{fl.src}", m)]
    else:
        out.append(("source:", m))
        if lim.storage_via_nic:
            out.append((f"in:{r}", 1))
    if fl.up is not None and fl.up.left > BYTE and fl.done >= fl.up.done - CHUNK - BYTE:
        out.append((f"upstream:{id(fl)}", 1))  # caught up: no faster than the owner's read
    return out


def _capacity(res: str, lim: Limits, flows: dict[int, _Flow]) -> float:
    kind, _, key = res.partition(":")
    if kind == "upstream":
        return flows[int(key)].up.rate
    return {
        "source": lim.source_bw,
        "out": lim.nic_bw,
        "in": lim.nic_bw,
        "nvme": lim.nvme_bw,
        "hash": lim.node_hash_bw,
        "thread": lim.core_hash_bw,
    }[kind]


def _fill(flows: list[_Flow], lim: Limits) -> None:
    """Weighted max-min fair rates (progressive filling); each flow's kind = the resource that froze it.
    A cut-through flow's cap is its upstream's rate, so then the fill repeats until those settle."""
    by_id = {id(f): f for f in flows}
    for f in flows:
        f.rate = 0.0
    for _ in range(8):
        prev = [f.rate for f in flows]
        uses = {id(f): _resources(f, lim) for f in flows}
        cap = {res: _capacity(res, lim, by_id) for u in uses.values() for res, _ in u}
        load: dict[str, float] = {}
        free = set(by_id)
        level = 0.0
        while free:
            need: dict[str, float] = {}
            for i in free:
                for res, w in uses[i]:
                    need[res] = need.get(res, 0.0) + w
            best, best_res = math.inf, set()
            for res, w in need.items():
                lv = (cap[res] - load.get(res, 0.0)) / w
                if lv < best * (1 - EPS):
                    best, best_res = lv, {res}
                elif lv <= best * (1 + EPS):
                    best_res.add(res)
            level = max(best, level)
            for i in [i for i in free if any(res in best_res for res, _ in uses[i])]:
                f = by_id[i]
                f.rate = level
                f.kind = next(res for res, _ in uses[i] if res in best_res).partition(":")[0]
                for res, w in uses[i]:
                    load[res] = load.get(res, 0.0) + w * level
                free.discard(i)
        if all(f.up is None for f in flows) or all(
            abs(a - f.rate) <= EPS * max(1.0, a) for a, f in zip(prev, flows, strict=True)
        ):
            break


def _roles(strategy: str, lim: Limits, files: list[dict]) -> list[_Role]:
    # copy_all: largest first; sorted() keeps the manifest order among equal sizes
    order = sorted(range(len(files)), key=lambda i: -files[i]["size"])
    if strategy == "naive":
        return [_Role("node", lim.nodes, order, dict.fromkeys(order, ""), hashes=False)]
    seeds = [f"seed{i + 1}" for i in range(min(lim.nodes, lim.readers))]
    by_path = assign_files(files, seeds)
    owner_of = {i: by_path[e["path"]] for i, e in enumerate(files)}
    roles = [_Role(s, 1, order, {i: ("" if o == s else o) for i, o in owner_of.items()}) for s in seeds]
    if lim.nodes > len(seeds):
        roles.append(_Role("peer", lim.nodes - len(seeds), order, owner_of))
    return roles


class _Sim:
    """One run of naive/llmfleet/pipelined: copy threads take files in order; a file starts when its
    source is ready; every event re-solves the rates."""

    def __init__(self, strategy: str, lim: Limits) -> None:
        self.lim = lim
        self.cut = strategy == "pipelined"
        self.files = lim.files()
        self.roles = _roles(strategy, lim, self.files)
        self.by_name = {r.name: r for r in self.roles}
        self.flows: list[_Flow] = []
        self.waiting: list[tuple[_Role, int]] = []  # threads holding a file whose source is not ready
        self.running: dict[tuple[str, int], _Flow] = {}  # (role, file) -> its read from shared storage
        self.t = self.src = self.peer = self.wait_s = 0.0
        self.shares = dict.fromkeys(KINDS, 0.0)
        for r in self.roles:
            for _ in range(min(lim.threads, len(self.files))):
                self.take_next(r)

    def take_next(self, r: _Role) -> None:
        if r.nxt < len(r.order):
            self.waiting.append((r, r.order[r.nxt]))
            r.nxt += 1

    def ready_at(self, r: _Role, f: int) -> float:
        """When a thread of r may start file f (inf: not known yet)."""
        o = r.owner[f]
        if not o or (self.cut and f in self.by_name[o].done_at):
            return self.t
        if f in self.by_name[o].done_at:  # store and forward: seen at the next status poll
            return self.by_name[o].done_at[f] + self.lim.poll_s
        up = self.running.get((o, f))
        if not self.cut or up is None:
            return math.inf
        first = min(CHUNK, up.size) - up.done  # cut-through: one chunk behind the owner's read
        if first <= BYTE:
            return self.t
        return self.t + first / up.rate if up.rate > 0 else math.inf

    def admit(self) -> None:
        still = []
        for r, f in self.waiting:
            if self.ready_at(r, f) <= self.t + EPS:
                o = r.owner[f]
                up = self.running.get((o, f)) if self.cut and o else None
                fl = _Flow(r, f, self.files[f]["size"], self.files[f]["size"], o, up)
                self.flows.append(fl)
                if not o:
                    self.running[(r.name, f)] = fl
            else:
                still.append((r, f))
        self.waiting = still

    def next_dt(self) -> float:
        dt = min((fl.left / fl.rate for fl in self.flows if fl.rate > 0), default=math.inf)
        for r, f in self.waiting:
            dt = min(dt, max(self.ready_at(r, f) - self.t, 0.0))
        for fl in self.flows:  # a cut-through flow catching up with its upstream changes its limits
            up = fl.up
            if up is not None and up.left > BYTE and fl.rate > up.rate * (1 + EPS):
                gap = fl.done - (up.done - CHUNK)
                if gap < -BYTE:
                    dt = min(dt, -gap / (fl.rate - up.rate))
        if math.isinf(dt):
            raise RuntimeError("stage_scale: every thread waits for a file nobody reads (model bug)")
        return dt

    def advance(self, dt: float) -> None:
        self.t += dt
        self.wait_s += dt * len(self.waiting)
        left = []
        for fl in self.flows:
            moved = min(fl.rate * dt, fl.left) * fl.role.mult
            fl.left -= moved / fl.role.mult
            self.shares[fl.kind] += moved
            if fl.src:
                self.peer += moved
            else:
                self.src += moved
            if fl.left > BYTE:
                left.append(fl)
                continue
            fl.left = 0.0
            fl.role.done_at[fl.f] = self.t
            self.running.pop((fl.role.name, fl.f), None)
            self.take_next(fl.role)
        self.flows = left

    def run(self, strategy: str) -> Result:
        while self.flows or self.waiting:
            self.admit()
            if self.flows:
                _fill(self.flows, self.lim)
            self.advance(self.next_dt())
        most = KINDS[max(self.shares, key=self.shares.get)]
        return Result(strategy, self.t, self.src, self.peer, self.src + self.peer, most, self.shares, self.wait_s)


def simulate(strategy: str, lim: Limits) -> Result:
    """Wall time and bytes of one strategy (see the module docstring)."""
    lim.check()
    if strategy == "ideal":
        return ideal(lim)
    if strategy not in STRATEGIES:
        raise ValueError(f"stage_scale: unknown strategy {strategy!r} (one of {', '.join(STRATEGIES)})")
    return _Sim(strategy, lim).run(strategy)


KNOBS = {"source_bw": "shared storage read", "nic_bw": "NIC", "nvme_bw": "NVMe write", "core_hash_bw": "sha256"}


def _scaled(lim: Limits, knob: str, k: float) -> Limits:
    more = {knob: getattr(lim, knob) * k}
    if knob == "core_hash_bw" and lim.hash_bw:
        more["hash_bw"] = lim.hash_bw * k
    return replace(lim, **more)


def bottleneck(strategy: str, lim: Limits, base: Result | None = None) -> tuple[str, float]:
    """What decides the wall time (not the resource that bounded the most bytes) and the fraction of
    the wall time saved with it doubled: the limit whose doubling saves most; when none saves 1 %, the
    limits tied for it (each one, halved, costs over 1 %); when none of those either, "latency" (store
    and forward file by file, or the ideal's pipeline fill)."""
    base = base or simulate(strategy, lim)

    def name(knob: str) -> str:
        if knob != "nic_bw":
            return KNOBS[knob]
        return KINDS["out"] if base.shares.get("out", 0) >= base.shares.get("in", 0) else KINDS["in"]

    gains = {k: 1 - simulate(strategy, _scaled(lim, k, 2)).wall_s / base.wall_s for k in KNOBS}
    best = max(KNOBS, key=lambda k: gains[k])  # ties: the first in KNOBS
    if gains[best] >= 0.01:
        return name(best), gains[best]
    tied = [k for k in KNOBS if simulate(strategy, _scaled(lim, k, 0.5)).wall_s / base.wall_s > 1.01]
    if tied:
        both = _scaled(lim, tied[0], 2)
        for k in tied[1:]:
            both = _scaled(both, k, 2)
        return " + ".join(name(k) for k in tied), 1 - simulate(strategy, both).wall_s / base.wall_s
    return "latency (no bandwidth limit)", gains[best]


def ideal(lim: Limits) -> Result:
    """The source read once at the slowest rate any stage of the relay allows, plus the pipeline's fill:
    one chunk per hop over 1 + ceil(log_fanout N) hops (source, then the relay trees)."""
    n = lim.nodes
    per_node = n if lim.one_host else 1  # lab: the nodes split one machine's disk and CPUs
    rates = {
        "source": lim.source_bw,
        "in": lim.nic_bw,
        "nvme": lim.nvme_bw / per_node,
        "hash": lim.node_hash_bw / per_node,
        "thread": lim.threads * lim.core_hash_bw,
    }
    if lim.storage_via_nic:
        rates["source"] = min(lim.source_bw, min(n, lim.readers) * lim.nic_bw)
    if n > 1:
        rates["out"] = lim.nic_bw * n / (n - 1)  # (N-1) x S leave the nodes, spread evenly over all N
    kind = min(rates, key=rates.get)
    rate = rates[kind]
    hops = 1 + (math.ceil(math.log(n, lim.fanout) - EPS) if n > 1 else 0)
    wall = lim.size / rate + hops * min(CHUNK, lim.size) / rate
    return Result("ideal", wall, lim.size, lim.size * (n - 1), lim.size * n, KINDS[kind], {kind: lim.size * n})


def table(lim: Limits, nodes: list[int]) -> tuple[str, dict[tuple[str, int], Result]]:
    """One markdown table per strategy: wall time, ratio to one node, source bytes, bottleneck."""
    res = {(s, n): simulate(s, replace(lim, nodes=n)) for s in STRATEGIES for n in [1, *nodes]}
    out = []
    for s in STRATEGIES:
        one = res[(s, 1)].wall_s
        out += [
            f"**{s}**\n",
            "| nodes | wall | ratio to 1 node | source read | x revision | bottleneck (wall time with it doubled) |",
            "|---:|---:|---:|---:|---:|---|",
        ]
        for n in nodes:
            r = res[(s, n)]
            name, gain = bottleneck(s, replace(lim, nodes=n), r)
            out.append(
                f"| {n} | {_dur(r.wall_s)} | {r.wall_s / one:.2f}x | {r.source_bytes / TiB:.2f} TiB "
                f"| {r.source_bytes / lim.size:.2f}x | {name} ({-gain:+.0%}) |"
            )
        out.append("")
    return "\n".join(out), res


def _dur(s: float) -> str:
    if s >= 3600:
        return f"{s:,.0f} s ({s / 3600:.2f} h)"
    if s >= 60:
        return f"{s:,.0f} s ({s / 60:.1f} min)"
    return f"{s:.1f} s"


def describe(lim: Limits) -> str:
    hash_cap = f" (node cap {lim.hash_bw / GB:.3g} GB/s)" if lim.hash_bw else ""
    return (
        f"{lim.size / GiB:.4g} GiB in {len(lim.files())} files of {lim.shard / GB:.3g} GB; shared storage "
        f"{lim.source_bw / GB:.3g} GB/s aggregate; per node: NVMe {lim.nvme_bw / GB:.3g} GB/s, NIC "
        f"{lim.nic_bw / GB:.3g} GB/s each way, sha256 {lim.core_hash_bw / GB:.3g} GB/s per thread x {lim.threads} "
        f"threads{hash_cap}; readers (seeds) {lim.readers}; peer poll {lim.poll_s:g} s"
        + ("; all nodes on one host (NVMe and sha256 caps are the machine's)" if lim.one_host else "")
    )


# The lab's 4-node run (docs/measurements/bench-stage.md, 2026-11-29:
# `bench/stage_bench.py --gb 8 --nodes 4 --fleet-gb 1`):
# 1 GiB in 16 shards, max_source_readers 1, 4 threads, all nodes on one 2-CPU machine and one disk.
LAB_MEASURED_S = 25.0  # the model_stage playbook, whole (orchestration included)
LAB_NAIVE_S = 5.0  # 4 x `cp -r` + sync through one `ansible` shell task


def lab_limits(stage_gibs: float, read_gibs: float, hash_gibs: float) -> Limits:
    """The lab as the model sees it: the nodes' NVMe and the shared storage are one disk, sha256 runs on
    the machine's 2 CPUs, the 'NIC' is a veth pair (not a limit here)."""
    return Limits(
        nodes=4,
        size=1 * GiB,
        shard=GiB / 16,
        source_bw=read_gibs * GiB,
        nvme_bw=stage_gibs * GiB,
        nic_bw=100 * GB,
        core_hash_bw=hash_gibs * GiB / 2,
        hash_bw=hash_gibs * GiB,
        threads=4,
        readers=1,
        one_host=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[4, 32, 128])
    ap.add_argument("--tib", type=float, default=2.3, help="revision size in TiB")
    ap.add_argument("--shard-gb", type=float, default=5.0)
    ap.add_argument("--source-gbs", type=float, default=2.0, help="shared storage aggregate read, GB/s")
    ap.add_argument("--nvme-gbs", type=float, default=4.0, help="per-node NVMe write, GB/s")
    ap.add_argument("--nic-gbs", type=float, default=25.0, help="per-node NIC, GB/s each way (25 = 200 Gb/s)")
    ap.add_argument("--hash-gbs", type=float, default=1.44, help="sha256 of one copy thread, GB/s")
    ap.add_argument("--threads", type=int, default=4, help="model_stage_threads")
    ap.add_argument("--readers", type=int, default=2, help="model_stage_max_source_readers")
    ap.add_argument("--lab-check", action="store_true", help="predict the lab's measured 4-node run instead")
    ap.add_argument("--lab-stage-gibs", type=float, default=0.67, help="lab: one node's llmfleet stage GiB/s")
    ap.add_argument("--lab-read-gibs", type=float, default=0.67, help="lab: disk read GiB/s (cold manifest build)")
    ap.add_argument("--lab-hash-gibs", type=float, default=2.69, help="lab: sha256 GiB/s, whole machine")
    ap.add_argument("--out", type=Path, help="also write the markdown here")
    a = ap.parse_args()
    if a.lab_check:
        lim = lab_limits(a.lab_stage_gibs, a.lab_read_gibs, a.lab_hash_gibs)
        rows = []
        for strategy, measured in (("llmfleet", LAB_MEASURED_S), ("naive", LAB_NAIVE_S)):
            r = simulate(strategy, lim)
            name, _ = bottleneck(strategy, lim, r)
            rows.append(
                f"| {strategy} | {r.wall_s:.1f} | {measured:.1f} | {(r.wall_s - measured) / measured:+.0%} "
                f"| {r.source_bytes / lim.size:.2f}x | {name} |"
            )
        text = (
            f"Lab check: {describe(lim)}\n\n"
            "| strategy | model s (transfer only) | lab s (measured) | model error | source read | bottleneck |\n"
            "|---|---:|---:|---:|---:|---|\n" + "\n".join(rows) + "\n"
        )
    else:
        try:
            lim = Limits(
                size=a.tib * TiB,
                shard=a.shard_gb * GB,
                source_bw=a.source_gbs * GB,
                nvme_bw=a.nvme_gbs * GB,
                nic_bw=a.nic_gbs * GB,
                core_hash_bw=a.hash_gbs * GB,
                threads=a.threads,
                readers=a.readers,
            )
            lim.check()
        except ValueError as e:
            raise SystemExit(f"{e}: pass positive --tib/--shard-gb/--*-gbs/--threads/--readers") from None
        body, _ = table(lim, a.nodes)
        cmd = " ".join(["bench/stage_scale.py", *sys.argv[1:]])
        day = time.strftime("%Y-%m-%d", time.gmtime())
        text = f"Command: `.venv/bin/python {cmd}` ({day})\n\nLimits: {describe(lim)}.\n\n{body}"
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
