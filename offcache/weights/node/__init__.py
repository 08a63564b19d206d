"""Offloaded weights shared by the ranks of a node, in one anonymous shared-memory region.

Under ``torch.distributed``, ``patch_llmcompressor(weights=True)`` gives compressed-tensors'
``cls_from_device("cpu")`` :class:`NodeSharedCPUCache` in place of its ``DistributedCPUCache``
(``cache_class()`` decides, once, for every rank together). Compressed-tensors' class writes each
tensor to its own ``/dev/shm`` file and broadcasts its name with a broadcast and a barrier per
tensor; this one (weights offloaded to disk: disk.py's ``NodeDiskCache``):

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
  (``offcache.engine.map_shared``; region.py holds the region) and registers that mapping
  once: on CUDA ``cudaHostRegister`` in chunks of at most 64 GiB, in relaxed capture mode, every
  return code checked, the chunks made undone on a failure, unregistered (after the copies still
  reading it) before it is unmapped; ranks registering at the same time each register their own
  mapping. The host backend keeps the same bookkeeping without a driver call. The region counts
  once per node against the pinned budget: each rank counts 1/``node_ranks`` of every mapping
  against its own (``offcache.stats()``' ``shared_pinned_share_bytes``; the arena's
  ``pinned_limit_bytes`` is the budget less it).
- onloads through the engine: an onload is an engine fetch from the region (asynchronous, from
  pinned memory), and the sequential pipeline's subgraphs prefetch the next one's weights as
  with one process (offcache.weights.ct_patch's prefetcher and bookkeeping.py's
  rules). An onload to the CPU is a copy, as ``OffcacheCPUCache``'s (compressed-tensors' class
  hands out the shared tensor itself there; the copy keeps its ``requires_grad``).
- invalidates across processes: every tensor of the region has a generation word in it
  (region.py's layout), odd while a rank's ``update_offload`` writes it and 2 more after;
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
``as_single_threaded()`` an offload is ``CPUCache``'s, this rank's alone (batch.py).

Fallbacks. Where memfd, the ``/proc`` hand-over or the registration of the region's first page
(the probe every rank makes at set-up: a low memlock limit, the pinned budget) fails on any rank,
one :class:`NodeRegionFallbackWarning` names the reason and every rank uses compressed-tensors'
``DistributedCPUCache``: a region whose onloads copy from pageable memory would make every H2D
copy block its caller, which is what compressed-tensors' class does already with less machinery.
Where a later mapping cannot be registered (the memlock limit or the pinned budget reached
mid-run, with tensors in the region already), one :class:`NodeRegionPinWarning` names the reason
and that mapping's onloads are engine fetches from pageable memory (``stats()["unpinned"]``).

``OFFCACHE_NODE_ONLOAD=sliced`` (default ``full``): a prefetch of the region's tensors is shared
out between the node's ranks, each fetching 1/N of it and all-gathering the rest (sliced.py).
The set-up checks the setting on every rank (a garbage value, or ranks that disagree: ValueError), and
in the sliced mode ``OFFCACHE_WEIGHT_PREFETCH`` too (every prefetch is a collective there: a rank that
prefetches less, or raises on a garbage value, would leave the others in it).

Not yet: the space of deleted or replaced tensors is not reused (the region only grows until the
run ends).

The package, one module per part (none imports this file; cpu.py and disk.py need compressed-tensors):

    group.py   the node group: which ranks share a node, the set-up every rank makes together
    region.py  the region: its memfd, allocator, registered mappings, generation words
    cpu.py     NodeSharedCPUCache: DistributedCPUCache with its tensors in the region
    disk.py    NodeDiskCache: DistributedDiskCache read through the engine, once per node
    warm.py    the page-cache warm-up before the engine reads checkpoint bytes (disk.py)
    sliced.py  OFFCACHE_NODE_ONLOAD=sliced: a prefetch shared out between the node's ranks
    batch.py   what cpu.py and disk.py share: a batch per module, its checks and verdicts
"""

from __future__ import annotations

import warnings

import torch.distributed as dist

from offcache.util.extras import as_missing

try:
    from compressed_tensors.offload.cache.dist_cpu import DistributedCPUCache
except ModuleNotFoundError as _missing:  # one line naming the extra
    raise as_missing(
        _missing, ("compressed_tensors", "transformers"), "llmcompressor", "offcache.weights.node"
    ) from None

from offcache import engine as _engine  # noqa: E402
from offcache.weights.node.cpu import NodeSharedCPUCache  # noqa: E402
from offcache.weights.node.disk import NodeDiskCache  # noqa: E402
from offcache.weights.node.group import GROUP, setup  # noqa: E402
from offcache.weights.node.region import (  # noqa: E402
    NodeRegion,
    NodeRegionFallbackWarning,
    NodeRegionFullError,
    NodeRegionPinWarning,
    NodeShapeMismatchError,
    node_key,
    node_limit,
)
from offcache.weights.node.sliced import NodeRankLostError, NodeSlicedPlanError  # noqa: E402

__all__ = [
    "GROUP",
    "NodeDiskCache",
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


def cache_class() -> type:
    """The class for distributed CPU offload: NodeSharedCPUCache, or compressed-tensors' own where the
    region cannot be set up (one warning says why). Decided once, by every rank together."""
    if GROUP.world is not dist.group.WORLD:  # a new process group (the old one destroyed): decide again
        reset()
        GROUP.world = dist.group.WORLD
    if GROUP.decided is None:
        reason = setup()
        GROUP.decided = "fallback" if reason else "node"
        if reason:
            GROUP.fallback_reason = reason
            warnings.warn(
                f"offcache: no node-shared weight region ({reason}); compressed-tensors' "
                "DistributedCPUCache keeps the offloaded weights",
                NodeRegionFallbackWarning,
                stacklevel=2,
            )
    return NodeSharedCPUCache if GROUP.decided == "node" else DistributedCPUCache


def reset() -> None:
    """Forget the decision (tests; a new process group). Tensors already offloaded stay valid."""
    GROUP.reset()


def stats() -> dict:
    """The node region's state in this process: bytes used, the limit, the decision, and what this
    process registered of it (see offcache.stats()' shared_* keys for the engine's side)."""
    node = GROUP.node
    if node is None:
        return {"decided": GROUP.decided, "fallback_reason": GROUP.fallback_reason}
    region = node.region
    engine = _engine.stats()
    return {
        "decided": GROUP.decided,
        "node": node.keys[node.rank],
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
