"""Property-based: offcache's NodeSharedCPUCache beside compressed-tensors' DistributedCPUCache,
under a real gloo group of 2 processes (tests/weights/node/weights_node_worker.py).

Random sequences of batch offloads (from_mapping; the other rank holding meta tensors or real
ones, parameters and plain tensors), assignments on every rank (new names, new shapes: collective
offloads), updates by one rank followed by a barrier, deletes, assignments and reads under
disable_onloading(), and reads inside disable_offloading(), applied to both classes on both
ranks. Every read must agree between the classes (values, dtypes, tensor types, whether a
context hands out the same object again: not outside disable_offloading(), where offcache's onload
to the CPU is a copy and compressed-tensors' hands out the offloaded tensor itself), and offcache's
must agree between the ranks, with the values the test expects.

Tied weights are not drawn here: compressed-tensors 0.19's class maps the shared file once per name on
the other ranks, so there a tied pair are two tensors and an update through one is not seen
through the other (test_weights_node.py checks offcache's tie on every rank).
"""

import hashlib

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

pytest.importorskip("compressed_tensors")

from tests.weights.node.weights_node_worker import Group, make  # noqa: E402

NAMES = ["weight", "bias", "scale"]
DTYPES = ["float32", "bfloat16", "int8"]
SHAPES = [(3,), (4, 5), (2, 300)]
MODS = ["a", "b"]


@pytest.fixture(scope="module")
def group():
    g = Group(2, setup="setup_node")
    yield g
    g.close()


def digest(shape, dtype, seed):
    t = make(shape, dtype, seed)
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class NodeMachine(RuleBasedStateMachine):
    group: Group

    def __init__(self):
        super().__init__()
        self.expected: dict[str, dict[str, tuple]] = {}  # mod -> name -> (shape, dtype, digest, shared)
        self.group.call("reset")

    @initialize(mod=st.sampled_from(MODS), meta=st.booleans(), data=st.data())
    def first(self, mod, meta, data):
        self.offload(mod, meta, data)

    @rule(mod=st.sampled_from(MODS), meta=st.booleans(), data=st.data())
    def offload(self, mod, meta, data):
        names = data.draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
        spec = []
        for name in names:
            shape, dtype = data.draw(st.sampled_from(SHAPES)), data.draw(st.sampled_from(DTYPES))
            spec.append((name, shape, dtype, data.draw(st.integers(0, 99)), data.draw(st.booleans()), None))
        self.group.call("offload", mod, spec, meta)
        self.expected[mod] = {n: (tuple(s), d, digest(s, d, seed), True) for n, s, d, seed, _, _ in spec}

    @rule(data=st.data())
    def assign_everywhere(self, data):
        if not self.expected:
            return
        mod = data.draw(st.sampled_from(sorted(self.expected)))
        name = data.draw(st.sampled_from(NAMES))
        shape, dtype = data.draw(st.sampled_from(SHAPES)), data.draw(st.sampled_from(DTYPES))
        seed = data.draw(st.integers(0, 99))
        old = self.expected[mod].get(name)
        self.group.call("set_all", mod, name, shape, dtype, seed, data.draw(st.booleans()))
        if old is not None and old[0] == tuple(shape):
            # same shape: an update, cast to the offloaded dtype (as Tensor.copy_)
            t = make(shape, dtype, seed).to(getattr(torch, old[1]))
            new = hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            self.expected[mod][name] = (old[0], old[1], new, old[3])
        else:
            self.expected[mod][name] = (tuple(shape), dtype, digest(shape, dtype, seed), True)

    @rule(data=st.data(), writer=st.sampled_from([0, 1]), seed=st.integers(0, 99))
    def update_by_one_rank(self, data, writer, seed):
        if not self.expected:
            return
        mod = data.draw(st.sampled_from(sorted(self.expected)))
        if not self.expected[mod]:
            return
        name = data.draw(st.sampled_from(sorted(self.expected[mod])))
        shape, dtype, _, shared = self.expected[mod][name]
        self.group.call("update_one", mod, name, seed, writer)
        if shared:  # a local tensor (assigned under disable_onloading) is not shared: checked per class only
            self.expected[mod][name] = (shape, dtype, digest(shape, dtype, seed), shared)
        else:
            self.expected[mod][name] = (shape, dtype, None, shared)

    @rule(data=st.data(), source=st.sampled_from([0, 1]))
    def recouple(self, data, source):
        """replace_module_parallel's last step: `source` (either rank) holds the module, the other
        rank meta tensors; every value is offloaded again from `source`."""
        if not self.expected:
            return
        mod = data.draw(st.sampled_from(sorted(self.expected)))
        self.group.call("recouple", mod, source)
        for name, (shape, dtype, want, shared) in self.expected[mod].items():
            # a local value (assigned under disable_onloading) is the source rank's now, everywhere
            self.expected[mod][name] = (shape, dtype, want if shared else None, True)

    @rule(data=st.data())
    def delete(self, data):
        if not self.expected:
            return
        mod = data.draw(st.sampled_from(sorted(self.expected)))
        if not self.expected[mod]:
            return
        name = data.draw(st.sampled_from(sorted(self.expected[mod])))
        self.group.call("delete", mod, name)
        del self.expected[mod][name]

    @rule(data=st.data())
    def assign_with_onloading_disabled(self, data):
        if not self.expected:
            return
        mod = data.draw(st.sampled_from(sorted(self.expected)))
        name = data.draw(st.sampled_from(NAMES))
        shape, dtype = data.draw(st.sampled_from(SHAPES)), data.draw(st.sampled_from(DTYPES))
        seed = data.draw(st.integers(0, 99))
        self.group.call("set_disabled", mod, name, shape, dtype, seed)
        self.expected[mod][name] = (tuple(shape), dtype, digest(shape, dtype, seed), False)

    @rule(data=st.data(), onloading=st.booleans(), offloading=st.booleans())
    def read(self, data, onloading, offloading):
        if not self.expected:
            return
        mod = data.draw(st.sampled_from(sorted(self.expected)))
        per_rank = self.group.call("snapshot", mod, onloading, offloading)
        for rank, (ours, theirs) in enumerate(per_rank):
            if onloading and not offloading:
                # An onload to the CPU is a copy (an engine fetch); compressed-tensors' class hands out
                # the offloaded tensor itself there, the same object every time: values only.
                ours, theirs = ours[:1], theirs[:1]
            assert ours == theirs, (rank, ours, theirs)
            values = ours[0]
            assert sorted(values) == sorted(self.expected[mod]), (values, self.expected[mod])
            for name, (shape, dtype, want, _) in self.expected[mod].items():
                _, got_dtype, got_shape, got = values[name]
                assert (got_shape, got_dtype) == (shape, f"torch.{dtype}"), (name, values[name])
                if want is not None:
                    assert got == want, (rank, name)
        assert per_rank[0][0][0] == per_rank[1][0][0] or any(
            not shared for shape, dtype, want, shared in self.expected[mod].values()
        )


def test_node_shared_matches_compressed_tensors(group):
    NodeMachine.group = group
    run = NodeMachine.TestCase
    run.settings = settings(
        max_examples=8,
        stateful_step_count=12,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    run().runTest()
