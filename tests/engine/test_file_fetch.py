"""fetch_file: tensors read from byte ranges of a file onto a device, by the engine's I/O thread.

The model is the file's bytes: tensor i must equal ``bytes[offset:offset + nbytes]`` viewed as
its dtype and shape, whatever the offsets (unaligned, overlapping, across 8 MiB pieces, past
the bounce ring), and the caller must not wait for the disk: the I/O thread reads each piece
and issues its copies itself. Errors name the file and the reason; a read that fails makes
``ticket.wait()`` raise, and the engine reports it at its next call.
"""

import os
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import offcache
from offcache import engine as _engine
from tests.helpers import random_file

CPU = torch.device("cpu")
MiB = 1 << 20
PIECE = 8 * MiB
DTYPES = [torch.float32, torch.bfloat16, torch.int16, torch.uint8, torch.float64, torch.bool, torch.float8_e4m3fn]


def expected(data, offset, shape, dtype):
    """What tensor (offset, shape, dtype) must hold: its shape, dtype and the file's bytes."""
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return tuple(shape), dtype, bytes(data[offset : offset + n])


def same_bytes(got, want):
    shape, dtype, raw = want
    got_raw = got.reshape(-1).view(torch.uint8).numpy().tobytes()
    return tuple(got.shape) == shape and got.dtype == dtype and got_raw == raw


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    """A 21 MiB + 123 byte file: three pieces, its end not aligned."""
    path = tmp_path_factory.mktemp("fetch-file") / "blob.bin"
    return str(path), random_file(path, 21 * MiB + 123, seed=1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    items=st.lists(
        st.tuples(
            st.integers(0, 21 * MiB + 123),
            st.lists(st.integers(0, 700), min_size=0, max_size=3),
            st.sampled_from([torch.float32, torch.bfloat16, torch.int16, torch.uint8, torch.float64]),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_every_range_reads_the_files_bytes(host_engine, big_file, items):
    path, data = big_file
    fitted = []
    for offset, shape, dtype in items:
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        offset = min(offset, len(data) - n) if n <= len(data) else 0
        if n <= len(data):
            fitted.append((offset, shape, dtype))
    if not fitted:
        return
    out, ticket = _engine.fetch_file(path, fitted, CPU, wait=False)
    ticket.wait()
    for (offset, shape, dtype), got in zip(fitted, out):
        assert got.is_contiguous()
        assert same_bytes(got, expected(data, offset, shape, dtype)), (offset, shape, dtype)


def test_pieces_across_the_ring_and_unaligned_edges(host_engine, tmp_path):
    # 70 MiB: nine pieces, so the ring's slots are read into again; tensors straddle pieces.
    path = tmp_path / "w.bin"
    data = random_file(path, 70 * MiB + 5, seed=2)
    items = [(3, [PIECE], torch.uint8), (PIECE - 1, [2], torch.uint8), (11 * MiB + 1, [14 * MiB // 4], torch.float32)]
    items += [(0, [len(data)], torch.uint8), (len(data) - 5, [5], torch.uint8), (len(data), [0], torch.uint8)]
    items += [(17, [], torch.int16), (40 * MiB, [3, 0, 2], torch.float32)]  # a scalar, an empty tensor
    before = offcache.stats()
    out, ticket = _engine.fetch_file(path, items, CPU)
    ticket.wait()
    for (offset, shape, dtype), got in zip(items, out):
        assert same_bytes(got, expected(data, offset, shape, dtype)), (offset, shape, dtype)
    s = offcache.stats()
    assert s["file_fetches"] - before["file_fetches"] == 1
    # One span covers it all (the ranges overlap): every byte read once, the last piece short.
    assert s["file_read_bytes"] - before["file_read_bytes"] == len(data)
    assert s["bounce_reserved_bytes"] <= 64 * MiB  # the ring, not the file


def test_all_dtypes_round_trip_through_a_file(host_engine, tmp_path):
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(3)
    tensors = {
        str(dtype): torch.randn(37, 3, generator=g).to(dtype) if dtype is not torch.bool else torch.rand(9) > 0.5
        for dtype in DTYPES
    }
    path = tmp_path / "all.safetensors"
    save_file(tensors, path)
    from offcache.weights.files import locate as _locate

    items = [_locate(str(path), name) for name in tensors]
    out, _ = _engine.fetch_file(path, items, CPU)
    back = load_file(path)
    for name, got in zip(tensors, out):
        want = back[name]
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


def test_the_caller_does_not_wait_for_the_reads(engine_config, tmp_path):
    # Copies slowed to 40 ms each: nine pieces take >= 0.36 s; the call returns before the
    # first piece's copy is done, the ticket not complete and not even issued.
    engine_config(backend="host", host_copy_delay_us=40_000)
    path = tmp_path / "slow.bin"
    data = random_file(path, 9 * PIECE, seed=4)
    out, ticket = _engine.fetch_file(path, [(0, [len(data)], torch.uint8)], CPU, wait=False)
    assert not ticket.query() and not ticket.issued()
    syncs = offcache.stats()["syncs"]
    ticket.wait()
    assert ticket.query() and ticket.issued()
    assert torch.equal(out[0], torch.from_numpy(data))
    assert offcache.stats()["syncs"] == syncs  # ticket.wait() on the CPU is the caller's own wait


def test_wait_true_returns_filled_tensors(host_engine, big_file):
    path, data = big_file
    (got,), ticket = _engine.fetch_file(path, [(5, [1000], torch.int16)], CPU, wait=True)
    assert ticket.query()
    assert same_bytes(got, expected(data, 5, [1000], torch.int16))


def test_bad_arguments_are_clear_errors(host_engine, big_file, tmp_path):
    path, data = big_file
    with pytest.raises(RuntimeError, match="cannot open .*missing.bin.*No such file"):
        _engine.fetch_file(tmp_path / "missing.bin", [(0, [1], torch.uint8)], CPU)
    with pytest.raises(RuntimeError, match="not a regular file"):
        _engine.fetch_file(tmp_path, [(0, [1], torch.uint8)], CPU)
    with pytest.raises(ValueError, match=r"tensor 1 of .*blob.bin needs bytes \[.*\) but the file has"):
        _engine.fetch_file(path, [(0, [1], torch.uint8), (len(data) - 3, [2], torch.int16)], CPU)
    with pytest.raises(ValueError, match="needs bytes"):
        _engine.fetch_file(path, [(-1, [1], torch.uint8)], CPU)
    # The engine is fine afterwards.
    (got,), _ = _engine.fetch_file(path, [(0, [4], torch.uint8)], CPU)
    assert torch.equal(got, torch.from_numpy(data[:4].copy()))


def test_a_file_truncated_mid_fetch_fails_that_fetch_only(engine_config, tmp_path):
    # Slowed copies hold the I/O thread at the ring's ninth piece; the file shrinks meanwhile.
    engine_config(backend="host", host_copy_delay_us=50_000)
    path = tmp_path / "shrinks.bin"
    data = random_file(path, 10 * PIECE, seed=5)
    out, ticket = _engine.fetch_file(path, [(0, [10 * PIECE], torch.uint8)], CPU, wait=False)
    os.truncate(path, PIECE)
    with pytest.raises(RuntimeError, match="shrinks.bin.*unexpected end of file"):
        ticket.wait()
    assert ticket.query()  # the copies issued before the failure have landed
    del out
    # Not the engine's failure: the next calls work (a prefetch of a bad file never fails a run).
    (got,), _ = _engine.fetch_file(path, [(5, [100], torch.uint8)], CPU)
    assert torch.equal(got, torch.from_numpy(data[5:105].copy()))
    (x,) = _engine.store([torch.arange(10.0)], CPU)
    assert torch.equal(_engine.fetch([x], CPU)[0][0], torch.arange(10.0))
    with pytest.raises(ValueError, match="but the file has 8388608"):  # checked against its size now
        _engine.fetch_file(path, [(0, [2 * PIECE], torch.uint8)], CPU, wait=True)
    offcache.synchronize()
    assert offcache.stats()["in_flight_bytes"] == 0


def test_disk_tier_fetches_and_file_fetches_interleaved(engine_config, tmp_path):
    # The disk tier's fetch makes the copy stream wait for its I/O thread's reads; a
    # fetch_file's I/O waits for that copy stream (its ring): on one I/O thread they deadlocked.
    disk = tmp_path / "tier"
    disk.mkdir()
    engine_config(backend="host", pinned_limit="1MiB", host_limit=0, disk_dir=disk, host_copy_delay_us=2_000)
    path = tmp_path / "ring.bin"
    data = random_file(path, 12 * PIECE, seed=7)
    stored = _engine.store([torch.full((MiB,), float(i)) for i in range(3)], CPU)
    assert all(_engine.is_disk_tensor(t) for t in stored)
    offcache.synchronize()
    (big,), file_ticket = _engine.fetch_file(path, [(0, [len(data)], torch.uint8)], CPU, wait=False)
    got, ticket = _engine.fetch(stored, CPU, wait=False)
    done = threading.Event()

    def join():
        ticket.wait()
        file_ticket.wait()
        done.set()

    threading.Thread(target=join, daemon=True).start()
    assert done.wait(60), "a disk-tier fetch and a fetch_file deadlocked"
    assert torch.equal(big, torch.from_numpy(data))
    assert all(torch.equal(g, torch.full((MiB,), float(i))) for i, g in enumerate(got))


def test_outputs_and_tickets_dropped_at_once_are_safe(host_engine, big_file):
    path, data = big_file
    for _ in range(20):
        _engine.fetch_file(path, [(i * 4099, [MiB], torch.uint8) for i in range(5)], CPU, wait=False)
    offcache.synchronize()
    s = offcache.stats()
    assert s["in_flight_bytes"] == 0


def test_threads_fetching_one_file_at_once(host_engine, big_file):
    path, data = big_file
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(10):
                offset = int(rng.integers(0, len(data) - 3 * MiB))
                (got,), ticket = _engine.fetch_file(path, [(offset, [3 * MiB], torch.uint8)], CPU, wait=False)
                ticket.wait()
                assert torch.equal(got, torch.from_numpy(data[offset : offset + 3 * MiB].copy()))
        except Exception as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_page_cache_first_then_o_direct(host_engine, tmp_path):
    path = tmp_path / "direct.bin"
    data = random_file(path, 3 * MiB, seed=6)
    # Just written: in the page cache, served from it (no disk read).
    before = offcache.stats()
    (got,), _ = _engine.fetch_file(path, [(1, [3 * MiB - 1], torch.uint8)], CPU)
    assert torch.equal(got, torch.from_numpy(data[1:].copy()))
    s = offcache.stats()
    assert s["file_cached_reads"] - before["file_cached_reads"] == 1
    assert s["file_read_bytes"] - before["file_read_bytes"] == 3 * MiB
    # Dropped from the page cache: read from the disk, O_DIRECT where it can be opened.
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        direct = True
    except OSError:
        direct = False
    before = offcache.stats()
    (got,), _ = _engine.fetch_file(path, [(4096, [MiB], torch.uint8)], CPU)
    assert torch.equal(got, torch.from_numpy(data[4096 : 4096 + MiB].copy()))
    s = offcache.stats()
    if s["file_cached_reads"] > before["file_cached_reads"]:
        pytest.skip("the kernel kept the file's pages (fadvise did not drop them)")
    assert (s["file_buffered_reads"] == before["file_buffered_reads"]) == direct


def test_no_caller_waits_for_another_fetch_files_disk_reads(engine_config, tmp_path):
    # A 1 MiB in-flight bound and slowed copies: fetch and store throttle on it, fetch_file
    # does not (its staging is the ring): the second call returns while the first is in flight.
    engine_config(backend="host", host_copy_delay_us=40_000, max_in_flight="1MiB")
    path = tmp_path / "bound.bin"
    data = random_file(path, 9 * PIECE, seed=8)
    (a,), first = _engine.fetch_file(path, [(0, [len(data)], torch.uint8)], CPU, wait=False)
    (b,), second = _engine.fetch_file(path, [(1, [len(data) - 1], torch.uint8)], CPU, wait=False)
    assert not first.query(), "the second fetch_file waited for the first one's reads"
    (x,) = _engine.store([torch.arange(8.0)], CPU)  # stores are bounded apart from fetch_file too
    assert not first.query()
    first.wait()
    second.wait()
    assert torch.equal(a, torch.from_numpy(data)) and torch.equal(b, torch.from_numpy(data[1:]))
    assert torch.equal(x, torch.arange(8.0))


def test_the_ring_is_made_from_the_backends_chunks_while_the_disk_tier_fills_its_arena(engine_config, tmp_path):
    # The disk tier's bounce arena (4 chunks of 64 MiB) is full: four 60 MiB stores wait to be
    # written behind a disk fetch whose copy the I/O thread runs slowed. fetch_file's ring, made
    # now, is a chunk of its own from the backend (pinned on CUDA), not a pageable buffer for
    # the engine's life.
    disk = tmp_path / "disk"
    disk.mkdir()
    engine_config(backend="host", pinned_limit="1MiB", host_limit=0, disk_dir=disk, host_copy_delay_us=3_000_000)
    (small,) = _engine.store([torch.randn(1000)], CPU)
    offcache.synchronize()
    fetched, ticket = _engine.fetch([small], CPU, wait=False)  # its copy holds the I/O thread ~3 s
    big = [torch.full((15 * MiB,), float(i)) for i in range(4)]
    stored = [_engine.store([x], CPU)[0] for x in big]
    path = tmp_path / "file.bin"
    data = random_file(path, 2 * MiB)
    (out,), file_ticket = _engine.fetch_file(str(path), [(0, (2 * MiB,), torch.uint8)], CPU)
    assert offcache.stats()["bounce_pageable"] == 0
    assert out.numpy().tobytes() == data.tobytes()
    ticket.wait()
    got, _ = _engine.fetch(stored, CPU)
    assert all(torch.equal(a, b) for a, b in zip(big, got))
