"""What each call asks of the backend, bounded. Both backends count the same primitives at
the same places (csrc/backends/backend.h, Counters), so these host-backend bounds hold for the CUDA
path too; tests/engine/test_gpu_streams.py checks the CUDA-only ones (pooled events)."""

import pytest
import torch

import offcache
from offcache import IntermediatesCache
from offcache import engine as _engine
from offcache.engine import loader as _loader
from tests.helpers import CPU

COUNTERS = ("events_created", "events_recorded", "stream_waits", "copy_calls", "host_callbacks", "syncs")


@pytest.fixture
def host_engine(engine_config):
    """The host backend with stores through its D2H stream, as a GPU's stores go: a copy delay sends a
    store of CPU memory there instead of copying it on the calling thread (csrc/backends/backend.h,
    copies_host_stores_inline), so the counts below are the CUDA path's."""
    engine_config(backend="host", host_copy_delay_us=1)
    return engine_config


class Delta:
    """Counter deltas over a `with` block."""

    def __enter__(self):
        self.before = offcache.stats()
        return self

    def __exit__(self, *exc):
        after = offcache.stats()
        self.d = {k: after[k] - self.before[k] for k in COUNTERS + ("h2d_copies", "d2h_copies")}

    def __getitem__(self, key):
        return self.d[key]


@pytest.mark.parametrize("n", [1, 10, 1000])
def test_store_of_many_small_tensors(host_engine, n):
    xs = [torch.randn(64) for _ in range(n)]
    _engine.store([torch.randn(64) for _ in range(n)], CPU)  # warm: chunks, threads
    offcache.synchronize()
    with Delta() as d:
        _engine.store(xs, CPU)
    assert d["copy_calls"] <= 2
    assert d["stream_waits"] <= 3
    assert d["events_created"] == 0
    assert d["host_callbacks"] == 0
    assert d["syncs"] == 0  # a store never blocks the host


def test_store_packs_in_pieces_of_at_most_16_mib(host_engine):
    xs = [torch.randn((1 << 17) - 16) for _ in range(40)]  # 40 x ~512 KiB: 20 MiB of small values
    with Delta() as d:
        stored = _engine.store(xs, CPU)
    assert 2 <= d["copy_calls"] <= 3
    # Each piece is one block: values of one piece lie within 16 MiB of each other.
    ptrs = sorted(t.data_ptr() for t in stored)
    gaps = sum(1 for a, b in zip(ptrs, ptrs[1:]) if b - a != xs[0].nbytes)  # packed back to back
    assert gaps <= d["copy_calls"] - 1


@pytest.mark.parametrize("n", [2, 100, 1000])
def test_fetch_of_many_small_tensors_from_one_block(host_engine, n):
    stored = _engine.store([torch.full((32,), float(i)) for i in range(n)], CPU)
    offcache.synchronize()
    with Delta() as d:
        back, _ = _engine.fetch(stored, CPU, True)
    assert d["copy_calls"] == 1 and d["h2d_copies"] == 1
    assert d["stream_waits"] == 0  # the store completed: nothing to wait for
    assert all(torch.equal(b, torch.full((32,), float(i))) for i, b in enumerate(back))


@pytest.mark.parametrize("n", [2, 1000])
def test_a_packed_fetch_costs_one_allocation_not_one_per_value(host_engine, n):
    # Per-output allocations (and on CUDA a recordStream each, then an event each when they die)
    # cost 2-4 us per tensor: the outputs of a span share one allocation, each a storage of its own.
    stored = _engine.store([torch.full((32,), float(i)) for i in range(n)], CPU)
    offcache.synchronize()
    before = offcache.stats()
    back, _ = _engine.fetch(stored, CPU, True)
    after = offcache.stats()
    assert after["output_allocations"] - before["output_allocations"] == 1
    assert after["handovers"] == before["handovers"]  # a CPU consumer: nothing to hand over
    ptrs = {b.untyped_storage().data_ptr() for b in back}
    assert len(ptrs) == n and all(b.untyped_storage().nbytes() == 32 * 4 for b in back)
    back[0].fill_(-1.0)  # separate storages: an edit of one output leaves the others
    assert all(torch.equal(b, torch.full((32,), float(i))) for i, b in enumerate(back) if i)


def test_outputs_sharing_an_allocation_live_and_die_independently(host_engine):
    import gc
    import weakref

    values = [torch.full((8, 4), float(i)).t() for i in range(5)]  # non-contiguous, dense: strides kept
    stored = _engine.store(values, CPU)
    back, _ = _engine.fetch(stored, CPU, True)
    assert all(b.stride() == v.stride() and torch.equal(b, v) for b, v in zip(back, values))
    keep, refs = back[3], [weakref.ref(b) for b in back]
    del back
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True, False, True]
    assert torch.equal(keep, values[3])  # the shared allocation lives while one output does
    assert _loader._C.allocation_of(keep) is not None and _loader._C.allocation_of(keep).numel() >= 5 * 32 * 4
    keep.resize_(1000).fill_(7.0)  # grown: memory of its own, from the span's allocator
    assert _loader._C.allocation_of(keep) is keep
    assert keep.untyped_storage().nbytes() == 4000


def test_fetch_waits_once_per_distinct_event(engine_config):
    engine_config(backend="host", host_copy_delay_us=20000)
    stored = _engine.store([torch.full((32,), float(i)) for i in range(500)], CPU)  # one block, one event
    with Delta() as d:
        _engine.fetch(stored, CPU, True)
    assert d["stream_waits"] <= 1
    assert d["copy_calls"] == 1


def test_timed_events_only_while_tracing_or_timing(host_engine):
    x = torch.randn(1000)
    _engine.store([x * 1], CPU)
    offcache.synchronize()
    s = offcache.stats()
    assert s["d2h_seconds"] == 0.0  # untimed by default
    _engine.set_timing(True)
    try:
        _engine.store([x * 2], CPU)
        offcache.synchronize()
        assert offcache.stats()["d2h_seconds"] > 0.0
    finally:
        _engine.set_timing(False)


def test_kv_decode_step_moves_one_copy_per_tensor(engine_config):
    pytest.importorskip("transformers")
    from offcache.bench.models import causal_lm
    from tests.kv.kv_models import kw

    engine_config(backend="host")
    model = causal_lm("llama")
    cache = offcache.OffloadedKVCache(config=model.config)
    ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, **kw(cache), use_cache=True)
        step = out.logits[:, -1:].argmax(-1)
        for _ in range(2):  # warm
            step = model(input_ids=step, **kw(cache), use_cache=True).logits[:, -1:].argmax(-1)
        offcache.synchronize()
        with Delta() as d:
            model(input_ids=step, **kw(cache), use_cache=True)
    layers = model.config.num_hidden_layers
    assert d["h2d_copies"] <= 2 * layers  # K and V, one copy each into one device tensor each
    assert d["d2h_copies"] <= 2 * layers  # the new token's K and V, into the tails of the layer's buffers
    assert d["events_created"] == 0


def test_iter_prefetch_depth_runs_ahead(host_engine):
    cache = IntermediatesCache.empty(6, "cpu")
    for i in range(6):
        cache.update(i, {"x": torch.full((4,), float(i))})
    for depth in (1, 2, 3):
        start = offcache.stats()["fetches"]
        for i, batch in enumerate(cache.iter_prefetch(depth=depth)):
            assert offcache.stats()["fetches"] - start == min(i + 1 + depth, 6)
            assert torch.equal(batch["x"], torch.full((4,), float(i)))
    with pytest.raises(ValueError, match="depth"):
        list(cache.iter_prefetch(depth=0))


def test_store_grows_the_arena_instead_of_waiting_for_a_deferred_free(engine_config):
    # The delete-then-update pattern: the freed block still has a copy in flight, the budget has
    # room, so the next store takes a new chunk and the host does not wait.
    engine_config(backend="host", host_copy_delay_us=300_000, min_chunk="2MiB")
    first = _engine.store([torch.randn(3 << 18)], CPU)  # 3 MiB, slowed copy in flight
    del first
    with Delta() as d:
        second = _engine.store([torch.randn(3 << 18)], CPU)
    assert d["syncs"] == 0
    offcache.synchronize()
    assert second[0].numel() == 3 << 18


def test_store_does_not_wait_for_fetches_in_flight(engine_config):
    # Each direction has its own in-flight bound: an update() while a large prefetch is in flight
    # does not wait for the H2D copies (no duplex overlap otherwise).
    engine_config(backend="host", max_in_flight="4MiB")
    stored = _engine.store([torch.randn(3 << 18)], CPU)  # 3 MiB
    offcache.synchronize()
    engine_config(backend="host", max_in_flight="4MiB", host_copy_delay_us=300_000)
    stored = _engine.store([torch.randn(3 << 18)], CPU)
    offcache.synchronize()
    _engine.fetch(stored, CPU, False)  # 3 MiB H2D, slowed, in flight
    with Delta() as d:
        _engine.store([torch.randn(3 << 18)], CPU)
    assert d["syncs"] == 0


def test_event_queries_are_bounded_per_call(engine_config):
    # One query per distinct pending event in a call, and reaping stops at each stream's first
    # incomplete copy: not one query per tensor or per entry in flight.
    engine_config(backend="host", host_copy_delay_us=200_000)
    for _ in range(20):
        _engine.store([torch.randn(1 << 18)], CPU)  # 20 slowed stores queued on one stream
    stored = _engine.store([torch.full((32,), float(i)) for i in range(500)], CPU)  # one block, pending
    before = offcache.stats()["event_queries"]
    _engine.fetch(stored, CPU, False)
    assert offcache.stats()["event_queries"] - before <= 8
