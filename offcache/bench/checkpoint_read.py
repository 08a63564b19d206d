"""The disk section's checkpoint row: the engine's cold read of a checkpoint's safetensors files
against a raw sequential O_DIRECT read of the same files, on the same disk, in the same run.

This is the read ``patch_llmcompressor(weights=True)`` makes for weights placed on disk by
``load_offloaded_model(device_map="auto_offload")``: ``OffcacheDiskCache`` reads each tensor from
the checkpoint's own file with the engine's ``fetch_file``, one call per file per subgraph. Here
every file's tensors are fetched in one call per file (issued one after the other, waited at the
end), onto the CPU. Before each read, timed or raw, the files' pages are dropped from the page
cache (fsync, then ``posix_fadvise(DONTNEED)``): both reads are cold. The raw read is the file
whole, header included, in 8 MiB pieces into one page-aligned buffer; the engine's is the tensors'
bytes. Each side's GB/s is its own bytes over its own time; ``ratio`` is the engine's over the
raw's (the issue's target: 90 %).

The checkpoint is written here (random bf16 tensors of a Llama's layer shapes, the safetensors
format written directly) under OFFCACHE_BENCH_DISK_DIR, else the system's temp folder.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import tempfile
import time

import torch

import offcache
from offcache import engine as _engine
from offcache.bench.common import Context, bench_disk_dir, median
from offcache.weights.files import DTYPES

PIECE = 8 << 20  # the engine's file piece: the raw read moves the same pieces
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def write_checkpoint(folder: str, total: int, hidden: int = 2048, shard: int = 256 << 20) -> list[str]:
    """Safetensors shards of about `shard` bytes holding `total` bytes of bf16 layer weights
    ([hidden, hidden] attention and [4 * hidden, hidden] MLP shapes), fsynced."""
    shapes = [(hidden, hidden)] * 4 + [(4 * hidden, hidden)] * 3
    paths: list[str] = []
    written, layer = 0, 0
    g = torch.Generator().manual_seed(0)
    while written < total:
        tensors: dict[str, torch.Tensor] = {}
        size = 0
        while size < shard and written + size < total:
            for i, shape in enumerate(shapes):
                t = torch.randint(-(1 << 14), 1 << 14, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)
                tensors[f"model.layers.{layer}.w{i}"] = t
                size += t.nbytes
            layer += 1
        paths.append(_save(os.path.join(folder, f"model-{len(paths):05d}.safetensors"), tensors))
        written += size
    return paths


def _save(path: str, tensors: dict[str, torch.Tensor]) -> str:
    meta, offset = {}, 0
    for name, t in tensors.items():
        meta[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    head = json.dumps(meta).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for t in tensors.values():
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    return path


def drop_page_cache(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def storage_read_bytes() -> int:
    """This process's bytes read from storage so far (/proc/self/io read_bytes; 0 where unreadable)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration):
        return 0


def raw_read(paths: list[str]) -> tuple[float, int, bool]:
    """Seconds to read `paths` whole, one after the other, with O_DIRECT in 8 MiB pieces; bytes read;
    whether O_DIRECT was refused (then buffered)."""
    buf = mmap.mmap(-1, PIECE)  # page-aligned, as O_DIRECT needs
    view = memoryview(buf)
    total, refused = 0, False
    try:
        t0 = time.perf_counter()
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                fd, refused = os.open(path, os.O_RDONLY), True
            try:
                size = os.fstat(fd).st_size
                for off in range(0, size, PIECE):
                    total += os.preadv(fd, [view[:PIECE]], off)
            finally:
                os.close(fd)
        seconds = time.perf_counter() - t0
    finally:
        view.release()
        buf.close()
    return seconds, total, refused


def probed_read(paths: list[str]) -> tuple[float, int, int]:
    """raw_read with the engine's page-cache probe before each piece (``preadv2(RWF_NOWAIT)`` on a
    buffered descriptor; O_DIRECT where it finds the piece not cached): seconds, bytes, pieces the probe
    found cached. Tells the probe's cost apart from the engine's copies."""
    buf = mmap.mmap(-1, PIECE)
    view = memoryview(buf)
    total, cached = 0, 0
    try:
        t0 = time.perf_counter()
        for path in paths:
            fd, direct = os.open(path, os.O_RDONLY), os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                size = os.fstat(fd).st_size
                for off in range(0, size, PIECE):
                    need = min(PIECE, size - off)
                    try:
                        got = os.preadv(fd, [view[:need]], off, os.RWF_NOWAIT)
                    except BlockingIOError:
                        got = 0
                    if got == need:
                        cached += 1
                    else:
                        got = os.preadv(direct, [view[:PIECE]], off)
                    total += got
            finally:
                os.close(fd)
                os.close(direct)
        seconds = time.perf_counter() - t0
    finally:
        view.release()
        buf.close()
    return seconds, total, cached


def _items(path: str) -> list[tuple[int, list[int], torch.dtype]]:
    from offcache.weights.files import header, locate

    parsed, _ = header(path)
    out = [locate(path, name) for name in parsed if name != "__metadata__"]
    return sorted(out, key=lambda item: item[0])


def engine_read(paths: list[str]) -> tuple[float, int, dict]:
    """Seconds for the engine's fetch_file of every tensor of `paths` onto the CPU (one call per file,
    all issued, then waited); bytes fetched; the engine's file counters over the read."""
    cpu = torch.device("cpu")
    items = {path: _items(path) for path in paths}
    before, storage = offcache.stats(), storage_read_bytes()
    t0 = time.perf_counter()
    fetched = [_engine.fetch_file(path, items[path], cpu, wait=False) for path in paths]
    for _, ticket in fetched:
        ticket.wait()
    seconds = time.perf_counter() - t0
    after = offcache.stats()
    nbytes = sum(t.nbytes for tensors, _ in fetched for t in tensors)
    keys = ("file_fetches", "file_read_bytes", "file_cached_reads", "file_buffered_reads", "file_read_seconds")
    out = {k: after[k] - before[k] for k in keys}
    out["storage_read_bytes"] = storage_read_bytes() - storage  # what the disk was asked for
    return seconds, nbytes, out


def run_checkpoint_read(ctx: Context) -> dict:
    total = (64 if ctx.tiny else 512 if ctx.quick else 2048) << 20
    repeats = 1 if ctx.tiny else 3
    folder = tempfile.mkdtemp(prefix="offcache-bench-checkpoint-", dir=bench_disk_dir())
    try:
        paths = write_checkpoint(folder, total, hidden=512 if ctx.tiny else 2048, shard=min(total, 256 << 20))
        offcache.configure()
        engine_read(paths[:1])  # untimed: the engine's bounce buffers are made once per run
        raws, ours, probes = [], [], []
        for _ in range(repeats):  # interleaved, so drift hits both alike
            drop_page_cache(paths)
            storage = storage_read_bytes()
            raws.append((*raw_read(paths), storage_read_bytes() - storage))
            drop_page_cache(paths)
            ours.append(engine_read(paths))
            if hasattr(os, "RWF_NOWAIT") and not raws[-1][2]:  # O_DIRECT refused: no probe row
                drop_page_cache(paths)
                storage = storage_read_bytes()
                probes.append((*probed_read(paths), storage_read_bytes() - storage))
        raw_s, ours_s = median([r[0] for r in raws]), median([o[0] for o in ours])
        raw_bytes, our_bytes = raws[0][1], ours[0][1]
        counters = sorted(ours, key=lambda o: o[0])[len(ours) // 2][2]
        raw_gbps, our_gbps = raw_bytes / raw_s / 1e9, our_bytes / ours_s / 1e9
        return {
            "files": len(paths), "file_bytes": raw_bytes, "tensor_bytes": our_bytes, "repeats": repeats,
            "raw_gbps": raw_gbps, "offcache_gbps": our_gbps, "ratio": our_gbps / raw_gbps,
            "raw_seconds": [r[0] for r in raws], "offcache_seconds": [o[0] for o in ours],
            "raw_direct": not raws[0][2], "raw_storage_read_bytes": raws[0][3], "counters": counters,
            "probed": probes and {
                "gbps": probes[0][1] / median([p[0] for p in probes]) / 1e9, "seconds": [p[0] for p in probes],
                "cached_pieces": probes[0][2], "storage_read_bytes": probes[0][3],
            },
        }  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def summary_line(r: dict) -> str:
    c = r["counters"]
    return (f"  checkpoint read, cold ({r['files']} files, {r['tensor_bytes'] / 2**30:.2f} GiB): offcache "
            f"{r['offcache_gbps']:.2f} | raw O_DIRECT {r['raw_gbps']:.2f} | {100 * r['ratio']:.0f}% of raw "
            f"(target 90%); storage read {c['storage_read_bytes'] / r['tensor_bytes']:.2f}x the tensors' bytes "
            f"(raw {r['raw_storage_read_bytes'] / r['file_bytes']:.2f}x)")  # fmt: skip


def probe_line(r: dict) -> str:
    p = r.get("probed")
    if not p:
        return ""
    return (
        f"  raw O_DIRECT after the engine's page-cache probe (preadv2 RWF_NOWAIT) per piece: {p['gbps']:.2f} GB/s, "
        f"{p['cached_pieces']} pieces found cached, storage read {p['storage_read_bytes'] / r['file_bytes']:.2f}x"
    )
