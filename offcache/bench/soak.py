"""Section soak (``python -m offcache.bench soak [--ops N]``): many store/fetch/delete
operations must keep RSS and pinned bytes flat.

Records RSS and engine bytes at intervals and the growth between the first and
last quarter of the run. tests/bench/test_soak.py runs a small version.
"""

from __future__ import annotations

import os

import torch

import offcache
from offcache.bench.common import Context


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(ops: int, device: torch.device, batches: int = 16, samples: int = 20) -> dict:
    cache = offcache.IntermediatesCache.empty(batches, "cpu")
    shared = torch.randn(64, 32, device=device)
    points = []
    for op in range(ops):
        b = op % batches
        kind = op % 3
        if kind == 0:
            cache.update(b, {"h": torch.randn(4, 256, device=device), "pos": (shared, shared * 2), "n": op})
        elif kind == 1:
            got = cache.fetch(b)
            if "h" in got and got["h"].shape != (4, 256):
                raise AssertionError(f"op {op}: wrong shape {got['h'].shape}")
        else:
            cache.delete(b)
        if op % max(1, ops // samples) == 0 or op == ops - 1:
            offcache.synchronize()
            s = offcache.stats()
            points.append({"op": op, "rss": rss_bytes(), "pinned_in_use": s["pinned_in_use_bytes"],
                           "pinned_reserved": s["pinned_reserved_bytes"]})  # fmt: skip
    del cache
    offcache.synchronize()
    end = offcache.stats()
    q = max(1, len(points) // 4)
    first, last = points[:q], points[-q:]

    def growth(key):
        return max(p[key] for p in last) - max(p[key] for p in first)

    return {
        "ops": ops,
        "device": str(device),
        "points": points,
        "rss_growth_bytes": growth("rss"),
        "pinned_in_use_growth_bytes": growth("pinned_in_use"),
        "pinned_reserved_growth_bytes": growth("pinned_reserved"),
        "pinned_in_use_after_gc": end["pinned_in_use_bytes"],
    }


def default_ops(ctx: Context) -> int:
    return 3_000 if ctx.tiny else (30_000 if ctx.quick else 100_000)


def run_soak(ctx: Context, ops: int | None = None) -> dict:
    return soak(ops or default_ops(ctx), ctx.device)


def describe(result: dict) -> str:
    return (
        f"soak: {result['ops']} ops, growth first->last quarter: rss {result['rss_growth_bytes'] >> 10} KiB, "
        f"pinned in use {result['pinned_in_use_growth_bytes']} B; after gc: {result['pinned_in_use_after_gc']} B"
    )
