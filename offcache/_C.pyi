"""Types of offcache._C, the compiled engine (csrc/bindings.cpp).

Only offcache/engine/ imports this module; everything else goes through its wrappers.
Copies and waits release the GIL.
"""

from collections.abc import Sequence
from typing import Literal, TypedDict

import torch

# _Stats and _TraceRow exist in this stub only (the module returns plain dicts).

class _Stats(TypedDict):
    """The engine's counters (``stats()``): bytes, counts, seconds, and whether the arena is pinned."""

    pinned_reserved_bytes: int
    pinned_in_use_bytes: int
    pageable_bytes: int
    in_flight_bytes: int
    deferred_bytes: int
    peak_pinned_reserved_bytes: int
    peak_pinned_in_use_bytes: int
    peak_pageable_bytes: int
    peak_in_flight_bytes: int
    peak_host_bytes: int
    dedup_hits: int
    spills: int
    blocks_reused_in_order: int
    staging_reserved_bytes: int
    stores: int
    fetches: int
    d2h_bytes: int
    h2d_bytes: int
    d2h_copies: int
    h2d_copies: int
    d2h_seconds: float
    h2d_seconds: float
    pinned_limit_bytes: int
    dedup_entries: int
    snapshot_bytes: int
    snapshot_fallbacks: int
    inline_store_copies: int
    lock_waits_over_1ms: int
    leaked_blocks: int
    events_created: int
    events_recorded: int
    stream_waits: int
    copy_calls: int
    host_callbacks: int
    pinned_registrations: int
    syncs: int
    host_limit_bytes: int
    disk_bytes: int
    disk_reserved_bytes: int
    peak_disk_bytes: int
    disk_files: int
    disk_write_bytes: int
    disk_read_bytes: int
    disk_write_seconds: float
    disk_read_seconds: float
    disk_fallbacks: int
    snapshot_oom_skips: int
    chunk_bytes: int
    chunk_seconds: float
    event_queries: int
    pinned_queries: int
    output_alloc_retries: int  # the allocator's free-and-retry met by fetch outputs (each synchronised)
    consumer_pool_fetches: int  # fetches whose outputs came from the consumer's pool near the memory limit
    packed_spans: int
    packed_span_bytes: int
    packed_output_bytes: int
    threads_prepared: int
    chunks_made: int
    chunks_released: int
    chunks_kept_registered: int
    bounce_reserved_bytes: int
    bounce_pageable: int
    file_fetches: int
    file_read_bytes: int
    file_cached_reads: int
    file_buffered_reads: int
    file_read_seconds: float
    pinned: bool
    retired_engines: int
    retired_reserved_bytes: int

class _TraceRow(TypedDict):
    """One copy batch recorded between ``trace_start`` and ``trace_stop``."""

    stream: Literal["d2h", "h2d"]
    bytes: int
    start_ms: float
    end_ms: float

class Ticket:
    """A copy's completion. Made by ``fetch``, ``fetch_file`` and ``copy_into`` only (no constructor)."""

    def wait(self) -> None:
        """Make the consumer's current stream (the calling thread, for the CPU) wait for the copies."""

    def query(self) -> bool:
        """True once the fetch's copies have completed."""

    def issued(self) -> bool:
        """False while a ``fetch_file``'s copies still wait for their reads (``wait()`` blocks the host then)."""

def store(values: Sequence[torch.Tensor], device: torch.device, allow_spill: bool = True) -> list[torch.Tensor]:
    """Snapshot tensors and copy them to `device` (CPU: the pinned arena). Returns the copies in order."""

def fetch(stored: Sequence[torch.Tensor], device: torch.device, wait: bool = True) -> tuple[list[torch.Tensor], Ticket]:
    """Copy stored tensors to `device`. Returns (tensors, ticket)."""

def fetch_file(
    path: str, offsets: Sequence[int], likes: Sequence[torch.Tensor], device: torch.device, wait: bool = True
) -> tuple[list[torch.Tensor], Ticket]:
    """Read tensors (likes[i]'s dtype and shape) from byte offsets of a file onto `device`: (tensors, ticket)."""

def copy_into(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], wait: bool = False) -> Ticket:
    """Copy srcs[i] into the existing dsts[i] on the copy streams. Returns a ticket."""

def set_timing(on: bool) -> None:
    """Time every copy batch (d2h_seconds / h2d_seconds in stats) with timed events."""

def _fail_next_copy() -> None:
    """Tests: the next host copy call queues its copies, then raises."""

def _fail_next_task() -> None:
    """Tests: the next host copy task fails on its worker thread."""

def _format_check(value: int) -> str:
    """Build check: the string '[value, 0.5]' as the engine formats it."""

def _fail_query_after(skip: int, transient: bool = False) -> bool:
    """Tests: the event query after the next `skip` ones raises, once."""

def synchronize() -> None:
    """Wait for every copy in flight and return freed blocks to the arena."""

def wait_stored(t: torch.Tensor, /) -> None:
    """Block until the store that produced `t` has written it."""

def empty_cache() -> int:
    """synchronize(), then give empty arena chunks back to the OS. Returns the bytes released."""

def trace_start(device: torch.device, /) -> None:
    """Record copy batches from now on, timed from an event on `device`'s current stream."""

def trace_stop() -> list[_TraceRow]:
    """The copy batches recorded since trace_start."""

def stats() -> _Stats: ...
def set_pinned_limit(bytes: int, /) -> None: ...
def take_spill_notice() -> str:
    """The engine's pending spill notice ('' when none), cleared by the call."""

def backend_name() -> Literal["cuda", "host"]: ...
def is_arena_tensor(t: torch.Tensor, /) -> bool: ...
def is_offcache_tensor(t: torch.Tensor, /) -> bool: ...
def is_disk_tensor(t: torch.Tensor, /) -> bool: ...
def allocation_of(t: torch.Tensor, /) -> torch.Tensor: ...
def map_shared(fd: int, offset: int, bytes: int, ranks: int) -> tuple[torch.Tensor, str]:
    """Map and register [offset, offset + bytes) of a shared file: (uint8 tensor, why not registered or '')."""

def is_shared_tensor(t: torch.Tensor, /) -> bool: ...
def is_pinned_shared_tensor(t: torch.Tensor, /) -> bool: ...
def wait_shared_reads(t: torch.Tensor, /) -> None: ...
def shared_word_add(word: torch.Tensor, delta: int) -> int: ...
def _fail_register(after: int, reason: str) -> None: ...
def _set_register_chunk(chunk: int) -> None: ...
def configure(
    backend: str,
    pinned_limit: int,
    min_chunk: int,
    max_in_flight: int,
    host_copy_delay_us: int,
    disk_dir: str = "",
    host_limit: int = ...,
) -> None:
    """Replace the process-wide engine (earlier stored tensors keep working)."""

cuda_compiled: bool
torch_version: str
cuda_version: str | None

class HostLimitError(MemoryError):
    """A store would take host memory (pinned + pageable) past the host limit, and there is no disk tier."""
