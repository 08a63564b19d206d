"""Freed host memory the C allocator keeps, given back to the kernel after offcache's host copies.

Onloading to the CPU, offcache's weight caches copy: an offload copies the caller's CPU tensor into
the arena (the caller then frees it), an onload hands out a copy, an update copies its data before
the engine writes it. glibc's malloc raises its mmap threshold to the size of the largest chunk
freed, so past the first free, tensors of a few MiB come from its heap; freed between live
allocations they stay resident (glibc trims only the heap's top). Compressing a 0.5 GiB model so,
on the CPU, left ~0.7 GiB of freed heap resident: in a memory cgroup sized for llm-compressor
alone, an OOM kill while saving. ``note(nbytes)`` counts the bytes of such copies and, every
``TRIM_BYTES`` of them, returns the free pages of every heap to the kernel (``malloc_trim(0)``,
which the allocator reuses as before, faulted in again). Where the C library has no malloc_trim
(not glibc) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

TRIM_BYTES = 16 << 20  # host copies between trims

_lock = threading.Lock()
_since = 0
_trim = None
_loaded = False
COUNTERS = {"host_trims": 0}


def _malloc_trim():
    global _trim, _loaded
    if not _loaded:
        _loaded = True
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _trim = libc.malloc_trim
            _trim.argtypes = [ctypes.c_size_t]
            _trim.restype = ctypes.c_int
        except (OSError, AttributeError):
            _trim = None
    return _trim


def note(nbytes: int) -> None:
    """`nbytes` of host memory were copied for a caller that frees the other copy: trim when due."""
    global _since
    with _lock:
        _since += nbytes
        if _since < TRIM_BYTES:
            return
        _since = 0
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
        COUNTERS["host_trims"] += 1
