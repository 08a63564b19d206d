"""Fetched outputs under each CUDA allocator backend, and a ticket waited on inside a graph capture (issue 32
items 3 and 4). GPU only: each allocator backend is chosen before CUDA starts, so each runs in its own process."""

import textwrap

import pytest
import torch

from offcache import engine as _engine
from tests.helpers import CPU, run_with_this_checkout

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_engine")]

ALLOCATORS = {
    "native": "",
    "cudaMallocAsync": "backend:cudaMallocAsync",
    "expandable_segments": "expandable_segments:True",
}

SCRIPT = """
import torch, offcache
from offcache import engine
offcache.configure(backend="cuda")
print("backend", torch.cuda.get_allocator_backend())
dev = torch.device("cuda:0")
values = [torch.randn(n, device=dev) for n in (1, 7, 1000, 4096, 1 << 19)]  # all but the last packable
stored = engine.store(values, torch.device("cpu"))
before = offcache.stats()["output_allocations"]
side = torch.cuda.Stream(dev)
for wait in (True, False):
    outs, ticket = engine.fetch(stored, dev, wait)
    if not wait:
        with torch.cuda.stream(side):
            ticket.wait()
    for o, v in zip(outs, values):
        o.record_stream(side)            # legal for an ordinary tensor: legal here
        offcache.record_stream(o, side)
        torch.cuda.synchronize()
        assert torch.equal(o, v)
    del outs
torch.cuda.synchronize()
print("allocations", offcache.stats()["output_allocations"] - before)
"""


@pytest.mark.parametrize("allocator", list(ALLOCATORS))
def test_fetched_outputs_take_record_stream_under_every_allocator_backend(allocator, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", ALLOCATORS[allocator])
    proc = run_with_this_checkout(textwrap.dedent(SCRIPT), tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    assert lines["backend"] == ("cudaMallocAsync" if allocator == "cudaMallocAsync" else "native")
    per_fetch = int(lines["allocations"]) // 2
    # Under cudaMallocAsync every output is an allocation of its own; else the small ones share one span.
    assert per_fetch == (5 if allocator == "cudaMallocAsync" else 2), lines


def test_a_ticket_waited_on_in_a_capture_of_finished_copies_queues_no_wait_and_the_graph_replays():
    dev = torch.device("cuda:0")
    values = [torch.randn(256, device=dev) for _ in range(4)]
    stored = _engine.store(values, CPU)
    outs, ticket = _engine.fetch(stored, dev, False)
    torch.cuda.synchronize()
    assert ticket.query()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            ticket.wait()  # the copies are done: nothing to wait for, and the capture stays valid
            total = torch.stack(outs).sum(0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(total, torch.stack(values).sum(0))


def test_a_ticket_of_copies_in_flight_waited_on_in_a_capture_says_what_to_do():
    dev = torch.device("cuda:0")
    big = torch.randn(1 << 28, device=dev)  # 1 GiB: its H2D copy takes milliseconds
    (stored,) = _engine.store([big], CPU)
    _engine.wait_stored(stored)
    torch.cuda.synchronize()
    (out,), ticket = _engine.fetch([stored], dev, False)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    raised = None
    try:
        with torch.cuda.stream(side):
            with torch.cuda.graph(graph, stream=side):
                ticket.wait()
                out.add_(1)
    except RuntimeError as exc:
        raised = str(exc)
    if raised is None:  # the copy finished before the wait asked: it had nothing to wait for
        assert ticket.query()
    else:
        assert "Ticket.wait() during a CUDA graph capture" in raised and "before the capture" in raised, raised
    torch.cuda.synchronize()
    ticket.wait()
    assert torch.equal(out, big)  # the captured add_ never ran (the graph was not replayed)


RETIRED_STREAMS = """
import gc, time, torch, offcache
from offcache import engine
print("backend", torch.cuda.get_allocator_backend())
dev = torch.device("cuda:0")
offcache.configure(backend="cuda")
(stored,) = engine.store([torch.randn(1 << 20)], torch.device("cpu"))
(out,), ticket = engine.fetch([stored], dev)  # allocated on the engine's H2D copy stream
want = stored.clone()
offcache.configure(backend="cuda")  # retires the engine
del stored, ticket
gc.collect()
deadline = time.monotonic() + 60
while offcache.stats()["retired_engines"] and time.monotonic() < deadline:
    time.sleep(0.01)  # deleted on a thread of its own, its copy streams with it
print("retired", offcache.stats()["retired_engines"])
assert torch.equal(out.cpu(), want)
del out  # freed on the stream that allocated it: the deleted engine's copy stream
torch.cuda.synchronize()
again = torch.randn(1 << 20, device=dev)  # the allocator still works
(back,), _ = engine.fetch(engine.store([again], torch.device("cpu")), dev)
torch.cuda.synchronize()
print("ok", torch.equal(back, again))
"""


def test_an_output_freed_after_its_engine_was_deleted_frees_on_a_live_stream(tmp_path, monkeypatch):
    # A retired engine destroyed its copy streams while the outputs a fetch allocated on them lived
    # on: under cudaMallocAsync their free is a cudaFreeAsync on the destroyed stream (issue 40
    # item 5). Copy streams now outlive their engine (kept for the next one).
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    proc = run_with_this_checkout(textwrap.dedent(RETIRED_STREAMS), tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    assert lines == {"backend": "cudaMallocAsync", "retired": "0", "ok": "True"}, proc.stdout + proc.stderr[-3000:]
