"""OffloadedStaticKVCache: tokens and logits identical to StaticCache; only what changed moves."""

import pytest
import torch

import offcache
from offcache import _engine
from offcache.bench.models import causal_lm
from offcache.static_kv_cache import OffloadedStaticKVCache

transformers = pytest.importorskip("transformers")

# The default and host engines (the slow 1 MiB configuration adds nothing here).
both_backends = pytest.mark.parametrize("engine", ["default", "host"], indirect=True)


def tiny_model(kind: str, device=None):
    return causal_lm(kind, device, sliding_window=8) if kind == "mistral" else causal_lm(kind, device)


def generate(model, ids, cache, new_tokens, **kwargs):
    with torch.no_grad():
        return model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kwargs,
        )  # fmt: skip


def assert_same(got, want, logits=True):
    assert torch.equal(got.sequences, want.sequences)
    if logits:
        assert len(got.logits) == len(want.logits)
        for a, b in zip(got.logits, want.logits):
            assert torch.equal(a, b)


def random_ids(batch, prompt, seed=0, device=None):
    ids = torch.randint(1, 128, (batch, prompt), generator=torch.Generator().manual_seed(seed))
    return ids.to(device)


CASES = [  # kind, offload_sliding, batch, prompt, new, max_cache_len
    ("llama", False, 1, 1, 20, 20),  # exactly full at the end
    ("llama", False, 3, 5, 24, 4 * 29),  # max_cache_len 4x the filled length
    ("llama", False, 2, 12, 30, 64),
    ("mistral", False, 2, 5, 20, 32),  # every layer sliding: all resident
    ("mistral", True, 2, 5, 20, 32),  # ... all offloaded, past the window of 8
    ("mistral", True, 1, 12, 10, 40),  # prefill longer than the window
]


@both_backends
@pytest.mark.parametrize("kind, offload_sliding, batch, prompt, new, max_len", CASES)
def test_tokens_and_logits_identical_to_static_cache(engine, kind, offload_sliding, batch, prompt, new, max_len):
    model = tiny_model(kind)
    ids = random_ids(batch, prompt, seed=batch + prompt)
    want = generate(model, ids, transformers.StaticCache(config=model.config, max_cache_len=max_len), new)
    cache = OffloadedStaticKVCache(config=model.config, max_cache_len=max_len, offload_sliding=offload_sliding)
    got = generate(model, ids, cache, new)
    assert_same(got, want)
    assert got.sequences.shape[1] == prompt + new


@pytest.mark.parametrize("engine", ["host-1MiB-slow"], indirect=True)
@pytest.mark.parametrize("kind, offload_sliding", [("llama", False), ("mistral", True)])
def test_identical_with_slow_copies(engine, kind, offload_sliding):
    """Copies slowed down: every read of the arena or a buffer must wait for the copy that writes it."""
    model = tiny_model(kind)
    ids = random_ids(2, 6, seed=11)
    want = generate(model, ids, transformers.StaticCache(config=model.config, max_cache_len=64), 16)
    cache = OffloadedStaticKVCache(config=model.config, max_cache_len=64, offload_sliding=offload_sliding)
    assert_same(generate(model, ids, cache, 16), want)


def test_layer_kinds_memory_and_arena_contents():
    model = tiny_model("llama")
    cache = OffloadedStaticKVCache(config=model.config, max_cache_len=48, max_batch_size=2, dtype=torch.float32)
    assert all(type(layer).__name__ == "OffloadedStaticLayer" for layer in cache.layers)
    mistral = tiny_model("mistral").config
    assert all(type(ly).__name__ == "StaticSlidingWindowLayer" for ly in OffloadedStaticKVCache(mistral, 16).layers)
    kinds = {type(ly).__name__ for ly in OffloadedStaticKVCache(mistral, 16, offload_sliding=True).layers}
    assert kinds == {"OffloadedStaticSlidingLayer"}

    ids = random_ids(2, 7, seed=4)
    ref = transformers.StaticCache(config=model.config, max_cache_len=48)
    generate(model, ids, ref, 9)
    generate(model, ids, cache, 9)
    offcache.synchronize()
    seq = 7 + 9 - 1
    assert int(cache.get_seq_length()) == seq
    layer_bytes = 2 * 2 * 2 * 48 * 16 * 4  # K and V of batch 2, 2 KV heads, 48 positions, head_dim 16, fp32
    assert cache.device_buffer_bytes() == 2 * layer_bytes  # two layers' worth, for three layers
    for ours, theirs in zip(cache.layers, ref.layers):
        assert _engine.is_arena_tensor(ours.keys) and _engine.is_arena_tensor(ours.values)
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    assert_zero_past(cache, seq)


@both_backends
def test_reset_then_a_shorter_sequence(engine):
    """The device buffers keep no stale tail from a longer sequence."""
    model = tiny_model("llama")
    cache = OffloadedStaticKVCache(config=model.config, max_cache_len=40)
    generate(model, random_ids(1, 9, seed=1), cache, 20)
    cache.reset()
    ids = random_ids(1, 3, seed=2)
    want = generate(model, ids, transformers.StaticCache(config=model.config, max_cache_len=40), 6)
    assert_same(generate(model, ids, cache, 6), want)
    assert_zero_past(cache, 3 + 6 - 1)


def assert_zero_past(cache, seq):
    """Masked positions hold zeros, never stale K/V: a NaN there would poison the softmax."""
    offcache.synchronize()
    for buffers in cache._buffers.values():
        assert all(not t[:, :, seq:].any() for t in buffers.k + buffers.v)


def step_bytes(cache):
    """Bytes per token of one offloaded layer's K and V."""
    layer = cache.layers[cache._offloaded_idx[0]]
    return layer.batch_size * layer.num_heads * (layer.k_head_dim + layer.v_head_dim) * layer.keys.element_size()


@both_backends
@pytest.mark.parametrize("batch", [1, 3])
def test_traffic_is_new_tokens_down_and_filled_prefix_up(engine, batch):
    """D2H per step: the new tokens' K/V; H2D: the filled prefix of each offloaded layer.

    Layer 0's prefix for step t + 1 is prefetched at the end of step t (while the last layer computes),
    so step t moves layers 1..L-1's prefix s_t and layer 0's prefix s_t + n_t.
    """
    model = tiny_model("llama")
    layers = model.config.num_hidden_layers
    cache = OffloadedStaticKVCache(config=model.config, max_cache_len=64)
    ids, seq = random_ids(batch, 6, seed=5), 0
    with torch.no_grad():
        for step in range(8):
            offcache.synchronize()
            before = offcache.stats()
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
            offcache.synchronize()
            after = offcache.stats()
            n, per_token = ids.shape[1], step_bytes(cache)
            arena = layers * 64 * per_token if step == 0 else 0  # allocated (zeros) at the first update
            assert after["d2h_bytes"] - before["d2h_bytes"] == arena + layers * n * per_token, step
            want_h2d = ((layers - 1) * seq + (seq + n)) * per_token
            assert after["h2d_bytes"] - before["h2d_bytes"] == want_h2d, step
            seq += n
            ids = logits[:, -1:].argmax(-1)


@both_backends
def test_traffic_of_a_whole_generation(engine):
    """Over prompt p and k new tokens: D2H = (p + k - 1) tokens, H2D = each step's prefix (+ one prefetch)."""
    model = tiny_model("llama")
    layers, p, k = model.config.num_hidden_layers, 5, 12
    cache = OffloadedStaticKVCache(config=model.config, max_cache_len=4 * (p + k))
    before = offcache.stats()
    generate(model, random_ids(2, p, seed=6), cache, k)
    offcache.synchronize()
    after, per_token = offcache.stats(), step_bytes(cache)
    arena = layers * 4 * (p + k) * per_token  # the zeros each arena layer is allocated with
    assert after["d2h_bytes"] - before["d2h_bytes"] == arena + layers * (p + k - 1) * per_token
    prefixes = sum(range(p, p + k - 1))  # decode steps see prefixes p, p + 1, ..., p + k - 2
    assert after["h2d_bytes"] - before["h2d_bytes"] == (layers * prefixes + (p + k - 1)) * per_token


@pytest.mark.parametrize("kind, offload_sliding", [("llama", False), ("mistral", True)])
def test_torch_compile_same_tokens(kind, offload_sliding):
    """torch.compile(model.forward), backend aot_eager: the graph breaks at each cache update."""
    model = tiny_model(kind)
    ids = random_ids(2, 5, seed=7)
    eager = generate(model, ids, transformers.StaticCache(config=model.config, max_cache_len=16), 8)
    model.forward = torch.compile(model.forward, backend="aot_eager")
    torch._dynamo.reset()
    compiled_ref = generate(model, ids, transformers.StaticCache(config=model.config, max_cache_len=16), 8)
    cache = OffloadedStaticKVCache(config=model.config, max_cache_len=16, offload_sliding=offload_sliding)
    got = generate(model, ids, cache, 8)
    torch._dynamo.reset()
    assert torch.equal(got.sequences, eager.sequences)
    assert_same(got, compiled_ref)  # same graphs around the cache: same logits too


def test_generate_auto_compile():
    """generate compiles the forward itself for a compileable cache (forced on a CPU here)."""
    model = tiny_model("llama")
    ids = random_ids(1, 4, seed=8)
    want = generate(model, ids, transformers.StaticCache(config=model.config, max_cache_len=24), 10)
    config = transformers.CompileConfig(backend="aot_eager", mode=None)
    config._compile_all_devices = True
    got = generate(model, ids, OffloadedStaticKVCache(config=model.config, max_cache_len=24), 10,
                   compile_config=config)  # fmt: skip
    torch._dynamo.reset()
    assert torch.equal(got.sequences, want.sequences)


def test_unsupported_operations_raise():
    model = tiny_model("llama")
    cache = OffloadedStaticKVCache(config=model.config, max_cache_len=32)
    for call, what in ((lambda: cache.crop(3), "cropping"), (lambda: cache.reorder_cache(torch.tensor([0])), "beam"),
                       (lambda: cache.batch_repeat_interleave(2), "batch expansion"),
                       (lambda: cache.batch_select_indices(torch.tensor([0])), "batch selection")):  # fmt: skip
        with pytest.raises(NotImplementedError, match=what):
            call()
    with pytest.raises(NotImplementedError, match="beam search"):
        generate(model, random_ids(1, 4), OffloadedStaticKVCache(config=model.config, max_cache_len=32), 5,
                 num_beams=2)  # fmt: skip
    with pytest.raises(IndexError, match="max_cache_len=8"):
        generate(model, random_ids(1, 6), OffloadedStaticKVCache(config=model.config, max_cache_len=8), 5)
    with pytest.raises(ValueError, match="offloading"):
        OffloadedStaticKVCache(config=model.config, max_cache_len=8, offloading=True)


def test_exported_lazily_from_the_package():
    assert offcache.OffloadedStaticKVCache is OffloadedStaticKVCache
    assert "OffloadedStaticKVCache" in offcache.__all__


@pytest.mark.gpu
@pytest.mark.parametrize("kind, offload_sliding", [("llama", False), ("mistral", True)])
def test_identical_to_static_cache_on_cuda(kind, offload_sliding):
    model = tiny_model(kind, "cuda")
    ids = random_ids(2, 9, seed=9, device="cuda")
    # Eager: identical tokens and logits.
    want = generate(model, ids, transformers.StaticCache(config=model.config, max_cache_len=64), 24,
                    disable_compile=True)  # fmt: skip
    cache = OffloadedStaticKVCache(config=model.config, max_cache_len=64, offload_sliding=offload_sliding)
    assert_same(generate(model, ids, cache, 24, disable_compile=True), want)
    offcache.synchronize()
    assert cache.device_buffer_bytes() > 0 and all(ly.keys.device.type == "cpu" for ly in cache.layers)
    # generate's own compilation (CUDA graphs between the cache calls): the same tokens.
    want = generate(model, ids, transformers.StaticCache(config=model.config, max_cache_len=64), 24)
    got = generate(model, ids, OffloadedStaticKVCache(config=model.config, max_cache_len=64,
                                                      offload_sliding=offload_sliding), 24)  # fmt: skip
    torch._dynamo.reset()
    assert torch.equal(got.sequences, want.sequences)


def test_static_traffic_arithmetic_and_cli(capsys):
    from offcache.kv import main, static_traffic

    t = static_traffic(32, 1, 8192, 32768, 8, 128, torch.bfloat16)
    assert t["offcache_d2h"] == 2 * 32 * 8 * 128 * 2  # one token's K and V in 32 layers
    assert t["offcache_h2d"] == 1 << 30  # the filled 8192 tokens
    assert t["transformers_d2h"] == t["transformers_h2d"] == 4 << 30  # all 32768 positions
    with pytest.raises(ValueError, match="max_cache_len"):
        static_traffic(1, 1, 9, 8, 1, 1)
    main(["size", "--layers", "32", "--tokens", "8192", "--kv-heads", "8", "--head-dim", "128",
          "--max-cache-len", "32768", "--bandwidth-gbps", "50"])  # fmt: skip
    out = capsys.readouterr().out
    assert "D2H 131072 bytes, H2D 1073741824 bytes (21.475 ms H2D" in out
    assert "D2H 4294967296 bytes, H2D 4294967296 bytes (85.899 ms H2D" in out
    assert "4.00x" in out
