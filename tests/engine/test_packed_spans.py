"""Packed fetches (issue 32 item 7): what one allocation shared by several outputs may retain, and
where each output starts in it. Bounds in docs/limits.md; counters in stats(): packed_spans,
packed_span_bytes and packed_output_bytes (the spans alive now and their live outputs' bytes)."""

import gc

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import offcache
from offcache import engine as _engine
from offcache.engine import loader as _loader
from tests.helpers import CPU

SPAN_FLOOR = 256 << 10  # a span may always reach this much (docs/limits.md)
SPAN_RATIO = 16  # beyond it, at most this many times its smallest output
SLACK = 4096
ALIGN = 64


def _span_bytes(t: torch.Tensor) -> int:
    return _loader._C.allocation_of(t).untyped_storage().nbytes()


def _spans(outputs):
    """Outputs grouped by the allocation they live in: {allocation's data_ptr: [outputs]}."""
    groups = {}
    for o in outputs:
        if o.numel():
            groups.setdefault(_loader._C.allocation_of(o).data_ptr(), []).append(o)
    return groups


def _assert_spans_dense(outputs):
    for outs in _spans(outputs).values():
        payload = sum(o.nbytes for o in outs)
        assert _span_bytes(outs[0]) <= 2 * payload + SLACK, (_span_bytes(outs[0]), payload)


def _assert_retention_bounded():
    s = offcache.stats()
    assert s["packed_span_bytes"] <= s["packed_spans"] * SPAN_FLOOR + SPAN_RATIO * s["packed_output_bytes"], s


def test_one_small_output_kept_retains_a_bounded_span(host_engine):
    # A 900 KiB value and a 16-byte one, stored together (one block) and fetched together: the
    # small output used to share the whole span, so keeping it kept 900 KiB alive.
    big, small = torch.randn(230_000), torch.arange(4.0)
    mid = [torch.randn(1000) for _ in range(8)]
    stored = _engine.store([big, small, *mid], CPU)
    back, _ = _engine.fetch(stored, CPU, True)
    assert torch.equal(back[1], small) and torch.equal(back[0], big)
    keep = back[1]
    del back
    gc.collect()
    assert _span_bytes(keep) <= max(SPAN_FLOOR, SPAN_RATIO * keep.nbytes), _span_bytes(keep)
    _assert_retention_bounded()
    assert offcache.stats()["packed_span_bytes"] < big.nbytes


def test_a_span_is_at_most_twice_its_values_plus_slack_when_a_value_is_fetched_twice(host_engine):
    # docs/limits.md promises a span of at most twice its values' bytes plus 4 KiB. A value
    # fetched several times counted once per copy in the packing, then all but one copy left the
    # span: a and b (200 KiB each) shared a 900 KiB span with a 500 KiB gap between them.
    a, gap, b = torch.randn(51_200), torch.randn(128_000), torch.randn(51_200)
    sa, _, sb = _engine.store([a, gap, b], CPU)
    back, _ = _engine.fetch([sa, sa, sa, sa, sb], CPU, True)
    assert all(torch.equal(o, w) for o, w in zip(back, [a, a, a, a, b]))
    _assert_spans_dense(back)


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int64,
           torch.complex64, torch.bool]  # fmt: skip


def _value(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_complex or dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float32 if not dtype.is_complex else dtype).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, (n,), generator=g, dtype=dtype)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    specs=st.lists(st.tuples(st.sampled_from(_DTYPES), st.integers(1, 5000), st.integers(0, 70), st.booleans()),
                   min_size=1, max_size=12),
    keep=st.lists(st.booleans(), min_size=24, max_size=24),
)  # fmt: skip
def test_packed_outputs_start_64_byte_aligned_and_are_independent(host_engine, specs, keep):
    # Views of stored values (a slice at any element) used to come back aligned only to their
    # element size inside the span: inductor clones inputs that are not 16-byte aligned.
    keys = ("packed_spans", "packed_span_bytes", "packed_output_bytes")
    start = [offcache.stats()[k] for k in keys]
    values = [_value(dtype, n, i) for i, (dtype, n, _, _) in enumerate(specs)]
    stored = _engine.store(values, CPU)
    wanted, want = [], []
    for s, v, (_, n, k, whole) in zip(stored, values, specs):
        k = min(k, n - 1)
        wanted.append(s[k:])
        want.append(v[k:])
        if whole:  # the value itself too: it overlaps its view
            wanted.append(s)
            want.append(v)
    back, _ = _engine.fetch(wanted, CPU, True)
    for o, w in zip(back, want):
        assert o.data_ptr() % ALIGN == 0, (o.dtype, o.numel(), o.data_ptr() % ALIGN)
        assert o.dtype == w.dtype and torch.equal(o, w)
    ranges = sorted((o.data_ptr(), o.data_ptr() + o.nbytes) for o in back)
    assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:]))  # no two share a byte
    assert len({o.untyped_storage().data_ptr() for o in back}) == len(back)
    _assert_spans_dense(back)  # the span promise, with its alignment padding
    # Whatever outputs stay alive, their spans retain a bounded multiple of them.
    kept = [o for o, k in zip(back, keep) if k]
    del back, o
    gc.collect()
    assert all(_span_bytes(k) <= max(SPAN_FLOOR, SPAN_RATIO * k.nbytes) for k in kept)
    _assert_retention_bounded()
    del kept
    gc.collect()
    assert [offcache.stats()[k] for k in keys] == start  # all gone with their outputs


def test_packed_span_counters_follow_the_outputs(host_engine):
    stored = _engine.store([torch.full((32,), float(i)) for i in range(100)], CPU)
    before = offcache.stats()
    back, _ = _engine.fetch(stored, CPU, True)
    s = offcache.stats()
    assert s["packed_spans"] - before["packed_spans"] == 1  # 100 outputs, one allocation
    assert s["packed_output_bytes"] - before["packed_output_bytes"] == 100 * 128
    assert s["packed_span_bytes"] - before["packed_span_bytes"] == _span_bytes(back[0])
    back[7].resize_(1000)  # grown: memory of its own, out of the span
    assert offcache.stats()["packed_output_bytes"] - before["packed_output_bytes"] == 99 * 128
    del back
    gc.collect()
    s = offcache.stats()
    assert (s["packed_spans"], s["packed_span_bytes"], s["packed_output_bytes"]) == (
        before["packed_spans"], before["packed_span_bytes"], before["packed_output_bytes"])  # fmt: skip
