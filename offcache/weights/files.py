"""Where a tensor lies in a safetensors file: its header parsed once per file version (torch only).

``offcache.weights.caches.OffcacheDiskCache`` reads the tensors it locates here with the
engine's ``fetch_file``; this module needs neither compressed-tensors nor llm-compressor.
"""

from __future__ import annotations

import json
import os
import struct
from collections import OrderedDict

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
}  # fmt: skip

HEADERS: OrderedDict[tuple, tuple[dict, int]] = OrderedDict()  # file identity -> header, data offset
MAX_HEADERS = 1024


def header(real: str) -> tuple[dict, int]:
    """A safetensors file's header and the offset of its data, parsed once per file version.

    Keyed by the file's identity (inode, size, mtime): a file DiskCache rewrites, or a symlink
    it replaces by a file, is parsed afresh.
    """
    st = os.stat(real)
    key = (real, st.st_ino, st.st_size, st.st_mtime_ns)
    hit = HEADERS.get(key)
    if hit is not None:
        HEADERS.move_to_end(key)
        return hit
    with open(real, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        parsed = json.loads(f.read(n))
    HEADERS[key] = hit = (parsed, 8 + n)
    while len(HEADERS) > MAX_HEADERS:
        HEADERS.popitem(last=False)
    return hit


def forget(path: str) -> None:
    real = os.path.realpath(path)
    for key in [k for k in HEADERS if k[0] == real]:
        del HEADERS[key]


def locate(real: str, name: str) -> tuple[int, list[int], torch.dtype] | None:
    """Tensor `name` of a safetensors file as (byte offset, shape, dtype); None for a dtype
    offcache does not read itself (DiskCache's reader takes those)."""
    parsed, start = header(real)
    entry = parsed.get(name)
    if entry is None:
        raise KeyError(f"offcache: {real} has no tensor {name!r} (DiskCache.index names it)")
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        return None
    return start + entry["data_offsets"][0], entry["shape"], dtype
