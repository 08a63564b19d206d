"""An offloaded KV cache for transformers' ``generate``, on offcache's engine.

``OffloadedKVCache(config=model.config)`` is a transformers ``DynamicCache``
whose full-attention layers keep their K/V in the pinned arena between steps:

- each step only the newly added tokens' K/V go D2H, on the engine's D2H stream,
  overlapped with the rest of the forward pass;
- while a layer computes, the next offloaded layer's K/V are fetched H2D on the
  engine's H2D stream (double-buffered: at most two offloaded layers are on the
  GPU), and compute waits on the fetch's event, never on a device-wide sync;
- host chunks are compacted into one every ``compact_every`` steps, so a
  layer's fetch stays a handful of copies however long the generation.

Sliding-window layers stay resident unless ``offload_sliding=True``;
linear-attention layers are never offloaded. The returned K/V are the same
contiguous tensors DynamicCache builds, so greedy outputs are identical.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from offcache import _engine
from offcache.static_kv_cache import OffloadedStaticKVCache  # noqa: F401  (the static one, for offcache.__getattr__)

_CPU = torch.device("cpu")


class _Offloaded:
    """Arena-backed K/V chunks and an in-flight prefetch, shared by the layer classes."""

    def _init_offload(self) -> None:
        self._host_k: list[torch.Tensor] = []
        self._host_v: list[torch.Tensor] = []
        self._prefetched = None  # (device tensors, ticket, number of chunks fetched)

    def prefetch(self) -> None:
        """Start the H2D copy of this layer's K/V; update() waits on it."""
        if self._host_k and self._prefetched is None:
            tensors, ticket = _engine.fetch(self._host_k + self._host_v, self.device, False)
            self._prefetched = (tensors, ticket, len(self._host_k))

    def offload(self) -> None:  # the K/V already live in the arena
        pass

    def _past(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This layer's cached K/V on its device: the prefetch if current, else a fetch now."""
        if not self._host_k:
            return None
        pre, self._prefetched = self._prefetched, None
        if pre is None or pre[2] != len(self._host_k):
            tensors, _ = _engine.fetch(self._host_k + self._host_v, self.device, True)
        else:
            tensors, ticket, _ = pre
            ticket.wait()  # the consumer stream waits on the H2D event
        n = len(self._host_k)
        if n == 1:
            return tensors[0], tensors[1]
        return torch.cat(tensors[:n], dim=-2), torch.cat(tensors[n:], dim=-2)

    def _drop_offloaded(self) -> None:
        self._host_k, self._host_v, self._prefetched = [], [], None


class OffloadedLayer(_Offloaded, DynamicLayer):
    """A full-attention layer whose K/V live in the pinned arena between steps."""

    def __init__(self, compact_every: int = 16, **kwargs):
        super().__init__(**kwargs)
        self.compact_every = compact_every
        self._seq = 0
        self._init_offload()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        past = self._past()
        if past is None:
            keys, values = key_states, value_states
        else:
            keys = torch.cat([past[0], key_states], dim=-2)
            values = torch.cat([past[1], value_states], dim=-2)
        self._seq = keys.shape[-2]
        if len(self._host_k) + 1 >= self.compact_every:
            # One chunk for everything: bounds the copies per fetch.
            k, v = _engine.store([keys, values], _CPU)
            self._host_k, self._host_v = [k], [v]
        else:  # only the new tokens go D2H
            k, v = _engine.store([key_states, value_states], _CPU)
            self._host_k.append(k)
            self._host_v.append(v)
        return keys, values

    def get_seq_length(self) -> int:
        return self._seq if self.is_initialized else 0

    def reset(self) -> None:
        self._drop_offloaded()
        self._seq = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("OffloadedKVCache does not support cropping (assisted decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("OffloadedKVCache does not support beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("OffloadedKVCache does not support batch expansion")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("OffloadedKVCache does not support batch selection")


class OffloadedSlidingLayer(_Offloaded, DynamicSlidingWindowLayer):
    """A sliding-window layer offloaded too (``offload_sliding=True``): its window moves whole."""

    def __init__(self, sliding_window: int, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self._init_offload()

    def update(self, key_states, value_states, *args, **kwargs):
        if self.is_initialized:
            past = self._past()
            if past is not None:
                self.keys, self.values = past
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        k, v = _engine.store([self.keys, self.values], _CPU)
        self._host_k, self._host_v = [k], [v]
        self.keys = self.values = None  # the window lives in the arena until the next step
        return keys, values

    def reset(self) -> None:
        self._drop_offloaded()
        self.cumulative_length = 0


class OffloadedKVCache(DynamicCache):
    """A ``DynamicCache`` whose offloadable layers keep their K/V in offcache's pinned arena.

    Usage: ``model.generate(**inputs, past_key_values=OffloadedKVCache(config=model.config))``.
    """

    def __init__(self, config=None, offload_sliding: bool = False, compact_every: int = 16):
        super().__init__(config=config)
        self.compact_every = compact_every
        self.offload_sliding = offload_sliding
        if self.layer_class_to_replicate is not None:  # no config: layers appear as they are used
            self.layer_class_to_replicate = lambda: OffloadedLayer(compact_every)
        self.layers = [self._offloaded(layer) for layer in self.layers]

    def _offloaded(self, layer):
        if type(layer) is DynamicLayer:
            return OffloadedLayer(self.compact_every)
        if type(layer) is DynamicSlidingWindowLayer and self.offload_sliding:
            return OffloadedSlidingLayer(layer.sliding_window)
        return layer  # sliding (resident by default), linear attention (never), others

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.layer_class_to_replicate is not None:
            while len(self.layers) <= layer_idx:
                self.layers.append(self.layer_class_to_replicate())
        nxt = self._next_offloaded(layer_idx)
        if nxt is not None:
            self.layers[nxt].prefetch()  # overlaps with this layer's attention and MLP
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def _next_offloaded(self, layer_idx: int) -> int | None:
        n = len(self.layers)
        for step in range(1, n):
            i = (layer_idx + step) % n
            if isinstance(self.layers[i], _Offloaded):
                return i
        return None
