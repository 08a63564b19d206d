"""Whether a CPU tensor's bytes lie in a mapping of a regular file (a safetensors checkpoint's mmap).

transformers loads a checkpoint's CPU weights as views of the safetensors file mapped into memory:
page cache the kernel may drop and read again under memory pressure (a cgroup's limit), so a
model larger than the limit loads and runs. A copy of such a weight (into the arena, or any
anonymous memory) is memory nothing can reclaim. ``OffcacheCPUCache.offload`` keeps these tensors
as they are (as compressed-tensors' ``CPUCache.offload`` does: no copy) until they are written.

The mappings are read from /proc/self/maps; what was read is kept and read again when a tensor
lies in none of them. A mapping unmapped since (its address reused) may be taken for file-backed:
the tensor is then kept as is, as CPUCache keeps every tensor, which is never wrong, only not
moved into the arena.
"""

from __future__ import annotations

import bisect

import torch

# (start, end) of each mapping of a regular file, sorted by start; None until first read.
_ranges: list[tuple[int, int]] | None = None
_starts: list[int] = []
# Mapped paths that are memory, not files the kernel reads back from a disk.
_MEMORY_PATHS = ("/dev/", "/memfd:", "/SYSV", "/proc/")


def _file_ranges(maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """(start, end) of every mapping of a regular file, from `maps`, sorted; [] where it cannot be read."""
    out = []
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or parts[4] == "0":  # no inode: anonymous, heap, stack
            continue
        path = parts[5]
        if not path.startswith("/") or path.startswith(_MEMORY_PATHS) or path.endswith(" (deleted)"):
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        out.append((start, end))
    out.sort()
    return out


def _within(start: int, end: int) -> bool:
    i = bisect.bisect_right(_starts, start) - 1
    # Adjacent mappings of one file (e.g. split by protection) count as one range.
    while 0 <= i < len(_ranges) and _ranges[i][0] <= start:
        if end <= _ranges[i][1]:
            return True
        if i + 1 < len(_ranges) and _ranges[i + 1][0] == _ranges[i][1]:
            start = _ranges[i][1]
            i += 1
            continue
        return False
    return False


def is_file_backed(tensor: torch.Tensor) -> bool:
    """True when `tensor` is a CPU tensor whose storage lies wholly in a mapping of a regular file."""
    global _ranges, _starts
    if tensor.device.type != "cpu" or tensor.is_sparse:
        return False
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    start = storage.data_ptr()
    end = start + storage.nbytes()
    if storage.nbytes() == 0 or start == 0:
        return False
    for fresh in (False, True):
        if fresh or _ranges is None:
            _ranges = _file_ranges()
            _starts = [s for s, _ in _ranges]
        if _within(start, end):
            return True
    return False
