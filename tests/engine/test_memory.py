"""Issue 19, Python side: memory from cgroups, the host limit, OFFCACHE_DISK_DIR=auto, the early warning."""

import contextlib
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import offcache
from offcache import IntermediatesCache
from offcache import engine as _engine
from offcache.engine import config as engine_settings
from offcache.engine import disk_dir
from offcache.engine import loader as _loader
from offcache.engine import machine as _machine

MiB, GiB = 1 << 20, 1 << 30
ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def fake_proc(tmp_path, cgroup: str, mounts: list[tuple[str, str, str, str]]):
    """A /proc/self stand-in: `cgroup` lines and (root, mount point, fs type, super options) mounts."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    lines = [
        f"{30 + i} 1 0:{40 + i} {root} {point.replace(' ', chr(92) + '040')} rw,relatime - {fs} {fs} {opts}"
        for i, (root, point, fs, opts) in enumerate(mounts)
    ]
    (proc / "mountinfo").write_text("\n".join(lines) + "\n")
    return str(proc)


def limit_dir(base, path: str, name: str, value: str):
    d = base / path.strip("/") if path.strip("/") else base
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(value + "\n")


# Memory: the smaller of RAM and the cgroup limit ---------------------------------------------------


def test_cgroup_v2_limit_is_the_tightest_on_the_path(tmp_path):
    root = tmp_path / "cg2 with space"
    limit_dir(root, "/job", "memory.max", str(3 * GiB))
    limit_dir(root, "/job/step", "memory.max", "max")  # no limit of its own: the parent's binds
    proc = fake_proc(tmp_path, "0::/job/step\n", [("/", str(root), "cgroup2", "rw")])
    assert _machine.cgroup_memory_limit(proc) == 3 * GiB


def test_cgroup_v1_memory_hierarchy_and_a_namespaced_mount(tmp_path):
    root = tmp_path / "memory"
    # The mount's root is the container's own cgroup: /proc/self/cgroup paths begin with it.
    limit_dir(root, "/", "memory.limit_in_bytes", str(2 * GiB))
    limit_dir(root, "/inner", "memory.limit_in_bytes", "9223372036854771712")  # v1's "unlimited"
    cgroup = "5:cpu,cpuacct:/kube/pod1\n4:memory:/kube/pod1/inner\n0::/\n"
    mounts = [("/kube/pod1", str(root), "cgroup", "rw,memory"), ("/kube/pod1", str(tmp_path / "cpu"), "cgroup", "cpu")]
    proc = fake_proc(tmp_path, cgroup, mounts)
    assert _machine.cgroup_memory_limit(proc) == 2 * GiB


def test_no_cgroup_limit_is_none(tmp_path):
    root = tmp_path / "cg2"
    limit_dir(root, "/", "memory.max", "max")
    assert _machine.cgroup_memory_limit(fake_proc(tmp_path, "0::/\n", [("/", str(root), "cgroup2", "rw")])) is None
    assert _machine.cgroup_memory_limit(str(tmp_path / "missing")) is None


def test_percentages_and_defaults_are_of_the_cgroup_limit(engine_config, monkeypatch):
    monkeypatch.setattr(_machine, "cgroup_memory_limit", lambda proc="/proc/self": 2 * GiB)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for var in ("OFFCACHE_PINNED_LIMIT", "OFFCACHE_HOST_LIMIT"):
        monkeypatch.delenv(var, raising=False)
    assert _machine.usable_memory_bytes() == min(2 * GiB, _machine.total_ram_bytes())
    assert _engine.parse_size("50%", "X") == _machine.usable_memory_bytes() // 2
    engine_config(backend="host", disk_dir="none")
    s = offcache.stats()
    assert s["host_limit_bytes"] == pinned_budget() == _machine.usable_memory_bytes() // 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    engine_config(backend="host", disk_dir="none", pinned_limit="10%")
    assert offcache.stats()["host_limit_bytes"] == _machine.usable_memory_bytes() // 4 // 2
    assert pinned_budget() == _machine.usable_memory_bytes() // 10 // 2  # shared by the ranks
    offcache.set_pinned_limit("20%")
    assert pinned_budget() == _machine.usable_memory_bytes() // 5 // 2
    engine_config(backend="host", disk_dir="none", pinned_limit="64MiB", host_limit=1 << 30)  # bytes: per process
    assert (pinned_budget(), offcache.stats()["host_limit_bytes"]) == (64 * MiB, GiB)


def pinned_budget() -> int:
    """The pinned limit as set: the arena's (``pinned_limit_bytes``) plus the share of a node region this
    process has pinned, which the arena's leaves out (a region an earlier test's process group left mapped)."""
    s = offcache.stats()
    return s["pinned_limit_bytes"] + s["shared_pinned_share_bytes"]


def test_stats_report_the_host_limit_without_a_disk_tier(engine_config):
    engine_config(backend="host", disk_dir="none", host_limit="123MiB")
    assert offcache.stats()["host_limit_bytes"] == 123 * MiB


# OFFCACHE_DISK_DIR -----------------------------------------------------------------------------------


def on_memory_fs(path) -> bool:
    return _machine.filesystem_type(str(path)) in _machine._MEMORY_FS


@pytest.fixture
def xdg(tmp_path, monkeypatch):
    if on_memory_fs(tmp_path):
        pytest.skip(f"{tmp_path} is on a memory file system: auto would refuse it")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


def test_auto_is_a_private_folder_under_xdg_cache_home(engine_config, xdg, monkeypatch):
    monkeypatch.delenv("OFFCACHE_DISK_DIR", raising=False)
    engine_config(backend="host", pinned_limit="1MiB", min_chunk="256KiB", host_limit="2MiB")
    folder = xdg / "offcache"
    assert _engine.settings()["disk_dir"] == str(folder) and _engine.settings()["disk_auto_reason"] == ""
    assert not xdg.exists()  # made when first needed, not when configured
    cache = IntermediatesCache.empty(4, "cpu")
    with pytest.warns(offcache.SpillWarning):
        for i in range(4):
            cache.update(i, {"x": torch.full((MiB // 4,), float(i))})
    assert folder.is_dir() and (folder.stat().st_mode & 0o777) == 0o700


def test_far_from_the_host_limit_an_update_does_not_ask_the_engine_for_its_stats(engine_config, xdg, monkeypatch):
    """Until the auto folder exists, every store checks whether it may be needed: that check used to
    build the engine's whole stats dict on every update of a run (issue 31 item 11). Far from the
    limit it is a subtraction; the engine is asked again only once the room seen last is used up,
    and the folder still appears in time (the test above)."""
    monkeypatch.delenv("OFFCACHE_DISK_DIR", raising=False)
    engine_config(backend="host", host_limit="1GiB")
    assert disk_dir.pending()
    calls = []
    real = _loader._C.stats
    monkeypatch.setattr(_loader._C, "stats", lambda: calls.append(1) or real())
    cache = IntermediatesCache.empty(0, "cpu")
    for i in range(200):
        cache.append({"x": torch.full((256,), float(i)), "y": torch.ones(3)})
    assert len(calls) <= 1, f"{len(calls)} stats() calls for 200 small updates far from the host limit"
    assert not xdg.exists()
    assert torch.equal(cache.fetch(199)["x"], torch.full((256,), 199.0))


def test_auto_without_xdg_uses_the_home_cache(engine_config, tmp_path, monkeypatch):
    if on_memory_fs(tmp_path):
        pytest.skip(f"{tmp_path} is on a memory file system")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _machine.auto_disk_dir() == (str(tmp_path / ".cache" / "offcache"), "")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # the XDG spec: a relative path is ignored
    assert _machine.auto_disk_dir()[0] == str(tmp_path / ".cache" / "offcache")


def test_crossing_the_host_limit_with_auto_lands_in_the_default_folder(engine_config, xdg):
    engine_config(backend="host", pinned_limit="1MiB", min_chunk="256KiB", host_limit="2MiB", disk_dir=" Auto ")
    cache = IntermediatesCache.empty(4, "cpu")
    src = [torch.full((MiB // 4,), float(i)) for i in range(4)]
    with pytest.warns(offcache.SpillWarning, match=f"values now go to disk in {xdg / 'offcache'}"):
        for i, x in enumerate(src):
            cache.update(i, {"x": x})
    assert offcache.stats()["disk_bytes"] > 0 and _engine.is_disk_tensor(cache.batch_intermediates[3]["x"].value)
    assert all(torch.equal(cache.fetch(i)["x"], x) for i, x in enumerate(src))
    assert os.listdir(xdg / "offcache") == []  # files unlinked at once, private folders removed


def test_auto_refuses_tmpfs_and_says_why(engine_config, monkeypatch):
    shm = "/dev/shm"
    if _machine.filesystem_type(shm) != "tmpfs" or not os.access(shm, os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm")
    xdg = os.path.join(shm, f"offcache-test-{os.getpid()}")
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    engine_config(backend="host", disk_dir="auto")
    got = _engine.settings()
    assert got["disk_dir"] == "" and "is on tmpfs, which is memory, not disk" in got["disk_auto_reason"]
    assert not os.path.exists(xdg)  # nothing made on the memory file system
    assert offcache.stats()["disk_bytes"] == 0


@pytest.mark.parametrize("fs", ["tmpfs", "ramfs"])
def test_auto_refuses_memory_file_systems_from_mountinfo(tmp_path, fs):
    proc = fake_proc(tmp_path, "0::/\n", [("/", "/", "ext4", "rw"), ("/", str(tmp_path / "mem"), fs, "rw")])
    (tmp_path / "mem").mkdir()  # a mount point exists; the folders under it are not made to check them
    folder, why = _machine.auto_disk_dir({"XDG_CACHE_HOME": str(tmp_path / "mem" / "cache")}, proc)
    assert folder == "" and f"is on {fs}" in why
    folder, why = _machine.auto_disk_dir({"XDG_CACHE_HOME": str(tmp_path / "disk")}, proc)
    assert (folder, why) == (str(tmp_path / "disk" / "offcache"), "")


def test_auto_refuses_a_full_disk_and_an_unwritable_folder(tmp_path, monkeypatch):
    real = os.statvfs

    class Full:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(_machine.os, "statvfs", lambda p: Full())
    folder, why = _machine.auto_disk_dir({"XDG_CACHE_HOME": str(tmp_path)})
    assert folder == "" and "has only 40KiB free (auto needs at least 1GiB)" in why
    monkeypatch.setattr(_machine.os, "statvfs", real)
    blocker = tmp_path / "file"
    blocker.write_text("")  # XDG_CACHE_HOME is a file: no folder can be made under it
    folder, why = _machine.auto_disk_dir({"XDG_CACHE_HOME": str(blocker)})
    assert folder == "" and "cannot make" in why


@pytest.mark.parametrize(
    "value, error, match",
    [("", ValueError, "'auto'.*'none'"), ("   ", ValueError, "'auto'.*'none'"), (True, TypeError, "disk_dir"),
     (0, TypeError, "disk_dir"), ("/no/such/folder", ValueError, "not a folder")],
)  # fmt: skip
def test_bad_disk_dir_values_name_the_forms(engine_config, value, error, match):
    with pytest.raises(error, match=match):
        engine_config(disk_dir=value)


def test_none_turns_the_disk_tier_off(engine_config):
    engine_config(backend="host", disk_dir=" NONE ")
    assert _engine.settings()["disk_dir"] == "" and _engine.settings()["disk_auto_reason"] == ""


# HostLimitError ------------------------------------------------------------------------------------


def test_host_limit_error_is_a_memory_error_offcache_exports():
    assert issubclass(offcache.HostLimitError, MemoryError)
    assert offcache.HostLimitError is getattr(offcache._C, "HostLimitError", offcache.HostLimitError)


def test_the_cache_names_the_batch_and_why_auto_found_no_folder(engine_config, monkeypatch):
    engine_config(backend="host", disk_dir="none")
    monkeypatch.setitem(
        engine_settings._resolved, "disk_auto_reason", "/x/offcache is on tmpfs, which is memory, not disk"
    )

    def refuse(values, device, allow_spill=True):
        raise offcache.HostLimitError("offcache: 4096 more bytes would cross the host limit (0 bytes)")

    cache = IntermediatesCache.empty(2, "cpu")
    cache.update(0, {"kept": torch.ones(4)})
    monkeypatch.setattr(_engine, "store", refuse)
    with pytest.raises(offcache.HostLimitError) as info:
        cache.update(1, {"hidden": torch.ones(1024), "mask": torch.ones(2)})
    text = str(info.value)
    assert text.startswith("batch 1 (values 'hidden', 'mask'): offcache: 4096 more bytes")
    assert "OFFCACHE_DISK_DIR=auto found no folder: /x/offcache is on tmpfs" in text
    monkeypatch.undo()
    assert cache.fetch(1) == {} and torch.equal(cache.fetch(0)["kept"], torch.ones(4))


def test_none_raises_at_the_host_limit_and_keeps_every_earlier_value(engine_config):
    engine_config(backend="host", pinned_limit="1MiB", min_chunk="256KiB", host_limit="2MiB", disk_dir="none")
    cache = IntermediatesCache.empty(8, "cpu")
    src = [torch.full((MiB // 4,), float(i)) for i in range(8)]
    with pytest.raises(offcache.HostLimitError) as info:
        for i, x in enumerate(src):
            cache.update(i, {"x": x})
    text = str(info.value)
    assert "OFFCACHE_HOST_LIMIT" in text and "OFFCACHE_DISK_DIR" in text and str(2 * MiB) in text
    assert text.startswith("batch ")
    stored = [i for i in range(8) if "x" in cache.batch_intermediates[i]]
    assert stored and all(torch.equal(cache.fetch(i)["x"], src[i]) for i in stored)


def test_the_host_limit_holds_at_its_peak_snapshot_staging_included(engine_config):
    # Each update stages a snapshot of its CPU source, kept in flight by slowed copies. The
    # staging counts against the host limit like the values: pinned + pageable never passes it,
    # right after update() nor at its peak; a store that finds no room for its staging waits for
    # earlier staging, then copies from its source. Nothing is lost: every value is intact.
    engine_config(backend="host", pinned_limit="64KiB", host_limit="4MiB", disk_dir="none", host_copy_delay_us=20_000)
    cache = IntermediatesCache.empty(5, "cpu")
    src = [torch.full((MiB // 4,), float(i)) for i in range(5)]
    for i, x in enumerate(src[:4]):
        cache.update(i, {"x": x})
        s = offcache.stats()
        assert s["pinned_in_use_bytes"] + s["pageable_bytes"] <= 4 * MiB, (i, s["pageable_bytes"])
    s = offcache.stats()
    assert s["peak_pinned_in_use_bytes"] + s["peak_pageable_bytes"] <= 4 * MiB, s["peak_pageable_bytes"]
    assert 4 * MiB - 64 * 1024 <= s["peak_host_bytes"] <= 4 * MiB, s["peak_host_bytes"]
    with pytest.raises(offcache.HostLimitError):  # a fifth value does not fit, staging or not
        cache.update(4, {"x": src[4]})
    assert offcache.stats()["peak_host_bytes"] <= 4 * MiB
    assert all(torch.equal(cache.fetch(i)["x"], src[i]) for i in range(4))


def test_auto_on_tmpfs_falls_back_to_the_error_saying_why(engine_config, monkeypatch):
    shm = "/dev/shm"
    if _machine.filesystem_type(shm) != "tmpfs" or not os.access(shm, os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm")
    monkeypatch.setenv("XDG_CACHE_HOME", os.path.join(shm, f"offcache-test-{os.getpid()}"))
    engine_config(backend="host", pinned_limit="1MiB", min_chunk="256KiB", host_limit="1MiB", disk_dir="auto")
    cache = IntermediatesCache.empty(4, "cpu")
    with pytest.raises(offcache.HostLimitError, match="auto found no folder: .* is on tmpfs"):
        for i in range(4):
            cache.update(i, {"x": torch.ones(MiB // 4)})


# The early warning -------------------------------------------------------------------------------


def test_the_early_warning_fires_after_the_first_batch_of_a_run_that_cannot_fit(engine_config):
    engine_config(backend="host", pinned_limit="4MiB", host_limit="4MiB", disk_dir="none")
    cache = IntermediatesCache.empty(1000, "cpu")
    with pytest.warns(offcache.CapacityWarning) as record:
        cache.update(0, {"hidden_states": torch.ones(64 * 1024)})  # 256 KiB x 1000 batches
    (w,) = [r for r in record if issubclass(r.category, offcache.CapacityWarning)]
    text = str(w.message)
    assert f"hold {256 * 1024} bytes" in text and f"{256 * 1024 * 1000} bytes" in text
    assert "OFFCACHE_DISK_DIR" in text and "OFFCACHE_HOST_LIMIT" in text and str(4 * MiB) in text
    assert w.filename == __file__  # points at the caller of update()
    with warnings.catch_warnings():
        warnings.simplefilter("error", offcache.CapacityWarning)
        cache.update(1, {"hidden_states": torch.ones(64 * 1024)})  # once per cache
        cache.update(0, {"next_layer": torch.ones(64 * 1024)})


def test_no_early_warning_for_a_run_that_fits(engine_config):
    engine_config(backend="host", pinned_limit="4MiB", host_limit="64MiB", disk_dir="none")
    cache = IntermediatesCache.empty(100, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", offcache.CapacityWarning)
        for name in ("a", "b"):
            cache.update(0, {name: torch.ones(64 * 1024)})  # 256 KiB x 100 < 64 MiB


def test_the_early_warning_counts_the_disk_tiers_free_space(engine_config, tmp_path):
    engine_config(backend="host", pinned_limit="4MiB", host_limit="4MiB", disk_dir=tmp_path)
    room, where = _engine.capacity()
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    assert abs(room - 4 * MiB - free) < GiB and str(tmp_path) in where  # a shared disk's free space moves
    with warnings.catch_warnings():
        warnings.simplefilter("error", offcache.CapacityWarning)
        IntermediatesCache.empty(100, "cpu").update(0, {"x": torch.ones(64 * 1024)})  # fits on the disk


def test_from_dataloader_projects_its_first_batch(engine_config):
    engine_config(backend="host", pinned_limit="4MiB", host_limit="1MiB", disk_dir="none")
    loader = torch.utils.data.DataLoader([{"input_ids": torch.ones(16 * 1024)} for _ in range(200)], batch_size=1)
    # The warning comes at the first batch; the engine refuses the batch that crosses the limit.
    with pytest.warns(offcache.CapacityWarning, match=f"for 200 batches that is {64 * 1024 * 200} bytes"):
        with pytest.raises(offcache.HostLimitError, match="batch 16"):
            IntermediatesCache.from_dataloader(loader)


# A real memory cgroup --------------------------------------------------------------------------------

PAYLOAD = """
import sys, torch, offcache
from offcache import IntermediatesCache
from offcache import engine as _engine
from offcache.engine import loader as _loader
n, size = 24, 128 << 20
s = _engine.settings()
print("limits", s["host_limit"], s["pinned_limit"], s["disk_dir"] or s["disk_auto_reason"], flush=True)
cache = IntermediatesCache.empty(n, "cpu")
for i in range(n):
    cache.update(i, {"hidden": torch.full((size // 4,), float(i))})
print("stored", offcache.stats()["disk_bytes"], flush=True)
for i in range(n):
    x = cache.fetch(i)["hidden"]
    assert x.shape == (size // 4,) and bool((x == float(i)).all()), i
    del x
print("intact", flush=True)
"""


@contextlib.contextmanager
def memory_cgroup(limit: int):
    """A fresh memory cgroup (offcache.bench.cgroup) limited to `limit`: yields its cgroup.procs. Skips where none
    can be made."""
    from offcache.bench.cgroup import NoCgroupError
    from offcache.bench.cgroup import memory_cgroup as make

    try:
        made = make(limit, f"offcache-test-{os.getpid()}")
        group = made.__enter__()
    except NoCgroupError as exc:
        pytest.skip(str(exc))
    try:
        yield group.procs
    finally:
        made.__exit__(None, None, None)


def test_three_gib_through_the_cache_in_a_two_gib_cgroup_completes_with_defaults(tmp_path):
    if on_memory_fs(tmp_path):
        pytest.skip(f"{tmp_path} is on a memory file system: the auto disk tier needs a disk")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFCACHE_") and k != "LOCAL_WORLD_SIZE"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with memory_cgroup(2 * GiB) as procs:
        script = f'echo $$ > {procs} && exec "{sys.executable}" -c "$0"'
        out = subprocess.run(["sh", "-c", script, textwrap.dedent(PAYLOAD)], env=env, capture_output=True, text=True,
                             timeout=600)  # fmt: skip
    assert out.returncode == 0, f"rc {out.returncode} (-9: OOM-killed)\n{out.stdout}\n{out.stderr[-3000:]}"
    lines = dict((line + " ").split(" ", 1) for line in out.stdout.splitlines())
    host, pinned, disk = lines["limits"].strip().split(" ", 2)
    assert int(host) <= GiB // 2 and int(pinned) <= GiB // 2, lines  # of the cgroup's 2 GiB, not of RAM
    assert disk == str(tmp_path / "xdg" / "offcache")
    assert int(lines["stored"]) > GiB and "intact" in lines


PAYLOAD_NONE = """
import torch, offcache
from offcache import IntermediatesCache
n, size = 24, 128 << 20
cache = IntermediatesCache.empty(n, "cpu")
try:
    for i in range(n):
        cache.update(i, {"hidden": torch.full((size // 4,), float(i))})
except offcache.HostLimitError as exc:
    print("refused", i, str(exc).replace(chr(10), " "), flush=True)
for j in range(i):
    x = cache.fetch(j)["hidden"]
    assert bool((x == float(j)).all()), j
    del x
print("intact", flush=True)
"""


def test_with_no_disk_tier_a_two_gib_cgroup_gets_the_error_not_the_oom_killer(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFCACHE_") and k != "LOCAL_WORLD_SIZE"}
    env.update(OFFCACHE_DISK_DIR="none", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with memory_cgroup(2 * GiB) as procs:
        script = f'echo $$ > {procs} && exec "{sys.executable}" -c "$0"'
        out = subprocess.run(["sh", "-c", script, textwrap.dedent(PAYLOAD_NONE)], env=env, capture_output=True,
                             text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, f"rc {out.returncode} (-9: OOM-killed)\n{out.stdout}\n{out.stderr[-3000:]}"
    refused = [line for line in out.stdout.splitlines() if line.startswith("refused")]
    assert refused and "OFFCACHE_HOST_LIMIT" in refused[0] and "intact" in out.stdout
    assert 1 <= int(refused[0].split()[1]) <= 4  # a 512 MiB limit holds a few 128 MiB values


# Spares for a burst --------------------------------------------------------------------------------


def test_a_burst_reuses_the_chunks_of_the_burst_before(engine_config):
    """Stores whose results die while their copies are in flight leave their blocks to the copies, so
    a burst of them needs many blocks at once, which empty right after; on an H200 making (pinning)
    those chunks again on every burst held a 64 MiB store loop to 12.8 GB/s against 55 for a raw
    pinned copy. The burst's chunks now stay for a while, and the next burst reuses them. Made
    deterministic here: each burst holds its results until it ends (the depth of copies in flight
    depends on timing), then drops them all."""
    engine_config(backend="host", min_chunk="256KiB")
    src = torch.ones(MiB, dtype=torch.uint8)
    kept = _engine.store([src], torch.device("cpu"))  # something in use, as in a real run
    made, released = [], offcache.stats()["chunks_released"]
    for _ in range(4):
        before = offcache.stats()["chunks_made"]
        burst = []
        for i in range(6):
            src.fill_(i)  # a new version each time: no dedup hit
            burst += _engine.store([src], torch.device("cpu"))
        offcache.synchronize()
        made.append(offcache.stats()["chunks_made"] - before)
        assert [int(t[0]) for t in burst] == list(range(6))
        del burst  # the whole burst's blocks free at once
    # How many blocks a burst holds at once depends on its snapshot staging still in flight (timing),
    # so a later burst may need a chunk more; it never gives the first burst's back to make them again.
    assert made[0] >= 6, f"each value of the first burst needs a chunk of its own (made {made})"
    assert offcache.stats()["chunks_released"] == released, f"chunks released between bursts (made {made})"
    assert sum(made[1:]) < made[0], f"chunks made per burst {made}: later bursts should reuse the first's"
    assert torch.equal(kept[0], torch.ones(MiB, dtype=torch.uint8))
    assert offcache.empty_cache() >= 0 and offcache.stats()["pinned_reserved_bytes"] <= 2 * MiB
