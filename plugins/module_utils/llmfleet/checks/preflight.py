"""Preflight: measure each node (GPU, driver, CUDA, NCCL, HCAs, limits, disk, clock, names) and
judge the fleet: every check is pass / warn / fail with the measured value per node, and the
node that differs is named. Measuring runs on nodes (stdlib only); judging runs anywhere.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import time
from collections import Counter
from typing import Any

from ..engine_env import EngineEnvError, describe, popen_kwargs, resolve, unsafe_paths, venv_root
from ..net import connect_state
from ..nodeinfo import nvidia_gpus
from .topology import hcas_from_sysfs

PASS, WARN, FAIL = "pass", "warn", "fail"
ORDER = {PASS: 0, WARN: 1, FAIL: 2}


def _run(argv: list[str], timeout: float = 30, kw: dict | None = None) -> tuple[int, str]:
    """(exit status, output); kw: subprocess arguments (engine_env.popen_kwargs for the engine's own Python)."""
    if not shutil.which(argv[0]):
        return 127, ""
    kw = kw or {"env": dict(os.environ)}
    kw["env"] = {**kw["env"], "LC_ALL": "C"}
    try:
        cp = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kw)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 124, str(e)
    return cp.returncode, cp.stdout + (cp.stderr if cp.returncode else "")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def nvswitch_count(sys_root: str = "/sys") -> int:
    base = os.path.join(sys_root, "bus/pci/devices")
    n = 0
    for bdf in os.listdir(base) if os.path.isdir(base) else []:
        vendor = _read(os.path.join(base, bdf, "vendor")) or ""
        cls = _read(os.path.join(base, bdf, "class")) or ""
        n += vendor.strip() == "0x10de" and cls.strip().startswith("0x0680")
    return n


def parse_driver_version(text: str | None) -> str | None:
    """From /proc/driver/nvidia/version: 'NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04 ...'."""
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9]+\.[0-9]+(?:\.[0-9]+)?)", text or "")
    return m.group(1) if m else None


GPU_QUERY = (
    "name,driver_version,persistence_mode,mig.mode.current,ecc.errors.uncorrected.volatile.total,retired_pages.pending,"
    # Ampere and later (A100, H100, H200) remap rows instead of retiring pages: retired_pages.pending is [N/A] there.
    "remapped_rows.pending,remapped_rows.failure"
)


def parse_gpu_query(text: str) -> list[dict[str, str]]:
    keys = GPU_QUERY.split(",")
    return [dict(zip(keys, [c.strip() for c in line.split(",")])) for line in text.splitlines() if line.strip()]


def clock_offset_s(chrony: str | None, timesync: str | None) -> float | None:
    """Offset from `chronyc tracking` ('System time : 0.000012 seconds fast of NTP time') or
    `timedatectl timesync-status` ('Offset: +1.234ms')."""
    m = re.search(r"System time\s*:\s*([0-9.]+) seconds (fast|slow)", chrony or "")
    if m:
        return float(m.group(1)) * (1 if m.group(2) == "fast" else -1)
    m = re.search(r"Offset:\s*([+-]?[0-9.]+)(us|ms|s)\b", timesync or "")
    if m:
        return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]
    return None


def libcuda_state(ldconfig_text: str | None, exists: Any = os.path.exists) -> dict[str, Any] | None:
    """Where the dynamic linker's cache (`ldconfig -p`) has the CUDA driver library, and whether each of those
    directories also has the unversioned `libcuda.so`: Triton (vLLM/SGLang kernels, CUDA graphs through
    torch.compile) links its launchers with `-L<those dirs> -lcuda`, which needs it; the driver packages
    install only `libcuda.so.1`. A `.../stubs/libcuda.so` in the cache is the toolkit's link-time stub, which
    makes every CUDA call fail at run time. None when ldconfig could not be read."""
    if ldconfig_text is None:
        return None
    libs = []
    for line in ldconfig_text.splitlines():
        # "\tlibcuda.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libcuda.so.1"
        m = re.match(r"\s*(libcuda\.so(?:\.\d+)*)\s+\(([^)]*)\)\s+=>\s+(\S+)", line)
        if m and ("x86-64" in m.group(2) or "AArch64" in m.group(2)):  # not the 32-bit (libc6) entries
            libs.append((m.group(1), m.group(3)))
    dirs = sorted({os.path.dirname(p) for n, p in libs if n != "libcuda.so" and "/stubs/" not in p})
    return {
        "dirs": dirs,
        "missing_unversioned": [d for d in dirs if not exists(os.path.join(d, "libcuda.so"))],
        "stubs": sorted(p for _, p in libs if "/stubs/" in p),
    }


def _ldconfig_cache() -> str | None:
    rc, out = _run([shutil.which("ldconfig") or "/sbin/ldconfig", "-p"])
    return out if rc == 0 else None


def measure(
    *,
    sys_root: str = "/sys",
    driver_version_file: str = "/proc/driver/nvidia/version",
    nvme_path: str = "/mnt/nvme",
    peers: dict[str, str] | None = None,
    engine_python: str | None = None,
    clock_source: str | None = None,
    engine_env: str | None = None,
    engine_user: str | None = None,
) -> dict[str, Any]:
    """What preflight needs to know about this node. Missing tools give None, not errors. engine_python's torch
    reports its NCCL as engine_user; engine_env (the engine's Python or command) is checked for writers."""
    m: dict[str, Any] = {"hostname": socket.gethostname()}
    gpus_pci = nvidia_gpus(sys_root)
    rc, out = _run(["nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"])
    q = parse_gpu_query(out) if rc == 0 else []
    m["gpu_count"] = len(q) if q else len(gpus_pci)
    m["gpu_models"] = sorted({g["name"] for g in q}) or None
    m["driver_version"] = (q[0]["driver_version"] if q else None) or parse_driver_version(_read(driver_version_file))
    m["persistence_mode"] = sorted({g["persistence_mode"] for g in q}) or None
    m["mig_mode"] = sorted({g["mig.mode.current"] for g in q}) or None
    ecc = [g["ecc.errors.uncorrected.volatile.total"] for g in q]
    m["ecc_uncorrected"] = sum(int(x) for x in ecc if x.isdigit()) if q else None
    m["retired_pages_pending"] = any(g["retired_pages.pending"].lower() == "yes" for g in q) if q else None
    m["remapped_rows_pending"] = any(g.get("remapped_rows.pending", "").lower() == "yes" for g in q) if q else None
    m["row_remap_failure"] = any(g.get("remapped_rows.failure", "").lower() == "yes" for g in q) if q else None
    rc, out = _run(["nvidia-smi"])
    cm = re.search(r"CUDA Version:\s*([0-9.]+)", out) if rc == 0 else None
    m["cuda_version"] = cm.group(1) if cm else None
    # NVSwitch systems (HGX 8-GPU) need nvidia-fabricmanager running; NVSwitches are NVIDIA PCI bridges.
    m["nvswitch"] = nvswitch_count(sys_root) > 0
    rc, out = _run(["systemctl", "is-active", "nvidia-fabricmanager"])
    m["fabricmanager_active"] = out.strip() == "active"
    m["peermem_loaded"] = bool(re.search(r"^(nvidia_peermem|nv_peer_mem) ", _read("/proc/modules") or "", re.M))
    m["libcuda"] = libcuda_state(_ldconfig_cache())
    hcas = hcas_from_sysfs(sys_root)
    ports = [p for h in hcas for p in h["ports"].values() if p["state"] == "ACTIVE"]
    m["hca_active_ports"] = len(ports)
    m["hca_link_layers"] = sorted({p["link_layer"] for p in ports})
    m["hca_rates"] = sorted({p["rate"] for p in ports})
    rc, out = _run(["systemctl", "show", "--property=DefaultLimitMEMLOCK", "--value"])
    m["default_memlock"] = out.strip() if rc == 0 else None
    with contextlib.suppress(OSError):
        st = os.statvfs(nvme_path)
        m["nvme_free_bytes"] = st.f_bavail * st.f_frsize
    m.setdefault("nvme_free_bytes", None)
    if clock_source:  # a file with chronyc/timedatectl output (tests, or a site's own probe)
        text = _read(clock_source)
        m["clock_offset_s"] = clock_offset_s(text, text)
    else:
        _, chrony = _run(["chronyc", "tracking"])
        _, ts = _run(["timedatectl", "timesync-status"])
        m["clock_offset_s"] = clock_offset_s(chrony, ts)
    m["clock_epoch"] = time.time()
    resolved = {}
    for name in sorted(peers or {}):
        try:
            resolved[name] = sorted({ai[4][0] for ai in socket.getaddrinfo(name, None, socket.AF_INET)})
        except OSError:
            resolved[name] = []
    m["resolves"] = resolved
    m["nccl_version"] = engine_nccl(engine_python, engine_user) if engine_python else None
    m["engine_env"] = engine_env_writers(engine_env, engine_user) if engine_env else None
    return m


def engine_nccl(engine_python: str, engine_user: str | None) -> str:
    """torch's NCCL version as the engine's Python reports it, run as the engine's account; "error: ..." else."""
    try:
        kw = popen_kwargs(engine_python, engine_user, what="the engine's Python")
    except EngineEnvError as e:
        rc, out = 1, str(e)
    else:
        code = "import torch; print('.'.join(map(str, torch.cuda.nccl.version())))"
        rc, out = _run([engine_python, "-c", code], timeout=120, kw=kw)
    return out.strip().splitlines()[-1] if rc == 0 and out.strip() else f"error: {out.strip()[-200:]}"


def engine_env_writers(command: str, engine_user: str | None = None) -> dict[str, Any]:
    """Who besides root can change what the engine's Python or command executes (engine_env.unsafe_paths):
    "others" (any account but root and the engine's), "engine" (the engine's account only)."""
    exe = resolve(command)
    if not exe:
        return {"path": command, "missing": True, "others": [], "engine": []}
    uid = None
    if engine_user:
        import pwd

        with contextlib.suppress(KeyError):
            uid = pwd.getpwnam(engine_user).pw_uid
    others = unsafe_paths(exe, (0,) if uid is None else (0, uid))
    bad = {f["path"] for f in others}
    engine = [f for f in unsafe_paths(exe) if f["path"] not in bad] if uid is not None else []
    return {"path": exe, "root": venv_root(exe), "others": others, "engine": engine}


def probe_ports(
    targets: dict[str, str], ports: list[int], timeout: float = 3.0, refused_grace: float = 5.0
) -> dict[str, dict[str, str]]:
    """{node: {port: 'open' | 'refused' | 'timeout' | error}} by TCP connect to each node's fabric IP.
    'refused' is retried for refused_grace seconds: peers' listeners start at about the same time."""
    out: dict[str, dict[str, str]] = {}
    for node, ip in sorted(targets.items()):
        out[node] = {}
        for port in ports:
            end = time.monotonic() + refused_grace
            state = connect_state(ip, port, timeout)
            while state == "refused" and time.monotonic() < end:
                time.sleep(0.25)
                state = connect_state(ip, port, timeout)
            out[node][str(port)] = state
    return out


# ---- judging ----------------------------------------------------------------------------------


def _row(check: str, node: str, value: Any, status: str, message: str = "") -> dict[str, Any]:
    return {"check": check, "node": node, "value": value, "status": status, "message": message}


def _consistent(check: str, values: dict[str, Any], *, missing: str = FAIL, why: str = "") -> list[dict[str, Any]]:
    """Every node must report the same value; the minority is named."""
    present = {n: v for n, v in values.items() if v not in (None, [], "")}
    rows = []
    if not present:
        return [_row(check, n, None, missing, f"not measurable{why}") for n in sorted(values)]
    common, _ = Counter(repr(v) for v in present.values()).most_common(1)[0]
    for n in sorted(values):
        v = values[n]
        if v in (None, [], ""):
            rows.append(_row(check, n, v, missing, f"not measurable{why}"))
        elif repr(v) != common:
            rows.append(_row(check, n, v, FAIL, f"differs from the other nodes ({common})"))
        else:
            rows.append(_row(check, n, v, PASS))
    return rows


FIX = {
    "persistence_mode": "enable it (nvidia-smi -pm 1 or nvidia-persistenced) to avoid slow first CUDA init",
    "mig_disabled": "MIG is enabled: disable it (nvidia-smi -mig 0) for tensor-parallel engines",
    "ecc": "uncorrectable ECC errors, pending page retirement or row remapping (a GPU reset applies it), or a failed "
    "row remap (replace the GPU): drain the node and reset or replace the GPU",
    "fabricmanager": "NVSwitch present but nvidia-fabricmanager is not active: CUDA init will fail",
    "nvidia_peermem": "GPUDirect RDMA expected: modprobe nvidia_peermem",
    "memlock_units": "DefaultLimitMEMLOCK is limited: units need LimitMEMLOCK=infinity (the engine role sets it)",
    "nvme_free": "free space on the NVMe staging root for the model revision + margin",
    "libcuda": "Triton/CUDA-graph kernels link with -lcuda and fail at the first new shape without it",
}


def _libcuda_row(n: str, m: dict[str, Any]) -> list[dict[str, Any]]:
    """Judged where the node has GPUs (or the cache has the driver library): no driver library, a missing
    unversioned link, or a stub in the linker cache fail."""
    lc = m.get("libcuda")
    if lc is None or not (m.get("gpu_count") or lc["dirs"]):
        return []
    if lc["stubs"]:
        fix = (
            f"{', '.join(lc['stubs'])} is in the linker cache: remove the CUDA stubs directory from "
            "/etc/ld.so.conf.d and run ldconfig"
        )
    elif not lc["dirs"]:
        fix = (
            "libcuda.so.1 is not in the linker cache (ldconfig -p): install the NVIDIA driver's user-space "
            "libraries and run ldconfig"
        )
    elif lc["missing_unversioned"]:
        d = lc["missing_unversioned"][0]
        fix = f"no unversioned libcuda.so in {d}: ln -s libcuda.so.1 {d}/libcuda.so && ldconfig"
    else:
        return [_row("libcuda", n, lc["dirs"], PASS)]
    return [_row("libcuda", n, lc, FAIL, f"{fix} ({FIX['libcuda']})")]


def _node_checks(n: str, m: dict[str, Any], cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-node checks judged on that node's own values: (check, applies, value, ok, warn_only)."""
    need = cfg.get("min_free_bytes", 0)
    free = m.get("nvme_free_bytes")
    checks = [
        ("persistence_mode", bool(m.get("persistence_mode")), m.get("persistence_mode"),
         m.get("persistence_mode") == ["Enabled"], True),
        ("mig_disabled", bool(m.get("mig_mode")), m.get("mig_mode"),
         all(x in ("Disabled", "[N/A]", "N/A") for x in m.get("mig_mode") or []), False),
        ("ecc", m.get("ecc_uncorrected") is not None,
         {"uncorrected": m.get("ecc_uncorrected"), "retired_pages_pending": m.get("retired_pages_pending"),
          "remapped_rows_pending": m.get("remapped_rows_pending"), "row_remap_failure": m.get("row_remap_failure")},
         m.get("ecc_uncorrected") == 0 and not any(m.get(k) for k in (
             "retired_pages_pending", "remapped_rows_pending", "row_remap_failure")), False),
        ("fabricmanager", bool(m.get("nvswitch")), m.get("fabricmanager_active"),
         bool(m.get("fabricmanager_active")), False),
        ("nvidia_peermem", bool(cfg.get("expect_rdma")), m.get("peermem_loaded"), bool(m.get("peermem_loaded")), False),
        ("memlock_units", m.get("default_memlock") is not None, m.get("default_memlock"),
         m.get("default_memlock") in ("infinity", "18446744073709551615"), True),
        ("nvme_free", True, free, free is not None and free >= need, False),
    ]  # fmt: skip
    rows = []
    for check, applies, value, ok, warn_only in checks:
        if applies:
            msg = "" if ok else FIX[check] + (f" (needs {need} bytes)" if check == "nvme_free" else "")
            rows.append(_row(check, n, value, PASS if ok else (WARN if warn_only else FAIL), msg))
    rows += _libcuda_row(n, m)
    rows += _engine_env_row(n, m.get("engine_env"))
    off, lim = m.get("clock_offset_s"), cfg.get("max_clock_offset_s", 0.1)
    if off is None:
        rows.append(_row("clock_sync", n, None, WARN, "no chrony/timesyncd offset available"))
    elif abs(off) > lim:
        rows.append(_row("clock_sync", n, off, FAIL, f"clock offset {off:+.3f}s exceeds {lim}s: fix NTP"))
    else:
        rows.append(_row("clock_sync", n, off, PASS))
    ips = cfg.get("fabric_ips", {})
    res = dict(m.get("resolves") or {})
    own = res.pop(n, None)
    if own is not None and any(ip.startswith("127.") for ip in own):
        rows.append(_row("own_name", n, own, WARN, "this node's name resolves to loopback (Debian's 127.0.1.1): "
                         "Gloo/NCCL must get *_SOCKET_IFNAME (the topology role writes it)"))  # fmt: skip
    bad = {peer: got for peer, got in res.items() if ips.get(peer) and ips[peer] not in got}
    note = "; ".join(f"{p} resolves to {g or 'nothing'}, not its fabric IP {ips[p]}" for p, g in bad.items())
    rows.append(_row("names_resolve", n, res if bad else f"{len(res)} peers", FAIL if bad else PASS, note))
    return rows


def _gpu_count_rows(measurements: dict[str, dict[str, Any]], cfg: dict[str, Any], missing: str, why: str) -> list:
    want = cfg.get("gpus_per_node")
    rows = []
    for n in sorted(measurements):
        c = measurements[n].get("gpu_count") or 0
        if c == 0:
            rows.append(_row("gpu_count", n, c, missing, f"no NVIDIA GPU{why}"))
        elif want and c != want:
            rows.append(_row("gpu_count", n, c, FAIL, f"expected {want} GPUs (llmfleet_gpus_per_node)"))
        else:
            rows.append(_row("gpu_count", n, c, PASS))
    if not want:
        counts = {n: measurements[n].get("gpu_count") for n in measurements}
        rows += [r for r in _consistent("gpu_count_equal", counts) if r["status"] == FAIL]
    return rows


def _engine_env_row(n: str, env: dict[str, Any] | None) -> list[dict[str, Any]]:
    """engine_env: root runs the engine's Python only as the engine's account, or from a path only root can change;
    a path another account can change lets that account into whatever runs it (fail), one the engine's account
    alone can change lets a compromised engine keep its foothold across restarts (warn)."""
    if not env:
        return []
    if env.get("missing"):
        why = f"{env['path']} is not installed here (yet): the engine and the NCCL check need it"
        return [_row("engine_env", n, env["path"], WARN, why)]
    fix = f"own it by root: chown -R root:root {env['root']}; chmod -R go-w {env['root']}"
    if env.get("others"):
        why = f"another account can change the engine's environment {env['path']}: {describe(env['others'])}: {fix}"
        return [_row("engine_env", n, [f["path"] for f in env["others"]][:5], FAIL, why)]
    if env.get("engine"):
        why = (f"the engine's account can change its own environment {env['path']} ({describe(env['engine'])}): "
               f"llmfleet runs it only as that account, but a compromised engine keeps its code; {fix}")  # fmt: skip
        return [_row("engine_env", n, [f["path"] for f in env["engine"]][:5], WARN, why)]
    return [_row("engine_env", n, env["path"], PASS)]


def evaluate(measurements: dict[str, dict[str, Any]], cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """All checks for all nodes. cfg: expect_gpus, gpus_per_node, min_free_bytes, max_clock_offset_s,
    expect_rdma, engine_python, fabric_ips ({node: ip}), ports ({node: {peer: {port: state}}})."""
    nodes = sorted(measurements)
    missing = FAIL if cfg.get("expect_gpus", True) else WARN
    why = "" if missing == FAIL else " (the inventory says this fleet has no GPUs: a warning, not a failure)"

    def col(key: str) -> dict[str, Any]:
        return {n: measurements[n].get(key) for n in nodes}

    rows = _gpu_count_rows(measurements, cfg, missing, why)
    for key in ("gpu_models", "driver_version", "cuda_version"):
        rows += _consistent(key, col(key), missing=missing, why=why)
    if cfg.get("engine_python"):
        nccl = col("nccl_version")
        # The same error on every node is consistent, but it is no NCCL version: fail it.
        broken = {n: v for n, v in nccl.items() if isinstance(v, str) and v.startswith("error:")}
        rows += _consistent("nccl_version", {n: v for n, v in nccl.items() if n not in broken})
        fix = (
            f"{cfg['engine_python']} cannot report torch's NCCL version: "
            "set llmfleet_engine_python to the engine's venv"
        )
        rows += [_row("nccl_version", n, v, FAIL, fix) for n, v in sorted(broken.items())]
    for n in nodes:
        rows += _node_checks(n, measurements[n], cfg)
    rows += _consistent("hca_active_ports", col("hca_active_ports"), missing=WARN)
    rows += _consistent("hca_link_layer", col("hca_link_layers"), missing=WARN, why=" (no ACTIVE HCA port)")
    rows += _consistent("hca_rate", col("hca_rates"), missing=WARN, why=" (no ACTIVE HCA port)")
    rows += _port_rows(cfg.get("ports") or {})
    return rows


def _port_rows(ports: dict[str, dict[str, dict[str, str]]]) -> list[dict[str, Any]]:
    """One row per node as a *target*: which peers could not reach which of its ports."""
    blocked: dict[str, list[str]] = {}
    targets: set[str] = set()
    for src, per_peer in ports.items():
        for dst, states in per_peer.items():
            targets.add(dst)
            for port, st in states.items():
                if st != "open":
                    blocked.setdefault(dst, []).append(f"{port} from {src}: {st}")
    rows = []
    for dst in sorted(targets):
        bad = sorted(blocked.get(dst, []))
        note = f"rendezvous port(s) unreachable: {'; '.join(bad)} (firewall or nothing bound)" if bad else ""
        rows.append(_row("ports_reachable", dst, "all open" if not bad else bad, FAIL if bad else PASS, note))
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    worst = max((ORDER[r["status"]] for r in rows), default=0)
    failed = [r for r in rows if r["status"] == FAIL]
    return {
        "status": [PASS, WARN, FAIL][worst],
        "failed_nodes": sorted({r["node"] for r in failed}),
        "failed_checks": sorted({r["check"] for r in failed}),
    }


def table(rows: list[dict[str, Any]]) -> str:
    """One table: check x node with the measured value, problems first."""
    rows = sorted(rows, key=lambda r: (-ORDER[r["status"]], r["check"], r["node"]))
    w = [max(len(str(x)) for x in col) for col in zip(*[("check", "node", "status", "value"), *[
        (r["check"], r["node"], r["status"].upper(), str(r["value"])[:60]) for r in rows]])]  # fmt: skip
    lines = [f"{'check':<{w[0]}}  {'node':<{w[1]}}  {'status':<{w[2]}}  {'value':<{w[3]}}  note"]
    for r in rows:
        lines.append(f"{r['check']:<{w[0]}}  {r['node']:<{w[1]}}  {r['status'].upper():<{w[2]}}  "
                     f"{str(r['value'])[:60]:<{w[3]}}  {r['message']}")  # fmt: skip
    return "\n".join(lines)
