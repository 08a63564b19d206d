"""Checkpoint bytes read through the page cache before the engine reads them (offcache.weights.node.disk).

The engine's ``fetch_file`` reads a piece from the page cache where all of it is there, else with
O_DIRECT: under torchrun every rank of a node would read the disk itself. Here a fetch first
reads its byte ranges (as the engine will cut them: spans merged across gaps under 1 MiB,
aligned to 4 KiB) with buffered reads, on this process's warm-up thread; ranks reading the same
pages at the same time wait on the kernel's one read of them, and the engine then finds them in
the page cache. The engine's read is issued once the warm-up is done: by the next call of the
cache class (``issue_ready``), or by whoever needs the copy (its ticket's ``query``/``wait``).

A warm-up that fails (a file gone or rewritten) is ignored: the engine's read says why, if it
still fails. It imports nothing of compressed-tensors.
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

_ALIGN = 4096  # the engine's kDiskAlign
_GAP = 1 << 20  # the engine's kFileGap: closer ranges are read as one span
_SCRATCH = 8 << 20

_pool: ThreadPoolExecutor | None = None
_pool_pid = -1
_pending: list[weakref.ref] = []  # deferred fetches not issued yet (oldest first)
_local = threading.local()


def page_cache_on() -> bool:
    """OFFCACHE_NODE_PAGE_CACHE (default 1): read checkpoint bytes through the page cache first."""
    raw = os.environ.get("OFFCACHE_NODE_PAGE_CACHE", "").strip() or "1"
    if raw not in ("0", "1"):
        raise ValueError(f"OFFCACHE_NODE_PAGE_CACHE must be 0 or 1, got {raw!r}")
    return raw == "1"


def spans(ranges: list[tuple[str, int, int] | None]) -> dict[str, list[tuple[int, int]]]:
    """(file, offset, bytes) ranges as the engine reads them: per file, [begin, end) spans merged
    across gaps under 1 MiB, aligned to 4 KiB."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for r in ranges:
        if r is not None and r[2] > 0:
            by_file.setdefault(r[0], []).append((r[1], r[1] + r[2]))
    out: dict[str, list[tuple[int, int]]] = {}
    for path, rs in by_file.items():
        rs.sort()
        merged: list[list[int]] = []
        for begin, end in rs:
            if merged and begin <= merged[-1][1] + _GAP:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([begin, end])
        out[path] = [(b // _ALIGN * _ALIGN, -(-e // _ALIGN) * _ALIGN) for b, e in merged]
    return out


def warm(ranges: list[tuple[str, int, int] | None], counters: dict | None = None) -> int:
    """Read `ranges` through the page cache (buffered); returns the bytes read, counted in `counters`
    (a WeightState's). Errors end it quietly."""
    scratch = getattr(_local, "scratch", None)
    if scratch is None:
        scratch = _local.scratch = memoryview(bytearray(_SCRATCH))
    done = 0
    for path, parts in spans(ranges).items():
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            for begin, end in parts:
                os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_WILLNEED)  # one large readahead
            for begin, end in parts:
                at = begin
                while at < end:
                    n = os.preadv(fd, [scratch[: min(_SCRATCH, end - at)]], at)
                    if n <= 0:
                        break  # the end of the file
                    at += n
                    done += n
        except OSError:
            pass
        finally:
            os.close(fd)
    if counters is not None:
        counters["weight_page_cache_bytes"] += done
    return done


def _submit(ranges, counters) -> Future:
    global _pool, _pool_pid
    if _pool is None or _pool_pid != os.getpid():
        _pool = ThreadPoolExecutor(1, thread_name_prefix="offcache-page-cache")
        _pool_pid = os.getpid()
    return _pool.submit(warm, ranges, counters)


class Deferred:
    """One fetch of a cache's tensors whose engine read waits for their page-cache warm-up.

    ``fetch(offloaded, device)`` is the cache's own read (``OffcacheDiskCache.fetch``), issued once;
    `counters` (its WeightState's) count the bytes warmed.
    """

    class Handle:
        """Stands for fetched tensor `i` until the read is issued (the cache's ``finish`` takes it)."""

        def __init__(self, deferred: Deferred, i: int):
            self.deferred, self.i = deferred, i

        def tensor(self) -> torch.Tensor:
            return self.deferred.issue()[self.i][0]

    class Ticket:
        """Tensor `i`'s ticket: complete once warmed, issued, and the engine's copy landed."""

        def __init__(self, deferred: Deferred, i: int):
            self.deferred, self.i = deferred, i

        def _real(self):
            return self.deferred.issue()[self.i][1]

        def query(self) -> bool:
            if self.deferred.results is None and self.deferred.error is None and not self.deferred.future.done():
                return False
            return self._real().query()

        def issued(self) -> bool:
            return self.deferred.results is not None and self.deferred.results[self.i][1].issued()

        def wait(self) -> None:
            self._real().wait()

    def __init__(self, fetch, offloaded: list[torch.Tensor], device: torch.device, ranges, counters: dict,
                 inline: bool):  # fmt: skip
        self.fetch, self.offloaded, self.device = fetch, offloaded, device
        self.results: list[tuple[torch.Tensor, Any]] | None = None
        self.error: Exception | None = None
        if inline:  # the caller needs it now: warm on its thread
            self.future: Future = Future()
            self.future.set_result(warm(ranges, counters))
        else:
            self.future = _submit(ranges, counters)

    def issue(self) -> list[tuple[torch.Tensor, Any]]:
        """The engine's read, issued (once) after the warm-up; its error, if it failed, every time."""
        if self.error is not None:
            raise self.error
        if self.results is None:
            try:
                self.future.result()
            except Exception:  # noqa: BLE001  (the engine's read says why, if it fails too)
                pass
            try:
                self.results = self.fetch(self.offloaded, self.device)
            except Exception as exc:
                self.error = exc
                raise
        return self.results

    def pairs(self) -> list[tuple[Any, Any]]:
        if self.future.done():
            return self.issue()
        _pending.append(weakref.ref(self))
        return [(Deferred.Handle(self, i), Deferred.Ticket(self, i)) for i in range(len(self.offloaded))]


def issue_ready() -> None:
    """Issue the engine's reads of the deferred fetches whose warm-up is done (oldest first; the
    ones nobody holds any more are forgotten)."""
    while _pending:
        deferred = _pending[0]()
        if deferred is not None and deferred.results is None and deferred.error is None:
            if not deferred.future.done():
                return
            try:
                deferred.issue()
            except Exception:  # noqa: BLE001  (raised to whoever takes that copy, not to this caller)
                pass
        _pending.pop(0)
