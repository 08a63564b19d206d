"""The node group: which ranks share a node, the region they share, and the decision every rank
takes together (offcache/weights/node/__init__.py explains the whole).

It imports nothing of compressed-tensors.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from offcache.weights.bookkeeping import prefetch_depth
from offcache.weights.node import sliced
from offcache.weights.node.region import NodeRegion, node_key, node_limit


class Node:
    """This process's region and where it stands in the group."""

    def __init__(self, region: NodeRegion, keys: list[str]):
        self.region = region
        self.keys = keys  # rank -> node key
        self.rank = dist.get_rank()
        self.multi = len(set(keys)) > 1

    def leader(self, key: str) -> int:
        return self.keys.index(key)


class NodeGroup:
    """The decision for distributed CPU offload, taken once per process group by every rank together."""

    def __init__(self) -> None:
        self.node: Node | None = None
        self.decided: str | None = None  # None: not yet; "node": NodeSharedCPUCache; "fallback": upstream's
        self.fallback_reason = ""
        self.world: Any = None  # the process group the decision was made in

    def reset(self) -> None:
        self.node = None
        self.decided = None
        self.fallback_reason = ""
        sliced.reset()


GROUP = NodeGroup()  # this process's


def setup() -> str:
    """Set up this node's region, collectively; '' or the reason it failed (the same on every rank)."""
    key = node_key()
    error = ""
    try:
        if not hasattr(os, "memfd_create"):
            raise OSError("os.memfd_create is not available on this platform")
    except OSError as exc:
        error = f"{key}: {exc}"
    try:
        mode = sliced.onload_mode()
    except ValueError as exc:
        mode = str(exc)
    try:
        depth: int | str = prefetch_depth()
    except ValueError as exc:
        depth = str(exc)
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, (key, os.getpid(), error, mode, depth))
    # ValueError on every rank: garbage, or disagreement (the prefetch depth too, in the sliced mode)
    sliced.check_modes([k[3] for k in keys], [k[4] for k in keys])
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
    GROUP.node = Node(region, node_keys)
    if mode == "sliced":
        sliced.setup(node_keys, [k[1] for k in keys])  # collective: every rank got here
    return ""
