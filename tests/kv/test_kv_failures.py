"""A KV update that fails (HostLimitError: the host limit reached with no disk tier) leaves the layer
exactly as it was: its length, its contents, and a later update that succeeds gives what a cache that
never failed gives (issue 31 item 4: the length used to move before the store, 83 against 82 held).

The failure is injected at the engine's store (dynamic layers) or copy (static layers), the calls a
real HostLimitError comes from, on the first update of a layer and on later ones."""

import pytest
import torch

import offcache
from offcache import engine as _engine
from offcache.bench.models import causal_lm

transformers = pytest.importorskip("transformers")

B, H, D = 2, 2, 8  # batch, KV heads, head dim of the tiny models (TINY in offcache/bench/models.py)


class FailNext:
    """Arms the engine call that a layer's update stores through to raise HostLimitError once."""

    def __init__(self, monkeypatch):
        self.armed = False
        for name in ("store", "copy_into"):
            real = getattr(_engine, name)
            monkeypatch.setattr(_engine, name, self._wrap(real))

    def _wrap(self, real):
        def call(*args, **kwargs):
            if self.armed:
                self.armed = False
                raise offcache.HostLimitError("injected: the host limit is reached")
            return real(*args, **kwargs)

        return call


def _step(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)


def _caches(kind: str):
    model = causal_lm("mistral", sliding_window=6) if "sliding" in kind else causal_lm("llama")
    config = model.config
    if kind.startswith("static"):
        return (offcache.OffloadedStaticKVCache(config=config, max_cache_len=32, offload_sliding=True),
                transformers.StaticCache(config=config, max_cache_len=32))  # fmt: skip
    return (offcache.OffloadedKVCache(config=config, offload_sliding=True),
            transformers.DynamicCache(config=config))  # fmt: skip


def _kv(cache, layer: int):
    layer = cache.layers[layer]
    return layer.keys.clone(), layer.values.clone()


@pytest.mark.parametrize("engine", ["host"], indirect=True)
@pytest.mark.parametrize("kind", ["dynamic", "dynamic_sliding", "static", "static_sliding"])
@pytest.mark.parametrize("fail_at", [0, 1, 4])  # the first update of a layer, a later one, past compaction/window
def test_a_failed_update_leaves_the_layer_as_it_was(engine, monkeypatch, kind, fail_at):
    ours, ref = _caches(kind)
    fail = FailNext(monkeypatch)
    steps = [_step(i, 3 if i == 0 else 1) for i in range(7)]
    for i, (k, v) in enumerate(steps):
        if i == fail_at:
            before_len = ours.get_seq_length(0)
            before_kv = _kv(ours, 0) if ours.layers[0].is_initialized and before_len else None
            fail.armed = True
            with pytest.raises(offcache.HostLimitError):
                ours.update(k, v, 0)
            assert not fail.armed, "the injected failure was not reached"
            assert ours.get_seq_length(0) == before_len, f"the length moved ({kind}, step {i})"
            if before_kv is not None:
                after = _kv(ours, 0)
                assert torch.equal(after[0], before_kv[0]) and torch.equal(after[1], before_kv[1])
        got = ours.update(k, v, 0)  # the same step again, now succeeding
        want = ref.update(k, v, 0)
        assert ours.get_seq_length(0) == ref.get_seq_length(0), f"step {i}"
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"step {i}"


@pytest.mark.parametrize("engine", ["host", "host-1MiB-slow"], indirect=True)
@pytest.mark.parametrize("fail_call", [0, 1, 2, 3])
@pytest.mark.parametrize("handed_out", [False, True])
def test_a_dynamic_update_failing_at_any_engine_call_leaves_the_layer_as_it_was(engine, monkeypatch, fail_call,
                                                                                handed_out):  # fmt: skip
    """Buffers that grow every few steps (ALIGN 1): an update makes up to four engine calls (the fetch, the new
    buffers' store, the prefix's copy into them, the new tokens' copy). Failing at any of them leaves the layer
    as it was, K/V handed out before included (their copy on write); the same step then succeeds."""
    from offcache.kv import dynamic_layers

    monkeypatch.setattr(dynamic_layers, "ALIGN", 1)
    ours, ref = _caches("dynamic")
    calls = {"armed": False, "n": 0}

    def wrap(real):
        def call(*args, **kwargs):
            if calls["armed"]:
                calls["n"] += 1
                if calls["n"] - 1 == fail_call:
                    calls["armed"] = False
                    raise offcache.HostLimitError("injected: the host limit is reached")
            return real(*args, **kwargs)

        return call

    for name in ("store", "copy_into"):
        monkeypatch.setattr(_engine, name, wrap(getattr(_engine, name)))
    failed = 0
    for i in range(12):
        k, v = _step(i, 3 if i == 0 else 1)
        before_len = ours.get_seq_length(0)
        before_kv = _kv(ref, 0) if before_len else None  # the reference's: reading ours would hand it out
        held = (ours.layers[0].keys, ours.layers[0].values) if handed_out and before_len else None
        calls.update(armed=True, n=0)
        try:
            got = ours.update(k, v, 0)
        except offcache.HostLimitError:
            failed += 1
            assert ours.get_seq_length(0) == before_len, f"step {i}"
            if before_kv is not None:
                after = _kv(ours, 0)
                assert torch.equal(after[0], before_kv[0]) and torch.equal(after[1], before_kv[1]), f"step {i}"
            got = ours.update(k, v, 0)  # the same step again, now succeeding
        calls["armed"] = False
        want = ref.update(k, v, 0)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"step {i}"
        if held is not None:  # a reference taken before the step sees none of it
            assert held[0].shape[-2] == before_len and torch.equal(held[0], before_kv[0])
    assert failed, "no update reached the injected failure"
    layer, theirs = ours.layers[0], ref.layers[0]
    assert torch.equal(layer.keys, theirs.keys) and torch.equal(layer.values, theirs.values)


# References held across steps (issue 31 items 2 and 3) -------------------------------------------------


def _ids(batch, n, seed):
    return torch.randint(1, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("engine", ["default", "host-1MiB-slow"], indirect=True)
@pytest.mark.parametrize("how", ["tensor", "data", "numpy"])
@pytest.mark.parametrize("kind", ["dynamic", "dynamic_sliding", "static", "static_sliding"])
def test_a_reference_taken_before_a_step_and_edited_after_it_behaves_as_in_transformers(engine, how, kind):
    """Take every layer's K/V before a step, run the step, then edit through the old references, and run
    one more step. DynamicCache made new tensors at the step (the edit never reaches the cache);
    StaticCache's are persistent (the edit is seen). offcache must agree on every layer: layer 0's
    prefetch for the next step is issued before the edit, the others' after it."""
    from tests.kv.kv_models import edit_in_place, kw

    ours, ref = _caches(kind)
    model = causal_lm("mistral", sliding_window=6) if "sliding" in kind else causal_lm("llama")
    ids, logits = _ids(2, 5, seed=4), {}
    for name, cache in (("ref", ref), ("ours", ours)):
        with torch.no_grad():
            out = model(input_ids=ids, **kw(cache), use_cache=True).logits
            held = [(layer.keys, layer.values) for layer in cache.layers]  # taken before the step
            step = out[:, -1:].argmax(-1)
            out = model(input_ids=step, **kw(cache), use_cache=True).logits
            if name == "ours":
                # An old reference to the arena sees a later step's D2H once it landed: the edit waits
                # for it (docs/kv-caches.md). The prefetch for the next step was issued all the same.
                offcache.synchronize()
            for k, v in held:
                edit_in_place(k, how, 0.5)
                edit_in_place(v, how, -1.0)
            step = out[:, -1:].argmax(-1)
            logits[name] = model(input_ids=step, **kw(cache), use_cache=True).logits
    gap = (logits["ours"] - logits["ref"]).abs().max()
    assert torch.allclose(logits["ours"], logits["ref"], atol=1e-5, rtol=0), gap


# At the host limit (issue 31 item 10; issue 41: a layer is one buffer per tensor) ------------------------


def test_at_the_host_limit_a_read_needs_no_room_and_a_growth_that_finds_none_loses_nothing(engine_config):
    """Reading an offloaded layer's keys hands out a view of its buffer: no host room needed, at the host
    limit too. An update whose buffers must grow past the limit (no disk tier) raises HostLimitError and
    leaves the layer as it was; the cache decodes on with DynamicCache's tokens."""
    from tests.kv.kv_models import kw

    engine_config(backend="host", host_limit="600KiB", disk_dir="none")
    model = causal_lm("llama")
    ours = offcache.OffloadedKVCache(config=model.config)
    ref = transformers.DynamicCache(config=model.config)
    ids = _ids(2, 8, seed=1)
    with torch.no_grad():
        steps = {}
        for name, cache in (("ours", ours), ("ref", ref)):
            out, tokens = model(input_ids=ids, **kw(cache), use_cache=True).logits, []
            for _ in range(100):  # 108 tokens: each layer's buffers hold 128 positions (64 KiB of K and V)
                tokens.append(out[:, -1:].argmax(-1))
                out = model(input_ids=tokens[-1], **kw(cache), use_cache=True).logits
            steps[name] = out
        offcache.synchronize()
        host = offcache.stats()["pinned_in_use_bytes"] + offcache.stats()["pageable_bytes"]
        held = [(layer.keys, layer.values) for layer in ours.layers]  # views: no room taken
        offcache.synchronize()
        assert offcache.stats()["pinned_in_use_bytes"] + offcache.stats()["pageable_bytes"] == host
        for (k, v), layer in zip(held, ref.layers):
            assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)
        del held
        length, before = ours.get_seq_length(), _kv(ours, 0)
        big = torch.randn(B, H, 2000, 16)  # 2108 tokens: buffers of 3200 positions, 1.6 MB: past the limit
        with pytest.raises(offcache.HostLimitError):
            ours.update(big, big, 0)
        assert ours.get_seq_length() == length
        after = _kv(ours, 0)
        assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
        for name, cache in (("ours", ours), ("ref", ref)):
            step = steps[name][:, -1:].argmax(-1)
            steps[name] = model(input_ids=step, **kw(cache), use_cache=True).logits
    assert torch.equal(steps["ours"], steps["ref"])


@pytest.mark.parametrize("engine", ["host"], indirect=True)
@pytest.mark.parametrize("kind", ["dynamic", "dynamic_sliding", "static", "static_sliding"])
def test_generate_hands_out_no_layer_so_every_layer_stays_prefetched(engine, kind):
    """A static layer whose K/V were handed out is no longer prefetched (see above): transformers'
    generate itself must not hand any out, or every decode step would wait for its fetches."""
    from tests.kv.kv_models import kw

    ours, _ = _caches(kind)
    model = causal_lm("mistral", sliding_window=6) if "sliding" in kind else causal_lm("llama")
    ids = _ids(2, 5, seed=9)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw(ours), max_new_tokens=10,
                       do_sample=False, pad_token_id=0)  # fmt: skip
    assert not any(layer.__dict__.get("_exposed") for layer in ours.layers)
