"""CUDA backend: streams, events, pinned arena, batching, prefetch. Marked `gpu`
(skipped in conftest.py when no GPU is visible)."""

import pytest
import torch

import offcache
from offcache import IntermediatesCache, _engine
from tests.helpers import CPU, assert_same, random_file

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda:0")
DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.complex64]


@pytest.fixture(autouse=True)
def cuda_engine(engine_config):
    engine_config(backend="cuda")


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


def test_cuda_engine_refuses_forked_child():
    import multiprocessing as mp

    _engine.store([torch.randn(10, device=DEV)], CPU)
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child(q):
        try:
            _engine.store([torch.randn(10)], CPU)
            q.put("no error")
        except RuntimeError as exc:
            q.put(str(exc))

    p = ctx.Process(target=child, args=(q,))
    p.start()
    p.join(60)
    assert "forked child" in q.get(timeout=5)


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


def test_sticky_cuda_error_does_not_abort_on_release(tmp_path):
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import gc, torch, offcache
        from offcache import _engine
        stored = _engine.store([torch.randn(1 << 20, device="cuda") for _ in range(4)], torch.device("cpu"))
        offcache.synchronize()
        try:
            torch.zeros(4, device="cuda")[torch.tensor([7], device="cuda")] = 1.0  # device-side assert
            torch.cuda.synchronize()
        except RuntimeError:
            pass
        del stored
        gc.collect()
        print("survived", flush=True)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != -6, proc.stderr[-2000:]  # no std::terminate / abort
    assert "survived" in proc.stdout, proc.stderr[-2000:]


# What a GPU pays per call (issue 10) -------------------------------------------------------


def test_pooled_events_no_new_events_once_warm():
    xs = [torch.randn(256, device=DEV) for _ in range(100)]
    for _ in range(3):  # warm the pool
        stored = _engine.store(xs, CPU)
        _engine.fetch(stored, DEV, True)
        offcache.synchronize()
    before = offcache.stats()
    for _ in range(5):
        stored = _engine.store([x + 1 for x in xs], CPU)
        _engine.fetch(stored, DEV, True)
        offcache.synchronize()
    after = offcache.stats()
    assert after["events_created"] - before["events_created"] == 0
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


def test_fetch_buffers_do_not_wait_for_the_consumers_queued_work():
    (stored,) = _engine.store([torch.randn(1 << 20, device=DEV)], CPU)
    offcache.synchronize()
    import time

    w = torch.randn(4096, 4096, device=DEV)
    for _ in range(200):  # a long kernel queue on the consumer stream
        w = w @ w / 4096
    queued = torch.cuda.Event()
    queued.record()
    (back,), ticket = _engine.fetch([stored], DEV, False)
    deadline = time.monotonic() + 30
    while not ticket.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    # The H2D copy ran beside the queued matmuls, so it finished before them.
    assert ticket.query() and not queued.query()
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


def _run(script: str, timeout: int = 300):
    import subprocess
    import sys
    import textwrap

    cmd = [sys.executable, "-c", textwrap.dedent(script)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_cuda_error_in_a_host_stream_wait_is_an_error_not_an_abort():
    # A CPU->CPU fetch of a block whose D2H is pending queues a host task that waits on a CUDA
    # event; a sticky error makes that wait throw on the worker thread.
    proc = _run(
        """
        import torch, offcache
        from offcache import _engine
        x = torch.zeros(1 << 24, device="cuda")
        for _ in range(50):
            x.add_(1)  # long producer work: the D2H is still pending below
        (stored,) = _engine.store([x], torch.device("cpu"))
        torch.zeros(4, device="cuda")[torch.tensor([7], device="cuda")] = 1.0  # device-side assert
        try:
            _engine.fetch([stored], torch.device("cpu"))
            offcache.synchronize()
            print("no error", flush=True)
        except RuntimeError as e:
            print("raised", type(e).__name__, flush=True)
        print("survived", flush=True)
        """
    )
    assert proc.returncode != -6, proc.stderr[-2000:]  # no std::terminate
    assert "survived" in proc.stdout, proc.stderr[-2000:]


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


def test_forked_child_reading_pinned_arena_memory_fails_loudly():
    import os
    import signal

    (stored,) = _engine.store([torch.full((1 << 20,), 5.0, device=DEV)], CPU)
    offcache.synchronize()
    assert float(stored[0]) == 5.0
    pid = os.fork()
    if pid == 0:
        try:
            value = float(stored[123])  # PROT_NONE in the child: faults instead of reading zeros
            os._exit(3 if value == 0.0 else 4)
        except BaseException:
            os._exit(5)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGSEGV, signal.SIGBUS), status


def test_staging_oom_does_not_flush_the_allocator_on_every_store():
    free, _ = torch.cuda.mem_get_info()
    torch.cuda.empty_cache()
    hog = torch.empty(max(free - (768 << 20), 0), dtype=torch.uint8, device=DEV)  # leave ~768 MiB
    try:
        xs = [torch.randn(1 << 26, device=DEV) for _ in range(2)]  # 2 x 256 MiB
        retries = torch.cuda.memory_stats()["num_alloc_retries"]
        start = offcache.stats()
        for _ in range(10):
            out = _engine.store([x[1:] for x in xs], CPU)  # views: staging needed, 512 MiB
            del out
        offcache.synchronize()
        s = offcache.stats()
        assert s["snapshot_fallbacks"] - start["snapshot_fallbacks"] >= 10
        assert s["snapshot_oom_skips"] - start["snapshot_oom_skips"] >= 8
        assert torch.cuda.memory_stats()["num_alloc_retries"] - retries <= 2
    finally:
        del hog
        torch.cuda.empty_cache()


def test_disk_tier_bounce_buffers_are_pinned_when_the_budget_is_full(engine_config, tmp_path):
    engine_config(backend="cuda", pinned_limit="1MiB", host_limit=0, disk_dir=tmp_path)
    xs = [torch.randn(1 << 20, device=DEV) for _ in range(8)]  # 8 x 4 MiB, all to disk
    before = offcache.stats()
    stored = _engine.store(xs, CPU)
    s = offcache.stats()
    assert s["bounce_pageable"] == 0 and s["bounce_reserved_bytes"] > 0
    assert s["syncs"] == before["syncs"]  # no host/producer sync per value
    back, _ = _engine.fetch(stored, DEV)
    assert all(torch.equal(a, b) for a, b in zip(xs, back))


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


# --- fetch_file: a checkpoint's byte ranges onto the GPU ----------------------------------------


def test_fetch_file_to_the_gpu_across_the_ring(tmp_path):
    # 75 MiB + 3: ten pieces (the ring's eight slots read into again), unaligned ranges.
    path = tmp_path / "w.bin"
    data = torch.from_numpy(random_file(path, 75 * (1 << 20) + 3, seed=1))
    items = [(3, [data.numel() - 3], torch.uint8), (8 * (1 << 20) - 2, [4], torch.uint8)]
    items.append((100, [2048, 3], torch.bfloat16))
    out, ticket = _engine.fetch_file(path, items, DEV, wait=False)
    ticket.wait()  # the current stream waits for the copies; the host only until they are issued
    for (offset, shape, dtype), got in zip(items, out):
        n = got.numel() * got.element_size()
        assert got.device == DEV and got.dtype == dtype and list(got.shape) == shape
        assert torch.equal(got.view(-1).view(torch.uint8).cpu(), data[offset : offset + n])
    s = offcache.stats()
    assert s["bounce_pageable"] == 0 and s["bounce_reserved_bytes"] >= 64 * (1 << 20)  # a pinned ring


def test_fetch_file_orders_a_side_streams_use_and_keeps_outputs_alive(tmp_path):
    path = tmp_path / "s.bin"
    data = torch.from_numpy(random_file(path, 40 * (1 << 20), seed=2))
    side = torch.cuda.Stream(DEV)
    with torch.cuda.stream(side):
        (got,), ticket = _engine.fetch_file(path, [(0, [data.numel()], torch.uint8)], DEV, wait=False)
        ticket.wait()  # orders `side`
        total = got.to(torch.int64).sum()
    del got  # dropped while its copies may still run: recordStream and the engine keep it
    torch.cuda.synchronize()
    assert int(total) == int(data.to(torch.int64).sum())


def test_disk_weights_prefetched_onto_the_gpu(tmp_path):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.offload import disable_offloading, offload_module

    from offcache import compressed_tensors as oc_ct

    oc_ct.patch()
    try:
        torch.manual_seed(0)
        linear = torch.nn.Linear(1024, 1024)
        reference = {k: v.clone() for k, v in linear.state_dict().items()}
        offload_module(linear, DEV, "disk", offload_dir=str(tmp_path))
        before = offcache.stats()
        assert oc_ct.prefetch([linear], target=0) == 1024 * 1025 * 4
        with disable_offloading():
            assert linear.weight.device == DEV
            assert torch.equal(linear.weight.cpu(), reference["weight"])
            assert torch.equal(linear.bias.cpu(), reference["bias"])
        assert offcache.stats()["file_fetches"] - before["file_fetches"] == 2
    finally:
        oc_ct.unpatch()


@pytest.mark.parametrize("static", [False, True])
def test_kv_in_place_edit_right_after_a_forward_is_seen_and_races_nothing(static):
    """Issue 24 items 1-2 on a GPU: the forward returns while H2D copies may still read the arena;
    editing a layer's host K/V at once must neither reach those copies nor be missed by the next step."""
    import transformers

    from offcache.bench.models import causal_lm
    from tests.kv_models import kw

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

    from offcache import compressed_tensors as oc_ct

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


def test_a_sticky_error_while_reaping_raises_and_does_not_deadlock(tmp_path):
    # A device-side assert breaks the context: every later event query raises. A host-stream
    # store (CPU to CPU, slowed) listed before a GPU fetch completes; reaping retires it (its
    # arena staging buffer held by the ledger only), then the fetch's query raises: the buffer
    # used to die under the engine's lock and its release to take that lock again (a hang).
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import os, torch, offcache
        from offcache import _engine
        offcache.configure(backend="cuda", host_copy_delay_us=200_000, disk_dir="none")
        cpu, dev = torch.device("cpu"), torch.device("cuda:0")
        (g,) = _engine.store([torch.randn(1000, device=dev)], cpu)
        offcache.synchronize()
        (a,) = _engine.store([torch.randn(1000)], cpu)  # a host stream, slowed: still in flight
        _engine.fetch([g], dev, False)  # listed after it
        torch.arange(3, device=dev)[torch.tensor([10], device=dev)]  # device-side assert
        try:
            torch.cuda.synchronize()
        except RuntimeError:
            pass
        _engine.wait_stored(a)  # the host store completes; not reaped yet
        try:
            offcache.stats()
        except RuntimeError as e:
            print("raised:", str(e)[:200], flush=True)
        del a, g  # released on a broken context: leaked, never a hang
        print("survived", flush=True)
        os._exit(0)
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's offcache
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": root},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "raised:" in proc.stdout and "survived" in proc.stdout, proc.stdout


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


def test_offcache_record_stream_keeps_a_packed_span_from_reuse_on_that_stream():
    # torch's record_stream does not reach the span a small fetched value lives in (the allocator
    # knows only the span); offcache.record_stream records the span itself.
    xs = [torch.randn(1 << 16) for _ in range(8)]
    stored = _engine.store(xs, CPU)
    zeros = _engine.store([torch.zeros(1 << 16) for _ in range(8)], CPU)
    offcache.synchronize()
    side = torch.cuda.Stream(DEV)
    outs, _ = _engine.fetch(stored, DEV, True)
    side.wait_stream(torch.cuda.current_stream(DEV))
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        totals = [o.sum() for o in outs]
    for o in outs:
        offcache.record_stream(o, side)
    del outs, o
    again, _ = _engine.fetch(zeros, DEV, True)
    torch.cuda.synchronize()
    for t, x in zip(totals, xs):
        assert torch.allclose(t.cpu(), x.sum(), rtol=1e-4, atol=1e-2)
    assert all(int(a.count_nonzero()) == 0 for a in again)


def test_a_ticket_waited_on_a_side_stream_keeps_a_packed_span_from_reuse_there():
    # The ticket's hand-off to `side` records the span's allocation, not the outputs (storages
    # inside it, which the allocator does not know).
    xs = [torch.randn(1 << 16) for _ in range(8)]
    stored = _engine.store(xs, CPU)
    zeros = _engine.store([torch.zeros(1 << 16) for _ in range(8)], CPU)
    offcache.synchronize()
    side = torch.cuda.Stream(DEV)
    outs, ticket = _engine.fetch(stored, DEV, wait=False)
    with torch.cuda.stream(side):
        ticket.wait()
        torch.cuda._sleep(200_000_000)
        totals = [o.sum() for o in outs]
    del outs
    again, _ = _engine.fetch(zeros, DEV, True)
    torch.cuda.synchronize()
    for t, x in zip(totals, xs):
        assert torch.allclose(t.cpu(), x.sum(), rtol=1e-4, atol=1e-2)
    assert all(int(a.count_nonzero()) == 0 for a in again)


def test_a_copy_stream_follows_a_disk_fetch_in_flight_without_a_host_wait(engine_config, tmp_path):
    # copy_into into a disk block still read by a disk-tier fetch (a ChainedEvent fence): the copy
    # stream waits on the fetch's last copy event once it is issued; the host did wait on it.
    engine_config(backend="cuda", host_limit=0, disk_dir=tmp_path)
    x = torch.randn(1 << 26)  # 256 MiB: its H2D copy still runs when copy_into is issued
    (stored,) = _engine.store([x], CPU)
    offcache.synchronize()
    assert _engine.is_disk_tensor(stored)
    (back,), ticket = _engine.fetch([stored], DEV, wait=False)
    ticket.wait()  # the host waits until the copies are issued, not done
    before = offcache.stats()["syncs"]
    src = torch.full((1 << 26,), 3.0, device=DEV)
    _engine.copy_into([stored], [src], wait=False)
    assert offcache.stats()["syncs"] == before
    torch.cuda.synchronize()
    offcache.synchronize()
    assert torch.equal(back.cpu(), x)  # the fetch read the block before copy_into wrote it
    _engine.wait_stored(stored)
    assert bool((stored == 3.0).all())


# --- engine threads: device selection, capture mode; host waits; bounce chunks (issue 24) ------

_PRIMARY_CONTEXT_SCRIPT = r"""
import ctypes, gc, os, sys, time
import torch
import offcache
from offcache import _engine

cuda = ctypes.CDLL("libcuda.so.1")

def active(ordinal):
    # Whether GPU `ordinal`'s primary context exists: asked of the driver, which makes none.
    assert cuda.cuInit(0) == 0
    dev, flags, on = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(dev), ordinal) == 0
    assert cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(on)) == 0
    return bool(on.value)

CPU, DEV = torch.device("cpu"), torch.device("cuda:1")
torch.cuda.set_device(1)  # a torchrun rank's first step
x = torch.randn(4 << 20, device=DEV)
small = torch.randn(1024, device=DEV)
torch.cuda.synchronize()
print("BASELINE", active(0))
offcache.configure(backend="cuda", pinned_limit="1MiB", host_limit="1MiB", disk_dir=sys.argv[1])
(on_disk,) = _engine.store([x], CPU)       # D2H into a bounce buffer; the I/O thread waits, writes
(in_memory,) = _engine.store([small], CPU)  # the pinned arena
(cpu_copy,), _ = _engine.fetch([in_memory], CPU)  # a host copy stream waits for the D2H's event
(back,), _ = _engine.fetch([on_disk], DEV)  # the I/O thread reads, then issues the H2D copy
path = os.path.join(sys.argv[1], "..", "file.bin")
with open(path, "wb") as f:
    f.write(os.urandom(3 << 20))
(out,), ticket = _engine.fetch_file(path, [(0, (3 << 20,), torch.uint8)], DEV)  # fetch_file's thread
ticket.wait()
offcache.synchronize()
torch.cuda.synchronize()
ok = torch.equal(back, x) and torch.equal(cpu_copy, small.cpu())
ok = ok and out.cpu().numpy().tobytes() == open(path, "rb").read()
offcache.configure(backend="cuda")  # the old engine retires; its last block's death deletes it
del on_disk, in_memory, cpu_copy, back, out
gc.collect()
while offcache.stats()["retired_engines"]:  # deleted on a thread of its own
    time.sleep(0.01)
print("OK", ok)
print("AFTER", active(0))
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_engine_threads_make_no_context_on_gpu_0_for_a_rank_on_gpu_1(tmp_path):
    # Every engine thread (host copy-stream workers, the disk tier's and fetch_file's I/O
    # threads, the thread deleting a retired engine) selects the engine's device before its
    # first CUDA call: none makes a primary context on GPU 0 (~0.5 GiB per torchrun rank).
    import subprocess
    import sys

    disk = tmp_path / "disk"
    disk.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", _PRIMARY_CONTEXT_SCRIPT, str(disk)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    if lines.get("BASELINE") != "False":
        pytest.skip("torch itself made a context on GPU 0 in this setup")
    assert lines["OK"] == "True", proc.stdout
    assert lines["AFTER"] == "False", "an engine thread made a primary context on GPU 0"


def test_a_disk_store_in_flight_does_not_invalidate_a_graph_capture(engine_config, tmp_path):
    # The I/O thread waits for each store's D2H copy (cudaEventSynchronize) between disk
    # writes, while this thread captures a graph in global mode (the default): engine threads
    # relax their own capture mode at their start, so their calls do not invalidate it.
    import time

    engine_config(backend="cuda", pinned_limit="1MiB", host_limit=0, disk_dir=tmp_path)
    xs = [torch.full((8 << 20,), float(i), device=DEV) for i in range(8)]  # 8 x 32 MiB to disk
    stored = []
    for x in xs:
        torch.cuda._sleep(50_000_000)  # the producer is busy: the I/O thread's waits are queued
        stored += _engine.store([x], CPU)
    static_in = torch.ones(1024, device=DEV)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = static_in * 2
        time.sleep(0.5)  # the capture stays open while the I/O thread works through its queue
    g.replay()
    torch.cuda.synchronize()
    assert torch.all(static_out == 2)
    back, _ = _engine.fetch(stored, DEV)
    assert all(torch.equal(a, b) for a, b in zip(xs, back))


def test_an_event_query_refused_by_a_capture_leaks_nothing(engine_config):
    # The capturing thread's own engine calls query the ledger's events, which a thread-local capture
    # refuses (cudaErrorStreamCaptureUnsupported: not sticky). The query says "unknown", the ledger
    # asks again later: nothing is taken for a broken context and leaked, and the engine stays usable.
    engine_config(backend="cuda")
    x = torch.randn(1 << 22, device=DEV)
    torch.cuda._sleep(100_000_000)
    (first,) = _engine.store([x], CPU)  # its copy still in flight during the capture
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            static_out = x * 2
            offcache.stats()  # reaps: queries the store's event
    except RuntimeError:
        pass  # the capture may be invalidated; the engine must not be
    torch.cuda.synchronize()
    offcache.synchronize()
    assert offcache.stats()["leaked_blocks"] == 0
    (back,), _ = _engine.fetch([first], DEV)
    assert torch.equal(back, x)
    del static_out


def test_a_d2h_copy_into_pageable_memory_counts_as_a_host_wait(engine_config, tmp_path):
    # cudaMemcpyAsync into pageable memory returns only once the copy is done: the caller
    # waited, and `syncs` says so (a spilled value; a disk value past a bounce chunk's 64 MiB).
    engine_config(backend="cuda", pinned_limit="1MiB", host_limit="1GiB", disk_dir="none")
    x = torch.randn(1 << 20, device=DEV)  # 4 MiB: past the 1 MiB budget, spilled
    before = offcache.stats()["syncs"]
    (s,) = _engine.store([x], CPU)
    assert not s.is_pinned() and offcache.stats()["syncs"] >= before + 1
    engine_config(backend="cuda", pinned_limit="1MiB", host_limit=0, disk_dir=tmp_path)
    big = torch.randn(20 << 20, device=DEV)  # 80 MiB: a pageable bounce buffer
    before = offcache.stats()
    (d,) = _engine.store([big], CPU)
    after = offcache.stats()
    assert after["bounce_pageable"] > before["bounce_pageable"] and after["syncs"] >= before["syncs"] + 1
    (back,), _ = _engine.fetch([d], DEV)
    assert torch.equal(back, big)


def test_disk_tier_bounce_chunks_are_registered_once(engine_config, tmp_path):
    # Two 40 MiB stores in flight take two bounce chunks; later rounds register none again
    # and unregister none (a cudaHostRegister costs ~ms per 64 MiB), with fetch_file's ring held.
    engine_config(backend="cuda", pinned_limit="1MiB", host_limit=0, disk_dir=tmp_path)
    path = tmp_path / "w.bin"
    random_file(path, 1 << 20)
    _engine.fetch_file(path, [(0, [1 << 20], torch.uint8)], DEV)
    xs = [torch.full((10 << 20,), float(i), device=DEV) for i in range(2)]
    made = []
    for _ in range(3):
        stored = _engine.store(xs, CPU)
        offcache.synchronize()
        s = offcache.stats()
        made.append((s["chunks_made"], s["pinned_registrations"]))
        assert s["chunks_released"] == 0
        del stored
    assert made[-1] == made[0], made
