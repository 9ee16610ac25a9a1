"""The engine role's node-side probes: the versions and GPU facts hashed into the compile-cache
fingerprint, the model's identity, the per-fingerprint cache directory (created and collected without
following links the engine user could plant) and the engine's own --help. command.py holds the pure
launch plan these feed."""

from __future__ import annotations

import json
import re
import stat
from typing import Any

from .. import engines
from ..engine_env import EngineEnvError, popen_kwargs
from ..safefs import chown_fd, lstat_at, only_root_can_change, open_dir, rmtree_at, subdir, write_file_at
from .command import PlanError

# The engines' own packages (the profiles'), then the kernel libraries they load.
KERNEL_LIBS = (
    *engines.engines(),
    "sgl-kernel",
    "flashinfer-python",
    "deep-gemm",
    "deep_gemm",
    "triton",
    "torch",
    "apache-tvm-ffi",
    "xformers",
    "nixl",
)
# torch's CUDA is read from torch/version.py, never by importing torch: the import took 3-4 s of every
# converge on the lab (seconds more with CUDA libraries on a GPU node) for one string.
_VERSIONS_PY = (
    "import ast, json, os, importlib.metadata as m, importlib.util as u\n"
    "v = {}\n"
    "for p in %r:\n"
    "    try: v[p] = m.version(p)\n"
    "    except Exception: pass\n"
    "cuda = None\n"
    "try:\n"
    "    spec = u.find_spec('torch')\n"
    "    with open(os.path.join(os.path.dirname(spec.origin), 'version.py')) as f:\n"
    "        tree = ast.parse(f.read())\n"
    "    for n in tree.body:\n"
    "        t = n.targets[0] if isinstance(n, ast.Assign) else getattr(n, 'target', None)\n"
    "        if getattr(t, 'id', None) == 'cuda' and n.value is not None:\n"
    "            cuda = ast.literal_eval(n.value)\n"
    "except Exception: pass\n"
    "print(json.dumps({'versions': v, 'cuda': cuda}))\n"
)


def _run(argv: list[str], timeout: float, *, engine: bool = False, run_as: str | None = None) -> tuple[int, str]:
    """(exit status, output). engine: argv is the engine's own program, run as `run_as` (engine_env.popen_kwargs;
    without it, root refuses a program another account can change: PlanError naming the path and its owner)."""
    import subprocess

    try:
        kw = popen_kwargs(argv[0], run_as) if engine else {}
    except EngineEnvError as e:
        raise PlanError(str(e)) from None
    try:
        p = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout, **kw)
    except FileNotFoundError:
        return 127, f"{argv[0]}: not found"
    except PermissionError:
        who = f" by the engine's account {run_as} (every directory above it must be searchable by it)" if run_as else ""
        return 126, f"{argv[0]}: not executable{who}"
    except subprocess.TimeoutExpired:
        return 124, f"{' '.join(argv[:3])} did not finish within {timeout:.0f} s"
    return p.returncode, p.stdout + p.stderr


def engine_versions(python: str, timeout: float = 120, run_as: str | None = None) -> dict[str, Any]:
    """Kernel-library versions and torch's CUDA as the engine's own Python sees them (run as `run_as`)."""
    rc, out = _run([python, "-c", _VERSIONS_PY % (KERNEL_LIBS,)], timeout, engine=True, run_as=run_as)
    if rc != 0:
        raise PlanError(f"llmfleet_engine_python {python} could not report package versions: {out.strip()[-300:]}")
    return json.loads(out.strip().splitlines()[-1])


def gpu_facts(timeout: float = 30) -> dict[str, Any]:
    """Driver and compute capabilities (nvidia-smi); 'none' on hosts without GPUs (the lab)."""
    import shutil

    smi = shutil.which("nvidia-smi")
    if not smi:
        return {"driver": "none", "compute_capability": "none"}
    rc, out = _run([smi, "--query-gpu=driver_version,compute_cap", "--format=csv,noheader"], timeout)
    if rc != 0:
        raise PlanError(f"nvidia-smi failed: {out.strip()[-300:]}")
    rows = [[c.strip() for c in line.split(",")] for line in out.strip().splitlines() if "," in line]
    return {
        "driver": ",".join(sorted({r[0] for r in rows})),
        "compute_capability": ",".join(sorted({r[1] for r in rows})),
    }


def model_identity(model_path: str, revision: str | None = None) -> dict[str, Any]:
    """The revision - the one the fleet contract pins, else the name of the directory model_path resolves to (an
    override of the model path) - and the quantization in config.json."""
    import os

    real = os.path.realpath(model_path)
    quant = None
    try:
        with open(os.path.join(real, "config.json"), encoding="utf-8") as f:
            qc = (json.load(f) or {}).get("quantization_config") or {}
        if qc.get("quant_method"):
            quant = f"{qc['quant_method']}:{qc.get('fmt') or qc.get('weight_block_size') or ''}"
    except (OSError, ValueError, AttributeError):
        pass
    return {"model_revision": revision or os.path.basename(real), "quantization": quant, "model_real_path": real}


def prepare_cache(root: str, fp: str, keep: int, *, uid: int, gid: int, in_use: set[str], check: bool) -> dict:
    """<root>/<fingerprint> for this launch, owned by uid:gid; older fingerprints beyond `keep` (newest
    first, current counted) are removed unless a running process uses them.

    Runs as root on directories the engine user owns: nothing here follows a symlink that user could
    have planted (safefs). A symlink where a cache directory belongs is refused (UnsafePathError), one
    named like an old fingerprint is unlinked by GC (its target untouched); directories are chowned
    and removed through file descriptors opened with O_NOFOLLOW."""
    import os

    if not re.fullmatch(r"[0-9a-f]{16}", fp or ""):
        raise PlanError(f"fingerprint {fp!r} is not 16 hex digits")
    root = os.path.abspath(root)
    result: dict[str, Any] = {
        "cache_dir": os.path.join(root, fp), "created": False, "chowned": [], "removed": [], "remove_failed": []
    }  # fmt: skip
    try:
        root_fd = open_dir(root, create_mode=None if check else 0o755)
    except FileNotFoundError:
        if not check:
            raise
        result["created"] = True  # check mode: nothing exists yet, nothing to collect
        return result
    try:
        _own_cache_dir(root_fd, root, fp, uid, gid, check, result)
        _collect_caches(root_fd, root, fp, keep, in_use, check, result)
    finally:
        os.close(root_fd)
    return result


def _own_cache_dir(root_fd: int, root: str, fp: str, uid: int, gid: int, check: bool, result: dict) -> None:  # noqa: PLR0917
    """Create <root>/<fp> and chown both through fds opened without following links (check: predict)."""
    import os

    path = result["cache_dir"]
    st = lstat_at(root_fd, fp)
    if check:
        if st is not None and not stat.S_ISDIR(st.st_mode):
            subdir(root_fd, fp, shown=path, create=False)  # raises: a symlink or a file is refused
        result["created"] = st is None
        for p, s in ((root, os.fstat(root_fd)), (path, st)):
            if s is not None and (s.st_uid, s.st_gid) != (uid, gid):
                result["chowned"].append(p)
        return
    if chown_fd(root_fd, uid, gid):
        result["chowned"].append(root)
    fp_fd, result["created"] = subdir(root_fd, fp, shown=path, mode=0o750)
    try:
        if chown_fd(fp_fd, uid, gid):
            result["chowned"].append(path)
        os.utime(fp_fd)  # GC orders by mtime: the current fingerprint is the newest
    finally:
        os.close(fp_fd)


def _collect_caches(root_fd: int, root: str, fp: str, keep: int, in_use: set[str], check: bool, result: dict) -> None:  # noqa: PLR0917
    """Remove old fingerprint directories beyond keep (never one in use) and symlinks named like one."""
    import errno
    import os

    dirs, links = [], []
    for name in os.listdir(root_fd):
        if name == fp or not re.fullmatch(r"[0-9a-f]{16}", name):
            continue
        st = lstat_at(root_fd, name)
        if st is not None and stat.S_ISDIR(st.st_mode):
            dirs.append((st.st_mtime, name))
        elif st is not None and stat.S_ISLNK(st.st_mode):
            links.append(name)  # not a cache directory: unlink the link, never its target
    dirs.sort(reverse=True)
    old = [n for _, n in dirs[max(0, keep - 1) :] if os.path.join(root, n) not in in_use]
    for name in old + sorted(links):
        full = os.path.join(root, name)
        if check:
            result["removed"].append(full)
            continue
        try:
            rmtree_at(root_fd, name)
            result["removed"].append(full)
        except OSError as e:
            if e.errno != errno.ENOENT:
                result["remove_failed"].append(f"{full}: {e.strerror or e}")


def help_cache_name(command: list[str], profile: str, key: str) -> str | None:
    """The help cache's file name for this engine install: the command, the profile, the caller's key (the
    engine and kernel-library versions) and the executable's identity (a reinstall over the same version
    gets a new inode or mtime). None when the executable cannot be found (then the help runs and fails)."""
    import hashlib
    import os
    import shutil

    exe = shutil.which(command[0]) if command else None
    if not exe:
        return None
    try:
        st = os.stat(exe)
    except OSError:
        return None
    ident = [list(command), profile, key, os.path.realpath(exe), st.st_ino, st.st_size, st.st_mtime_ns]
    return "help-" + hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:32] + ".txt"


HELP_CACHE_KEEP = 8


def _cached_help(cache_dir: str, name: str) -> str | None:
    """The cached help, trusted only from a root-owned directory no one else can change and a root-owned
    file no one else can write (root reads it to decide what a unit runs)."""
    import os

    try:
        dfd = open_dir(cache_dir)
    except OSError:  # UnsafePathError included
        return None
    try:
        if not only_root_can_change(os.fstat(dfd)):
            return None
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
                return None
            text = f.read().decode(errors="replace")
        return text if text.strip() else None
    finally:
        os.close(dfd)


def _store_help(cache_dir: str, name: str, text: str) -> None:
    """Keep the help for the next converge (best effort: a cache that cannot be written costs a rerun only)."""
    import os

    try:
        dfd = open_dir(cache_dir, create_mode=0o700)
    except OSError:  # UnsafePathError included
        return
    try:
        if not only_root_can_change(os.fstat(dfd)):
            return
        write_file_at(dfd, name, text.encode(), mode=0o644)
        entries = []
        for entry in os.listdir(dfd):
            if entry.startswith("help-") and entry.endswith(".txt") and entry != name:
                st = lstat_at(dfd, entry)
                if st is not None:
                    entries.append((st.st_mtime, entry))
        for _, old in sorted(entries)[: max(0, len(entries) - (HELP_CACHE_KEEP - 1))]:
            os.unlink(old, dir_fd=dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def help_text(
    command: list[str],
    profile: str,
    timeout: float = 300,
    *,
    cache_dir: str = "",
    cache_key: str = "",
    store: bool = True,
    run_as: str | None = None,
) -> tuple[str, bool]:
    """(the engine's help, whether it came from the cache). With ``cache_dir`` the help of this exact engine
    install is kept there (unless ``store`` is off: check mode reads it, never writes it): `vllm serve
    --help=all` imports vLLM and torch, 20-30 s of every converge). The help runs as `run_as` (engine_env)."""
    name = help_cache_name(command, profile, cache_key) if cache_dir else None
    if name:
        text = _cached_help(cache_dir, name)
        if text is not None:
            return text, True
    args = list(engines.help_args(profile))
    rc, out = _run(list(command) + args, timeout, engine=True, run_as=run_as)
    if rc != 0 or not out.strip():
        raise PlanError(
            f"`{' '.join(list(command) + args)}` failed (exit {rc}): {out.strip()[-400:]}; "
            + (
                "check engine_pd_router_command (the P/D router must be installed on the head)"
                if profile == "router"
                else "check engine_command (the engine must be installed on the head)"
            )
        )
    if name and store:
        _store_help(cache_dir, name, out)
    return out, False
