#!/usr/bin/env python3
"""Benchmarks for model staging, each measured side by side with the obvious alternative:

1. one node, N GB in 20 shards: llmfleet stage (sha256 in the same pass, fdatasync) vs `cp -r` vs
   `rsync -a` vs what a person does by hand with the same parallelism: `xargs -P N cp` of the shards,
   then `xargs -P N sha256sum` (or OpenSSL's sha256 on every core: the best by hand) of the copies
   compared with the manifest (every row ends with `sync`, so the data is on disk); llmfleet with the
   manifest cached, and a revision's first run without one (the cold path): the manifest built from
   the copy itself (one read, as `llmfleet stage` without --manifest) and built first (two reads);
   one line gives both ratios to the best by hand (--goal-only: only the rows those need);
2. re-stage of an unchanged 200-shard revision: wall time and bytes copied;
3. 4 lab nodes: bytes read from shared storage (model_stage fan-out vs 4 independent copies)
   and total time of both.

    .venv/bin/python bench/stage_bench.py [--gb 8] [--threads 4] [--repeat 1] [--nodes 4] [--fleet-gb 1]
        [--goal-only] [--skip single restage fleet] [--out docs/measurements/bench-stage.md]

Page cache is dropped before every copy (root only) so each starts from a cold source.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmfleet.stage import checkpoint  # noqa: E402
from llmfleet.stage import staging as stage  # noqa: E402
from llmfleet.stage.manifest import build_manifest  # noqa: E402
from tests.helpers.ckpt import write_raw  # noqa: E402
from tests.lab.labctl import Lab  # noqa: E402

WORK = Path(os.environ.get("LLMFLEET_BENCH_DIR", "/var/tmp/llmfleet-bench"))
BIN = Path(sys.executable).parent
GiB = 1024**3
REV = "b" * 40
# The fleet's staging of the lab's revision on shared storage, as stage_bench and stage_fanout run it.
FLEET_STAGE_VARS = {
    "llmfleet_model": "fleet",
    "llmfleet_model_revision": REV,
    "model_stage_source": "/mnt/shared/fleet",
    "model_stage_shared_rw_dir": "/mnt/shared-rw/llmfleet",
    "model_stage_max_source_readers": 1,
    "model_stage_free_space_margin_gb": 0,
    "llmfleet_report_dir": str(WORK),
}


def busy_cpu_s() -> float:
    """The whole machine's busy CPU-seconds so far (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat", encoding="ascii") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        print("note: cannot drop page cache (not root?): copies may read from cache", file=sys.stderr)


def make_revision(d: Path, total_bytes: int, shards: int) -> Path:
    """A valid safetensors checkpoint of about total_bytes (pseudo-random data, no dedup)."""
    if (d / "config.json").exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    block = os.urandom(64 * 2**20)
    per = total_bytes // shards
    rows = max(1, per // (4096 * 2))
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        n = rows * 4096 * 2
        header = {f"layers.{s}.w": {"dtype": "F16", "shape": [rows, 4096], "data_offsets": [0, n]}}
        path = d / name
        write_raw(path, header, b"")
        with open(path, "ab") as f:
            left = n
            while left:
                k = min(left, len(block))
                f.write(block[:k])
                left -= k
            block = block[1:] + block[:1]  # shards differ from each other
        weight_map[f"layers.{s}.w"] = name
    (d / checkpoint.INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    (d / "config.json").write_text("{}")
    (d / "tokenizer.json").write_text("{}")
    return d


def timed(fn) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def sh(*argv: str) -> None:
    subprocess.run(list(argv), check=True)


def par_cp(src: Path, dst: Path, n: int) -> None:
    """By hand: one `cp` per shard, n at a time, then `sync`."""
    dst.mkdir(parents=True)
    names = "\0".join(sorted(f.name for f in src.iterdir())) + "\0"
    subprocess.run(
        ["xargs", "-0", "-P", str(n), "-I{}", "cp", "--reflink=never", f"{src}/{{}}", f"{dst}/"],
        input=names.encode(), check=True,
    )  # fmt: skip
    sh("sync")


HASHERS = {
    # coreutils' sha256sum may lack SHA-NI (here: 0.2 GB/s per core, OpenSSL 1 GB/s): a person who knows
    # uses openssl, so both are rows.
    "sha256sum": (["sha256sum"], re.compile(r"^([0-9a-f]{64}) [ *](.+)$")),
    "openssl": (["openssl", "dgst", "-sha256"], re.compile(r"^SHA2?-?256\((.+)\)= ([0-9a-f]{64})$")),
}


def par_sha256(d: Path, n: int, manifest: dict, tool: str = "sha256sum") -> None:
    """By hand: a sha256 of every copied file, n at a time, compared with the manifest."""
    argv, pattern = HASHERS[tool]
    names = "\0".join(sorted(f.name for f in d.iterdir())) + "\0"
    out = subprocess.run(
        ["xargs", "-0", "-P", str(n), "-n", "1", *argv], cwd=d, input=names,
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    got = {}
    for line in out.splitlines():
        m = pattern.match(line)
        if m:
            digest, name = m.groups() if tool == "sha256sum" else m.groups()[::-1]
            got[name] = digest
    want = {e["path"]: e["sha256"] for e in manifest["files"]}
    if got != want:
        raise SystemExit(f"{tool} of the copies in {d} does not match the manifest: the bench copy is broken")


def bench_single(
    gb: float, threads: int, repeat: int = 1, shards: int = 20, hashers: int = 0, *, goal_only: bool = False
) -> tuple[str, dict]:
    src = make_revision(WORK / f"src-{gb:g}g-{shards}", int(gb * GiB), shards)
    hashers = hashers or os.cpu_count() or 1
    size = sum(f.stat().st_size for f in src.iterdir())
    manifest = build_manifest(str(src), threads=threads, revision=REV)

    def llmfleet(d: Path, m: dict) -> None:
        stage.stage(
            stage.StageRequest(root=str(d), model="m", revision=REV, manifest=m, threads=threads),
            lambda rel: [stage.LocalSource(str(src))],
        )

    def cold(d: Path) -> None:
        # A first run without a cached manifest: build it (reads the source once), then stage
        # (reads it again, from page cache where it fits, as on a real node).
        llmfleet(d, build_manifest(str(src), threads=threads, revision=REV))

    def one_pass(d: Path) -> None:
        # The same first run as `llmfleet stage` without --manifest does it: the manifest is built
        # from the copy itself (one read; each source file checked unchanged under its copy).
        stage.stage(
            stage.StageRequest(
                root=str(d), model="m", revision=REV, manifest=stage.sizes_manifest(str(src), REV),
                threads=threads, build_from=str(src),
            ),
            lambda rel: [stage.LocalSource(str(src))],
        )  # fmt: skip

    t = str(threads)
    # The issue's yardstick: parallel cp, OpenSSL's sha256 (not coreutils', 3x slower here) on every core, sync.
    best = f"xargs -P {t} cp + sync, then xargs -P {hashers} openssl dgst -sha256 vs manifest (best by hand)"
    staged = "llmfleet stage, manifest cached (sha256, fdatasync, verify, publish)"
    cold_one = "llmfleet stage, no manifest: built from the copy (cold, one read)"
    cold_two = "llmfleet stage, manifest built first (cold, two reads)"
    methods = (
        ("cp -r + sync", "1 process", lambda d: (sh("cp", "-r", "--reflink=never", str(src), str(d)), sh("sync"))),
        ("rsync -a + sync", "1 process", lambda d: (sh("rsync", "-a", f"{src}/", f"{d}/"), sh("sync"))),
        (f"xargs -P {t} cp + sync", f"{t} processes", lambda d: par_cp(src, d, threads)),
        (
            f"xargs -P {t} cp + sync, then xargs -P {t} sha256sum vs manifest",
            f"{t} + {t} processes",
            lambda d: (par_cp(src, d, threads), par_sha256(d, threads, manifest)),
        ),
        (
            f"xargs -P {t} cp + sync, then xargs -P {t} openssl dgst -sha256 vs manifest",
            f"{t} + {t} processes",
            lambda d: (par_cp(src, d, threads), par_sha256(d, threads, manifest, "openssl")),
        ),
        (
            best,
            f"{t} + {hashers} processes",
            lambda d: (par_cp(src, d, threads), par_sha256(d, hashers, manifest, "openssl")),
        ),
        (
            staged,
            f"{t} threads",
            lambda d: llmfleet(d, manifest),
        ),
        (
            "manifest build alone (read + sha256 of the source)",
            f"{t} threads",
            lambda d: build_manifest(str(src), threads=threads),
        ),
        (cold_one, f"{t} threads", one_pass),
        (cold_two, f"{t} threads (build, then copy)", cold),
    )
    if goal_only:  # the rows the goal line needs (8 GiB rows take minutes each on 2 cores)
        methods = tuple(m for m in methods if m[0] in (best, staged, cold_one, cold_two))
    runs: dict[str, list[float]] = {name: [] for name, _, _ in methods}
    # Interleaved (every method once per round): load from other work on the machine hits all alike.
    for _ in range(repeat):
        for name, _, fn in methods:
            dst = WORK / "dst"
            shutil.rmtree(dst, ignore_errors=True)
            drop_caches()
            runs[name].append(timed(lambda fn=fn, dst=dst: fn(dst)))
            shutil.rmtree(dst, ignore_errors=True)
    rows = {name: statistics.median(v) for name, v in runs.items()}
    cp = rows.get("cp -r + sync", rows[best])
    yardstick = "cp -r" if "cp -r + sync" in rows else "best by hand"
    lines = [
        f"Revision: {size / GiB:.2f} GiB in {shards} shards; page cache dropped before each run; wall s = median of "
        f"{repeat} interleaved runs (min-max beside it).\n",
        f"| method | parallelism | wall s | min-max s | GiB/s | ratio to {yardstick} |",
        "|---|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {name} | {par} | {rows[name]:.2f} | {min(runs[name]):.1f}-{max(runs[name]):.1f} "
        f"| {size / GiB / rows[name]:.2f} | {rows[name] / cp:.2f}x |"
        for name, par, _ in methods
    ]
    lines.append(
        f"\n**llmfleet stage / best by hand ({best.split(' (', maxsplit=1)[0]}): manifest cached "
        f"{rows[staged] / rows[best]:.2f}x (goal <= 1.00x); cold, manifest built from the copy "
        f"{rows[cold_one] / rows[best]:.2f}x (built first: {rows[cold_two] / rows[best]:.2f}x)**"
    )
    return "\n".join(lines), {"size": size, **rows}


def bench_restage() -> tuple[str, dict]:
    src = make_revision(WORK / "src-200", 200 * 2**20, 200)
    manifest = build_manifest(str(src), revision=REV)
    dst = WORK / "dst-200"
    shutil.rmtree(dst, ignore_errors=True)
    req = stage.StageRequest(root=str(dst), model="m", revision=REV, manifest=manifest)
    stage.stage(req, lambda rel: [stage.LocalSource(str(src))])
    t0 = time.monotonic()
    r = stage.stage(req, lambda rel: [stage.LocalSource(str(src))])
    dt = time.monotonic() - t0
    t0 = time.monotonic()
    rd = stage.stage(
        stage.StageRequest(**{**req.__dict__, "deep_verify": True}), lambda rel: [stage.LocalSource(str(src))]
    )
    deep = time.monotonic() - t0
    shutil.rmtree(dst, ignore_errors=True)
    text = (
        "| re-stage of an unchanged 200-shard revision | wall s | bytes copied | changed |\n|---|---:|---:|---|\n"
        f"| size + mtime check (default) | {dt:.3f} | {r['bytes_copied']} | {r['changed']} |\n"
        f"| deep_verify (sha256 of 200 MiB) | {deep:.3f} | {rd['bytes_copied']} | {rd['changed']} |"
    )
    return text, {"restage_s": dt, "bytes": r["bytes_copied"]}


def bench_fleet(nodes: int, gb: float) -> tuple[str, dict]:
    lab = Lab(name="sb", subnet="10.81.0")
    lab.down()
    lab.up(nodes, wipe_nvme=True)
    try:
        src = make_revision(lab.shared / "fleet", int(gb * GiB), 16)
        size = sum(f.stat().st_size for f in src.iterdir())
        inv = str(lab.state / "inventory")
        env = dict(
            os.environ,
            ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
            ANSIBLE_INVENTORY=str(ROOT / "inventory" / "lab"),
            PATH=f"{BIN}:{os.environ['PATH']}",
        )
        base = [
            # As a site runs it: the operator account, root through sudo (the lab nodes have `ops`).
            "-i", inv, "-e", "ansible_user=ops", "-e", "ansible_become=true",
            "-e", "ansible_python_interpreter=/usr/bin/python3",
        ]  # fmt: skip
        ev = dict(FLEET_STAGE_VARS)
        # manifest first (cached on shared storage; later runs reuse it), so the timed run is the copy
        margs = {
            "source": "/mnt/shared/fleet",
            "model": "fleet",
            "revision": REV,
            "cache_dir": "/mnt/shared-rw/llmfleet",
            "lease_dir": "/mnt/shared-rw/llmfleet/leases",
        }
        out = subprocess.run(
            [str(BIN / "ansible"), "node1", *base, "-o", "-m", "llmfleet.fleet.llmfleet_model_manifest",
             "-a", json.dumps(margs)],
            cwd=ROOT, env=env, check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        manifest_path = json.loads(out.split("=>", 1)[1])["manifest_path"]

        def wipe() -> None:
            for i in range(1, nodes + 1):
                lab.node(i).nsenter("rm", "-rf", "/mnt/nvme/models", "/mnt/nvme/naive", check=True)
            drop_caches()

        def staged(limit: list[str]) -> tuple[float, float, dict]:
            wipe()
            c0, t0 = busy_cpu_s(), time.monotonic()
            subprocess.run(
                [str(BIN / "ansible-playbook"), *base, *limit, "-e", json.dumps(ev), "playbooks/model_stage.yml"],
                cwd=ROOT, env=env, check=True, capture_output=True,
            )  # fmt: skip
            wall, cpu = time.monotonic() - t0, busy_cpu_s() - c0
            return wall, cpu, json.loads((WORK / "stage-fleet.json").read_text())["nodes"]

        one, one_cpu, _ = staged(["--limit", "node1"])  # the same playbook, one node staging alone
        fan, fan_cpu, res = staged([])
        # The lab's floor for the same work: every node stages alone from shared storage at once (the same
        # module, hashing and fsync, no peers; the nodes share one machine, so this is 4x one node's work)
        wipe()
        alone = {
            "source": "/mnt/shared/fleet", "manifest_path": manifest_path, "model": "fleet", "revision": REV,
            "lease_dir": "/mnt/shared-rw/llmfleet/leases", "max_source_readers": nodes,
            "me": "{{ inventory_hostname }}", "free_space_margin_bytes": 0,
        }  # fmt: skip
        c0, t0 = busy_cpu_s(), time.monotonic()
        subprocess.run(
            [str(BIN / "ansible"), "llmfleet_nodes", *base, "-f", str(nodes),
             "-m", "llmfleet.fleet.llmfleet_model_stage", "-a", json.dumps(alone)],
            cwd=ROOT, env=env, check=True, capture_output=True,
        )  # fmt: skip
        every, every_cpu = time.monotonic() - t0, busy_cpu_s() - c0
        src_read = sum(r["source_bytes_read"] for r in res.values())
        served = {h: r["served_bytes"] for h, r in res.items()}
        wipe()
        c0, t0 = busy_cpu_s(), time.monotonic()
        subprocess.run(
            [str(BIN / "ansible"), "llmfleet_nodes", *base, "-m", "ansible.builtin.shell", "-a",
             "mkdir -p /mnt/nvme/naive && cp -r /mnt/shared/fleet /mnt/nvme/naive/ && sync"],
            cwd=ROOT, env=env, check=True, capture_output=True,
        )  # fmt: skip
        naive_cpu = busy_cpu_s() - c0
        naive = time.monotonic() - t0
    finally:
        lab.down()
    cpus = os.cpu_count() or 1
    text = (
        f"Revision: {size / GiB:.2f} GiB in 16 shards, {nodes} lab nodes (one machine: the nodes share its disk and "
        f"{cpus} CPUs, so {nodes} nodes do {nodes}x one node's hashing and writing on the same cores and disk; bytes "
        "read are exact). Busy CPU = the whole machine's busy CPU-seconds during the run (/proc/stat), "
        f"out of {cpus} x wall.\n\n"
        "| method | bytes read from shared storage | x revision | wall s | x one node | busy CPU s |\n"
        "|---|---:|---:|---:|---:|---:|\n"
        f"| llmfleet model_stage, node1 alone (`--limit node1`) | {size} | 1.00x | {one:.1f} | 1.00x "
        f"| {one_cpu:.0f} |\n"
        "| llmfleet model_stage (1 seed, relay tree, cut-through, sha256 everywhere) "
        f"| {src_read} | {src_read / size:.2f}x | {fan:.1f} | {fan / one:.2f}x | {fan_cpu:.0f} |\n"
        f"| every node stages alone from shared storage at once (`ansible -m llmfleet_model_stage`, no peers) "
        f"| {nodes * size} | {nodes:.2f}x | {every:.1f} | {every / one:.2f}x | {every_cpu:.0f} |\n"
        f"| {nodes} independent `cp -r` + sync | {nodes * size} | {nodes:.2f}x | {naive:.1f} | {naive / one:.2f}x "
        f"| {naive_cpu:.0f} |\n\n"
        "Bytes each node passed on to others: "
        + ", ".join(f"{h} {b / GiB:.2f} GiB" for h, b in sorted(served.items()))
        + "; CPU seconds of each node's staging process: "
        + ", ".join(f"{h} {r.get('cpu_s', 0):.1f}" for h, r in sorted(res.items()))
        + "."
    )
    return text, {"src_read": src_read, "size": size, "fan_s": fan, "one_s": one, "naive_s": naive, "served": served,
                  "every_s": every,
            "cpu_s": {"one": one_cpu, "fan": fan_cpu, "every": every_cpu, "naive": naive_cpu}}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=8.0, help="single-node revision size in GiB (issue goal: 8)")
    ap.add_argument("--threads", type=int, default=4, help="llmfleet copy threads = xargs -P of the by-hand rows")
    ap.add_argument("--repeat", type=int, default=1, help="one-node rows: runs each (median reported)")
    ap.add_argument("--shards", type=int, default=20, help="one-node revision: shards (the issue's figures: 8)")
    ap.add_argument("--hashers", type=int, default=0, help="openssl processes of the best by-hand row (0: cores)")
    ap.add_argument("--goal-only", action="store_true", help="one-node rows: only the best by hand and llmfleet's")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--fleet-gb", type=float, default=1.0)
    ap.add_argument("--skip", nargs="*", default=[], choices=["single", "restage", "fleet"])
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    parts = []
    if "single" not in a.skip:
        parts.append(
            (
                "One node: stage vs cp vs rsync vs parallel cp + sha256sum",
                bench_single(a.gb, a.threads, a.repeat, a.shards, a.hashers, goal_only=a.goal_only)[0],
            )
        )
    if "restage" not in a.skip:
        parts.append(("Re-stage of an unchanged revision", bench_restage()[0]))
    if "fleet" not in a.skip:
        parts.append(
            (f"{a.nodes} nodes: shared-storage reads, wall time against one node", bench_fleet(a.nodes, a.fleet_gb)[0])
        )
    cmd = " ".join(["bench/stage_bench.py", *sys.argv[1:]])
    day = time.strftime("%Y-%m-%d", time.gmtime())
    text = f"## Model staging\n\nCommand: `.venv/bin/python {cmd}` ({day}, {os.cpu_count()} CPUs)\n"
    for title, body in parts:
        text += f"\n### {title}\n\n{body}\n"
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
