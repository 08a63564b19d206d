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

Layers whose K/V later layers read through ``shared_kv_states`` in the same step (KV-sharing
models: Gemma3n, Gemma4) stay resident: a prefetch into a shared device buffer would
overwrite them while they are still read.

``keys`` / ``values`` of an offloaded layer are its arena tensors (CPU, ``max_cache_len``
long), returned once the layer's pending D2H copies have landed. ``reorder_cache``,
``crop``, ``batch_repeat_interleave`` and ``batch_select_indices`` work on the arena (host
side: the next H2D brings the result; no extra PCIe traffic), for resident static layers
too; a sliding layer that already dropped tokens cannot be cropped (transformers'
RuntimeError). ``copy.deepcopy`` and pickling wait for the copies and copy the arena.

torch.compile: under compilation the update of an offloaded layer is one ``torch.library``
custom op (``offcache::static_kv_update``) with a fake implementation and its mutation of
``cumulative_length`` and of its two outputs declared, so ``torch.compile(model.forward,
fullgraph=True)`` traces one graph per forward; the op runs the eager update (engine
bookkeeping, waits, copies, prefetch) at every call and copies the layer's device buffers
into outputs the graph allocated (one device-to-device copy per layer and step: graph
outputs must not alias the buffers the engine rewrites). It is tagged ``cudagraph_unsafe``:
inductor's graph partition keeps it out of CUDA graphs (mode "reduce-overhead") and captures
the rest; the outputs are then in the CUDA graph pool, which the next partition reads in
place (no second copy into its input buffers).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from offcache.util.extras import as_missing

try:
    from transformers.cache_utils import StaticCache, StaticLayer, StaticSlidingWindowLayer, get_layer_types_and_kwargs
except ModuleNotFoundError as _missing:  # one line naming the extra, as offcache.OffloadedKVCache gives
    raise as_missing(_missing, "transformers", "kv", "offcache.kv.static") from None


from offcache import engine as _engine
from offcache.kv.counters import count as _count
from offcache.kv.layer import OffloadedLayerBase
from offcache.kv.resident import check_croppable, crop_count, resident_op

_CPU = torch.device("cpu")


class _BufferPool(dict):
    """The device buffers of a cache, by shape: a copy of the cache starts with none (they are scratch)."""

    def __deepcopy__(self, memo):
        return _BufferPool()

    def __reduce__(self):
        return (_BufferPool, ())


class _Buffers:
    """Two device buffers of one layer's K/V shape, alternating between the layers that share them."""

    def __init__(self, k_shape, v_shape, k_dtype, v_dtype, device):
        self.k = [torch.zeros(k_shape, dtype=k_dtype, device=device) for _ in range(2)]
        self.v = [torch.zeros(v_shape, dtype=v_dtype, device=device) for _ in range(2)]
        if not torch.compiler.is_compiling():
            for t in self.k + self.v:
                torch._dynamo.mark_static_address(t)
        self.written = [0, 0]  # positions [written, max_cache_len) of a buffer are zero
        self.current = 1  # the buffer of the layer that took one last; the next layer gets the other
        self.reserved = None  # the layer whose prefetch fills the other buffer

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def _buffer_key(layer) -> tuple:
    """What a layer's device buffers are shared by: K and V shapes, K and V dtypes, device."""
    k, v = layer.__dict__["_host_k"], layer.__dict__["_host_v"]
    return tuple(k.shape), tuple(v.shape), k.dtype, v.dtype, layer.device


class _StaticOffloaded(OffloadedLayerBase):
    """Arena-backed full-size K/V, a share of two device buffers, and an in-flight prefetch."""

    def _init_offload(self, buffers: dict) -> None:
        self._all_buffers = buffers  # the cache's, keyed by shape, dtype and device
        self._buffers: _Buffers | None = None
        self._host_k = self._host_v = None
        self._dev_k = self._dev_v = None  # the device buffer, while StaticSlidingWindowLayer.update runs
        self._prefetched = None  # (buffer index, positions fetched, ticket)
        self._last_read = None  # the ticket of the last H2D copy that read the arena layer
        self._exposed = False  # the arena layer was handed out (keys/values): no prefetch, see _host_view

    # keys / values: the arena layer (the device buffer during a sliding update) ------------------

    @property
    def keys(self) -> torch.Tensor | None:
        if self.__dict__.get("_dev_k") is not None:
            return self._dev_k
        return self._host_view(self.__dict__.get("_host_k"))

    @keys.setter
    def keys(self, t) -> None:
        self._assign("_host_k", t)

    @property
    def values(self) -> torch.Tensor | None:
        if self.__dict__.get("_dev_v") is not None:
            return self._dev_v
        return self._host_view(self.__dict__.get("_host_v"))

    @values.setter
    def values(self, t) -> None:
        self._assign("_host_v", t)

    def _host_view(self, t, expose: bool = True):
        """The arena layer, handed out: code outside may edit it in place (through ``.data`` or numpy
        too, where no version counter sees it), so a prefetch of it is dropped (the next update fetches
        what it holds then) and the H2D copies still reading it complete first."""
        if t is not None:
            self._drop_prefetch(on_host=True)
            _engine.wait_on_host(self.__dict__.get("_last_read"))
            self._last_read = None
            _engine.wait_stored(t)  # the D2H copies into it (copy_into) have landed
            # StaticCache's K/V are persistent: an edit through this reference, whenever it comes, is seen
            # by the next update. So this layer is not prefetched any more (a prefetch issued before such an
            # edit would miss it); each update fetches what the arena holds then. Until new arena tensors.
            self._exposed = self._exposed or expose
        return t

    def _own_kv(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The arena layer, read by the cache's own operations (nothing handed out: prefetch stays)."""
        d = self.__dict__
        return self._host_view(d.get("_host_k"), expose=False), self._host_view(d.get("_host_v"), expose=False)

    def _assign(self, name: str, t) -> None:
        # CacheLayerMixin.__init__ sets None; a tensor assigned from outside goes to the arena.
        if t is not None:
            self._drop_prefetch()
            (t,) = _engine.store([t.detach().contiguous()], _CPU)
            _engine.wait_stored(t)
        self.__dict__[name] = t

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # K and V each keep their own dtype (transformers 5.24 allows them to differ).
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        k_shape = (self.batch_size, self.num_heads, self.max_cache_len, self.k_head_dim)
        v_shape = (self.batch_size, self.num_heads, self.max_cache_len, self.v_head_dim)
        self._set_arena(torch.zeros(k_shape, dtype=key_states.dtype), torch.zeros(v_shape, dtype=value_states.dtype))
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.cumulative_length)
        self.is_initialized = True

    def _set_arena(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The arena layer, allocated once (and again only when the batch changes)."""
        self._drop_prefetch()
        self._host_k, self._host_v = _engine.store([k, v], _CPU)
        for t in (self._host_k, self._host_v):
            _engine.wait_stored(t)  # written before any copy lands in it
        self._buffers = None  # looked up by shape when next needed
        self._exposed = False  # references handed out before hold the old arena tensors

    def _resolve_buffers(self) -> _Buffers:
        if self._buffers is None:
            key = _buffer_key(self)
            if key not in self._all_buffers:
                self._all_buffers[key] = _Buffers(*key)
            self._buffers = self._all_buffers[key]
        return self._buffers

    def _filled(self) -> int:
        """Positions [0, filled) of the arena layer hold K/V: what a device buffer needs."""
        raise NotImplementedError

    def prefetch(self) -> None:
        """Start the H2D copy of the filled prefix into the buffer not in use; update() waits on it."""
        n = self._filled() if self.is_initialized else 0
        if n == 0 or not self._may_prefetch():
            return
        bufs = self._resolve_buffers()
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
        bufs, n = self._resolve_buffers(), self._filled()
        i = 1 - bufs.current
        pre, self._prefetched = self._prefetched, None
        if pre is not None and pre[1] == n and bufs.reserved is self and pre[0] == i:
            pre[2].wait()  # the current stream waits for the H2D copy
            self._last_read = pre[2]
        else:
            if pre is not None:
                pre[2].wait()  # a stale prefetch: ordered before anything touches its buffer again
            if n:
                dsts, srcs = (
                    [bufs.k[i][:, :, :n], bufs.v[i][:, :, :n]],
                    [self._host_k[:, :, :n], self._host_v[:, :, :n]],
                )
                self._last_read = _engine.copy_into(dsts, srcs, True)
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

    # transformers' operations, on the arena -----------------------------------------------------

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        n = self._filled() if self.is_initialized else 0
        if n == 0:
            return
        idx = beam_idx.to(_CPU)
        if self._exposed:  # StaticCache's reorder makes new tensors: a reference handed out before sees none of it
            self._rebatch(lambda t: t.index_select(0, idx))
            return
        self._drop_prefetch()
        dsts = [self._host_k[:, :, :n], self._host_v[:, :, :n]]
        srcs = [t[:, :, :n].index_select(0, idx) for t in self._own_kv()]  # read once written
        # Host to host on the engine's stream, after the H2D copies still reading the arena layer.
        _engine.copy_into(dsts, srcs, True)

    def _rebatch(self, pick) -> None:
        if not self.is_initialized:
            return
        k, v = (pick(t).contiguous() for t in self._own_kv())
        self._set_arena(k, v)
        self.batch_size = k.shape[0]

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rebatch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        idx = indices.to(_CPU) if isinstance(indices, torch.Tensor) else indices
        self._rebatch(lambda t: t[idx])

    def crop(self, tokens_to_remove: int) -> None:
        if not self.is_initialized:
            return
        remove = crop_count(tokens_to_remove, int(self.get_seq_length()))
        check_croppable(self, remove)
        if remove:
            self._drop_prefetch()
            self._shorten(remove)  # positions past the length are zeroed in the device buffer when taken

    def _shorten(self, remove: int) -> None:
        raise NotImplementedError

    # deepcopy / pickle -------------------------------------------------------------------------

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self._host_k is not None:
            state["_host_k"], state["_host_v"] = self._own_kv()  # waits for the D2H copies
        state.update(_buffers=None, _prefetched=None, _last_read=None, _dev_k=None, _dev_v=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._host_k is not None:  # plain CPU tensors now: back into this process's arena
            self._set_arena(self._host_k, self._host_v)
        if isinstance(self.cumulative_length, torch.Tensor):
            torch._dynamo.mark_static_address(self.cumulative_length)


class OffloadedStaticLayer(_StaticOffloaded, StaticLayer):
    """A full-attention static layer whose K/V live in the pinned arena between uses."""

    def __init__(self, max_cache_len: int, buffers: dict | None = None, **kwargs):
        super().__init__(max_cache_len=max_cache_len, **kwargs)
        self._seq = 0
        self._init_offload({} if buffers is None else buffers)

    def _filled(self) -> int:
        return self._seq

    def _out_len(self, n: int) -> int:
        return self.max_cache_len

    def update(self, key_states, value_states, *args, **kwargs):
        start, n = self._seq, key_states.shape[-2]
        if start + n > self.max_cache_len:
            raise IndexError(
                f"OffloadedStaticKVCache: {start} cached tokens + {n} new exceed max_cache_len={self.max_cache_len}"
            )
        # The length moves once the store succeeded (HostLimitError leaves the layer as it was).
        with self._first_update(key_states, value_states):
            k, v = self._take_buffer(start + n)
            k[:, :, start : start + n].copy_(key_states)
            v[:, :, start : start + n].copy_(value_states)
            self._store_positions(start, key_states, value_states)
        self._seq = start + n
        self.cumulative_length.add_(n)
        _count(kv_layer_updates=1, kv_new_token_bytes=key_states.nbytes + value_states.nbytes)
        return k, v

    def _shorten(self, remove: int) -> None:
        self._seq -= remove
        self.cumulative_length.sub_(remove)

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

    def _out_len(self, n: int) -> int:
        """The length StaticSlidingWindowLayer.update returns for `n` new tokens."""
        cur, window = self.cumulative_length_int, self.max_cache_len
        if cur >= window:
            return window if n == 1 else window - 1 + n
        if cur + n > window:
            return n if cur == 0 else cur + n
        return window

    def update(self, key_states, value_states, *args, **kwargs):
        start, n, window = self.cumulative_length_int, key_states.shape[-2], self.max_cache_len
        with self._first_update(key_states, value_states):
            self._dev_k, self._dev_v = self._take_buffer(min(start + n, window))
            try:  # StaticCache's own update, on the device buffer
                keys, values = StaticSlidingWindowLayer.update(self, key_states, value_states, *args, **kwargs)
                if start + n <= window:  # written in place at [start, start + n)
                    self._store_positions(start, key_states, value_states)
                else:  # the window moved: all of it changed
                    self._store_positions(0, self._dev_k, self._dev_v)
            except BaseException:
                # A failed store (HostLimitError) leaves the layer as it was: the lengths the update moved go back.
                moved = self.cumulative_length_int - start
                if moved:
                    self.cumulative_length_int = start
                    self.cumulative_length.sub_(moved)
                raise
            finally:
                self._dev_k = self._dev_v = None
        _count(kv_layer_updates=1, kv_new_token_bytes=key_states.nbytes + value_states.nbytes)
        return keys, values

    def _shorten(self, remove: int) -> None:  # only before the window dropped anything (check_croppable)
        self.cumulative_length_int -= remove
        self.cumulative_length.sub_(remove)

    def reset(self) -> None:
        self._drop_prefetch()
        self.cumulative_length_int = 0
        self.cumulative_length.zero_()


# The resident layers that resident_op handles: its crop and batch operations are theirs exactly. Any
# other layer (a subclass too: a hybrid one also holds linear-attention states) runs its own.
_PLAIN_STATIC = (StaticLayer, StaticSlidingWindowLayer)

# handle -> cache, for the custom op: weak values, so a dropped cache's entry goes with it.
_CACHES: weakref.WeakValueDictionary[int, OffloadedStaticKVCache] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


class OffloadedStaticKVCache(StaticCache):
    """A ``StaticCache`` whose full-attention layers keep their K/V in offcache's pinned arena.

    Usage: ``model.generate(**inputs, cache=OffloadedStaticKVCache(config=model.config, max_cache_len=n))``
    (``past_key_values=`` before transformers 5.24). ``max_batch_size``, ``dtype`` and ``device`` are
    accepted as StaticCache accepts them, and likewise unused: shapes, dtype and device come from the
    first update.
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
        self._buffers = _BufferPool()  # device buffers shared by the offloaded layers, by shape
        shared = _kv_shared_sources(config)
        self.layers = [layer if i in shared else self._offloaded(layer) for i, layer in enumerate(self.layers)]
        self._offloaded_idx = [i for i, layer in enumerate(self.layers) if isinstance(layer, _StaticOffloaded)]
        self._register()

    def _register(self) -> None:
        self._handle = next(_HANDLES)
        _CACHES[self._handle] = self
        # A tensor, not an int: dynamo guards on int attributes (a recompile per cache), not on tensor values.
        self._handle_t = torch.tensor(self._handle)

    def _offloaded(self, layer):
        if type(layer) is StaticLayer:
            return OffloadedStaticLayer(layer.max_cache_len, self._buffers)
        if type(layer) is StaticSlidingWindowLayer and self.offload_sliding:
            # layer.max_cache_len is already min(window, max_cache_len)
            return OffloadedStaticSlidingLayer(layer.max_cache_len, layer.max_cache_len, self._buffers)
        return layer  # sliding (resident by default), linear attention and others: as StaticCache has them

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        if torch.compiler.is_compiling():
            if not isinstance(layer, _StaticOffloaded):
                return layer.update(key_states, value_states, *args, **kwargs)  # traced as StaticCache's
            # The outputs are allocated by the graph and filled by the op: under mode="reduce-overhead"
            # they live in the CUDA graph pool, so the next graph reads them where the op wrote them.
            b, h, out_len = *key_states.shape[:2], layer._out_len(key_states.shape[-2])
            out_k = key_states.new_empty((b, h, out_len, key_states.shape[-1]))
            out_v = value_states.new_empty((b, h, out_len, value_states.shape[-1]))
            torch.ops.offcache.static_kv_update(
                key_states, value_states, layer.cumulative_length, self._handle_t, layer_idx, out_k, out_v
            )
            return out_k, out_v
        return self._update_eager(key_states, value_states, layer_idx, *args, **kwargs)

    def _update_eager(self, key_states, value_states, layer_idx, *args, **kwargs):
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

    # transformers' operations: StaticCache's layers lack some; resident layers get them here ---------

    def _each(self, op: str, arg) -> None:
        for layer in self.layers:
            if type(layer) in _PLAIN_STATIC:
                resident_op(layer, op, arg)
            else:  # ours; linear, hybrid, indexed and dummy layers: their own (or transformers' error), as
                getattr(layer, op)(arg)  # StaticCache calls it (a hybrid layer's crop rolls its states back too)

    def crop(self, tokens_to_remove: int) -> None:
        self._each("crop", tokens_to_remove)

    def activate_past_recording(self, **kwargs) -> None:
        # Assisted decoding calls this first: a static window cannot keep the tokens a rollback needs.
        # kwargs: the installed transformers' (5.25: recurrent_states_to_keep, for the linear-attention layers).
        if any(getattr(layer, "is_sliding", False) for layer in self.layers):
            raise ValueError(
                "assisted generate is not supported with static sliding window layers: OffloadedStaticKVCache "
                "cannot roll a window back once it dropped tokens (use OffloadedKVCache)"
            )
        super().activate_past_recording(**kwargs)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._each("batch_repeat_interleave", repeats)
        self._drop_unused_buffers()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._each("batch_select_indices", indices)
        self._drop_unused_buffers()

    def _drop_unused_buffers(self) -> None:
        """Device buffers of the old batch size: no layer will take them again."""
        shapes = {_buffer_key(ly) for ly in self.layers if isinstance(ly, _StaticOffloaded) and ly._host_k is not None}
        for key in [k for k in self._buffers if k not in shapes]:
            del self._buffers[key]

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._register()


def _kv_shared_sources(config) -> set[int]:
    """Layers whose K/V later layers of the same step read through ``shared_kv_states`` (Gemma3n, Gemma4).

    Each is the last cached layer of its type; kept resident, since an offloaded layer's device buffer
    is refilled by the next layers' prefetches while the sharing layers still read it.
    """
    text = config.get_text_config(decoder=True)
    modes = getattr(text, "kv_sharing_modes", None)  # transformers >= 5.2x names the producers "store"
    if modes is not None:
        return {i for i, mode in enumerate(modes) if mode == "store"}
    if not (getattr(text, "num_kv_shared_layers", 0) or 0):
        return set()
    types = get_layer_types_and_kwargs(text)[0]  # the cached layers: shared ones are cut off
    return {len(types) - 1 - types[::-1].index(t) for t in set(types)}


def _run_update(key_states, value_states, cumulative_length, handle, layer_idx):
    """The eager update of an offloaded layer, called from a compiled graph: host bookkeeping at every call."""
    cache = _CACHES[int(handle)]
    layer = cache.layers[layer_idx]
    # The op mutates only what it declares: the update advances the `cumulative_length` it was given.
    # Under inductor that is a copy of the layer's own (a graph input), which the graph itself may
    # still read after this call (rotary positions, the mask) and writes back at its end.
    own, layer.cumulative_length = layer.cumulative_length, cumulative_length
    try:
        return cache._update_eager(key_states, value_states, layer_idx)
    finally:
        now = layer.cumulative_length
        if now is not cumulative_length:  # lazy_initialization moved it to the device: the layer keeps that
            cumulative_length.copy_(now)
            own = now
        layer.cumulative_length = own


@torch.library.custom_op("offcache::static_kv_update", mutates_args=("cumulative_length", "out_k", "out_v"),
                         tags=(torch.Tag.cudagraph_unsafe,))  # fmt: skip
def _static_kv_update(
    key_states: torch.Tensor,  # [batch, heads, new, k_dim]
    value_states: torch.Tensor,  # [batch, heads, new, v_dim]
    cumulative_length: torch.Tensor,  # [] int64
    handle: torch.Tensor,  # [] int64: the cache's key in _CACHES
    layer_idx: int,
    out_k: torch.Tensor,  # [batch, heads, out_len, k_dim]: the layer's keys, written here
    out_v: torch.Tensor,  # [batch, heads, out_len, v_dim]: its values
) -> None:
    """One offloaded layer's update, run eagerly from a compiled graph (host bookkeeping at every call).

    Its one device-to-device copy per layer and step: the layer's K/V into the graph's outputs, which
    must not alias the device buffers that later layers' prefetches rewrite."""
    k, v = _run_update(key_states, value_states, cumulative_length, handle, layer_idx)
    got, want = [(t.shape, t.dtype) for t in (k, v)], [(t.shape, t.dtype) for t in (out_k, out_v)]
    if got != want:  # copy_ would broadcast a shorter one, or cast another dtype, silently
        raise RuntimeError(
            f"OffloadedStaticKVCache: layer {layer_idx}'s update returned K/V of {got}, but the compiled graph "
            f"expects {want}"
        )
    out_k.copy_(k)
    out_v.copy_(v)


@_static_kv_update.register_fake
def _(key_states, value_states, cumulative_length, handle, layer_idx, out_k, out_v):
    return None
