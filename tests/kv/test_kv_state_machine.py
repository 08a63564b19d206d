"""The KV caches against transformers' own, by construction: hypothesis state machines.

One machine drives both offcache caches side by side with their references on a tiny model:
``OffloadedKVCache`` with ``DynamicCache``, ``OffloadedStaticKVCache`` with ``StaticCache``.
Rules: forward steps of random lengths (the dynamic layers' buffers grow every few steps, or
never, by the drawn alignment; prefetches one to three layers ahead), reads and in-place edits
(tensor, ``.data``, numpy) of any layer's keys / values, references to them held across later
steps and edited then (DynamicCache's are stale after the next update, StaticCache's
persistent), updates that fail at the engine (HostLimitError: the layer is left as it was, the
reference not updated), ``reorder_cache``, ``crop``, ``batch_select_indices``,
``batch_repeat_interleave``, ``deepcopy`` / pickling, ``reset``. Every step's logits equal the
reference's; every layer's K/V are compared by a rule and at the end (a rule, not an invariant:
reading K/V drops a layer's prefetch, and the prefetch carried from one step to the next must be
exercised too). Models: Llama (full attention), Mistral (every layer sliding, offloaded too),
Gemma3 (alternating sliding / full), Gemma4 (KV sharing). Engines: the default one and the host
backend with slowed copies and a 1 MiB arena.

Where the installed transformers lacks an operation on a reference layer (static layers had no
crop / batch operations before 5.24; 5.17's DynamicLayer.reset keeps the length), the reference
gets the plain semantics: what ``StaticLayer`` would do, and a fresh ``DynamicCache`` for reset.

The compiled path (inductor on the CPU) has its own, smaller machine.
"""

from __future__ import annotations

import copy
import functools
import os
import pickle
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import offcache
from offcache import engine as _engine
from offcache.bench.models import causal_lm
from offcache.kv import dynamic_layers
from offcache.kv.dynamic import OffloadedKVCache
from offcache.kv.layer import OffloadedLayerBase
from offcache.kv.resident import resident_op
from offcache.kv.static import OffloadedStaticKVCache
from tests.kv.kv_models import edit_in_place, kw, tiny_causal_lm

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import DynamicCache, DynamicLayer, StaticCache  # noqa: E402

WINDOW = 8
MAX_LEN = 20  # the static caches' max_cache_len
KINDS = ["llama", "mistral", "gemma3", "gemma4"]
SLIDING = {"mistral", "gemma3", "gemma4"}
HOW = ["tensor", "data", "numpy"]  # how an in-place edit reaches a layer's K/V
FACTORS = [0.5, -1.0, 2.0]  # exact in every dtype


@functools.cache
def model_of(kind: str):
    if kind in ("llama", "mistral"):
        return causal_lm(kind, **({"sliding_window": WINDOW} if kind == "mistral" else {}))
    return tiny_causal_lm(kind, sliding_window=WINDOW)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float reassociation (1e-5 absolute: a missed edit or a stale prefetch is 1e-3 and more)."""
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=0, atol=1e-5)


def holds_kv(layer) -> bool:
    """False for transformers 5.24's DummyLayer (a layer that reads another's K/V, as Gemma4's shared ones)."""
    return hasattr(layer, "get_seq_length")


def assert_same_layer(ours, ref, static: bool, where) -> None:
    if not holds_kv(ref):
        assert type(ours) is type(ref) and ours.keys is None and ours.values is None, where
        return
    assert int(ours.get_seq_length()) == int(ref.get_seq_length()), where
    if not ref.is_initialized or int(ref.get_seq_length()) == 0:
        return
    for a, b in ((ours.keys, ref.keys), (ours.values, ref.values)):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        if static:  # the filled prefix: past it, stale positions are masked (and differ after reset)
            n = min(int(ref.get_seq_length()), b.shape[-2])
            a, b = a[:, :, :n], b[:, :, :n]
        assert close(a.cpu(), b.cpu()), where


class KVCaches(RuleBasedStateMachine):
    """(OffloadedKVCache, DynamicCache) and (OffloadedStaticKVCache, StaticCache) fed the same tokens."""

    @initialize(kind=st.sampled_from(KINDS), batch=st.integers(1, 3), depth=st.integers(1, 3),
                align=st.sampled_from([1, 64]), offload_sliding=st.booleans())  # fmt: skip
    def start(self, kind, batch, depth, align, offload_sliding):
        self.kind, self.model, self.batch, self.seq = kind, model_of(kind), batch, 0
        config = self.model.config
        # align 1: a dynamic layer's buffers hold 1.5x the positions they need, so they grow every few steps
        self.align = mock.patch.object(dynamic_layers, "ALIGN", align)
        self.align.start()
        self.pairs = {
            "dynamic": [OffloadedKVCache(config=config, offload_sliding=offload_sliding, prefetch_depth=depth),
                        DynamicCache(config=config)],
            "static": [OffloadedStaticKVCache(config=config, max_cache_len=MAX_LEN, offload_sliding=offload_sliding),
                       StaticCache(config=config, max_cache_len=MAX_LEN)],
        }  # fmt: skip
        self.held = []  # (ours, the reference's): a layer's keys or values taken earlier

    # forward steps ------------------------------------------------------------------------

    @precondition(lambda self: self.seq < MAX_LEN)
    @rule(data=st.data())
    def step(self, data):
        if self.seq > 0 and data.draw(st.booleans(), label="edit first"):  # right before the step that reads it
            self.edit(
                data, data.draw(st.booleans()), data.draw(st.sampled_from(HOW)), data.draw(st.sampled_from(FACTORS))
            )
        if self.seq > 0 and data.draw(st.booleans(), label="hold across"):  # edited once the step is done
            self.hold_references()
        n = data.draw(st.integers(1, min(5, MAX_LEN - self.seq)), label="tokens")
        seed = data.draw(st.integers(0, 2**16), label="seed")
        ids = torch.randint(1, 128, (self.batch, n), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            for name, (ours, ref) in self.pairs.items():
                got = self.model(input_ids=ids, **kw(ours), use_cache=True).logits
                want = self.model(input_ids=ids, **kw(ref), use_cache=True).logits
                assert close(got, want), (name, (got - want).abs().max())
        self.seq += n
        if self.held and data.draw(st.booleans(), label="edit held"):
            self.edit_held_references(data.draw(st.sampled_from(HOW)), data.draw(st.sampled_from(FACTORS)))

    # reads and in-place edits ---------------------------------------------------------------

    @precondition(lambda self: self.seq > 0)
    @rule(data=st.data())
    def check_layers(self, data):
        for name, (ours, ref) in self.pairs.items():
            for i, (a, b) in enumerate(zip(ours.layers, ref.layers, strict=True)):
                assert_same_layer(a, b, name == "static", (name, i))

    @precondition(lambda self: self.seq > 0)
    @rule(data=st.data(), values=st.booleans(), how=st.sampled_from(HOW), factor=st.sampled_from(FACTORS))
    def edit(self, data, values, how, factor):
        for ours, ref in self.pairs.values():
            # Often the first layer: the last layer's update has prefetched it for the next step.
            i = data.draw(st.one_of(st.just(0), st.integers(0, len(ref.layers) - 1)), label="layer")
            layer = ref.layers[i]
            if not holds_kv(layer) or not layer.is_initialized or int(layer.get_seq_length()) == 0:
                continue
            for cache in (ours, ref):
                layer = cache.layers[i]
                edit_in_place(layer.values if values else layer.keys, how, factor)

    @precondition(lambda self: self.seq > 0)
    @rule()
    def hold_references(self):
        """Take every layer's keys and values and keep them across later steps (issue 31 items 2 and 3)."""
        self.held = [(getattr(ours.layers[i], what), getattr(ref.layers[i], what))
                     for ours, ref in self.pairs.values() for i, layer in enumerate(ref.layers)
                     if holds_kv(layer) and layer.is_initialized and int(layer.get_seq_length())
                     for what in ("keys", "values")]  # fmt: skip

    @precondition(lambda self: bool(getattr(self, "held", None)))
    @rule(how=st.sampled_from(HOW), factor=st.sampled_from(FACTORS))
    def edit_held_references(self, how, factor):
        """Edit through references taken before later steps: an edit reaches StaticCache (persistent tensors),
        not DynamicCache once an update made new ones; offcache must agree on every layer."""
        offcache.synchronize()  # an old reference to the arena sees a D2H in flight once it landed (docs)
        for a, b in self.held:
            edit_in_place(a, how, factor)
            edit_in_place(b, how, factor)

    @precondition(lambda self: 0 < self.seq < MAX_LEN)
    @rule(data=st.data())
    def failed_update(self, data):
        """An update of an offloaded layer that fails at the engine (HostLimitError) leaves the layer as it
        was; the reference is not updated, and every later step still matches (issue 31 item 4)."""
        for name, (ours, ref) in self.pairs.items():
            offloaded = [i for i, layer in enumerate(ours.layers) if isinstance(layer, OffloadedLayerBase)]
            offloaded = [i for i in offloaded if ref.layers[i].is_initialized and ref.layers[i].get_seq_length()]
            if not offloaded:
                continue
            i = data.draw(st.sampled_from(offloaded), label="failing layer")
            keys = ref.layers[i].keys
            k = torch.randn(*keys.shape[:2], 1, keys.shape[-1], dtype=keys.dtype)
            reached = []
            refuse = functools.partial(_refuse, reached)
            before = int(ours.layers[i].get_seq_length())
            with mock.patch.object(_engine, "store", refuse), mock.patch.object(_engine, "copy_into", refuse):
                with pytest.raises(offcache.HostLimitError):
                    ours.update(k, -k, i)
            assert reached, (name, i, "the injected failure was not reached")
            assert int(ours.layers[i].get_seq_length()) == before, (name, i)
            assert_same_layer(ours.layers[i], ref.layers[i], name == "static", (name, i, "after a failed update"))

    # transformers' operations -----------------------------------------------------------------

    @precondition(lambda self: self.seq > 0)
    @rule(data=st.data())
    def reorder_cache(self, data):
        beams = torch.tensor(data.draw(st.lists(st.integers(0, self.batch - 1), min_size=self.batch,
                                                max_size=self.batch), label="beam_idx"))  # fmt: skip
        for ours, ref in self.pairs.values():
            ours.reorder_cache(beams)
            ref.reorder_cache(beams)

    # A crop past a sliding window is refused (tested on its own); here: within the windows.
    @precondition(lambda self: self.seq > 0 and (self.kind not in SLIDING or self.seq < WINDOW))
    @rule(data=st.data())
    def crop(self, data):
        remove = data.draw(st.integers(0, self.seq), label="remove")
        for name, (ours, ref) in self.pairs.items():
            ours.crop(-remove)
            if name == "dynamic":
                ref.crop(-remove)
            else:
                for layer in ref.layers:
                    _static_ref_op(layer, "crop", -remove)
        self.seq -= remove

    @precondition(lambda self: self.seq > 0 and self.batch > 1)
    @rule(data=st.data())
    def batch_select_indices(self, data):
        keep = data.draw(st.lists(st.integers(0, self.batch - 1), min_size=1, max_size=self.batch, unique=True),
                         label="indices")  # fmt: skip
        self._batch_op("batch_select_indices", torch.tensor(sorted(keep)))
        self.batch = len(keep)

    @precondition(lambda self: self.seq > 0 and self.batch <= 2)
    @rule(repeats=st.integers(1, 2))
    def batch_repeat_interleave(self, repeats):
        self._batch_op("batch_repeat_interleave", repeats)
        self.batch *= repeats

    def _batch_op(self, op, arg):
        for name, (ours, ref) in self.pairs.items():
            getattr(ours, op)(arg)
            if name == "dynamic":
                getattr(ref, op)(arg)
            else:
                for layer in ref.layers:
                    _static_ref_op(layer, op, arg)

    @rule(how=st.sampled_from(["deepcopy", "pickle"]))
    def copy_caches(self, how):
        copy_of = copy.deepcopy if how == "deepcopy" else (lambda c: pickle.loads(pickle.dumps(c)))
        for pair in self.pairs.values():
            pair[0], pair[1] = copy_of(pair[0]), copy.deepcopy(pair[1])

    @rule()
    def reset(self):
        for name, pair in self.pairs.items():
            pair[0].reset()
            if name == "dynamic" and "reset" not in vars(DynamicLayer):  # 5.17's keeps the length
                pair[1] = DynamicCache(config=self.model.config)  # what a reset is (5.24's)
            else:
                pair[1].reset()
        self.seq = 0

    @invariant()
    def same_lengths(self):
        if hasattr(self, "pairs"):
            for ours, ref in self.pairs.values():
                assert int(ours.get_seq_length()) == int(ref.get_seq_length())

    def teardown(self):
        try:
            if hasattr(self, "pairs") and self.seq > 0:
                self.check_layers(None)
        finally:
            if hasattr(self, "align"):
                self.align.stop()


def _refuse(reached: list, *args, **kwargs):
    """The engine's store / copy_into, failing as at the host limit with no disk tier."""
    reached.append(1)
    raise offcache.HostLimitError("injected: the host limit is reached")


def _static_ref_op(layer, op: str, arg) -> None:
    """StaticCache's layer operation, or, where the installed transformers lacks it, the plain one
    (what OffloadedStaticKVCache does to its resident layers)."""
    if hasattr(type(layer), op):
        getattr(layer, op)(arg)
    else:
        resident_op(layer, op, arg)


SETTINGS = settings(max_examples=int(os.environ.get("KV_MACHINE_EXAMPLES", "5")), stateful_step_count=10, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip


@pytest.mark.parametrize("engine", ["default", "host-1MiB-slow"], indirect=True)
def test_kv_caches_against_transformers(engine):
    run_state_machine_as_test(KVCaches, settings=SETTINGS)


# The compiled path: inductor on the CPU, a 1-layer Llama --------------------------------------


class CompiledStatic(RuleBasedStateMachine):
    """OffloadedStaticKVCache and StaticCache, decode steps through one compiled forward (the caches are
    made once and reset per example: a new cache object would be a recompile)."""

    shared = None  # (model, compiled forward, ours, ref)

    @initialize()
    def start(self):
        cls = type(self)
        if cls.shared is None:
            model = causal_lm("llama", num_hidden_layers=1)
            cls.shared = (model, torch.compile(model.forward, fullgraph=True),
                          OffloadedStaticKVCache(config=model.config, max_cache_len=MAX_LEN),
                          StaticCache(config=model.config, max_cache_len=MAX_LEN))  # fmt: skip
        self.model, self.compiled, self.ours, self.ref = cls.shared
        self.batch, self.seq, self.last = 1, 0, None
        self.reset()

    def _forward(self, fwd, ids):
        with torch.no_grad():
            got = fwd(input_ids=ids, **kw(self.ours), use_cache=True).logits
            want = fwd(input_ids=ids, **kw(self.ref), use_cache=True).logits
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        self.seq += ids.shape[1]
        self.last = want[:, -1:].argmax(-1)

    @precondition(lambda self: self.seq + 4 <= MAX_LEN)
    @rule(n=st.integers(1, 4), seed=st.integers(0, 2**16))
    def eager_prefill(self, n, seed):
        ids = torch.randint(1, 128, (self.batch, n), generator=torch.Generator().manual_seed(seed))
        self._forward(self.model.forward, ids)

    @precondition(lambda self: self.last is not None and self.seq < MAX_LEN)
    @rule()
    def compiled_decode(self):
        self._forward(self.compiled, self.last)

    @precondition(lambda self: self.seq > 0)
    @rule(values=st.booleans(), how=st.sampled_from(["tensor", "data", "numpy"]))
    def edit(self, values, how):
        for cache in (self.ours, self.ref):
            layer = cache.layers[0]
            edit_in_place(layer.values if values else layer.keys, how, 0.5)

    @rule()
    def reset(self):
        self.ours.reset()
        self.ref.reset()
        self.seq, self.last = 0, None

    def teardown(self):
        if getattr(self, "seq", 0):
            assert_same_layer(self.ours.layers[0], self.ref.layers[0], True, "teardown")


COMPILED_SETTINGS = settings(max_examples=3, stateful_step_count=10, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])  # fmt: skip


@pytest.mark.parametrize("engine", ["default"], indirect=True)
def test_compiled_static_cache_against_static_cache(engine):
    torch._dynamo.reset()
    try:
        run_state_machine_as_test(CompiledStatic, settings=COMPILED_SETTINGS)
    finally:
        torch._dynamo.reset()
        CompiledStatic.shared = None
