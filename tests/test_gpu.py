"""CUDA backend: streams, events, pinned arena, batching, prefetch. Marked `gpu`
(skipped in conftest.py when no GPU is visible)."""

import pytest
import torch

import offcache
from offcache import IntermediatesCache, _engine
from tests.helpers import CPU, assert_same

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
