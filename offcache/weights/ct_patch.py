"""compressed-tensors' offloaded model weights on the offcache engine.

``offcache.patch_llmcompressor(weights=True)`` calls ``patch()`` here:

- ``OffloadCache.cls_from_device`` returns ``OffcacheCPUCache`` for a non-distributed
  ``"cpu"`` offload and ``OffcacheDiskCache`` for ``"disk"`` (the classes ``offload_module``
  builds every module's cache from).
  Distributed runs get ``NodeSharedCPUCache`` (offcache/weights/node/) for ``"cpu"`` (one
  shared region per node, where a per-rank arena would hold one copy per rank; its onloads are
  engine fetches from the region, prefetched as below) and ``NodeDiskCache``
  (offcache/weights/node/disk.py) for ``"disk"``: compressed-tensors' ``DistributedDiskCache``
  with ``OffcacheDiskCache``'s onload and prefetch, its checkpoint bytes read once per node
  through the page cache.
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
(offcache/weights/drift.py). The state the classes and the prefetcher share (prefetched copies,
write-backs in flight, per-subgraph records) and its rules are in offcache/weights/bookkeeping.py.

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
import sys
from typing import Any

import torch

from offcache.util.extras import as_missing

try:
    from compressed_tensors.offload.cache.base import OffloadCache
    from compressed_tensors.offload.cache.cpu import CPUCache
    from compressed_tensors.offload.cache.disk import DiskCache
except ModuleNotFoundError as _missing:  # one line naming the extra
    raise as_missing(
        _missing, ("compressed_tensors", "transformers"), "llmcompressor", "offcache.weights.compressed_tensors"
    ) from None

from loguru import logger  # llm-compressor's and compressed-tensors' logger: its INFO lines show

from offcache import engine as _engine  # noqa: F401  (tests patch the engine through this module)
from offcache.engine import machine as _machine
from offcache.weights.bookkeeping import WEIGHTS, Prefetched, Subgraph, WeightState, onload_device, prefetch_depth
from offcache.weights.caches import OffcacheCPUCache, OffcacheDiskCache
from offcache.weights.interface import WeightCache
from offcache.weights.memory import fit, placement
from offcache.weights.node import sliced as node_sliced

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

Tensor = torch.Tensor


def _device_free_bytes(device: torch.device) -> int | None:
    """Bytes a prefetch may take on `device`; None: no limit known (a device other than the CPU or a GPU).

    The CPU: the memory the process may still take (its cgroup's limit or RAM, less the anonymous
    memory it holds), less a tenth of that limit for the running subgraph's work: under a memory
    cgroup a prefetch must never be what kills the run."""
    if device.type == "cpu":
        room, _ = fit.host_room()
        return int(room - 0.1 * _machine.usable_memory_bytes())
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)(device)
    limit = total * fraction - torch.cuda.memory_allocated(device)
    # Headroom for the running subgraph's activations and GPTQ's Hessians: 10 % of the device.
    return int(min(free + cached, limit) - 0.1 * total)


# --- prefetch ----------------------------------------------------------------------------------


def _offloaded_of(modules) -> list[tuple[WeightCache, Tensor]]:
    seen: set[int] = set()
    out = []
    for module in modules:
        for cache in (module._parameters, module._buffers):
            if not isinstance(cache, WeightCache):
                continue
            for offloaded in cache.offloaded_values.values():
                if offloaded is not None and id(offloaded) not in seen:
                    seen.add(id(offloaded))
                    out.append((cache, offloaded))
    return out


def prefetch(modules, target: int, state: WeightState = WEIGHTS) -> int:
    """Fetch the offloaded weights of `modules` ahead, for subgraph `target`, into `state`'s table;
    returns bytes issued.

    A tensor already prefetched is not fetched again (but in the node region's sliced mode, whose
    plan must not depend on what each rank holds: a write by one rank drops its copy only).
    When the device has no room, or the fetch fails, nothing is prefetched and the skip is
    counted: a prefetch never fails a run (a sliced one whose ranks disagree raises).
    """
    groups: dict[tuple[torch.device, type], list[tuple[Any, Tensor]]] = {}
    sliced_mode = node_sliced.active()
    for cache, offloaded in _offloaded_of(modules):
        if id(offloaded) in state.prefetched and not (sliced_mode and getattr(cache, "_sliced_onload", False)):
            continue
        device = onload_device(cache)
        # A weight this subgraph holds onloaded too (tied, shared) is fetched again, not aliased:
        # this subgraph may edit its onloaded copy in place (AWQ's grid search does, through
        # .data, which no version counter sees), and such edits die with its context.
        if not cache.prefetchable(offloaded, device):
            continue  # e.g. a fetch would hand back the tensor itself: nothing to do ahead
        groups.setdefault((device, type(cache)), []).append((cache, offloaded))
    issued = 0
    if sliced_mode:
        # The node region's tensors, sliced between the node's ranks (1 or 2 collectives per
        # onload device; the agreement even with nothing to fetch, so no rank is left waiting).
        sliced = [key for key in groups if getattr(key[1], "_sliced_onload", False)]
        for device in dict.fromkeys(key[0] for key in sliced) or [None]:
            items = [item for key in sliced if key[0] == device for item in groups[key]]
            done, rest = node_sliced.prefetch(items, device, target, _device_free_bytes, state)
            issued += done
            for key in sliced:
                if key[0] == device:
                    groups[key] = [item for item in rest if type(item[0]) is key[1]]
    for (device, _), items in groups.items():
        if not items:
            continue
        nbytes = sum(offloaded.nbytes for _, offloaded in items)
        free = _device_free_bytes(device)
        if free is not None and nbytes > free:
            state.counters["weight_prefetch_skips"] += 1
            logger.info(f"offcache weights: no room for a {nbytes}-byte prefetch on {device}, skipped")
            continue
        tags = [cache.tag(offloaded) for cache, offloaded in items]  # before the copies are issued
        try:
            fetched = items[0][0].fetch([offloaded for _, offloaded in items], device)
        except Exception as exc:  # noqa: BLE001  (an OOM, an unreadable file: the onload will say why)
            state.counters["weight_prefetch_skips"] += 1
            logger.info(f"offcache weights: prefetch of {nbytes} bytes on {device} skipped: {exc}")
            continue
        for (cache, offloaded), (onloaded, ticket), tag in zip(items, fetched, tags):
            # Not finished yet: finish() may read the copy (a dtype cast), which is still in flight.
            state.prefetched[id(offloaded)] = Prefetched(
                offloaded, cache, onloaded, ticket, device, offloaded._version, target, offloaded.nbytes, tag
            )
        state.counters["weight_prefetch_bytes"] += nbytes
        issued += nbytes
    return issued


def _wrap_subgraphs(subgraphs: list, state: WeightState = WEIGHTS) -> list:
    """Give each subgraph a forward that prefetches the next subgraphs' weights after its first call."""
    depth = prefetch_depth()
    state.prefetched.clear()  # a new pipeline run: nothing ahead belongs to it
    issued_upto = [0]  # subgraphs [0, issued_upto) have been prefetched (or run)

    for index, subgraph in enumerate(subgraphs):
        forward = subgraph.forward

        def prefetching_forward(model, *args, _index=index, _forward=forward, **kwargs):
            current = state.current
            first = current is not None and current.index != _index
            if current is not None:
                current.index = _index
            out = _forward(model, *args, **kwargs)
            if first and depth > 0:
                # This subgraph's weights are onloaded now: queue the next ones behind them.
                start = max(issued_upto[0], _index + 1)
                for ahead in range(start, min(len(subgraphs), _index + 1 + depth)):
                    prefetch(subgraphs[ahead].submodules(model), target=ahead, state=state)
                    issued_upto[0] = ahead + 1
            return out

        subgraph.forward = prefetching_forward
    return subgraphs


# --- patching ----------------------------------------------------------------------------------

_originals: dict[tuple[object, str], object] = {}


def _cls_from_device(cls, device=None):
    chosen = _originals[(OffloadCache, "cls_from_device")].__func__(cls, device)
    if chosen.__name__ == "DistributedCPUCache":  # one region per node (offcache/weights/node/)
        from offcache.weights.node import cache_class

        return cache_class()
    if chosen.__name__ == "DistributedDiskCache":  # read once per node (offcache/weights/node/disk.py)
        from offcache.weights.node.disk import NodeDiskCache

        return NodeDiskCache
    return {CPUCache: OffcacheCPUCache, DiskCache: OffcacheDiskCache}.get(chosen, chosen)


@contextlib.contextmanager
def _disable_offloading(cls, state: WeightState = WEIGHTS):
    if OffloadCache.offloading_disabled:  # nested: the outermost context owns the bookkeeping
        with _originals[(OffloadCache, "disable_offloading")].__func__(cls):
            yield
        return
    state.current = record = Subgraph()
    failed = False
    try:
        with _originals[(OffloadCache, "disable_offloading")].__func__(cls):
            yield
    except BaseException:
        failed = True
        raise
    finally:
        state.flush_all()  # its waits count for this context
        state.current = None
        if failed:
            state.prefetched.clear()
        elif record.index is not None:
            for key, entry in list(state.prefetched.items()):
                if entry.target <= record.index:
                    del state.prefetched[key]
        if record.onloaded_bytes or record.written_back_bytes:
            state.history.append(record)
            if record.index is not None:
                logger.info(record.line())


def _trace_subgraphs(*args, **kwargs):
    subgraphs = _originals[("pipeline", "trace_subgraphs")](*args, **kwargs)
    model = args[0] if args else kwargs.get("model")
    sample_input = args[1] if len(args) > 1 else kwargs.get("sample_input")
    fit.check(subgraphs, model, sample_input)  # SubgraphMemoryError before any calibration
    return _wrap_subgraphs(subgraphs)


def patch() -> None:
    """Route compressed-tensors' CPU and disk weight offloading (distributed or not) through offcache. Idempotent."""
    if WEIGHTS.patched:
        return
    from offcache.weights import drift as ct_drift

    ct_drift.check()  # CompressedTensorsDriftError: a compressed-tensors offcache's subclasses do not fit
    import llmcompressor.pipelines.sequential.pipeline as pipeline

    _originals[(OffloadCache, "cls_from_device")] = OffloadCache.__dict__["cls_from_device"]
    _originals[(OffloadCache, "disable_offloading")] = OffloadCache.__dict__["disable_offloading"]
    _originals[("pipeline", "trace_subgraphs")] = pipeline.trace_subgraphs
    OffloadCache.cls_from_device = classmethod(_cls_from_device)
    OffloadCache.disable_offloading = classmethod(_disable_offloading)
    pipeline.trace_subgraphs = _trace_subgraphs
    placement.patch()
    WEIGHTS.history.clear()
    WEIGHTS.patched = True


def unpatch() -> None:
    """Restore compressed-tensors' classes and the pipeline's trace_subgraphs.

    Modules offloaded while patched keep their offcache caches (they work unpatched too).
    """
    if not WEIGHTS.patched:
        return
    OffloadCache.cls_from_device = _originals.pop((OffloadCache, "cls_from_device"))
    OffloadCache.disable_offloading = _originals.pop((OffloadCache, "disable_offloading"))
    pipeline = sys.modules["llmcompressor.pipelines.sequential.pipeline"]
    pipeline.trace_subgraphs = _originals.pop(("pipeline", "trace_subgraphs"))
    placement.unpatch()
    WEIGHTS.flush_all()
    WEIGHTS.prefetched.clear()
    WEIGHTS.patched = False


def is_patched() -> bool:
    return WEIGHTS.patched


def subgraph_stats() -> list[dict]:
    """Per outermost ``disable_offloading()`` context since ``patch()``: bytes, hits, misses, waits."""
    return WEIGHTS.subgraph_stats()
