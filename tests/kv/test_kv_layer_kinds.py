"""Both KV caches on the layer kinds of newer models: tokens and logits identical to transformers' caches.

KV-sharing (Gemma3n, Gemma4: later layers read earlier layers' K/V through ``shared_kv_states``),
alternating sliding / full (Gemma3), hybrid conv / attention (Lfm2), "mlp" / "moe" layers with no
cache of their own (NemotronH: transformers' DummyLayer, first or after an attention layer), and "hybrid"
layers holding K/V and Mamba2 states at once (FalconH1). Run against llm-compressor's transformers and the
newest one. Where transformers' own cache raises (5.25's get_seq_length on a DummyLayer first), offcache's
raise the same error.
"""

import functools
import inspect

import pytest
import torch

from offcache.kv.dynamic import OffloadedKVCache
from offcache.kv.static import OffloadedStaticKVCache
from tests.kv.kv_models import kw, outcome, tiny_causal_lm, tiny_hybrid_lm, tiny_mlp_moe_lm

transformers = pytest.importorskip("transformers")

WINDOW = 16
KINDS = ["gemma3n", "gemma4", "gemma3", "lfm2", "mlp_moe", "attn_mlp_moe", "falcon_h1"]


@functools.cache
def model_of(kind):
    if kind == "mlp_moe":
        return tiny_mlp_moe_lm()
    if kind == "attn_mlp_moe":
        return tiny_mlp_moe_lm(layers=("full_attention", "mlp", "full_attention", "moe"))
    if kind == "falcon_h1":
        return tiny_hybrid_lm()
    return tiny_causal_lm(kind, sliding_window=WINDOW)


def generate(model, cache, new, **extra):
    """generate's outcome: its output, or the error it raised."""
    ids = torch.randint(1, 128, (2 if not extra else 1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return outcome(
            model.generate, input_ids=ids, attention_mask=torch.ones_like(ids), **kw(cache), max_new_tokens=new,
            do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True, **extra,
        )  # fmt: skip


def assert_same(got, want):
    if want[0] == "raised" or got[0] == "raised":  # transformers' cache raised: ours raises the same
        assert got == want
        return
    got, want = got[1], want[1]
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == len(want.logits)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))


@functools.cache
def reference(kind, max_cache_len, new):
    model = model_of(kind)
    if max_cache_len is None:
        return generate(model, transformers.DynamicCache(config=model.config), new)
    return generate(model, transformers.StaticCache(config=model.config, max_cache_len=max_cache_len), new)


@pytest.mark.parametrize("engine", ["host"], indirect=True)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("offload_sliding", [False, True])
def test_dynamic_cache_identical(engine, kind, offload_sliding):
    model = model_of(kind)
    new = WINDOW + 6  # past the window
    got = generate(model, OffloadedKVCache(config=model.config, offload_sliding=offload_sliding), new)
    assert_same(got, reference(kind, None, new))


@pytest.mark.parametrize("engine", ["host"], indirect=True)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("offload_sliding", [False, True])
@pytest.mark.parametrize("max_cache_len, new", [(WINDOW, WINDOW - 5), (2 * WINDOW, 2 * WINDOW - 6)])
def test_static_cache_identical(engine, kind, offload_sliding, max_cache_len, new):
    """max_cache_len = the window (full and sliding layers share the device buffers) and past it."""
    model = model_of(kind)
    cache = OffloadedStaticKVCache(config=model.config, max_cache_len=max_cache_len, offload_sliding=offload_sliding)
    assert_same(generate(model, cache, new), reference(kind, max_cache_len, new))
    if kind in ("gemma3n", "gemma4"):  # the layers read through shared_kv_states stay resident
        resident = [i for i, ly in enumerate(cache.layers) if type(ly).__name__.startswith("Static")]
        assert resident == ([2, 3] if offload_sliding else [0, 2, 3])  # (sliding layers: resident by default)


def _record_past(cache) -> None:
    """What assisted decoding does first (5.25 passes how many recurrent states its drafts need)."""
    from transformers.cache_utils import LinearAttentionLayer

    wants = "recurrent_states_to_keep" in inspect.signature(LinearAttentionLayer.activate_past_recording).parameters
    cache.activate_past_recording(**({"recurrent_states_to_keep": 4} if wants else {}))


@pytest.mark.parametrize("engine", ["host"], indirect=True)
@pytest.mark.parametrize("static", [False, True])
def test_crop_of_hybrid_layers(engine, static):
    """A crop rolls a hybrid layer's Mamba2 states back with its K/V, as transformers' caches do: logits and
    lengths identical after it (a crop of the K/V alone would leave states of the removed tokens behind)."""
    model = model_of("falcon_h1")
    ids = torch.randint(1, 128, (1, 9), generator=torch.Generator().manual_seed(3))
    if static:
        ours = OffloadedStaticKVCache(config=model.config, max_cache_len=16)
        ref = transformers.StaticCache(config=model.config, max_cache_len=16)
    else:
        ours, ref = OffloadedKVCache(config=model.config), transformers.DynamicCache(config=model.config)
    logits = []
    for cache in (ours, ref):
        _record_past(cache)
        with torch.no_grad():
            model(input_ids=ids[:, :6], **kw(cache), use_cache=True)
            cache.crop(-2)
            logits.append(model(input_ids=ids[:, 4:], **kw(cache), use_cache=True).logits)
    assert torch.equal(logits[0], logits[1])
    assert int(ours.get_seq_length()) == int(ref.get_seq_length())


@pytest.mark.parametrize("engine", ["host"], indirect=True)
@pytest.mark.parametrize("static", [False, True])
def test_assisted_decoding_on_hybrid_layers(engine, static):
    """Prompt-lookup decoding on FalconH1: transformers' caches' tokens and logits, or their error (before
    5.25 assisted decoding refuses stateful models)."""
    model = model_of("falcon_h1")
    if static:
        ours = OffloadedStaticKVCache(config=model.config, max_cache_len=32)
        ref = transformers.StaticCache(config=model.config, max_cache_len=32)
    else:
        ours, ref = OffloadedKVCache(config=model.config), transformers.DynamicCache(config=model.config)
    assert_same(
        generate(model, ours, 12, prompt_lookup_num_tokens=3), generate(model, ref, 12, prompt_lookup_num_tokens=3)
    )


@pytest.mark.parametrize("engine", ["host"], indirect=True)
def test_reset_of_hybrid_layers(engine):
    """OffloadedKVCache.reset() is a new cache, Mamba states included: the logits of a new DynamicCache (what
    DynamicCache.reset gives from 5.24 on; 5.17's keeps the length, so the reference is a new cache)."""
    model = model_of("falcon_h1")
    ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    ours = OffloadedKVCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, **kw(ours), use_cache=True)
        ours.reset()
        got = model(input_ids=ids, **kw(ours), use_cache=True).logits
        want = model(input_ids=ids, **kw(transformers.DynamicCache(config=model.config)), use_cache=True).logits
    assert torch.equal(got, want)
    assert int(ours.get_seq_length()) == ids.shape[1]
