"""The disk tier: values past the host limit live in files under the disk dir.

Placement (first come stays in memory), round trips through disk, `.value`,
pickle, prefetch that starts reading at fetch time, stats, the spill notice,
no names left on disk (even after kill -9), and disk full (RLIMIT_FSIZE).
"""

import copy
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

import offcache
from offcache import engine as _engine
from offcache.engine import machine as _machine
from tests.conftest import DISK_DIR

CPU = torch.device("cpu")
MiB = 1 << 20


@pytest.fixture
def disk_dir(tmp_path):
    d = tmp_path / "disk"
    d.mkdir()
    return d


@pytest.fixture
def all_on_disk(engine_config, disk_dir):
    engine_config(backend="host", pinned_limit="1MiB", min_chunk="256KiB", host_limit=0, disk_dir=disk_dir)
    return disk_dir


def values(seed=0):
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(3 * MiB + 13, generator=g)  # over a disk piece, not a multiple of 4096 bytes
    return [
        torch.randn(7, 5, generator=g),
        torch.randint(0, 255, (1000,), generator=g, dtype=torch.uint8),
        torch.randn(2, 3, 8, 8, generator=g).to(memory_format=torch.channels_last),
        big,
        torch.randn(300, generator=g).to(torch.bfloat16),
        torch.zeros(0, 4),
    ]


def test_values_round_trip_through_disk(all_on_disk):
    src = values()
    stored = _engine.store(src, CPU)
    assert all(_engine.is_disk_tensor(t) for t in stored if t.numel())
    assert os.listdir(all_on_disk) == []  # the files have no names
    got, ticket = _engine.fetch(stored, CPU)
    ticket.wait()
    for a, b, s in zip(src, got, stored):
        assert torch.equal(a, b)
        assert b.stride() == a.stride()
        _engine.wait_stored(s)
        assert torch.equal(a, s)  # `.value` reads the mapped file
    s = offcache.stats()
    assert s["disk_bytes"] > 0 and s["disk_files"] >= 1 and s["host_limit_bytes"] == 0
    assert s["disk_write_bytes"] >= sum(t.nbytes for t in src)
    assert s["disk_read_bytes"] >= sum(t.nbytes for t in src)
    assert s["disk_write_seconds"] > 0 and s["disk_read_seconds"] > 0
    del stored, got
    offcache.empty_cache()  # gives the disk tier's empty files back too
    s = offcache.stats()
    assert s["disk_bytes"] == 0 and s["disk_files"] == 0 and s["peak_disk_bytes"] > 0


def test_disk_tensors_pickle_and_deepcopy(all_on_disk):
    src = values(1)
    stored = _engine.store(src, CPU)
    for a, s in zip(src, stored):
        _engine.wait_stored(s)
        assert torch.equal(pickle.loads(pickle.dumps(s)), a)
        assert torch.equal(copy.deepcopy(s), a)


def test_cache_values_and_views_through_disk(all_on_disk):
    cache = offcache.IntermediatesCache.empty(3, "cpu")
    batches = [{"x": torch.randn(64, 64), "pair": (torch.arange(10), torch.ones(3))} for _ in range(3)]
    with pytest.warns(offcache.SpillWarning, match="disk"):
        for b, v in enumerate(batches):
            cache.update(b, v)
    for b, got in enumerate(cache.iter_prefetch()):
        assert torch.equal(got["x"], batches[b]["x"])
        assert torch.equal(got["pair"][1], batches[b]["pair"][1])
    deep = copy.deepcopy(cache)
    assert torch.equal(deep.fetch(2)["x"], batches[2]["x"])
    # A strided view of a disk value: fetched through the mapping.
    (view,) = _engine.store([torch.arange(100.0)], CPU)
    got, _ = _engine.fetch([view[::3]], CPU)
    assert torch.equal(got[0], torch.arange(100.0)[::3])


def test_fetch_starts_reading_before_the_ticket_is_waited(all_on_disk):
    src = [torch.randn(4 * MiB // 4) for _ in range(4)]
    stored = _engine.store(src, CPU)
    offcache.synchronize()
    before = offcache.stats()["disk_read_bytes"]
    got, ticket = _engine.fetch(stored, CPU, wait=False)
    deadline = time.monotonic() + 30
    while offcache.stats()["disk_read_bytes"] < before + sum(t.nbytes for t in src):
        assert time.monotonic() < deadline, "the disk read did not run ahead of ticket.wait()"
        time.sleep(0.005)
    ticket.wait()
    assert all(torch.equal(a, b) for a, b in zip(src, got))


def test_placement_first_come_stays_in_memory(engine_config, disk_dir):
    engine_config(backend="host", pinned_limit="64MiB", min_chunk="1MiB", host_limit="4MiB", disk_dir=disk_dir)
    stored = [_engine.store([torch.full((MiB // 4,), float(i))], CPU)[0] for i in range(12)]
    on_disk = [_engine.is_disk_tensor(t) for t in stored]
    # Batches written first (and read first, in the sequential pattern) stay in memory.
    assert on_disk == sorted(on_disk) and 0 < on_disk.count(False) <= 4 and on_disk[-1], on_disk
    got, _ = _engine.fetch(stored, CPU)
    assert all(torch.equal(g, torch.full((MiB // 4,), float(i))) for i, g in enumerate(got))


def test_with_a_disk_tier_the_host_limit_holds_at_its_peak(engine_config, disk_dir):
    # Snapshot staging counts against the host limit: values past it go to disk, and host
    # memory (pinned + pageable, staging included) never passes the limit, even for a moment.
    engine_config(backend="host", pinned_limit="64KiB", host_limit="4MiB", disk_dir=disk_dir, host_copy_delay_us=20_000)
    src = [torch.full((MiB // 4,), float(i)) for i in range(8)]
    stored = [_engine.store([x], CPU)[0] for x in src]
    s = offcache.stats()
    assert s["peak_pinned_in_use_bytes"] + s["peak_pageable_bytes"] <= 4 * MiB, s["peak_pageable_bytes"]
    assert s["peak_host_bytes"] <= 4 * MiB
    on_disk = [_engine.is_disk_tensor(t) for t in stored]
    assert on_disk == sorted(on_disk) and on_disk[-1] and not on_disk[0], on_disk
    got, _ = _engine.fetch(stored, CPU)
    assert all(torch.equal(a, b) for a, b in zip(src, got))


def test_no_disk_dir_nothing_goes_to_disk(engine_config):
    engine_config(backend="host", pinned_limit="1MiB", host_limit=4 * MiB, disk_dir="none")
    x = torch.randn(MiB)  # 4 MiB: past the pinned budget, spilled, within the host limit
    stored = _engine.store([x], CPU)
    assert not _engine.is_disk_tensor(stored[0])
    s = offcache.stats()
    assert s["disk_bytes"] == 0 and s["disk_write_bytes"] == 0 and s["pageable_bytes"] > 0
    assert s["host_limit_bytes"] == 4 * MiB


def test_past_the_host_limit_without_a_disk_tier_is_a_memory_error(engine_config):
    # The host limit holds without a disk dir too: the store that would cross it raises a
    # MemoryError naming the bytes and the variables, and every earlier value is intact.
    engine_config(backend="host", pinned_limit="1MiB", host_limit=6 * MiB, disk_dir="none")
    kept = [torch.full((MiB // 4,), float(i)) for i in range(5)]  # 5 x 1 MiB
    stored = _engine.store(kept, CPU)
    want = r"storing 4194304 more bytes.*host limit of 6291456.*OFFCACHE_HOST_LIMIT.*OFFCACHE_DISK_DIR"
    with pytest.raises(MemoryError, match=want):
        _engine.store([torch.randn(MiB)], CPU)
    assert issubclass(offcache._C.HostLimitError, MemoryError)
    got, _ = _engine.fetch(stored, CPU)
    assert all(torch.equal(a, b) for a, b in zip(kept, got))


def test_disk_dir_must_exist(engine_config, tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        engine_config(disk_dir=tmp_path / "missing")


def test_env_configures_the_disk_tier(disk_dir):
    code = "import offcache, torch; from offcache import engine as e; " \
           "t = e.store([torch.ones(10)], torch.device('cpu'))[0]; " \
           "print(e.is_disk_tensor(t), offcache.stats()['host_limit_bytes'])"  # fmt: skip
    env = dict(os.environ, OFFCACHE_BACKEND="host", OFFCACHE_DISK_DIR=str(disk_dir), OFFCACHE_HOST_LIMIT="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "0"]


def test_tmpfs_without_direct_io_falls_back(engine_config, tmp_path):
    shm = "/dev/shm"
    if not os.path.isdir(shm) or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    engine_config(backend="host", host_limit=0, disk_dir=shm)
    src = values(2)
    got, _ = _engine.fetch(_engine.store(src, CPU), CPU)
    assert all(torch.equal(a, b) for a, b in zip(src, got))


CHILD_WRITER = """
import sys, torch, offcache
from offcache import engine as _engine
offcache.configure(backend="host", host_limit=0, disk_dir=sys.argv[1])
keep = []
print("go", flush=True)
while True:
    keep.append(_engine.store([torch.randn(4 << 20)], torch.device("cpu"))[0])
    if len(keep) > 8:
        keep.pop(0)
"""


def test_kill_9_mid_write_leaves_no_files(disk_dir):
    env = dict(os.environ, OFFCACHE_BACKEND="host")
    p = subprocess.Popen([sys.executable, "-c", CHILD_WRITER, str(disk_dir)], stdout=subprocess.PIPE, env=env)
    try:
        assert p.stdout.readline().strip() == b"go"
        time.sleep(1.0)
        assert p.poll() is None
        assert os.listdir(disk_dir) == []  # nothing has a name even while it runs
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == -signal.SIGKILL
    assert os.listdir(disk_dir) == []


CHILD_FULL = """
import resource, signal, sys, torch, offcache
from offcache import engine as _engine
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killed process
resource.setrlimit(resource.RLIMIT_FSIZE, (48 << 20, 48 << 20))
offcache.configure(backend="host", host_limit=0, disk_dir=sys.argv[1])
cpu = torch.device("cpu")
small = [torch.randn(1000) for _ in range(10)]
kept = _engine.store(small, cpu) + _engine.store([torch.randn(40 << 18)], cpu)  # 40 MiB file
src = small + [None]
try:
    _engine.store([torch.randn(60 << 18)], cpu)  # a 60 MiB file: over RLIMIT_FSIZE
except RuntimeError as e:
    print("ERROR", e)
got, _ = _engine.fetch(kept, cpu)
print("INTACT", all(torch.equal(a, b) for a, b in zip(small, got)) and got[-1].numel() == 40 << 18)
print("DISK", all(_engine.is_disk_tensor(t) for t in kept))
"""


def test_disk_full_is_a_clear_error_and_loses_nothing(disk_dir):
    env = dict(os.environ, OFFCACHE_BACKEND="host")
    out = subprocess.run(
        [sys.executable, "-c", CHILD_FULL, str(disk_dir)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert str(disk_dir) in lines["ERROR"] and "bytes" in lines["ERROR"] and "File too large" in lines["ERROR"]
    assert lines["INTACT"] == "True" and lines["DISK"] == "True"
    assert os.listdir(disk_dir) == []


def test_session_disk_dir_is_clean():
    # The 4th engine configuration's folder: never any file in it.
    assert os.listdir(DISK_DIR) == []


@pytest.mark.slow
def test_llmcompressor_oneshot_bit_identical_through_disk(engine_config, disk_dir, tmp_path_factory):
    pytest.importorskip("llmcompressor")
    from offcache.bench.models import save_llama
    from tests.test_llmcompressor_oneshot import quantize

    model_dir = save_llama(
        tmp_path_factory.mktemp("tiny-llama"), vocab_size=96, hidden_size=128, intermediate_size=256,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        offcache.unpatch_llmcompressor()
        reference = quantize(model_dir, True)
        engine_config(host_limit=0, disk_dir=disk_dir)
        offcache.patch_llmcompressor()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", offcache.SpillWarning)
            ours = quantize(model_dir, True)
        s = offcache.stats()
        assert s["disk_write_bytes"] > 0 and s["disk_read_bytes"] > 0, "the disk tier was not used"
    finally:
        offcache.unpatch_llmcompressor()
        torch.set_num_threads(threads)
    assert reference.keys() == ours.keys()
    for k in reference:
        assert torch.equal(reference[k], ours[k]), f"{k} differs"
    assert os.listdir(disk_dir) == []


def test_bench_disk_tiny(tmp_path, monkeypatch):
    from offcache.bench.__main__ import main
    from offcache.bench.common import load_results

    monkeypatch.setenv("OFFCACHE_BENCH_DISK_DIR", str(tmp_path))
    assert main(["disk", "--tiny", "--out", str(tmp_path / "out")]) == 0
    r = load_results(tmp_path / "out" / "results.json")["disk"]
    assert {x["direction"] for x in r["throughput"]} == {"store", "fetch"}
    assert all(x["offcache_gbps"] > 0 and x["raw_gbps"] > 0 for x in r["throughput"])
    assert {"iter", "iter_prefetch", "in_memory", "hidden_fraction"} <= set(r["pipeline"])
    c = r["checkpoint"]  # the engine's cold read of a checkpoint's files against raw O_DIRECT
    assert c["offcache_gbps"] > 0 and c["raw_gbps"] > 0 and c["tensor_bytes"] == 64 << 20
    assert c["counters"]["file_read_bytes"] >= c["tensor_bytes"] and c["file_bytes"] > c["tensor_bytes"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # bench folders removed


def test_default_host_limit_is_shared_among_local_ranks(engine_config, disk_dir, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("OFFCACHE_HOST_LIMIT", raising=False)
    engine_config(backend="host", disk_dir=disk_dir)
    memory = min(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), _machine.cgroup_memory_limit() or 2**64)
    assert offcache.stats()["host_limit_bytes"] == int(memory * 0.25) // 4


def test_values_of_a_replaced_engine_still_fetch(engine_config, disk_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    engine_config(backend="host", host_limit=0, disk_dir=disk_dir)
    src = values(3)
    stored = _engine.store(src, CPU)
    engine_config(backend="host", host_limit=0, disk_dir=other)  # a new engine with its own files
    got, _ = _engine.fetch(stored, CPU)
    assert all(torch.equal(a, b) for a, b in zip(src, got))
    engine_config(backend="host")  # and one with no disk tier
    got, _ = _engine.fetch(stored, CPU)
    assert all(torch.equal(a, b) for a, b in zip(src, got))


CHILD_FORK = """
import os, sys, gc, torch, offcache, warnings
from offcache import engine as _engine
warnings.simplefilter("ignore")
torch.set_num_threads(1)  # OpenMP's pool does not survive fork(): a parallel op in the child would hang
offcache.configure(backend="host", pinned_limit="1MiB", min_chunk="256KiB", host_limit=0, disk_dir=sys.argv[1])
cpu = torch.device("cpu")
def val(i):
    return torch.full((1 << 18,), float(i))  # 1 MiB
before = _engine.store([val(0)], cpu)
offcache.synchronize()
assert _engine.is_disk_tensor(before[0])
to_child_r, to_child_w = os.pipe()
to_parent_r, to_parent_w = os.pipe()
pid = os.fork()
if pid == 0:
    import signal
    signal.alarm(30)  # a hang in the child ends it (and so the parent's wait)
    os.close(to_parent_r); os.close(to_child_w)
    os.read(to_child_r, 1)  # the parent has stored batch 1 and re-stored over batch 0's space
    try:
        mine = _engine.store([val(2)], cpu)
        offcache.synchronize()
        got_before, _ = _engine.fetch(before, cpu)
        got_mine, _ = _engine.fetch(mine, cpu)
        ok = torch.equal(got_before[0], val(0)) and torch.equal(got_mine[0], val(2))
        code = 0 if ok else 3
    except RuntimeError as e:  # refusing disk use in the child with a clear error would be fine too
        print("CHILD ERROR", e, flush=True)
        code = 0 if "fork" in str(e) else 4
    os.write(to_parent_w, b"x")
    os._exit(code)
os.close(to_parent_w); os.close(to_child_r)
first = _engine.store([val(1)], cpu)
offcache.synchronize()
del before; gc.collect()  # the parent frees batch 0: its space must not be reused under the child
again = _engine.store([val(3)], cpu)
offcache.synchronize()
os.write(to_child_w, b"x")
os.read(to_parent_r, 1)
_, status = os.waitpid(pid, 0)
got, _ = _engine.fetch(first + again, cpu)
print("PARENT", torch.equal(got[0], val(1)) and torch.equal(got[1], val(3)), flush=True)
print("CHILD", os.waitstatus_to_exitcode(status), flush=True)
"""


def test_fork_children_and_parents_do_not_share_new_disk_values(disk_dir):
    # Expected: after fork() each process's new disk values are its own, and the parent never reuses
    # space a child may still read (the child's pre-fork value stays intact).
    out = subprocess.run([sys.executable, "-c", CHILD_FORK, str(disk_dir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "PARENT True" in out.stdout and "CHILD 0" in out.stdout, (out.stdout, out.stderr[-3000:])


CHILD_EXT2 = """
import sys, torch, offcache, warnings
from offcache import engine as _engine
warnings.simplefilter("ignore")
offcache.configure(backend="host", pinned_limit="1MiB", min_chunk="256KiB", host_limit=0, disk_dir=sys.argv[1])
cpu = torch.device("cpu")
kept = []
try:
    for i in range(20):
        x = torch.full((1 << 20,), float(i))  # 4 MiB each: the 64 MiB file system fills up
        kept.append((x, _engine.store([x], cpu)[0]))
        offcache.synchronize()
    print("NOERROR", flush=True)
except RuntimeError as e:
    print("ERROR", str(e).replace(chr(10), " "), flush=True)
got, _ = _engine.fetch([s for _, s in kept], cpu)
print("INTACT", len(kept) > 0 and all(torch.equal(a, b) for (a, _), b in zip(kept, got)), flush=True)
"""


@pytest.fixture
def small_ext2(tmp_path):
    """A 64 MiB ext2 file system on a loop device: no fallocate, so nothing is reserved by it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a loop file system needs root")
    image, mnt = tmp_path / "ext2.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(64 * MiB)
    made = subprocess.run(["mkfs.ext2", "-q", "-F", str(image)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"mkfs.ext2 unavailable: {made.stderr.strip()}")
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount here: {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full_without_fallocate_is_a_clear_error(small_ext2):
    # Expected: a RuntimeError naming the folder and the bytes, earlier values intact; not SIGBUS.
    cmd = [sys.executable, "-c", CHILD_EXT2, str(small_ext2)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert "ERROR" in lines and str(small_ext2) in lines["ERROR"] and "bytes" in lines["ERROR"], out.stdout
    assert lines["INTACT"] == "True", out.stdout


def test_disk_io_buffers_come_from_the_bounce_arena_when_the_budget_is_full(all_on_disk):
    # The pinned budget (1 MiB) is full, yet the disk tier's I/O buffers are not pageable: they
    # come from its own arena outside the budget (pinned on CUDA, so the D2H stays asynchronous).
    src = values(3)
    stored = _engine.store(src, CPU)
    got, _ = _engine.fetch(stored, CPU)
    assert all(torch.equal(a, b) for a, b in zip(src, got))
    s = offcache.stats()
    assert s["bounce_pageable"] == 0 and s["bounce_reserved_bytes"] > 0
    offcache.synchronize()
    assert offcache.empty_cache() >= 0 and offcache.stats()["bounce_reserved_bytes"] == 0


def test_a_disk_fetch_does_not_hold_up_the_copy_stream(engine_config, disk_dir):
    """The I/O thread issues a disk value's copies once its reads are done: the fetch stream
    never waits for the disk, so a fetch from memory issued after it completes first (it used
    to queue behind the reads, and on CUDA the caller itself waited for them)."""
    engine_config(backend="host", pinned_limit="256MiB", min_chunk="1MiB", host_limit="8MiB", disk_dir=disk_dir)
    (small,) = _engine.store([torch.arange(1000.0)], CPU)  # first come: stays in memory
    (big,) = _engine.store([torch.randn(24 * MiB)], CPU)  # 96 MiB: past the host limit, on disk
    assert _engine.is_disk_tensor(big) and not _engine.is_disk_tensor(small)
    offcache.synchronize()
    (got_big,), big_ticket = _engine.fetch([big], CPU, wait=False)
    (got_small,), small_ticket = _engine.fetch([small], CPU, wait=False)
    small_ticket.wait()
    assert not big_ticket.query(), "the memory fetch waited for the disk fetch's reads"
    assert torch.equal(got_small, torch.arange(1000.0))
    big_ticket.wait()
    assert torch.equal(got_big, big)


def test_disk_fetch_then_a_write_and_a_fetch_of_its_memory_neighbour_do_not_deadlock(engine_config, disk_dir):
    """A fetch of a memory value and a disk value, then copy_into the memory value (its write
    waits for that fetch's read), then a fetch of it (waits for the write): the disk group's
    copies must not queue behind waits that follow them (a host stream's waits block it)."""
    engine_config(backend="host", pinned_limit="256MiB", min_chunk="1MiB", host_limit="8MiB", disk_dir=disk_dir)
    (m,) = _engine.store([torch.arange(1000.0)], CPU)  # in memory
    (b,) = _engine.store([torch.randn(24 * MiB)], CPU)  # 96 MiB: on disk
    assert _engine.is_disk_tensor(b) and not _engine.is_disk_tensor(m)
    offcache.synchronize()
    result = {}

    def run():
        (got_m, got_b), first = _engine.fetch([m, b], CPU, wait=False)
        written = _engine.copy_into([m], [torch.full((1000,), 7.0)])
        (again,), second = _engine.fetch([m], CPU, wait=False)
        for ticket in (first, written, second):
            ticket.wait()
        _engine.wait_stored(m)
        result.update(got_m=got_m, got_b=got_b, again=again)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "deadlocked"
    assert torch.equal(result["got_m"], torch.arange(1000.0)) and torch.equal(result["got_b"], b)
    assert torch.equal(result["again"], torch.full((1000,), 7.0))


def test_every_engine_thread_prepares_itself_before_its_work(engine_config, disk_dir, tmp_path):
    # Backend.prepare_thread (on CUDA: select the engine's device, relax the capture mode) runs
    # on each engine thread before its first task: the store and fetch copy streams, the disk
    # tier's I/O thread and fetch_file's. Counted once per thread.
    from tests.helpers import random_file

    # A copy delay sends a store of CPU memory through the D2H stream, as a GPU's store goes.
    engine_config(backend="host", pinned_limit="1MiB", host_limit="1MiB", disk_dir=disk_dir, host_copy_delay_us=1)
    assert offcache.stats()["threads_prepared"] == 0
    small, big = torch.randn(1000), torch.randn(MiB)  # in memory (a copy-stream store), then on disk
    stored = _engine.store([small], CPU) + _engine.store([big], CPU)
    assert not _engine.is_disk_tensor(stored[0]) and _engine.is_disk_tensor(stored[1])
    got = _engine.fetch(stored[:1], CPU)[0] + _engine.fetch(stored[1:], CPU)[0]  # fetch stream, I/O thread
    path = tmp_path / "file.bin"
    random_file(path, 4096)
    _engine.fetch_file(str(path), [(0, (1024,), torch.float32)], CPU)  # fetch_file's I/O thread
    offcache.synchronize()
    assert torch.equal(got[0], small) and torch.equal(got[1], big)
    assert offcache.stats()["threads_prepared"] == 4


def test_disk_io_buffer_chunks_are_kept_not_made_and_given_back_per_store(engine_config, disk_dir):
    # Two stores in flight at once need two of the bounce arena's chunks; once written, both
    # stay (on CUDA a chunk costs a cudaHostRegister to make and a cudaHostUnregister to give
    # back), so later rounds make none and give none back.
    engine_config(backend="host", pinned_limit="1MiB", host_limit=0, disk_dir=disk_dir)
    src = [torch.full((10 * MiB,), float(i)) for i in range(2)]  # 40 MiB each: one chunk each
    made = []
    for _ in range(3):
        stored = _engine.store(src, CPU)
        offcache.synchronize()
        s = offcache.stats()
        made.append(s["chunks_made"])
        assert s["chunks_released"] == 0, s["chunks_released"]
        got, _ = _engine.fetch(stored, CPU)
        assert all(torch.equal(a, b) for a, b in zip(src, got))
        del stored, got
    assert made[0] >= 2 and made[-1] == made[0], made
    offcache.synchronize()
    assert offcache.empty_cache() >= 0 and offcache.stats()["chunks_released"] >= 2
