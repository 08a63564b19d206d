"""The node's shared region (offcache/weights/node/__init__.py explains the whole): one memfd, its allocator,
its mappings (registered with the engine once each) and the generation word of every tensor in it.

Layout: the first page holds the bump pointer (uint64); then batches, each page-aligned: a table
of generation words (uint64, one per tensor the batch adds, rounded to 64 bytes), then the
tensors, each 64-byte aligned. A tensor's generation is odd while a rank writes it and grows by
2 per write (``update_offload``) or per hand-out under ``disable_onloading()``: a prefetched
copy whose generation changed since its fetch was issued is stale.
"""

from __future__ import annotations

import bisect
import fcntl
import math
import mmap
import os
import socket
import struct
import warnings
import weakref

import torch

from offcache import engine as _engine

_PAGE = mmap.ALLOCATIONGRANULARITY
_HEADER = _PAGE  # the first page holds the bump pointer (uint64)
_GROW = 64 << 20  # the region grows in steps of this many bytes
ALIGN = 64  # each tensor's offset within a batch
WORD = 8  # a generation word


class NodeRegionFallbackWarning(UserWarning):
    """The node region could not be set up: compressed-tensors' DistributedCPUCache is used."""


class NodeRegionPinWarning(UserWarning):
    """A mapping of the node region could not be registered: its onloads copy from pageable memory."""


class NodeRegionFullError(MemoryError):
    """A batch would take the node's region past the node's host limit."""


class NodeShapeMismatchError(RuntimeError):
    """Ranks disagree on the shape or dtype of a tensor being offloaded."""


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def node_key() -> str:
    """This process's node: torchrun's GROUP_RANK on this host (the host alone without torchrun)."""
    group = os.environ.get("GROUP_RANK")
    host = socket.gethostname()
    return f"{host}/node{group}" if group is not None else host


def node_limit() -> int:
    """Bytes the node's region may hold: the node's ranks' host_limit shares together."""
    return _engine.settings()["host_limit"] * _engine.local_world_size()


def nbytes_of(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * dtype.itemsize


def plain(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s bytes, in order, are its values: contiguous, no lazy conjugate or negative bit
    (``Tensor.conj()`` is a contiguous view whose bytes are the unconjugated values)."""
    return tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


_pin_warned = False


class NodeRegion:
    """One memfd, shared by the ranks of a node: a bump allocator in its first page, batches after.

    Allocations and growth take ``flock`` on the file (every rank has its own open file
    description, so the lock works between them). A batch's span is mapped once per process by
    the engine (``map_shared``: registered once, pinned on CUDA) and never unmapped while a
    tensor views it: the mapping's storage unregisters and unmaps it when the last one dies.
    `ranks`: the node's ranks, each mapping every span (each counts 1/ranks of it against its
    pinned budget).
    """

    def __init__(self, fd: int, limit: int, ranks: int = 1):
        self.fd = fd
        self.limit = limit
        self.ranks = ranks
        self._starts: list[int] = []  # sorted span starts (file offsets) mapped in this process
        self._spans: dict[int, tuple[int, torch.Tensor]] = {}  # start -> (length, its bytes)
        self._addrs: list[tuple[int, int]] = []  # sorted (address where a span is mapped, its start)
        self._tensors: list[tuple[int, int, int]] = []  # sorted (offset, end, generation word offset)
        self._words: dict[int, torch.Tensor] = {}  # generation word offset -> its 8 bytes
        # (offset, dtype, shape) -> this process's offloaded tensor of that entry (one object per entry)
        self._adopted: dict[tuple, weakref.ref] = {}
        self.unpinned: list[str] = []  # why mappings were left unregistered (pageable)
        self.probe: torch.Tensor | None = None  # the header page, mapped through the engine

    @classmethod
    def create(cls, name: str, limit: int, ranks: int = 1) -> NodeRegion:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, _HEADER)
        return cls(fd, limit, ranks)

    @classmethod
    def open(cls, pid: int, fd: int, limit: int, ranks: int = 1) -> NodeRegion:
        return cls(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC), limit, ranks)

    def register_probe(self) -> str:
        """Map the header page through the engine: '' where it registered, else why not (the
        node then falls back: see node/__init__.py)."""
        self.probe, reason = _engine.map_shared(self.fd, 0, _HEADER, self.ranks)
        return reason

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
                    os.ftruncate(self.fd, min(round_up(end, _GROW), self.limit + _HEADER))
                struct.pack_into("<Q", head, 0, max(bump, end))
            return start
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def allocate(self, nbytes: int) -> int:
        """A new page-aligned span of `nbytes` (> 0): its file offset."""
        return self._locked(lambda bump: (bump, bump + round_up(nbytes, _PAGE)))

    def reserve(self, start: int, nbytes: int) -> None:
        """Make [start, start + nbytes) part of the region (another node's allocation, mirrored)."""
        self._locked(lambda bump: (start, start + round_up(nbytes, _PAGE)))

    @property
    def used(self) -> int:
        with mmap.mmap(self.fd, _HEADER, mmap.MAP_SHARED, mmap.PROT_READ) as head:
            return max(struct.unpack_from("<Q", head, 0)[0] - _HEADER, 0)

    # -- mapping --
    def span(self, start: int, nbytes: int) -> torch.Tensor:
        """The bytes of the span starting at `start` (mapped and registered on first use), as uint8."""
        if start not in self._spans:
            length = round_up(nbytes, _PAGE)
            data, reason = _engine.map_shared(self.fd, start, length, self.ranks)
            if reason:
                self.unpinned.append(reason)
                _warn_unpinned(reason)
            self._spans[start] = (length, data)
            bisect.insort(self._starts, start)
            bisect.insort(self._addrs, (data.data_ptr(), start))
        return self._spans[start][1]

    def storage(self, offset: int) -> tuple[torch.UntypedStorage, int]:
        """The storage of the mapped span holding file offset `offset`, and the offset's byte in it."""
        i = bisect.bisect_right(self._starts, offset) - 1
        start = self._starts[i]
        return self._spans[start][1].untyped_storage(), offset - start

    def locate(self, tensor: torch.Tensor) -> int | None:
        """The file offset of a plain CPU tensor's first byte if it lies in a span mapped here, else None."""
        if tensor.device.type != "cpu" or not plain(tensor):
            return None
        ptr = tensor.data_ptr()
        i = bisect.bisect_right(self._addrs, (ptr, float("inf"))) - 1
        if i < 0:
            return None
        base, start = self._addrs[i]
        if ptr + tensor.nbytes <= base + self._spans[start][0]:
            return start + (ptr - base)
        return None

    # -- generations --
    def note(self, offset: int, nbytes: int, word: int) -> None:
        """A tensor of `nbytes` at `offset` whose generation is the word at `word` (a batch added it)."""
        bisect.insort(self._tensors, (offset, offset + nbytes, word))

    def word_at(self, offset: int) -> int | None:
        """The generation word's offset of the tensor holding byte `offset` (None: no tensor there)."""
        i = bisect.bisect_right(self._tensors, (offset, float("inf"), 0)) - 1
        if i < 0:
            return None
        start, end, word = self._tensors[i]
        return word if offset < end or offset == start else None

    def word(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The 8 bytes of `tensor`'s generation word, where it is a tensor of this region, else None."""
        offset = self.locate(tensor)
        at = None if offset is None else self.word_at(offset)
        if at is None:
            return None
        if at not in self._words:
            storage, byte = self.storage(at)
            self._words[at] = torch.empty(0, dtype=torch.uint8).set_(storage, byte, (WORD,))
        return self._words[at]

    # -- this process's tensor of each entry --
    def adopted(self, offset: int, dtype: torch.dtype, shape) -> torch.Tensor | None:
        """The tensor this process offloaded at `offset` with `dtype` and `shape`, while it is alive
        and still views those bytes as such; else None."""
        ref = self._adopted.get((offset, dtype, tuple(shape)))
        tensor = ref() if ref is not None else None
        if tensor is None or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            return None
        return tensor if self.locate(tensor) == offset else None

    def remember(self, tensor: torch.Tensor, offset: int) -> None:
        """`tensor` is this process's offloaded tensor of the entry at `offset` (its dtype and shape)."""
        self._adopted[(offset, tensor.dtype, tuple(tensor.shape))] = weakref.ref(tensor)

    def close(self) -> None:
        self._adopted.clear()
        self._spans.clear()
        self._starts.clear()
        self._addrs.clear()
        self._tensors.clear()
        self._words.clear()
        self.probe = None
        os.close(self.fd)


def _warn_unpinned(reason: str) -> None:
    global _pin_warned
    if _pin_warned:
        return
    _pin_warned = True
    warnings.warn(
        f"offcache: a mapping of the node's weight region could not be registered ({reason}); its "
        "onloads copy from pageable memory (on a GPU the caller waits for each)",
        NodeRegionPinWarning,
        stacklevel=3,
    )
