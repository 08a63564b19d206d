"""Adversarial tests of Engine::fetch_file (offcache.engine.fetch_file); OffcacheDiskCache's are in
test_file_disk_cache.py (they need compressed-tensors).

Each test asserts the behaviour a user may rely on: the right bytes, a clear Python exception,
no crash, no hang. Risky cases (hangs, crashes, memory corruption) run in a subprocess with a
timeout so that the suite itself never hangs.
"""

import gc
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

import offcache
from offcache import _C
from offcache import engine as _engine
from tests.helpers import random_file, raw

CPU = torch.device("cpu")
MiB = 1 << 20
PIECE = 8 * MiB
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- helpers -----------------------------------------------------------------------------------


def write_random(path, nbytes, seed=0):
    return random_file(path, nbytes, seed).tobytes()  # bytes: the tests compare raw bytes


def nbytes_of(shape, dtype):
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def check(out, items, data):
    assert len(out) == len(items)
    for t, (off, shape, dtype) in zip(out, items):
        assert t.dtype == dtype and tuple(t.shape) == tuple(shape) and t.is_contiguous()
        assert t.device.type == "cpu"
        n = nbytes_of(shape, dtype)
        assert raw(t) == data[off : off + n], f"wrong bytes for item at offset {off}, shape {shape}, {dtype}"


def run_py(code, timeout=30):
    """Runs `code` in a fresh interpreter (this checkout's offcache); (returncode, output). rc None: hung."""
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONFAULTHANDLER="1")
    try:
        p = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out
    return p.returncode, p.stdout + p.stderr


# --- values: alignment, dtypes, shapes -----------------------------------------------------------

DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32,
    torch.int64, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2,
]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unaligned_offsets_every_dtype_scalars_and_empty(host_engine, tmp_path, dtype):
    path = tmp_path / "f.bin"
    data = write_random(path, 3 * 4096 + 77)
    items = [
        (1, (5, 3), dtype),
        (4095, (7,), dtype),  # straddles a 4 KiB boundary
        (13, (), dtype),  # a scalar
        (17, (0,), dtype),  # empty
        (19, (3, 0, 2), dtype),  # empty, 3-d
        (0, (1,), dtype),
    ]
    end = len(data) - nbytes_of((2,), dtype)
    items.append((end, (2,), dtype))  # the file's last bytes (its size is not aligned)
    items.append((len(data), (0,), dtype))  # zero bytes at the end of the file
    out, ticket = _engine.fetch_file(path, items, CPU)
    ticket.wait()
    assert ticket.query()
    check(out, items, data)


def test_piece_boundaries_and_ring_reuse_with_slow_copies(engine_config, tmp_path):
    """> 8 pieces (the ring of 8 bounce slots is reused), tensors straddling every 8 MiB piece
    boundary; slow copies so that a slot read into too early would show."""
    engine_config(backend="host", host_copy_delay_us=20000)
    path = tmp_path / "f.bin"
    size = 10 * PIECE + 12345
    data = write_random(path, size, seed=1)
    items = [(3, ((size - 3 - 5) // 4,), torch.float32)]  # one tensor over all pieces, unaligned
    for k in range(1, 11):
        items.append((k * PIECE - 5, (11,), torch.uint8))  # straddles boundary k
        items.append((k * PIECE - 6, (3,), torch.int32))
    out, ticket = _engine.fetch_file(path, items, CPU, wait=False)
    ticket.wait()
    check(out, items, data)


def test_spans_far_apart_reuse_the_ring(engine_config, tmp_path):
    """Ranges more than the 1 MiB merge gap apart: many spans, more pieces than slots."""
    engine_config(backend="host", host_copy_delay_us=5000)
    path = tmp_path / "f.bin"
    data = write_random(path, 40 * MiB, seed=2)
    items = [(i * 3 * MiB + 4097 + i, (1000 + i,), torch.int16) for i in range(13)]
    out, ticket = _engine.fetch_file(path, items, CPU, wait=False)
    ticket.wait()
    check(out, items, data)


def test_overlapping_and_duplicate_ranges(host_engine, tmp_path):
    path = tmp_path / "f.bin"
    data = write_random(path, PIECE + 5 * 4096, seed=3)
    items = [
        (100, (1000,), torch.float32),
        (100, (1000,), torch.float32),  # the same range twice
        (101, (999,), torch.int32),  # overlaps, unaligned to the first
        (100, (4000,), torch.uint8),
        (PIECE - 1000, (500,), torch.int64),  # straddles the piece boundary
        (PIECE - 1000, (4000,), torch.uint8),
    ]
    out, ticket = _engine.fetch_file(path, items, CPU)
    check(out, items, data)
    assert out[0].data_ptr() != out[1].data_ptr()  # distinct outputs
    out[0].zero_()
    assert raw(out[1]) == data[100:4100]


def test_no_items_and_only_empty_items(host_engine, tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"")
    out, ticket = _engine.fetch_file(path, [], CPU)
    assert out == [] and ticket.query()
    ticket.wait()
    out, ticket = _engine.fetch_file(path, [(0, (0,), torch.float32), (0, (2, 0), torch.bool)], CPU)
    assert [tuple(t.shape) for t in out] == [(0,), (2, 0)] and ticket.query()
    ticket.wait()


def test_tmpfs_file(host_engine):
    """/dev/shm: O_DIRECT may be refused (or be a no-op); the bytes are right either way."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = f"/dev/shm/offcache-adv-{os.getpid()}.bin"
    try:
        data = write_random(path, 2 * PIECE + 999, seed=4)
        items = [(7, (PIECE,), torch.uint8), (2 * PIECE + 990, (9,), torch.uint8), (0, (), torch.float64)]
        out, ticket = _engine.fetch_file(path, items, CPU)
        check(out, items, data)
    finally:
        os.unlink(path)


def test_stats_count_the_fetch(host_engine, tmp_path):
    path = tmp_path / "f.bin"
    data = write_random(path, PIECE + 100, seed=5)
    items = [(1, (PIECE // 4,), torch.float32), (PIECE + 10, (10,), torch.uint8)]
    before = offcache.stats()
    out, ticket = _engine.fetch_file(path, items, CPU)
    check(out, items, data)
    after = offcache.stats()
    requested = sum(nbytes_of(s, d) for _, s, d in items)
    assert after["file_fetches"] - before["file_fetches"] == 1
    assert after["h2d_bytes"] - before["h2d_bytes"] == requested
    read = after["file_read_bytes"] - before["file_read_bytes"]
    assert requested <= read <= len(data)


def test_ticket_has_issued(host_engine, tmp_path):
    """The documented Ticket API (_C.pyi, fetch_file's docs, compressed_tensors._wait) has issued()."""
    path = tmp_path / "f.bin"
    write_random(path, 4096)
    _, ticket = _engine.fetch_file(path, [(0, (4,), torch.uint8)], CPU, wait=False)
    ticket.wait()
    assert hasattr(ticket, "issued"), "offcache._C.Ticket has no issued(): the built extension predates the source"
    assert ticket.issued()


# --- bad arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "offset, shape",
    [(-1, (1,)), (-(2**62), (1,)), (4096, (1,)), (4097, (0,)), (4000, (97,)), (2**63 - 1, (1,)), (0, (4097,))],
)
def test_ranges_outside_the_file_raise(host_engine, tmp_path, offset, shape):
    path = tmp_path / "f.bin"
    write_random(path, 4096)
    with pytest.raises(ValueError, match="needs bytes"):
        _engine.fetch_file(path, [(offset, shape, torch.uint8)], CPU)


@pytest.mark.parametrize(
    "shape, dtype", [((2**62,), torch.float32), ((2**61, 2), torch.int64), ((2**62 + 1,), torch.float32)]
)
def test_byte_count_overflow_raises(host_engine, tmp_path, shape, dtype):
    """numel * element_size past 2**64: the byte count must not wrap to a small, valid range."""
    path = tmp_path / "f.bin"
    write_random(path, 4096)
    with pytest.raises((ValueError, RuntimeError, MemoryError, OverflowError)):
        _engine.fetch_file(path, [(0, shape, dtype)], CPU)


def test_float_offset_is_refused(host_engine, tmp_path):
    """int(8.7) == 8: a float offset would silently read other bytes."""
    path = tmp_path / "f.bin"
    write_random(path, 4096)
    with pytest.raises(TypeError):
        _engine.fetch_file(path, [(8.7, (4,), torch.uint8)], CPU)


def test_garbage_arguments_raise_python_errors(host_engine, tmp_path):
    path = tmp_path / "f.bin"
    write_random(path, 4096)
    bad = [
        lambda: _engine.fetch_file(None, [(0, (1,), torch.uint8)], CPU),
        lambda: _engine.fetch_file(123, [(0, (1,), torch.uint8)], CPU),
        lambda: _engine.fetch_file(path, [(0, (1,))], CPU),
        lambda: _engine.fetch_file(path, [(0, (1,), "float32")], CPU),
        lambda: _engine.fetch_file(path, [(0, (1.5,), torch.uint8)], CPU),
        lambda: _engine.fetch_file(path, [(0, (-1,), torch.uint8)], CPU),
        lambda: _engine.fetch_file(path, [("zero", (1,), torch.uint8)], CPU),
        lambda: _engine.fetch_file(path, [(0, (1,), torch.uint8)], "not a device"),
        lambda: _engine.fetch_file(path, [(0, (1,), torch.uint8)], torch.device("meta")),
        lambda: _C.fetch_file(str(path), [0, 1], [torch.empty(1, device="meta")], CPU, True),
        lambda: _C.fetch_file(str(path), [0], [torch.empty(1, device="meta"), torch.empty(1)], CPU, True),
        lambda: _C.fetch_file(str(path), [0], [torch.empty(2, 2).to_sparse()], CPU, True),
        lambda: _C.fetch_file(str(path), [0], [None], CPU, True),
    ]
    for i, call in enumerate(bad):
        try:
            call()
        except (TypeError, ValueError, RuntimeError):
            continue
        pytest.fail(f"garbage call {i} did not raise")
    # The engine still works.
    out, _ = _engine.fetch_file(path, [(0, (4,), torch.uint8)], CPU)
    assert out[0].shape == (4,)


def test_path_with_an_embedded_nul_is_refused(host_engine, tmp_path):
    """open() in Python refuses "a\\0b"; fetch_file must not silently read the file "a"."""
    path = tmp_path / "f.bin"
    write_random(path, 4096)
    with pytest.raises((ValueError, TypeError, RuntimeError)):
        _engine.fetch_file(str(path) + "\0.other", [(0, (1,), torch.uint8)], CPU)


def test_cuda_device_on_host_backend_raises(host_engine, tmp_path):
    path = tmp_path / "f.bin"
    write_random(path, 4096)
    with pytest.raises((RuntimeError, ValueError)):
        _engine.fetch_file(path, [(0, (1,), torch.uint8)], torch.device("cuda", 0))


def test_paths_that_are_not_regular_files_raise(host_engine, tmp_path):
    for p in [tmp_path, "/dev/null", "/dev/zero", tmp_path / "missing", "/proc/self/status", ""]:
        with pytest.raises((RuntimeError, ValueError)):
            _engine.fetch_file(p, [(0, (1,), torch.uint8)], CPU)


def test_fifo_path_raises_and_does_not_hang(tmp_path):
    """A FIFO with no writer: open(O_RDONLY) blocks for ever unless the engine checks first."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    rc, out = run_py(
        f"""
        import torch, offcache
        from offcache import engine as _engine
        offcache.configure(backend="host")
        try:
            _engine.fetch_file({str(fifo)!r}, [(0, (1,), torch.uint8)], torch.device("cpu"))
        except RuntimeError as e:
            print("RAISED", e)
        """,
        timeout=60,  # a hang, not a slow start: importing torch took 8 s on a loaded 2-core machine
    )
    assert rc is not None, "fetch_file of a FIFO hung (blocked in open())"
    assert rc == 0 and "RAISED" in out, out


# --- the file changing under a fetch -------------------------------------------------------------


def test_file_unlinked_while_in_flight_reads_the_old_bytes(engine_config, tmp_path):
    engine_config(backend="host", host_copy_delay_us=100000)
    path = tmp_path / "f.bin"
    data = write_random(path, 10 * PIECE, seed=6)
    items = [(5, ((10 * PIECE - 5),), torch.uint8)]
    out, ticket = _engine.fetch_file(path, items, CPU, wait=False)
    os.unlink(path)
    ticket.wait()
    check(out, items, data)


# A read failure leaves the engine's I/O stream failed, and replacing that engine crashed
# the test process once: every failure case runs in its own interpreter.
TRUNCATE_PRELUDE = """
import gc, os, sys, time, torch, offcache
from offcache import _C
from offcache import engine as _engine
MiB = 1 << 20
PIECE = 8 * MiB
CPU = torch.device("cpu")
path = sys.argv[1]
size = 10 * PIECE
open(path, "wb").write(b"\\x01" * size)
offcache.configure(backend="host", host_copy_delay_us=int(sys.argv[2]))
(out,), ticket = _engine.fetch_file(path, [(0, (size,), torch.uint8)], CPU, wait=False)
time.sleep(0.05)
os.truncate(path, 8 * PIECE)  # the I/O thread waits for slot 0's copies before reading piece 8
"""


def run_truncated(tmp_path, body, delay_us=150000, timeout=40):
    script = tmp_path / "case.py"
    script.write_text(TRUNCATE_PRELUDE + textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONFAULTHANDLER="1")
    try:
        p = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "f.bin"), str(delay_us)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return None, "hung"
    return p.returncode, p.stdout + p.stderr


def test_file_truncated_while_in_flight_raises(tmp_path):
    """A read past the new end fails: the consumer's wait raises (no silent garbage)."""
    rc, out = run_truncated(
        tmp_path,
        """
        try:
            ticket.wait()
            print("NO ERROR")
        except RuntimeError as e:
            print("RAISED", "unexpected end of file" in str(e))
        os._exit(0)  # (not through the engine's teardown: see the next tests)
        """,
    )
    assert rc == 0 and "RAISED True" in out, out


def test_replacing_the_engine_after_a_failed_read_does_not_crash(tmp_path):
    """configure() after a failed fetch_file (the documented way out: 'offcache.configure()
    starts a new engine') must not crash the process."""
    rc, out = run_truncated(
        tmp_path,
        """
        try:
            ticket.wait()
        except RuntimeError:
            pass
        offcache.configure(backend="host")
        print("SURVIVED")
        """,
    )
    assert rc is not None, "hung"
    assert rc == 0 and "SURVIVED" in out, f"rc {rc}:\n{out[-3000:]}"


def test_failed_fetch_ticket_is_not_complete_while_its_copies_still_write(tmp_path):
    """After a read fails, ticket.query() turns True (and the engine lets go of the outputs and
    the bounce buffer). No copy may still be writing the outputs then."""
    rc, out = run_truncated(
        tmp_path,
        """
        deadline = time.time() + 20
        while not ticket.query() and time.time() < deadline:
            time.sleep(0.005)
        complete_at = time.time()
        try:
            ticket.wait()
        except RuntimeError:
            pass
        snapshot = out[7 * PIECE : 7 * PIECE + 64].clone()  # piece 7, read before the failure
        time.sleep(1.5)  # 8 copies of 0.15 s were queued: all would have landed by now
        later = out[7 * PIECE : 7 * PIECE + 64].clone()
        print("QUERY", ticket.query(), "CHANGED", not torch.equal(snapshot, later))
        os._exit(0)
        """,
    )
    assert rc == 0, out
    assert "QUERY True CHANGED False" in out, f"the output changed after its ticket completed:\n{out}"


def test_failed_fetch_does_not_corrupt_other_memory(tmp_path):
    """The outputs of a failed fetch, dropped once its ticket completes, are freed while the
    copies of the pieces read before the failure still write them: an unrelated tensor that
    reuses the memory must stay intact (and the process must not crash)."""
    rc, out = run_truncated(
        tmp_path,
        """
        while not ticket.query():
            time.sleep(0.005)
        try:
            ticket.wait()
        except RuntimeError:
            pass
        del out, ticket
        gc.collect()
        try:
            offcache.stats()  # reaps the finished fetch: its outputs die
        except RuntimeError:
            pass
        others = [torch.zeros(size, dtype=torch.uint8) for _ in range(3)]
        time.sleep(1.5)
        print("NONZERO", sum(int(o.count_nonzero()) for o in others))
        os._exit(0)
        """,
    )
    assert rc is not None, "hung"
    assert rc == 0, f"crashed (rc {rc}):\n{out[-3000:]}"
    assert "NONZERO 0" in out, f"an unrelated tensor was overwritten by a failed fetch's copies:\n{out}"


def test_engine_usable_after_one_file_fails(tmp_path):
    """A truncated checkpoint is the file's fault, not the engine's: a later fetch of another,
    intact file, a plain store/fetch and synchronize() work."""
    rc, out = run_truncated(
        tmp_path,
        """
        try:
            ticket.wait()
        except RuntimeError:
            pass
        good = path + ".good"
        data = os.urandom(3 * 4096)
        open(good, "wb").write(data)
        errors = []
        try:
            (o,), _ = _engine.fetch_file(good, [(3, (100,), torch.uint8)], CPU)
            assert o.numpy().tobytes() == data[3:103]
        except RuntimeError as e:
            errors.append("fetch_file of an intact file: " + str(e)[:160])
        try:
            (s,) = _engine.store([torch.arange(10.0)], CPU)
            (f,), _ = _engine.fetch([s], CPU)
            assert torch.equal(f, torch.arange(10.0))
        except RuntimeError as e:
            errors.append("store/fetch: " + str(e)[:160])
        try:
            offcache.synchronize()
        except RuntimeError as e:
            errors.append("synchronize: " + str(e)[:160])
        print("ERRORS", errors)
        os._exit(0)
        """,
        delay_us=50000,
    )
    assert rc == 0, out
    assert "ERRORS []" in out, out


def test_file_grown_while_in_flight_reads_the_requested_bytes(engine_config, tmp_path):
    engine_config(backend="host", host_copy_delay_us=50000)
    path = tmp_path / "f.bin"
    data = write_random(path, 3 * PIECE + 11, seed=10)
    items = [(1, (3 * PIECE + 10,), torch.uint8)]
    out, ticket = _engine.fetch_file(path, items, CPU, wait=False)
    with open(path, "ab") as f:
        f.write(b"\xff" * PIECE)
    ticket.wait()
    check(out, items, data)


# --- lifetimes, threads, fork, configure --------------------------------------------------------


def test_dropping_outputs_and_tickets_at_once(engine_config, tmp_path):
    engine_config(backend="host", host_copy_delay_us=20000)
    path = tmp_path / "f.bin"
    data = write_random(path, 3 * PIECE, seed=11)
    for i in range(20):
        _engine.fetch_file(path, [(i, (PIECE,), torch.uint8), (PIECE + i, (100,), torch.int16)], CPU, wait=False)
    gc.collect()
    items = [(5, (2 * PIECE,), torch.uint8)]
    out, ticket = _engine.fetch_file(path, items, CPU)
    check(out, items, data)
    offcache.synchronize()
    assert offcache.stats()["in_flight_bytes"] == 0


def test_many_threads_fetching_concurrently(engine_config, tmp_path):
    engine_config(backend="host", host_copy_delay_us=1000)
    files = []
    for j in range(4):
        p = tmp_path / f"f{j}.bin"
        files.append((p, write_random(p, PIECE + 4096 * j + 13, seed=20 + j)))
    errors = []

    def worker(w):
        try:
            rng = np.random.default_rng(w)
            for _ in range(6):
                p, data = files[int(rng.integers(len(files)))]
                items = []
                for _ in range(int(rng.integers(1, 6))):
                    dtype = [torch.uint8, torch.float16, torch.int32, torch.float64][int(rng.integers(4))]
                    es = torch.empty((), dtype=dtype).element_size()
                    n = int(rng.integers(0, 200000))
                    off = int(rng.integers(0, len(data) - n * es))
                    items.append((off, (n,), dtype))
                out, t = _engine.fetch_file(p, items, CPU, wait=bool(rng.integers(2)))
                t.wait()
                check(out, items, data)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a fetching thread hung"
    assert not errors, errors[:3]


def test_configure_while_a_fetch_is_in_flight(engine_config, tmp_path):
    """The engine is replaced while its I/O thread still reads and its copy stream still copies."""
    engine_config(backend="host", host_copy_delay_us=100000)
    path = tmp_path / "f.bin"
    data = write_random(path, 10 * PIECE + 7, seed=12)
    items = [(3, (10 * PIECE + 4,), torch.uint8)]
    out, ticket = _engine.fetch_file(path, items, CPU, wait=False)
    offcache.configure(backend="host")  # retires the engine mid-fetch
    ticket.wait()
    check(out, items, data)
    out2, _ = _engine.fetch_file(path, items, CPU)
    check(out2, items, data)


def test_configure_while_ring_waits_then_drop_everything(tmp_path):
    """Retire the engine mid-fetch, drop outputs and ticket, reconfigure again: no crash."""
    path = tmp_path / "f.bin"
    rc, out = run_py(
        f"""
        import gc, os, time, torch, offcache
        from offcache import engine as _engine
        path = {str(path)!r}
        MiB = 1 << 20
        data = os.urandom(10 * 8 * MiB + 5)
        open(path, "wb").write(data)
        offcache.configure(backend="host", host_copy_delay_us=30000)
        for i in range(2):
            _engine.fetch_file(path, [(i, (len(data) - i,), torch.uint8)], torch.device("cpu"), wait=False)
            offcache.configure(backend="host", host_copy_delay_us=30000)
            gc.collect()
        out, t = _engine.fetch_file(path, [(1, (len(data) - 1,), torch.uint8)], torch.device("cpu"))
        assert out[0].numpy().tobytes() == data[1:]
        offcache.synchronize()
        print("OK")
        """,
        timeout=40,
    )
    assert rc is not None, "hung"
    assert rc == 0 and "OK" in out, out


def test_fork_after_and_during_a_fetch_child_fetches_too(tmp_path):
    path = tmp_path / "f.bin"
    rc, out = run_py(
        f"""
        import os, sys, torch, offcache
        from offcache import engine as _engine
        path = {str(path)!r}
        MiB = 1 << 20
        data = os.urandom(3 * 8 * MiB + 3)
        open(path, "wb").write(data)
        offcache.configure(backend="host", host_copy_delay_us=20000)
        items = [(1, (len(data) - 1,), torch.uint8)]
        out, t = _engine.fetch_file(path, items, torch.device("cpu"))  # a finished fetch
        out2, t2 = _engine.fetch_file(path, items, torch.device("cpu"), wait=False)  # one in flight
        pid = os.fork()
        if pid == 0:
            try:
                o, tk = _engine.fetch_file(path, [(5, (1000,), torch.int16)], torch.device("cpu"))
                tk.wait()
                ok = o[0].numpy().tobytes() == data[5:2005]
                t2.wait()  # the parent's ticket, inherited
                ok = ok and out2[0].numpy().tobytes() == data[1:]
                os._exit(0 if ok else 3)
            except BaseException as e:
                print("child:", repr(e), flush=True)
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        t2.wait()
        assert out[0].numpy().tobytes() == data[1:] and out2[0].numpy().tobytes() == data[1:]
        print("CHILD", os.waitstatus_to_exitcode(status))
        """,
        timeout=40,
    )
    assert rc is not None, "hung"
    assert rc == 0 and "CHILD 0" in out, out
