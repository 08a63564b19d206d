"""The engine's page-cache probe against a side-effect-free one, on a cold checkpoint (2026-12-08,
benchmarks/results/2026-12-08-cpu-2core-weights-disk-read.md): `python benchmarks/checkpoint_probe.py [MiB]`.

Three sequential reads of the same files in 8 MiB pieces, each after the files' pages are dropped:
raw O_DIRECT; the engine's pattern (``preadv2(RWF_NOWAIT)`` on a buffered descriptor, O_DIRECT where
the piece is not cached: the probe starts the kernel's readahead of the piece, so the disk is asked
for it twice); and the fix proposed for csrc/core/disk_file.cpp's ``read_if_cached``: ``cachestat``
(Linux 6.5+, syscall 451 on x86-64) says how much of the piece is cached, with no read, before any
``RWF_NOWAIT`` read. Prints GB/s and storage bytes read (/proc/self/io) over the bytes, 3 rounds.
"""

import ctypes
import mmap
import os
import shutil
import sys
import tempfile
import time

from offcache.bench import checkpoint_read as cr

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_CACHESTAT = 451  # x86-64


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def cached_pages(fd: int, offset: int, length: int) -> int:
    stat, span = _Stat(), _Range(offset, length)
    if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat), 0) != 0:
        raise OSError(ctypes.get_errno(), "cachestat")
    return stat.cache


def cachestat_read(paths):
    buf = mmap.mmap(-1, cr.PIECE)
    view = memoryview(buf)
    total = cached = 0
    t0 = time.perf_counter()
    for path in paths:
        fd, direct = os.open(path, os.O_RDONLY), os.open(path, os.O_RDONLY | os.O_DIRECT)
        size = os.fstat(fd).st_size
        for off in range(0, size, cr.PIECE):
            need = min(cr.PIECE, size - off)
            if cached_pages(fd, off, need) * mmap.PAGESIZE >= need:
                cached += 1
                total += os.preadv(fd, [view[:need]], off, os.RWF_NOWAIT)
            else:
                total += os.preadv(direct, [view[: cr.PIECE]], off)
        os.close(fd)
        os.close(direct)
    seconds = time.perf_counter() - t0
    view.release()
    buf.close()
    return seconds, total, cached


def main(mib: int) -> None:
    folder = tempfile.mkdtemp(prefix="offcache-probe-", dir=os.environ.get("OFFCACHE_BENCH_DISK_DIR") or None)
    try:
        paths = cr.write_checkpoint(folder, mib << 20)
        for _ in range(3):
            for name, read in (("raw O_DIRECT", cr.raw_read), ("cachestat probe", cachestat_read),
                               ("RWF_NOWAIT probe", cr.probed_read)):  # fmt: skip
                cr.drop_page_cache(paths)
                before = cr.storage_read_bytes()
                seconds, nbytes, _ = read(paths)
                storage = cr.storage_read_bytes() - before
                print(f"{name:17} {nbytes / seconds / 1e9:.2f} GB/s, storage read {storage / nbytes:.2f}x", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 512)
