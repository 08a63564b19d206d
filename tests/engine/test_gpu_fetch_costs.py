"""What a fetch to a GPU asks of the driver and the allocator beyond its copies (issue 32 item 7): whether a source
is pinned is asked at most once per foreign storage, and packed outputs start 64-byte aligned. GPU only."""

import numpy as np
import pytest
import torch

import offcache
from offcache import engine as _engine
from tests.helpers import CPU

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_engine")]
DEV = torch.device("cuda:0")


def _queries(stored, times=3):
    before = offcache.stats()["pinned_queries"]
    for _ in range(times):
        (out,), _ = _engine.fetch([stored], DEV, True)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), stored)
    return offcache.stats()["pinned_queries"] - before


def test_a_fetch_asks_whether_a_source_is_pinned_once_per_foreign_storage():
    # Each segment from a CPU tensor offcache does not hold used to cost a cudaPointerGetAttributes
    # (Tensor.is_pinned()), on every fetch: only to count the host wait of a pageable source.
    arena = _engine.store([torch.randn(1 << 16)], CPU)[0]
    assert _queries(arena) == 0  # the engine's own memory: known
    assert _queries(torch.randn(1 << 16)) == 0  # torch's CPU allocator: pageable, known
    assert _queries(torch.randn(1 << 16).pin_memory()) <= 1  # torch's pinned allocator: known (or asked once)
    foreign = torch.from_numpy(np.arange(1 << 16, dtype=np.float32))  # no allocator torch knows
    before = offcache.stats()["syncs"]
    assert _queries(foreign) == 1  # asked once, remembered for its storage
    assert offcache.stats()["syncs"] - before >= 3  # each copy from pageable memory still counted as a wait


def test_packed_outputs_on_the_gpu_start_64_byte_aligned():
    values = [torch.randn(n) for n in (3, 17, 1000)] + [torch.arange(50, dtype=torch.int8)]
    stored = _engine.store(values, CPU)
    views = [s[k:] for s, k in zip(stored, (1, 5, 3, 7))]
    outs, _ = _engine.fetch(views + stored, DEV, True)
    torch.cuda.synchronize()
    for o, w in zip(outs, views + stored):
        assert o.data_ptr() % 64 == 0
        assert torch.equal(o.cpu(), w)
    s = offcache.stats()
    assert s["packed_span_bytes"] <= s["packed_spans"] * (256 << 10) + 16 * s["packed_output_bytes"]
