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


NEAR_THE_LIMIT = """
import time, torch, offcache
from offcache import engine as _engine
from tests.engine.test_gpu_streams import _spin_cycles
cpu, dev = torch.device("cpu"), torch.device("cuda:0")
offcache.configure(backend="cuda")
torch.cuda.set_per_process_memory_fraction((256 << 20) / torch.cuda.get_device_properties(0).total_memory, 0)
(stored,) = _engine.store([torch.randn(4 << 20)], cpu)  # 16 MiB
_engine.wait_stored(stored)
cycles = _spin_cycles(0.2)
before, stats = torch.cuda.memory_stats()["num_alloc_retries"], offcache.stats()
slowest, rounds = 0.0, 6
for _ in range(rounds):
    work = torch.empty(248 << 20, dtype=torch.uint8, device=dev)  # compute's memory: the budget but 8 MiB
    torch.cuda._sleep(cycles)  # ~0.2 s of compute queued
    del work  # cached in the consumer stream's pool
    t0 = time.monotonic()
    (y,), ticket = _engine.fetch([stored], dev, False)
    slowest = max(slowest, time.monotonic() - t0)
    ticket.wait()
    torch.cuda.synchronize()
    assert torch.equal(y.cpu(), stored)
    del y
after = offcache.stats()
print("retries", torch.cuda.memory_stats()["num_alloc_retries"] - before)
print("engine_retries", after["output_alloc_retries"] - stats["output_alloc_retries"])
print("consumer_pool", after["consumer_pool_fetches"] - stats["consumer_pool_fetches"])
print("slowest", round(slowest, 3))
"""


def test_fetches_near_the_memory_limit_meet_no_allocator_retry(tmp_path):
    # Under a per-process memory fraction, with the consumer's cached blocks filling it, a fetch's
    # outputs allocated on the copy stream met the allocator's free-and-retry on every fetch: it
    # frees every cached block after a device synchronisation, so each fetch waited for the
    # consumer's queued compute (issue 40 item 7). Now they come from the consumer's pool there.
    # In a subprocess: the memory fraction is the process's.
    import textwrap

    from tests.helpers import run_with_this_checkout

    proc = run_with_this_checkout(textwrap.dedent(NEAR_THE_LIMIT), tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    assert lines["retries"] == "0" and lines["engine_retries"] == "0", lines
    assert lines["consumer_pool"] == "6", lines
    assert float(lines["slowest"]) < 0.1, lines  # no fetch waited for the ~0.2 s of queued compute


PINNED_BEFORE_INIT = """
import ctypes
import numpy as np
import torch, offcache
from offcache import engine as _engine
# Host memory pinned by another library (the driver API) before torch's CUDA lazy init: torch's
# Tensor.is_pinned() says False for every pointer until then.
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
array = np.arange(1 << 20, dtype=np.float32)
assert cuda.cuMemHostRegister_v2(ctypes.c_void_p(array.ctypes.data), ctypes.c_size_t(array.nbytes), 1) == 0
foreign = torch.from_numpy(array)
print("before_init", foreign.is_pinned())
stats = offcache.stats()  # the engine (and torch's CUDA state) is made here
for _ in range(3):
    (out,), _ = _engine.fetch([foreign], torch.device("cuda:0"), True)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), foreign)
after = offcache.stats()
print("queries", after["pinned_queries"] - stats["pinned_queries"])
print("syncs", after["syncs"] - stats["syncs"])
assert cuda.cuMemHostUnregister(ctypes.c_void_p(array.ctypes.data)) == 0
"""


def test_a_source_pinned_before_cudas_lazy_init_is_known_pinned(tmp_path):
    # foreign_pinned() remembers Tensor.is_pinned() per storage; asked before torch's CUDA lazy
    # init it says False for pinned memory, and that False was remembered for good (issue 40 item
    # 8). The engine asks only once torch's CUDA state is initialised.
    import textwrap

    from tests.helpers import run_with_this_checkout

    proc = run_with_this_checkout(textwrap.dedent(PINNED_BEFORE_INIT), tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    assert lines["queries"] == "1", lines  # asked once, remembered
    assert lines["syncs"] == "0", lines  # every copy from pinned memory: no host wait counted
