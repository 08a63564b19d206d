"""The offloaded layers of OffloadedKVCache: each of a layer's K and V in one arena buffer.

An offloaded layer's K and V each live in one arena tensor ``[batch, heads, capacity, dim]``
(``_host_k`` / ``_host_v``) whose positions ``[0, _len)`` hold the cached tokens.

- A full-attention layer (OffloadedLayer) appends. Each update copies only its new tokens D2H,
  into ``[_len, _len + n)`` of the buffers (``engine.copy_into``, on the D2H stream): no
  compaction, nothing stored again. When they do not fit, the layer moves to buffers of 1.5x the
  length it needs (rounded up to 64 positions): a store of the new buffers (the engine copies the
  empty tensor it is given: a host-side copy of their size) and one host-to-host copy of the
  prefix, on the engine's stream. So the buffers grow geometrically, a few times in a long
  generation, and the host-to-host bytes per new token are bounded (``kv_host_copy_bytes``).
- Its K/V come back in one H2D copy per tensor into one device allocation each, ``_len + n``
  long, and the update writes the new tokens into place (no ``torch.cat``): at most 2 H2D copies
  and 2 allocations per layer and step. The cache prefetches two offloaded layers ahead, with n
  guessed as the layer's last update's count (1 while decoding); another n moves the prefix into
  a tensor of the right length on the device.
- A sliding layer (OffloadedSlidingLayer, ``offload_sliding=True``) moves its window whole, as
  before: transformers' own update on the fetched past, the window it keeps stored at its length.

``keys`` / ``values`` hand out the views ``[:, :, :_len]`` of the buffers, once the copies into
them landed and those reading them finished; code outside may edit them in place (``.data`` and
numpy too). A layer handed out is not prefetched, and its next update reads what they hold then
and moves the layer to new buffers first (copy on write), so a reference kept across that step sees
none of it, as DynamicCache's update makes new tensors. ``crop`` is a slice, as DynamicCache's (a
reference keeps sharing the memory); ``reorder_cache`` writes the buffers in place unless handed
out; batch changes make new buffers.
"""

from __future__ import annotations

import math

import torch

from offcache.util.extras import as_missing

try:
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
except ModuleNotFoundError as _missing:  # one line naming the extra, as offcache.OffloadedKVCache gives
    raise as_missing(_missing, "transformers", "kv", "offcache.kv.dynamic") from None

from offcache import engine as _engine
from offcache.kv.counters import count as _count
from offcache.kv.layer import OffloadedLayerBase

_CPU = torch.device("cpu")
GROWTH = 1.5  # a full layer's buffers hold this many times the positions they must hold when made
ALIGN = 64  # ... rounded up to a multiple of this many positions


def _on_cpu(index):
    return index.to(_CPU) if isinstance(index, torch.Tensor) else index


def _prefix_of(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether `view` is ``buffer[:, :, :m]`` (what crop makes of a layer's handed-out K/V)."""
    return (
        view.data_ptr() == buffer.data_ptr()
        and view.stride() == buffer.stride()
        and view.shape[:-2] == buffer.shape[:-2]
        and view.shape[-1] == buffer.shape[-1]
        and view.shape[-2] <= buffer.shape[-2]
    )


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` views `b`'s memory."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _source(t: torch.Tensor) -> torch.Tensor:
    """`t` as copy_into takes it: offcache's host memory (a buffer's rows) as is, anything else contiguous."""
    return t if _engine.is_offcache_tensor(t) else t.contiguous()


class DynamicOffloaded(OffloadedLayerBase):
    """A layer's arena buffers, its device K/V in flight (the prefetch) and transformers' operations on the
    buffers, shared by the layer classes."""

    _shadow_class = DynamicLayer  # whose operations run on the host K/V

    def _init_offload(self) -> None:
        self.__dict__.setdefault("_host_k", None)
        self.__dict__.setdefault("_host_v", None)
        self._len = 0  # positions [0, _len) of the buffers hold the cached tokens
        self._next_n = 1  # the new tokens the next update is expected to bring (the prefetch's room)
        self._prefetched = None  # (device K, device V, version fetched, ticket)
        self._last_read = None  # the ticket of the last H2D copy that read the buffers
        self._version = 0  # bumped by every change of the host K/V: a prefetch of an older one is stale
        self._views = None  # (buffer K, length, K view, V view): the handed-out views, the same objects per read
        self._exposed = False  # handed out since the last update

    def _capacity(self, n: int) -> int:
        """The positions of buffers made to hold `n`."""
        return n

    # keys / values: what transformers' layers expose, read from the arena ------------------------

    @property
    def keys(self) -> torch.Tensor | None:
        return self._handed_out()[0]

    @keys.setter
    def keys(self, t) -> None:
        self._assign("_host_k", t)

    @property
    def values(self) -> torch.Tensor | None:
        return self._handed_out()[1]

    @values.setter
    def values(self, t) -> None:
        self._assign("_host_v", t)

    def _assign(self, name: str, t) -> None:
        # CacheLayerMixin.__init__ sets None; code outside may set a tensor: it goes to a new buffer.
        if t is None:
            self.__dict__[name] = None
            return
        t = t.detach()
        (buf,) = self._new_buffers([t], t.shape[-2], wait=True)
        self._drop_prefetch()
        self.__dict__[name] = buf
        if name == "_host_k":
            self._len = t.shape[-2]
        self._changed()

    def _handed_out(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """K and V for code outside the cache: host views it may edit in place, through ``.data`` or numpy
        too, where no version counter sees it. So any prefetch of this layer is dropped (the next update
        fetches what they hold then), and the copies still reading the buffers complete first (on a GPU a
        fetch's H2D copy can still be reading when the forward returns)."""
        self._drop_prefetch(on_host=True)
        _engine.wait_on_host(self.__dict__.get("_last_read"))
        self._last_read = None
        k, v = self._host_kv()
        self._exposed = k is not None
        return k, v

    def _host_kv(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Views of the cached positions of the buffers, once the copies writing them landed."""
        hk, hv = self.__dict__.get("_host_k"), self.__dict__.get("_host_v")
        if hk is None:
            return None, None
        _engine.wait_stored(hk)
        _engine.wait_stored(hv)
        views = self.__dict__.get("_views")
        if views is None or views[0] is not hk or views[1] != self._len:
            views = self._views = (hk, self._len, hk[:, :, : self._len], hv[:, :, : self._len])
        return views[2], views[3]

    def _changed(self) -> None:
        self._version += 1

    def _new_buffers(self, srcs: list[torch.Tensor], need: int, wait: bool = False) -> list[torch.Tensor]:
        """Arena buffers holding `srcs` (each ``[batch, heads, m, dim]``) in their first m positions, with
        room for `need` positions as this layer grows (``_capacity``). `wait`: the host waits for the copies
        (the sources are then free to change). Nothing of the layer changes here: the caller swaps them in."""
        length = srcs[0].shape[-2]
        cap = max(self._capacity(max(need, length)), length)
        host = sum(s.nbytes for s in srcs if s.device.type == "cpu")
        if cap == length:  # exactly their size: one store
            bufs = _engine.store([s.contiguous() for s in srcs], _CPU)
            _count(kv_host_copy_bytes=host)
        else:
            empty = [torch.empty((*s.shape[:-2], cap, s.shape[-1]), dtype=s.dtype) for s in srcs]
            bufs = _engine.store(empty, _CPU)
            _count(kv_host_copy_bytes=sum(b.nbytes for b in bufs), kv_buffer_moves=1)
            if length:
                ticket = _engine.copy_into([b[:, :, :length] for b in bufs], [_source(s) for s in srcs])
                _count(kv_host_copy_bytes=host)
                if wait:
                    _engine.wait_on_host(ticket)
        if wait:
            for b in bufs:
                _engine.wait_stored(b)
        return bufs

    # the copies ------------------------------------------------------------------------------

    def prefetch(self) -> None:
        """Start the H2D copy of this layer's K/V into device tensors with room for the next update's new
        tokens; update() waits on it (not while handed out: _may_prefetch)."""
        n = self._len
        if not n or self._host_k is None or not self._may_prefetch():
            return
        k, v = self._allocate(self._host_k, self._host_v, n + self._next_n)
        ticket = _engine.copy_into([k[:, :, :n], v[:, :, :n]], [self._host_k[:, :, :n], self._host_v[:, :, :n]])
        self._prefetched = (k, v, self._version, ticket)

    def offload(self) -> None:  # the K/V already live in the arena
        pass

    def _allocate(self, like_k: torch.Tensor, like_v: torch.Tensor, length: int):
        """Device K and V `length` long, of `like_k`'s / `like_v`'s batch, heads, dim and dtype."""
        _count(kv_output_allocations=2)
        return tuple(
            torch.empty((*t.shape[:-2], length, t.shape[-1]), dtype=t.dtype, device=self.device)
            for t in (like_k, like_v)
        )

    def _fetched(self, key_states, value_states, new: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Device K/V ``_len + new`` long whose first ``_len`` positions hold the cached ones (the prefetch
        if current, else a fetch now); None when nothing is cached and there is no room to make."""
        pre, self._prefetched = self._prefetched, None
        n, total = self._len, self._len + new
        if pre is not None:
            pre[-1].wait()  # the current stream waits for the H2D copy (a stale one: before its memory goes)
            if pre[2] == self._version and n and self._host_k is not None:
                self._last_read = pre[-1]
                if pre[0].shape[-2] == total:
                    return pre[0], pre[1]
                # Another number of new tokens than the prefetch made room for: the prefix, on the device.
                k, v = self._allocate(key_states, value_states, total)
                k[:, :, :n].copy_(pre[0][:, :, :n])
                v[:, :, :n].copy_(pre[1][:, :, :n])
                return k, v
        if not total:
            return None
        k, v = self._allocate(key_states, value_states, total)
        if n:
            srcs = [self._host_k[:, :, :n], self._host_v[:, :, :n]]
            self._last_read = _engine.copy_into([k[:, :, :n], v[:, :, :n]], srcs, True)
        return k, v

    def _commit(self, bufs: list[torch.Tensor] | None, length: int) -> None:
        """After an update that succeeded: its buffers (when it moved the layer) and length."""
        if self._exposed:  # nothing may read the buffers handed out once the update returned
            _engine.wait_on_host(self._last_read)
            self._last_read = None
        if bufs is not None:
            self._host_k, self._host_v = bufs
            self._exposed = False
        self._len = length
        self._changed()

    def _drop_offloaded(self) -> None:
        self._drop_prefetch()
        self.__dict__.update(_host_k=None, _host_v=None, _views=None)
        self._len = 0
        self._exposed = False
        self._changed()

    # transformers' operations, on the host K/V -------------------------------------------------

    def _shadow(self, keys: torch.Tensor, values: torch.Tensor):
        """A plain transformers layer holding `keys`/`values` and this layer's other state (length, ...)."""
        shadow = self._shadow_class.__new__(self._shadow_class)
        skip = ("_host_k", "_host_v", "_views", "_prefetched", "_last_read")
        shadow.__dict__.update({k: v for k, v in self.__dict__.items() if k not in skip})
        shadow.keys, shadow.values = keys, values  # what transformers' code leaves there is kept, not these
        return shadow

    def _run_on_host(self, op: str, *args) -> None:
        if self.__dict__.get("_host_k") is None:  # nothing cached: nothing to change
            return
        k, v = self._host_kv()
        shadow = self._shadow(k, v)
        getattr(self._shadow_class, op)(shadow, *args)  # transformers' own code: its rules and errors
        for name in ("cumulative_length", "record_past"):
            if name in shadow.__dict__:
                setattr(self, name, shadow.__dict__[name])
        nk, nv = shadow.keys, shadow.values
        if nk is k and nv is v:
            return
        m = nk.shape[-2]
        if _prefix_of(nk, self._host_k) and _prefix_of(nv, self._host_v):
            # A slice from the start (crop): the buffers stay, shorter, so a reference taken before still
            # shares their memory, as DynamicCache's does.
            bufs = None
        elif _shares(nk, self._host_k) and _shares(nv, self._host_v):
            # Another slice of them (a sliding window's crop): kept as transformers keeps it, for the same reason.
            bufs = [nk, nv]
        elif (
            not self._exposed
            and nk.shape[:-2] == k.shape[:-2]
            and nv.shape[:-2] == v.shape[:-2]
            and (m <= min(self._host_k.shape[-2], self._host_v.shape[-2]))
        ):
            # The same batch, nothing handed out (reorder_cache): into the buffers, host to host, after the
            # copies still reading them (the engine orders it).
            self._drop_prefetch()
            _engine.copy_into([self._host_k[:, :, :m], self._host_v[:, :, :m]], [_source(nk), _source(nv)])
            _count(kv_host_copy_bytes=nk.nbytes + nv.nbytes)
            bufs = None
        else:  # new tensors (a batch change, or K/V handed out): new buffers
            bufs = self._new_buffers([nk, nv], m)
        self._drop_prefetch()
        if bufs is not None:
            self.__dict__.update(_host_k=bufs[0], _host_v=bufs[1])
            self._exposed = self._exposed and _shares(bufs[0], k)
        self._len = m
        self._changed()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._run_on_host("reorder_cache", _on_cpu(beam_idx))

    def crop(self, tokens_to_remove: int) -> None:
        self._run_on_host("crop", tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._run_on_host("batch_repeat_interleave", repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._run_on_host("batch_select_indices", _on_cpu(indices))

    # deepcopy / pickle -------------------------------------------------------------------------

    def __getstate__(self) -> dict:
        k, v = self._host_kv()  # waits for this layer's copies
        state = dict(self.__dict__)
        if k is not None:  # the cached positions only (a view would carry its whole buffer)
            k, v = (t if t.shape == b.shape else t.clone() for t, b in ((k, self._host_k), (v, self._host_v)))
        state.update(_host_k=k, _host_v=v, _prefetched=None, _last_read=None, _views=None, _exposed=False)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._host_k is not None:  # plain CPU tensors now: back into this process's arena
            self._host_k, self._host_v = self._new_buffers([self._host_k, self._host_v], self._len, wait=True)


class OffloadedLayer(DynamicOffloaded, DynamicLayer):
    """A full-attention layer whose K/V live in one arena buffer each between steps, appended in place."""

    def __init__(self, compact_every: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.compact_every = compact_every  # no longer used: the layer is one buffer, never compacted
        self._init_offload()

    def _capacity(self, n: int) -> int:
        return max(ALIGN, math.ceil(n * GROWTH / ALIGN) * ALIGN)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        start, n = self._len, key_states.shape[-2]
        # Nothing of the layer changes until the copies are issued (HostLimitError leaves it as it was).
        with self._first_update(key_states, value_states):
            keys, values = self._fetched(key_states, value_states, n)
            keys[:, :, start:].copy_(key_states)
            values[:, :, start:].copy_(value_states)
            bufs = self._append(keys[:, :, start:], values[:, :, start:], start)
        self._commit(bufs, start + n)
        self._next_n = n if start else 1  # after the prompt, one token at a time
        _count(kv_layer_updates=1, kv_new_token_bytes=key_states.nbytes + value_states.nbytes)
        return keys, values

    def _append(self, new_k: torch.Tensor, new_v: torch.Tensor, start: int) -> list[torch.Tensor] | None:
        """D2H the new tokens into positions [start, start + n) of the buffers; first into new buffers
        holding the prefix (returned) when they are too short, of another batch, or handed out."""
        end = start + new_k.shape[-2]
        hk, hv = self._host_k, self._host_v
        moved = None
        if (
            hk is None
            or self._exposed
            or end > min(hk.shape[-2], hv.shape[-2])
            or hk.shape[:-2] != new_k.shape[:-2]
            or hv.shape[:-2] != new_v.shape[:-2]
        ):
            prefix = [new_k[:, :, :0], new_v[:, :, :0]] if hk is None else [hk[:, :, :start], hv[:, :, :start]]
            # The host waits for the prefix's copy when handed out: the old buffers are the caller's once
            # this update returns.
            hk, hv = moved = self._new_buffers(prefix, end, wait=self._exposed)
        _engine.copy_into([hk[:, :, start:end], hv[:, :, start:end]], [new_k, new_v])
        return moved

    def get_seq_length(self) -> int:
        return self._len if self.is_initialized else 0

    def reset(self) -> None:
        self._drop_offloaded()
        self._next_n = 1


class OffloadedSlidingLayer(DynamicOffloaded, DynamicSlidingWindowLayer):
    """A sliding-window layer offloaded too (``offload_sliding=True``): its window moves whole."""

    _shadow_class = DynamicSlidingWindowLayer

    def __init__(self, sliding_window: int, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self._init_offload()
        self._next_n = 0  # the past is fetched exactly: transformers' update concatenates

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        # The installed transformers' own DynamicSlidingWindowLayer.update (what it keeps and what it
        # returns: 5.23+ returns only the visible part while it records the past for assisted decoding),
        # run on a shadow holding the past fetched from the arena; what it keeps is stored.
        with self._first_update(key_states, value_states):  # nothing changes until the store succeeded
            past = self._fetched(key_states, value_states, 0)
            shadow = self._shadow(*(past if past is not None else (key_states[:, :, :0], value_states[:, :, :0])))
            out = self._shadow_class.update(shadow, key_states, value_states, *args, **kwargs)
            bufs = self._new_buffers([shadow.keys, shadow.values], shadow.keys.shape[-2])
        skip = ("keys", "values", "_host_k", "_host_v", "_views", "_prefetched", "_last_read")
        for name, value in shadow.__dict__.items():  # what the update set (cumulative_length, ...)
            if name not in skip and value is not self.__dict__.get(name):
                setattr(self, name, value)
        self._commit(bufs, bufs[0].shape[-2])
        _count(kv_layer_updates=1, kv_new_token_bytes=key_states.nbytes + value_states.nbytes)
        return out

    def reset(self) -> None:
        self._drop_offloaded()
        self.cumulative_length = 0
