"""Offloaded weights shared by the ranks of a node, in one anonymous shared-memory region.

Under ``torch.distributed``, ``patch_llmcompressor(weights=True)`` gives compressed-tensors'
``cls_from_device("cpu")`` :class:`NodeSharedCPUCache` in place of its ``DistributedCPUCache``
(``cache_class()`` decides, once, for every rank together). Compressed-tensors' class writes each
tensor to its own ``/dev/shm`` file and broadcasts its name with a broadcast and a barrier per
tensor; this one:

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

Everything else (onload, ``update_offload``: a copy into the shared bytes, visible to every rank
of the node after a barrier; ``__delitem__``, ``disable_onloading`` / ``disable_offloading``,
tied weights, tensor subclasses) is compressed-tensors' ``DistributedCPUCache`` / ``CPUCache``.

Where memfd or the ``/proc`` hand-over is unavailable on any rank, one
:class:`NodeRegionFallbackWarning` names the reason and compressed-tensors' own class is used
by every rank.

Not yet: registering the region with CUDA (``cudaHostRegister`` of each mapped batch, through
the engine) so onloads are asynchronous H2D copies from pinned memory; onloads are
compressed-tensors' synchronous ``.to(device)`` for now. Space of deleted or replaced tensors is
not reused (the region only grows until the run ends).
"""

from __future__ import annotations

import bisect
import fcntl
import mmap
import os
import socket
import struct
import warnings
from typing import Any

import torch
import torch.distributed as dist

from offcache.util.extras import as_missing

try:
    from compressed_tensors.distributed import get_source_rank, is_source_process
    from compressed_tensors.offload.cache.dist_cpu import DistributedCPUCache
    from compressed_tensors.offload.cache.utils import catch_cpu_mem_error
    from compressed_tensors.offload.utils import to_tensor
except ModuleNotFoundError as _missing:  # one line naming the extra
    raise as_missing(
        _missing, ("compressed_tensors", "transformers"), "llmcompressor", "offcache.weights.node"
    ) from None

from offcache import engine as _engine  # noqa: E402

__all__ = [
    "NodeRegion",
    "NodeRegionFallbackWarning",
    "NodeRegionFullError",
    "NodeShapeMismatchError",
    "NodeSharedCPUCache",
    "cache_class",
    "node_key",
    "reset",
]

_PAGE = mmap.ALLOCATIONGRANULARITY
_HEADER = _PAGE  # the first page holds the bump pointer (uint64)
_GROW = 64 << 20  # the region grows in steps of this many bytes
_ALIGN = 64  # each tensor's offset within a batch


class NodeRegionFallbackWarning(UserWarning):
    """The node region could not be set up: compressed-tensors' DistributedCPUCache is used."""


class NodeRegionFullError(MemoryError):
    """A batch would take the node's region past the node's host limit."""


class NodeShapeMismatchError(RuntimeError):
    """Ranks disagree on the shape or dtype of a tensor being offloaded."""


def _round(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def node_key() -> str:
    """This process's node: torchrun's GROUP_RANK on this host (the host alone without torchrun)."""
    group = os.environ.get("GROUP_RANK")
    host = socket.gethostname()
    return f"{host}/node{group}" if group is not None else host


def node_limit() -> int:
    """Bytes the node's region may hold: the node's ranks' host_limit shares together."""
    return _engine.settings()["host_limit"] * _engine.local_world_size()


class NodeRegion:
    """One memfd, shared by the ranks of a node: a bump allocator in its first page, batches after.

    Allocations and growth take ``flock`` on the file (every rank has its own open file
    description, so the lock works between them). A batch's span is mapped once per process and
    never unmapped: tensors view it, and the mapping lives as long as the process.
    """

    def __init__(self, fd: int, limit: int):
        self.fd = fd
        self.limit = limit
        self._starts: list[int] = []  # sorted span starts (file offsets) mapped in this process
        self._spans: dict[int, tuple[int, mmap.mmap, torch.Tensor]] = {}  # start -> (length, map, bytes)
        self._addrs: list[tuple[int, int]] = []  # sorted (address where a span is mapped, its start)

    @classmethod
    def create(cls, name: str, limit: int) -> NodeRegion:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, _HEADER)
        return cls(fd, limit)

    @classmethod
    def open(cls, pid: int, fd: int, limit: int) -> NodeRegion:
        return cls(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC), limit)

    # -- allocation (under flock) --
    def _locked(self, fn):
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            with mmap.mmap(self.fd, _HEADER, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as head:
                (bump,) = struct.unpack_from("<Q", head, 0)
                bump = bump or _HEADER
                start, end = fn(bump)
                if end > self.limit + _HEADER:
                    raise NodeRegionFullError(
                        f"offcache's node region ({node_key()}) would hold {end - _HEADER} bytes, past the "
                        f"node's host limit of {self.limit} bytes (OFFCACHE_HOST_LIMIT x LOCAL_WORLD_SIZE)"
                    )
                if os.fstat(self.fd).st_size < end:
                    os.ftruncate(self.fd, min(_round(end, _GROW), self.limit + _HEADER))
                struct.pack_into("<Q", head, 0, max(bump, end))
            return start
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def allocate(self, nbytes: int) -> int:
        """A new page-aligned span of `nbytes` (> 0): its file offset."""
        return self._locked(lambda bump: (bump, bump + _round(nbytes, _PAGE)))

    def reserve(self, start: int, nbytes: int) -> None:
        """Make [start, start + nbytes) part of the region (another node's allocation, mirrored)."""
        self._locked(lambda bump: (start, start + _round(nbytes, _PAGE)))

    @property
    def used(self) -> int:
        with mmap.mmap(self.fd, _HEADER, mmap.MAP_SHARED, mmap.PROT_READ) as head:
            return max(struct.unpack_from("<Q", head, 0)[0] - _HEADER, 0)

    # -- mapping --
    def span(self, start: int, nbytes: int) -> torch.Tensor:
        """The bytes of the span starting at `start` (mapped on first use), as a uint8 tensor."""
        if start not in self._spans:
            length = _round(nbytes, _PAGE)
            mapped = mmap.mmap(self.fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
            data = torch.frombuffer(mapped, dtype=torch.uint8)
            self._spans[start] = (length, mapped, data)
            bisect.insort(self._starts, start)
            bisect.insort(self._addrs, (data.data_ptr(), start))
        return self._spans[start][2]

    def storage(self, offset: int) -> tuple[torch.UntypedStorage, int]:
        """The storage of the mapped span holding file offset `offset`, and the offset's byte in it."""
        i = bisect.bisect_right(self._starts, offset) - 1
        start = self._starts[i]
        return self._spans[start][2].untyped_storage(), offset - start

    def locate(self, tensor: torch.Tensor) -> int | None:
        """The file offset of a CPU tensor's first byte if it lies in a span mapped here, else None."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        ptr = tensor.data_ptr()
        i = bisect.bisect_right(self._addrs, (ptr, float("inf"))) - 1
        if i < 0:
            return None
        base, start = self._addrs[i]
        if ptr + tensor.nbytes <= base + self._spans[start][0]:
            return start + (ptr - base)
        return None

    def close(self) -> None:
        self._spans.clear()
        self._starts.clear()
        self._addrs.clear()
        os.close(self.fd)


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
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, (key, os.getpid(), error))
    errors = [e for _, _, e in keys if e]
    node_keys = [k for k, _, _ in keys]
    leader = node_keys.index(key)
    region = None
    fd = -1
    if not errors and leader == dist.get_rank():
        try:
            region = NodeRegion.create(f"offcache-weights-{key}", node_limit())
            fd = region.fd
        except OSError as exc:
            error = f"{key}: memfd_create failed: {exc}"
    fds: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(fds, (fd, error))
    errors += [e for _, e in fds if e]
    if not errors and region is None:
        try:
            region = NodeRegion.open(keys[leader][1], fds[leader][0], node_limit())
        except OSError as exc:
            error = f"{key}: opening the node region through /proc/{keys[leader][1]}/fd failed: {exc}"
    verdicts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, error)
    errors += [e for e in verdicts if e]
    if errors:
        if region is not None:
            region.close()
        return errors[0]
    _node = _Node(region, node_keys)
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


# --- the cache class ------------------------------------------------------------------------------


def _shape_of(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


class NodeSharedCPUCache(DistributedCPUCache):
    """compressed-tensors' ``DistributedCPUCache`` with its offloads in the node's region, a batch at a time."""

    @classmethod
    def from_mapping(cls, mapping, onload_device, offload_device=None, **kwargs):
        instance = cls(onload_device=onload_device, offload_device=offload_device, **kwargs)
        instance.offloaded_values = instance._offload_batch(dict(mapping))
        return instance

    _key: Any = None  # the name __setitem__ is offloading, for messages

    @catch_cpu_mem_error
    def offload(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        return self._offload_batch({None: tensor})[None]

    def __setitem__(self, key, value):
        self._key = key
        try:
            super().__setitem__(key, value)
        finally:
            self._key = None

    def _name(self, name) -> str:
        return str(self._key if name is None else name)

    @catch_cpu_mem_error  # compressed-tensors' remediation hint, as its from_mapping logs it (per offload)
    def _offload_batch(self, mapping: dict) -> dict:
        """Offload every tensor of `mapping` (name -> tensor or None): one broadcast, one all_gather."""
        node = _node
        assert node is not None, "NodeSharedCPUCache is used only after cache_class() set up the node region"
        region = node.region
        source = get_source_rank()
        names = [name for name, t in mapping.items() if t is not None]
        out = dict.fromkeys(mapping)

        if is_source_process():
            header: Any
            entries: list[tuple] = []
            new: list[tuple[int, torch.Tensor, int]] = []  # (entry index, cpu tensor, relative offset)
            try:
                seen: dict[int, int] = {}  # id(tensor) -> entry index (tied within the batch)
                total = 0
                for name in names:
                    t = mapping[name]
                    if id(t) in seen:
                        entries.append((name,) + entries[seen[id(t)]][1:])
                        continue
                    seen[id(t)] = len(entries)
                    offset = region.locate(t)
                    if offset is not None:  # already in the region (tied, or offloaded before)
                        entries.append((name, "at", offset, t.dtype, _shape_of(t)))
                        continue
                    rel = total
                    total = _round(total + max(t.nbytes, 1), _ALIGN)
                    new.append((len(entries), t, rel))
                    entries.append((name, "new", rel, t.dtype, _shape_of(t)))
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
                    for _, t, rel in new:
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
            adopted: dict[int, torch.Tensor] = {}  # id(this rank's tensor) -> its offload (tied stay one)
            for name, kind, offset, dtype, shape in entries:
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
        shape and dtype), else a new one with its class and attributes."""
        shape = torch.Size(shape)
        if not tensor.is_meta and (tensor.dtype != dtype or tensor.shape != shape):
            raise NodeShapeMismatchError(
                f"rank {dist.get_rank()}: ranks disagree on tensor {name!r}: the source rank "
                f"{get_source_rank()} offloads {tuple(shape)} {dtype}, this rank holds "
                f"{tuple(tensor.shape)} {tensor.dtype}"
            )
        storage, byte = region.storage(offset)
        if region.locate(tensor) == offset and tensor.is_contiguous():
            return tensor  # already this rank's view of these bytes
        if tensor.is_meta or tensor.device.type != "cpu" or not tensor.is_contiguous():
            target = to_tensor(torch.empty(0, dtype=dtype), tensor)
        else:
            target = tensor
        stride = torch.empty(shape, device="meta").stride()
        with torch.no_grad():
            target.set_(storage, storage_offset=byte // dtype.itemsize, size=shape, stride=stride)
        return target


def stats() -> dict:
    """The node region's state in this process: bytes used, the limit, and the decision."""
    if _node is None:
        return {"decided": _decided, "fallback_reason": _fallback_reason}
    return {
        "decided": _decided,
        "node": _node.keys[_node.rank],
        "used_bytes": _node.region.used,
        "limit_bytes": _node.region.limit,
        "mapped_spans": len(_node.region._starts),
    }
