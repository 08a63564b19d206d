"""Worker functions for tests/weights/node/test_weights_node_disk.py (run through weights_node_worker's Group
as 'tests.weights.node.weights_node_disk_worker:fn').

Each module slot holds offcache's NodeDiskCache and compressed-tensors' DistributedDiskCache built
from the same checkpoint file (the source rank writes it and symlinks each tensor into the class's
offload folder, as compressed-tensors' from_accelerate does; the other ranks hold meta tensors).
"""

from __future__ import annotations

import hashlib
import os
import random
import types
from pathlib import Path
from typing import Any

import torch

from tests.weights.node.weights_node_worker import DTYPES, make


def _describe(t):
    """(class, dtype, shape, sha1 of the bytes; 'meta' for a meta tensor)."""
    if t is None:
        return None
    if t.is_meta:
        return (type(t).__name__, str(t.dtype), tuple(t.shape), "meta")
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return (type(t).__name__, str(t.dtype), tuple(t.shape), hashlib.sha1(raw.numpy().tobytes()).hexdigest())


_D: dict[str, Any] = {}


def _source() -> bool:
    from compressed_tensors.distributed import is_source_process

    return is_source_process()


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _checkpoint(folder: str, mod: str, spec) -> Path:
    """The source rank writes `spec`'s tensors to one safetensors file (synced: a later
    POSIX_FADV_DONTNEED drops every page of it); every rank returns its path."""
    from safetensors.torch import save_file

    path = Path(folder) / f"{mod}.safetensors"
    if _source():
        tensors = {name: make(shape, dtype, seed) for name, shape, dtype, seed, _, tie in spec if tie is None}
        save_file(tensors, str(path))
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    _barrier()
    return path


def _meta_mapping(spec, checkpoint: Path, offload_dir: Path) -> dict:
    from compressed_tensors.offload.cache.disk import DiskCache

    out: dict = {}
    for name, shape, dtype, _, param, tie in spec:
        if tie is not None:
            out[name] = out[tie]
            continue
        meta = torch.empty(tuple(shape), dtype=DTYPES[dtype], device="meta")
        if param:
            meta = torch.nn.Parameter(meta, requires_grad=False)
        if _source():
            info = {"safetensors_file": str(checkpoint), "weight_name": name, "dtype": dtype}
            DiskCache.create_checkpoint_symlink(meta, info, str(offload_dir))
        out[name] = meta
    return out


def offload(mod: str, folder: str, spec, classes=("ours", "theirs")) -> None:
    """Both classes' from_mapping of one checkpoint's tensors (meta tensors off the source rank)."""
    from compressed_tensors.offload.cache.dist_disk import DistributedDiskCache

    from offcache.weights.node.disk import NodeDiskCache

    checkpoint = _checkpoint(folder, mod, spec)
    caches = []
    for which in classes:
        cls = NodeDiskCache if which == "ours" else DistributedDiskCache
        offload_dir = Path(folder) / f"{mod}-{which}"
        offload_dir.mkdir(exist_ok=True)
        mapping = _meta_mapping(spec, checkpoint, offload_dir)
        caches.append(cls.from_mapping(mapping, "cpu", offload_dir=str(offload_dir)))
    _D[mod] = caches


def offload_local(mod: str, folder: str, spec) -> None:
    """Ours only, from this rank's own (non-meta off the source: a shape or dtype may disagree)."""
    from offcache.weights.node.disk import NodeDiskCache

    checkpoint = _checkpoint(folder, mod, spec)
    offload_dir = Path(folder) / f"{mod}-ours"
    offload_dir.mkdir(exist_ok=True)
    if _source():
        mapping = _meta_mapping(spec, checkpoint, offload_dir)
    else:
        mapping = {name: make(shape, dtype, seed, param) for name, shape, dtype, seed, param, _ in spec}
    _D[mod] = [NodeDiskCache.from_mapping(mapping, "cpu", offload_dir=str(offload_dir))]


def values(mod: str) -> list[dict]:
    """Each cache's onloads (described: class, dtype, shape, sha1 of the bytes), and its ties."""
    out = []
    for cache in _D[mod]:
        out.append({name: _describe(cache[name]) for name in list(cache.offloaded_values)})
    return out


def update(mod: str, name: str, seed: int, writer: int) -> None:
    """Rank `writer` alone assigns a new value of the offloaded shape and dtype; then a barrier."""
    import torch.distributed as dist

    _barrier()  # no rank still reads the file the writer rewrites (compressed-tensors' contract too)
    for cache in _D[mod]:
        offloaded = cache.offloaded_values[name]
        if dist.get_rank() == writer:
            cache[name] = make(offloaded.shape, str(offloaded.dtype).removeprefix("torch."), seed)
    _barrier()


def delete(mod: str, name: str) -> list[bool]:
    """Every rank deletes `name`; then whether each cache still has it, and whether its file is gone."""
    _barrier()  # no rank still reads the file the source removes
    for cache in _D[mod]:
        del cache[name]
    _barrier()
    return [name in cache.offloaded_values for cache in _D[mod]]


def prefetch_update_onload(mod: str, name: str, seed: int, writer: int) -> dict:
    """Every rank prefetches ours; rank `writer` updates `name`; after a barrier every rank onloads."""
    from offcache import engine
    from offcache.weights import compressed_tensors as oc_ct
    from offcache.weights.bookkeeping import WEIGHTS

    ours = _D[mod][0]
    before = dict(engine.stats())
    holder = types.SimpleNamespace(_parameters=ours, _buffers={})
    issued = oc_ct.prefetch([holder], target=0)
    for entry in list(WEIGHTS.prefetched.values()):
        entry.ticket.wait()  # the old values have landed (the page-cache read, then the engine's)
    _barrier()
    update(mod, name, seed, writer)
    got = {key: _describe(ours[key]) for key in list(ours.offloaded_values)}
    after = engine.stats()
    WEIGHTS.prefetched.clear()
    keys = ("weight_prefetch_hits", "weight_prefetch_stale", "file_fetches", "weight_page_cache_bytes")
    return {"issued": issued, "values": got, **{k: after.get(k, 0) - before.get(k, 0) for k in keys}}


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes")


def storage_reads(mod: str, folder: str, mib: int, page_cache: bool, prefetched: bool) -> dict:
    """Bytes this rank read from storage (/proc/self/io read_bytes) to onload a `mib`-MiB checkpoint
    through ours, the file dropped from the page cache first; every rank onloads at once."""
    from offcache import engine
    from offcache.weights import compressed_tensors as oc_ct
    from offcache.weights.bookkeeping import WEIGHTS

    os.environ["OFFCACHE_NODE_PAGE_CACHE"] = "1" if page_cache else "0"
    spec = [(f"t{i}", (256, 1024), "float32", i, False, None) for i in range(mib)]  # 1 MiB each
    offload(mod, folder, spec, classes=("ours",))
    checkpoint = Path(folder) / f"{mod}.safetensors"
    fd = os.open(checkpoint, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    _barrier()
    ours = _D[mod][0]
    before, stats = read_bytes(), dict(engine.stats())
    if prefetched:
        oc_ct.prefetch([types.SimpleNamespace(_parameters=ours, _buffers={})], target=0)
    got = [ours[name] for name in list(ours.offloaded_values)]
    after = read_bytes()
    WEIGHTS.prefetched.clear()
    _barrier()
    del got
    now = engine.stats()
    return {
        "read_bytes": after - before,
        "file_bytes": checkpoint.stat().st_size,
        "cached_reads": now["file_cached_reads"] - stats["file_cached_reads"],
        "hits": now["weight_prefetch_hits"] - stats["weight_prefetch_hits"],
    }


def random_sequence(folder: str, seed: int, steps: int) -> list:
    """A seeded random sequence of onloads, updates by one rank, deletes, assignments under
    disable_onloading and new names, driving ours and compressed-tensors' class side by side;
    returns each step's onloads of both (every rank draws the same sequence)."""
    from compressed_tensors.offload import disable_onloading

    rng = random.Random(seed)
    spec = [(f"w{i}", (rng.randint(1, 9), rng.randint(1, 9)), rng.choice(["float32", "bfloat16"]), i, i % 2 == 0, None)
            for i in range(4)]  # fmt: skip
    mod = f"seq{seed}"
    offload(mod, folder, spec)
    log = []
    for step in range(steps):
        caches = _D[mod]
        names = sorted(caches[0].offloaded_values)
        op = rng.choice(["onload", "update", "delete", "disabled", "new"] if names else ["new"])
        if op == "update":
            update(mod, rng.choice(names), rng.randint(0, 10**6), rng.randint(0, 1))
        elif op == "delete":
            delete(mod, rng.choice(names))
        elif op == "disabled":
            name = rng.choice(names)
            with disable_onloading():
                got = [_describe(cache[name]) for cache in caches]  # the offloaded (meta) tensors
            log.append((step, op, name, got))
            continue
        elif op == "new":
            name, shape = f"n{step}", (rng.randint(1, 5),)
            value = make(shape, "float32", rng.randint(0, 10**6))
            for cache in caches:
                cache[name] = value.clone()  # every rank the same: a collective offload
        log.append((step, op, values(mod)))
    return log


def offload_unwritable(folder: str) -> None:
    """The source rank's write fails (its offload folder is not writable... a file stands there)."""
    from offcache.weights.node.disk import NodeDiskCache

    blocker = Path(folder) / "blocked"
    if _source():
        blocker.write_text("a file, not a folder")
    _barrier()
    cache = NodeDiskCache(torch.device("cpu"), offload_dir=str(blocker))
    cache["w"] = make((3,), "float32", 0)


def patched_classes() -> dict:
    """cls_from_device('disk') under the patch and after unpatch (a distributed group is up)."""
    from compressed_tensors.offload.cache.base import OffloadCache

    from offcache.weights import compressed_tensors as oc_ct

    oc_ct.patch()
    try:
        patched = OffloadCache.cls_from_device("disk").__name__
    finally:
        oc_ct.unpatch()
    return {"patched": patched, "unpatched": OffloadCache.cls_from_device("disk").__name__}


def update_while_reading(mod: str, rounds: int, writer: int) -> list:
    """Rank `writer` updates 'weight' `rounds` times while the other ranks onload it, no barrier
    between: each read must be one of the values written (never a truncated file's error)."""
    import torch.distributed as dist

    cache = _D[mod][0]
    offloaded = cache.offloaded_values["weight"]
    seen = []
    _barrier()
    for r in range(rounds):
        if dist.get_rank() == writer:
            cache["weight"] = make(offloaded.shape, str(offloaded.dtype).removeprefix("torch."), 100 + r)
        else:
            seen.append(_describe(cache["weight"])[3])
    _barrier()
    return seen


def describe_seeds(shape, dtype: str, seeds) -> list:
    return [_describe(make(shape, dtype, seed))[3] for seed in seeds]


def prefetch_then_file_gone(mod: str, name: str) -> dict:
    """Every rank prefetches ours; the source removes `name`'s file; then every rank onloads each name."""
    from offcache.weights import compressed_tensors as oc_ct
    from offcache.weights.bookkeeping import WEIGHTS

    ours = _D[mod][0]
    oc_ct.prefetch([types.SimpleNamespace(_parameters=ours, _buffers={})], target=0)
    _barrier()
    if _source():
        os.unlink(ours.index[ours.offloaded_values[name]]["safetensors_file"])
    _barrier()
    out = {}
    for key in list(ours.offloaded_values):
        try:
            out[key] = _describe(ours[key])
        except Exception as exc:  # noqa: BLE001
            out[key] = f"{type(exc).__name__}: {exc}"
    WEIGHTS.prefetched.clear()
    return out


def offload_with_page_cache(mod: str, folder: str, spec, value: str | None) -> str:
    """offcache's class offloads with OFFCACHE_NODE_PAGE_CACHE=`value` on this rank (None: unset):
    the error it raises ('' if none), the setting restored after."""
    saved = os.environ.pop("OFFCACHE_NODE_PAGE_CACHE", None)
    if value is not None:
        os.environ["OFFCACHE_NODE_PAGE_CACHE"] = value
    try:
        offload(mod, folder, spec, classes=("ours",))
    except ValueError as exc:
        return f"ValueError: {exc}"
    finally:
        os.environ.pop("OFFCACHE_NODE_PAGE_CACHE", None)
        if saved is not None:
            os.environ["OFFCACHE_NODE_PAGE_CACHE"] = saved
    return ""


def delete_race_lost(folder: str) -> dict:
    """compressed-tensors' test_delete with its race lost (the order a busy machine can give): the source
    rank onloads the tensor and deletes it, and only then (a barrier) the other rank onloads it. Each
    class's error there ('' where it read the tensor)."""
    from compressed_tensors.offload.cache.dist_disk import DistributedDiskCache

    from offcache.weights.node.disk import NodeDiskCache

    out = {}
    for which, cls in (("ours", NodeDiskCache), ("theirs", DistributedDiskCache)):
        offload_dir = Path(folder) / which / "tmp-rank0/test_delete0/offload_dir"  # as the harness names it
        offload_dir.mkdir(parents=True, exist_ok=True)
        cache = cls(torch.device("cpu"), offload_dir=str(offload_dir))
        cache["weight"] = torch.ones(10)
        if _source():
            cache["weight"]
            del cache["weight"]
        _barrier()
        out[which] = ""
        if not _source():
            try:
                cache["weight"]
            except Exception as exc:  # noqa: BLE001
                out[which] = f"{type(exc).__name__}: {exc}"
        _barrier()
    return out
