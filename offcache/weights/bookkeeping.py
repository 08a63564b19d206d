"""The state offcache's weight caches and their prefetcher share: one :class:`WeightState`.

``WEIGHTS`` is the process's one instance; every cache holds it as ``cache.state`` and the
prefetcher takes it from the cache (or as an argument): nothing reads it as a module global.
It owns, with their rules:

- the prefetch table (``prefetched``: ``Prefetched`` copies keyed by the offloaded tensor),
  handed out (``take_prefetched``) only while the source is unchanged: not updated, deleted or
  edited in place (version counter), not written by another process since the fetch was issued
  (the cache's ``is_fresh`` with the ``tag`` it gave then: the node region's generation, a file's
  identity), and, for a host copy, still holding the source's bytes (``same_bytes``, compared as
  the engine's dedup table compares CPU sources);
- the write-backs in flight (``pending``) and the host waits that land them (``flush``,
  ``flush_all``); the disk reads in flight (``reads``: a file is not rewritten under one);
- what each outermost ``disable_offloading()`` context moved (``Subgraph``, ``subgraph_stats()``)
  and the process-wide weight counters (``counters``: the ``weight_*`` keys of
  ``offcache.stats()``, which the engine merges in: ``engine.add_counters``).

The interface it calls on a cache is offcache/weights/interface.py's. It imports nothing of
compressed-tensors.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from offcache import engine as _engine
from offcache.weights.interface import WeightCache

Tensor = torch.Tensor


def prefetch_depth() -> int:
    """Subgraphs whose weights are fetched ahead: OFFCACHE_WEIGHT_PREFETCH (0, 1 or k; default 1)."""
    raw = os.environ.get("OFFCACHE_WEIGHT_PREFETCH", "").strip() or "1"
    try:
        k = int(raw)
    except ValueError:
        k = -1
    if k < 0:
        raise ValueError(f"OFFCACHE_WEIGHT_PREFETCH must be an integer >= 0, got {raw!r}")
    return k


def onload_device(cache) -> torch.device:
    """`cache`'s onload device, a bare "cuda" made the current device."""
    device = torch.device(cache.onload_device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _zeroed_counters() -> dict[str, int | float]:
    return {
        "weight_onload_bytes": 0,  # onloads of offloaded weights, served by a fetch or a prefetch
        "weight_prefetch_bytes": 0,  # fetched ahead of use
        "weight_writeback_bytes": 0,  # update_offload copies into the arena
        "weight_prefetch_hits": 0,  # onloads served by a prefetched copy
        "weight_prefetch_misses": 0,  # onloads that fetched (with prefetch on)
        "weight_prefetch_skips": 0,  # prefetches not issued: no device memory, or the fetch failed
        "weight_prefetch_stale": 0,  # prefetched copies not served: another rank wrote the weight since
        "weight_host_waits": 0,  # times the host blocked on a weight copy
        "weight_stream_waits": 0,  # onloads to a GPU whose copy was still in flight: its stream waited
        "weight_host_wait_seconds": 0.0,
        "weight_page_cache_bytes": 0,  # checkpoint bytes read through the page cache first (node/warm.py)
        "weight_sliced_prefetches": 0,  # sliced prefetches gathered (node/sliced.py)
        "weight_sliced_fetch_bytes": 0,  # of them, the bytes this rank fetched from the node region (its slices)
    }


@dataclass
class Prefetched:
    offloaded: Tensor  # held so that id(offloaded) stays the key's tensor
    cache: WeightCache  # the cache that fetched it: finish() makes the onloaded value, after the wait
    onloaded: Any  # the engine's copy, not waited for
    ticket: Any
    device: torch.device
    version: int  # offloaded._version when fetched: an in-place edit since makes it stale
    target: int  # the subgraph it was fetched for; it dies with that subgraph's context
    nbytes: int
    tag: Any = None  # cache.tag(offloaded) before the fetch was issued; cache.is_fresh judges it


@dataclass
class Subgraph:
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


class WeightState:
    """The prefetch table, the write-backs and disk reads in flight, the subgraph records and the counters."""

    def __init__(self) -> None:
        self.prefetched: dict[int, Prefetched] = {}
        self.pending: dict[int, tuple[Tensor, Any]] = {}  # write-backs in flight
        self.reads: dict[str, Any] = {}  # real file path -> the ticket of the last fetch that read it
        self.current: Subgraph | None = None  # the open outermost disable_offloading() context
        self.history: list[Subgraph] = []
        self.patched = False  # compressed-tensors' classes are offcache's (weights.compressed_tensors.patch)
        self.counters = _zeroed_counters()  # process-wide, never reset

    def subgraph_stats(self) -> list[dict]:
        return [vars(s).copy() for s in self.history]

    # -- waits --
    def host_wait(self, block) -> None:
        """Run `block`, which blocks the host until copies landed, counted as a host wait with its seconds."""
        t0 = time.perf_counter()
        block()
        self.counters["weight_host_waits"] += 1
        self.counters["weight_host_wait_seconds"] += time.perf_counter() - t0
        if self.current is not None:
            self.current.host_waits += 1

    def wait(self, ticket, device: torch.device) -> None:
        """Make the consumer wait for a fetch; only a CPU consumer (host backend) blocks the host.

        A GPU consumer's stream waits on the copy's event instead; one still in flight when handed
        out is counted (weight_stream_waits): the GPU may idle there.
        """
        if ticket.query():
            ticket.wait()
        elif device.type == "cpu" or not ticket.issued():  # the host blocks (on a GPU: for a disk read)
            self.host_wait(ticket.wait)
        else:
            ticket.wait()
            self.counters["weight_stream_waits"] += 1

    # -- write-backs --
    def flush(self, offloaded: Tensor) -> None:
        """Block until the write-back into `offloaded` (if any) has landed, for a host read."""
        entry = self.pending.pop(id(offloaded), None)
        if entry is None or entry[0] is not offloaded:
            return
        if not entry[1].query():
            self.host_wait(lambda: _engine.wait_stored(offloaded))

    def flush_all(self) -> None:
        for offloaded, _ in list(self.pending.values()):
            self.flush(offloaded)

    # -- the prefetch table --
    def drop_prefetched(self, offloaded: Tensor) -> None:
        entry = self.prefetched.pop(id(offloaded), None)
        if entry is not None and entry.offloaded is not offloaded:  # an id reused: not ours to drop
            self.prefetched[id(offloaded)] = entry

    def take_prefetched(self, offloaded: Tensor, device: torch.device) -> Tensor | None:
        entry = self.prefetched.pop(id(offloaded), None)
        if entry is None:
            return None
        if entry.offloaded is not offloaded or entry.device != device or entry.version != offloaded._version:
            return None  # stale (edited in place since) or for another device: fetch afresh
        if entry.tag is not None and not entry.ticket.query():
            # Another process may write the source: its generation says whether the copy read one value
            # only once the copy has landed, so a GPU consumer waits on the host here, not only on its stream.
            self.host_wait(lambda: _engine.wait_on_host(entry.ticket))
        self.wait(entry.ticket, device)
        if not entry.cache.is_fresh(offloaded, entry.tag):
            self.counters["weight_prefetch_stale"] += 1
            return None  # another process wrote the source since the fetch was issued
        if not same_bytes(offloaded, entry.onloaded):
            return None  # edited through .data, an alias or numpy: no version counter saw it
        return entry.cache.finish(entry.onloaded, offloaded)  # after the wait: finish may read it

    # -- the onload every cache shares --
    def onload(self, cache: WeightCache, offloaded: Tensor | None) -> Tensor | None:
        """`offloaded` onloaded by `cache` to its onload device: the prefetched copy, else a fetch now."""
        if offloaded is None:
            return None
        device = onload_device(cache)
        nbytes = offloaded.nbytes
        self.counters["weight_onload_bytes"] += nbytes
        current = self.current
        onloaded = self.take_prefetched(offloaded, device)
        if onloaded is not None:
            self.counters["weight_prefetch_hits"] += 1
            if current is not None:
                current.hits += 1
                current.onloaded_bytes += nbytes
                current.prefetched_bytes += nbytes
            return onloaded
        if self.patched and prefetch_depth() > 0:
            self.counters["weight_prefetch_misses"] += 1
        if current is not None:
            current.misses += 1
            current.onloaded_bytes += nbytes
        ((fetched, ticket),) = cache.fetch([offloaded], device)
        self.wait(ticket, device)
        return cache.finish(fetched, offloaded)


def same_bytes(source: Tensor, copy: Tensor) -> bool:
    """Whether a prefetched `copy` (landed) still holds `source`'s bytes, as the engine's dedup
    table judges a CPU source: byte for byte, which sees writes that bump no version counter.

    Only where both are host memory (the host backend, a CPU onload device); a device copy
    cannot be read here: the offloaded tensor handed out under ``disable_onloading()`` drops
    its prefetched copy instead (``EngineCache.__getitem__``).
    """
    if source.device.type != "cpu" or copy.device.type != "cpu":
        return True
    if source.dtype != copy.dtype or source.shape != copy.shape:
        return False
    # As bytes: NaN and -0.0 compare as written.
    a, b = (t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8) for t in (source, copy))
    return torch.equal(a, b)


WEIGHTS = WeightState()  # the process's one: every cache's ``state``
_engine.add_counters(WEIGHTS.counters)  # offcache.stats()' weight_* keys
