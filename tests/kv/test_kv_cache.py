"""OffloadedKVCache: greedy generations identical to DynamicCache, on both backends."""

import pytest
import torch

import offcache
import offcache.kv.dynamic
from offcache import engine as _engine
from offcache.bench.models import causal_lm
from offcache.kv.dynamic import cache_kwarg
from tests.kv.kv_models import copier, edit_layer_in_place, fill, kw, select_repeat_decode

transformers = pytest.importorskip("transformers")


def tiny_model(kind: str):
    return causal_lm(kind, sliding_window=8) if kind == "mistral" else causal_lm(kind)


def generate(model, input_ids, cache, new_tokens):
    with torch.no_grad():
        return model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            **kw(cache),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )


# The default and host engines (the slow 1 MiB configuration adds nothing here).
both_backends = pytest.mark.parametrize("engine", ["default", "host"], indirect=True)


@both_backends
@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("batch, prompt, new", [(1, 1, 20), (3, 5, 24), (2, 12, 30)])
def test_greedy_tokens_identical_to_dynamic_cache(engine, kind, batch, prompt, new):
    model = tiny_model(kind)
    ids = torch.randint(1, 128, (batch, prompt), generator=torch.Generator().manual_seed(batch + prompt))
    want = generate(model, ids, transformers.DynamicCache(config=model.config), new)
    got = generate(model, ids, offcache.OffloadedKVCache(config=model.config), new)
    assert torch.equal(got, want)
    assert got.shape[1] == prompt + new  # past the sliding window of 8


@both_backends
def test_sliding_layers_can_be_offloaded_too(engine):
    model = tiny_model("mistral")
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    want = generate(model, ids, transformers.DynamicCache(config=model.config), 20)
    cache = offcache.OffloadedKVCache(config=model.config, offload_sliding=True)
    assert all(type(layer).__name__ == "OffloadedSlidingLayer" for layer in cache.layers)
    got = generate(model, ids, cache, 20)
    assert torch.equal(got, want)


@both_backends
def test_layer_kinds_and_seq_length(engine):
    model = tiny_model("llama")
    cache = offcache.OffloadedKVCache(config=model.config)
    assert all(type(layer).__name__ == "OffloadedLayer" for layer in cache.layers)
    mistral = offcache.OffloadedKVCache(config=tiny_model("mistral").config)
    assert all(type(layer).__name__ == "DynamicSlidingWindowLayer" for layer in mistral.layers)  # resident
    ids = torch.randint(1, 128, (1, 7))
    generate(model, ids, cache, 5)
    assert cache.get_seq_length() == 7 + 5 - 1
    offcache.synchronize()
    assert offcache.stats()["pinned_in_use_bytes"] > 0  # the K/V live in the arena


@both_backends
def test_manual_forward_loop_without_config(engine):
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (2, 4), generator=torch.Generator().manual_seed(9))
    outs = {}
    for name, cache in (("dynamic", transformers.DynamicCache()), ("offcache", offcache.OffloadedKVCache())):
        step_ids, tokens = ids, []
        with torch.no_grad():
            for _ in range(10):
                logits = model(input_ids=step_ids, **kw(cache), use_cache=True).logits
                step_ids = logits[:, -1:].argmax(-1)
                tokens.append(step_ids)
        outs[name] = torch.cat(tokens, dim=1)
    assert torch.equal(outs["offcache"], outs["dynamic"])


def test_kv_bytes_of_32_layers_8192_tokens_is_exactly_one_gib():
    assert offcache.kv_bytes(32, 1, 8192, 8, 128, torch.bfloat16) == 1 << 30
    assert offcache.kv_bytes(32, 1, 8192, 8, 128, 2) == 1 << 30
    assert offcache.kv_bytes(32, 1, 16384, 8, 128, "float16") == 2 << 30
    with pytest.raises(ValueError, match="tokens"):
        offcache.kv_bytes(32, 1, -1, 8, 128)


def test_kv_bytes_for_config_counts_sliding_windows():
    llama = transformers.LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                     hidden_size=4096)  # fmt: skip
    assert offcache.kv_bytes_for_config(llama, 1, 8192, torch.bfloat16) == 1 << 30
    mistral = transformers.MistralConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                         hidden_size=4096, sliding_window=4096)  # fmt: skip
    assert offcache.kv_bytes_for_config(mistral, 1, 8192, torch.bfloat16) == 1 << 29


def test_kv_size_cli(capsys):
    from offcache.kv.size import main

    main(["size", "--layers", "32", "--batch", "1", "--tokens", "8192", "--kv-heads", "8", "--head-dim", "128",
          "--dtype", "bfloat16", "--bandwidth-gbps", "50"])  # fmt: skip
    out = capsys.readouterr().out
    assert "1073741824 bytes = 1.0000 GiB" in out
    assert "21.475 ms" in out  # 2^30 B / 50 GB/s


# Layer K/V, transformers' cache operations, deepcopy (issues 17 and 20) --------------------------

offload_modes = pytest.mark.parametrize(
    "kind, offload_sliding", [("llama", False), ("mistral", False), ("mistral", True)]
)


def run(model, ids, cache, new, **kwargs):
    """generate with `kwargs` overriding the greedy defaults (seeded, for sampling)."""
    torch.manual_seed(0)
    with torch.no_grad():
        return model.generate(**{"input_ids": ids, "attention_mask": torch.ones_like(ids), cache_kwarg(): cache,
                                 "max_new_tokens": new, "do_sample": False, "pad_token_id": 0, **kwargs})  # fmt: skip


def random_ids(batch, prompt, seed=0):
    return torch.randint(1, 128, (batch, prompt), generator=torch.Generator().manual_seed(seed))


def assert_same_layers(ours, theirs):
    """Every layer's K/V hold the reference's values; offloaded ones are CPU tensors of offcache's memory."""
    assert len(ours.layers) == len(theirs.layers)
    for i, (a, b) in enumerate(zip(ours.layers, theirs.layers)):
        if isinstance(a, offcache.kv.dynamic._Offloaded):
            assert a.keys.device.type == "cpu" and _engine.is_offcache_tensor(a.keys), i
            assert _engine.is_offcache_tensor(a.values), i
        assert a.get_seq_length() == b.get_seq_length(), i
        assert torch.equal(a.keys.cpu(), b.keys.cpu()) and torch.equal(a.values.cpu(), b.values.cpu()), i


@pytest.mark.parametrize("engine", ["host", "host-1MiB-slow"], indirect=True)
@offload_modes
def test_layer_keys_and_values_hold_the_cached_states(engine, kind, offload_sliding):
    """layers[i].keys / .values equal DynamicCache's, read right after generate (copies slowed: must wait)."""
    model = tiny_model(kind)
    ids = random_ids(2, 6, seed=1)
    ref = transformers.DynamicCache(config=model.config)
    run(model, ids, ref, 14)
    cache = offcache.OffloadedKVCache(config=model.config, offload_sliding=offload_sliding)
    run(model, ids, cache, 14)
    assert_same_layers(cache, ref)
    keys = [layer.keys for layer in cache.layers]
    assert all(k.shape == (2, 2, k.shape[2], 16) for k in keys)
    assert all(a is b for a, b in zip(keys, [ly.keys for ly in cache.layers]))  # read again: the same tensors


@pytest.mark.parametrize("engine", ["host"], indirect=True)
def test_layer_keys_cost_nothing_unless_read(engine):
    """Per step only the new tokens go D2H, into one buffer per tensor; a read is a view of it: no copy."""
    from offcache.kv.counters import kv_stats

    model = tiny_model("llama")
    layers, p, k = model.config.num_hidden_layers, 5, 9
    cache = offcache.OffloadedKVCache(config=model.config)
    before, host_before = offcache.stats(), kv_stats()["kv_host_copy_bytes"]
    run(model, random_ids(1, p, seed=2), cache, k)
    offcache.synchronize()
    per_token = 2 * 2 * 16 * 4  # K and V of 2 heads of 16 fp32
    host = kv_stats()["kv_host_copy_bytes"] - host_before  # the buffers made: once per layer here
    assert offcache.stats()["d2h_bytes"] - before["d2h_bytes"] - host == layers * (p + k - 1) * per_token
    assert host == layers * 64 * per_token  # one buffer of 64 positions per tensor
    first = cache.layers[0].keys
    assert first.shape == (1, 2, p + k - 1, 16) and cache.layers[0]._host_k.shape == (1, 2, 64, 16)
    assert first.data_ptr() == cache.layers[0]._host_k.data_ptr()  # a view of the buffer
    mid = offcache.stats()
    assert cache.layers[0].keys is first and cache.layers[0].values is cache.layers[0].values
    offcache.synchronize()
    assert offcache.stats()["d2h_bytes"] == mid["d2h_bytes"]  # reads copied nothing


@pytest.mark.parametrize("engine", ["host", "host-1MiB-slow"], indirect=True)
@offload_modes
@pytest.mark.parametrize("search", [dict(num_beams=3), dict(num_beams=2, do_sample=True, top_k=5),
                                    dict(num_beams=2, num_return_sequences=2)])  # fmt: skip
def test_beam_search_same_tokens_as_dynamic_cache(engine, kind, offload_sliding, search):
    model = tiny_model(kind)
    ids = random_ids(2, 5, seed=3)
    want = run(model, ids, transformers.DynamicCache(config=model.config), 14, **search)
    cache = offcache.OffloadedKVCache(config=model.config, offload_sliding=offload_sliding)
    assert torch.equal(run(model, ids, cache, 14, **search), want)


@pytest.mark.parametrize("engine", ["host", "host-1MiB-slow"], indirect=True)
@offload_modes
@pytest.mark.parametrize("assist", ["model", "prompt_lookup"])
def test_assisted_decoding_same_tokens_as_greedy(engine, kind, offload_sliding, assist):
    """Assisted / prompt-lookup decoding crop the cache after each rejected candidate."""
    model = tiny_model(kind)
    # A repetitive prompt: prompt lookup finds candidates; a differently seeded assistant proposes others.
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    extra = ({"assistant_model": causal_lm(kind, seed=1, **({"sliding_window": 8} if kind == "mistral" else {}))}
             if assist == "model" else {"prompt_lookup_num_tokens": 3})  # fmt: skip
    want = run(model, ids, transformers.DynamicCache(config=model.config), 16)
    cache = offcache.OffloadedKVCache(config=model.config, offload_sliding=offload_sliding)
    ref_cache = transformers.DynamicCache(config=model.config)
    assert torch.equal(run(model, ids, ref_cache, 16, **extra), want)  # the reference path itself
    assert torch.equal(run(model, ids, cache, 16, **extra), want)
    assert_same_layers(cache, ref_cache)


@pytest.mark.parametrize("engine", ["host", "host-1MiB-slow"], indirect=True)
@offload_modes
def test_batch_select_and_repeat_same_as_dynamic_cache(engine, kind, offload_sliding):
    """Fill with a prompt, select / repeat batch rows, decode on: the same tokens and K/V as DynamicCache."""
    model = tiny_model(kind)
    ids = random_ids(3, 6, seed=4)
    ours = offcache.OffloadedKVCache(config=model.config, offload_sliding=offload_sliding)
    ref = transformers.DynamicCache(config=model.config)
    assert torch.equal(select_repeat_decode(model, ours, ids), select_repeat_decode(model, ref, ids))
    assert_same_layers(ours, ref)


@pytest.mark.parametrize("engine", ["host"], indirect=True)
def test_crop_follows_transformers_rules(engine):
    """crop: a length change; past the window without recorded past, transformers' RuntimeError."""
    model = tiny_model("mistral")
    for offload_sliding in (False, True):
        ref = transformers.DynamicCache(config=model.config)
        cache = offcache.OffloadedKVCache(config=model.config, offload_sliding=offload_sliding)
        for c in (ref, cache):
            with torch.no_grad():
                model(input_ids=random_ids(1, 6, seed=5), **kw(c), use_cache=True)
            c.crop(-2)
        assert_same_layers(cache, ref)
        for c in (ref, cache):
            with torch.no_grad():
                model(input_ids=random_ids(1, 6, seed=6), **kw(c), use_cache=True)
        errors = []
        for c in (ref, cache):
            with pytest.raises(RuntimeError) as e:
                c.crop(-1)
            errors.append(str(e.value))
        assert errors[0] == errors[1] and "sliding window" in errors[0]
    llama = tiny_model("llama")
    ref, cache = transformers.DynamicCache(config=llama.config), offcache.OffloadedKVCache(config=llama.config)
    outcomes = []
    for c in (ref, cache):
        with torch.no_grad():
            llama(input_ids=random_ids(2, 7, seed=7), **kw(c), use_cache=True)
        c.crop(-3)
        try:  # the legacy form (keep 2): deprecated, then refused by newer transformers; the same either way
            c.crop(2)
            outcomes.append(None)
        except ValueError as e:
            outcomes.append(str(e))
    assert outcomes[0] == outcomes[1]
    assert cache.get_seq_length() == ref.get_seq_length() == (4 if outcomes[0] else 2)
    assert_same_layers(cache, ref)


@pytest.mark.parametrize("engine", ["host", "host-1MiB-slow"], indirect=True)
@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("kind, offload_sliding", [("llama", False), ("mistral", True)])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copied_cache_generates_like_dynamic_cache(engine, layers, kind, offload_sliding, how):
    """The prompt-reuse recipe: fill, deepcopy (or pickle), generate from the copy; twice from one prompt."""
    import copy

    copy_of = copier(how)
    shape = {"num_hidden_layers": layers, **({"sliding_window": 8} if kind == "mistral" else {})}
    model = causal_lm(kind, **shape)
    prompt, ids = random_ids(1, 6, seed=8), random_ids(1, 9, seed=8)
    ids[:, :6] = prompt
    ref = copy.deepcopy(fill(model, transformers.DynamicCache(config=model.config), prompt))
    want = run(model, ids, ref, 10)
    filled = fill(model, offcache.OffloadedKVCache(config=model.config, offload_sliding=offload_sliding), prompt)
    copied = copy_of(filled)
    assert torch.equal(run(model, ids, copied, 10), want)
    assert_same_layers(copied, ref)
    assert torch.equal(run(model, ids, copy_of(filled), 10), want)  # the original is intact
    assert torch.equal(run(model, ids, filled, 10), want)


# In-place edits of a layer's keys / values (issue 24, item 1) -------------------------------------


@pytest.mark.parametrize("engine", ["default", "host-1MiB-slow"], indirect=True)
@pytest.mark.parametrize("how", ["tensor", "data", "numpy"])
@pytest.mark.parametrize("kind, offload_sliding", [("llama", False), ("mistral", True)])
def test_in_place_edit_of_layer_kv_is_seen_by_the_next_step(engine, how, kind, offload_sliding):
    """Prefill, edit layer 0's K/V in place (the layer the last layer's update prefetched), decode:
    DynamicCache's logits. A prefetch taken before the edit must not be served."""
    model = tiny_model(kind)
    ids = random_ids(2, 6, seed=21)
    logits = {}
    caches = {"ref": transformers.DynamicCache(config=model.config),
              "ours": offcache.OffloadedKVCache(config=model.config, offload_sliding=offload_sliding)}  # fmt: skip
    for name, cache in caches.items():
        with torch.no_grad():
            out = model(input_ids=ids, **kw(cache), use_cache=True).logits
            if name == "ours" and engine.get("host_copy_delay_us") is None:
                offcache.synchronize()  # else: the edit while the prefetch is in flight
            edit_layer_in_place(cache.layers[0], how)
            step = out[:, -1:].argmax(-1)
            logits[name] = model(input_ids=step, **kw(cache), use_cache=True).logits
    assert torch.equal(logits["ours"], logits["ref"])
    assert_same_layers(caches["ours"], caches["ref"])


# transformers 5.24 (issue 25): keys and values of different dtypes, the `cache=` keyword ----------


@pytest.mark.parametrize("engine", ["host"], indirect=True)
@pytest.mark.parametrize("offload_sliding", [False, True])
def test_keys_and_values_of_different_dtypes(engine, offload_sliding):
    """Each keeps its own dtype (5.24's DynamicLayer does); the returned K/V are the concatenations."""
    model = tiny_model("mistral" if offload_sliding else "llama")
    cache = offcache.OffloadedKVCache(config=model.config, offload_sliding=offload_sliding)
    g = torch.Generator().manual_seed(0)
    chunks = [(torch.randn(2, 2, n, 16, generator=g), torch.randn(2, 2, n, 16, generator=g).to(torch.bfloat16))
              for n in (3, 1, 2)]  # fmt: skip
    for i, (k, v) in enumerate(chunks):
        for layer in range(len(cache.layers)):
            got_k, got_v = cache.update(k, v, layer)
        want_k = torch.cat([c[0] for c in chunks[: i + 1]], dim=-2)
        want_v = torch.cat([c[1] for c in chunks[: i + 1]], dim=-2)
        assert got_k.dtype == torch.float32 and got_v.dtype == torch.bfloat16
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    for layer in cache.layers:
        assert torch.equal(layer.keys, want_k) and torch.equal(layer.values, want_v)


def test_no_past_key_values_warning_from_offcache():
    """generate and forward get the cache under the installed transformers' keyword: on 5.24, whose
    `past_key_values` is deprecated, no FutureWarning about it comes from offcache's code."""
    import warnings

    from offcache.bench.common import Context
    from offcache.bench.kv import _run

    model = tiny_model("llama")
    ids = random_ids(1, 4, seed=3)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*", category=FutureWarning)
        fill(model, offcache.OffloadedKVCache(config=model.config), ids)
        run(model, ids, offcache.OffloadedKVCache(config=model.config), 3)
        ctx = Context(device=torch.device("cpu"), quick=True, tiny=True, backend=_engine.backend_name())
        _run(ctx, model, ids, lambda: offcache.OffloadedKVCache(config=model.config), 3)
    assert cache_kwarg() in ("cache", "past_key_values")


@pytest.mark.parametrize("engine", ["host"], indirect=True)
@pytest.mark.parametrize("kind, offload_sliding", [("llama", False), ("mistral", False), ("mistral", True)])
def test_reset_then_a_new_prompt_as_a_new_cache(engine, kind, offload_sliding):
    """After reset() the cache is empty: a new prompt gives a new DynamicCache's logits (resident
    sliding layers too, which transformers before 5.24 zeroed and kept at their length)."""
    model = tiny_model(kind)
    cache = fill(model, offcache.OffloadedKVCache(config=model.config, offload_sliding=offload_sliding),
                 random_ids(2, 5, seed=40))  # fmt: skip
    cache.reset()
    assert cache.get_seq_length() == 0
    ids = random_ids(2, 3, seed=41)
    with torch.no_grad():
        got = model(input_ids=ids, **kw(cache), use_cache=True).logits
        want = model(input_ids=ids, **kw(transformers.DynamicCache(config=model.config)), use_cache=True).logits
    assert torch.equal(got, want)
    assert_same_layers(cache, fill(model, transformers.DynamicCache(config=model.config), ids))


@pytest.mark.parametrize("engine", ["host", "host-1MiB-slow"], indirect=True)
def test_offloaded_sliding_layer_updates_as_the_installed_transformers_does(engine):
    """Recording the past (assisted decoding), several forwards without a crop: what transformers'
    DynamicSlidingWindowLayer keeps and returns (5.23+ returns only the part the mask sees), then a crop."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    window = 4
    ours = offcache.kv.dynamic.OffloadedSlidingLayer(window)
    ref = DynamicSlidingWindowLayer(window)
    for layer in (ours, ref):
        layer.activate_past_recording()
    g = torch.Generator().manual_seed(7)
    for n in (3, 2, 1, 3):  # past the window, never cropped
        k, v = torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)
        got, want = ours.update(k, v), ref.update(k, v)
        for a, b in zip(got, want):
            assert a.shape == b.shape and torch.equal(a, b)
        assert ours.get_seq_length() == ref.get_seq_length()
        assert torch.equal(ours.keys, ref.keys) and torch.equal(ours.values, ref.values)
    ours.crop(-2)
    ref.crop(-2)
    assert ours.get_seq_length() == ref.get_seq_length()
    assert torch.equal(ours.keys, ref.keys) and torch.equal(ours.values, ref.values)
