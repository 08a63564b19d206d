"""The store contract (a snapshot taken at the call) and the wrong-result, crash, hang and
leak cases found by trying offcache as a user would. Host backend; GPU-only cases are in
tests/test_gpu_*.py."""

import gc
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch

import offcache
from offcache import IntermediatesCache
from offcache import engine as _engine
from offcache.engine import ops as _ops
from tests.helpers import CPU


@pytest.fixture
def slow_host(engine_config):
    """The host backend with slowed copies: every store is still draining when update() returns."""
    engine_config(backend="host", host_copy_delay_us=20000)


# The store contract --------------------------------------------------------------------


@pytest.mark.parametrize("delay_us", [0, 20000])
def test_a_store_of_cpu_memory_is_copied_by_the_calling_thread(engine_config, delay_us):
    # For a CPU producer the snapshot is already a copy by the calling thread: the store lands in its
    # block then (no staging, no copy stream, nothing in flight). The host backend slowed for tests
    # sends it through its D2H stream, as a GPU's store goes, so the suite runs that path too.
    engine_config(backend="host", host_copy_delay_us=delay_us)
    values = [torch.randn(8, 16), torch.ones(64, dtype=torch.bool), torch.arange(3 << 18)]  # packed, and 6 MiB
    expected = [v.clone() for v in values]
    before = _engine.stats()
    _engine.trace_start(CPU)
    stored = _engine.store(values, CPU)
    after = _engine.stats()
    for v in values:
        v.zero_()  # the snapshot was taken at the call, on either path
    for s in stored:
        _engine.wait_stored(s)  # a no-op for a store that landed inline
    _engine.synchronize()
    trace = _engine.trace_stop()
    assert all(torch.equal(s, e) for s, e in zip(stored, expected))
    # Either way the copies are in a trace as D2H batches (the timeline plot), one per block.
    rows = [r for r in trace if r["stream"] == "d2h"]
    assert len(rows) == 2, trace
    assert sum(r["bytes"] for r in rows) >= sum(v.numel() * v.element_size() for v in values)
    assert all(0 <= r["start_ms"] <= r["end_ms"] for r in rows), rows
    inline = after["inline_store_copies"] - before["inline_store_copies"]
    streamed = after["copy_calls"] - before["copy_calls"]
    assert after["d2h_copies"] - before["d2h_copies"] == 2  # one per block: the two small values share one
    if delay_us:
        assert (inline, after["snapshot_bytes"] > before["snapshot_bytes"]) == (0, True)
        assert streamed > 0
    else:
        assert (inline, streamed, after["in_flight_bytes"]) == (3, 0, 0)
        assert after["snapshot_bytes"] == before["snapshot_bytes"]  # no staging


def test_in_place_edit_right_after_update_never_tears_the_stored_value(slow_host):
    cache = IntermediatesCache.empty(1, "cpu")
    for _ in range(20):
        x = torch.zeros(1 << 20)
        cache.update(0, {"x": x})
        x.add_(1)  # the drain is still running
        assert torch.equal(cache.fetch(0)["x"], torch.zeros(1 << 20))


def test_edit_of_many_small_sources_after_store(slow_host):
    xs = [torch.full((100,), float(i)) for i in range(50)]
    stored = _engine.store(xs, CPU)
    for x in xs:
        x.mul_(-1)
    back, _ = _engine.fetch(stored, CPU, True)
    assert all(torch.equal(b, torch.full((100,), float(i))) for i, b in enumerate(back))


def test_source_edited_by_another_thread_right_after_store(slow_host):
    x = torch.zeros(1 << 18)
    (a,) = _engine.store([x], CPU)
    t = threading.Thread(target=lambda: x.fill_(5.0))
    t.start()
    t.join()
    _engine.wait_stored(a)
    assert torch.equal(a, torch.zeros(1 << 18))


def test_deepcopy_and_pickle_right_after_update_see_the_stored_values(slow_host):
    import copy

    cache = IntermediatesCache.empty(1, "cpu")
    x = torch.arange(1 << 16, dtype=torch.float32)
    for clone in (copy.deepcopy, lambda c: pickle.loads(pickle.dumps(c)), lambda c: _torch_save_load(c)):
        cache.update(0, {"x": x, "t": (x * 2, 3)})
        other = clone(cache)
        got = other.fetch(0)
        assert torch.equal(got["x"], x) and torch.equal(got["t"][0], x * 2) and got["t"][1] == 3


def _torch_save_load(value):
    import io

    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


# Wrong results ---------------------------------------------------------------------------


@pytest.mark.parametrize("view", ["conj", "neg", "conj_of_transpose"])
def test_conj_and_neg_views_are_resolved(host_engine, view):
    z = torch.randn(8, 6, dtype=torch.complex64)
    x = torch.randn(8, 6)
    value = {"conj": lambda: z.conj(), "neg": lambda: torch._neg_view(x), "conj_of_transpose": lambda: z.t().conj()}[
        view
    ]()
    want = value.resolve_conj().resolve_neg().clone()
    (stored,) = _engine.store([value], CPU)
    (back,), _ = _engine.fetch([stored], CPU, True)
    assert not back.is_conj() and not back.is_neg()
    assert torch.equal(back, want)
    cache = IntermediatesCache.empty(1, "cpu")
    cache.update(0, {"v": value})
    assert torch.equal(cache.fetch(0)["v"], want)


def test_view_of_a_value_still_being_stored_waits_for_the_store(slow_host):
    (s,) = _engine.store([torch.full((512, 512), 3.0)], CPU)
    (back,), _ = _engine.fetch([s.t()], CPU, True)  # made dense before the store finished, before the fix
    assert torch.equal(back, torch.full((512, 512), 3.0))
    (s2,) = _engine.store([torch.arange(4096.0).view(64, 64)], CPU)
    (back2,), _ = _engine.fetch([s2[::2, 1::3]], CPU, True)
    assert torch.equal(back2, torch.arange(4096.0).view(64, 64)[::2, 1::3])


def test_data_swap_is_not_served_from_the_dedup_table(host_engine):
    x = torch.zeros(4)
    (a,) = _engine.store([x], CPU)
    x.data = torch.ones(3, dtype=torch.float64)  # no version bump
    (b,) = _engine.store([x], CPU)
    _engine.wait_stored(b)
    assert b.dtype == torch.float64 and torch.equal(b, torch.ones(3, dtype=torch.float64))
    y = torch.zeros(6)
    (c,) = _engine.store([y], CPU)
    y.data = torch.full((6,), 2.0)  # same dtype and shape, new storage
    (d,) = _engine.store([y], CPU)
    _engine.wait_stored(d)
    assert torch.equal(d, torch.full((6,), 2.0)) and torch.equal(c, torch.zeros(6))


def test_channels_last_and_other_dense_layouts_keep_their_strides(host_engine):
    x = torch.randn(2, 3, 5, 7).to(memory_format=torch.channels_last)
    p = torch.randn(4, 5, 6).permute(2, 0, 1)  # dense, not contiguous
    cache = IntermediatesCache.empty(1, "cpu")
    cache.update(0, {"x": x, "p": p})
    got = cache.fetch(0)
    assert got["x"].stride() == x.stride() and torch.equal(got["x"], x)
    assert got["p"].stride() == p.stride() and torch.equal(got["p"], p)
    # Tensor.to() keeps strides too: the llm-compressor results are the same.
    assert got["x"].stride() == x.to("cpu", copy=True).stride()


def test_requires_grad_kept_on_zero_size_tensors_and_refreshed_in_dedup(host_engine):
    z = torch.empty(0, 3, requires_grad=True)
    (a,) = _engine.store([z], CPU)
    assert a.requires_grad and a.shape == (0, 3)
    (b,), _ = _engine.fetch([a], CPU, True)
    assert b.requires_grad
    x = torch.randn(5)
    (c,) = _engine.store([x], CPU)
    x.requires_grad_()
    (d,) = _engine.store([x], CPU)
    assert not c.requires_grad and d.requires_grad


def test_fetched_small_tensors_are_independent_storages(host_engine, tmp_path):
    cache = IntermediatesCache.empty(1, "cpu")
    cache.update(0, {f"t{i}": torch.full((16,), float(i)) for i in range(8)})
    before = offcache.stats()["copy_calls"]
    g = cache.fetch(0)
    assert offcache.stats()["copy_calls"] - before == 1  # still one copy of the span
    g["t0"].resize_(32).fill_(-1)
    assert torch.equal(g["t1"], torch.full((16,), 1.0))
    assert torch.equal(cache.fetch(0)["t1"], torch.full((16,), 1.0))
    assert g["t2"].untyped_storage().nbytes() == g["t2"].nbytes
    torch.save(g["t3"], tmp_path / "t3.pt")
    assert (tmp_path / "t3.pt").stat().st_size < 2000


def test_odd_offset_view_fetched_with_a_wider_dtype_from_the_same_block(host_engine):
    s8, f32 = _engine.store([torch.arange(100, dtype=torch.int8), torch.arange(10.0)], CPU)
    back, _ = _engine.fetch([s8[3:], f32, s8[7:9]], CPU, True)
    assert torch.equal(back[0], torch.arange(3, 100, dtype=torch.int8))
    assert torch.equal(back[1], torch.arange(10.0))
    assert torch.equal(back[2], torch.tensor([7, 8], dtype=torch.int8))


# Crashes and hangs -----------------------------------------------------------------------


def test_wrapper_subclass_without_storage_is_refused_by_the_engine(host_engine):
    from torch.testing._internal.two_tensor import TwoTensor

    t = TwoTensor(torch.randn(4), torch.randn(4))
    with pytest.raises(TypeError, match="subclass"):
        _engine.store([t], CPU)


def test_tensor_with_freed_storage_is_refused(host_engine):
    x = torch.randn(100)
    x.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="storage"):
        _engine.store([x], CPU)


def _forked_child_script(fetch_kind: str) -> str:
    return textwrap.dedent(
        f"""
        import os, sys, torch, offcache
        offcache.configure(backend="host", host_copy_delay_us=30000)
        cache = offcache.IntermediatesCache.empty(1, "cpu")
        x = torch.arange(5000.0)
        cache.update(0, {{"x": x}})  # the drain is in flight when we fork
        pid = os.fork()
        if pid == 0:
            if "{fetch_kind}" == "fetch":
                ok = torch.equal(cache.fetch(0)["x"], x)
            else:
                ok = torch.equal(cache.batch_intermediates[0]["x"].value, x)
            cache.update(0, {{"y": x * 2}})
            ok = ok and torch.equal(cache.fetch(0)["y"], x * 2)
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert torch.equal(cache.fetch(0)["x"], x)
        print("child", os.waitstatus_to_exitcode(status), flush=True)
        """
    )


@pytest.mark.parametrize("fetch_kind", ["fetch", "value"])
def test_fork_while_a_store_is_in_flight(tmp_path, fetch_kind):
    proc = subprocess.run(
        [sys.executable, "-c", _forked_child_script(fetch_kind)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "child 0" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_failed_enqueue_unwinds_after_the_queued_copies(slow_host):
    x = torch.full((4096,), 3.0)
    _ops._fail_next_copy()
    with pytest.raises(RuntimeError, match="injected copy failure"):
        _engine.store([x], CPU)
    s = offcache.stats()
    assert s["in_flight_bytes"] == 0
    offcache.synchronize()
    assert offcache.stats()["pinned_in_use_bytes"] == 0  # the block went back only after its copy
    (a,) = _engine.store([x], CPU)  # the engine still works
    (b,), _ = _engine.fetch([a], CPU, True)
    assert torch.equal(b, x)


# Leaks and unclear errors ----------------------------------------------------------------


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_configure_retires_old_engines(engine_config):
    # Engines retired by earlier tests may still serve tensors those tests keep: counted from here.
    gc.collect()
    engine_config(backend="host")
    base = offcache.stats()["retired_engines"]
    kept = []
    start_threads = _threads()
    for _ in range(30):
        offcache.configure(backend="host", min_chunk="1MiB")
        kept.append(_engine.store([torch.randn(1000)], CPU)[0])
    offcache.synchronize()
    s = offcache.stats()
    assert s["retired_engines"] >= base + 29 and s["retired_reserved_bytes"] >= 29 << 20
    assert all(k.numel() == 1000 for k in kept)
    kept.clear()  # the old engines' last blocks die: they stop their threads and go
    for _ in range(200):
        if offcache.stats()["retired_engines"] <= base and _threads() <= start_threads + 2:
            break
        threading.Event().wait(0.05)
    assert offcache.stats()["retired_engines"] <= base
    assert _threads() <= start_threads + 2


def test_configure_with_nothing_stored_drops_the_old_engine_at_once(engine_config):
    # Engines retired by earlier tests may still serve tensors those tests keep: counted from here.
    gc.collect()
    engine_config(backend="host")
    base = offcache.stats()["retired_engines"]
    before = _threads()
    for _ in range(10):
        offcache.configure(backend="host")
        offcache.stats()  # builds the new engine
    threading.Event().wait(0.2)
    assert offcache.stats()["retired_engines"] <= base
    assert _threads() <= before + 2


@pytest.mark.parametrize(
    "var, value, match",
    [
        ("OFFCACHE_HOST_COPY_DELAY_US", "abc", "OFFCACHE_HOST_COPY_DELAY_US"),
        ("OFFCACHE_PINNED_LIMIT", "lots", "OFFCACHE_PINNED_LIMIT"),
        ("OFFCACHE_PINNED_LIMIT", str(2**70), "OFFCACHE_PINNED_LIMIT.*2\\*\\*64"),
        ("OFFCACHE_CHUNK_BYTES", "0", "OFFCACHE_CHUNK_BYTES"),
        ("OFFCACHE_MAX_IN_FLIGHT", "12XB", "OFFCACHE_MAX_IN_FLIGHT"),
        ("OFFCACHE_BACKEND", "tpu", "OFFCACHE_BACKEND"),
        ("LOCAL_WORLD_SIZE", "abc", "LOCAL_WORLD_SIZE"),
    ],
)
def test_configuration_errors_name_the_variable(engine_config, monkeypatch, var, value, match):
    # engine_config first: its teardown (configure()) runs after monkeypatch restores the environment.
    monkeypatch.delenv("OFFCACHE_PINNED_LIMIT", raising=False)
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        offcache.configure()


@pytest.mark.parametrize(
    "bad, error",
    [(2**70, ValueError), (1.5, TypeError), (-1, ValueError), ("1.5 parsecs", ValueError), (True, TypeError)],
)
def test_set_pinned_limit_rejects_bad_values(host_engine, bad, error):
    with pytest.raises(error, match="set_pinned_limit"):
        offcache.set_pinned_limit(bad)


def test_spill_warning_points_at_the_caller(engine_config):
    engine_config(backend="host", pinned_limit="1MiB", min_chunk="256KiB")
    cache = IntermediatesCache.empty(2, "cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache.update(0, {"x": torch.randn(1 << 18)})
        cache.update(1, {"x": torch.randn(1 << 18)})
    spill = [w for w in caught if issubclass(w.category, offcache.SpillWarning)]
    assert len(spill) == 1 and spill[0].filename == __file__


def test_ticket_waits_through_the_engine_that_issued_it(engine_config):
    engine_config(backend="host", host_copy_delay_us=50000)
    (a,) = _engine.store([torch.arange(1000.0)], CPU)
    (back,), ticket = _engine.fetch([a], CPU, False)
    offcache.configure(backend="host")  # a new engine; the old one still copies
    ticket.wait()
    assert ticket.query() and torch.equal(back, torch.arange(1000.0))
