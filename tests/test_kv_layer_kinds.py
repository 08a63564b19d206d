"""Both KV caches on the layer kinds of newer models: tokens and logits identical to transformers' caches.

KV-sharing (Gemma3n, Gemma4: later layers read earlier layers' K/V through ``shared_kv_states``),
alternating sliding / full (Gemma3), hybrid conv / attention (Lfm2), and "mlp" / "moe" layers with no
cache of their own (NemotronH). Run against llm-compressor's transformers and the newest one.
"""

import functools

import pytest
import torch

from offcache.kv_cache import OffloadedKVCache
from offcache.static_kv_cache import OffloadedStaticKVCache
from tests.kv_models import kw, tiny_causal_lm, tiny_mlp_moe_lm

transformers = pytest.importorskip("transformers")

WINDOW = 16
KINDS = ["gemma3n", "gemma4", "gemma3", "lfm2", "mlp_moe"]


@functools.cache
def model_of(kind):
    return tiny_mlp_moe_lm() if kind == "mlp_moe" else tiny_causal_lm(kind, sliding_window=WINDOW)


def generate(model, cache, new):
    ids = torch.randint(1, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), **kw(cache), max_new_tokens=new,
            do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip


def assert_same(got, want):
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
