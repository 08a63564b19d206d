"""Offloaded weights shared by the ranks of a node, in one anonymous shared-memory region.

Under ``torch.distributed``, ``patch_llmcompressor(weights=True)`` gives compressed-tensors'
``cls_from_device("cpu")`` :class:`NodeSharedCPUCache` in place of its ``DistributedCPUCache``
(``cache_class()`` decides, once, for every rank together). Compressed-tensors' class writes each
tensor to its own ``/dev/shm`` file and broadcasts its name with a broadcast and a barrier per
tensor; this one (weights offloaded to disk: offcache/weights/node_disk.py's ``NodeDiskCache``):

- keeps every offloaded weight of a node in **one region**: a ``memfd_create`` file (anonymous:
  nothing in ``/dev/shm``, so a 64 MB ``/dev/shm`` does not matter, and the memory goes back to
  the system when the last process holding it exits, however it exits). The node's first rank
  creates it; the others open it once through ``/proc/<pid>/fd/<n>``. It grows in 64 MiB steps
  (``ftruncate`` under ``flock``), each batch of tensors mapped on its own, so growing never moves
  a tensor. The node is torchrun's (``GROUP_RANK``; the host name without torchrun): two
  launchers on one host with ``--nnodes 2`` get two regions.
- offloads a **batch** per call of ``from_mapping`` (a module's parameters, or its buffers): the
  source rank copies the batch into the region, then one ``broadcast_object_list`` of the batch's
  index (offsets, dtypes, shapes) and one ``all_gather_object`` (every rank's verdict, which is
  also the barrier compressed-tensors' class ends with). A single ``offload`` (``__setitem__`` of
  a new name) is a batch of one.
- across nodes (``--nnodes`` > 1), every node's region holds the same layout (allocations are
  collective, so they happen in the same order everywhere): the source's node allocates, the
  others reserve the same range, and the batch's bytes go to the other nodes with one
  ``dist.broadcast``.
- raises :class:`NodeShapeMismatchError` on every rank, naming the tensor, when a rank holds a
  (non-meta) tensor whose shape or dtype differs from the source's; meta tensors take the
  source's, as compressed-tensors' class does for them.
- counts the region once per node against offcache's host limit: the ranks' ``host_limit``
  shares together (``OFFCACHE_HOST_LIMIT`` x ``LOCAL_WORLD_SIZE``); a batch past it raises
  :class:`NodeRegionFullError` on every rank.
- registers the region with the engine: every rank maps each batch once
  (``offcache.engine.map_shared``; node_region.py holds the region) and registers that mapping
  once: on CUDA ``cudaHostRegister`` in chunks of at most 64 GiB, in relaxed capture mode, every
  return code checked, the chunks made undone on a failure, unregistered (after the copies still
  reading it) before it is unmapped; ranks registering at the same time each register their own
  mapping. The host backend keeps the same bookkeeping without a driver call. The region counts
  once per node against the pinned budget: each rank counts 1/``node_ranks`` of every mapping
  against its own (``offcache.stats()``' ``shared_pinned_share_bytes``; the arena's
  ``pinned_limit_bytes`` is the budget less it).
- onloads through the engine: an onload is an engine fetch from the region (asynchronous, from
  pinned memory), and the sequential pipeline's subgraphs prefetch the next one's weights as
  with one process (offcache.weights.compressed_tensors' prefetcher and bookkeeping.py's
  rules). An onload to the CPU is a copy, as ``OffcacheCPUCache``'s (compressed-tensors' class
  hands out the shared tensor itself there; the copy keeps its ``requires_grad``).
- invalidates across processes: every tensor of the region has a generation word in it
  (node_region.py's layout), odd while a rank's ``update_offload`` writes it and 2 more after;
  a handed-out tensor under ``disable_onloading()`` (which its caller may write) adds 2. A
  prefetched copy is served only if the generation it saw before its fetch was issued (even) is
  the generation when it is used, so a write by another rank, after a barrier, is seen by a rank
  that had prefetched the old value. (A direct write through a tensor handed out under
  ``disable_onloading()`` after another rank's prefetch is not seen by that prefetch: the same
  rule as with one process.)

``update_offload`` is compressed-tensors' ``offloaded.copy_(data)`` into the shared bytes, landed
on return (visible to every rank of the node after a barrier, which an asynchronous write-back
would not be), after this rank's copies still reading them. ``__delitem__``,
``disable_onloading`` / ``disable_offloading``, tied weights and tensor subclasses are
compressed-tensors' ``DistributedCPUCache`` / ``CPUCache``. Under compressed-tensors'
``as_single_threaded()`` an offload is ``CPUCache``'s, this rank's alone (batch_offload.py).

Fallbacks. Where memfd, the ``/proc`` hand-over or the registration of the region's first page
(the probe every rank makes at set-up: a low memlock limit, the pinned budget) fails on any rank,
one :class:`NodeRegionFallbackWarning` names the reason and every rank uses compressed-tensors'
``DistributedCPUCache``: a region whose onloads copy from pageable memory would make every H2D
copy block its caller, which is what compressed-tensors' class does already with less machinery.
Where a later mapping cannot be registered (the memlock limit or the pinned budget reached
mid-run, with tensors in the region already), one :class:`NodeRegionPinWarning` names the reason
and that mapping's onloads are engine fetches from pageable memory (``stats()["unpinned"]``).

``OFFCACHE_NODE_ONLOAD=sliced`` (default ``full``): a prefetch of the region's tensors is shared
out between the node's ranks, each fetching 1/N of it and all-gathering the rest (node_sliced.py).
The set-up checks the setting on every rank (a garbage value, or ranks that disagree: ValueError), and
in the sliced mode ``OFFCACHE_WEIGHT_PREFETCH`` too (every prefetch is a collective there: a rank that
prefetches less, or raises on a garbage value, would leave the others in it).

Not yet: the space of deleted or replaced tensors is not reused (the region only grows until the
run ends).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from offcache.util.extras import as_missing

try:
    from compressed_tensors.distributed import get_source_rank, is_source_process
    from compressed_tensors.offload.cache.cpu import CPUCache
    from compressed_tensors.offload.cache.dist_cpu import DistributedCPUCache
    from compressed_tensors.offload.cache.utils import catch_cpu_mem_error
    from compressed_tensors.offload.utils import to_tensor
except ModuleNotFoundError as _missing:  # one line naming the extra
    raise as_missing(
        _missing, ("compressed_tensors", "transformers"), "llmcompressor", "offcache.weights.node"
    ) from None

from offcache import engine as _engine  # noqa: E402
from offcache.weights import node_sliced  # noqa: E402
from offcache.weights.batch_offload import _BatchOffload  # noqa: E402
from offcache.weights.bookkeeping import prefetch_depth  # noqa: E402
from offcache.weights.caches import EngineCache, fetch_host, with_class_of  # noqa: E402
from offcache.weights.node_region import (  # noqa: E402
    _ALIGN,
    _WORD,
    NodeRegion,
    NodeRegionFallbackWarning,
    NodeRegionFullError,
    NodeRegionPinWarning,
    NodeShapeMismatchError,
    _round,
    nbytes_of,
    node_key,
    node_limit,
    plain,
)
from offcache.weights.node_sliced import NodeRankLostError, NodeSlicedPlanError  # noqa: E402

__all__ = [
    "NodeRankLostError",
    "NodeRegion",
    "NodeRegionFallbackWarning",
    "NodeRegionFullError",
    "NodeRegionPinWarning",
    "NodeShapeMismatchError",
    "NodeSharedCPUCache",
    "NodeSlicedPlanError",
    "cache_class",
    "node_key",
    "node_limit",
    "reset",
    "stats",
]


# --- the node group -------------------------------------------------------------------------------


class _Node:
    """This process's region and where it stands in the group."""

    def __init__(self, region: NodeRegion, keys: list[str]):
        self.region = region
        self.keys = keys  # rank -> node key
        self.rank = dist.get_rank()
        self.multi = len(set(keys)) > 1

    def leader(self, key: str) -> int:
        return self.keys.index(key)


_node: _Node | None = None
_decided: str | None = None  # None: not yet; "node": NodeSharedCPUCache; "fallback": upstream's
_fallback_reason = ""
_world: Any = None  # the process group the decision was made in


def _setup() -> str:
    """Set up this node's region, collectively; '' or the reason it failed (the same on every rank)."""
    global _node
    key = node_key()
    error = ""
    try:
        if not hasattr(os, "memfd_create"):
            raise OSError("os.memfd_create is not available on this platform")
    except OSError as exc:
        error = f"{key}: {exc}"
    try:
        mode = node_sliced.onload_mode()
    except ValueError as exc:
        mode = str(exc)
    try:
        depth: int | str = prefetch_depth()
    except ValueError as exc:
        depth = str(exc)
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, (key, os.getpid(), error, mode, depth))
    # ValueError on every rank: garbage, or disagreement (the prefetch depth too, in the sliced mode)
    node_sliced.check_modes([k[3] for k in keys], [k[4] for k in keys])
    errors = [k[2] for k in keys if k[2]]
    node_keys = [k[0] for k in keys]
    leader = node_keys.index(key)
    ranks = node_keys.count(key)  # the node's ranks: each maps the region
    region = None
    fd = -1
    if not errors and leader == dist.get_rank():
        try:
            region = NodeRegion.create(f"offcache-weights-{key}", node_limit(), ranks)
            fd = region.fd
        except OSError as exc:
            error = f"{key}: memfd_create failed: {exc}"
    fds: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(fds, (fd, error))
    errors += [e for _, e in fds if e]
    if not errors and region is None:
        try:
            region = NodeRegion.open(keys[leader][1], fds[leader][0], node_limit(), ranks)
        except OSError as exc:
            error = f"{key}: opening the node region through /proc/{keys[leader][1]}/fd failed: {exc}"
    if not errors and not error and region is not None:
        # Every rank registers its mapping of the region's first page with the engine: where one
        # cannot (a low memlock limit, no room in the pinned budget), every rank falls back.
        try:
            reason = region.register_probe()
        except (OSError, RuntimeError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        if reason:
            error = f"{key} rank {dist.get_rank()}: registering the node region with the engine failed: {reason}"
    verdicts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, error)
    errors += [e for e in verdicts if e]
    if errors:
        if region is not None:
            region.close()
        return errors[0]
    _node = _Node(region, node_keys)
    if mode == "sliced":
        node_sliced.setup(node_keys, [k[1] for k in keys])  # collective: every rank got here
    return ""


def cache_class() -> type:
    """The class for distributed CPU offload: NodeSharedCPUCache, or compressed-tensors' own where the
    region cannot be set up (one warning says why). Decided once, by every rank together."""
    global _decided, _fallback_reason, _world
    if _world is not dist.group.WORLD:  # a new process group (the old one destroyed): decide again
        reset()
        _world = dist.group.WORLD
    if _decided is None:
        reason = _setup()
        _decided = "fallback" if reason else "node"
        if reason:
            _fallback_reason = reason
            warnings.warn(
                f"offcache: no node-shared weight region ({reason}); compressed-tensors' "
                "DistributedCPUCache keeps the offloaded weights",
                NodeRegionFallbackWarning,
                stacklevel=2,
            )
    return NodeSharedCPUCache if _decided == "node" else DistributedCPUCache


def reset() -> None:
    """Forget the decision (tests; a new process group). Tensors already offloaded stay valid."""
    global _node, _decided, _fallback_reason
    _node = None
    _decided = None
    _fallback_reason = ""
    node_sliced.reset()


# --- the cache class ------------------------------------------------------------------------------


def _shape_of(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


class NodeSharedCPUCache(_BatchOffload, EngineCache, DistributedCPUCache):
    """compressed-tensors' ``DistributedCPUCache`` with its offloads in the node's region, a batch at
    a time, and its onloads engine fetches from the region (prefetched as with one process, or
    sliced between the node's ranks: node_sliced.py)."""

    _sliced_onload = True  # compressed_tensors.prefetch gives its prefetches to node_sliced in the sliced mode

    def __init__(self, onload_device, offload_device=None):
        super().__init__(onload_device, offload_device=offload_device)
        self._region = _node.region if _node is not None else None  # the region its tensors live in

    @classmethod
    def from_mapping(cls, mapping, onload_device, offload_device=None, **kwargs):
        instance = cls(onload_device=onload_device, offload_device=offload_device, **kwargs)
        instance.offloaded_values = instance._offload_mapping(dict(mapping))
        return instance

    # -- onload: an engine fetch from the region (WeightState.onload) --
    def onload(self, offloaded: torch.Tensor | None) -> torch.Tensor | None:
        """A copy of `offloaded` on the onload device: the prefetched one while its generation is
        unchanged, else an engine fetch from the region (pinned where registered)."""
        return self.state.onload(self, offloaded)

    def fetch(self, offloaded: list[torch.Tensor], device: torch.device) -> list[tuple[torch.Tensor, Any]]:
        return fetch_host(offloaded, device)

    def finish(self, fetched: torch.Tensor, offloaded: torch.Tensor) -> torch.Tensor:
        out = with_class_of(fetched, offloaded, onloaded=True)
        if _onload_is_cpu(self) and offloaded.requires_grad:
            out.requires_grad_(True)  # compressed-tensors hands out the offloaded tensor itself there
        return out

    def prefetchable(self, offloaded: torch.Tensor, device: torch.device) -> bool:
        # A local tensor (assigned under disable_onloading) onloaded to the CPU: a fetch is a clone.
        return device.type != "cpu" or _engine.is_shared_tensor(offloaded)

    def _word(self, offloaded: torch.Tensor) -> torch.Tensor | None:
        return self._region.word(offloaded) if self._region is not None else None

    def tag(self, offloaded: torch.Tensor) -> int | None:
        """The generation before a prefetch is issued (-1: a rank is writing it: never fresh)."""
        word = self._word(offloaded)
        if word is None:
            return None
        generation = _engine.shared_word_add(word, 0)
        return generation if generation % 2 == 0 else -1

    def is_fresh(self, offloaded: torch.Tensor, tag: int | None) -> bool:
        """Whether no rank wrote `offloaded` since the prefetch was issued (its copy has landed)."""
        if tag is None:
            return True
        word = self._word(offloaded)
        return tag >= 0 and word is not None and _engine.shared_word_add(word, 0) == tag

    def __getitem__(self, key):
        # Handed out under disable_onloading(): the caller may write it directly, which no
        # generation sees: the other ranks' prefetched copies of it are made stale now.
        if self.onloading_disabled:
            offloaded = self.offloaded_values.get(key)
            word = self._word(offloaded) if offloaded is not None else None
            if word is not None:
                _engine.shared_word_add(word, 2)
        return super().__getitem__(key)

    @torch.no_grad()
    def update_offload(self, offloaded: torch.Tensor, data: torch.Tensor | None) -> None:
        """compressed-tensors' ``offloaded.copy_(data)`` into the shared bytes (landed on return:
        visible to every rank of the node after a barrier), after this rank's copies still reading
        them, between two steps of the tensor's generation (odd while writing)."""
        if data is None:
            return
        self.state.drop_prefetched(offloaded)
        word = self._word(offloaded)
        if word is None:  # not in the region (a local tensor): compressed-tensors' update
            return super().update_offload(offloaded, data)
        _engine.wait_shared_reads(offloaded)  # an onload's copy still in flight reads the old bytes
        _engine.shared_word_add(word, 1)
        try:
            super().update_offload(offloaded, data)
        finally:
            _engine.shared_word_add(word, 1)

    # -- offload: a batch per module (offload, __setitem__, _name: _BatchOffload) --
    def _offload_local(self, tensor: torch.Tensor) -> torch.Tensor:
        """Under compressed-tensors' as_single_threaded(): its CPUCache's offload (a local tensor)."""
        return CPUCache.offload(self, tensor)

    @catch_cpu_mem_error  # compressed-tensors' remediation hint, as its from_mapping logs it (per offload)
    def _offload_batch(self, mapping: dict) -> dict:
        """Offload every tensor of `mapping` (name -> tensor or None): one broadcast, one all_gather."""
        node = _node
        assert node is not None, "NodeSharedCPUCache is used only after cache_class() set up the node region"
        region = node.region
        self._region = region
        source = get_source_rank()
        names = [name for name, t in mapping.items() if t is not None]
        out = dict.fromkeys(mapping)

        if is_source_process():
            header: Any
            entries: list[tuple] = []
            new: list[tuple[int, torch.Tensor]] = []  # (entry index, cpu tensor)
            try:
                seen: dict[int, int] = {}  # id(tensor) -> entry index (tied within the batch)
                for name in names:
                    t = mapping[name]
                    if id(t) in seen:
                        entries.append((name,) + tuple(entries[seen[id(t)]][1:]))
                        continue
                    seen[id(t)] = len(entries)
                    offset = region.locate(t)
                    if offset is not None and region.word_at(offset) is not None:
                        # already a tensor of the region (tied, or offloaded before): its generation too
                        entries.append((name, "at", offset, t.dtype, _shape_of(t), -1))
                        continue
                    new.append((len(entries), t))
                    entries.append((name, "new", 0, t.dtype, _shape_of(t), len(new) - 1))
                # The batch: its generation words, then its tensors.
                total = _round(_WORD * len(new), _ALIGN) if new else 0
                rels = []  # new tensor k's offset in the batch
                for _, t in new:
                    rels.append(total)
                    total = _round(total + max(t.nbytes, 1), _ALIGN)
                # (a tie within the batch is an entry of its own with the first's index)
                entries = [e[:2] + (rels[e[5]],) + e[3:] if e[1] == "new" else e for e in entries]
                start = region.allocate(total) if total else -1
                header = ("ok", source, node.keys[source], start, total)
            except (OSError, MemoryError) as exc:
                header = ("error", f"{type(exc).__name__}: {exc}")
            payload = [header, entries]
        else:
            payload = [None, None]
        dist.broadcast_object_list(payload, src=source)
        header, entries = payload
        if header[0] == "error":
            raise NodeRegionFullError(header[1]) if "NodeRegionFullError" in header[1] else OSError(header[1])
        _, source, source_key, start, total = header
        mine = node.keys[node.rank]

        error = ""
        try:
            if total:
                if mine != source_key:
                    region.reserve(start, total)
                data = region.span(start, total)
            if is_source_process():
                with torch.no_grad():
                    for (_, t), rel in zip(new, rels):
                        if t.nbytes:
                            data[rel : rel + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
            if node.multi and total:
                # Other nodes' regions get the batch's bytes; ranks beside the source, or beside
                # their node's leader, receive into scratch memory.
                leader_here = node.leader(mine) == node.rank
                into = data if (mine != source_key and leader_here) or node.rank == source else torch.empty_like(data)
                dist.broadcast(into[:total], src=source)
            missing = set(names) ^ {entry[0] for entry in entries}
            if missing:
                raise NodeShapeMismatchError(
                    f"rank {node.rank}: ranks disagree on the tensors offloaded: {sorted(map(str, missing))} "
                    f"(this rank has {sorted(map(str, names))})"
                )
            noted: set[int] = set()
            for _, kind, rel, dtype, shape, index in entries:
                if kind == "new" and index not in noted:
                    noted.add(index)
                    region.note(start + rel, nbytes_of(dtype, shape), start + _WORD * index)
            adopted: dict[int, torch.Tensor] = {}  # id(this rank's tensor) -> its offload (tied stay one)
            for name, kind, offset, dtype, shape, _ in entries:
                if kind == "new":
                    offset = start + offset
                t = mapping[name]
                if id(t) not in adopted:
                    adopted[id(t)] = self._adopt(self._name(name), t, region, offset, dtype, shape)
                out[name] = adopted[id(t)]
        except NodeShapeMismatchError as exc:
            error = str(exc)
        except (OSError, MemoryError, RuntimeError) as exc:
            error = f"rank {node.rank}: {type(exc).__name__}: {exc}"
        verdicts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, error)  # also the barrier compressed-tensors' class ends with
        errors = [e for e in verdicts if e]
        if errors:
            if any("disagree" in e for e in errors):
                raise NodeShapeMismatchError("; ".join(errors))
            raise RuntimeError("offcache's node-shared offload failed: " + "; ".join(errors))
        return out

    def _adopt(self, name, tensor: torch.Tensor, region: NodeRegion, offset: int, dtype, shape) -> torch.Tensor:
        """`tensor` (this rank's) pointed at the region's bytes at `offset`, as compressed-tensors'
        class points it at the shared file: same object where it can be (a CPU tensor of the right
        shape and dtype), else the tensor this rank made for that entry already (a weight tied
        across modules: one object, as on the source rank, whose tied modules hold one tensor),
        else a new one with its class and attributes."""
        shape = torch.Size(shape)
        if not tensor.is_meta and (tensor.dtype != dtype or tensor.shape != shape):
            raise NodeShapeMismatchError(
                f"rank {dist.get_rank()}: ranks disagree on tensor {name!r}: the source rank "
                f"{get_source_rank()} offloads {tuple(shape)} {dtype}, this rank holds "
                f"{tuple(tensor.shape)} {tensor.dtype}"
            )
        storage, byte = region.storage(offset)
        if region.locate(tensor) == offset:
            region.remember(tensor, offset)
            return tensor  # already this rank's view of these bytes
        # A tie the source rank holds as one tensor, this rank as two (e.g. meta parameters of
        # modules whose first offload replaced the tie): two objects here would make a sliced
        # prefetch's plan differ between ranks, and the full mode fetch the weight twice.
        existing = region.adopted(offset, dtype, shape)
        if existing is not None and type(existing) is type(tensor):
            return existing
        if tensor.is_meta or tensor.device.type != "cpu" or not plain(tensor):
            target = to_tensor(torch.empty(0, dtype=dtype), tensor)
        else:
            target = tensor
        stride = torch.empty(shape, device="meta").stride()
        with torch.no_grad():
            target.set_(storage, storage_offset=byte // dtype.itemsize, size=shape, stride=stride)
        region.remember(target, offset)
        return target


def _onload_is_cpu(cache) -> bool:
    return torch.device(cache.onload_device).type == "cpu"


def stats() -> dict:
    """The node region's state in this process: bytes used, the limit, the decision, and what this
    process registered of it (see offcache.stats()' shared_* keys for the engine's side)."""
    if _node is None:
        return {"decided": _decided, "fallback_reason": _fallback_reason}
    region = _node.region
    engine = _engine.stats()
    return {
        "decided": _decided,
        "node": _node.keys[_node.rank],
        "node_ranks": region.ranks,
        "used_bytes": region.used,
        "limit_bytes": region.limit,
        "mapped_spans": len(region._starts),
        # This process's mappings of the region (the probe page included), registered or not,
        # and its share of them against its pinned budget: summed over the node's ranks, the
        # region's bytes once.
        "mapped_bytes": engine["shared_mapped_bytes"],
        "registered_bytes": engine["shared_registered_bytes"],
        "pinned_share_bytes": engine["shared_pinned_share_bytes"],
        "unpinned": list(region.unpinned),
        "stale_prefetches": NodeSharedCPUCache.state.counters["weight_prefetch_stale"],
    }
