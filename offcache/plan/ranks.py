"""A torchrun job in the plan: every rank its own activation cache, the offloaded weights once per node.

llm-compressor's data-parallel oneshot splits the calibration set over the job's ranks
(``datasets/utils.py``: rank i of W gets samples ``[S*i//W, S*(i+1)//W)``), and every rank runs
every subgraph on its share with a cache of its own, so the cache lines of the plan are the
largest rank's, and a node holds ``nproc_per_node`` of them. Its offloaded weights are one shared
region per node (offcache's ``NodeSharedCPUCache``; compressed-tensors' ``DistributedCPUCache``
shares them too), counted once; one copy per rank would hold ``nproc_per_node`` times that.

Each rank's limits are what its engine would resolve: a percentage (``OFFCACHE_HOST_LIMIT=25%``,
the defaults) is shared by the node's ranks, a size is each rank's; the node's region may hold
the ranks' host limits together (``offcache.weights.node.node_limit``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from offcache import engine as _engine


@dataclass
class Node:
    """A torchrun job's node: its ranks' caches, one each, and the offloaded weights once."""

    nproc_per_node: int
    nnodes: int
    world_size: int
    samples_per_rank: int  # the largest rank's share of the calibration set: the cache lines are its
    cache_host_bytes: int  # every rank's cache in host memory (pinned + pageable), together
    cache_disk_bytes: int  # every rank's disk tier, together
    weight_host_bytes: int  # the offloaded weights in host memory: once per node (one shared region)
    weight_region_limit_bytes: int  # the most the node's region may hold: its ranks' host limits together
    host_bytes: int  # cache_host_bytes + weight_host_bytes
    per_rank_copies_bytes: int  # what one copy of the offloaded weights per rank would hold instead


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    return value


def job(nproc_per_node: int | None, nnodes: int | None) -> tuple[int, int]:
    """(ranks per node, nodes): as given, else from torchrun's LOCAL_WORLD_SIZE and WORLD_SIZE, else 1."""
    if nproc_per_node is None:
        nproc_per_node = _engine.local_world_size()
    nproc_per_node = _count("nproc_per_node", nproc_per_node)
    if nnodes is None:
        world = os.environ.get("WORLD_SIZE", "").strip()
        if world and "LOCAL_WORLD_SIZE" in os.environ:
            w = _count("WORLD_SIZE", int(world) if world.isdigit() else world)
            if w % nproc_per_node:
                raise ValueError(
                    f"WORLD_SIZE {w} is not a multiple of LOCAL_WORLD_SIZE {nproc_per_node}: give nnodes "
                    "(--nnodes) and nproc_per_node (--nproc-per-node)"
                )
            nnodes = w // nproc_per_node
        else:
            nnodes = 1
    return nproc_per_node, _count("nnodes", nnodes)


def samples_per_rank(samples: int, world: int) -> int:
    """The largest rank's share of `samples` as llm-compressor splits them over `world` ranks."""
    if samples < world:
        raise ValueError(
            f"{samples} samples for {world} ranks: llm-compressor gives every rank a share of the "
            "calibration set, and a rank with none fails; use at least one sample per rank"
        )
    return max(samples * (i + 1) // world - samples * i // world for i in range(world))


def rank_settings(settings: dict, nproc_per_node: int, memory: int | None = None) -> dict:
    """The engine's settings as each of `nproc_per_node` local ranks would resolve them (a percentage of
    `memory` where given: a run's memory limit; else of this process's memory)."""
    out = dict(settings)
    for key, spec in (settings.get("limit_specs") or {}).items():
        out[key] = _engine.memory_share(spec, key, ranks=nproc_per_node, memory=memory)
    return out


def node(nproc: int, nnodes: int, share: int, tiers, weights, settings: dict) -> Node:
    """The node's host memory: `nproc` caches like `tiers`, the weights' host part once."""
    cache_host = nproc * (tiers.pinned_bytes + tiers.pageable_bytes)
    offloaded = weights.ram_bytes if weights.placement != "gpu" else 0
    return Node(
        nproc_per_node=nproc, nnodes=nnodes, world_size=nproc * nnodes, samples_per_rank=share,
        cache_host_bytes=cache_host, cache_disk_bytes=nproc * tiers.disk_bytes, weight_host_bytes=offloaded,
        weight_region_limit_bytes=settings.get("host_limit", 0) * nproc, host_bytes=cache_host + offloaded,
        per_rank_copies_bytes=nproc * offloaded,
    )  # fmt: skip


def advice(n: Node, text, safe_per_rank: int | None = None) -> list[str]:
    """Advice for a torchrun job (`text`: bytes as text; `safe_per_rank`: the largest host limit per rank the
    planner advises on this machine, None for no bound)."""
    if n.world_size == 1 or n.weight_host_bytes <= n.weight_region_limit_bytes:
        return []
    per_rank_mib = -(-n.weight_host_bytes // (n.nproc_per_node << 20))
    said = (
        f"The offloaded weights in host memory ({text(n.weight_host_bytes)}) exceed what the node's shared "
        f"region may hold, the {n.nproc_per_node} ranks' host limits together ({text(n.weight_region_limit_bytes)}): "
        "offloading them would raise NodeRegionFullError; "
    )
    if safe_per_rank is not None and per_rank_mib << 20 > safe_per_rank:
        return [
            said + f"holding them would take OFFCACHE_HOST_LIMIT={per_rank_mib}MiB per rank, more than this machine "
            f"holds safely ({text(safe_per_rank)} per rank): offload the weights to disk instead"
        ]
    return [
        said + f"OFFCACHE_HOST_LIMIT={per_rank_mib}MiB (each rank's limit, which its cache has too) or more holds them."
    ]
