"""Section kv (``python -m offcache.bench kv``): the measurement protocol for offloaded KV caches.

Held fixed: model, dtype, prompt tokens, max_new_tokens and greedy decoding.
Compared, dynamic cases: DynamicCache, transformers' offloaded cache, offcache.OffloadedKVCache;
static cases (``static``: max_cache_len = the filled length; ``static_4x``: 4x it): StaticCache
resident, StaticCache(offloading=True), offcache.OffloadedStaticKVCache, with generate's
automatic compilation off (eager forward: the rows differ only by cache; on a GPU the
``static_compiled`` case turns it back on).
Recorded per implementation: completion (an OOM is a failure, not speed 0),
tokens generated, peak GPU and host memory, time to first token and decode
tokens/s (median and spread over repeats, a short warm-up kept apart), bytes
moved per decode step D2H and H2D (offcache: offcache.stats() deltas; transformers'
offloading: its buffer sizes), and whether the output equals the reference's
(DynamicCache for dynamic cases, StaticCache for static ones).
offcache's rows also carry ``per_layer_step``: the decode steps' work per offloaded layer and
step (H2D copies, output allocations, D2H bytes over the new tokens' bytes, host-to-host bytes,
pinned chunks made), from the engine's counters and offcache.kv.counters (issue 41).
The step clock waits on an event of the current stream, never for the whole device.
"""

from __future__ import annotations

import resource
import time

import torch

import offcache
from offcache.bench.common import Context, env_choice, median, spread
from offcache.bench.models import causal_lm


def _model(ctx: Context):
    if ctx.gpu:  # 8B-like layer shapes, fewer layers, random weights (no download)
        return causal_lm("llama", ctx.device, torch.bfloat16, vocab_size=32000, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=4 if ctx.quick else 8, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=65536)  # fmt: skip
    return causal_lm("llama", ctx.device, torch.float32, vocab_size=256, hidden_size=128, intermediate_size=256,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=4096)  # fmt: skip


def _stream_waiter(ctx: Context):
    """Waits for the work queued so far on the current stream (an event of it; on the CPU nothing
    to wait for), not for the whole device: copies another stream still runs ahead for the next
    step are not waited for, for any cache."""
    if not ctx.gpu:
        return lambda: None

    def wait():
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(ctx.device))
        event.synchronize()

    return wait


def _counters() -> dict:
    """The engine's copy counters and the KV caches' own (offcache.kv.counters), now."""
    from offcache.kv.counters import kv_stats

    s = offcache.stats()
    keys = ("d2h_bytes", "h2d_bytes", "d2h_copies", "h2d_copies", "chunks_made")
    return {**{k: s[k] for k in keys}, **kv_stats()}


class _StepClock:
    """A logits processor that timestamps every generated token and snapshots the copy counters."""

    def __init__(self, wait):
        self.wait = wait
        self.times: list[float] = []
        self.counters: list[dict] = []  # read as copies are issued, after each forward

    def __call__(self, input_ids, scores):
        self.wait()
        self.times.append(time.perf_counter())
        self.counters.append(_counters())
        return scores


def per_layer_step(first: dict, last: dict) -> dict:
    """The decode steps' work per offloaded layer and step, from two _counters() snapshots: H2D
    copies, output allocations, D2H bytes over the new tokens' bytes (the engine's d2h_bytes, which
    include the host-to-host copies; and without them), host-to-host bytes over the new tokens'
    bytes, and the pinned chunks made in all (the arena growing)."""
    d = {k: last[k] - first[k] for k in first}
    steps, new = d["kv_layer_updates"], d["kv_new_token_bytes"]
    if not steps or not new:
        return {}
    return {
        "layer_steps": steps,
        "h2d_copies": d["h2d_copies"] / steps,
        "output_allocations": d["kv_output_allocations"] / steps,
        "d2h_bytes_over_new": d["d2h_bytes"] / new,
        "d2h_bytes_over_new_without_host_copies": (d["d2h_bytes"] - d["kv_host_copy_bytes"]) / new,
        "host_copy_bytes_over_new": d["kv_host_copy_bytes"] / new,
        "pinned_chunks_made": d["chunks_made"],
    }


# transformers' offloaded caches move layers with CUDA streams and events: they need a GPU.
NEEDS_GPU = {
    "transformers_offloaded": "needs a GPU: transformers' DynamicCache(offloading=True) uses CUDA streams",
    "transformers_static_offloaded": "needs a GPU: transformers' StaticCache(offloading=True) uses CUDA streams",
}


def _caches(model):
    import transformers

    return {
        "dynamic": lambda: transformers.DynamicCache(config=model.config),
        "transformers_offloaded": lambda: transformers.DynamicCache(config=model.config, offloading=True),
        "offcache": lambda: offcache.OffloadedKVCache(config=model.config),
    }


def _static_caches(model, max_cache_len: int, compiled: bool = False):
    import transformers

    kw = dict(config=model.config, max_cache_len=max_cache_len)
    impls = {
        "static": lambda: transformers.StaticCache(**kw),
        "transformers_static_offloaded": lambda: transformers.StaticCache(**kw, offloading=True),
        "offcache_static": lambda: offcache.OffloadedStaticKVCache(**kw),
    }
    if compiled:  # generate's own torch.compile (mode reduce-overhead: CUDA graphs between the cache calls)
        impls.pop("transformers_static_offloaded")
    return impls


def _run(ctx: Context, model, ids, make_cache, new_tokens: int, **generate_kwargs) -> dict:
    import transformers

    from offcache.kv.dynamic import cache_kwarg

    sync = _stream_waiter(ctx)
    clock = _StepClock(sync)
    if ctx.gpu:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    cache = make_cache()
    sync()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), **{cache_kwarg(): cache},
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
            logits_processor=transformers.LogitsProcessorList([clock]), **generate_kwargs,
        )  # fmt: skip
    sync()
    t = clock.times
    row = {
        "ttft_s": t[0] - start,
        "decode_tokens_per_s": (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 else None,
        "tokens_generated": out.shape[1] - ids.shape[1],
    }
    steps = len(t) - 1  # forward passes after the prefill
    if isinstance(cache, (offcache.OffloadedKVCache, offcache.OffloadedStaticKVCache)) and steps:
        # Step i's counters are read after its forward: the deltas are the decode steps' copies
        # (layer 0's prefix for the next step is prefetched during the last layer of this one).
        first, last = clock.counters[0], clock.counters[-1]
        row["d2h_bytes_per_step"] = (last["d2h_bytes"] - first["d2h_bytes"]) / steps
        row["h2d_bytes_per_step"] = (last["h2d_bytes"] - first["h2d_bytes"]) / steps
        row["bytes_from"] = "offcache.stats()"
        row["per_layer_step"] = per_layer_step(first, last)
    if ctx.gpu:
        row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
    return row, out


def run_case(ctx: Context, model, case: str, prompt: int, new_tokens: int, repeats: int, caches=None,
             reference: str = "dynamic", **generate_kwargs) -> list[dict]:  # fmt: skip
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, model.config.vocab_size, (1, prompt), generator=g).to(ctx.device)
    rows, ref_out = [], None
    for impl, make_cache in (caches or _caches(model)).items():
        row = {"impl": impl, "case": case, "prompt_tokens": prompt, "max_new_tokens": new_tokens}
        if impl in NEEDS_GPU and not ctx.gpu:
            row.update(completed=None, note=NEEDS_GPU[impl])
            rows.append(row)
            continue
        try:
            _run(ctx, model, ids, make_cache, min(new_tokens, 3), **generate_kwargs)  # warm-up, not recorded
            runs, out = [], None
            for _ in range(repeats):
                r, out = _run(ctx, model, ids, make_cache, new_tokens, **generate_kwargs)
                runs.append(r)
        except (torch.OutOfMemoryError, RuntimeError, NotImplementedError, AssertionError) as exc:
            row.update(completed=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            rows.append(row)
            if ctx.gpu:
                torch.cuda.empty_cache()
            continue
        rates = [r["decode_tokens_per_s"] for r in runs if r["decode_tokens_per_s"]]
        ttfts = [r["ttft_s"] for r in runs]
        row.update(
            completed=True,
            tokens_generated=runs[-1]["tokens_generated"],
            ttft_s_median=median(ttfts),
            ttft_spread=spread(ttfts),
            decode_tokens_per_s_median=median(rates) if rates else None,
            decode_spread=spread(rates) if rates else None,
            decode_tokens_per_s_min=min(rates) if rates else None,
            decode_tokens_per_s_max=max(rates) if rates else None,
            repeats=repeats,
            host_max_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        )
        for key in ("d2h_bytes_per_step", "h2d_bytes_per_step", "bytes_from", "per_layer_step"):
            if key in runs[-1]:
                row[key] = runs[-1][key]
        if ctx.gpu:
            row["peak_gpu_bytes"] = max(r["peak_gpu_bytes"] for r in runs)
        if impl == reference:
            ref_out = out
        row[f"equal_to_{reference}"] = None if ref_out is None else bool(torch.equal(out, ref_out))
        rows.append(row)
    return rows


def run_static_cases(ctx: Context, model, cases, repeats: int) -> list[dict]:
    """StaticCache resident, transformers' static offloading and offcache's, at each max_cache_len."""
    rows = []
    for case, prompt, new, factor in cases:
        max_len = factor * (prompt + new)
        compiled = case.endswith("_compiled")
        caches = _static_caches(model, max_len, compiled)
        extra = {} if compiled else {"disable_compile": True}
        # transformers' static offloading moves every full-attention layer whole, both ways, each step
        # (the bench model has no sliding layers): computed, whether or not it could run here.
        whole = offcache.kv_bytes_for_config(model.config, 1, max_len, model.dtype)
        for r in run_case(ctx, model, case, prompt, new, repeats, caches, reference="static", **extra):
            r["max_cache_len"] = max_len
            if r["impl"] == "static":
                r.update(d2h_bytes_per_step=0, h2d_bytes_per_step=0, bytes_from="resident")
            elif r["impl"] == "transformers_static_offloaded":
                r.update(d2h_bytes_per_step=whole, h2d_bytes_per_step=whole, bytes_from="buffer sizes")
            rows.append(r)
    return rows


class _GraphBreakStaticKVCache(offcache.OffloadedStaticKVCache):
    """The update as it was before the custom op: excluded from compilation, a graph break per layer."""

    @torch.compiler.disable
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self._update_eager(key_states, value_states, layer_idx, *args, **kwargs)


def run_compiled_static_case(ctx: Context, model, case: str, prompt: int, new: int, factor: int, repeats: int):
    """CPU decode of ``torch.compile(model.forward)`` (backend aot_eager): StaticCache (fullgraph),
    offcache's static cache as before (a graph break at each update) and now (fullgraph, custom op)."""
    import transformers

    max_len = factor * (prompt + new)
    kw = dict(config=model.config, max_cache_len=max_len)
    forward = model.forward
    compiled = {fg: torch.compile(forward, backend="aot_eager", fullgraph=fg) for fg in (True, False)}
    current = [None]

    def compiled_with(impl, make, fullgraph):
        def make_cache():
            if current[0] != impl:  # a fresh compilation per implementation, reused across its runs
                torch._dynamo.reset()
                current[0] = impl
            model.forward = compiled[fullgraph]
            return make()

        return make_cache

    caches = {
        "static": compiled_with("static", lambda: transformers.StaticCache(**kw), True),
        "offcache_static_graph_breaks": compiled_with("breaks", lambda: _GraphBreakStaticKVCache(**kw), False),
        "offcache_static": compiled_with("offcache", lambda: offcache.OffloadedStaticKVCache(**kw), True),
    }
    try:
        rows = run_case(ctx, model, case, prompt, new, repeats, caches, reference="static", disable_compile=True)
    finally:
        model.forward = forward
        torch._dynamo.reset()
    for r in rows:
        r.update(max_cache_len=max_len, compile="aot_eager", fullgraph=r["impl"] != "offcache_static_graph_breaks")
    return rows


CASES = ("short", "long", "static", "static_4x", "static_4x_compiled", "static_4x_compiled_cpu", "memory_limited")


def run_kv(ctx: Context) -> list[dict]:
    # OFFCACHE_BENCH_KV_CASES=short,long: only those (the device check runs the goal's two to fit its budget)
    wanted = env_choice("OFFCACHE_BENCH_KV_CASES", CASES)
    model = _model(ctx)
    repeats = 2 if (ctx.quick or ctx.tiny) else 5
    # static cases: (case, prompt, new tokens, max_cache_len as a multiple of prompt + new)
    if ctx.tiny:
        cases = [("short", 8, 8)]
        static = [("static_4x", 8, 8, 4)]
    elif ctx.gpu:
        cases = [("short", 512, 64), ("long", 16384 if ctx.quick else 32768, 64)]
        long = 4096 if ctx.quick else 8192
        static = [("static", long, 64, 1), ("static_4x", long, 64, 4)]
        if not ctx.quick:
            static.append(("static_4x_compiled", long, 64, 4))
    else:
        cases = [("short", 512, 64), ("long", 1536, 64)]  # issue 41's counters: 512 and 1536, 64 steps
        static = [("static", 256, 16, 1), ("static_4x", 256, 16, 4)]
    rows = []
    for case, prompt, new in cases:
        if case in wanted:
            rows += run_case(ctx, model, case, prompt, new, repeats)
            ctx.partial(rows)
    rows += run_static_cases(ctx, model, [c for c in static if c[0] in wanted], repeats)
    ctx.partial(rows)
    if not ctx.gpu and not ctx.tiny and "static_4x_compiled_cpu" in wanted:  # compiled decode on the CPU:
        rows += run_compiled_static_case(ctx, model, "static_4x_compiled_cpu", 256, 16, 4, repeats)  # 1 graph
    if ctx.gpu and not ctx.tiny and "memory_limited" in wanted:
        rows += _constrained_case(ctx, model, repeats)
    elif ctx.gpu and not ctx.tiny:
        rows.append(
            {"impl": "all", "case": "memory_limited", "completed": None, "note": "left out by OFFCACHE_BENCH_KV_CASES"}
        )
    else:
        note = "needs a GPU: torch.cuda.set_per_process_memory_fraction limits device memory"
        rows.append({"impl": "all", "case": "memory_limited", "completed": None, "note": note})
    return rows


def _constrained_case(ctx: Context, model, repeats: int) -> list[dict]:
    """A context long enough that DynamicCache needs more GPU memory than it is given."""
    text = model.config
    per_token = offcache.kv_bytes(text.num_hidden_layers, 1, 1, text.num_key_value_heads,
                                  text.hidden_size // text.num_attention_heads, torch.bfloat16)  # fmt: skip
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    total = torch.cuda.get_device_properties(ctx.device).total_memory
    budget = weights + (8 << 30)  # weights, activations, and less room than the whole cache needs
    prompt = min(int((12 << 30) / per_token), 65536 - 128)
    torch.cuda.set_per_process_memory_fraction(budget / total, ctx.device)
    try:
        rows = run_case(ctx, model, "memory_limited", prompt, 32, max(1, repeats // 2))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, ctx.device)
        torch.cuda.empty_cache()
    for r in rows:
        r["gpu_budget_bytes"] = budget
    return rows
