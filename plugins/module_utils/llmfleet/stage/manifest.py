"""The per-revision manifest: size + sha256 of every file (for an LFS file, sha256 = its LFS oid,
which is checked where the source carries it).

Its format, building it (every file read once), reading and checking a manifest file, comparing
a directory with it, obtaining a revision's manifest for staging (cached on shared storage,
shipped with the source, or built), and checking a manifest against what the source itself says
of its files (hub-cache blob names, Git LFS pointers, sha256 lists) and against a pinned digest.
Checkpoint structure (safetensors headers, the shard index, required files) and the
Problem/Report types are in checkpoint.py, which builds on this module.

Stdlib only: runs inside Ansible modules on nodes and in the CLI.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import safefs
from ..facts import HEX40
from .errors import StageError

MANIFEST_FORMAT = "llmfleet-manifest/1"
SHIPPED_MANIFEST = ".llmfleet-manifest.json"
HASH_CHUNK = 8 * 1024 * 1024
HEX64 = re.compile(r"^[0-9a-f]{64}$")
# Files up to this size (config, tokenizer, index, ...) are re-hashed from the source whenever a
# cached or shipped manifest is used: cheap, and the hub keeps most of them out of LFS.
SMALL_FILE = 16 * 1024 * 1024
# sha256sum-format lists at the top of a source directory that staging compares the manifest with.
SHA256_LISTS = ("SHA256SUMS", "SHA256SUMS.txt", "sha256sums.txt", "checksums.sha256")


def sha256_file(path: str | int, chunk: int = HASH_CHUNK, check: Callable[[], None] | None = None) -> str:
    """sha256 hex of a file (a path, or an open fd, which is closed); check() runs before every chunk read
    (a lost reader lease stops it)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while True:
            if check:
                check()
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def revision_from_path(directory: str) -> str | None:
    """The commit of a hub-cache snapshot dir (models--org--name/snapshots/<40-hex>/), else None."""
    parts = os.path.normpath(os.path.abspath(directory)).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "snapshots" and HEX40.match(parts[-1]) and parts[-3].startswith("models--"):
        return parts[-1]
    return None


def source_bounds(directory: str, allow_links_into: tuple[str, ...] | list[str] = ()) -> list[str]:
    """The real directories a source file may resolve into: the source itself (for a hub-cache snapshot,
    its repo dir, whose blobs/ the snapshot links to) and the directories the inventory allows
    (model_stage_source_allow_links_into). A link out of these is refused: staging would copy its target as
    root, read-only for every user, and serve it to peers."""
    bounds = [os.path.realpath(directory)]
    if revision_from_path(directory):
        bounds.append(os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(directory)))))
    bounds += [os.path.realpath(a) for a in allow_links_into]
    return bounds


def _inside(real: str, bounds: list[str]) -> bool:
    return any(real == b or real.startswith(b.rstrip("/") + "/") for b in bounds)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def _escape_error(directory: str, rel: str, target: str) -> StageError:
    return StageError(
        f"source {directory}: {rel} is a link to {target}, outside the source: staging copies a file as root, "
        "leaves it readable by every user on the node and serves it to peers, so a link out of the source is "
        f"refused. Replace {rel} with the file itself (or remove it); if the revision's files really live in "
        f"{os.path.dirname(target)}, allow that directory with model_stage_source_allow_links_into"
    )


def check_source_file(
    directory: str, rel: str, bounds: list[str], *, missing_ok: bool = False
) -> os.stat_result | None:
    """The stat of the source file ``rel`` when staging may read it: a regular file whose real path
    (every link resolved) stays within ``bounds`` (source_bounds); else StageError naming it, where it
    points and the fix. With missing_ok, a missing file is None (the caller reports it)."""
    path = os.path.join(directory, rel)
    try:
        os.stat(path)  # a dangling link (an interrupted hub download) is a missing file, wherever it points
    except FileNotFoundError:
        if missing_ok:
            return None
        raise
    real = os.path.realpath(path)
    if not _inside(real, bounds):
        raise _escape_error(directory, rel, real)
    st = os.stat(real, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise StageError(
            f"source {directory}: {rel} is {_kind(st.st_mode)}, not a regular file: only regular files are staged "
            "(a FIFO would hang the copy, a device would be read as root); remove it from the source"
        )
    return st


def open_source_file(directory: str, rel: str, bounds: list[str]) -> int:
    """A read-only fd of the source file ``rel``, checked as check_source_file does, and re-checked after
    the open: the file opened is the one checked, even if a path component was swapped for a link in
    between (O_NOFOLLOW on the resolved path, then where the fd really points, from /proc)."""
    check_source_file(directory, rel, bounds)
    real = os.path.realpath(os.path.join(directory, rel))
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StageError(f"source {directory}: {rel} is {_kind(st.st_mode)}, not a regular file: remove it")
        try:
            landed = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # no /proc: the path must still name the inode opened
            now = os.stat(real, follow_symlinks=False)
            landed = real if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino) else "(changed while opened)"
        if not _inside(landed, bounds):
            raise _escape_error(directory, rel, landed)
    except BaseException:
        os.close(fd)
        raise
    return fd


def list_files(directory: str, allow_links_into: tuple[str, ...] | list[str] = ()) -> list[str]:
    """Relative paths of the revision's files, sorted. Links are followed while they stay in the source
    (hub snapshots link into ../../blobs) or a directory in ``allow_links_into``; a link out of them, or
    anything but a regular file, is refused (StageError naming it). Hidden entries (.cache, .git,
    .llmfleet-*) are not part of a revision."""
    bounds = source_bounds(directory, allow_links_into)
    out = []
    seen: set[str] = set()
    for top, dirs, files in os.walk(directory, followlinks=True):
        real_top = os.path.realpath(top)
        if real_top in seen:  # a directory link loop, or a second link to one directory
            again = os.path.relpath(top, directory)
            raise StageError(f"source {directory}: {again} repeats {real_top} (a directory link): remove the link")
        seen.add(real_top)
        keep = []
        for d in sorted(d for d in dirs if not d.startswith(".")):
            rel = os.path.relpath(os.path.join(top, d), directory)
            real = os.path.realpath(os.path.join(top, d))
            if not _inside(real, bounds):
                raise _escape_error(directory, rel, real)
            keep.append(d)
        dirs[:] = keep
        for name in files:
            if not name.startswith("."):
                rel = os.path.relpath(os.path.join(top, name), directory)
                check_source_file(directory, rel, bounds)
                out.append(rel)
    return sorted(out)


# ---- building ---------------------------------------------------------------------------------


def build_manifest(
    directory: str,
    threads: int = 4,
    revision: str | None = None,
    check: Callable[[], None] | None = None,
    allow_links_into: tuple[str, ...] | list[str] = (),
) -> dict[str, Any]:
    """Read every file once and record its size and sha256 (check() as in sha256_file; links as in
    list_files: each file is opened as open_source_file checks it)."""
    files = list_files(directory, allow_links_into)
    bounds = source_bounds(directory, allow_links_into)

    def one(rel: str) -> dict[str, Any]:
        fd = open_source_file(directory, rel, bounds)
        size = os.fstat(fd).st_size
        return {"path": rel, "size": size, "sha256": sha256_file(fd, check=check)}

    with ThreadPoolExecutor(max_workers=max(1, threads)) as ex:  # hashlib releases the GIL
        entries = list(ex.map(one, files))
    return {
        "format": MANIFEST_FORMAT,
        "revision": revision or revision_from_path(directory),
        "files": entries,
        "total_bytes": sum(e["size"] for e in entries),
    }


def stat_manifest(src: str, allow_links_into: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
    """Sizes only (no hashing): what check mode uses to predict bytes before a manifest exists."""
    files = [
        {"path": p, "size": os.path.getsize(os.path.join(src, p)), "sha256": ""}
        for p in list_files(src, allow_links_into)
    ]
    return {"files": files, "total_bytes": sum(e["size"] for e in files), "revision": None}


# ---- reading and verifying ----------------------------------------------------------------------


def load_manifest(path: str) -> dict[str, Any]:
    """Read and check a manifest file; raises ValueError naming what is wrong."""
    with open(path, encoding="utf-8") as f:
        m = json.load(f)
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT or not isinstance(m.get("files"), list):
        raise ValueError(f"{path}: not an {MANIFEST_FORMAT} manifest")
    for e in m["files"]:
        if not (
            isinstance(e, dict)
            and isinstance(e.get("path"), str)
            and isinstance(e.get("size"), int)
            and isinstance(e.get("sha256"), str)
            and re.fullmatch(r"[0-9a-f]{64}", e["sha256"])
        ):
            raise ValueError(f"{path}: malformed entry {e!r}")
        rel = e["path"]
        if os.path.isabs(rel) or ".." in rel.split("/") or rel.startswith(".") or "\\" in rel:
            raise ValueError(f"{path}: entry path {rel!r} leaves the revision directory")
    return m


def verify_manifest(
    directory: str, manifest: dict[str, Any], deep: bool = True, threads: int = 4
) -> tuple[list[tuple[str, str, str]], list[str]]:
    """Compare files on disk with the manifest: presence, size, and (deep) sha256.

    Returns (problems, warnings); each problem is (file, kind, message) with kind one of
    missing_file, truncated, size_mismatch, hash_mismatch (checkpoint.KIND_FIX says the fix;
    checkpoint.verify turns them into its Problems)."""
    expected = {e["path"]: e for e in manifest["files"]}

    def one(rel: str) -> tuple[str, str, str] | None:
        e = expected[rel]
        path = os.path.join(directory, rel)
        if not os.path.isfile(path):
            return (rel, "missing_file", "listed in the manifest, not on disk")
        size = os.path.getsize(path)
        if size != e["size"]:
            kind = "truncated" if size < e["size"] else "size_mismatch"
            return (rel, kind, f"{size} bytes on disk, manifest says {e['size']}")
        if deep:
            got = sha256_file(path)
            if got != e["sha256"]:
                return (rel, "hash_mismatch", f"sha256 {got[:12]}… on disk, manifest says {e['sha256'][:12]}…")
        return None

    with ThreadPoolExecutor(max_workers=max(1, threads)) as ex:
        problems = [p for p in ex.map(one, sorted(expected)) if p]
    warnings = []
    extra = sorted(set(list_files(directory)) - set(expected))
    if extra:
        warnings.append(f"files not in the manifest: {', '.join(extra[:5])}{' …' if len(extra) > 5 else ''}")
    return problems, warnings


def sizes_match(src: str, manifest: dict[str, Any]) -> list[str]:
    """Files whose size on the source differs from the manifest (a revision must be immutable)."""
    bad = []
    for e in manifest["files"]:
        try:
            if os.path.getsize(os.path.join(src, e["path"])) != e["size"]:
                bad.append(e["path"])
        except OSError:
            bad.append(e["path"])
    return bad


# ---- what the source itself says of its files -------------------------------------------------


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's content (revision + path, size, sha256 of every file, in a canonical
    form): what an operator pins (model_stage_manifest_sha256) and what the manifest step hands to
    the staging step, so a manifest file rewritten in between is refused."""
    canon = {
        "revision": manifest.get("revision"),
        "files": sorted([e["path"], e["size"], e["sha256"]] for e in manifest["files"]),
    }
    return hashlib.sha256(json.dumps(canon, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def source_options() -> dict[str, dict[str, Any]]:
    """The argument spec of the options the manifest and staging modules share (their doc fragment:
    llmfleet_model_source); a fresh dict each call, as AnsibleModule keeps defaults by reference."""
    return {
        "source_allow_links_into": {"type": "list", "elements": "path", "default": []},
        "revision": {"type": "str", "required": True},
        "max_source_readers": {"type": "int", "default": 2},
    }


def digest_problem(value: str | None, option: str, fix: str) -> str | None:
    """What is wrong with a manifest digest an option gives (unset is fine), or None."""
    if value and not HEX64.match(value):
        return f"{option}={value!r}{fix}"
    return None


def source_mtimes(src: str, paths: list[str]) -> dict[str, int]:
    """Whole-second mtimes of the source's files (what a cached manifest is re-checked against)."""
    out = {}
    for rel in paths:
        try:
            out[rel] = int(os.stat(os.path.join(src, rel)).st_mtime)
        except OSError:
            out[rel] = -1
    return out


def _claim(claims: dict[str, list[dict[str, Any]]], rel: str, kind: str, where: str, **kw: Any) -> None:
    claims.setdefault(rel, []).append({"kind": kind, "where": where, **kw})


def _hub_blobs(src: str, paths: list[str], claims: dict[str, list[dict[str, Any]]]) -> None:
    """A hub-cache snapshot links each file to ../../blobs/<id>: the LFS sha256 for LFS files, the git
    blob sha1 for the others (names huggingface_hub took from the hub, not from the bytes)."""
    for rel in paths:
        path = os.path.join(src, rel)
        if not os.path.islink(path):
            continue
        parts = os.path.normpath(os.readlink(path)).split(os.sep)
        if len(parts) < 2 or parts[-2] != "blobs":
            continue
        name = parts[-1]
        if HEX64.match(name):
            _claim(claims, rel, "hub blob", f"its hub-cache blob name {name[:12]}…", sha256=name)
        elif HEX40.match(name):
            _claim(claims, rel, "hub blob", f"its hub-cache blob name (git blob {name[:12]}…)", git_sha1=name)


def _sha256_lists(src: str, paths: list[str], claims: dict[str, list[dict[str, Any]]]) -> None:
    """<file>.sha256 beside a file, and sha256sum-format lists (SHA256_LISTS) at the top."""
    for rel in paths:
        side = os.path.join(src, rel + ".sha256")
        if os.path.isfile(side):
            with open(side, encoding="utf-8", errors="replace") as f:
                m = re.search(r"\b([0-9a-fA-F]{64})\b", f.read(4096))
            if m:
                _claim(claims, rel, "<file>.sha256", f"{rel}.sha256", sha256=m.group(1).lower())
    for name in SHA256_LISTS:
        listing = os.path.join(src, name)
        if not os.path.isfile(listing):
            continue
        with open(listing, encoding="utf-8", errors="replace") as f:
            for line in f:
                m = re.match(r"^([0-9a-fA-F]{64}) [ *](.+?)\s*$", line)
                if m:
                    rel = os.path.normpath(m.group(2))
                    _claim(claims, rel, name, name, sha256=m.group(1).lower())


def _git(src: str, *args: str, stdin: bytes | None = None) -> bytes:
    # Read-only plumbing on a checkout another user may own (shared storage): no hooks, no fsmonitor.
    cmd = ["git", "-c", "safe.directory=*", "-c", "core.fsmonitor=false", "-C", src, *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, timeout=300, check=True).stdout


def _git_lfs(src: str, revision: str | None, claims: dict[str, list[dict[str, Any]]], notes: list[str]) -> None:
    """A git checkout (a clone of the hub repo): its HEAD must be the revision; HEAD's tree holds an
    LFS pointer (oid sha256 + size) for each LFS file and the git blob sha1 of every other file.
    Needs git, not git-lfs (the pointers are read from the object store)."""
    try:
        head = _git(src, "rev-parse", "HEAD").decode().strip()
        tree = _git(src, "ls-tree", "-r", "-l", "-z", "HEAD")
    except FileNotFoundError:
        notes.append(f"{src} is a git checkout but git is not installed here: its LFS pointers were not compared")
        return
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", b"") or b""
        why = err.decode(errors="replace").strip().splitlines()[:1] or [str(e)]
        notes.append(f"git could not read {src} ({why[0]}): its LFS pointers were not compared")
        return
    if revision and head != revision:
        raise StageError(
            f"source {src} is a git checkout at {head}, not the pinned revision {revision}: check out {revision} "
            "there (git checkout <rev> && git lfs pull) or point model_stage_source at a copy of that revision"
        )
    small = []
    for entry in tree.split(b"\0"):
        meta, _, path = entry.partition(b"\t")
        fields = meta.split()
        if len(fields) != 4 or fields[1] != b"blob":
            continue
        rel, obj, size = path.decode(errors="replace"), fields[2].decode(), fields[3]
        if size.isdigit() and int(size) < 1024:  # LFS pointers are smaller than 1024 bytes
            small.append((rel, obj))
        else:
            _claim(claims, rel, "git blob", f"git blob {obj[:12]}… of HEAD", git_sha1=obj)
    if not small:
        return
    out = _git(src, "cat-file", "--batch", stdin="".join(f"{o}\n" for _r, o in small).encode())
    pos = 0
    for rel, obj in small:
        header_end = out.index(b"\n", pos)
        header = out[pos:header_end].split()
        if len(header) != 3 or not header[2].isdigit():  # "<obj> missing": a shallow or partial clone
            pos = header_end + 1
            notes.append(f"{rel}: git blob {obj[:12]}… is not in {src}/.git: its LFS pointer was not compared")
            continue
        n = int(header[2])
        body = out[header_end + 1 : header_end + 1 + n]
        pos = header_end + 1 + n + 1
        oid = re.search(rb"^oid sha256:([0-9a-f]{64})$", body, re.M)
        size_m = re.search(rb"^size (\d+)$", body, re.M)
        if body.startswith(b"version https://") and oid and size_m:
            sha, n_lfs = oid.group(1).decode(), int(size_m.group(1))
            _claim(claims, rel, "git-lfs pointer", "its git-lfs pointer in HEAD", sha256=sha, size=n_lfs)
        else:
            _claim(claims, rel, "git blob", f"git blob {obj[:12]}… of HEAD", git_sha1=obj)


def upstream_claims(src: str, paths: list[str], revision: str | None) -> tuple[dict[str, list[dict]], list[str]]:
    """What the source says of its files without reading the large ones: path -> claims (sha256,
    git_sha1 and/or size, and where each comes from), and notes on what could not be checked."""
    claims: dict[str, list[dict[str, Any]]] = {}
    notes: list[str] = []
    _hub_blobs(src, paths, claims)
    _sha256_lists(src, paths, claims)
    if os.path.exists(os.path.join(src, ".git")):
        _git_lfs(src, revision, claims, notes)
    return claims, notes


def _hash_both(fd: int, size: int) -> tuple[str, str]:
    """sha256 and git blob sha1 of a (small) file, in one read (the fd is closed)."""
    h, g = hashlib.sha256(), hashlib.sha1()  # noqa: S324 (git's object id, not a security choice)
    g.update(b"blob %d\0" % size)
    with open(fd, "rb") as f:
        for b in iter(lambda: f.read(HASH_CHUNK), b""):
            h.update(b)
            g.update(b)
    return h.hexdigest(), g.hexdigest()


def check_against_source(
    src: str,
    manifest: dict[str, Any],
    revision: str | None,
    *,
    rehash_small: bool,
    fix: str,
    allow_links_into: tuple[str, ...] | list[str] = (),
) -> dict[str, Any]:
    """Compare the manifest with what the source itself says (upstream_claims), and re-hash the
    source's small files (all of them with rehash_small, else those the source gives a git blob
    id for). Raises StageError naming each file that disagrees; returns what was checked:
    upstream_checked (files the source's own digest confirms), upstream_kinds (where those digests
    came from), rehashed, unverified (files whose sha256 only the manifest vouches for) and notes."""
    paths = [e["path"] for e in manifest["files"]]
    bounds = source_bounds(src, allow_links_into)
    claims, notes = upstream_claims(src, paths, revision)
    problems: list[str] = []
    confirmed, rehashed, kinds = set(), set(), set()
    for e in manifest["files"]:
        rel, ours = e["path"], e["sha256"][:12]
        mine = claims.get(rel, [])
        for c in mine:
            if c.get("sha256") and c["sha256"] != e["sha256"]:
                problems.append(f"{rel}: the manifest says sha256 {ours}…, {c['where']} says {c['sha256'][:12]}…")
            elif c.get("sha256"):
                confirmed.add(rel)
                kinds.add(c["kind"])
            if c.get("size") is not None and c["size"] != e["size"]:
                problems.append(f"{rel}: the manifest says {e['size']} bytes, {c['where']} says {c['size']}")
        sha1s = [c for c in mine if c.get("git_sha1")]
        if e["size"] <= SMALL_FILE and (rehash_small or sha1s):
            try:
                sha256, sha1 = _hash_both(open_source_file(src, rel, bounds), e["size"])
            except OSError as err:
                problems.append(f"{rel}: cannot read it from the source ({err.strerror or err})")
                continue
            rehashed.add(rel)
            if sha256 != e["sha256"]:
                problems.append(f"{rel}: the manifest says sha256 {ours}…, the source file's is {sha256[:12]}…")
            for c in sha1s:
                if c["git_sha1"] != sha1:
                    problems.append(f"{rel}: the source file is not {c['where']} (its git blob id is {sha1[:12]}…)")
                elif sha256 == e["sha256"]:
                    confirmed.add(rel)
                    kinds.add(c["kind"])
    if problems:
        more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
        raise StageError(
            f"the manifest of {revision} and the source {src} disagree: {'; '.join(problems[:5])}{more}. A damaged "
            f"source file: restore it (e.g. re-download that file of the revision); a wrong manifest: {fix}"
        )
    return {
        "upstream_checked": len(confirmed),
        "upstream_kinds": sorted(kinds),
        "rehashed": len(rehashed),
        "unverified": len([p for p in paths if p not in confirmed and p not in rehashed]),
        "notes": notes,
    }


# ---- obtaining a revision's manifest for staging ------------------------------------------------


def manifest_cache_path(cache_dir: str, model: str, revision: str) -> str:
    return os.path.join(cache_dir, "manifests", model, f"{revision}.json")


def _build_checked(
    src: str, build: Callable[[], dict[str, Any]], allow_links_into: tuple[str, ...] | list[str] = ()
) -> dict[str, Any]:
    """build(), refusing a source that changed while it was read; records the source's mtimes."""
    before = source_mtimes(src, list_files(src, allow_links_into))
    manifest = build()
    after = source_mtimes(src, [e["path"] for e in manifest["files"]])
    moved = sorted(p for p, t in after.items() if before.get(p) != t)
    if moved:
        raise StageError(
            f"source {src} changed while its manifest was built ({', '.join(moved[:5])}): a pinned revision must "
            "not change on shared storage; rerun once nothing writes to it"
        )
    manifest["source_mtime"] = after
    return manifest


def _unchanged_source(src: str, manifest: dict[str, Any], cache: str, rebuild: str) -> None:
    """Sizes (every manifest) and, for a manifest that recorded them, mtimes of the source's files."""
    revision = manifest["revision"]
    changed_files = sizes_match(src, manifest)
    if changed_files:
        raise StageError(
            f"source {src} no longer matches the manifest of {revision} ({', '.join(changed_files[:5])}): a pinned "
            "revision must not change on shared storage; restore it or delete the cached manifest "
            f"{cache} if the change is intended"
        )
    recorded = manifest.get("source_mtime")
    if isinstance(recorded, dict):
        now = source_mtimes(src, [p for p in recorded if isinstance(p, str)])
        moved = sorted(p for p, t in now.items() if recorded.get(p) != t)
        if moved:
            raise StageError(
                f"source {src}: {', '.join(moved[:5])} rewritten since the manifest {cache} was built (mtime): a "
                f"pinned revision must not change on shared storage; restore it, or {rebuild} if that is intended"
            )


def obtain_manifest(
    src: str,
    model: str,
    revision: str,
    cache_dir: str,
    *,
    build: Callable[[], dict[str, Any]],
    check_mode: bool = False,
    expected_sha256: str | None = None,
    allow_links_into: tuple[str, ...] | list[str] = (),
) -> dict[str, Any]:
    """The revision's manifest: from the cache next to the source, shipped with the source, or
    built (``build()`` reads every file once; the caller holds a reader lease). Cached atomically.

    Before use it is checked against the source: sizes; the source's mtimes when the manifest
    recorded them (built here); the source's own digests (hub-cache blob names, Git LFS pointers,
    sha256 lists); a re-hash of the source's small files (cached or shipped manifests); and
    expected_sha256 (the operator's pin) when given. Check mode checks sizes and mtimes only (it
    reads no file contents). Returns origin, path (the cache), manifest, sha256 (manifest_digest)
    and trust (what check_against_source checked; None in check mode)."""
    cache = manifest_cache_path(cache_dir, model, revision)
    found = [
        (o, p) for o, p in (("cache", cache), ("shipped", os.path.join(src, SHIPPED_MANIFEST))) if os.path.isfile(p)
    ]
    rebuild = f"delete {cache} (on shared storage that nodes can write) so it is rebuilt from the source"
    if found:
        origin, path = found[0]
        try:
            manifest = load_manifest(path)
        except (OSError, ValueError) as e:
            raise StageError(f"{path}: {e}; delete it so the manifest is rebuilt") from None
    elif check_mode:
        return {"origin": "would build", "path": cache, "manifest": None, "sha256": None, "trust": None}
    else:
        origin, path, manifest = "built", cache, _build_checked(src, build, allow_links_into)
    if manifest.get("revision") not in (None, revision):
        raise StageError(f"manifest {path} is for revision {manifest.get('revision')}, not {revision}")
    manifest["revision"] = revision
    # A cached or shipped manifest names files the source may since have turned into links out of it.
    bounds = source_bounds(src, allow_links_into)
    for e in manifest["files"]:
        check_source_file(src, e["path"], bounds, missing_ok=True)
    _unchanged_source(src, manifest, cache, rebuild)
    trust = None
    if not check_mode:
        fix = rebuild if origin != "shipped" else f"fix or delete the shipped {path}"
        trust = check_against_source(
            src, manifest, revision, rehash_small=origin != "built", fix=fix, allow_links_into=allow_links_into
        )
    digest = manifest_digest(manifest)
    if expected_sha256 and digest != expected_sha256:
        raise StageError(
            f"the manifest of {revision} ({origin}, {path}) has digest {digest}, the pinned "
            f"model_stage_manifest_sha256 is {expected_sha256}: a node or user rewrote the cached manifest, or the "
            f"pin is from another revision; {rebuild}, and if the rebuilt one still differs, check the source"
        )
    if origin != "cache" and not check_mode:
        if origin == "shipped":
            manifest["source_mtime"] = source_mtimes(src, [e["path"] for e in manifest["files"]])
        # Shared storage that every node (or, squashed, every user) may write: never through a planted link.
        try:
            safefs.write_json(cache, manifest, create_dirs=True)
        except safefs.UnsafePathError as e:
            raise StageError(f"cannot cache the manifest: {e}") from None
    return {"origin": origin, "path": cache, "manifest": manifest, "sha256": digest, "trust": trust}
