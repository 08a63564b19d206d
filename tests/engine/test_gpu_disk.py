"""CUDA backend: the disk tier and fetch_file on a GPU: bounce buffers and chunks, a checkpoint's
byte ranges read onto the device, disk weights prefetched, copies that follow a disk fetch.
Marked `gpu` (skipped in conftest.py when no GPU is visible)."""

import pytest
import torch

import offcache
from offcache import engine as _engine
from tests.helpers import CPU, random_file

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_engine")]

DEV = torch.device("cuda:0")


# --- the disk tier: bounce buffers and chunks, host waits, fences (issues 17, 24) -----------------


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


def test_an_h2d_copy_from_pageable_memory_counts_as_a_host_wait(engine_config):
    # cudaMemcpyAsync from pageable memory returns once the driver staged the source: the caller
    # waited, and `syncs` says so (a spilled value); from the pinned arena it does not.
    # Tensor.is_pinned() is False for every pointer until torch itself has initialised CUDA (as
    # the first test of a pytest-xdist worker may not have): initialise it first.
    torch.cuda.init()
    engine_config(backend="cuda", pinned_limit="1MiB", host_limit="1GiB", disk_dir="none")
    small, big = torch.randn(1024), torch.randn(1 << 20)  # 4 KiB pinned, 4 MiB spilled
    pinned, spilled = _engine.store([small], CPU)[0], _engine.store([big], CPU)[0]
    offcache.synchronize()
    where = [(t.is_pinned(), _engine.is_arena_tensor(t)) for t in (pinned, spilled)]
    assert where == [(True, True), (False, False)], f"(is_pinned, is_arena_tensor) of 4 KiB, 4 MiB: {where}"
    before = offcache.stats()["syncs"]
    (a,), _ = _engine.fetch([pinned], DEV, wait=False)
    assert offcache.stats()["syncs"] == before, "a fetch from the pinned arena counted a host wait"
    (b,), _ = _engine.fetch([spilled], DEV, wait=False)
    assert offcache.stats()["syncs"] - before == 1, offcache.stats()["syncs"] - before
    torch.cuda.synchronize()
    assert torch.equal(a.cpu(), small) and torch.equal(b.cpu(), big)


def test_a_d2h_copy_into_pageable_memory_counts_as_a_host_wait(engine_config, tmp_path):
    # cudaMemcpyAsync into pageable memory returns only once the copy is done: the caller
    # waited, and `syncs` says so (a spilled value; a disk value past the bounce arena's 256 MiB,
    # kBounceArenaBytes: a larger value than a 64 MiB chunk takes a pinned chunk of its own).
    engine_config(backend="cuda", pinned_limit="1MiB", host_limit="1GiB", disk_dir="none")
    x = torch.randn(1 << 20, device=DEV)  # 4 MiB: past the 1 MiB budget, spilled
    before = offcache.stats()["syncs"]
    (s,) = _engine.store([x], CPU)
    assert not s.is_pinned() and offcache.stats()["syncs"] >= before + 1
    engine_config(backend="cuda", pinned_limit="1MiB", host_limit=0, disk_dir=tmp_path)
    big = torch.randn(66 << 20, device=DEV)  # 264 MiB: past the bounce arena, a pageable bounce buffer
    before = offcache.stats()
    (d,) = _engine.store([big], CPU)
    after = offcache.stats()
    got = {k: after[k] - before[k] for k in ("bounce_pageable", "syncs", "bounce_reserved_bytes")}
    assert got["bounce_pageable"] >= 1 and got["syncs"] >= 1, got
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

    from offcache.weights import compressed_tensors as oc_ct

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
