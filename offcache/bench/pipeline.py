"""Sections pipeline and pinned: a simulated llm-compressor sequential pipeline.

B batches x L layers. Each batch holds hidden states [1, S, H] (bf16 on GPU),
an attention mask, position ids and a (cos, sin) tuple. Each layer makes two
passes as llm-compressor does: a calibration pass (fetch -> compute) and a
propagation pass (fetch -> compute -> update -> delete).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

import offcache
from offcache.bench.common import Context, median, spread
from offcache.bench.transfer import calls_per_tensor


@dataclass
class Shape:
    batches: int
    layers: int
    seq: int
    hidden: int
    matmuls: int  # per batch and pass: the layer's compute

    @classmethod
    def for_context(cls, ctx: Context) -> Shape:
        if ctx.tiny:
            return cls(4, 2, 32, 64, 1)
        if not ctx.gpu:  # big enough that a run takes a fraction of a second
            return cls(8 if ctx.quick else 16, 2 if ctx.quick else 3, 512, 512, 2)
        return cls(16 if ctx.quick else 64, 2 if ctx.quick else 4, 2048, 4096, 8)


def make_batch(ctx: Context, shape: Shape, seed: int, dtype: torch.dtype | None = None) -> dict:
    g = torch.Generator(device=ctx.device).manual_seed(seed)
    dtype = dtype or (torch.bfloat16 if ctx.gpu else torch.float32)
    s, h = shape.seq, shape.hidden
    return {
        "h0": torch.randn(1, s, h, generator=g, device=ctx.device).to(dtype),
        "attention_mask": torch.ones(1, 1, s, s, dtype=torch.bool, device=ctx.device).tril(),
        "position_ids": torch.arange(s, device=ctx.device).unsqueeze(0),
        "position_embeddings": (
            torch.randn(1, s, 128, generator=g, device=ctx.device).to(dtype),
            torch.randn(1, s, 128, generator=g, device=ctx.device).to(dtype),
        ),
    }


def implementations(ctx: Context) -> dict:
    """name -> (cache class, offload device, prefetch depth: 0 for iter())."""
    impls = {
        "offcache_iter": (offcache.IntermediatesCache, "cpu", 0),
        "offcache_iter_prefetch": (offcache.IntermediatesCache, "cpu", 1),
        "offcache_iter_prefetch_depth2": (offcache.IntermediatesCache, "cpu", 2),
    }
    try:
        offcache.unpatch_llmcompressor()
        from llmcompressor.pipelines.cache import IntermediatesCache as LC

        impls["llmcompressor_iter"] = (LC, "cpu", 0)
        impls["llmcompressor_iter_prefetch"] = (LC, "cpu", 1)
    except ImportError:
        pass
    impls[baseline(ctx)] = (offcache.IntermediatesCache, None, 0)
    return impls


def baseline(ctx: Context) -> str:
    """The row with no offload: values stay where they were computed (on a GPU, the ideal)."""
    return "ideal_on_gpu" if ctx.gpu else "no_offload"


def _layer(x: torch.Tensor, weight: torch.Tensor, matmuls: int) -> torch.Tensor:
    """The simulated layer's compute: `matmuls` products with an [H, H] weight."""
    for _ in range(matmuls):
        x = torch.tanh(x @ weight)
    return x


def run_one(ctx: Context, shape: Shape, cls, offload, prefetch: int) -> dict:
    """One pipeline run; `prefetch` is iter_prefetch's depth (0: iter())."""
    dtype = torch.bfloat16 if ctx.gpu else torch.float32
    weight = torch.randn(shape.hidden, shape.hidden, device=ctx.device, dtype=dtype) / shape.hidden**0.5
    cache = cls.empty(shape.batches, offload)
    for b in range(shape.batches):
        cache.update(b, make_batch(ctx, shape, b))
    ctx.sync()
    if ctx.gpu:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    peak_host = 0

    def layer(x):
        return _layer(x, weight, shape.matmuls)

    before = offcache.stats()
    t0 = time.perf_counter()
    for li in range(shape.layers):
        names = [f"h{li}", "attention_mask", "position_ids", "position_embeddings"]
        for propagate in (False, True):
            if not prefetch:
                batches = cache.iter(names)
            elif prefetch > 1:
                batches = cache.iter_prefetch(names, depth=prefetch)
            else:
                batches = cache.iter_prefetch(names)
            for b, inputs in enumerate(batches):
                out = layer(inputs[f"h{li}"])
                if propagate:
                    cache.update(b, {f"h{li + 1}": out})
                    cache.delete(b, [f"h{li}"])
        peak_host = max(peak_host, cache.size().get(torch.device("cpu"), 0))
    ctx.sync()
    wall = time.perf_counter() - t0
    row = {"wall_s": wall, "peak_host_live_bytes": peak_host, "prefetch_depth": prefetch}
    if cls is offcache.IntermediatesCache and offload is not None:
        steps = shape.layers * 2 * shape.batches  # batch fetches (and half as many updates)
        row["calls_per_batch"] = calls_per_tensor(before, offcache.stats(), steps)
    if ctx.gpu:
        row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
    del cache
    ctx.sync()
    return row


def run_pipeline(ctx: Context) -> tuple[list[dict], list[dict], dict]:
    """Each implementation runs `repeats` times, interleaved; wall_s is the median."""
    shape = Shape.for_context(ctx)
    impls = implementations(ctx)
    repeats = 1 if ctx.tiny else 3
    runs: dict[str, list[dict]] = {name: [] for name in impls}
    for _ in range(repeats):
        for name, (cls, offload, prefetch) in impls.items():
            before = offcache.stats()
            row = run_one(ctx, shape, cls, offload, prefetch)
            if name.startswith("offcache") and offload is not None:
                row["dedup_hits"] = offcache.stats()["dedup_hits"] - before["dedup_hits"]
            runs[name].append(row)
    rows = []
    for name, rs in runs.items():
        walls = [r["wall_s"] for r in rs]
        row = {
            **rs[-1],
            "impl": name,
            "wall_s": median(walls),
            "spread": spread(walls),
            "repeats": repeats,
            "wall_min_s": min(walls),
            "wall_max_s": max(walls),
        }
        if name.startswith("offcache") and impls[name][1] is not None:
            row["peak_pinned_reserved_bytes"] = offcache.stats()["peak_pinned_reserved_bytes"]
        rows.append({**row, **shape.__dict__})
    ideal = next(r for r in rows if r["impl"] == baseline(ctx))["wall_s"]
    # The copy bound: the same loop through offcache's prefetch with no compute.
    no_compute = dataclasses.replace(shape, matmuls=0)
    copies = median([run_one(ctx, no_compute, offcache.IntermediatesCache, "cpu", 1)["wall_s"] for _ in range(repeats)])
    for r in rows:
        r["vs_ideal"] = r["wall_s"] / ideal
        r["bound_ratio"] = r["wall_s"] / max(ideal, copies)
    rows.append({"impl": "copies_alone", "wall_s": copies, **shape.__dict__})
    return rows, run_pinned(ctx, shape), run_timeline(ctx, shape)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def run_pinned(ctx: Context, shape: Shape) -> list[dict]:
    """Pinned bytes reserved / live bytes, offcache's arena vs PyTorch's pinned allocator."""
    if not ctx.tiny:  # realistic sizes even on CPU: the ratio is about sizes, not speed
        shape = Shape(batches=16 if ctx.quick else 64, layers=1, seq=2048, hidden=4096, matmuls=0)
    offcache.empty_cache()  # nothing else is alive: what the arena reserves from here is for this cache
    grown = offcache.stats()
    cache = offcache.IntermediatesCache.empty(shape.batches, "cpu")
    # Calibration samples differ in length: vary the sequence length per batch.
    values = [
        make_batch(ctx, dataclasses.replace(shape, seq=shape.seq - (37 * b) % (shape.seq // 2)), b, torch.bfloat16)
        for b in range(shape.batches)
    ]
    for b, v in enumerate(values):
        cache.update(b, v)
    offcache.synchronize()
    s = offcache.stats()
    live = sum(cache.size().values())
    # Only this cache is alive now, so everything the arena reserves is for it.
    chunk_gib = (s["chunk_bytes"] - grown["chunk_bytes"]) / 2**30
    rows = [{
        "impl": "offcache_arena", "live_bytes": live, "reserved_bytes": s["pinned_reserved_bytes"],
        "ratio": s["pinned_reserved_bytes"] / live if live else None,
        "method": "measured (engine stats)",
        # Making chunks: mmap, pre-faulting and (on CUDA) cudaHostRegister, per GiB.
        "pinning_s_per_gib": (s["chunk_seconds"] - grown["chunk_seconds"]) / chunk_gib if chunk_gib else None,
        "pinned": s["pinned"],
    }]  # fmt: skip
    tensors = [t for v in values for t in (v["h0"], v["attention_mask"], v["position_ids"], *v["position_embeddings"])]
    if ctx.gpu and hasattr(torch.cuda, "host_memory_stats"):
        torch.cuda.host_memory_stats()  # initialise
        before = torch.cuda.host_memory_stats().get("reserved_bytes.current", 0)
        pinned = [t.to("cpu").pin_memory() for t in tensors]
        reserved = torch.cuda.host_memory_stats().get("reserved_bytes.current", 0) - before
        method = "measured (torch.cuda.host_memory_stats)"
        del pinned
    else:
        # PyTorch's CachingHostAllocator rounds every block up to a power of two.
        reserved = sum(_pow2(t.nbytes) for t in tensors)
        method = "model: CachingHostAllocator's power-of-two rounding (no GPU to pin with)"
    live_t = sum(t.nbytes for t in tensors)
    row = {
        "impl": "torch_pin_memory",
        "live_bytes": live_t,
        "reserved_bytes": reserved,
        "ratio": reserved / live_t if live_t else None,
        "method": method,
    }
    if ctx.gpu:  # a fresh pinned block from PyTorch's host allocator: cudaHostAlloc, per GiB
        size = (1 << 30) + (3 << 20)  # a size the allocator has not cached
        t0 = time.perf_counter()
        block = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        row["pinning_s_per_gib"] = (time.perf_counter() - t0) / (size / 2**30)
        del block
    rows.append(row)
    del cache
    offcache.synchronize()
    return rows


def run_timeline(ctx: Context, shape: Shape) -> dict:
    """Copy batches on the D2H and H2D streams and the compute, for a few propagation
    steps of offcache's iter_prefetch, in ms from one origin (events on the GPU)."""
    steps = min(shape.batches, 6)
    dtype = torch.bfloat16 if ctx.gpu else torch.float32
    weight = torch.randn(shape.hidden, shape.hidden, device=ctx.device, dtype=dtype) / shape.hidden**0.5
    cache = offcache.IntermediatesCache.empty(steps, "cpu")
    for b in range(steps):
        cache.update(b, make_batch(ctx, shape, b))
    names = ["h0", "attention_mask", "position_ids", "position_embeddings"]
    marks = []
    ctx.sync()
    offcache.engine.trace_start(ctx.device)
    if ctx.gpu:
        origin = torch.cuda.Event(enable_timing=True)
        origin.record()
    t0 = time.perf_counter()
    for b, inputs in enumerate(cache.iter_prefetch(names)):
        if ctx.gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = _layer(inputs["h0"], weight, shape.matmuls)
            end.record()
            marks.append((start, end))
        else:
            start = time.perf_counter() - t0
            out = _layer(inputs["h0"], weight, shape.matmuls)
            marks.append((start, time.perf_counter() - t0))
        cache.update(b, {"h1": out})
        cache.delete(b, ["h0"])
    ctx.sync()
    copies = offcache.engine.trace_stop()
    if ctx.gpu:
        compute = [(origin.elapsed_time(s), origin.elapsed_time(e)) for s, e in marks]
    else:
        compute = [(s * 1e3, e * 1e3) for s, e in marks]
    return {
        "steps": steps,
        "origin": "CUDA events on the current stream" if ctx.gpu else "host clock (approximate, host backend)",
        "copies": copies,
        "compute": [{"start_ms": s, "end_ms": e} for s, e in compute],
    }
