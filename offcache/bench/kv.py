"""Section kv (``python -m offcache.bench kv``): the measurement protocol for offloaded KV caches.

Held fixed: model, dtype, prompt tokens, max_new_tokens and greedy decoding.
Compared: DynamicCache, transformers' offloaded cache, offcache.OffloadedKVCache.
Recorded per implementation: completion (an OOM is a failure, not speed 0),
tokens generated, peak GPU and host memory, time to first token and decode
tokens/s (median and spread over repeats, warm-up kept apart), and whether the
output equals DynamicCache's.
"""

from __future__ import annotations

import resource
import time

import torch

import offcache
from offcache.bench.common import Context, median, spread
from offcache.bench.models import causal_lm


def _model(ctx: Context):
    if ctx.gpu:  # 8B-like layer shapes, fewer layers, random weights (no download)
        return causal_lm("llama", ctx.device, torch.bfloat16, vocab_size=32000, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=4 if ctx.quick else 8, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=65536)  # fmt: skip
    return causal_lm("llama", ctx.device, torch.float32, vocab_size=256, hidden_size=128, intermediate_size=256,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=4096)  # fmt: skip


class _StepClock:
    """A logits processor that timestamps every generated token."""

    def __init__(self, sync):
        self.sync = sync
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.sync()
        self.times.append(time.perf_counter())
        return scores


def _caches(model):
    import transformers

    return {
        "dynamic": lambda: transformers.DynamicCache(config=model.config),
        "transformers_offloaded": lambda: transformers.DynamicCache(config=model.config, offloading=True),
        "offcache": lambda: offcache.OffloadedKVCache(config=model.config),
    }


def _run(ctx: Context, model, ids, make_cache, new_tokens: int) -> dict:
    import transformers

    sync = (lambda: torch.cuda.synchronize(ctx.device)) if ctx.gpu else (lambda: None)
    clock = _StepClock(sync)
    if ctx.gpu:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    sync()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=make_cache(),
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
            logits_processor=transformers.LogitsProcessorList([clock]),
        )  # fmt: skip
    sync()
    t = clock.times
    row = {
        "ttft_s": t[0] - start,
        "decode_tokens_per_s": (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 else None,
        "tokens_generated": out.shape[1] - ids.shape[1],
    }
    if ctx.gpu:
        row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
    return row, out


def run_case(ctx: Context, model, case: str, prompt: int, new_tokens: int, repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, model.config.vocab_size, (1, prompt), generator=g).to(ctx.device)
    rows, reference = [], None
    for impl, make_cache in _caches(model).items():
        row = {"impl": impl, "case": case, "prompt_tokens": prompt, "max_new_tokens": new_tokens}
        try:
            _run(ctx, model, ids, make_cache, new_tokens)  # warm-up, not recorded
            runs, out = [], None
            for _ in range(repeats):
                r, out = _run(ctx, model, ids, make_cache, new_tokens)
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
            repeats=repeats,
            host_max_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        )
        if ctx.gpu:
            row["peak_gpu_bytes"] = max(r["peak_gpu_bytes"] for r in runs)
        if impl == "dynamic":
            reference = out
        row["equal_to_dynamic"] = None if reference is None else bool(torch.equal(out, reference))
        rows.append(row)
    return rows


def run_kv(ctx: Context) -> list[dict]:
    model = _model(ctx)
    repeats = 2 if (ctx.quick or ctx.tiny) else 5
    if ctx.tiny:
        cases = [("short", 8, 8)]
    elif ctx.gpu:
        cases = [("short", 512, 64), ("long", 16384 if ctx.quick else 32768, 64)]
    else:
        cases = [("short", 64, 32), ("long", 1024 if ctx.quick else 2048, 32)]
    rows = []
    for case, prompt, new in cases:
        rows += run_case(ctx, model, case, prompt, new, repeats)
    if ctx.gpu and not ctx.tiny:
        rows += _constrained_case(ctx, model, repeats)
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
