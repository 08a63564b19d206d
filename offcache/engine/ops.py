"""Thin typed wrappers over the compiled engine's calls: store, fetch, copies, stats and their tickets."""

from __future__ import annotations

import operator
import os
import time
import warnings
from collections.abc import Sequence

import torch

from offcache.engine import disk_dir as _disk
from offcache.engine.config import ensure_configured
from offcache.engine.loader import _C

Tensor = torch.Tensor
Ticket = _C.Ticket


def _engine():
    """offcache._C, its process-wide engine configured (from the environment at the first call)."""
    ensure_configured()
    return _C


class SpillWarning(UserWarning):
    """Values no longer fit the pinned budget and now live in pageable memory (or on disk)."""


class CapacityWarning(UserWarning):
    """A run is projected to need more than the host limit plus the disk tier's free space."""


# A store would cross the host limit and there is no disk tier to take it (a MemoryError).
HostLimitError: type[MemoryError] = _C.HostLimitError


# Counters kept above the engine (offcache.weights' weight_* keys), merged into stats(): the
# engine cannot import the concerns that count them, so they hand it their dicts (add_counters).
_COUNTERS: list[dict[str, int | float]] = []


def add_counters(counters: dict[str, int | float]) -> None:
    """Merge `counters` (a dict its owner keeps updating) into every later ``stats()``."""
    if not any(c is counters for c in _COUNTERS):
        _COUNTERS.append(counters)


def stats() -> dict:
    """Counters of the process's engine: bytes pinned, in use, pageable, in flight, copied, ...

    Disk tier: disk_bytes (in use), disk_reserved_bytes (files' size), disk_files,
    disk_write_bytes / disk_read_bytes and disk_write_seconds / disk_read_seconds (I/O thread
    time), disk_fallbacks (direct I/O refused: buffered I/O instead), host_limit_bytes (with or
    without a disk tier). Model weights (``patch_llmcompressor(weights=True)``): the ``weight_*``
    keys (offcache/weights/bookkeeping.py's counters, handed in with ``add_counters``).

    Shared mappings (``offcache.weights.node``'s region; process-wide, every engine's):
    shared_mapped_bytes (this process's live mappings of it), shared_registered_bytes (of them,
    registered: pinned on CUDA, bookkeeping on the host backend), shared_pinned_share_bytes (what
    they count against this process's pinned budget: each mapping's bytes divided by the node's
    ranks, so the node's ranks together count the region once; ``pinned_limit_bytes``, the
    arena's budget, is the pinned budget less it), shared_mappings, shared_registrations (chunk
    registrations made), shared_register_failures (mappings left pageable),
    shared_unregister_failures, shared_register_seconds, shared_fetches / shared_fetch_bytes
    (fetches reading a mapping) and shared_pinned_fetch_bytes (of them, from registered ones),
    shared_deferred_unmaps (dead mappings waiting for their copies).
    """
    out = _engine().stats()
    for counters in _COUNTERS:
        out.update(counters)
    return out


def synchronize() -> None:
    """Wait for every copy in flight and return freed blocks to the arena."""
    _engine().synchronize()


def empty_cache() -> int:
    """synchronize(), then give every empty arena chunk back to the OS. Returns the bytes released."""
    return _engine().empty_cache()


def backend_name() -> str:
    """'cuda' or 'host': the backend of the process-wide engine."""
    return _engine().backend_name()


def build_info(version: str) -> dict:
    """The package `version` with the build variant (e.g. 0.2.0+cu130 or 0.2.0+cpu), torch, CUDA and backend."""
    variant = "cu" + _C.cuda_version.replace(".", "") if _C.cuda_compiled else "cpu"
    return {
        "version": f"{version}+{variant}",
        "torch": _C.torch_version,
        "torch_runtime": torch.__version__,
        "cuda": bool(_C.cuda_compiled),
        "cuda_version": _C.cuda_version,
        "backend": backend_name(),
    }


# The engine calls ---------------------------------------------------------------------------


def store(values: Sequence[Tensor], device: torch.device, allow_spill: bool = True) -> list[Tensor]:
    """Snapshot `values` now and copy them to `device` (CPU: the pinned arena), in order.

    The result holds what the values held at the call, whatever the caller does to them
    afterwards. With allow_spill=False a value that does not fit the arena comes back as is.
    """
    values = list(values)
    engine = _engine()  # configured first: a disk tier it arms is made here, as for any store
    if _disk.pending():
        _disk.make_disk_dir(sum([v.numel() * v.element_size() for v in values]))
    return engine.store(values, device, allow_spill)


def fetch(stored: Sequence[Tensor], device: torch.device, wait: bool = True) -> tuple[list[Tensor], Ticket]:
    """Copies of `stored` on `device`, and the ticket of their copy.

    wait=True: the current stream of `device` already waits for the copy. Otherwise call
    ``ticket.wait()`` before using the tensors.
    """
    return _engine().fetch(list(stored), device, wait)


def fetch_file(
    path: str | os.PathLike,
    items: Sequence[tuple[int, Sequence[int], torch.dtype]],
    device: torch.device,
    wait: bool = True,
) -> tuple[list[Tensor], Ticket]:
    """Tensors read from a file straight onto `device`: items[i] = (byte offset, shape, dtype).

    Tensor i is contiguous and holds the file's bytes [offset, offset + nbytes), as safetensors
    lays a tensor out. The engine's I/O thread reads the file in 8 MiB pieces (O_DIRECT where
    the file system allows it) into bounce buffers (pinned on CUDA) and issues each piece's
    copy as soon as it is read, so the calling thread does not wait for the disk and copies
    overlap reads. The file must not change until the ticket completes. wait: as ``fetch``'s;
    ``ticket.wait()`` raises if a read failed (the path and the reason).
    """
    likes = [torch.empty(tuple(shape), dtype=dtype, device="meta") for _, shape, dtype in items]
    offsets = [operator.index(offset) for offset, _, _ in items]  # a float offset is a TypeError
    return _engine().fetch_file(os.fspath(path), offsets, likes, device, wait)


def copy_into(dsts: Sequence[Tensor], srcs: Sequence[Tensor], wait: bool = False) -> Ticket:
    """Copy srcs[i] into the existing tensor dsts[i] (same shape and dtype) on the engine's copy streams.

    Device -> host pairs run on the D2H stream after the work queued on the source's current
    stream; host -> device pairs on the H2D stream after the work queued on the destination's
    current stream and after any copy still writing the source. Host memory must be offcache's
    (a view of a tensor returned by store(): the pinned arena). Views are allowed when each side
    is rows of contiguous bytes at one pitch (e.g. ``x[:, :, a:b, :]`` of a contiguous
    ``[B, H, S, D]``): one 2-D copy call per pair. Sources are kept alive until the copy
    completes and must not be modified before then (no snapshot is taken). wait=True: the
    current stream (of the destination's device) waits for the copy; else ``ticket.wait()`` does.
    Bytes count in stats()' d2h_bytes / h2d_bytes.
    """
    return _engine().copy_into(list(dsts), list(srcs), wait)


def set_timing(on: bool) -> None:
    """Time every copy batch with timed events (stats' d2h_seconds / h2d_seconds). Off by default."""
    _engine().set_timing(bool(on))


def wait_on_host(ticket: Ticket | None) -> None:
    """Block the calling thread until `ticket`'s copies completed (on a GPU too, where ``ticket.wait()``
    only orders a stream): then the host memory they read can be written."""
    while ticket is not None and not ticket.query():
        time.sleep(20e-6)


def wait_stored(t: Tensor) -> None:
    """Block until the store that produced `t` has written it, so it can be read directly."""
    _engine().wait_stored(t)


def is_arena_tensor(t: Tensor) -> bool:
    """True for a stored tensor in the pinned arena of the current engine."""
    return _engine().is_arena_tensor(t)


def record_stream(t: Tensor, stream: torch.Stream) -> None:
    """``t.record_stream(stream)`` for a fetched tensor: the allocation it lives in is kept from reuse
    until `stream`'s work queued so far is done. A fetched value under 1 MiB is a storage inside one
    allocation shared with the values fetched with it, which ``Tensor.record_stream`` does not reach."""
    _engine().allocation_of(t).record_stream(stream)


def map_shared(fd: int, offset: int, nbytes: int, ranks: int) -> tuple[Tensor, str]:
    """Map bytes [offset, offset + nbytes) of the shared file `fd` (page-aligned) and register the
    mapping with the engine once: (its bytes as a uint8 CPU tensor, '' or why it is not registered).

    On CUDA the mapping is pinned with cudaHostRegister in chunks of at most 64 GiB, under relaxed
    capture mode; a failure unregisters the chunks made and leaves it pageable. The host backend
    keeps the same bookkeeping without a driver call. Fetches copy from it as from the arena
    (also to the CPU). `ranks` processes map these bytes: each counts 1/ranks of them against
    its pinned budget. The tensor's storage owns the mapping: when it dies the mapping is
    unregistered after the copies reading it, then unmapped.
    """
    return _engine().map_shared(
        operator.index(fd), operator.index(offset), operator.index(nbytes), operator.index(ranks)
    )


def is_shared_tensor(t: Tensor) -> bool:
    """True for a CPU tensor viewing a mapping made by map_shared()."""
    return _engine().is_shared_tensor(t)


def is_pinned_shared_tensor(t: Tensor) -> bool:
    """True for a CPU tensor viewing a registered mapping made by map_shared()."""
    return _engine().is_pinned_shared_tensor(t)


def wait_shared_reads(t: Tensor) -> None:
    """Block until the copies reading `t`'s shared mapping completed, so its bytes may be written."""
    _engine().wait_shared_reads(t)


def shared_word_add(word: Tensor, delta: int) -> int:
    """Atomically add `delta` to the 8-byte word `word` (shared memory; 0: a load); the new value."""
    return _engine().shared_word_add(word, delta)


def _fail_register(after: int, reason: str) -> None:
    """Tests only: the registration of chunk `after` of the next map_shared() fails, once."""
    _engine()._fail_register(after, reason)


def _set_register_chunk(nbytes: int) -> None:
    """Tests only: register shared mappings in chunks of at most `nbytes` (0: 64 GiB)."""
    _engine()._set_register_chunk(nbytes)


def is_disk_tensor(t: Tensor) -> bool:
    """True for a stored tensor whose bytes live in the disk tier (a mapped file)."""
    return _engine().is_disk_tensor(t)


def is_offcache_tensor(t: Tensor) -> bool:
    """True for a CPU tensor whose memory offcache manages (arena or spilled)."""
    return _engine().is_offcache_tensor(t)


def trace_start(device: torch.device) -> None:
    """Record copy batches from now on, timed from an event on `device`'s current stream."""
    _engine().trace_start(device)


def trace_stop() -> list[dict]:
    """The copy batches since trace_start: stream ('d2h'/'h2d'), bytes, start_ms, end_ms."""
    return _engine().trace_stop()


def _fail_next_copy() -> None:
    """Tests only: the next host-backend copy call queues its copies, then raises."""
    _engine()._fail_next_copy()


def _fail_next_task() -> None:
    """Tests only: the next host copy task fails on its worker thread (as a CUDA event wait can)."""
    _engine()._fail_next_task()


def _fail_query_after(skip: int, transient: bool = False) -> bool:
    """Tests only: the event query after the next `skip` ones raises, once (transient: as during
    another thread's CUDA graph capture, a state asked again later; else as on a broken context).
    skip < 0 disarms. Returns whether a fault armed before had not fired yet."""
    return _engine()._fail_query_after(skip, transient)


def warn_if_spilled(stacklevel: int = 2) -> None:
    """Emit the engine's one-time spill notice as a SpillWarning pointing at the caller's caller."""
    notice = _engine().take_spill_notice()
    if notice:
        warnings.warn(notice, SpillWarning, stacklevel=stacklevel + 1)
