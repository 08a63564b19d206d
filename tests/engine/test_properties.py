"""Property-based: random operation sequences against a dict model of the cache.

Runs under every engine configuration of tests/conftest.py (the `engine`
fixture): the default backend, the host backend, and the host backend with a
1 MiB pinned budget and slowed copies (spill and race windows). All must agree
with the model.

CacheMachine: stores, fetches, deletes, prefetching iteration, in-place edits of
sources once their stores completed and of fetched tensors, and copies of the
whole cache (deepcopy, pickle) that then carry on as the cache.
SnapshotMachine adds what the engine rewrite promises: a store is a snapshot
taken at the call (sources edited or given new data right after update()),
conj/neg views and channels_last tensors (strides kept).
"""

import copy
import pickle
import warnings
from dataclasses import fields, is_dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import offcache
from offcache import IntermediatesCache
from tests.helpers import Frozen, Pair, assert_same, snapshot

NAMES = ["h", "mask", "pos", "emb", "out"]
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]
VIEWS = ["conj", "neg", "channels_last"]


def value_strategy(pool_size, views=False):
    refs = [
        st.integers(0, pool_size - 1).map(lambda i: ("pool", i)),
        st.tuples(st.sampled_from(DTYPES), st.integers(0, 2000), st.integers(0, 2**16)).map(lambda t: ("new",) + t),
    ]
    if views:
        refs.append(
            st.tuples(st.sampled_from(VIEWS), st.integers(0, 600), st.integers(0, 2**16)).map(lambda t: ("view",) + t)
        )
    tensor_ref = st.one_of(*refs)
    leaf = st.one_of(tensor_ref, st.sampled_from([None, 3, 0.5, "s", torch.float16]).map(lambda v: ("leaf", v)))
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.tuples(inner, inner).map(lambda t: ("pair", t)),
            st.lists(inner, max_size=3).map(lambda t: ("list", t)),
            st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2).map(lambda t: ("dict", t)),
            inner.map(lambda t: ("frozen", t)),
            st.lists(inner, min_size=1, max_size=3).map(lambda t: ("tuple", t)),
        ),
        max_leaves=5,
    )


def make_tensor(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, (n,), generator=g)
    return torch.randn(n, generator=g).to(dtype)


def make_view(kind, n, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "conj":
        return torch.randn(n, dtype=torch.complex64, generator=g).conj()
    if kind == "neg":
        return torch._neg_view(torch.randn(n, generator=g))
    return torch.randn(2, n % 5 + 1, 3, 4, generator=g).to(memory_format=torch.channels_last)


def tensors_in(value, unique=True):
    """Every tensor in a nested value, in order; each once if `unique`."""
    found = []

    def visit(v):
        if isinstance(v, torch.Tensor):
            if not (unique and any(t is v for t in found)):
                found.append(v)
        elif is_dataclass(v) and not isinstance(v, type):
            for f in fields(v):
                visit(getattr(v, f.name))
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)
        elif isinstance(v, dict):
            for x in v.values():
                visit(x)

    visit(value)
    return found


def assert_same_strides(got, want):
    """Fetched tensors keep the strides of what was stored (only dense tensors are generated).

    The stride of a dimension of size 0 or 1 is never used, so it is not compared.
    """

    def strides(t):
        return [s for n, s in zip(t.shape, t.stride()) if n > 1]

    g, w = tensors_in(got, unique=False), tensors_in(want, unique=False)
    assert [strides(t) for t in g] == [strides(t) for t in w]


def edit_in_place(t, delta):
    if t.dtype == torch.bool:
        t.logical_not_()
    else:
        t.add_(delta)


class CacheMachine(RuleBasedStateMachine):
    config: dict = {}

    @initialize(num=st.integers(0, 3))
    def setup(self, num):
        offcache.configure(**self.config)
        self.cache = IntermediatesCache.empty(num, "cpu")
        self.model = [{} for _ in range(num)]
        # Tensors shared between names and batches, sometimes edited in place.
        self.pool = [make_tensor(DTYPES[i % 4], 64 * (i + 1), i) for i in range(4)]

    def build(self, spec):
        kind, *rest = spec
        if kind == "pool":
            return self.pool[rest[0]]
        if kind == "new":
            return make_tensor(*rest)
        if kind == "leaf":
            return rest[0]
        if kind == "pair":
            return Pair(self.build(rest[0][0]), self.build(rest[0][1]))
        if kind == "list":
            return [self.build(s) for s in rest[0]]
        if kind == "dict":
            return {k: self.build(s) for k, s in rest[0].items()}
        if kind == "frozen":
            return Frozen(self.build(rest[0]))
        if kind == "view":
            return make_view(*rest)
        return tuple(self.build(s) for s in rest[0])

    def values(self, specs):
        return {name: self.build(spec) for name, spec in specs.items()}

    def check(self, got, want):
        assert_same(got, want)
        assert_same_strides(got, want)

    def do_append(self, specs):
        values = self.values(specs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", offcache.SpillWarning)
            self.cache.append(values)
        self.model.append({k: snapshot(v) for k, v in values.items()})
        return values

    def do_update(self, i, specs):
        values = self.values(specs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", offcache.SpillWarning)
            self.cache.update(i, values)
        self.model[i].update({k: snapshot(v) for k, v in values.items()})
        return values

    @rule(specs=st.dictionaries(st.sampled_from(NAMES), value_strategy(4), max_size=4))
    def append(self, specs):
        self.do_append(specs)

    @precondition(lambda self: len(self.model) > 0)
    @rule(data=st.data(), specs=st.dictionaries(st.sampled_from(NAMES), value_strategy(4), max_size=3))
    def update(self, data, specs):
        self.do_update(data.draw(st.integers(0, len(self.model) - 1)), specs)

    @precondition(lambda self: len(self.model) > 0)
    @rule(data=st.data())
    def delete(self, data):
        i = data.draw(st.integers(0, len(self.model) - 1))
        names = data.draw(st.one_of(st.none(), st.lists(st.sampled_from(NAMES), unique=True, max_size=3)))
        missing = names is not None and any(n not in self.model[i] for n in names)
        if missing:
            with pytest.raises(KeyError):
                self.cache.delete(i, names)
            # llm-compressor deletes names in order until the missing one
            for n in names:
                if n not in self.model[i]:
                    break
                del self.model[i][n]
            return
        self.cache.delete(i, names)
        if names is None:
            self.model[i].clear()
        else:
            for n in names:
                del self.model[i][n]

    @precondition(lambda self: len(self.model) > 0)
    @rule(data=st.data())
    def fetch(self, data):
        i = data.draw(st.integers(0, len(self.model) - 1))
        names = data.draw(st.one_of(st.none(), st.lists(st.sampled_from(NAMES + ["zz"]), max_size=4)))
        want = {k: v for k, v in self.model[i].items() if names is None or k in names}
        self.check(self.cache.fetch(i, names), want)

    @rule(prefetch=st.booleans(), names=st.one_of(st.none(), st.lists(st.sampled_from(NAMES), max_size=3)))
    def iterate(self, prefetch, names):
        it = self.cache.iter_prefetch(names) if prefetch else self.cache.iter(names)
        got = list(it)
        assert len(got) == len(self.model)
        for g, m in zip(got, self.model):
            self.check(g, {k: v for k, v in m.items() if names is None or k in names})

    @rule(i=st.integers(0, 3), delta=st.integers(1, 5))
    def edit_pool_tensor_in_place(self, i, delta):
        # After synchronize(), which today's engine needs (SnapshotMachine edits
        # without it). The dedup table must copy the source again rather than
        # serve the old copy.
        offcache.synchronize()
        edit_in_place(self.pool[i], delta)

    @precondition(lambda self: len(self.model) > 0)
    @rule(data=st.data(), delta=st.integers(1, 5))
    def edit_fetched_in_place(self, data, delta):
        # Fetched tensors are the consumer's: editing them must not change the cache.
        i = data.draw(st.integers(0, len(self.model) - 1))
        for t in tensors_in(self.cache.fetch(i)):
            edit_in_place(t, delta)
        self.check(self.cache.fetch(i), self.model[i])

    @rule(how=st.sampled_from(["deepcopy", "pickle"]), carry_on_with_copy=st.booleans())
    def copy_cache(self, how, carry_on_with_copy):
        # Often right after an update, while its stores are still in flight.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", offcache.SpillWarning)
            dup = copy.deepcopy(self.cache) if how == "deepcopy" else pickle.loads(pickle.dumps(self.cache))
        assert len(dup) == len(self.model)
        for i, m in enumerate(self.model):
            self.check(dup.fetch(i), m)
        if carry_on_with_copy:  # later rules run on the copy; the original is dropped
            self.cache = dup

    @invariant()
    def length_matches(self):
        if hasattr(self, "cache"):
            assert len(self.cache) == len(self.model)

    def teardown(self):
        if hasattr(self, "cache"):
            del self.cache
            offcache.synchronize()


class SnapshotMachine(CacheMachine):
    """The engine rewrite's contract: update() stores what its values hold at the call."""

    @rule(specs=st.dictionaries(st.sampled_from(NAMES), value_strategy(4, views=True), max_size=4))
    def append_views(self, specs):
        self.do_append(specs)

    @precondition(lambda self: len(self.model) > 0)
    @rule(
        data=st.data(),
        specs=st.dictionaries(st.sampled_from(NAMES), value_strategy(4, views=True), min_size=1, max_size=3),
        delta=st.integers(1, 5),
    )
    def edit_sources_right_after_update(self, data, specs, delta):
        # No synchronize(): the model holds the values as they were at the call.
        values = self.do_update(data.draw(st.integers(0, len(self.model) - 1)), specs)
        for t in tensors_in(values):
            edit_in_place(t, delta)

    @rule(i=st.integers(0, 3), dtype=st.sampled_from(DTYPES), n=st.integers(0, 300), seed=st.integers(0, 2**16))
    def swap_pool_data(self, i, dtype, n, seed):
        # Same tensor object and version counter, new storage (and maybe dtype and shape).
        self.pool[i].data = make_tensor(dtype, n, seed)


def run_machine(machine_cls, engine):
    machine = type(machine_cls.__name__, (machine_cls,), {"config": engine})
    runner = machine.TestCase
    runner.settings = settings(
        max_examples=40,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    runner().runTest()


def test_cache_agrees_with_dict_model(engine):
    run_machine(CacheMachine, engine)


def test_stores_are_snapshots_under_the_dict_model(engine):
    run_machine(SnapshotMachine, engine)


# Every fetched output is a storage of its own, whatever dedup and packing did. One stored copy
# serves a tensor stored under two names (dedup); small values move as one span and come out
# inside one allocation (packing): two places of one stored copy once came out at the same
# address of the span, so an edit of one changed the other.
SIZES = [16, 1000, (1 << 18) + 16]  # float32 elements: 64 B, 4 KB (packed), just past the 1 MiB threshold
nested_ref = st.recursive(
    st.integers(0, 3),
    lambda inner: st.one_of(
        st.lists(inner, min_size=1, max_size=3).map(tuple),
        st.lists(inner, min_size=1, max_size=3),
        st.dictionaries(st.sampled_from(["a", "b"]), inner, min_size=1, max_size=2),
    ),
    max_leaves=6,
)


def _build_refs(spec, pool):
    if isinstance(spec, int):
        return pool[spec]
    if isinstance(spec, dict):
        return {k: _build_refs(v, pool) for k, v in spec.items()}
    return type(spec)(_build_refs(v, pool) for v in spec)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.sampled_from(SIZES), min_size=4, max_size=4),
    specs=st.dictionaries(st.sampled_from(NAMES), nested_ref, min_size=1, max_size=4),
    views=st.booleans(),
)
def test_every_fetched_output_is_independent(engine, sizes, specs, views):
    pool = [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(sizes)]
    if views:  # views of one base too: overlapping bytes in the same stored block
        pool[1] = pool[0][: max(1, pool[0].numel() // 2)]
    cache = IntermediatesCache.empty(1, "cpu")
    values = {name: _build_refs(spec, pool) for name, spec in specs.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", offcache.SpillWarning)
        cache.update(0, values)
    got = cache.fetch(0)
    leaves = tensors_in(got, unique=False)
    want = [t.clone() for t in tensors_in(values, unique=False)]
    assert len(leaves) == len(want)
    for k, leaf in enumerate(leaves):
        leaf.add_(k + 1)  # an edit of one output ...
        want[k] += k + 1
        for j, other in enumerate(leaves):  # ... shows in that output only
            assert torch.equal(other, want[j]), f"editing output {k} changed output {j} ({len(leaves)} outputs)"
    assert_same(cache.fetch(0), values)  # and never in the cache
