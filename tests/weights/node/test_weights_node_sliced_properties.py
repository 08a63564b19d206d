"""Property-based: the sliced onload (OFFCACHE_NODE_ONLOAD=sliced) beside compressed-tensors'
DistributedCPUCache, 2 ranks, gloo, host backend (tests/weights/node/weights_node_sliced_worker.py).

Random sequences of module offloads (tensors of random shapes, the empty and 0-dim ones included,
and dtypes: slices cut them anywhere), sliced prefetches of random sets of modules, writes by one
rank followed by a barrier, onloads and drops of every prefetched copy. Every onload must be
bit-identical to compressed-tensors' and make no collective; a prefetch must make 2 collectives
when it fetches anything (1, the agreement, when nothing is left to fetch) and issue every
byte of its modules (prefetched already or not: a write drops the writer's copy alone, and the
plan must be every rank's alike); each onload's hits must be the copies prefetched and not
written since.
"""

import math

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

pytest.importorskip("compressed_tensors")

from tests.weights.node.weights_node_sliced_worker import S  # noqa: E402
from tests.weights.node.weights_node_worker import Group  # noqa: E402

ITEMSIZE = {"float32": 4, "bfloat16": 2, "int8": 1, "float16": 2}
shapes = st.lists(st.integers(0, 13), min_size=0, max_size=3).map(tuple)
tensors = st.lists(st.tuples(shapes, st.sampled_from(sorted(ITEMSIZE))), min_size=1, max_size=4)


@pytest.fixture(scope="module")
def group():
    g = Group(2, setup="setup_node", timeout=120)
    assert g.call(S + "use_mode", "sliced") == [True, True]
    yield g
    g.close()


class SlicedMachine(RuleBasedStateMachine):
    group: Group
    count = 0

    def __init__(self):
        super().__init__()
        self.mods: dict[str, list] = {}  # mod -> [(shape, dtype)]
        self.ahead: list[set] = [set(), set()]  # per rank: (mod, name) prefetched, not taken
        self.stale: set = set()  # (mod, name) written since its prefetch on the reading rank
        self.target = 0
        self.group.call(S + "clear_prefetched")

    def nbytes(self, mod: str, name: str) -> int:
        shape, dtype = self.mods[mod][int(name[1:])]
        return math.prod(shape) * ITEMSIZE[dtype]

    @initialize(spec=tensors)
    def first(self, spec):
        self.offload(spec)

    @rule(spec=tensors)
    def offload(self, spec):
        SlicedMachine.count += 1
        mod = f"m{SlicedMachine.count}"
        self.group.call(S + "offload_pair", mod, [list(s) for s in spec])
        self.mods[mod] = spec

    @rule(data=st.data())
    def prefetch(self, data):
        mods = data.draw(st.lists(st.sampled_from(sorted(self.mods)), unique=True, max_size=3))
        self.target += 1
        # every tensor of the modules, prefetched already or not (the plan is every rank's alike)
        new = {(m, f"t{i}") for m in mods for i in range(len(self.mods[m]))}
        expected = sum(self.nbytes(m, n) for m, n in new)
        for r in self.group.call(S + "prefetch", mods, self.target):
            assert r["issued"] == expected, (r, expected)
            assert sum(r["collectives"].values()) == (2 if expected else 1), r
        for rank in range(2):
            self.ahead[rank] |= new
        self.stale -= new

    @rule(data=st.data(), writer=st.integers(0, 1), seed=st.integers(0, 1000))
    def write(self, data, writer, seed):
        mod = data.draw(st.sampled_from(sorted(self.mods)))
        name = f"t{data.draw(st.integers(0, len(self.mods[mod]) - 1))}"
        self.group.call(S + "write", mod, name, seed, writer)
        self.ahead[writer].discard((mod, name))  # the writer drops its own copy
        if (mod, name) in self.ahead[1 - writer] and self.nbytes(mod, name):
            self.stale.add((mod, name))  # the reader's copy is stale: its generation moved

    @rule(data=st.data())
    def onload(self, data):
        mod = data.draw(st.sampled_from(sorted(self.mods)))
        names = {f"t{i}" for i in range(len(self.mods[mod]))}
        self.group.call(S + "mark")
        for r in self.group.call(S + "onload", mod):
            assert r["collectives"] == {}, r
            for name, (ours, theirs) in r["values"].items():
                assert ours == theirs, (mod, name)
        for rank, d in enumerate(self.group.call(S + "since")):
            taken = {(mod, n) for n in names} & self.ahead[rank]
            hits = len(taken - self.stale)
            assert d.get("weight_prefetch_hits", 0) == hits, (rank, d, taken, self.stale)
            self.ahead[rank] -= taken
        self.stale -= {(mod, n) for n in names} - self.ahead[0] - self.ahead[1]

    @rule()
    def drop(self):
        self.group.call(S + "clear_prefetched")
        self.ahead = [set(), set()]
        self.stale = set()


def test_sliced_prefetches_match_compressed_tensors(group):
    SlicedMachine.group = group
    run = SlicedMachine.TestCase
    run.settings = settings(
        max_examples=10,
        stateful_step_count=12,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    run().runTest()
