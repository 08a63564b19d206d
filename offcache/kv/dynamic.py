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

An offloaded layer's ``keys`` / ``values`` are CPU tensors viewing the arena
(``[batch, heads, seq, dim]``), built when read: a read waits for the layer's
pending D2H copies and joins its chunks into one, so a generation nobody
inspects pays nothing for them. ``reorder_cache`` (beam search), ``crop``
(assisted decoding), ``batch_repeat_interleave`` and ``batch_select_indices``
run transformers' own layer code on those host tensors (no PCIe traffic: the
next fetch brings the result) and store the result back. ``copy.deepcopy`` and
pickling wait for the copies and copy the K/V.
"""

from __future__ import annotations

import functools

import torch

from offcache.util.extras import as_missing

try:
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
except ModuleNotFoundError as _missing:  # one line naming the extra, as offcache.OffloadedKVCache gives
    raise as_missing(_missing, "transformers", "kv", "offcache.kv.dynamic") from None


from offcache import engine as _engine
from offcache.kv.counters import count as _count
from offcache.kv.layer import OffloadedLayerBase
from offcache.kv.static import OffloadedStaticKVCache  # noqa: F401  (the static one, for offcache.__getattr__)

_CPU = torch.device("cpu")


@functools.cache
def cache_kwarg() -> str:
    """The keyword under which the installed transformers takes a cache in ``generate`` and ``forward``:
    ``cache`` where it has it (5.24 deprecates ``past_key_values``), else ``past_key_values``."""
    import inspect

    from transformers import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def _on_cpu(index):
    return index.to(_CPU) if isinstance(index, torch.Tensor) else index


def _allocations(tensors) -> int:
    """How many allocations fetched tensors live in (the engine packs small ones into one)."""
    return len({_engine._C.allocation_of(t).data_ptr() for t in tensors})


def _views_of(new: tuple[torch.Tensor, torch.Tensor], old: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether each new tensor shares its memory with the old one (a slice of it, as crop makes)."""
    return all(n.untyped_storage().data_ptr() == o.untyped_storage().data_ptr() for n, o in zip(new, old))


class _Offloaded(OffloadedLayerBase):
    """Arena-backed K/V chunks (along the sequence) and an in-flight prefetch, shared by the layer classes."""

    _shadow_class = DynamicLayer  # whose operations run on the host K/V

    def _init_offload(self) -> None:
        self.__dict__.setdefault("_host_k", [])
        self.__dict__.setdefault("_host_v", [])
        self._prefetched = None  # (device tensors, version fetched, number of K chunks, ticket)
        self._last_read = None  # the ticket of the last H2D copy that read the host chunks
        self._version = 0  # bumped by every change of the host chunks: a prefetch of an older one is stale

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
        # CacheLayerMixin.__init__ sets None; code outside may set a tensor: it goes to the arena.
        self.__dict__[name] = [] if t is None else _engine.store([t.contiguous()], _CPU)
        if t is not None:
            self._changed()
            if name == "_host_k":
                self._set_length(t.shape[-2])

    def _set_length(self, n: int) -> None:
        pass

    def _handed_out(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """K and V for code outside the cache: host tensors it may edit in place, through ``.data`` or
        numpy too, where no version counter sees it. So any prefetch of this layer is dropped (the next
        update fetches what the host tensors hold then), and the copies still reading them complete
        first (on a GPU a fetch's H2D copy can still be reading when the forward returns)."""
        self._drop_prefetch(on_host=True)
        _engine.wait_on_host(self.__dict__.get("_last_read"))
        self._last_read = None
        k, v = self._host_tensors()
        # DynamicCache's update makes new tensors: a reference taken now sees no later step. The next
        # update reads what these hold then, and stores everything as a new chunk, so these leave the layer.
        self._exposed = k is not None
        return k, v

    def _host_tensors(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's K and V as single arena tensors, written: waits for this layer's copies."""
        if not self._host_k:
            return None, None
        k, v = self._joined()
        if len(self._host_k) > 1 or len(self._host_v) > 1:  # joined once; later reads are free
            try:
                k, v = _engine.store([k, v], _CPU)
            except _engine.HostLimitError as exc:  # the join needs the layer's size in host room
                raise _engine.HostLimitError(
                    f"offcache: reading an offloaded layer's keys/values joins its {len(self._host_k)} chunks into "
                    f"one tensor each ({k.nbytes + v.nbytes} bytes), which the host limit has no room for; the "
                    f"cache is unchanged and its steps carry on. The engine said: {exc}"
                ) from None
            self._host_k, self._host_v = [k], [v]  # same values: a prefetch would stay valid
            self._wait([k, v])
        return k, v

    def _joined(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as one written CPU tensor each: the arena chunk itself, or the chunks' concatenation."""
        chunks = [self._wait(c) for c in (self._host_k, self._host_v)]
        return tuple(c[0] if len(c) == 1 else torch.cat(c, dim=-2) for c in chunks)

    @staticmethod
    def _wait(chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        for c in chunks:
            _engine.wait_stored(c)
        return chunks

    def _changed(self) -> None:
        self._version += 1

    # the copies ------------------------------------------------------------------------------

    def prefetch(self) -> None:
        """Start the H2D copy of this layer's K/V; update() waits on it (not while handed out: _may_prefetch)."""
        if self._host_k and self._may_prefetch():
            tensors, ticket = _engine.fetch(self._host_k + self._host_v, self.device, False)
            _count(kv_output_allocations=_allocations(tensors))
            self._prefetched = (tensors, self._version, len(self._host_k), ticket)

    def offload(self) -> None:  # the K/V already live in the arena
        pass

    def _past(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This layer's cached K/V on its device: the prefetch if current, else a fetch now."""
        pre, self._prefetched = self._prefetched, None
        if not self._host_k:
            return None
        if pre is not None and pre[1] == self._version:
            tensors, _, n, ticket = pre
            ticket.wait()  # the consumer stream waits on the H2D event
        else:
            if pre is not None:
                pre[-1].wait()  # a stale prefetch: ordered before its memory is reused
            n = len(self._host_k)
            tensors, ticket = _engine.fetch(self._host_k + self._host_v, self.device, True)
            _count(kv_output_allocations=_allocations(tensors))
        self._last_read = ticket
        k, v = tensors[:n], tensors[n:]
        _count(kv_output_allocations=2 * (n > 1))
        return (k[0] if len(k) == 1 else torch.cat(k, dim=-2)), (v[0] if len(v) == 1 else torch.cat(v, dim=-2))

    def _drop_offloaded(self) -> None:
        self._drop_prefetch()
        self._host_k, self._host_v = [], []
        self._changed()

    # transformers' operations, on the host K/V -------------------------------------------------

    def _shadow(self, keys: torch.Tensor, values: torch.Tensor):
        """A plain transformers layer holding `keys`/`values` and this layer's other state (length, ...)."""
        shadow = self._shadow_class.__new__(self._shadow_class)
        shadow.__dict__.update({k: v for k, v in self.__dict__.items() if not k.startswith("_host")})
        shadow.keys, shadow.values = keys, values  # what transformers' code leaves there is stored, not these
        return shadow

    def _run_on_host(self, op: str, *args) -> None:
        if not self._host_k:  # nothing cached: nothing to change
            return
        shadow = self._shadow(*self._joined())
        before = shadow.keys, shadow.values
        getattr(self._shadow_class, op)(shadow, *args)  # transformers' own code: its rules and errors
        for name in ("cumulative_length", "record_past"):
            if name in shadow.__dict__:
                setattr(self, name, shadow.__dict__[name])
        if shadow.keys is not before[0] or shadow.values is not before[1]:
            if len(self._host_k) == 1 and _views_of((shadow.keys, shadow.values), before):
                # A view of the layer's one arena chunk (crop slices): kept as transformers' layer keeps it,
                # so a reference taken before still shares its memory, as DynamicCache's does.
                k, v = shadow.keys, shadow.values
            else:
                k, v = _engine.store([shadow.keys.contiguous(), shadow.values.contiguous()], _CPU)
            self._host_k, self._host_v = [k], [v]
            self._changed()
            self._set_length(k.shape[-2])

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
        k, v = self._host_tensors()  # waits for this layer's copies
        state = dict(self.__dict__)
        state["_host_k"], state["_host_v"] = ([k], [v]) if k is not None else ([], [])
        state["_prefetched"] = state["_last_read"] = None  # tickets: the copy fetches again
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._host_k:  # plain CPU tensors now: back into this process's arena
            k, v = _engine.store(self._host_k + self._host_v, _CPU)
            self._host_k, self._host_v = [k], [v]


class OffloadedLayer(_Offloaded, DynamicLayer):
    """A full-attention layer whose K/V live in the pinned arena between steps."""

    def __init__(self, compact_every: int = 16, **kwargs):
        super().__init__(**kwargs)
        self.compact_every = compact_every
        self._seq = 0
        self._init_offload()

    def _set_length(self, n: int) -> None:
        self._seq = n

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        # Compacting: one chunk for everything bounds the copies per fetch, and takes the chunk handed out
        # (keys/values) out of the layer; else only the new tokens go D2H.
        compact = self.__dict__.get("_exposed", False) or len(self._host_k) + 1 >= self.compact_every
        # Nothing of the layer changes until the store succeeded (HostLimitError leaves it as it was).
        with self._first_update(key_states, value_states):
            past = self._past()
            if past is None:
                keys, values = key_states, value_states
            else:
                _count(kv_output_allocations=2)
                keys = torch.cat([past[0], key_states], dim=-2)
                values = torch.cat([past[1], value_states], dim=-2)
            k, v = _engine.store([keys, values] if compact else [key_states, value_states], _CPU)
        if compact:
            self._host_k, self._host_v = [k], [v]
            self._exposed = False
        else:
            self._host_k.append(k)
            self._host_v.append(v)
        self._seq = keys.shape[-2]
        self._changed()
        _count(kv_layer_updates=1, kv_new_token_bytes=key_states.nbytes + value_states.nbytes)
        return keys, values

    def get_seq_length(self) -> int:
        return self._seq if self.is_initialized else 0

    def reset(self) -> None:
        self._drop_offloaded()
        self._seq = 0


class OffloadedSlidingLayer(_Offloaded, DynamicSlidingWindowLayer):
    """A sliding-window layer offloaded too (``offload_sliding=True``): its window moves whole."""

    _shadow_class = DynamicSlidingWindowLayer

    def __init__(self, sliding_window: int, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self._init_offload()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        # The installed transformers' own DynamicSlidingWindowLayer.update (what it keeps and what it
        # returns: 5.23+ returns only the visible part while it records the past for assisted decoding),
        # run on a shadow holding the past fetched from the arena; what it keeps is stored.
        with self._first_update(key_states, value_states):  # nothing changes until the store succeeded
            past = self._past()
            shadow = self._shadow(*(past if past is not None else (key_states[:, :, :0], value_states[:, :, :0])))
            out = self._shadow_class.update(shadow, key_states, value_states, *args, **kwargs)
            k, v = _engine.store([shadow.keys.contiguous(), shadow.values.contiguous()], _CPU)
        for name, value in shadow.__dict__.items():  # what the update set (cumulative_length, ...)
            if name not in ("keys", "values") and not name.startswith("_host") and value is not self.__dict__.get(name):
                setattr(self, name, value)
        self._host_k, self._host_v = [k], [v]
        self._changed()
        return out

    def reset(self) -> None:
        self._drop_offloaded()
        self.cumulative_length = 0


class OffloadedKVCache(DynamicCache):
    """A ``DynamicCache`` whose offloadable layers keep their K/V in offcache's pinned arena.

    Usage: ``model.generate(**inputs, cache=OffloadedKVCache(config=model.config))`` (``past_key_values=``
    before transformers 5.24: ``cache_kwarg()`` names the installed one's keyword).
    """

    def __init__(self, config=None, offload_sliding: bool = False, compact_every: int = 16):
        super().__init__(config=config)
        self.compact_every = compact_every
        self.offload_sliding = offload_sliding
        if self.layer_class_to_replicate is not None:  # no config: layers appear as they are used
            self.layer_class_to_replicate = functools.partial(OffloadedLayer, compact_every)  # picklable
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

    def reset(self) -> None:
        """Every layer empty, as a new cache: resident dynamic layers are dropped as transformers 5.24's are
        (before it, they were zeroed and kept their length, so the next tokens followed zeros)."""
        for layer in self.layers:
            if isinstance(layer, _Offloaded) or "reset" in vars(DynamicLayer) or not isinstance(layer, DynamicLayer):
                layer.reset()
            else:  # transformers' own reset first: a hybrid layer's linear-attention states too
                layer.reset()
                layer.keys = layer.values = None
                layer.is_initialized = False
                if hasattr(layer, "cumulative_length"):
                    layer.cumulative_length = 0

    def _next_offloaded(self, layer_idx: int) -> int | None:
        n = len(self.layers)
        for step in range(1, n):
            i = (layer_idx + step) % n
            if isinstance(self.layers[i], _Offloaded):
                return i
        return None
