"""An offloaded KV cache for transformers' ``generate``, on offcache's engine.

``OffloadedKVCache(config=model.config)`` is a transformers ``DynamicCache``
whose full-attention layers keep their K/V in the pinned arena between steps:

- each of a layer's K and V lives in one arena buffer that grows geometrically
  (1.5x, a few times in a long generation); each step only the new tokens' K/V
  go D2H, into the buffers' tail, on the engine's D2H stream, overlapped with
  the rest of the forward pass: no compaction, nothing stored again;
- a layer comes back in one H2D copy per tensor into one device allocation
  each, sized for the new length, and the new tokens are written into place
  (no ``torch.cat``);
- while a layer computes, the next two offloaded layers' K/V are fetched H2D on
  the engine's H2D stream (``prefetch_depth``: at most three offloaded layers
  on the GPU), so a copy longer than one layer's compute still hides behind
  two; compute waits on the fetch's event, never on a device-wide sync.

Sliding-window layers stay resident unless ``offload_sliding=True`` (their
window then moves whole); linear-attention layers are never offloaded. The
returned K/V hold what DynamicCache's do, so greedy outputs are identical.

An offloaded layer's ``keys`` / ``values`` are CPU views of its arena buffers
(``[batch, heads, seq, dim]``), read once the layer's pending copies landed: a
generation nobody inspects pays nothing for them, and a read copies nothing.
Code may edit them in place; the layer's next update reads the edit and moves the
layer to new buffers first, so a reference kept across a step sees none of its
changes, as with DynamicCache. ``reorder_cache`` (beam search), ``crop``
(assisted decoding), ``batch_repeat_interleave`` and ``batch_select_indices``
run transformers' own layer code on those host views (no PCIe traffic: the
next fetch brings the result) and keep the result in the buffers.
``copy.deepcopy`` and pickling wait for the copies and copy the K/V. The layers
are in dynamic_layers.py.
"""

from __future__ import annotations

import functools

from offcache.util.extras import as_missing

try:
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
except ModuleNotFoundError as _missing:  # one line naming the extra, as offcache.OffloadedKVCache gives
    raise as_missing(_missing, "transformers", "kv", "offcache.kv.dynamic") from None

from offcache.kv.dynamic_layers import DynamicOffloaded, OffloadedLayer, OffloadedSlidingLayer
from offcache.kv.static import OffloadedStaticKVCache  # noqa: F401  (the static one, for offcache.__getattr__)

__all__ = [
    "DynamicOffloaded",
    "OffloadedKVCache",
    "OffloadedLayer",
    "OffloadedSlidingLayer",
    "_Offloaded",
    "cache_kwarg",
]

_Offloaded = DynamicOffloaded  # its name before layout step 2 (docs/changelog.md), kept: __all__ lists it


@functools.cache
def cache_kwarg() -> str:
    """The keyword under which the installed transformers takes a cache in ``generate`` and ``forward``:
    ``cache`` where it has it (5.24 deprecates ``past_key_values``), else ``past_key_values``."""
    import inspect

    from transformers import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


class OffloadedKVCache(DynamicCache):
    """A ``DynamicCache`` whose offloadable layers keep their K/V in offcache's pinned arena.

    Usage: ``model.generate(**inputs, cache=OffloadedKVCache(config=model.config))`` (``past_key_values=``
    before transformers 5.24: ``cache_kwarg()`` names the installed one's keyword).
    """

    def __init__(self, config=None, offload_sliding: bool = False, compact_every: int | None = None,
                 prefetch_depth: int = 2):  # fmt: skip
        """`prefetch_depth`: offloaded layers fetched ahead of the one computing (2: a layer's copy has two
        layers' compute to hide behind). `compact_every` is no longer used (a layer is one buffer)."""
        if prefetch_depth < 1:
            raise ValueError(f"OffloadedKVCache: prefetch_depth must be 1 or more, got {prefetch_depth}")
        super().__init__(config=config)
        self.compact_every = compact_every
        self.prefetch_depth = prefetch_depth
        self.offload_sliding = offload_sliding
        if self.layer_class_to_replicate is not None:  # no config: layers appear as they are used
            self.layer_class_to_replicate = OffloadedLayer  # picklable
        self.layers = [self._offloaded(layer) for layer in self.layers]

    def _offloaded(self, layer):
        if type(layer) is DynamicLayer:
            return OffloadedLayer()
        if type(layer) is DynamicSlidingWindowLayer and self.offload_sliding:
            return OffloadedSlidingLayer(layer.sliding_window)
        return layer  # sliding (resident by default), linear attention (never), others

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.layer_class_to_replicate is not None:
            while len(self.layers) <= layer_idx:
                self.layers.append(self.layer_class_to_replicate())
        for nxt in self._next_offloaded(layer_idx):
            self.layers[nxt].prefetch()  # overlaps with this layer's attention and MLP (and the next's)
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def reset(self) -> None:
        """Every layer empty, as a new cache: resident dynamic layers are dropped as transformers 5.24's are
        (before it, they were zeroed and kept their length, so the next tokens followed zeros)."""
        for layer in self.layers:
            if (
                isinstance(layer, DynamicOffloaded)
                or "reset" in vars(DynamicLayer)
                or not isinstance(layer, DynamicLayer)
            ):
                layer.reset()
            else:  # transformers' own reset first: a hybrid layer's linear-attention states too
                layer.reset()
                layer.keys = layer.values = None
                layer.is_initialized = False
                if hasattr(layer, "cumulative_length"):
                    layer.cumulative_length = 0

    def _next_offloaded(self, layer_idx: int) -> list[int]:
        """The `prefetch_depth` offloaded layers after `layer_idx`, wrapping to the next step's first ones."""
        n, out = len(self.layers), []
        for step in range(1, n):
            i = (layer_idx + step) % n
            if isinstance(self.layers[i], DynamicOffloaded):
                out.append(i)
                if len(out) == self.prefetch_depth:
                    break
        return out
