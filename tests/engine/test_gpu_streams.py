"""CUDA backend: the engine's streams, events and tickets: store and fetch ordering, batching
and packing, copy_into, fetch outputs' lifetime, pooled events, and the caches (intermediates, KV,
weights) prefetching on them. Marked `gpu` (skipped in conftest.py when no GPU is visible)."""

import pytest
import torch

import offcache
from offcache import IntermediatesCache
from offcache import engine as _engine
from tests.helpers import CPU, assert_same, cap_gpu_memory

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_engine")]

DEV = torch.device("cuda:0")
DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.complex64]


def test_backend_is_cuda_and_arena_is_pinned():
    assert offcache.build_info()["backend"] == "cuda"
    (a,) = _engine.store([torch.randn(1000, device=DEV)], CPU)
    assert a.is_pinned() and _engine.is_arena_tensor(a)
    assert offcache.stats()["pinned"] is True


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 1000, 1 << 22])
@pytest.mark.parametrize("direction", ["d2h_then_h2d", "h2d_of_host_tensor"])
def test_roundtrip(dtype, numel, direction):
    x = torch.randn(numel, device=DEV).to(dtype) if dtype != torch.bool else torch.rand(numel, device=DEV) > 0.5
    if direction == "d2h_then_h2d":
        (stored,) = _engine.store([x], CPU)
    else:
        stored = x.cpu()  # a plain pageable CPU tensor fetched to the GPU
    (back,), _ = _engine.fetch([stored], DEV, True)
    assert back.device == DEV
    assert_same(back, x)


def test_store_waits_for_the_producer_stream():
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.zeros(1 << 24, device=DEV)
        for _ in range(20):
            x.add_(1)  # long producer work on a side stream
        (stored,) = _engine.store([x], CPU)  # the producer is `side`: the copy must wait for it
    (back,), _ = _engine.fetch([stored], DEV, True)
    torch.cuda.synchronize()
    assert torch.all(back == 20)


def test_consumer_stream_waits_for_fetch():
    (stored,) = _engine.store([torch.full((1 << 24,), 3.0, device=DEV)], CPU)
    consumer = torch.cuda.Stream()
    with torch.cuda.stream(consumer):
        (back,), _ = _engine.fetch([stored], DEV, True)
        total = back.sum()  # runs on `consumer`, after the H2D copy
    torch.cuda.synchronize()
    assert total.item() == 3.0 * (1 << 24)


def test_fetch_immediately_after_store_reads_complete_data():
    xs = [torch.full((1 << 20,), float(i), device=DEV) for i in range(8)]
    stored = _engine.store(xs, CPU)
    back, _ = _engine.fetch(stored, DEV, True)
    for b, x in zip(back, xs):
        assert torch.equal(b, x)


def test_source_freed_right_after_store_is_not_reused_early():
    (stored,) = _engine.store([torch.full((1 << 24,), 5.0, device=DEV)], CPU)
    noise = [torch.full((1 << 24,), -1.0, device=DEV) for _ in range(4)]  # may take the freed memory
    del noise
    (back,), _ = _engine.fetch([stored], DEV, True)
    assert torch.all(back == 5.0)


def test_many_small_values_are_gathered_into_few_copies():
    xs = [torch.full((1024,), float(i), device=DEV) for i in range(1000)]
    before = offcache.stats()
    stored = _engine.store(xs, CPU)
    back, _ = _engine.fetch(stored, DEV, True)
    after = offcache.stats()
    assert after["h2d_copies"] - before["h2d_copies"] == 1
    for b, x in zip(back, xs):
        assert torch.equal(b, x)


def test_cache_on_gpu_matches_llmcompressor():
    lc = pytest.importorskip("llmcompressor.pipelines.cache")
    offcache.unpatch_llmcompressor()
    ours, theirs = IntermediatesCache.empty(4, "cpu"), lc.IntermediatesCache.empty(4, "cpu")
    for i in range(4):
        v = {
            "h": torch.randn(1, 64, 128, device=DEV).to(torch.bfloat16),
            "pos": (torch.randn(1, 64, 16, device=DEV), torch.randn(1, 64, 16, device=DEV)),
        }
        ours.update(i, v)
        theirs.update(i, v)
    for a, b in zip(ours.iter_prefetch(), theirs.iter_prefetch()):
        assert_same(a, b)
    for a, b in zip(ours.iter(), theirs.iter()):
        assert_same(a, b)


def test_prefetch_overlaps_with_compute():
    cache = IntermediatesCache.empty(6, "cpu")
    for i in range(6):
        cache.update(i, {"h": torch.full((1 << 24,), float(i), device=DEV)})
    w = torch.randn(2048, 2048, device=DEV)
    for i, batch in enumerate(cache.iter_prefetch()):
        for _ in range(10):
            w = torch.tanh(w @ w)
        assert torch.all(batch["h"] == i)


def test_peer_offload_to_another_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    cache = IntermediatesCache.empty(1, "cuda:1")
    x = torch.randn(1000, device=DEV)
    cache.update(0, {"x": x})
    assert cache.batch_intermediates[0]["x"].value.device == torch.device("cuda:1")
    assert torch.equal(cache.fetch(0)["x"], x)


def test_device_without_index_means_the_current_device():
    cache = IntermediatesCache.empty(1, "cpu")
    x = torch.randn(100, device=DEV)
    cache.update(0, {"x": x})
    cache.batch_intermediates[0]["x"].device = torch.device("cuda")
    assert torch.equal(cache.fetch(0)["x"], x)


# The store contract and the issue-9 cases that only a GPU shows ---------------------------


def test_edit_on_the_current_stream_right_after_store_does_not_change_it():
    x = torch.zeros(1 << 24, device=DEV)
    (stored,) = _engine.store([x], CPU)
    x.add_(1)  # queued right behind the snapshot on the same stream
    _engine.wait_stored(stored)
    assert torch.all(stored == 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    y = torch.zeros(1 << 24, device=DEV)
    (s2,) = _engine.store([y], CPU)
    with torch.cuda.stream(side):  # another stream, ordered after the store call returned
        side.wait_stream(torch.cuda.current_stream())
        y.fill_(5)
    (back,), _ = _engine.fetch([s2], DEV, True)
    assert torch.all(back == 0)


def test_fetch_of_a_peer_stored_tensor_already_on_the_target_waits_for_its_copy():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    src = torch.full((1 << 24,), 2.0, device="cuda:1")
    (dst,) = _engine.store([src], DEV)  # peer copy cuda:1 -> cuda:0
    (back,), _ = _engine.fetch([dst], DEV, True)  # already on cuda:0: must still wait
    assert torch.all(back == 2.0)


def test_gpu_to_cpu_fetch_waits_for_the_producer_stream():
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.zeros(1 << 24, device=DEV)
        for _ in range(20):
            x.add_(1)
        (back,), _ = _engine.fetch([x], CPU, True)
    assert torch.all(back == 20)


def test_cpu_target_fetch_with_sources_on_the_gpu_and_the_host():
    a = torch.full((1000,), 1.0, device=DEV)
    (b,) = _engine.store([torch.full((1000,), 2.0)], CPU)
    c = torch.full((1000,), 3.0)
    back, _ = _engine.fetch([a, b, c], CPU, True)
    assert [float(t[0]) for t in back] == [1.0, 2.0, 3.0]


def test_channels_last_and_conj_on_the_gpu():
    x = torch.randn(2, 3, 8, 8, device=DEV).to(memory_format=torch.channels_last)
    z = torch.randn(64, dtype=torch.complex64, device=DEV)
    sx, sz = _engine.store([x, z.conj()], CPU)
    (bx, bz), _ = _engine.fetch([sx, sz], DEV, True)
    assert bx.stride() == x.stride() and torch.equal(bx, x)
    assert not bz.is_conj() and torch.equal(bz, z.conj().resolve_conj())


# What a GPU pays per call (issue 10) -------------------------------------------------------


def test_pooled_events_no_new_events_once_warm():
    # Each round stores new values while the last round's are alive (their blocks hold their copies'
    # events), then fetches them. The warm-up rounds are the measured ones: a warm-up that stored the
    # same values again (dedup hits: no copy, no event) left the pool short of a round's events.
    xs = [torch.randn(256, device=DEV) for _ in range(100)]
    stored, created = [], []
    for i in range(8):  # 3 to warm the pool, 5 measured
        if i == 3:
            before = offcache.stats()
        stored = _engine.store([x + i for x in xs], CPU)
        _engine.fetch(stored, DEV, True)
        offcache.synchronize()
        created.append(offcache.stats()["events_created"])
    after = offcache.stats()
    assert after["events_created"] - before["events_created"] == 0, f"events created by round: {created}"
    assert after["host_callbacks"] == before["host_callbacks"]


def test_store_and_fetch_of_many_small_tensors_are_one_copy_each():
    xs = [torch.randn(256, device=DEV) for _ in range(1000)]
    _engine.store([x * 2 for x in xs], CPU)
    offcache.synchronize()
    before = offcache.stats()
    stored = _engine.store(xs, CPU)
    mid = offcache.stats()
    back, _ = _engine.fetch(stored, DEV, True)
    after = offcache.stats()
    assert mid["copy_calls"] - before["copy_calls"] <= 2
    assert mid["stream_waits"] - before["stream_waits"] <= 3
    assert after["copy_calls"] - mid["copy_calls"] == 1
    assert all(torch.equal(b, x) for b, x in zip(back, xs))
    assert len({b.untyped_storage().data_ptr() for b in back}) == len(back)  # independent storages


def _spin_cycles(seconds: float) -> int:
    """GPU clock cycles that torch.cuda._sleep spins for about `seconds` on this GPU, measured
    (a fixed count or a matmul queue is over in a blink on a fast GPU)."""
    torch.cuda._sleep(1000)  # the kernel loaded before the measurement
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return max(int(cycles * seconds * 1000 / max(start.elapsed_time(end), 1e-3)), 200_000_000)


def test_fetch_buffers_do_not_wait_for_the_consumers_queued_work():
    import time

    (stored,) = _engine.store([torch.randn(1 << 20, device=DEV)], CPU)
    offcache.synchronize()
    # Blocks cached by earlier tests near a per-process memory limit would send the outputs to the
    # consumer's pool (the copy then follows its queued work): this test measures the copy stream's.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    cycles = _spin_cycles(1.0)
    t0 = time.monotonic()
    torch.cuda._sleep(cycles)  # ~1 s of work queued on the consumer stream, no allocation
    queued = torch.cuda.Event()
    queued.record()
    (back,), ticket = _engine.fetch([stored], DEV, False)
    deadline = time.monotonic() + 30
    while not ticket.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    copied, busy = ticket.query(), not queued.query()
    # The H2D copy ran beside the queued work, so it finished before it.
    assert copied and busy, (
        f"after {time.monotonic() - t0:.3f} s: the fetch's copy {'done' if copied else 'not done'}, "
        f"the consumer's queued work ({cycles} cycles, ~1 s) {'still running' if busy else 'done'}"
    )
    ticket.wait()
    torch.cuda.synchronize()
    assert torch.equal(back, stored.to(DEV))


def test_iter_prefetch_depth_two_on_the_gpu():
    cache = IntermediatesCache.empty(8, "cpu")
    for i in range(8):
        cache.update(i, {"h": torch.full((1 << 20,), float(i), device=DEV)})
    for i, batch in enumerate(cache.iter_prefetch(depth=2)):
        assert torch.all(batch["h"] == i)


def test_peer_access_is_enabled_for_peer_copies():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    x = torch.randn(1 << 20, device="cuda:0")
    (y,) = _engine.store([x], torch.device("cuda:1"))
    assert y.device == torch.device("cuda:1") and torch.equal(y.cpu(), x.cpu())


# Round 3 of review (issue 17) --------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_copy_into_orders_after_every_source_devices_producer():
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    (h0,) = _engine.store([torch.zeros(1 << 22)], CPU)
    (h1,) = _engine.store([torch.zeros(1 << 22)], CPU)
    a = torch.zeros(1 << 22, device=d0)
    with torch.cuda.device(d1):
        b = torch.zeros(1 << 22, device=d1)
        for _ in range(50):
            b.add_(1)  # queued on cuda:1's current stream
    _engine.copy_into([h0, h1], [a, b], wait=True)
    assert torch.all(h1 == 50)


def test_copy_into_d2h_read_is_ordered_before_a_later_h2d_write():
    n = 1 << 26  # 256 MiB: the D2H takes long enough for an unordered H2D to overtake it
    buf = torch.full((n,), 1.0, device=DEV)
    (h,) = _engine.store([torch.zeros(n)], CPU)
    (h2,) = _engine.store([torch.full((n,), 2.0)], CPU)
    offcache.synchronize()
    _engine.copy_into([h], [buf])  # D2H on the D2H stream
    _engine.copy_into([buf], [h2], wait=True)  # H2D into the buffer the D2H reads
    _engine.wait_stored(h)
    assert torch.all(h == 1.0)
    torch.cuda.synchronize()
    assert torch.all(buf == 2.0)


def test_copy_into_d2h_ticket_is_a_stream_wait():
    buf = torch.randn(1 << 20, device=DEV)
    (h,) = _engine.store([torch.zeros(1 << 20)], CPU)
    offcache.synchronize()
    ticket = _engine.copy_into([h], [buf])
    before = offcache.stats()["syncs"]
    ticket.wait()  # orders buf's device stream after the read; the host does not block
    buf.fill_(0.0)
    assert offcache.stats()["syncs"] == before
    _engine.wait_stored(h)
    assert not torch.all(h == 0.0)


def test_dedup_does_not_serve_a_stored_copy_overwritten_by_copy_into():
    x = torch.randn(1 << 16, device=DEV)
    (s,) = _engine.store([x], CPU)
    (other,) = _engine.store([torch.randn(1 << 16)], CPU)
    offcache.synchronize()
    _engine.copy_into([s], [other], wait=True)
    (again,) = _engine.store([x], CPU)
    offcache.synchronize()
    assert torch.equal(again, x.cpu())


def test_staging_oom_does_not_flush_the_allocator_on_every_store():
    # Device memory runs out for this process only: its caching allocator is capped 640 MiB above
    # what it holds (set_per_process_memory_fraction), where filling the GPU would starve the other
    # pytest-xdist workers sharing it (and their frees would let staging succeed here).
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(DEV)
    cap = torch.cuda.memory_reserved(DEV) + (640 << 20)
    torch.cuda.set_per_process_memory_fraction(cap / total, DEV)
    try:
        xs = [torch.randn(1 << 26, device=DEV) for _ in range(2)]  # 2 x 256 MiB: 128 MiB left
        retries = torch.cuda.memory_stats(DEV)["num_alloc_retries"]
        start = offcache.stats()
        for _ in range(10):
            out = _engine.store([x[1:] for x in xs], CPU)  # views: staging needed, 256 MiB each
            del out
        offcache.synchronize()
        s = offcache.stats()
        got = {k: s[k] - start[k] for k in ("snapshot_fallbacks", "snapshot_oom_skips", "snapshot_bytes")}
        got["num_alloc_retries"] = torch.cuda.memory_stats(DEV)["num_alloc_retries"] - retries
        assert got["snapshot_fallbacks"] >= 10 and got["snapshot_oom_skips"] >= 8, got
        assert got["num_alloc_retries"] <= 2, got
    finally:
        cap_gpu_memory(DEV)  # this worker's share again, not the whole GPU
        torch.cuda.empty_cache()


def test_event_queries_per_small_tensor_are_o1():
    xs = [torch.randn(64, device=DEV) for _ in range(1000)]
    _engine.store(xs, CPU)
    offcache.synchronize()
    before = offcache.stats()["event_queries"]
    stored = _engine.store(xs, CPU)
    back, _ = _engine.fetch(stored, DEV)
    assert offcache.stats()["event_queries"] - before <= 16


def test_update_does_not_wait_for_a_large_prefetch_in_flight(engine_config):
    engine_config(backend="cuda", max_in_flight="512MiB")
    (big,) = _engine.store([torch.randn(1 << 27, device=DEV)], CPU)  # 512 MiB
    offcache.synchronize()
    _engine.fetch([big], DEV, False)  # H2D in flight
    before = offcache.stats()["syncs"]
    _engine.store([torch.randn(1 << 26, device=DEV)], CPU)  # 256 MiB D2H: its own bound
    assert offcache.stats()["syncs"] == before
    offcache.synchronize()


# --- the KV caches and prefetched weights on the GPU (issue 24) -----------------------------------


@pytest.mark.parametrize("static", [False, True])
def test_kv_in_place_edit_right_after_a_forward_is_seen_and_races_nothing(static):
    """Issue 24 items 1-2 on a GPU: the forward returns while H2D copies may still read the arena;
    editing a layer's host K/V at once must neither reach those copies nor be missed by the next step."""
    import transformers

    from offcache.bench.models import causal_lm
    from tests.kv.kv_models import kw

    model = causal_lm("llama", DEV, num_hidden_layers=4, num_key_value_heads=4)
    ids = torch.randint(1, 128, (4, 256), generator=torch.Generator().manual_seed(0)).to(DEV)
    if static:
        caches = (transformers.StaticCache(config=model.config, max_cache_len=300),
                  offcache.OffloadedStaticKVCache(config=model.config, max_cache_len=300))  # fmt: skip
    else:
        caches = (transformers.DynamicCache(config=model.config), offcache.OffloadedKVCache(config=model.config))
    logits = []
    with torch.no_grad():
        for cache in caches:
            first = model(input_ids=ids, **kw(cache), use_cache=True).logits
            second = model(input_ids=first[:, -1:].argmax(-1), **kw(cache), use_cache=True).logits
            for layer in (0, 3):  # 0: prefetched for the next step; 3: its fetch may still be in flight
                cache.layers[layer].keys.mul_(0.5)
                cache.layers[layer].values.neg_()
            third = model(input_ids=second[:, -1:].argmax(-1), **kw(cache), use_cache=True).logits
            logits.append((second, third))
    for want, got in zip(logits[0], logits[1]):
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("edit", ["data", "numpy"])
def test_prefetched_gpu_weight_not_served_stale_after_an_edit_through_data(edit):
    """Issue 24 item 4 on a GPU: the prefetched copy is device memory (not compared byte for byte
    as a host copy is); the offloaded tensor handed out under disable_onloading() drops it."""
    pytest.importorskip("compressed_tensors")
    pytest.importorskip("llmcompressor")
    from compressed_tensors.offload import disable_offloading, disable_onloading
    from compressed_tensors.offload.cache import OffloadCache

    from offcache.weights import compressed_tensors as oc_ct

    oc_ct.patch()
    try:
        cache = OffloadCache.cls_from_device("cpu")(DEV)
        cache["w"] = torch.zeros(64, 64)
        module = type("M", (), {"_parameters": cache, "_buffers": {}})()
        assert oc_ct.prefetch([module], target=0) == 64 * 64 * 4
        offcache.synchronize()
        with disable_onloading():
            if edit == "data":
                cache["w"].data.fill_(5.0)
            else:
                cache["w"].numpy()[:] = 5.0
        with disable_offloading():
            assert torch.equal(cache["w"].cpu(), torch.full((64, 64), 5.0))
    finally:
        oc_ct.unpatch()


# --- the in-flight ledger, fetch outputs' lifetime, streams that wait (issue 24) -----------------


@pytest.mark.parametrize("path", ["fetch", "fetch_disk", "fetch_file"])
def test_a_dropped_fetch_result_frees_its_device_memory_at_once(engine_config, tmp_path, path):
    import gc
    import weakref

    engine_config(backend="cuda", **({"host_limit": 0, "disk_dir": tmp_path} if path == "fetch_disk" else {}))
    x = torch.randn(1 << 20)
    file = tmp_path / "x.bin"
    x.numpy().tofile(file)
    (stored,) = _engine.store([x], CPU)
    offcache.synchronize()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(DEV)
    if path == "fetch_file":
        (out,), ticket = _engine.fetch_file(file, [(0, [1 << 20], torch.float32)], DEV, wait=False)
        ticket.wait()
    else:
        (out,), _ = _engine.fetch([stored], DEV, True)
    assert torch.equal(out.cpu(), x)
    r = weakref.ref(out)
    del out
    gc.collect()
    assert r() is None
    assert torch.cuda.memory_allocated(DEV) == before  # nothing held until the next engine call


def test_a_ticket_waited_on_a_side_stream_keeps_the_outputs_from_reuse_there():
    # Fetched on the default stream (handed over to it), waited for and read on `side`, then
    # dropped: the allocator must not give the block to the next fetch while `side` still reads.
    x = torch.randn(1 << 22)
    (stored,) = _engine.store([x], CPU)
    (zeros,) = _engine.store([torch.zeros(1 << 22)], CPU)
    offcache.synchronize()
    side = torch.cuda.Stream(DEV)
    (out,), ticket = _engine.fetch([stored], DEV, wait=False)
    with torch.cuda.stream(side):
        ticket.wait()
        torch.cuda._sleep(200_000_000)  # `side` is busy a while before it reads `out`
        total = out.sum()
    del out
    (again,), _ = _engine.fetch([zeros], DEV, True)  # from the copy stream's pool, as `out` was
    torch.cuda.synchronize()
    assert torch.allclose(total.cpu(), x.sum(), rtol=1e-4, atol=1e-2)
    assert int(again.count_nonzero()) == 0


def test_a_packed_fetch_makes_one_device_allocation_and_one_handover():
    # 1000 small values: one span copy into one allocation, each output a storage inside it; one
    # recordStream on it, not 1000 (nor 1000 allocator frees and events when they die).
    values = [torch.full((64,), float(i)) for i in range(1000)]
    stored = _engine.store(values, CPU)
    offcache.synchronize()
    torch.cuda.synchronize()
    before_mem, before = torch.cuda.memory_stats(DEV), offcache.stats()
    outs, _ = _engine.fetch(stored, DEV, True)
    after_mem, after = torch.cuda.memory_stats(DEV), offcache.stats()
    assert after_mem["allocation.all.allocated"] - before_mem["allocation.all.allocated"] == 1
    assert after["output_allocations"] - before["output_allocations"] == 1
    assert after["handovers"] - before["handovers"] == 1
    assert all(torch.equal(o.cpu(), v) for o, v in zip(outs, values))
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated(DEV)
    keep = outs[7]
    del outs
    assert torch.cuda.memory_allocated(DEV) == held  # one output alive holds the span
    del keep
    assert torch.cuda.memory_allocated(DEV) < held


def _packed_values_and_zeros():
    """8 small values stored together (one span when fetched), 8 zeros likewise, and a side stream."""
    xs = [torch.randn(1 << 16) for _ in range(8)]
    stored = _engine.store(xs, CPU)
    zeros = _engine.store([torch.zeros(1 << 16) for _ in range(8)], CPU)
    offcache.synchronize()
    return xs, stored, zeros, torch.cuda.Stream(DEV)


def _assert_side_read_before_reuse(totals, xs, zeros):
    """The zeros, fetched into the span's memory once it may be reused, did not overwrite what the
    side stream read."""
    again, _ = _engine.fetch(zeros, DEV, True)
    torch.cuda.synchronize()
    for t, x in zip(totals, xs):
        assert torch.allclose(t.cpu(), x.sum(), rtol=1e-4, atol=1e-2)
    assert all(int(a.count_nonzero()) == 0 for a in again)


def test_offcache_record_stream_keeps_a_packed_span_from_reuse_on_that_stream():
    # torch's record_stream does not reach the span a small fetched value lives in (the allocator
    # knows only the span); offcache.record_stream records the span itself.
    xs, stored, zeros, side = _packed_values_and_zeros()
    outs, _ = _engine.fetch(stored, DEV, True)
    side.wait_stream(torch.cuda.current_stream(DEV))
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        totals = [o.sum() for o in outs]
    for o in outs:
        offcache.record_stream(o, side)
    del outs, o
    _assert_side_read_before_reuse(totals, xs, zeros)


def test_a_ticket_waited_on_a_side_stream_keeps_a_packed_span_from_reuse_there():
    # The ticket's hand-off to `side` records the span's allocation, not the outputs (storages
    # inside it, which the allocator does not know).
    xs, stored, zeros, side = _packed_values_and_zeros()
    outs, ticket = _engine.fetch(stored, DEV, wait=False)
    with torch.cuda.stream(side):
        ticket.wait()
        torch.cuda._sleep(200_000_000)
        totals = [o.sum() for o in outs]
    del outs
    _assert_side_read_before_reuse(totals, xs, zeros)
