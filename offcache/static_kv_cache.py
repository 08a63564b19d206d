"""An offloaded static KV cache for transformers, on offcache's engine.

``OffloadedStaticKVCache(config=model.config, max_cache_len=n)`` is a transformers
``StaticCache`` whose full-attention layers keep their K/V in the pinned arena:

- each layer's K/V live in the arena at full size (``max_cache_len``), allocated once;
- two device buffers of one layer's shape alternate between the offloaded layers (the
  one in use and the one being prefetched), so offloaded layers take 2 layers of GPU
  memory, not all of them;
- per step only what changed moves: D2H the positions written this step, into the
  arena at those positions; H2D the filled prefix ``[0, seq)``. The rest of a device
  buffer is zero (never stale: a buffer's written extent is tracked and any excess is
  zeroed when a layer takes it), so the returned K/V equal StaticCache's bit for bit;
- the copies run on the engine's streams, ordered by events; the next offloaded layer
  is prefetched while the current one computes.

Sliding-window layers stay resident unless ``offload_sliding=True`` (then their window
moves: new positions while it fills, the whole rolled window once it is full).

torch.compile: ``update`` is excluded from compilation (``torch.compiler.disable``) and
runs eagerly, so a compiled forward breaks its graph at each ``past_key_values.update``
call, one per attention layer (dynamo splits the enclosing decoder-layer and model frames
there too: about 3 graphs per layer). A CUDA graph cannot contain the cache call (the
engine's bookkeeping runs on the host at every update, which a replay would skip), so a
whole-forward CUDA graph is impossible; ``generate`` on a GPU compiles the forward itself
(mode "reduce-overhead": CUDA graphs for the pieces between cache calls), which the
``gpu``-marked test checks for equal tokens.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import StaticCache, StaticLayer, StaticSlidingWindowLayer

from offcache import _engine

_CPU = torch.device("cpu")


class _Buffers:
    """Two device buffers of one layer's K/V shape, alternating between the layers that share them."""

    def __init__(self, k_shape, v_shape, dtype, device):
        self.k = [torch.zeros(k_shape, dtype=dtype, device=device) for _ in range(2)]
        self.v = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(2)]
        if not torch.compiler.is_compiling():
            for t in self.k + self.v:
                torch._dynamo.mark_static_address(t)
        self.written = [0, 0]  # positions [written, max_cache_len) of a buffer are zero
        self.current = 1  # the buffer of the layer that took one last; the next layer gets the other
        self.reserved = None  # the layer whose prefetch fills the other buffer

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class _Unsupported:
    """Cropping, beam search and batch reordering: a clear error (layers and the cache alike)."""

    def _unsupported(self, what: str):
        raise NotImplementedError(f"OffloadedStaticKVCache does not support {what}")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("cropping (assisted decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._unsupported("beam search (reorder_cache)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("batch expansion")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._unsupported("batch selection")


class _StaticOffloaded(_Unsupported):
    """Arena-backed full-size K/V, a share of two device buffers, and an in-flight prefetch."""

    def _init_offload(self, buffers: dict) -> None:
        self._all_buffers = buffers  # the cache's, keyed by shape, dtype and device
        self._buffers: _Buffers | None = None
        self._host_k = self._host_v = None
        self._prefetched = None  # (buffer index, positions fetched, ticket)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        k_shape = (self.batch_size, self.num_heads, self.max_cache_len, self.k_head_dim)
        v_shape = (self.batch_size, self.num_heads, self.max_cache_len, self.v_head_dim)
        zeros = [torch.zeros(k_shape, dtype=self.dtype), torch.zeros(v_shape, dtype=self.dtype)]
        self._host_k, self._host_v = _engine.store(zeros, _CPU)  # the arena layer, allocated once
        for t in (self._host_k, self._host_v):
            _engine.wait_stored(t)  # zeros written before any copy lands in it
        self.keys, self.values = self._host_k, self._host_v  # what the layer holds (read after synchronize())
        key = (k_shape, v_shape, self.dtype, self.device)
        if key not in self._all_buffers:
            self._all_buffers[key] = _Buffers(k_shape, v_shape, self.dtype, self.device)
        self._buffers = self._all_buffers[key]
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.cumulative_length)
        self.is_initialized = True

    def _filled(self) -> int:
        """Positions [0, filled) of the arena layer hold K/V: what a device buffer needs."""
        raise NotImplementedError

    def prefetch(self) -> None:
        """Start the H2D copy of the filled prefix into the buffer not in use; update() waits on it."""
        n = self._filled() if self.is_initialized else 0
        if n == 0 or self._prefetched is not None:
            return
        bufs = self._buffers
        i = 1 - bufs.current
        ticket = _engine.copy_into(
            [bufs.k[i][:, :, :n], bufs.v[i][:, :, :n]], [self._host_k[:, :, :n], self._host_v[:, :, :n]], False
        )
        bufs.written[i] = max(bufs.written[i], n)
        bufs.reserved = self
        self._prefetched = (i, n, ticket)

    def offload(self) -> None:  # the K/V already live in the arena
        pass

    def _take_buffer(self, valid_after: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A device buffer holding the filled prefix, zero from `valid_after` on (the update fills the rest)."""
        bufs, n = self._buffers, self._filled()
        pre, self._prefetched = self._prefetched, None
        if pre is not None and pre[1] == n and bufs.reserved is self and pre[0] == 1 - bufs.current:
            i = pre[0]
            pre[2].wait()  # the current stream waits for the H2D copy
        else:
            if pre is not None:
                pre[2].wait()  # a stale prefetch: ordered before anything touches its buffer again
            i = 1 - bufs.current
            if n:
                dsts, srcs = (
                    [bufs.k[i][:, :, :n], bufs.v[i][:, :, :n]],
                    [self._host_k[:, :, :n], self._host_v[:, :, :n]],
                )
                _engine.copy_into(dsts, srcs, True)
        bufs.current, bufs.reserved = i, None
        k, v = bufs.k[i], bufs.v[i]
        if bufs.written[i] > valid_after:  # left by a longer sequence (after reset()): zero it again
            k[:, :, valid_after : bufs.written[i]].zero_()
            v[:, :, valid_after : bufs.written[i]].zero_()
        bufs.written[i] = valid_after  # >= n: the update writes [n, valid_after)
        return k, v

    def _store_positions(self, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """D2H `key_states`/`value_states` into the arena layer at positions [start, start + n)."""
        end = start + key_states.shape[-2]
        # Fresh contiguous copies as sources (a few tokens): the engine keeps them alive until the
        # copy is done and nothing else writes to them, whereas a device buffer is rewritten by the
        # next layers and a compiled graph's output by its next replay.
        srcs = [t.clone(memory_format=torch.contiguous_format) for t in (key_states, value_states)]
        _engine.copy_into([self._host_k[:, :, start:end], self._host_v[:, :, start:end]], srcs, False)

    def _drop_prefetch(self) -> None:
        if self._prefetched is not None:
            self._prefetched[2].wait()
            self._prefetched = None


class OffloadedStaticLayer(_StaticOffloaded, StaticLayer):
    """A full-attention static layer whose K/V live in the pinned arena between uses."""

    def __init__(self, max_cache_len: int, buffers: dict | None = None, **kwargs):
        super().__init__(max_cache_len=max_cache_len, **kwargs)
        self._seq = 0
        self._init_offload({} if buffers is None else buffers)

    def _filled(self) -> int:
        return self._seq

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, n = self._seq, key_states.shape[-2]
        if start + n > self.max_cache_len:
            raise IndexError(
                f"OffloadedStaticKVCache: {start} cached tokens + {n} new exceed max_cache_len={self.max_cache_len}"
            )
        k, v = self._take_buffer(start + n)
        k[:, :, start : start + n].copy_(key_states)
        v[:, :, start : start + n].copy_(value_states)
        self._store_positions(start, key_states, value_states)
        self._seq = start + n
        self.cumulative_length.add_(n)
        return k, v

    def reset(self) -> None:
        self._drop_prefetch()
        self._seq = 0
        self.cumulative_length.zero_()


class OffloadedStaticSlidingLayer(_StaticOffloaded, StaticSlidingWindowLayer):
    """A sliding-window static layer offloaded too (``offload_sliding=True``)."""

    def __init__(self, max_cache_len: int, sliding_window: int, buffers: dict | None = None, **kwargs):
        super().__init__(max_cache_len=max_cache_len, sliding_window=sliding_window, **kwargs)
        self._init_offload({} if buffers is None else buffers)

    def _filled(self) -> int:
        return min(self.cumulative_length_int, self.max_cache_len)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, n, window = self.cumulative_length_int, key_states.shape[-2], self.max_cache_len
        self.keys, self.values = self._take_buffer(min(start + n, window))
        try:  # StaticCache's own update, on the device buffer
            keys, values = StaticSlidingWindowLayer.update(self, key_states, value_states, *args, **kwargs)
            if start + n <= window:  # written in place at [start, start + n)
                self._store_positions(start, key_states, value_states)
            else:  # the window moved: all of it changed
                self._store_positions(0, self.keys, self.values)
        finally:
            self.keys, self.values = self._host_k, self._host_v
        return keys, values

    def reset(self) -> None:
        self._drop_prefetch()
        self.cumulative_length_int = 0
        self.cumulative_length.zero_()


class OffloadedStaticKVCache(_Unsupported, StaticCache):
    """A ``StaticCache`` whose full-attention layers keep their K/V in offcache's pinned arena.

    Usage: ``model.generate(**inputs, past_key_values=OffloadedStaticKVCache(config=model.config,
    max_cache_len=n))``. ``max_batch_size``, ``dtype`` and ``device`` are accepted as StaticCache
    accepts them, and likewise unused: shapes, dtype and device come from the first update.
    """

    def __init__(
        self,
        config,
        max_cache_len: int,
        max_batch_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        offload_sliding: bool = False,
        **kwargs,
    ):
        if kwargs.get("offloading"):
            raise ValueError("OffloadedStaticKVCache offloads through offcache; drop transformers' offloading=True")
        kwargs.pop("offloading", None)
        kwargs.pop("offload_only_non_sliding", None)
        super().__init__(config=config, max_cache_len=max_cache_len, **kwargs)
        self.offload_sliding = offload_sliding
        self._buffers: dict = {}  # device buffers shared by the offloaded layers, by shape
        self.layers = [self._offloaded(layer) for layer in self.layers]
        self._offloaded_idx = [i for i, layer in enumerate(self.layers) if isinstance(layer, _StaticOffloaded)]

    def _offloaded(self, layer):
        if type(layer) is StaticLayer:
            return OffloadedStaticLayer(layer.max_cache_len, self._buffers)
        if type(layer) is StaticSlidingWindowLayer and self.offload_sliding:
            # layer.max_cache_len is already min(window, max_cache_len)
            return OffloadedStaticSlidingLayer(layer.max_cache_len, layer.max_cache_len, self._buffers)
        return layer  # sliding (resident by default), linear attention and others: as StaticCache has them

    @torch.compiler.disable  # the engine calls run eagerly: one graph break per attention layer
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)
        nxt = self._next_offloaded(layer_idx)
        if nxt is not None:
            self.layers[nxt].prefetch()  # overlaps with this layer's attention and MLP
        return out

    def _next_offloaded(self, layer_idx: int) -> int | None:
        """The offloaded layer after `layer_idx`, wrapping to the next step's first."""
        for i in self._offloaded_idx:
            if i > layer_idx:
                return i
        return self._offloaded_idx[0] if self._offloaded_idx else None

    def device_buffer_bytes(self) -> int:
        """Bytes of the device buffers the offloaded layers share (2 layers per shape)."""
        return sum(b.nbytes() for b in self._buffers.values())
