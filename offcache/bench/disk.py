"""Section disk: the disk tier against raw sequential I/O, and the pipeline with it forced.

Throughput: `values` tensors stored through the disk tier (host limit 0: every byte goes
to a file) and fetched back, against a raw O_DIRECT sequential write and read of the same
bytes in the same folder, in the same run. Checkpoint: the engine's cold read of a
checkpoint's safetensors files (disk-offloaded weights' onloads) against a raw O_DIRECT read
of the same files (checkpoint_read.py). Pipeline: the sequential-pipeline simulation
(pipeline.run_one) with a host limit far below the data, iter vs iter_prefetch, and the
read time prefetch hides against its bound, min(read time, compute time).

The folder is OFFCACHE_BENCH_DISK_DIR, else the system's temp folder.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
import warnings

import torch

import offcache
from offcache import engine as _engine
from offcache.bench.common import Context, bench_disk_dir, median
from offcache.bench.pipeline import Shape, run_one

PIECE = 8 << 20  # the engine's disk piece: the raw baseline moves the same pieces


def _folder() -> str:
    return tempfile.mkdtemp(prefix="offcache-bench-disk-", dir=bench_disk_dir())


def _raw(folder: str, total: int) -> tuple[float, float]:
    """Seconds to write then read `total` bytes sequentially with O_DIRECT (buffered if refused)."""
    path = os.path.join(folder, "raw")
    buf = mmap.mmap(-1, PIECE)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(1 << 16) * (PIECE >> 16))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.unlink(path)
        os.posix_fallocate(fd, 0, total)  # the engine reserves its files' space too

        def write_all():
            for off in range(0, total, PIECE):
                os.pwritev(fd, [memoryview(buf)[: min(PIECE, total - off)]], off)

        write_all()  # untimed: the engine's timed round also reuses file space it wrote before
        t0 = time.perf_counter()
        write_all()
        write = time.perf_counter() - t0
        t0 = time.perf_counter()
        for off in range(0, total, PIECE):
            os.preadv(fd, [memoryview(buf)[: min(PIECE, total - off)]], off)
        read = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
    return write, read


def _store_fetch(src: list[torch.Tensor]) -> tuple[float, float, list[torch.Tensor]]:
    cpu = torch.device("cpu")
    offcache.synchronize()
    t0 = time.perf_counter()
    stored = _engine.store(src, cpu)
    offcache.synchronize()  # the disk writes are in flight until here
    store = time.perf_counter() - t0
    t0 = time.perf_counter()
    got, ticket = _engine.fetch(stored, cpu)
    ticket.wait()
    fetch = time.perf_counter() - t0
    assert all(torch.equal(a, b) for a, b in zip(src, got))
    return store, fetch, stored


def _through_engine(folder: str | None, sizes: list[int]) -> tuple[float, float, dict]:
    """Seconds to store (until written) and fetch `sizes` float32 values, through the disk tier
    (host limit 0) or, without a folder, through host memory. One untimed round first: the
    engine's buffers are made once per run, as the raw baseline's one buffer is."""
    if folder:
        offcache.configure(host_limit=0, disk_dir=folder)
    else:
        offcache.configure()
    src = [torch.randn(n // 4) for n in sizes]
    _store_fetch(src)
    store, fetch, stored = _store_fetch(src)
    assert all(_engine.is_disk_tensor(t) == bool(folder) for t in stored)
    stats = offcache.stats()
    del stored
    offcache.synchronize()
    return store, fetch, stats


def run_throughput(ctx: Context) -> list[dict]:
    total = (64 if ctx.tiny else 256 if ctx.quick else 1024) << 20
    value = 32 << 20 if not ctx.tiny else 8 << 20
    sizes = [value] * (total // value)
    repeats = 1 if ctx.tiny else 3
    folder = _folder()
    rows = []
    try:
        raws, ours, mems = [], [], []
        for _ in range(repeats):  # interleaved, so drift hits all alike
            raws.append(_raw(folder, total))
            ours.append(_through_engine(folder, sizes))
            mems.append(_through_engine(None, sizes))
        offcache.configure()
        stats = ours[-1][2]
        for k, direction in enumerate(("store", "fetch")):
            raw = median([x[k] for x in raws])
            our = median([x[k] for x in ours])
            mem = median([x[k] for x in mems])
            rows.append({
                "direction": direction, "bytes": total, "value_bytes": value,
                "raw_gbps": total / raw / 1e9, "offcache_gbps": total / our / 1e9, "ratio": raw / our,
                "memory_tier_gbps": total / mem / 1e9, "disk_fallbacks": stats["disk_fallbacks"],
            })  # fmt: skip
    finally:
        offcache.configure()
        os.rmdir(folder)
    return rows


def run_disk_pipeline(ctx: Context) -> dict:
    """iter vs iter_prefetch with the disk tier forced; the hidden read time against its bound."""
    shape = Shape.for_context(ctx)
    if not ctx.tiny and not ctx.gpu:
        # 8 MiB per batch against one [256, 256] product: reads are a fair part of the time.
        shape = Shape(shape.batches, 2, 2048, 256, 1)
    folder = _folder()
    out: dict = {"shape": vars(shape)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", offcache.SpillWarning)  # the disk tier is used on purpose
        _pipeline_runs(ctx, shape, folder, out)
    read = out["iter"]["disk_read_seconds"]
    hidden = out["iter"]["wall_s"] - out["iter_prefetch"]["wall_s"]
    bound = min(read, out["compute_only"]["wall_s"])
    out.update(hidden_read_s=hidden, hide_bound_s=bound, hidden_fraction=hidden / bound if bound > 0 else 0.0)
    return out


def _pipeline_runs(ctx: Context, shape: Shape, folder: str, out: dict) -> None:
    try:
        limit = 0 if ctx.tiny else "1MiB"  # the tiny shape's data would fit in 1 MiB
        repeats = 1 if ctx.tiny else 3
        runs: dict[str, list[dict]] = {"iter": [], "iter_prefetch": [], "in_memory": [], "compute_only": []}
        offcache.configure(disk_dir=folder, host_limit=limit)
        run_one(ctx, shape, offcache.IntermediatesCache, "cpu", False)  # untimed: files and buffers made
        for _ in range(repeats):  # interleaved, so drift hits all alike
            offcache.configure(disk_dir=folder, host_limit=limit)
            for prefetch in (False, True):
                before = offcache.stats()
                row = run_one(ctx, shape, offcache.IntermediatesCache, "cpu", prefetch)
                after = offcache.stats()
                for key in ("read_seconds", "read_bytes", "write_bytes"):
                    row[f"disk_{key}"] = after[f"disk_{key}"] - before[f"disk_{key}"]
                runs["iter_prefetch" if prefetch else "iter"].append(row)
            offcache.configure()
            runs["in_memory"].append(run_one(ctx, shape, offcache.IntermediatesCache, "cpu", False))
            runs["compute_only"].append(run_one(ctx, shape, offcache.IntermediatesCache, None, False))
        for name, rows in runs.items():  # the run of median wall time
            out[name] = sorted(rows, key=lambda r: r["wall_s"])[len(rows) // 2]
    finally:
        offcache.configure()
        os.rmdir(folder)


def run_disk(ctx: Context) -> dict:
    from offcache.bench.checkpoint_read import run_checkpoint_read

    return {"throughput": run_throughput(ctx), "pipeline": run_disk_pipeline(ctx),
            "checkpoint": run_checkpoint_read(ctx)}  # fmt: skip


def summary_lines(r: dict) -> list[str]:
    lines = ["disk tier vs raw O_DIRECT sequential I/O (GB/s):"]
    for x in r["throughput"]:
        lines.append(
            f"  {x['direction']:5}: offcache {x['offcache_gbps']:.2f} | raw {x['raw_gbps']:.2f} | "
            f"{100 * x['ratio']:.0f}% of raw | memory tier {x['memory_tier_gbps']:.2f}"
        )
    if r.get("checkpoint"):
        from offcache.bench.checkpoint_read import probe_line, summary_line

        lines += [line for line in (summary_line(r["checkpoint"]), probe_line(r["checkpoint"])) if line]
    p = r["pipeline"]
    lines.append(
        f"  pipeline (disk tier forced): iter {p['iter']['wall_s']:.2f}s, iter_prefetch "
        f"{p['iter_prefetch']['wall_s']:.2f}s, in memory {p['in_memory']['wall_s']:.2f}s; prefetch hides "
        f"{p['hidden_read_s']:.2f}s of {p['iter']['disk_read_seconds']:.2f}s read (bound {p['hide_bound_s']:.2f}s, "
        f"{100 * p['hidden_fraction']:.0f}%)"
    )
    return lines
