"""Sections transfer, overlap and small: copy bandwidth and per-tensor overhead."""

from __future__ import annotations

import contextlib
import functools
import time

import torch

import offcache
from offcache import engine as _engine
from offcache.bench.common import Context, bump_version, gbps, median, spread, timed, timed_per_call

CPU = torch.device("cpu")


def sizes(ctx: Context) -> list[int]:
    top = 1 << 20 if ctx.tiny else (64 << 20 if ctx.quick else 1 << 30)
    out, s = [], 4096
    while s <= top:
        out.append(s)
        s *= 4
    return out


def _repeats(ctx: Context, size: int) -> int:
    if ctx.tiny:
        return 3
    return 10 if size <= (4 << 20) else (5 if size <= (256 << 20) else 3)


def _source(ctx: Context, size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, device=ctx.device).fill_(7)


def _host_buffer(ctx: Context, size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=ctx.gpu)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _raw_copy(ctx: Context, dst: torch.Tensor, src: torch.Tensor) -> None:
    """The ceiling: one non_blocking copy on a side stream (plain copy_ on CPU)."""
    if ctx.gpu:
        side = _side_stream(ctx.device)
        side.wait_stream(torch.cuda.current_stream(ctx.device))
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        torch.cuda.current_stream(ctx.device).wait_stream(side)
    else:
        dst.copy_(src)


@contextlib.contextmanager
def _baseline_threads(ctx: Context, impl: str):
    """On a CPU the baselines copy on one thread, as the host backend's copies do (one memcpy on a
    worker thread). torch's intra-op threads make a copy of 64 KiB or more a parallel region,
    which on a busy 2-core machine waits for a descheduled thread: 23 ms for a 64 KiB copy that
    takes 3 us on one thread."""
    if ctx.gpu or impl == "offcache":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_transfer(ctx: Context) -> list[dict]:
    rows = []
    for size in sizes(ctx):
        rows += _transfer_at(ctx, size)
        ctx.sync()
    return rows


def _transfer_at(ctx: Context, size: int) -> list[dict]:
    n = _repeats(ctx, size)
    src = _source(ctx, size)
    host = _host_buffer(ctx, size)
    stored = _engine.store([src], CPU)[0]
    ctx.sync()

    def store_once():
        bump_version(src)
        _engine.store([src], CPU)

    impls = {
        ("offcache", "store"): store_once,
        ("offcache", "fetch"): lambda: _engine.fetch([stored], ctx.device, True),
        ("raw_pinned", "store"): lambda: _raw_copy(ctx, host, src),
        ("raw_pinned", "fetch"): lambda: _raw_copy(ctx, src, host),
        ("pageable_to", "store"): lambda: src.to(CPU, copy=True),
        ("pageable_to", "fetch"): (lambda: host.to(ctx.device)) if ctx.gpu else (lambda: host.clone()),
    }
    rows = []
    for (impl, direction), fn in impls.items():
        before = _engine.stats()
        with _baseline_threads(ctx, impl):
            secs, calls = timed_per_call(ctx, fn, n)
        rows.append({
            "impl": impl, "direction": direction, "bytes": size, "repeats": n, "calls_per_sample": calls,
            "threads": 1 if impl != "offcache" and not ctx.gpu else None,
            "median_s": median(secs), "spread": spread(secs), "gbps": gbps(size, median(secs)),
            "gbps_min": gbps(size, max(secs)), "gbps_max": gbps(size, min(secs)),
            **(_store_counters(before, _engine.stats(), size) if (impl, direction) == ("offcache", "store") else {}),
        })  # fmt: skip
    return rows


def run_store_reuse(ctx: Context, drops: int = 16) -> dict:
    """On a CPU: a GPU's store-and-drop loop, counted on the host backend with each copy slowed
    (``host_copy_delay_us``), so every store goes through a copy stream and its result dies while the
    copy is in flight, as on a GPU. The engine is configured for it, then reconfigured as before."""
    size = (1 << 20) if ctx.tiny else (64 << 20)
    src = torch.zeros(size, dtype=torch.uint8)
    offcache.configure(backend="host", host_copy_delay_us=2000)
    try:
        _engine.store([src], CPU)  # the first store makes the value's chunk
        before = _engine.stats()
        t0 = time.perf_counter()
        for i in range(1, drops):
            src.fill_(i)  # a new version each time: no dedup hit
            _engine.store([src], CPU)
        offcache.synchronize()
        seconds = time.perf_counter() - t0
        after = _engine.stats()
        row = {"bytes": size, "copy_delay_us": 2000, **_store_counters(before, after, size)}
        row["chunks_made_after_first"] = row.pop("chunks_made")
        row["staging_reserved_over_bytes"] = round(after["staging_reserved_bytes"] / size, 3)
        row["seconds"] = seconds
    finally:
        offcache.configure()
    return row


def _store_counters(before: dict, after: dict, size: int) -> dict:
    """What the store-and-drop loop cost the arena: every value dies at once, while its copy may
    still be in flight (a GPU store), so each needs a block; ``blocks_reused_in_order`` counts those
    that took the dropped one behind its copy, ``chunks_made`` the new chunks (a pinning each)."""
    stores = max(after["stores"] - before["stores"], 1)
    return {
        "stores": stores,
        "chunks_made": after["chunks_made"] - before["chunks_made"],
        "blocks_reused_in_order": after["blocks_reused_in_order"] - before["blocks_reused_in_order"],
        "peak_pinned_reserved_over_bytes": round(after["peak_pinned_reserved_bytes"] / size, 3),
    }


def run_overlap(ctx: Context) -> list[dict]:
    """Duplex copies (D2H and H2D at once) and copy-compute overlap."""
    size = (1 << 20) if ctx.tiny else ((64 << 20) if (ctx.quick or not ctx.gpu) else (256 << 20))
    n = 3 if ctx.tiny else 5
    a = _source(ctx, size)
    stored = _engine.store([_source(ctx, size)], CPU)[0]
    ctx.sync()

    def d2h():
        bump_version(a)
        _engine.store([a], CPU)

    def h2d():
        _engine.fetch([stored], ctx.device, False)

    def both():
        bump_version(a)
        _engine.fetch([stored], ctx.device, False)
        _engine.store([a], CPU)

    t_d2h, t_h2d, t_both = (median(timed(ctx, f, n)) for f in (d2h, h2d, both))
    one_way = max(gbps(size, t_d2h), gbps(size, t_h2d))
    rows = [
        {"impl": "offcache", "case": "d2h_alone", "bytes": size, "gbps": gbps(size, t_d2h)},
        {"impl": "offcache", "case": "h2d_alone", "bytes": size, "gbps": gbps(size, t_h2d)},
        {"impl": "offcache", "case": "duplex", "bytes": 2 * size, "gbps": gbps(2 * size, t_both),
         "ratio_to_one_direction": gbps(2 * size, t_both) / one_way},
    ]  # fmt: skip

    # Copy-compute overlap: a matmul loop of known duration with a fetch beside it.
    h = 256 if ctx.tiny or not ctx.gpu else 4096
    dtype = torch.bfloat16 if ctx.gpu else torch.float32
    x = torch.randn(h, h, device=ctx.device, dtype=dtype)
    steps = _calibrate_steps(ctx, x, target_s=t_h2d)

    def compute():
        y = x
        for _ in range(steps):
            y = x @ x
        return y

    def compute_and_fetch():
        _, ticket = _engine.fetch([stored], ctx.device, False)
        compute()
        ticket.wait()

    t_c = median(timed(ctx, compute, n))
    t_x = t_h2d
    t_cx = median(timed(ctx, compute_and_fetch, n))
    hidden = max(0.0, min(1.0, (t_c + t_x - t_cx) / min(t_c, t_x))) if min(t_c, t_x) > 0 else 0.0
    rows.append({
        "impl": "offcache", "case": "copy_compute", "bytes": size, "compute_s": t_c, "copy_s": t_x,
        "both_s": t_cx, "fraction_of_copy_hidden": hidden,
        "bound_ratio": t_cx / max(t_c, t_x),
    })  # fmt: skip
    return rows


def _calibrate_steps(ctx: Context, x: torch.Tensor, target_s: float) -> int:
    ctx.sync()
    t0 = time.perf_counter()
    for _ in range(4):
        x @ x
    ctx.sync()
    per = (time.perf_counter() - t0) / 4
    return max(1, min(10_000, round(target_s / per)))


def run_small(ctx: Context) -> list[dict]:
    """1000 values of 4 KiB stored and fetched: host time per tensor."""
    count, size = (200 if ctx.tiny else 1000), 4096
    n = 3 if ctx.tiny else 10
    values = [_source(ctx, size) for _ in range(count)]
    hosts = [_host_buffer(ctx, size) for _ in range(count)]
    stored = _engine.store(values, CPU)
    ctx.sync()

    def store_all():
        _engine.store(values, CPU)

    def fetch_all():
        _engine.fetch(stored, ctx.device, True)

    def raw_store():
        for h, v in zip(hosts, values):
            h.copy_(v, non_blocking=ctx.gpu)

    def raw_fetch():
        for h, v in zip(hosts, values):
            v.copy_(h, non_blocking=ctx.gpu)

    def to_store():
        for v in values:
            v.to(CPU, copy=True)

    def bump_all():
        for v in values:
            bump_version(v)

    rows = []
    cases = [
        ("offcache", "store", store_all, bump_all),
        ("offcache", "fetch", fetch_all, None),
        ("per_tensor_copy", "store", raw_store, None),
        ("per_tensor_copy", "fetch", raw_fetch, None),
        ("pageable_to", "store", to_store, None),
    ]
    for impl, direction, fn, setup in cases:
        before = offcache.stats()
        secs = timed(ctx, (lambda _s, f=fn: f()) if setup else fn, n, setup=setup)
        row = {
            "impl": impl, "direction": direction, "count": count, "bytes_each": size,
            "us_per_tensor": median(secs) / count * 1e6, "spread": spread(secs),
        }  # fmt: skip
        if impl == "offcache":  # what each call asked of the backend (warm-up calls included)
            row["calls"] = calls_per_tensor(before, offcache.stats(), count * (n + 2))
        rows.append(row)
    return rows


COUNTERS = ("copy_calls", "stream_waits", "events_recorded", "events_created", "syncs", "host_callbacks")


def calls_per_tensor(before: dict, after: dict, tensors: int) -> dict:
    """Backend primitives per tensor between two stats() snapshots."""
    return {k: (after[k] - before[k]) / tensors for k in COUNTERS}


def run_bookkeeping(ctx: Context) -> list[dict]:
    """Host time to fetch one batch of five small tensors (hidden states, mask, position
    ids, a cos/sin tuple) through each cache: the per-batch Python bookkeeping."""
    import offcache

    def values():
        s = 8
        return {
            "hidden_states": torch.randn(1, s, 16, device=ctx.device),
            "attention_mask": torch.ones(1, 1, s, s, dtype=torch.bool, device=ctx.device),
            "position_ids": torch.arange(s, device=ctx.device)[None],
            "position_embeddings": (torch.randn(1, s, 4, device=ctx.device), torch.randn(1, s, 4, device=ctx.device)),
        }

    caches = {"offcache": offcache.IntermediatesCache}
    try:
        offcache.unpatch_llmcompressor()
        from llmcompressor.pipelines.cache import IntermediatesCache as LC

        caches["llmcompressor"] = LC
    except ImportError:
        pass
    n = 300 if ctx.tiny else 5000
    rows = []
    for offload in ("cpu", None):
        for impl, cls in caches.items():
            cache = cls.empty(1, offload)
            cache.update(0, values())

            def loop(c=cache):
                for _ in range(n):
                    c.fetch(0)  # the result is dropped, as a pipeline step drops its inputs

            secs = timed(ctx, loop, 5 if not ctx.tiny else 2)
            rows.append({
                "impl": impl, "direction": "fetch_batch_of_5", "offload_device": str(offload),
                "us_per_batch": median(secs) / n * 1e6, "spread": spread(secs),
            })  # fmt: skip
    rows += update_host_work(ctx, caches, values, n)
    return rows


def update_host_work(ctx: Context, caches: dict, values, n: int) -> list[dict]:
    """Host CPU time per ``update()`` of a new 5-tensor batch (process time: every thread, the engine's
    copy threads too), each cache storing to the CPU; the engine's disk folder in the state a new user's
    run has (``disk_folder_pending``: not made yet, so every store checks whether it is needed)."""
    from offcache.engine import disk_dir

    rows = []
    for impl, cls in caches.items():
        cpu, wall = [], []
        for _ in range(3 if ctx.tiny else 5):
            batches = [values() for _ in range(n)]  # new tensors per batch, as a pipeline makes them
            cache = cls.empty(n, "cpu")
            ctx.sync()
            c0, w0 = time.process_time(), time.perf_counter()
            for i, v in enumerate(batches):
                cache.update(i, v)
            ctx.sync()
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
            del cache, batches
        rows.append({
            "impl": impl, "direction": "update_batch_of_5", "offload_device": "cpu",
            "us_per_batch": median(wall) / n * 1e6, "cpu_us_per_batch": median(cpu) / n * 1e6,
            "spread": spread(cpu), "disk_folder_pending": disk_dir.pending(),
        })  # fmt: skip
    return rows
