"""Property-based: OffcacheCPUCache against compressed-tensors' own CPUCache as the model.

Random sequences of offload (new names, new shapes), onload, update (same shape, other
dtypes, broadcast), delete, reads under disable_onloading(), nested disable_offloading()
contexts and prefetches, applied to both caches; every read must agree in values, dtypes,
tensor types, and in whether a context hands out the same object again. Runs under the host
backend, the slowed 1 MiB budget (spills, wide race windows) and the forced disk tier.
On compressed-tensors 0.20 also its staging (``stage()``, ``is_staged``; pinned and not), and
edits through ``.data`` or numpy of offloaded tensors held from earlier reads, which bump no
version counter (a prefetched copy must not hide them).

Not driven: in-place edits of onloaded values. With the CPU as the onload device
compressed-tensors' CPUCache hands out the offloaded tensor itself, so such an edit changes
the offload; offcache hands out a copy, as CPUCache does for a GPU.
"""

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

pytest.importorskip("compressed_tensors")
pytest.importorskip("llmcompressor")

from compressed_tensors.offload import disable_offloading, disable_onloading  # noqa: E402
from compressed_tensors.offload.cache import CPUCache, OffloadCache  # noqa: E402

import offcache  # noqa: E402
from offcache.weights import compressed_tensors as oc_ct  # noqa: E402
from tests.conftest import ENGINE_CONFIGS  # noqa: E402

CPU = torch.device("cpu")
NAMES = ["weight", "bias", "scale", "zp"]
DTYPES = [torch.float32, torch.bfloat16, torch.int8]
SHAPES = [(3,), (4, 5), (64, 64), (2, 300)]
STAGING = hasattr(OffloadCache, "stage") and hasattr(OffloadCache, "is_staged")  # compressed-tensors 0.20


def make(shape, dtype, seed, like=torch.Tensor):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g) * 8).to(dtype)
    if like is torch.nn.Parameter:
        t = torch.nn.Parameter(t, requires_grad=False)
    return t


def same(a, b):
    assert (a is None) == (b is None)
    if a is None:
        return
    assert type(a) is type(b), (type(a), type(b))
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
    assert torch.equal(a, b)


class WeightsMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.model = CPUCache(CPU)
        self.ours = OffloadCache.cls_from_device("cpu")(CPU)
        assert type(self.ours) is oc_ct.OffcacheCPUCache
        self.contexts = []  # the open disable_offloading() contexts, innermost last
        self.depth = 0
        self.kept: dict[str, tuple] = {}  # name -> (model's, ours) onloaded in the open context
        self.held: list[tuple] = []  # (model's, ours) offloaded tensors read under disable_onloading()

    def teardown(self):
        while self.contexts:
            self.contexts.pop().__exit__(None, None, None)

    def _both(self, fn):
        return fn(self.model), fn(self.ours)

    @rule(
        name=st.sampled_from(NAMES),
        shape=st.sampled_from(SHAPES),
        dtype=st.sampled_from(DTYPES),
        seed=st.integers(0, 999),
        param=st.booleans(),
        edit_source=st.booleans(),
    )
    def offload(self, name, shape, dtype, seed, param, edit_source):
        source = make(shape, dtype, seed, torch.nn.Parameter if param else torch.Tensor)
        twin = source.detach().clone()
        if param:
            twin = torch.nn.Parameter(twin, requires_grad=False)
        self.model[name] = twin  # CPUCache keeps a CPU source itself: give it its own
        self.ours[name] = source
        if edit_source:
            with torch.no_grad():
                source.add_(1)  # offcache's offload is a snapshot: an edit after it is not seen
        self.kept.pop(name, None)

    @precondition(lambda self: len(self.model))
    @rule(data=st.data())
    def onload(self, data):
        name = data.draw(st.sampled_from(sorted(self.model.offloaded_values)))
        a, b = self.model[name], self.ours[name]
        same(a, b)
        if self.depth:
            if name in self.kept:
                ka, kb = self.kept[name]
                assert (a is ka) == (b is kb), "a context hands out its onloaded value again"
            self.kept[name] = (a, b)

    @precondition(lambda self: len(self.model))
    @rule(data=st.data(), seed=st.integers(0, 999), dtype=st.sampled_from([None, torch.float64]))
    def update(self, data, seed, dtype):
        name = data.draw(st.sampled_from(sorted(self.model.offloaded_values)))
        with disable_onloading():
            like = self.model[name]
        new = make(like.shape, dtype or like.dtype, seed)
        self.model[name] = new.clone()
        self.ours[name] = new
        new.zero_()  # the caller reuses its tensor at once: the write-back read its own copy

    @precondition(lambda self: len(self.model) and not self.depth)
    @rule(data=st.data(), value=st.integers(-3, 3))
    def update_broadcast(self, data, value):
        # update_offload alone (not __setitem__), outside a context for the reason edit_offloaded is.
        name = data.draw(st.sampled_from(sorted(self.model.offloaded_values)))
        fill = torch.tensor(float(value))
        self.model.update_offload(self.model.offloaded_values[name], fill)
        self.ours.update_offload(self.ours.offloaded_values[name], fill)

    @precondition(lambda self: len(self.model) and not self.depth)
    @rule(data=st.data())
    def edit_offloaded(self, data):
        # In place, on the host, after offload (and maybe after a prefetch of it). Outside a
        # context: in one, CPUCache's onloaded value on the CPU is the offloaded tensor itself.
        name = data.draw(st.sampled_from(sorted(self.model.offloaded_values)))
        with disable_onloading(), torch.no_grad():
            for cache in (self.model, self.ours):
                t = cache[name]
                t.copy_(t.flip(0) if t.dtype != torch.bool else ~t)

    @precondition(lambda self: len(self.model))
    @rule(data=st.data())
    def delete(self, data):
        name = data.draw(st.sampled_from(sorted(self.model.offloaded_values)))
        del self.model[name]
        del self.ours[name]
        self.kept.pop(name, None)

    @precondition(lambda self: len(self.model))
    @rule(data=st.data())
    def read_offloaded(self, data):
        name = data.draw(st.sampled_from(sorted(self.model.offloaded_values)))
        with disable_onloading():
            a, b = self.model[name], self.ours[name]
        assert b.device == CPU
        same(a, b)
        self.held.append((a, b))

    @precondition(lambda self: self.held and not self.depth)
    @rule(data=st.data(), seed=st.integers(0, 999), numpy=st.booleans())
    def edit_held(self, data, seed, numpy):
        # Through .data or numpy, on tensors read earlier (maybe prefetched since): no version
        # counter moves. Outside a context, for the reason edit_offloaded is.
        a, b = data.draw(st.sampled_from(self.held))
        new = make(a.shape, a.dtype, seed)
        for t in (a, b):
            if numpy and t.dtype != torch.bfloat16:
                t.detach().numpy()[...] = new.numpy()
            else:
                t.data.copy_(new)

    @precondition(lambda self: STAGING and not self.depth)
    @rule(pin=st.booleans())
    def stage(self, pin):
        # compressed-tensors 0.20's stage_module_offload, on both caches: the next onloads hand
        # out the staged tensors. (Outside a context: a staged copy is a new offloaded tensor.)
        for cache in (self.model, self.ours):
            cache.offloaded_values = {n: cache.stage(t, pin_memory=pin) for n, t in cache.offloaded_values.items()}
            cache.is_staged = True
        self.held.clear()  # a pinned copy is a new tensor: references from before are not the offload

    @precondition(lambda self: self.depth < 2)
    @rule()
    def enter_context(self):
        cm = disable_offloading()
        cm.__enter__()
        self.contexts.append(cm)
        self.depth += 1

    @precondition(lambda self: self.depth > 0)
    @rule()
    def exit_context(self):
        self.contexts.pop().__exit__(None, None, None)  # the innermost
        self.depth -= 1
        if self.depth == 0:
            self.kept.clear()

    @rule(subgraph=st.integers(0, 3), land=st.booleans())
    def prefetch(self, subgraph, land):
        module = type("M", (), {"_parameters": self.ours, "_buffers": {}})()
        oc_ct.prefetch([module], target=subgraph)
        if land:  # the copies done: an edit after this one would leave them stale
            offcache.synchronize()

    @invariant()
    def same_names_and_offloads(self):
        assert sorted(self.model) == sorted(self.ours)
        assert OffloadCache.offloading_disabled == (self.depth > 0)
        with disable_onloading():
            for name in self.model:
                same(self.model[name], self.ours[name])


@pytest.mark.parametrize("config", ["host", "host-1MiB-slow", "host-disk"])
def test_weights_state_machine(engine_config, config):
    engine_config(**ENGINE_CONFIGS[config])
    oc_ct.patch()
    try:
        runner = type("WeightsMachine", (WeightsMachine,), {}).TestCase
        runner.settings = settings(
            max_examples=40 if config == "host" else 15,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        runner().runTest()
    finally:
        oc_ct.unpatch()
        OffloadCache.keep_onloaded_values.clear()
