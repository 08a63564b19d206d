"""Shared mappings (offcache.weights.node's region, engine.map_shared) whose storage dies while copies
still read them: unmapped once those copies completed, not at the next region call (issue 40 item 8).
Host backend: the same bookkeeping as on CUDA without the driver."""

import os

import torch

import offcache
from offcache import engine as _engine
from offcache.engine import ops as _ops
from tests.helpers import CPU

NAME = "offcache-test-dead-mapping"


def _mapped() -> bool:
    with open("/proc/self/maps") as f:
        return any(NAME in line for line in f)


def test_a_mapping_that_died_while_read_is_unmapped_once_its_copies_completed(engine_config):
    engine_config(backend="host", host_copy_delay_us=20000, disk_dir="none")
    fd = os.memfd_create(NAME)
    try:
        os.ftruncate(fd, 1 << 16)
        region, reason = _engine.map_shared(fd, 0, 1 << 16, 1)
        assert reason == "" and _mapped()
        region.view(torch.float32).copy_(torch.arange(1 << 14, dtype=torch.float32))
        (y,), ticket = _engine.fetch([region.view(torch.float32)], CPU, False)
        ticket.wait()  # the engine holds nothing of the region now; its fence stays on the span
        # The storage's deleter asks whether the copy completed: refused for now (as during another
        # thread's graph capture), so the mapping waits, dead, for a later look.
        _ops._fail_query_after(0, transient=True)
        del region
        assert not _ops._fail_query_after(-1)  # the deleter's query was the one refused
        assert _mapped()
        offcache.synchronize()  # every copy of the engine is complete: the dead mapping goes
        assert not _mapped(), "a dead mapping stayed mapped after its copies completed"
        assert torch.equal(y, torch.arange(1 << 14, dtype=torch.float32))
        assert offcache.stats()["shared_deferred_unmaps"] == 0
    finally:
        os.close(fd)


def test_a_mapping_that_died_while_read_is_unmapped_by_the_next_fetch(engine_config):
    engine_config(backend="host", host_copy_delay_us=20000, disk_dir="none")
    fd = os.memfd_create(NAME)
    try:
        os.ftruncate(fd, 1 << 16)
        region, _ = _engine.map_shared(fd, 0, 1 << 16, 1)
        (_,), ticket = _engine.fetch([region], CPU, False)
        ticket.wait()
        _ops._fail_query_after(0, transient=True)
        del region
        _ops._fail_query_after(-1)
        assert _mapped()
        x = _engine.store([torch.randn(100)], CPU)
        _engine.fetch(x, CPU)  # any fetch looks at the dead mappings first
        assert not _mapped(), "a dead mapping stayed mapped past a fetch"
    finally:
        os.close(fd)
