"""The engine through the host backend: arena, dedup, ordering, deferred frees, batching."""

import multiprocessing as mp
import os
import threading

import pytest
import torch

import offcache
from offcache import engine as _engine
from tests.helpers import CPU

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool, torch.complex64]


def store_now(values):
    """Store and wait until the copies are written (stored tensors are read directly)."""
    out = _engine.store(values, CPU)
    for t in out:
        _engine.wait_stored(t)
    return out


def make(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (1,), (3, 5), (2, 3, 4, 5), (1 << 19,)])
def test_roundtrip_bit_exact(host_engine, dtype, shape):
    x = make(dtype, shape)
    (stored,) = _engine.store([x], CPU)
    assert _engine.is_arena_tensor(stored)
    assert stored.data_ptr() != x.data_ptr()
    (back,), _ = _engine.fetch([stored], CPU, True)
    assert back.dtype == dtype and back.shape == x.shape
    assert torch.equal(
        back.view(torch.uint8) if dtype == torch.bool else back,
        x.view(torch.uint8) if dtype == torch.bool else x,
    )
    assert back.data_ptr() != stored.data_ptr()


def test_non_contiguous_and_zero_size(host_engine):
    x = torch.randn(6, 8).t()[1:, ::2]
    z = torch.empty(0, 4)
    stored = store_now([x, z])
    assert stored[0].is_contiguous() and torch.equal(stored[0], x)
    assert stored[1].shape == (0, 4)
    back, _ = _engine.fetch(stored, CPU, True)
    assert torch.equal(back[0], x) and back[1].shape == (0, 4)


def test_small_values_share_one_block_and_one_fetch_copy(host_engine):
    xs = [torch.full((64,), float(i)) for i in range(100)]
    before = offcache.stats()
    stored = _engine.store(xs, CPU)
    ptrs = [t.data_ptr() for t in stored]
    assert all(b - a == 256 for a, b in zip(ptrs, ptrs[1:]))  # one packed block, 64-byte aligned
    assert all(t.untyped_storage().nbytes() == 256 for t in stored)  # each its own bytes only
    back, _ = _engine.fetch(stored, CPU, True)
    after = offcache.stats()
    assert after["d2h_copies"] - before["d2h_copies"] == 1
    assert after["h2d_copies"] - before["h2d_copies"] == 1
    assert all(torch.equal(b, x) for b, x in zip(back, xs))


def test_large_values_get_their_own_blocks(host_engine):
    xs = [torch.randn(1 << 19) for _ in range(3)]  # 2 MiB each
    stored = _engine.store(xs, CPU)
    assert len({t.untyped_storage().data_ptr() for t in stored}) == 3


def test_dedup_hit_returns_same_copy(host_engine):
    x = torch.randn(100)
    (a,) = _engine.store([x], CPU)
    hits = offcache.stats()["dedup_hits"]
    (b,) = _engine.store([x], CPU)
    assert b.data_ptr() == a.data_ptr()
    assert offcache.stats()["dedup_hits"] == hits + 1


def test_dedup_table_does_not_grow_with_dead_sources(host_engine):
    for _ in range(5000):
        _engine.store([torch.randn(16)], CPU)  # source and copy die at once
    offcache.synchronize()
    assert offcache.stats()["dedup_entries"] <= 2048


def test_dedup_within_one_call(host_engine):
    x = torch.randn(100)
    a, b = _engine.store([x, x], CPU)
    assert a.data_ptr() == b.data_ptr()


def test_in_place_edit_after_store_is_copied_again(host_engine):
    x = torch.zeros(100)
    (a,) = store_now([x])
    x.add_(1)  # bumps the version counter
    (b,) = store_now([x])
    assert b.data_ptr() != a.data_ptr()
    assert torch.equal(a, torch.zeros(100))  # the first copy is untouched
    assert torch.equal(b, torch.ones(100))


def test_reading_a_stored_value_waits_for_its_store(host_engine):
    host_engine(backend="host", host_copy_delay_us=20000)
    cache = offcache.IntermediatesCache.empty(1, "cpu")
    x = torch.arange(1000.0)
    cache.update(0, {"x": x})
    assert torch.equal(cache.batch_intermediates[0]["x"].value, x)  # .value waits


def test_edit_during_in_flight_store_does_not_change_the_stored_value(host_engine):
    host_engine(backend="host", host_copy_delay_us=50000)
    x = torch.zeros(1000)
    (a,) = _engine.store([x], CPU)
    x.fill_(1.0)  # the drain has not started yet: its delay is still running
    (b,), _ = _engine.fetch([a], CPU, True)
    assert torch.equal(b, torch.zeros(1000))
    _engine.wait_stored(a)
    assert torch.equal(a, torch.zeros(1000))


def test_edit_after_store_completed_is_fine(host_engine):
    host_engine(backend="host", host_copy_delay_us=1000)
    x = torch.zeros(1000)
    (a,) = _engine.store([x], CPU)
    offcache.synchronize()
    x.fill_(1.0)
    (b,), _ = _engine.fetch([a], CPU, True)
    assert torch.equal(b, torch.zeros(1000))


def test_dead_source_is_not_served(host_engine):
    x = torch.randn(100)
    (a,) = _engine.store([x], CPU)
    del x
    y = torch.randn(100)  # may reuse x's TensorImpl address
    (b,) = store_now([y])
    assert torch.equal(b, y)
    assert b.data_ptr() != a.data_ptr()


def test_dead_stored_copy_is_not_served(host_engine):
    x = torch.randn(100)
    (a,) = _engine.store([x], CPU)
    del a
    (b,) = store_now([x])
    assert torch.equal(b, x)


def test_fetch_right_after_slow_store_waits_for_it(host_engine):
    host_engine(backend="host", host_copy_delay_us=20000)
    xs = [torch.randn(1000) + i for i in range(5)]
    stored = _engine.store(xs, CPU)
    back, _ = _engine.fetch(stored, CPU, True)  # must not read the block before the store wrote it
    assert all(torch.equal(b, x) for b, x in zip(back, xs))


def test_source_dropped_right_after_store(host_engine):
    host_engine(backend="host", host_copy_delay_us=20000)
    stored = _engine.store([torch.full((1000,), 7.0)], CPU)  # the source dies at once
    torch.randn(1000)  # reuse its memory
    offcache.synchronize()
    assert torch.equal(stored[0], torch.full((1000,), 7.0))


def test_block_freed_during_its_store_is_reused_only_after_the_copy(host_engine):
    host_engine(backend="host", host_copy_delay_us=30000, min_chunk="64KiB")
    (a,) = _engine.store([torch.full((1024,), 1.0)], CPU)
    in_use = offcache.stats()["pinned_in_use_bytes"]
    a_ptr = a.data_ptr()
    del a  # the store is still writing the block
    s = offcache.stats()
    assert s["deferred_bytes"] > 0 and s["pinned_in_use_bytes"] == in_use
    (b,) = _engine.store([torch.full((1024,), 2.0)], CPU)
    assert b.data_ptr() != a_ptr  # the block is not handed out again yet
    offcache.synchronize()
    assert offcache.stats()["deferred_bytes"] == 0
    assert torch.equal(b, torch.full((1024,), 2.0))


def test_block_read_by_a_fetch_stays_alive_until_the_fetch_completes(host_engine):
    host_engine(backend="host", host_copy_delay_us=30000, min_chunk="64KiB")
    (a,) = _engine.store([torch.full((1024,), 1.0)], CPU)
    offcache.synchronize()
    (back,), ticket = _engine.fetch([a], CPU, False)  # a slow fetch still reads `a`
    in_use = offcache.stats()["pinned_in_use_bytes"]
    a_ptr = a.data_ptr()
    del a
    assert offcache.stats()["pinned_in_use_bytes"] == in_use
    (b,) = _engine.store([torch.full((1024,), 2.0)], CPU)
    assert b.data_ptr() != a_ptr
    ticket.wait()
    assert torch.equal(back, torch.full((1024,), 1.0))
    offcache.synchronize()
    assert offcache.stats()["pinned_in_use_bytes"] < in_use + b.nbytes + 256


def test_prefetch_ticket_orders_consumer(host_engine):
    host_engine(backend="host", host_copy_delay_us=20000)
    (a,) = _engine.store([torch.arange(1000.0)], CPU)
    (back,), ticket = _engine.fetch([a], CPU, False)
    ticket.wait()
    assert ticket.query()
    assert torch.equal(back, torch.arange(1000.0))


def test_pinned_bytes_return_to_zero(host_engine):
    stored = _engine.store([torch.randn(1000) for _ in range(10)] + [torch.randn(1 << 20)], CPU)
    assert offcache.stats()["pinned_in_use_bytes"] > 0
    del stored
    offcache.synchronize()
    assert offcache.stats()["pinned_in_use_bytes"] == 0


def test_empty_cache_gives_spare_chunks_back(host_engine):
    (a,) = store_now([torch.randn(1 << 20)])
    del a
    offcache.synchronize()
    assert offcache.stats()["pinned_reserved_bytes"] > 0  # kept as the spare
    assert offcache.empty_cache() > 0
    assert offcache.stats()["pinned_reserved_bytes"] == 0


def test_tensor_larger_than_a_chunk(host_engine):
    host_engine(backend="host", min_chunk="256KiB")
    x = torch.randn(1 << 20)  # 4 MiB > chunk
    (a,) = store_now([x])
    assert _engine.is_arena_tensor(a) and torch.equal(a, x)
    reserved = offcache.stats()["pinned_reserved_bytes"]
    assert reserved >= x.nbytes
    del a
    offcache.synchronize()
    assert offcache.stats()["pinned_in_use_bytes"] == 0
    (b,) = store_now([x * 2])  # the freed chunk is the spare: reused, not pinned anew
    assert offcache.stats()["pinned_reserved_bytes"] == reserved
    assert torch.equal(b, x * 2)


def test_budget_spills_to_pageable_and_warns_once(host_engine):
    host_engine(backend="host", pinned_limit="1MiB", min_chunk="256KiB")
    cache = offcache.IntermediatesCache.empty(4, "cpu")
    xs = [torch.randn(1 << 18) for _ in range(4)]  # 1 MiB each
    with pytest.warns(offcache.SpillWarning, match="spilling to pageable") as record:
        for i, x in enumerate(xs):
            cache.update(i, {"x": x})
    assert len([w for w in record if issubclass(w.category, offcache.SpillWarning)]) == 1
    s = offcache.stats()
    assert s["pageable_bytes"] > 0 and s["spills"] >= 1
    assert s["pinned_reserved_bytes"] <= 1 << 20
    for i, x in enumerate(xs):
        assert torch.equal(cache.fetch(i)["x"], x)


def test_pin_memory_moves_spilled_values_back_when_room(host_engine):
    host_engine(backend="host", pinned_limit="1MiB", min_chunk="256KiB")
    cache = offcache.IntermediatesCache.empty(2, "cpu")
    a, b = torch.randn(1 << 18), torch.randn(1 << 17)  # 1 MiB fills the budget; 512 KiB spills
    with pytest.warns(offcache.SpillWarning):
        cache.update(0, {"a": a})
        cache.update(1, {"b": b})
    assert _engine.is_arena_tensor(cache.batch_intermediates[0]["a"].value)
    assert not _engine.is_arena_tensor(cache.batch_intermediates[1]["b"].value)
    cache.pin_memory(1)  # no room yet: stays where it is
    assert not _engine.is_arena_tensor(cache.batch_intermediates[1]["b"].value)
    cache.delete(0)
    offcache.synchronize()
    cache.pin_memory(1)
    assert _engine.is_arena_tensor(cache.batch_intermediates[1]["b"].value)
    assert torch.equal(cache.fetch(1)["b"], b)
    offcache.synchronize()
    assert offcache.stats()["pageable_bytes"] == 0  # the spilled copy was freed


def test_in_flight_bytes_are_bounded(host_engine):
    host_engine(backend="host", max_in_flight="64KiB", host_copy_delay_us=1000)
    stored = [_engine.store([torch.randn(4096)], CPU)[0] for _ in range(20)]  # 16 KiB each
    assert offcache.stats()["peak_in_flight_bytes"] <= 64 * 1024
    assert all(t.numel() == 4096 for t in stored)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (lambda: torch.randn(4, 4).to_sparse(), TypeError, "layout"),
        (lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8), TypeError, "quantized"),
        (lambda: torch.empty(4, device="meta"), ValueError, "meta"),
        (lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), TypeError, "nested"),
    ],
)
def test_engine_rejects_bad_tensors(host_engine, bad, error, match):
    with pytest.raises(error, match=match):
        _engine.store([bad()], CPU)


def test_trace_records_copies_on_both_streams(host_engine):
    host_engine(backend="host", host_copy_delay_us=2000)
    _engine.trace_start(CPU)
    (a,) = _engine.store([torch.randn(1000)], CPU)
    _engine.fetch([a], CPU, True)
    rows = _engine.trace_stop()
    assert sorted(r["stream"] for r in rows) == ["d2h", "h2d"]
    d2h = next(r for r in rows if r["stream"] == "d2h")
    h2d = next(r for r in rows if r["stream"] == "h2d")
    assert d2h["bytes"] == h2d["bytes"] == 4000
    assert 0 <= d2h["start_ms"] < d2h["end_ms"] <= h2d["end_ms"]  # the fetch waited for the store
    assert d2h["end_ms"] - d2h["start_ms"] >= 1.5  # the slowed copy
    assert _engine.trace_stop() == []  # tracing is off again


def test_requires_grad_is_kept_as_a_flag(host_engine):
    x = torch.randn(10, requires_grad=True)
    (a,) = store_now([x])
    assert a.requires_grad and a.grad_fn is None
    (b,), _ = _engine.fetch([a], CPU, True)
    assert b.requires_grad and torch.equal(b.detach(), x.detach())


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="auto"):
        offcache.configure(backend="tpu")


def test_build_info():
    info = offcache.build_info()
    assert set(info) >= {"version", "torch", "cuda", "cuda_version", "backend"}
    assert info["version"].split("+")[0] == offcache.__version__
    assert info["version"].endswith("+cpu") or info["version"].endswith(
        "+cu" + (info["cuda_version"] or "").replace(".", "")
    )
    assert info["backend"] in ("host", "cuda")
    if info["cuda"]:
        assert torch.version.cuda is not None and info["cuda_version"]
    if os.environ.get("OFFCACHE_EXPECT_CUDA") == "1":  # set by scripts/test.sh when a toolkit is present
        assert info["cuda"], "the CUDA path was not compiled"
    if not torch.cuda.is_available():
        assert info["backend"] == "host"


def _child(queue):
    x = torch.arange(100.0)
    (a,) = _engine.store([x], CPU)
    (b,), _ = _engine.fetch([a], CPU, True)
    queue.put(bool(torch.equal(b, x)))


def test_host_backend_works_in_forked_child(host_engine):
    _engine.store([torch.randn(10)], CPU)  # the parent's engine exists, with worker threads
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert q.get(timeout=5) is True


def test_two_threads_one_cache(host_engine):
    host_engine(backend="host", host_copy_delay_us=50)
    cache = offcache.IntermediatesCache.empty(40, "cpu")
    errors = []

    def work(offset):
        try:
            for i in range(offset, 40, 2):
                x = torch.full((256,), float(i))
                cache.update(i, {"x": x, "t": (x, i)})
                got = cache.fetch(i)
                assert torch.equal(got["x"], x) and got["t"][1] == i
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, batch in enumerate(cache.iter()):
        assert torch.equal(batch["x"], torch.full((256,), float(i)))


def test_two_caches_share_one_engine(host_engine):
    x = torch.randn(64)
    a = offcache.IntermediatesCache.empty(1, "cpu")
    b = offcache.IntermediatesCache.empty(1, "cpu")
    a.update(0, {"x": x})
    b.update(0, {"x": x})
    assert a.batch_intermediates[0]["x"].value.data_ptr() == b.batch_intermediates[0]["x"].value.data_ptr()
    a.delete(0)
    offcache.synchronize()
    assert torch.equal(b.fetch(0)["x"], x)
