"""Property-based: random operation sequences against a dict model of the cache.

Runs under every engine configuration of tests/conftest.py (the `engine`
fixture): the default backend, the host backend, and the host backend with a
1 MiB pinned budget and slowed copies (spill and race windows). All must agree
with the model.
"""

import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import offcache
from offcache import IntermediatesCache
from tests.helpers import Frozen, Pair, assert_same, snapshot

NAMES = ["h", "mask", "pos", "emb", "out"]
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


def value_strategy(pool_size):
    tensor_ref = st.one_of(
        st.integers(0, pool_size - 1).map(lambda i: ("pool", i)),
        st.tuples(st.sampled_from(DTYPES), st.integers(0, 2000), st.integers(0, 2**16)).map(lambda t: ("new",) + t),
    )
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
        return tuple(self.build(s) for s in rest[0])

    def values(self, specs):
        return {name: self.build(spec) for name, spec in specs.items()}

    @rule(specs=st.dictionaries(st.sampled_from(NAMES), value_strategy(4), max_size=4))
    def append(self, specs):
        values = self.values(specs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", offcache.SpillWarning)
            self.cache.append(values)
        self.model.append({k: snapshot(v) for k, v in values.items()})

    @precondition(lambda self: len(self.model) > 0)
    @rule(data=st.data(), specs=st.dictionaries(st.sampled_from(NAMES), value_strategy(4), max_size=3))
    def update(self, data, specs):
        i = data.draw(st.integers(0, len(self.model) - 1))
        values = self.values(specs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", offcache.SpillWarning)
            self.cache.update(i, values)
        self.model[i].update({k: snapshot(v) for k, v in values.items()})

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
        assert_same(self.cache.fetch(i, names), want)

    @rule(prefetch=st.booleans(), names=st.one_of(st.none(), st.lists(st.sampled_from(NAMES), max_size=3)))
    def iterate(self, prefetch, names):
        it = self.cache.iter_prefetch(names) if prefetch else self.cache.iter(names)
        got = list(it)
        assert len(got) == len(self.model)
        for g, m in zip(got, self.model):
            assert_same(g, {k: v for k, v in m.items() if names is None or k in names})

    @rule(i=st.integers(0, 3), delta=st.integers(1, 5))
    def edit_pool_tensor_in_place(self, i, delta):
        # The contract: a source is edited only once its store has completed
        # (tests/test_engine.py checks that violations are reported). The dedup
        # table must then copy it again rather than serve the old copy.
        offcache.synchronize()
        t = self.pool[i]
        if t.dtype == torch.bool:
            t.logical_not_()
        else:
            t.add_(delta)

    @invariant()
    def length_matches(self):
        if hasattr(self, "cache"):
            assert len(self.cache) == len(self.model)

    def teardown(self):
        if hasattr(self, "cache"):
            del self.cache
            offcache.synchronize()


def test_cache_agrees_with_dict_model(engine):
    machine = type("Machine", (CacheMachine,), {"config": engine})
    runner = machine.TestCase
    runner.settings = settings(
        max_examples=40,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    runner().runTest()
