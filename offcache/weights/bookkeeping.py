"""The bookkeeping offcache's compressed-tensors caches and their prefetcher share.

``offcache.weights.compressed_tensors`` holds the cache classes, the prefetcher and the patch; this is
the state they share and its rules:

- prefetched copies (``_Prefetched``), keyed by the offloaded tensor, handed out
  (``_take_prefetched``) only while the source is unchanged: not updated, deleted or edited in
  place (version counter), not written by another process since the fetch was issued (the
  cache's ``_fresh`` with the ``_tag`` it gave then: the node region's generation), and, for
  a host copy, still holding the source's bytes (``_same_bytes``, compared as the engine's
  dedup table compares CPU sources);
- the write-backs in flight (``_State.pending``) and the host waits that land them
  (``_flush``, ``_flush_all``);
- what each outermost ``disable_offloading()`` context moved (``_Subgraph``,
  ``subgraph_stats()``) and the process-wide weight counters (``_engine.WEIGHT_COUNTERS``).

It imports nothing of compressed-tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from offcache import engine as _engine

Tensor = torch.Tensor
COUNTERS = _engine.WEIGHT_COUNTERS


@dataclass
class _Prefetched:
    offloaded: Tensor  # held so that id(offloaded) stays the key's tensor
    cache: Any  # the cache that fetched it: _finish() makes the onloaded value, after the wait
    onloaded: Tensor  # the engine's copy, not waited for
    ticket: Any
    device: torch.device
    version: int  # offloaded._version when fetched: an in-place edit since makes it stale
    target: int  # the subgraph it was fetched for; it dies with that subgraph's context
    nbytes: int
    tag: Any = None  # cache._tag(offloaded) before the fetch was issued; cache._fresh judges it


@dataclass
class _Subgraph:
    """What one outermost disable_offloading() context moved (``subgraph_stats()``)."""

    index: int | None = None  # the pipeline subgraph that ran in it, if one did
    onloaded_bytes: int = 0
    prefetched_bytes: int = 0  # of onloaded_bytes, served by a prefetch
    hits: int = 0
    misses: int = 0
    host_waits: int = 0
    written_back_bytes: int = 0

    def line(self) -> str:
        hidden = self.prefetched_bytes / self.onloaded_bytes if self.onloaded_bytes else 1.0
        return (
            f"offcache weights, subgraph {self.index}: {self.onloaded_bytes / 2**20:.2f} MiB onloaded, "
            f"{hidden:.0%} prefetched ({self.hits} hits, {self.misses} misses), "
            f"{self.host_waits} host waits, {self.written_back_bytes / 2**20:.2f} MiB written back"
        )


@dataclass
class _State:
    prefetched: dict[int, _Prefetched] = field(default_factory=dict)
    pending: dict[int, tuple[Tensor, Any]] = field(default_factory=dict)  # write-backs in flight
    current: _Subgraph | None = None  # the open outermost disable_offloading() context
    history: list[_Subgraph] = field(default_factory=list)
    patched: bool = False  # compressed-tensors' classes are offcache's (weights.compressed_tensors.patch)


_state = _State()


def subgraph_stats() -> list[dict]:
    """Per outermost ``disable_offloading()`` context since ``patch()``: bytes, hits, misses, waits."""
    return [vars(s).copy() for s in _state.history]


def _host_wait(block) -> None:
    """Run `block`, which blocks the host until copies landed, counted as a host wait with its seconds."""
    t0 = time.perf_counter()
    block()
    COUNTERS["weight_host_waits"] += 1
    COUNTERS["weight_host_wait_seconds"] += time.perf_counter() - t0
    if _state.current is not None:
        _state.current.host_waits += 1


def _wait(ticket, device: torch.device) -> None:
    """Make the consumer wait for a fetch; only a CPU consumer (host backend) blocks the host.

    A GPU consumer's stream waits on the copy's event instead; one still in flight when handed
    out is counted (weight_stream_waits): the GPU may idle there.
    """
    if ticket.query():
        ticket.wait()
    elif device.type == "cpu" or not ticket.issued():  # the host blocks (on a GPU: for a disk read)
        _host_wait(ticket.wait)
    else:
        ticket.wait()
        COUNTERS["weight_stream_waits"] += 1


def _flush(offloaded: Tensor) -> None:
    """Block until the write-back into `offloaded` (if any) has landed, for a host read."""
    entry = _state.pending.pop(id(offloaded), None)
    if entry is None or entry[0] is not offloaded:
        return
    if not entry[1].query():
        _host_wait(lambda: _engine.wait_stored(offloaded))


def _flush_all() -> None:
    for offloaded, _ in list(_state.pending.values()):
        _flush(offloaded)


def _drop_prefetched(offloaded: Tensor) -> None:
    entry = _state.prefetched.pop(id(offloaded), None)
    if entry is not None and entry.offloaded is not offloaded:  # an id reused: not ours to drop
        _state.prefetched[id(offloaded)] = entry


def _take_prefetched(offloaded: Tensor, device: torch.device) -> Tensor | None:
    entry = _state.prefetched.pop(id(offloaded), None)
    if entry is None:
        return None
    if entry.offloaded is not offloaded or entry.device != device or entry.version != offloaded._version:
        return None  # stale (edited in place since) or for another device: fetch afresh
    if entry.tag is not None and not entry.ticket.query():
        # Another process may write the source: its generation says whether the copy read one value only
        # once the copy has landed, so a GPU consumer waits on the host here, not only on its stream.
        _host_wait(lambda: _engine.wait_on_host(entry.ticket))
    _wait(entry.ticket, device)
    if not entry.cache._fresh(offloaded, entry.tag):
        COUNTERS["weight_prefetch_stale"] += 1
        return None  # another process wrote the source since the fetch was issued
    if not _same_bytes(offloaded, entry.onloaded):
        return None  # edited through .data, an alias or numpy: no version counter saw it
    return entry.cache._finish(entry.onloaded, offloaded)  # after the wait: _finish may read it


def _same_bytes(source: Tensor, copy: Tensor) -> bool:
    """Whether a prefetched `copy` (landed) still holds `source`'s bytes, as the engine's dedup
    table judges a CPU source: byte for byte, which sees writes that bump no version counter.

    Only where both are host memory (the host backend, a CPU onload device); a device copy
    cannot be read here: the offloaded tensor handed out under ``disable_onloading()`` drops
    its prefetched copy instead (``__getitem__``).
    """
    if source.device.type != "cpu" or copy.device.type != "cpu":
        return True
    if source.dtype != copy.dtype or source.shape != copy.shape:
        return False
    # As bytes: NaN and -0.0 compare as written.
    a, b = (t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8) for t in (source, copy))
    return torch.equal(a, b)
