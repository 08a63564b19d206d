"""The dynamic KV cache's work per layer and decode step, counted, not timed (issue 41 item 1).

Per offloaded layer and decode step: at most 2 H2D copies (K and V, each one copy into one
device allocation) and 2 output allocations, D2H of the new tokens only (no compaction, no
re-store of the layer), no pinned chunk made; the next two layers prefetched. Counted by the
bench's own code (offcache.bench.kv), as ``python -m offcache.bench kv`` reports them.
"""

import pytest
import torch

import offcache
from offcache.bench.common import Context
from offcache.bench.kv import _run, per_layer_step
from offcache.bench.models import causal_lm
from offcache.kv.counters import kv_stats
from tests.kv.kv_models import kw

transformers = pytest.importorskip("transformers")


def _model():
    return causal_lm("llama", num_hidden_layers=4, max_position_embeddings=1024)


@pytest.mark.parametrize("engine", ["host", "host-1MiB-slow"], indirect=True)
@pytest.mark.parametrize("prompt", [64, 300])
def test_decode_work_per_layer_step_is_at_its_floor(engine, prompt):
    model = _model()
    ids = torch.randint(1, 128, (1, prompt), generator=torch.Generator().manual_seed(prompt))
    ctx = Context(device=torch.device("cpu"), quick=True, tiny=True, backend=offcache.build_info()["backend"])
    row, got = _run(ctx, model, ids, lambda: offcache.OffloadedKVCache(config=model.config), 24)
    _, want = _run(ctx, model, ids, lambda: transformers.DynamicCache(config=model.config), 24)
    assert torch.equal(got, want)
    c = row["per_layer_step"]
    assert c["layer_steps"] == 4 * 23  # 24 forwards after the prefill's, whose logits start the clock
    assert c["h2d_copies"] <= 2, c
    assert c["output_allocations"] <= 2, c
    assert c["d2h_bytes_over_new"] <= 1.25, c  # the new tokens only: no compaction, no re-store
    assert c["d2h_bytes_over_new_without_host_copies"] == 1.0, c
    if engine.get("pinned_limit") is None:  # a 1 MiB arena spills: its pageable blocks are not chunks
        assert c["pinned_chunks_made"] == 0, c


@pytest.mark.parametrize("engine", ["host"], indirect=True)
def test_the_next_two_layers_are_prefetched(engine):
    """After a decode step the next step's first two layers are in flight: a layer's copy has two
    layers' compute to hide behind."""
    model = _model()
    cache = offcache.OffloadedKVCache(config=model.config)
    step = torch.randint(1, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _ in range(3):
            step = model(input_ids=step, **kw(cache), use_cache=True).logits[:, -1:].argmax(-1)
            assert [layer._prefetched is not None for layer in cache.layers] == [True, True, False, False]


@pytest.mark.parametrize("engine", ["host"], indirect=True)
def test_a_long_decode_grows_each_layer_geometrically(engine):
    """From a 16-token prompt to 136 tokens each layer's buffer grows a few times (not once per step), the
    device-to-host copies stay the new tokens', and the host-to-host copies are bounded per new token."""
    model = _model()
    cache = offcache.OffloadedKVCache(config=model.config)
    ref = transformers.DynamicCache(config=model.config)
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        outs = [model(input_ids=ids, **kw(c), use_cache=True).logits for c in (cache, ref)]
        before, stats_before = kv_stats(), offcache.stats()
        for _ in range(120):
            steps = [o[:, -1:].argmax(-1) for o in outs]
            assert torch.equal(steps[0], steps[1])
            outs = [model(input_ids=s, **kw(c), use_cache=True).logits for s, c in zip(steps, (cache, ref))]
    offcache.synchronize()
    after, stats_after = kv_stats(), offcache.stats()
    first = {**{k: stats_before[k] for k in ("d2h_bytes", "h2d_bytes", "d2h_copies", "h2d_copies", "chunks_made")},
             **before}  # fmt: skip
    last = {**{k: stats_after[k] for k in first if k in stats_after}, **after}
    c = per_layer_step(first, last)
    assert c["layer_steps"] == 4 * 120
    assert c["d2h_bytes_over_new_without_host_copies"] == 1.0, c
    moves = after["kv_buffer_moves"] - before["kv_buffer_moves"]
    assert moves == 4 * 2, moves  # 16 -> 136 tokens: 2 growths per layer (64 -> 128 -> 256 positions)
    assert c["host_copy_bytes_over_new"] <= 6.0, c  # growth by 1.5x: (1.5 + 1) / 0.5 per new token at most
    assert c["h2d_copies"] <= 2 and c["output_allocations"] <= 2, c
    for ours, theirs in zip(cache.layers, ref.layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


@pytest.mark.parametrize("engine", ["host"], indirect=True)
def test_static_cache_work_per_layer_step(engine):
    """Issue 41 item 4, beside the dynamic cache's: the static cache moves the filled prefix in one H2D copy
    per tensor into its shared device buffers (no allocation per step) and the new positions D2H."""
    model = _model()
    ids = torch.randint(1, 128, (1, 64), generator=torch.Generator().manual_seed(3))
    ctx = Context(device=torch.device("cpu"), quick=True, tiny=True, backend=offcache.build_info()["backend"])
    kw_ = dict(config=model.config, max_cache_len=128)
    row, got = _run(ctx, model, ids, lambda: offcache.OffloadedStaticKVCache(**kw_), 24, disable_compile=True)
    _, want = _run(ctx, model, ids, lambda: transformers.StaticCache(**kw_), 24, disable_compile=True)
    assert torch.equal(got, want)
    c = row["per_layer_step"]
    assert c["layer_steps"] == 4 * 23
    assert c["h2d_copies"] <= 2 and c["output_allocations"] == 0, c
    assert c["d2h_bytes_over_new"] == 1.0 and c["pinned_chunks_made"] == 0, c
