"""CUDA backend: the engine's threads and processes: forked children, sticky CUDA errors met on
worker threads, the device each engine thread selects, graph captures beside them. Marked `gpu`
(skipped in conftest.py when no GPU is visible)."""

import pytest
import torch

import offcache
from offcache import engine as _engine
from tests.helpers import CPU, run_with_this_checkout

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_engine")]

DEV = torch.device("cuda:0")


# --- forks and sticky CUDA errors: an error or a fault, never an abort or a hang ------------------


def test_cuda_engine_refuses_forked_child():
    import multiprocessing as mp
    import queue

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
    if p.is_alive():
        p.kill()
        p.join(5)
        pytest.fail("the forked child still ran after 60 s (killed)")
    try:
        said = q.get(timeout=5)
    except queue.Empty:
        # A negative exit code is the signal that ended it (-11: SIGSEGV).
        pytest.fail(f"the forked child said nothing: exit code {p.exitcode}")
    assert "forked child" in said, (said, p.exitcode)


def test_sticky_cuda_error_does_not_abort_on_release(tmp_path):
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import gc, torch, offcache
        from offcache import engine as _engine
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
        from offcache import engine as _engine
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


def test_a_sticky_error_while_reaping_raises_and_does_not_deadlock(tmp_path):
    # A device-side assert breaks the context: every later event query raises. A host-stream
    # store (CPU to CPU, slowed) listed before a GPU fetch completes; reaping retires it (its
    # arena staging buffer held by the ledger only), then the fetch's query raises: the buffer
    # used to die under the engine's lock and its release to take that lock again (a hang).
    import textwrap

    script = textwrap.dedent(
        """
        import os, torch, offcache
        from offcache import engine as _engine
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
    proc = run_with_this_checkout(script, tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "raised:" in proc.stdout and "survived" in proc.stdout, proc.stdout


# --- engine threads: the device they select, capture mode (issue 24) ------------------------------


_PRIMARY_CONTEXT_SCRIPT = r"""
import ctypes, gc, os, sys, time
import torch
import offcache
from offcache import engine as _engine

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

# A caller's thread whose current device is GPU 0 (a Python thread never selects one): the pinned
# chunk it makes the engine register, and unregister, the shared mapping it maps and drops, and
# the events it queries and waits for all run on the engine's GPU (issue 40 item 4).
import threading
_engine.store([small], CPU)  # the new engine's first GPU: cuda:1
side = []

def caller_on_gpu_0():
    try:
        assert torch.cuda.current_device() == 0
        big = torch.randn(8 << 20)  # 32 MiB: a new pinned chunk, cudaHostRegister on this thread
        (s,) = _engine.store([big], CPU)
        _engine.wait_stored(s)
        (c,), ticket = _engine.fetch([s], CPU, False)
        ticket.wait()
        good = torch.equal(c, big)
        (g,), ticket = _engine.fetch([s], DEV, False)  # a CUDA event, queried and waited for here
        offcache.stats()
        ticket.wait()
        del s, c, g
        offcache.synchronize()
        offcache.empty_cache()  # cudaHostUnregister on this thread
        fd = os.memfd_create("offcache-primary-context")
        os.ftruncate(fd, 1 << 21)
        region, reason = _engine.map_shared(fd, 0, 1 << 21, 1)  # cudaHostRegister on this thread
        del region  # cudaHostUnregister on this thread
        os.close(fd)
        side.append(good and reason == "")
    except BaseException as e:
        side.append(repr(e))

t = threading.Thread(target=caller_on_gpu_0)
t.start()
t.join(120)
torch.cuda.synchronize()
print("SIDE", side[0] if side else "hung")
print("SIDE_AFTER", active(0))
"""


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two GPUs: a context on GPU 0 shows only beside a rank's own GPU"
)
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
    assert lines["SIDE"] == "True", proc.stdout
    assert lines["SIDE_AFTER"] == "False", (
        "a pinned registration or event call on a caller's thread made a context on GPU 0"
    )


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


def test_engine_calls_during_a_capture_neither_break_it_nor_leak(engine_config):
    # The capturing thread's own engine calls: a store on a stream that is not captured (its staging
    # buffer's cudaMalloc, a new chunk's cudaHostRegister), queries of the ledger's events (its copy
    # still in flight behind a long kernel), then the release of its block. Engine calls run in
    # relaxed capture mode, so they neither invalidate the capture nor fail; a query a capture still
    # refuses would be "unknown" (asked again later), never a broken context.
    engine_config(backend="cuda")
    x = torch.randn(1 << 22, device=DEV)
    side = torch.cuda.Stream(DEV)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        static_out = x * 2
        with torch.cuda.stream(side):  # not captured: runs now
            torch.cuda._sleep(200_000_000)
            (stored,) = _engine.store([x], CPU)  # its D2H copy follows `side`: still in flight
        assert offcache.stats()["leaked_blocks"] == 0  # reaps: queries the pending copy's event
        del stored  # its block's release queries the copy's event too
    g.replay()
    torch.cuda.synchronize()
    offcache.synchronize()
    assert torch.equal(static_out, x * 2)
    assert offcache.stats()["leaked_blocks"] == 0
    (again,) = _engine.store([x], CPU)  # the engine is not sticky
    _engine.wait_stored(again)
    assert torch.equal(again, x.cpu())


def test_chunks_pinned_and_released_beside_a_capture_leave_it_valid(engine_config):
    # While this thread captures a graph in global mode (the default), another thread makes the
    # engine pin a new chunk (cudaHostRegister), drops its value, and empty_cache() gives the
    # chunk back (cudaHostUnregister). Chunk registrations run in relaxed capture mode on whatever
    # thread makes them (issue 32): the capture stays valid and no chunk is kept registered.
    import threading

    engine_config(backend="cuda")
    static_in = torch.ones(1024, device=DEV)
    torch.cuda.synchronize()
    before = offcache.stats()
    errors = []

    def pin_and_release():
        try:
            big = torch.randn(16 << 20)  # 64 MiB: a new chunk
            (stored,) = _engine.store([big], CPU)
            _engine.wait_stored(stored)
            assert torch.equal(stored, big)
            del stored  # its block's release, on this thread
            offcache.synchronize()
            assert offcache.empty_cache() > 0
        except BaseException as e:  # noqa: BLE001 - reported by the capturing thread
            errors.append(e)

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = static_in * 2
        worker = threading.Thread(target=pin_and_release)
        worker.start()
        worker.join(120)
    assert not worker.is_alive() and not errors, errors
    g.replay()
    torch.cuda.synchronize()
    assert torch.all(static_out == 2)
    s = offcache.stats()
    assert s["chunks_made"] > before["chunks_made"], (before, s)
    assert s["chunks_released"] > before["chunks_released"], (before, s)
    assert s["chunks_kept_registered"] == 0


def test_a_fetch_on_the_legacy_stream_beside_a_capture_on_a_blocking_stream_waits(engine_config):
    # While one thread captures a graph on a blocking stream, cudaStreamIsCapturing on the legacy
    # default stream (another thread's current stream) answers cudaErrorStreamCaptureImplicit: the
    # fetch's capture check raised it instead of serving the fetch. Now it counts as a capture
    # elsewhere: the host waits for the copy (no work is queued on the legacy stream, which would
    # join the capture), and the capture stays valid (issue 40 item 6).
    import ctypes
    import threading

    engine_config(backend="cuda")
    x = torch.randn(1 << 20)
    (stored,) = _engine.store([x], CPU)
    _engine.wait_stored(stored)
    (warm,), _ = _engine.fetch([stored], DEV)  # the outputs' memory cached in the copy stream's pool
    del warm
    torch.cuda.synchronize()
    cuda = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_void_p()
    assert cuda.cuStreamCreate(ctypes.byref(handle), 0) == 0  # CU_STREAM_DEFAULT: a blocking stream
    blocking = torch.cuda.ExternalStream(handle.value, device=DEV)
    static_in = torch.ones(1024, device=DEV)
    results = []

    def fetch_on_the_legacy_stream():
        try:
            assert torch.cuda.current_stream(DEV) == torch.cuda.default_stream(DEV)
            (y,), ticket = _engine.fetch([stored], DEV, True)  # the consumer: the legacy default stream
            results.append((ticket.query(), y))
        except BaseException as e:  # noqa: BLE001 - reported by the capturing thread
            results.append(e)

    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=blocking, capture_error_mode="thread_local"):
            static_out = static_in * 2
            worker = threading.Thread(target=fetch_on_the_legacy_stream)
            worker.start()
            worker.join(60)
        g.replay()
        torch.cuda.synchronize()
    finally:
        torch.cuda.synchronize()
        cuda.cuStreamDestroy_v2(handle)
    assert not worker.is_alive() and len(results) == 1 and isinstance(results[0], tuple), results
    done, y = results[0]
    assert done  # the host waited for the copy
    assert torch.equal(y.cpu(), x)
    assert torch.all(static_out == 2)
