"""compressed-tensors' offloaded model weights on the offcache engine.

``offcache.patch_llmcompressor(weights=True)`` calls ``patch()`` here:

- ``OffloadCache.cls_from_device`` returns ``OffcacheCPUCache`` for a non-distributed
  ``"cpu"`` offload and ``OffcacheDiskCache`` for ``"disk"`` (the classes ``offload_module``
  builds every module's cache from).
  Distributed runs get ``offcache.weights_node.NodeSharedCPUCache`` for ``"cpu"`` (one shared
  region per node, where a per-rank arena would hold one copy per rank) and keep
  compressed-tensors' ``DistributedDiskCache`` for ``"disk"``.
- ``OffcacheCPUCache`` is compressed-tensors' ``CPUCache`` with its three device moves on
  the engine: ``offload`` snapshots into the pinned arena (and waits: the result is
  readable on return, as CPUCache's), ``onload`` is an engine fetch
  (the consumer's stream waits on an event, the host does not), ``update_offload`` an
  asynchronous copy back into the same arena block. Everything else (``__getitem__``,
  ``keep_onloaded_values``, the ``disable_*`` contexts, ``__delitem__``) is the base class's.
- ``OffcacheDiskCache`` is ``DiskCache`` with its onload reading the checkpoint's safetensors
  file through the engine (``fetch_file``: 8 MiB pieces, from the page cache or O_DIRECT, into
  pinned bounce buffers, each piece's H2D copy issued by the engine's I/O thread as soon as it
  is read, so it can be prefetched and never blocks the caller on the disk); its index,
  symlinks and update files are DiskCache's.
- The sequential pipeline's subgraphs are learnt by wrapping ``trace_subgraphs``: after the
  first forward of subgraph *i*, the weights of subgraphs *i+1 .. i+k* are fetched on the
  engine's stream (``OFFCACHE_WEIGHT_PREFETCH``, default k=1; 0 turns prefetch off). An
  onload of a prefetched tensor hands out the prefetched copy. Prefetched copies die at the
  end of the ``disable_offloading()`` context of the subgraph they were fetched for.

compressed-tensors 0.20's staging (``stage()``, ``is_staged``, ``stage_module_offload``,
``subgraph_onload_modules``): both classes stage on the engine (``OffcacheCPUCache``: an arena
tensor is staged already; ``OffcacheDiskCache``: read through ``fetch_file`` into host memory,
into the pinned arena for ``pin_memory``), and onload a staged tensor with an engine fetch. A
disk onload returns the type the installed DiskCache's does (0.20: the Parameter class kept).
``patch()`` first checks that the installed compressed-tensors is one these subclasses fit
(offcache/ct_drift.py). The state the classes and the prefetcher share (prefetched copies,
write-backs in flight, per-subgraph records) and its rules are in offcache/_weight_bookkeeping.py.

A prefetched copy is handed out only while its source is unchanged: not updated, deleted or
edited in place (version counter), and, for a host copy, holding the source's bytes (compared as
the engine's dedup table compares CPU sources, which sees edits through ``.data`` or numpy). An
offloaded tensor handed out under ``disable_onloading()`` loses its prefetched copy.

Write-backs are visible to every later read: an onload or a fetch is ordered after them on
the engine's streams, a read of the offloaded tensor through ``__getitem__`` under
``disable_onloading()`` waits for them, and every write-back has landed when the outermost
``disable_offloading()`` context ends (and at once for an update outside one). A host read
of ``offloaded_values`` directly, inside the context, may see the old bytes.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import torch

from offcache._extras import as_missing

try:
    from compressed_tensors.offload.cache.base import OffloadCache
    from compressed_tensors.offload.cache.cpu import CPUCache
    from compressed_tensors.offload.cache.disk import DiskCache
    from compressed_tensors.offload.cache.utils import catch_cpu_mem_error
    from compressed_tensors.offload.utils import to_tensor
except ModuleNotFoundError as _missing:  # one line naming the extra
    raise as_missing(
        _missing, ("compressed_tensors", "transformers"), "llmcompressor", "offcache.compressed_tensors"
    ) from None

from loguru import logger  # llm-compressor's and compressed-tensors' logger: its INFO lines show

from offcache import _engine
from offcache._safetensors import forget as _forget
from offcache._safetensors import locate as _locate
from offcache._weight_bookkeeping import (
    _drop_prefetched,
    _flush,
    _flush_all,
    _Prefetched,
    _state,
    _Subgraph,
    _take_prefetched,
    _wait,
    subgraph_stats,
)

__all__ = [
    "OffcacheCPUCache",
    "OffcacheDiskCache",
    "is_patched",
    "patch",
    "prefetch",
    "prefetch_depth",
    "subgraph_stats",
    "unpatch",
]

_CPU = torch.device("cpu")
# compressed-tensors 0.20's DiskCache.onload casts to the index's dtype, then copies the class (a
# Parameter stays one); 0.19's copies the class, then casts (Tensor.to gives a plain tensor).
try:
    from compressed_tensors.offload.cache.utils import load_disk_tensor_from_offload  # noqa: F401

    _CAST_FIRST = True
except ImportError:
    _CAST_FIRST = False
Tensor = torch.Tensor
COUNTERS = _engine.WEIGHT_COUNTERS


def prefetch_depth() -> int:
    """Subgraphs whose weights are fetched ahead: OFFCACHE_WEIGHT_PREFETCH (0, 1 or k; default 1)."""
    raw = os.environ.get("OFFCACHE_WEIGHT_PREFETCH", "").strip() or "1"
    try:
        k = int(raw)
    except ValueError:
        k = -1
    if k < 0:
        raise ValueError(f"OFFCACHE_WEIGHT_PREFETCH must be an integer >= 0, got {raw!r}")
    return k


def _device_free_bytes(device: torch.device) -> int | None:
    """Bytes a prefetch may take on `device`; None: no limit known (the host backend's CPU)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)(device)
    limit = total * fraction - torch.cuda.memory_allocated(device)
    # Headroom for the running subgraph's activations and GPTQ's Hessians: 10 % of the device.
    return int(min(free + cached, limit) - 0.1 * total)


# --- the cache classes -------------------------------------------------------------------------


def _like(new: Tensor, like: Tensor, onloaded: bool = False) -> Tensor:
    """`new` with the tensor subclass and attributes of `like`, as compressed-tensors' send_tensors.

    An onloaded copy does not require grad, as ``Tensor.to`` under no_grad gives it.
    """
    if onloaded and new.requires_grad:
        new.requires_grad_(False)
    if new.__class__ is not like.__class__:
        new.__class__ = like.__class__
    new.__dict__ = like.__dict__.copy()
    return new


def _onload_device(cache) -> torch.device:
    device = torch.device(cache.onload_device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _onload(cache, offloaded: Tensor | None) -> Tensor | None:
    """The engine's onload for both cache classes: a prefetched copy, else a fetch of the source."""
    if offloaded is None:
        return None
    device = _onload_device(cache)
    nbytes = offloaded.nbytes
    COUNTERS["weight_onload_bytes"] += nbytes
    current = _state.current
    onloaded = _take_prefetched(offloaded, device)
    if onloaded is not None:
        COUNTERS["weight_prefetch_hits"] += 1
        if current is not None:
            current.hits += 1
            current.onloaded_bytes += nbytes
            current.prefetched_bytes += nbytes
        return onloaded
    if _patched and prefetch_depth() > 0:
        COUNTERS["weight_prefetch_misses"] += 1
    if current is not None:
        current.misses += 1
        current.onloaded_bytes += nbytes
    ((fetched, ticket),) = cache._fetch([offloaded], device)
    _wait(ticket, device)
    return cache._finish(fetched, offloaded)


def _fetch_host(offloaded: list[Tensor], device: torch.device) -> list[tuple[Tensor, Any]]:
    """One engine fetch of host tensors to `device`: (copy, ticket) each, not waited for.

    The arena blocks' own fences order later write-backs after these reads.
    """
    fetched, ticket = _engine.fetch(offloaded, device, wait=False)
    # A CPU tensor offcache does not own, onloaded to the CPU, comes back as is: copy it.
    return [(f.clone() if f is o else f, ticket) for f, o in zip(fetched, offloaded)]


def _stage_host(tensor: Tensor, pin_memory: bool) -> Tensor:
    """A host tensor staged: into the pinned arena when asked and not there already (where room)."""
    if not pin_memory or _engine.is_arena_tensor(tensor):
        return tensor
    with torch.no_grad():
        (stored,) = _engine.store([tensor], _CPU, allow_spill=False)
    _engine.wait_stored(stored)
    return _like(stored, tensor)


class OffcacheCPUCache(CPUCache):
    """compressed-tensors' ``CPUCache``, its offload, onload and update on the offcache engine."""

    @catch_cpu_mem_error
    def offload(self, tensor: Tensor | None) -> Tensor | None:
        """A snapshot of `tensor` in the pinned arena (a CPU tensor viewing arena memory).

        The same tensor offloaded twice (tied weights) gives the same offloaded tensor: the
        engine's dedup table serves the second store. A tensor offcache holds (arena, spilled
        or disk tier) is offloaded already and comes back as is, as CPUCache gives back a CPU one.
        """
        if tensor is None:
            return None
        if _engine.is_offcache_tensor(tensor):
            return tensor
        with torch.no_grad():
            (stored,) = _engine.store([tensor], _CPU)
        # CPUCache's offload is readable on return (callers read it on the host, and the
        # source may be the last copy of a loaded model's tensor): wait for it. Offloads happen
        # once, when a model is dispatched; the pipeline's traffic is onloads and write-backs.
        _engine.wait_stored(stored)
        _engine.warn_if_spilled(stacklevel=3)
        return _like(stored, tensor)

    def onload(self, offloaded: Tensor | None) -> Tensor | None:
        """A copy of `offloaded` on the onload device: the prefetched one if there is one."""
        return _onload(self, offloaded)

    def _fetch(self, offloaded: list[Tensor], device: torch.device) -> list[tuple[Tensor, Any]]:
        return _fetch_host(offloaded, device)

    def _finish(self, fetched: Tensor, offloaded: Tensor) -> Tensor:
        return _like(fetched, offloaded, onloaded=True)

    def stage(self, offloaded: Tensor | None, pin_memory: bool = False) -> Tensor | None:
        """compressed-tensors 0.20's staging: `offloaded` in host memory for a later onload.

        An arena tensor is staged already (pinned on a GPU engine) and comes back as is, so a
        prefetched copy of it stays valid; any other host tensor is put in the arena when
        `pin_memory` asks for pinned memory, else comes back as is (as CPUCache's stage).
        """
        if offloaded is None:
            return None
        _flush(offloaded)
        return _stage_host(offloaded, pin_memory)

    @torch.no_grad()
    def update_offload(self, offloaded: Tensor, data: Tensor | None) -> None:
        """Copy `data` into `offloaded`'s arena block asynchronously (as ``offloaded.copy_(data)``).

        The engine reads a private copy of `data` (taken now, on `data`'s device and current
        stream) so that the caller may reuse `data` at once.
        """
        if data is None:
            return
        _drop_prefetched(offloaded)
        if not _engine.is_offcache_tensor(offloaded):
            # Not offcache's (assigned under disable_onloading()): no fences order the engine's
            # reads of it, so every copy in flight lands first; then CPUCache's own copy.
            _engine.synchronize()
            offloaded.copy_(data)
            return
        src = torch.empty_like(offloaded, device=data.device)
        src.copy_(data)  # dtype cast and broadcast as Tensor.copy_ does
        try:
            ticket = _engine.copy_into([offloaded], [src], wait=False)
        except (ValueError, RuntimeError):
            # A pair the engine refuses (a layout, or host data where a backend wants a device
            # source): every copy in flight landed first, then a plain copy, as CPUCache's.
            _engine.synchronize()
            offloaded.copy_(src)
            return
        COUNTERS["weight_writeback_bytes"] += offloaded.nbytes
        if _state.current is not None:
            _state.current.written_back_bytes += offloaded.nbytes
        # The engine orders copies into one block (write after write), so the last one wins.
        _state.pending[id(offloaded)] = (offloaded, ticket)
        if _state.current is None:
            _flush(offloaded)  # outside a patched context nothing marks an end: land it now

    def __getitem__(self, key):
        # Under disable_onloading() the caller reads the offloaded tensor on the host, and may
        # edit it through .data or numpy, which no version counter sees: its prefetched copy,
        # if any, is dropped (a host copy is also compared byte for byte when taken).
        if self.onloading_disabled:
            offloaded = self.offloaded_values[key]
            if offloaded is not None:
                _flush(offloaded)
                _drop_prefetched(offloaded)
        return super().__getitem__(key)

    def __delitem__(self, key):
        offloaded = self.offloaded_values[key]
        if offloaded is not None:
            _drop_prefetched(offloaded)
        super().__delitem__(key)


_READS: dict[str, Any] = {}  # real file path -> the ticket of the last fetch that read it


class _Ready:
    """The ticket of a tensor read without the engine: complete."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def issued() -> bool:
        return True

    @staticmethod
    def wait() -> None:
        pass


class OffcacheDiskCache(DiskCache):
    """compressed-tensors' ``DiskCache``, its onload reading the checkpoint's file through the engine.

    The offloaded meta tensors, ``DiskCache.index``, the checkpoint symlinks and the files an
    update writes are compressed-tensors' own (other code reads them). An onload reads the
    tensor's bytes from its safetensors file with the engine's ``fetch_file`` (never copying the
    file): the engine's I/O thread reads 8 MiB pieces (from the page cache where they are
    there, else O_DIRECT where the file system allows it) into pinned bounce buffers and
    issues each piece's copy to the device as soon as it is read. The caller does not wait for
    the disk, so a prefetch reads the next subgraph's weights while this one computes. Updates
    write files as DiskCache does; a prefetched copy of an updated weight is dropped.
    """

    def onload(self, offloaded: Tensor | None) -> Tensor | None:
        """A copy of `offloaded` on the onload device: read from its file (a meta tensor), or,
        once staged (compressed-tensors 0.20's ``is_staged``), fetched from the staged host copy."""
        return _onload(self, offloaded)

    def stage(self, offloaded: Tensor | None, pin_memory: bool = False) -> Tensor | None:
        """compressed-tensors 0.20's staging: the weight read from its file into host memory
        through the engine (``fetch_file``), cast to the index's dtype with the offloaded tensor's
        class; with `pin_memory` and a device onload, into the pinned arena. A staged tensor
        (not meta) comes back as is."""
        if offloaded is None:
            return None
        if offloaded.device.type != "meta":
            return _stage_host(offloaded, pin_memory)
        ((fetched, ticket),) = self._fetch([offloaded], _CPU)
        _wait(ticket, _CPU)
        staged = self._finish(fetched, offloaded)
        return _stage_host(staged, pin_memory and torch.device(self.onload_device).type != "cpu")

    def _fetch(self, offloaded: list[Tensor], device: torch.device) -> list[tuple[Tensor, Any]]:
        """(copy, ticket) of each offloaded tensor, read from its file: one engine call per file.

        A staged tensor (host memory, not meta) is fetched from the host instead."""
        out: list[tuple[Tensor, Any] | None] = [None] * len(offloaded)
        by_file: dict[str, list[tuple[int, tuple]]] = {}
        staged = [i for i, t in enumerate(offloaded) if t.device.type != "meta"]
        if staged:
            for i, pair in zip(staged, _fetch_host([offloaded[i] for i in staged], device)):
                out[i] = pair
        for i, meta in enumerate(offloaded):
            if out[i] is not None:
                continue
            info = self.index[meta]
            real = os.path.realpath(info["safetensors_file"])
            where = _locate(real, info["weight_name"])
            if where is None:  # a dtype offcache does not know: DiskCache reads it (blocking)
                out[i] = (self._read_upstream(meta, device), _Ready)
            else:
                by_file.setdefault(real, []).append((i, where))
        for real, entries in by_file.items():
            tensors, ticket = _engine.fetch_file(real, [where for _, where in entries], device, wait=False)
            _READS[real] = ticket
            for (i, _), tensor in zip(entries, tensors):
                out[i] = (tensor, ticket)
        if len(_READS) > 1024:  # a model's worth of files: keep the reads still in flight only
            for path in [p for p, t in _READS.items() if t.query()]:
                del _READS[path]
        return out

    def _read_upstream(self, meta: Tensor, device: torch.device) -> Tensor:
        """DiskCache's own read of `meta` (a dtype offcache does not parse) onto `device`, unfinished."""
        if device == _onload_device(self):
            staged = getattr(self, "is_staged", False)  # 0.20's onload reads the file unless staged
            if staged:
                self.is_staged = False
            try:
                return super().onload(meta)
            finally:
                if staged:
                    self.is_staged = True
        return super().stage(meta).to(device)  # staging (0.20) reads onto the CPU

    def _finish(self, fetched: Tensor, offloaded: Tensor) -> Tensor:
        if offloaded.device.type != "meta":  # staged: as DiskCache's onload of a staged tensor
            return _like(fetched, offloaded, onloaded=True)
        # As the installed DiskCache.onload: the index's dtype and the offloaded tensor's class and
        # attributes, in its order (0.20 casts first: a Parameter; 0.19 copies the class first).
        dtype = getattr(torch, self.index[offloaded]["dtype"])
        if _CAST_FIRST:
            return to_tensor(fetched.to(dtype), offloaded)
        return to_tensor(fetched, offloaded).to(dtype)

    def update_offload(self, offloaded: Tensor, data: Tensor | None):
        if offloaded.device.type != "meta":  # staged (0.20): a host tensor, updated as CPUCache's
            return OffcacheCPUCache.update_offload(self, offloaded, data)
        _drop_prefetched(offloaded)
        # DiskCache rewrites its own file in place (truncating it): no read of it may still be
        # in flight then (it would fail at the new end, or read the new bytes). A checkpoint
        # symlink is only unlinked (the checkpoint is never written): its reads may go on.
        name = self.index[offloaded]["safetensors_file"]
        path = os.path.realpath(name)
        reading = None if os.path.islink(name) else _READS.pop(path, None)
        if reading is not None and not reading.query():
            _engine.synchronize()
        _forget(path)
        super().update_offload(offloaded, data)

    def __getitem__(self, key):
        # A staged host tensor handed out under disable_onloading() may be edited: as CPUCache's.
        if self.onloading_disabled:
            offloaded = self.offloaded_values[key]
            if offloaded is not None and offloaded.device.type != "meta":
                _flush(offloaded)
                _drop_prefetched(offloaded)
        return super().__getitem__(key)

    def __delitem__(self, key):
        offloaded = self.offloaded_values[key]
        if offloaded is not None:
            _drop_prefetched(offloaded)
        super().__delitem__(key)


# --- prefetch ----------------------------------------------------------------------------------


def _offloaded_of(modules) -> list[tuple[Any, Tensor]]:
    seen: set[int] = set()
    out = []
    for module in modules:
        for cache in (module._parameters, module._buffers):
            if not isinstance(cache, (OffcacheCPUCache, OffcacheDiskCache)):
                continue
            for offloaded in cache.offloaded_values.values():
                if offloaded is not None and id(offloaded) not in seen:
                    seen.add(id(offloaded))
                    out.append((cache, offloaded))
    return out


def prefetch(modules, target: int) -> int:
    """Fetch the offloaded weights of `modules` ahead, for subgraph `target`; returns bytes issued.

    A tensor already prefetched is not fetched again.
    When the device has no room, or the fetch fails, nothing is prefetched and the skip is
    counted: a prefetch never fails a run.
    """
    groups: dict[tuple[torch.device, type], list[tuple[Any, Tensor]]] = {}
    for cache, offloaded in _offloaded_of(modules):
        if id(offloaded) in _state.prefetched:
            continue
        device = _onload_device(cache)
        # A weight this subgraph holds onloaded too (tied, shared) is fetched again, not aliased:
        # this subgraph may edit its onloaded copy in place (AWQ's grid search does, through
        # .data, which no version counter sees), and such edits die with its context.
        if isinstance(cache, OffcacheCPUCache) and device.type == "cpu" and not _engine.is_offcache_tensor(offloaded):
            continue  # a fetch would hand back the tensor itself: nothing to do ahead
        groups.setdefault((device, type(cache)), []).append((cache, offloaded))
    issued = 0
    for (device, _), items in groups.items():
        nbytes = sum(offloaded.nbytes for _, offloaded in items)
        free = _device_free_bytes(device)
        if free is not None and nbytes > free:
            COUNTERS["weight_prefetch_skips"] += 1
            logger.info(f"offcache weights: no room for a {nbytes}-byte prefetch on {device}, skipped")
            continue
        try:
            fetched = items[0][0]._fetch([offloaded for _, offloaded in items], device)
        except Exception as exc:  # noqa: BLE001  (an OOM, an unreadable file: the onload will say why)
            COUNTERS["weight_prefetch_skips"] += 1
            logger.info(f"offcache weights: prefetch of {nbytes} bytes on {device} skipped: {exc}")
            continue
        for (cache, offloaded), (onloaded, ticket) in zip(items, fetched):
            # Not finished yet: _finish may read the copy (a dtype cast), which is still in flight.
            _state.prefetched[id(offloaded)] = _Prefetched(
                offloaded, cache, onloaded, ticket, device, offloaded._version, target, offloaded.nbytes
            )
        COUNTERS["weight_prefetch_bytes"] += nbytes
        issued += nbytes
    return issued


def _wrap_subgraphs(subgraphs: list) -> list:
    """Give each subgraph a forward that prefetches the next subgraphs' weights after its first call."""
    depth = prefetch_depth()
    _state.prefetched.clear()  # a new pipeline run: nothing ahead belongs to it
    issued_upto = [0]  # subgraphs [0, issued_upto) have been prefetched (or run)

    for index, subgraph in enumerate(subgraphs):
        forward = subgraph.forward

        def prefetching_forward(model, *args, _index=index, _forward=forward, **kwargs):
            current = _state.current
            first = current is not None and current.index != _index
            if current is not None:
                current.index = _index
            out = _forward(model, *args, **kwargs)
            if first and depth > 0:
                # This subgraph's weights are onloaded now: queue the next ones behind them.
                start = max(issued_upto[0], _index + 1)
                for ahead in range(start, min(len(subgraphs), _index + 1 + depth)):
                    prefetch(subgraphs[ahead].submodules(model), target=ahead)
                    issued_upto[0] = ahead + 1
            return out

        subgraph.forward = prefetching_forward
    return subgraphs


# --- patching ----------------------------------------------------------------------------------

_patched = False
_originals: dict[tuple[object, str], object] = {}


def _cls_from_device(cls, device=None):
    chosen = _originals[(OffloadCache, "cls_from_device")].__func__(cls, device)
    if chosen.__name__ == "DistributedCPUCache":  # one region per node (offcache/weights_node.py)
        from offcache import weights_node

        return weights_node.cache_class()
    # DistributedDiskCache stays compressed-tensors'.
    return {CPUCache: OffcacheCPUCache, DiskCache: OffcacheDiskCache}.get(chosen, chosen)


@contextlib.contextmanager
def _disable_offloading(cls):
    if OffloadCache.offloading_disabled:  # nested: the outermost context owns the bookkeeping
        with _originals[(OffloadCache, "disable_offloading")].__func__(cls):
            yield
        return
    _state.current = record = _Subgraph()
    failed = False
    try:
        with _originals[(OffloadCache, "disable_offloading")].__func__(cls):
            yield
    except BaseException:
        failed = True
        raise
    finally:
        _flush_all()  # its waits count for this context
        _state.current = None
        if failed:
            _state.prefetched.clear()
        elif record.index is not None:
            for key, entry in list(_state.prefetched.items()):
                if entry.target <= record.index:
                    del _state.prefetched[key]
        if record.onloaded_bytes or record.written_back_bytes:
            _state.history.append(record)
            if record.index is not None:
                logger.info(record.line())


def _trace_subgraphs(*args, **kwargs):
    return _wrap_subgraphs(_originals[("pipeline", "trace_subgraphs")](*args, **kwargs))


def patch() -> None:
    """Route compressed-tensors' non-distributed CPU weight offloading through offcache. Idempotent."""
    global _patched
    if _patched:
        return
    from offcache import ct_drift

    ct_drift.check()  # CompressedTensorsDriftError: a compressed-tensors offcache's subclasses do not fit
    import llmcompressor.pipelines.sequential.pipeline as pipeline

    _originals[(OffloadCache, "cls_from_device")] = OffloadCache.__dict__["cls_from_device"]
    _originals[(OffloadCache, "disable_offloading")] = OffloadCache.__dict__["disable_offloading"]
    _originals[("pipeline", "trace_subgraphs")] = pipeline.trace_subgraphs
    OffloadCache.cls_from_device = classmethod(_cls_from_device)
    OffloadCache.disable_offloading = classmethod(_disable_offloading)
    pipeline.trace_subgraphs = _trace_subgraphs
    _state.history.clear()
    _patched = True


def unpatch() -> None:
    """Restore compressed-tensors' classes and the pipeline's trace_subgraphs.

    Modules offloaded while patched keep their offcache caches (they work unpatched too).
    """
    global _patched
    if not _patched:
        return
    OffloadCache.cls_from_device = _originals.pop((OffloadCache, "cls_from_device"))
    OffloadCache.disable_offloading = _originals.pop((OffloadCache, "disable_offloading"))
    pipeline = sys.modules["llmcompressor.pipelines.sequential.pipeline"]
    pipeline.trace_subgraphs = _originals.pop(("pipeline", "trace_subgraphs"))
    _flush_all()
    _state.prefetched.clear()
    _patched = False


def is_patched() -> bool:
    return _patched
