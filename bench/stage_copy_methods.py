#!/usr/bin/env python3
"""Where one node's copy time goes, per copy method (the measurement behind transfer._copy_in_kernel).

Each variant copies every file of SRC into a fresh DST with 4 threads, sha256-hashes the bytes and makes
each file durable (fsync or fdatasync per file, or one syncfs at the end where the name says so); page cache
dropped before each run (root); prints wall and this process's CPU seconds:

    .venv/bin/python bench/stage_copy_methods.py SRC DST [ROUNDS]

SRC: e.g. a revision bench/stage_bench.py made (/var/tmp/llmfleet-bench/src-2g-8). DST is removed.
"""

import ctypes
import hashlib
import mmap
import os
import resource
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

SRC, DST = sys.argv[1], sys.argv[2]
files = sorted(os.listdir(SRC))


def rw(chunk):
    def one(name):
        h = hashlib.sha256()
        buf = bytearray(chunk)
        v = memoryview(buf)
        s = os.open(os.path.join(SRC, name), os.O_RDONLY)
        d = os.open(os.path.join(DST, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        while True:
            n = os.readv(s, [buf])
            if not n:
                break
            h.update(v[:n])
            w = 0
            while w < n:
                w += os.write(d, v[w:n])
        os.fsync(d)
        os.close(d)
        os.close(s)
        return h.hexdigest()

    return one


libc = ctypes.CDLL(None, use_errno=True)
libc.sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


def cfr_mmap(chunk, writeback=False, sync=os.fsync, drop_src=False):
    """copy_file_range, sha256 of the destination's pages; writeback: sync_file_range(WRITE) of each chunk
    as it lands; sync: per file (None: the caller syncs once at the end); drop_src: fadvise DONTNEED on the
    source chunk just copied."""

    def one(name):
        h = hashlib.sha256()
        s = os.open(os.path.join(SRC, name), os.O_RDONLY)
        d = os.open(os.path.join(DST, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        off = 0
        while True:
            n = os.copy_file_range(s, d, chunk)
            if not n:
                break
            mm = mmap.mmap(d, n, prot=mmap.PROT_READ, offset=off)  # off is a multiple of chunk (page aligned)
            with memoryview(mm) as v:
                h.update(v)
            mm.close()
            if writeback:
                libc.sync_file_range(d, off, n, 2)
            if drop_src:
                os.posix_fadvise(s, off, n, os.POSIX_FADV_DONTNEED)
            off += n
        if sync:
            sync(d)
        os.close(d)
        os.close(s)
        return h.hexdigest()

    return one


def direct(chunk):
    """O_DIRECT on both files: the disk reads into one page-aligned buffer, it is hashed and written back
    out (the tail padded to 4 KiB, then the file cut to size): no page-cache copy (transfer._copy_direct)."""

    def one(name):
        h = hashlib.sha256()
        buf = mmap.mmap(-1, chunk)
        v = memoryview(buf)
        s = os.open(os.path.join(SRC, name), os.O_RDONLY | os.O_DIRECT)
        d = os.open(os.path.join(DST, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
        off = 0
        while True:
            n = os.preadv(s, [buf], off)
            h.update(v[:n])
            whole = -(-n // 4096) * 4096
            os.pwrite(d, v[:whole], off)
            off += n
            if whole != n:
                os.ftruncate(d, off)
            if n < chunk:
                break
        os.fdatasync(d)
        os.close(d)
        os.close(s)
        v.release()
        buf.close()
        return h.hexdigest()

    return one


def syncfs_at_end(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        libc.syncfs(fd)
    finally:
        os.close(fd)


def mmap_src_write(chunk):
    """hash the source through mmap (no copy to user space) and write from the same mapping: one copy."""

    def one(name):
        h = hashlib.sha256()
        s = os.open(os.path.join(SRC, name), os.O_RDONLY)
        d = os.open(os.path.join(DST, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        size = os.fstat(s).st_size
        off = 0
        while off < size:
            n = min(chunk, size - off)
            mm = mmap.mmap(s, n, prot=mmap.PROT_READ, offset=off)
            mm.madvise(mmap.MADV_SEQUENTIAL)
            with memoryview(mm) as v:
                h.update(v)
                w = 0
                while w < n:
                    w += os.write(d, v[w:n])
            mm.close()
            off += n
        os.fsync(d)
        os.close(d)
        os.close(s)
        return h.hexdigest()

    return one


variants = {
    "read+hash+write 16M": rw(16 << 20),
    "copy_file_range 64M + hash dst mmap, fsync": cfr_mmap(64 << 20),
    "  + sync_file_range per chunk, fdatasync": cfr_mmap(64 << 20, True, os.fdatasync),
    "  + sync_file_range, fdatasync, 16M chunks": cfr_mmap(16 << 20, True, os.fdatasync),
    "  + sync_file_range, fdatasync, src DONTNEED": cfr_mmap(64 << 20, True, os.fdatasync, True),
    "  no per-file sync: one syncfs at the end": cfr_mmap(64 << 20, False, None),
    "mmap src 64M: hash + write": mmap_src_write(64 << 20),
    "O_DIRECT read 16M + hash + O_DIRECT write": direct(16 << 20),
}
want = None
for _round in range(int(sys.argv[3]) if len(sys.argv) > 3 else 1):
    for name, fn in variants.items():
        shutil.rmtree(DST, ignore_errors=True)
        os.makedirs(DST)
        subprocess.run(["sync"], check=True)
        open("/proc/sys/vm/drop_caches", "w").write("3\n")
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(fn, files))
        if "syncfs" in name:
            syncfs_at_end(DST)
        t = time.monotonic() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        want = want or got
        if got != want:
            raise SystemExit(f"{name}: the hashes differ from the first variant's: a broken copy")
        print(
            f"{name:46s} wall {t:5.2f} s  user {r1.ru_utime - r0.ru_utime:5.2f}  sys {r1.ru_stime - r0.ru_stime:5.2f}",
            flush=True,
        )
shutil.rmtree(DST, ignore_errors=True)
