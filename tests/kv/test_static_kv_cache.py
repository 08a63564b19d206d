"""OffloadedStaticKVCache: tokens and logits identical to StaticCache; only what changed moves."""

import pytest
import torch

import offcache
import offcache.kv.static
from offcache import engine as _engine
from offcache.bench.models import causal_lm
from offcache.kv.dynamic import cache_kwarg
from offcache.kv.static import OffloadedStaticKVCache
from tests.kv.kv_models import copier, edit_layer_in_place, fill, kw, select_repeat_decode

transformers = pytest.importorskip("transformers")

# The default and host engines (the slow 1 MiB configuration adds nothing here).
both_backends = pytest.mark.parametrize("engine", ["default", "host"], indirect=True)


def tiny_model(kind: str, device=None):
    return causal_lm(kind, device, sliding_window=8) if kind == "mistral" else causal_lm(kind, device)


def generate(model, ids, cache, new_tokens, **kwargs):
    with torch.no_grad():
        return model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), **kw(cache), max_new_tokens=new_tokens,
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
    """Bytes per token of one offloaded layer's K and V (not read through .keys: handing K/V out drops
    the layer's prefetch, which would add an H2D copy to the traffic measured)."""
    layer = cache.layers[cache._offloaded_idx[0]]
    k, v = layer._host_k, layer._host_v
    return (
        layer.batch_size * layer.num_heads * (layer.k_head_dim * k.element_size() + layer.v_head_dim * v.element_size())
    )


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
            logits = model(input_ids=ids, **kw(cache), use_cache=True).logits
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
def test_torch_compile_fullgraph_same_tokens(kind, offload_sliding):
    """torch.compile(model.forward, fullgraph=True), backend aot_eager: the cache update is one custom op."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = tiny_model(kind)
    ids = random_ids(2, 5, seed=7)
    eager = generate(model, ids, transformers.StaticCache(config=model.config, max_cache_len=16), 8)
    counter = CompileCounterWithBackend("aot_eager")
    forward = model.forward
    model.forward = torch.compile(forward, backend=counter, fullgraph=True)  # a graph break raises
    torch._dynamo.reset()
    try:
        compiled_ref = generate(model, ids, transformers.StaticCache(config=model.config, max_cache_len=16), 8)
        ref_graphs, counter.frame_count = counter.frame_count, 0
        cache = OffloadedStaticKVCache(config=model.config, max_cache_len=16, offload_sliding=offload_sliding)
        got = generate(model, ids, cache, 8)
    finally:
        model.forward = forward
        torch._dynamo.reset()
    assert torch.equal(got.sequences, eager.sequences)
    assert_same(got, compiled_ref)  # same graphs around the cache: same logits too
    assert 0 < counter.frame_count <= ref_graphs  # no more (re)compilations than StaticCache needs
    assert all(ly.keys.device.type == "cpu" for ly in cache.layers)


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


def test_errors():
    model = tiny_model("llama")
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
    from offcache.kv.size import main, static_traffic

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


# Layer K/V, transformers' cache operations, deepcopy (issues 17 and 20) --------------------------


def run(model, ids, cache, new, **kwargs):
    """generate with `kwargs` overriding the greedy defaults (seeded, for sampling)."""
    torch.manual_seed(0)
    with torch.no_grad():
        return model.generate(**{"input_ids": ids, "attention_mask": torch.ones_like(ids), cache_kwarg(): cache,
                                 "max_new_tokens": new, "do_sample": False, "pad_token_id": 0, **kwargs})  # fmt: skip


def assert_same_layers(ours, theirs, exact=True):
    """Every layer's K/V hold the reference's values (read at once: reads wait for the copies)."""
    assert len(ours.layers) == len(theirs.layers)
    for i, (a, b) in enumerate(zip(ours.layers, theirs.layers)):
        if isinstance(a, offcache.kv.static._StaticOffloaded):
            assert a.keys.device.type == "cpu" and _engine.is_offcache_tensor(a.keys), i
        assert int(a.get_seq_length()) == int(b.get_seq_length()), i
        n = min(int(a.get_seq_length()), a.keys.shape[-2])
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            x, y = x[:, :, :n].cpu(), y[:, :, :n].cpu()
            assert torch.equal(x, y) if exact else torch.allclose(x, y, atol=1e-5), i


offload_modes = pytest.mark.parametrize(
    "kind, offload_sliding", [("llama", False), ("mistral", False), ("mistral", True)]
)


@pytest.mark.parametrize("engine", ["host-1MiB-slow"], indirect=True)
@offload_modes
def test_layer_keys_read_after_the_copies_land(engine, kind, offload_sliding):
    """Read at once after an update (no synchronize) with slowed copies: the values just written."""
    model = tiny_model(kind)
    ref = transformers.StaticCache(config=model.config, max_cache_len=12)
    cache = OffloadedStaticKVCache(config=model.config, max_cache_len=12, offload_sliding=offload_sliding)
    for c in (ref, cache):
        k = torch.arange(1, 2 * 2 * 3 * 16 + 1, dtype=torch.float32).reshape(2, 2, 3, 16)
        for i in range(len(c.layers)):
            c.update(k + i, -k - i, i)
    assert_same_layers(cache, ref)
    ids = random_ids(2, 4, seed=12)
    ref = transformers.StaticCache(config=model.config, max_cache_len=20)
    cache = OffloadedStaticKVCache(config=model.config, max_cache_len=20, offload_sliding=offload_sliding)
    run(model, ids, ref, 12)
    run(model, ids, cache, 12)
    assert_same_layers(cache, ref)


@pytest.mark.parametrize("engine", ["host", "host-1MiB-slow"], indirect=True)
@offload_modes
@pytest.mark.parametrize("search", [dict(num_beams=3), dict(num_beams=2, do_sample=True, top_k=5)])
def test_beam_search_same_as_static_cache(engine, kind, offload_sliding, search):
    model = tiny_model(kind)
    ids = random_ids(2, 5, seed=3)
    ref = transformers.StaticCache(config=model.config, max_cache_len=24)
    want = run(model, ids, ref, 14, **search)
    cache = OffloadedStaticKVCache(config=model.config, max_cache_len=24, offload_sliding=offload_sliding)
    assert torch.equal(run(model, ids, cache, 14, **search), want)
    assert_same_layers(cache, ref)


@pytest.mark.parametrize("engine", ["host", "host-1MiB-slow"], indirect=True)
@pytest.mark.parametrize("assist", ["model", "prompt_lookup"])
def test_assisted_decoding_same_tokens_as_greedy(engine, assist):
    """Candidates rejected by the model are cropped off; tokens equal StaticCache's greedy ones."""
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    extra = {"assistant_model": causal_lm("llama", seed=1)} if assist == "model" else {"prompt_lookup_num_tokens": 3}
    want = run(model, ids, transformers.StaticCache(config=model.config, max_cache_len=40), 16)
    cache = OffloadedStaticKVCache(config=model.config, max_cache_len=40)
    assert torch.equal(run(model, ids, cache, 16, **extra), want)
    assert int(cache.get_seq_length()) == 10 + 16 - 1


@pytest.mark.parametrize("engine", ["host"], indirect=True)
@pytest.mark.parametrize("offload_sliding", [False, True])
def test_crop_of_sliding_layers(engine, offload_sliding):
    """Within the window crop is a length change; once the window dropped tokens, a RuntimeError."""
    model = tiny_model("mistral")
    ids = random_ids(1, 7, seed=13)
    ref = transformers.StaticCache(config=model.config, max_cache_len=16)
    cache = OffloadedStaticKVCache(config=model.config, max_cache_len=16, offload_sliding=offload_sliding)
    with torch.no_grad():
        want = model(input_ids=ids, **kw(ref), use_cache=True).logits
        model(input_ids=ids[:, :6], **kw(cache), use_cache=True)
        cache.crop(-2)
        assert int(cache.get_seq_length()) == 4
        got = model(input_ids=ids[:, 4:], **kw(cache), use_cache=True).logits
        assert torch.allclose(got, want[:, 4:], atol=1e-5)
        model(input_ids=ids[:, :2], **kw(cache), use_cache=True)  # 9 > window 8: one dropped
    with pytest.raises(RuntimeError, match="sliding window"):
        cache.crop(-1)
    cache.crop(0)  # removes nothing: fine
    with pytest.raises(ValueError, match="assisted"):  # refused up front, not mid-generation
        run(model, ids, OffloadedStaticKVCache(config=model.config, max_cache_len=16), 4, prompt_lookup_num_tokens=2)


@pytest.mark.parametrize("engine", ["host", "host-1MiB-slow"], indirect=True)
@offload_modes
def test_batch_select_and_repeat_same_tokens_as_dynamic_cache(engine, kind, offload_sliding):
    """Fill with a prompt, select / repeat batch rows, decode on: DynamicCache's tokens and K/V."""
    model = tiny_model(kind)
    ids = random_ids(3, 6, seed=4)
    ours = OffloadedStaticKVCache(config=model.config, max_cache_len=24, offload_sliding=offload_sliding)
    ref = transformers.DynamicCache(config=model.config)
    assert torch.equal(select_repeat_decode(model, ours, ids), select_repeat_decode(model, ref, ids))
    assert ours.batch_size == 4
    if ours._offloaded_idx:  # device buffers of the batch size in use only: 2 layers' worth
        layer = ours.layers[ours._offloaded_idx[0]]
        assert ours.device_buffer_bytes() == 2 * 2 * layer._host_k.numel() * layer._host_k.element_size()
    if kind == "llama":
        assert_same_layers(ours, ref, exact=False)


@pytest.mark.parametrize("engine", ["host", "host-1MiB-slow"], indirect=True)
@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("kind, offload_sliding", [("llama", False), ("mistral", True)])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copied_cache_generates_like_static_cache(engine, layers, kind, offload_sliding, how):
    """The prompt-reuse recipe: fill, deepcopy (or pickle), generate from the copy."""
    import copy

    copy_of = copier(how)
    model = causal_lm(kind, num_hidden_layers=layers, **({"sliding_window": 8} if kind == "mistral" else {}))
    prompt, ids = random_ids(1, 6, seed=8), random_ids(1, 9, seed=8)
    ids[:, :6] = prompt
    ref = copy.deepcopy(fill(model, transformers.StaticCache(config=model.config, max_cache_len=24), prompt))
    want = run(model, ids, ref, 10)
    ours = OffloadedStaticKVCache(config=model.config, max_cache_len=24, offload_sliding=offload_sliding)
    filled = fill(model, ours, prompt)
    copied = copy_of(filled)
    assert torch.equal(run(model, ids, copied, 10), want)
    assert_same_layers(copied, ref)
    assert torch.equal(run(model, ids, copy_of(filled), 10), want)  # the original is intact
    assert torch.equal(run(model, ids, filled, 10), want)


@pytest.mark.gpu
@pytest.mark.parametrize("kind, offload_sliding", [("llama", False), ("mistral", True)])
def test_reduce_overhead_fullgraph_same_tokens_on_cuda(kind, offload_sliding):
    """mode="reduce-overhead", fullgraph: the custom op stays out of the CUDA graphs (graph partition)."""
    model = tiny_model(kind, "cuda")
    ids = random_ids(2, 9, seed=9, device="cuda")
    want = generate(model, ids, transformers.StaticCache(config=model.config, max_cache_len=64), 24,
                    disable_compile=True)  # fmt: skip
    forward = model.forward
    model.forward = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
    torch._dynamo.reset()
    try:
        for _ in range(2):  # the second run replays the recorded graphs
            cache = OffloadedStaticKVCache(config=model.config, max_cache_len=64, offload_sliding=offload_sliding)
            got = generate(model, ids, cache, 24, disable_compile=True)
            assert torch.equal(got.sequences, want.sequences)
            assert all(ly.keys.device.type == "cpu" for ly in cache.layers)  # all offloaded
    finally:
        model.forward = forward
        torch._dynamo.reset()


@pytest.mark.gpu
def test_reduce_overhead_copies_no_layer_kv_into_cuda_graph_inputs(monkeypatch):
    """Per offloaded layer and step, one device-to-device copy of its K/V (the op's, into outputs the graph
    allocated): CUDA graph trees read those in the graph pool where the op wrote them, copying none of them
    into the next graph's input buffers on replay (a second full-buffer copy each, before)."""
    from torch._inductor import cudagraph_trees

    model = tiny_model("llama", "cuda")
    ids = random_ids(1, 9, seed=5, device="cuda")
    copied = []
    node = cudagraph_trees.CUDAGraphNode
    assert hasattr(node, "_copy_inputs_and_remove_from_src"), f"torch {torch.__version__}: replay copies moved"
    original = node._copy_inputs_and_remove_from_src

    def counting(self, dsts, srcs):
        copied.extend(tuple(srcs[i].shape) for i in self.non_static_input_idx if isinstance(srcs[i], torch.Tensor))
        return original(self, dsts, srcs)

    monkeypatch.setattr(node, "_copy_inputs_and_remove_from_src", counting)
    forward = model.forward
    model.forward = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
    torch._dynamo.reset()
    try:
        for _ in range(2):  # the second run replays the recorded graphs
            cache = OffloadedStaticKVCache(config=model.config, max_cache_len=64)
            copied.clear()
            generate(model, ids, cache, 8, disable_compile=True)
    finally:
        model.forward = forward
        torch._dynamo.reset()
    assert copied, "no replay copied any input: the graphs did not replay, or the copy moved"  # ids do
    layer = cache.layers[0]
    kv_shapes = {tuple(layer.keys.shape), tuple(layer.values.shape)}
    assert not [s for s in copied if s in kv_shapes], copied


# In-place edits, the op registry, inductor (issue 24, items 2, 3, 7) ------------------------------


@pytest.mark.parametrize("engine", ["default", "host-1MiB-slow"], indirect=True)
@pytest.mark.parametrize("how", ["tensor", "data", "numpy"])
@pytest.mark.parametrize("kind, offload_sliding", [("llama", False), ("mistral", True)])
def test_in_place_edit_of_layer_kv_is_seen_by_the_next_step(engine, how, kind, offload_sliding):
    """Prefill, edit layer 0's K/V in place (the layer the last layer's update prefetched), decode:
    StaticCache's logits, with copies slowed too (a prefetch still reading the arena races the edit)."""
    model = tiny_model(kind)
    ids = random_ids(2, 6, seed=21)
    logits = {}
    ours = OffloadedStaticKVCache(config=model.config, max_cache_len=16, offload_sliding=offload_sliding)
    caches = {"ref": transformers.StaticCache(config=model.config, max_cache_len=16), "ours": ours}
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


def test_a_dropped_cache_leaves_the_op_registry():
    """The custom op finds a cache by handle; the registry holds it weakly: no growth per cache built."""
    import gc

    from offcache.kv.static import _CACHES

    model = tiny_model("llama")
    gc.collect()
    before = len(_CACHES)
    cache = fill(model, OffloadedStaticKVCache(config=model.config, max_cache_len=8), random_ids(1, 3, seed=1))
    handle = cache._handle
    assert _CACHES[handle] is cache
    del cache
    gc.collect()
    assert handle not in _CACHES
    for _ in range(100):
        OffloadedStaticKVCache(config=model.config, max_cache_len=8)
    gc.collect()
    assert len(_CACHES) == before


def test_torch_compile_inductor_fullgraph_logits_per_step():
    """The default backend (inductor, on the CPU), fullgraph: per step the logits of StaticCache compiled
    the same way, and of eager, across reset() and a new prompt. Inductor hands the custom op a copy of
    `cumulative_length` while the graph reads the layer's own: the op must advance only the copy."""
    model = causal_lm("llama", num_hidden_layers=1)
    forward = model.forward
    compiled = torch.compile(forward, fullgraph=True)
    torch._dynamo.reset()

    def run_steps(cache, fwd, prompt, decode):
        """Eager prefill (as generate does), then `decode` steps through `fwd`: every step's logits."""
        out = []
        with torch.no_grad():
            logits = forward(input_ids=prompt, **kw(cache), use_cache=True).logits
            for _ in range(decode):
                out.append(logits[:, -1])
                logits = fwd(input_ids=logits[:, -1:].argmax(-1), **kw(cache), use_cache=True).logits
        return out + [logits[:, -1]]

    caches = {name: (cls(config=model.config, max_cache_len=16), fwd)
              for name, cls, fwd in (("eager", transformers.StaticCache, forward),
                                     ("static", transformers.StaticCache, compiled),
                                     ("ours", OffloadedStaticKVCache, compiled))}  # fmt: skip
    try:
        for prompt in (random_ids(1, 5, seed=31), random_ids(1, 3, seed=32)):
            got = {}
            for name, (cache, fwd) in caches.items():
                cache.reset()
                got[name] = run_steps(cache, fwd, prompt, 3)
            for step, (ours, static, eager) in enumerate(zip(got["ours"], got["static"], got["eager"])):
                assert torch.allclose(static, eager, atol=1e-5), step  # the reference itself
                assert torch.allclose(ours, static, atol=1e-5), (step, (ours - static).abs().max())
    finally:
        torch._dynamo.reset()


# transformers 5.24 (issue 25): keys and values of different dtypes, crops by its rule -------------


@pytest.mark.parametrize("engine", ["host", "host-1MiB-slow"], indirect=True)
@pytest.mark.parametrize("offload_sliding", [False, True])
def test_keys_and_values_of_different_dtypes(engine, offload_sliding):
    """Each keeps its own dtype in the arena and the device buffers (5.24's StaticLayer does)."""
    model = tiny_model("mistral" if offload_sliding else "llama")
    cache = OffloadedStaticKVCache(config=model.config, max_cache_len=8, offload_sliding=offload_sliding)
    g = torch.Generator().manual_seed(0)
    chunks = [(torch.randn(2, 2, n, 16, generator=g), torch.randn(2, 2, n, 16, generator=g).to(torch.bfloat16))
              for n in (3, 1, 2)]  # fmt: skip
    for k, v in chunks:
        for layer in range(len(cache.layers)):
            got_k, got_v = cache.update(k, v, layer)
        assert got_k.dtype == torch.float32 and got_v.dtype == torch.bfloat16
    want_k, want_v = (torch.cat([c[i] for c in chunks], dim=-2) for i in (0, 1))
    assert torch.equal(got_k[:, :, :6], want_k) and torch.equal(got_v[:, :, :6], want_v)
    assert not got_k[:, :, 6:].any() and not got_v[:, :, 6:].any()
    for layer in cache.layers:
        assert layer.keys.dtype == torch.float32 and layer.values.dtype == torch.bfloat16
        assert torch.equal(layer.keys[:, :, :6], want_k) and torch.equal(layer.values[:, :, :6], want_v)
    assert cache.device_buffer_bytes() == 2 * 2 * 2 * 8 * 16 * (4 + 2)  # 2 buffers of K fp32 and V bf16


@pytest.mark.parametrize("engine", ["host"], indirect=True)
@pytest.mark.parametrize("kind, offload_sliding", [("llama", False), ("mistral", False), ("mistral", True)])
def test_positive_crop_follows_the_installed_transformers(engine, kind, offload_sliding):
    """crop(n > 0), the legacy "keep n": refused with transformers' own error where it refuses it (5.24's
    StaticLayer.crop; 5.23's dynamic rule), else the length kept: as transformers' cache does."""
    from transformers.cache_utils import StaticLayer

    model = tiny_model(kind)
    ids = random_ids(1, 7, seed=14)
    ours = fill(model, OffloadedStaticKVCache(config=model.config, max_cache_len=16, offload_sliding=offload_sliding),
                ids)  # fmt: skip
    static_crops = "crop" in vars(StaticLayer)  # else static layers have no crop: the dynamic rule is the one
    ref = fill(model, transformers.StaticCache(config=model.config, max_cache_len=16) if static_crops
               else transformers.DynamicCache(config=model.config), ids)  # fmt: skip
    outcomes = []
    for c in (ref, ours):
        try:
            c.crop(4)
            outcomes.append(None)
        except (ValueError, RuntimeError) as e:
            outcomes.append((type(e), str(e)))
    assert outcomes[0] == outcomes[1]
    assert int(ours.get_seq_length()) == int(ref.get_seq_length()) == (7 if outcomes[0] else 4)
