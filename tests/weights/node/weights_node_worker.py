"""Worker processes for tests/weights/node/test_weights_node*.py: a real gloo group on localhost.

``Group(n)`` spawns n processes that join one process group; ``group.call(fn, *args)`` runs the
function ``fn`` of this module on every rank (each gets its rank's args from ``per_rank`` when
given) and returns their results, rank by rank; an exception on any rank is raised here with
its traceback. Each worker holds, per module slot, offcache's NodeSharedCPUCache and
compressed-tensors' DistributedCPUCache built from the same tensors.
"""

from __future__ import annotations

import hashlib
import os
import socket
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8, "float16": torch.float16}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main(rank: int, world: int, port: int, conn, env: dict, setup: str | None) -> None:
    os.environ.update(env)
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = os.environ.get("OFFCACHE_TEST_PG", "gloo")  # nccl: the sliced mode's GPU test
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if setup:
        _resolve(setup)()
    conn.send(("ready", os.getpid()))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args = msg
        try:
            conn.send(("ok", _resolve(fn)(*args)))
        except BaseException as exc:  # noqa: BLE001
            conn.send(("err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    dist.destroy_process_group()


def _resolve(fn: str):
    """A function of this module by name, or of another one as 'module:function'."""
    if ":" in fn:
        import importlib

        module, name = fn.split(":")
        return getattr(importlib.import_module(module), name)
    return globals()[fn]


class WorkerError(RuntimeError):
    pass


class Group:
    def __init__(self, world: int = 2, env: list[dict] | None = None, setup: str | None = None, timeout: float = 60):
        ctx = mp.get_context("spawn")
        port = free_port()
        self.timeout = timeout
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            e = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)}
            e.update((env or [{}] * world)[rank])
            p = ctx.Process(target=_main, args=(rank, world, port, child, e, setup), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self.pids = [self._recv(rank)[1] for rank in range(world)]

    def _recv(self, rank: int):
        if not self.conns[rank].poll(self.timeout):
            self.close(force=True)
            raise TimeoutError(f"rank {rank} did not answer in {self.timeout} s")
        return self.conns[rank].recv()

    def call(self, fn: str, *args, per_rank: list[tuple] | None = None) -> list[Any]:
        for rank, conn in enumerate(self.conns):
            conn.send((fn, per_rank[rank] if per_rank is not None else args))
        results = [self._recv(rank) for rank in range(len(self.conns))]
        errors = [(rank, r) for rank, r in enumerate(results) if r[0] == "err"]
        if errors:
            raise WorkerError("\n".join(f"rank {rank}: {r[1]}\n{r[2]}" for rank, r in errors))
        return [r[1] for r in results]

    def close(self, force: bool = False) -> None:
        for conn, p in zip(self.conns, self.procs):
            if not force and p.is_alive():
                try:
                    conn.send(None)
                except OSError:
                    pass
        for p in self.procs:
            p.join(5 if not force else 0.1)
            if p.is_alive():
                p.kill()
                p.join(5)


# --- functions run on the workers ----------------------------------------------------------------

_S: dict[str, Any] = {}


def setup_node() -> None:
    from offcache.weights import node as weights_node

    weights_node.reset()
    assert weights_node.cache_class() is weights_node.NodeSharedCPUCache, weights_node.stats()


def reset() -> None:
    _S.clear()


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def make(shape, dtype: str, seed: int, param: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(tuple(shape), generator=g) * 8).to(DTYPES[dtype])
    return torch.nn.Parameter(t, requires_grad=False) if param else t


def _mapping(spec, meta: bool) -> dict:
    out: dict = {}
    for name, shape, dtype, seed, param, tie in spec:
        if tie is not None and tie in out:
            out[name] = out[tie]
        elif meta:
            t = torch.empty(tuple(shape), dtype=DTYPES[dtype], device="meta")
            out[name] = torch.nn.Parameter(t, requires_grad=False) if param else t
        else:
            out[name] = make(shape, dtype, seed, param)
    return out


def offload(mod: str, spec, meta_elsewhere: bool) -> None:
    """Both classes' from_mapping of the same tensors; ranks other than the source hold meta ones
    when `meta_elsewhere` (as a model loaded on the source rank only)."""
    from compressed_tensors.distributed import is_source_process
    from compressed_tensors.offload.cache import DistributedCPUCache

    from offcache.weights.node import NodeSharedCPUCache

    meta = meta_elsewhere and not is_source_process()
    ours = NodeSharedCPUCache.from_mapping(_mapping(spec, meta), "cpu")
    theirs = DistributedCPUCache.from_mapping(_mapping(spec, meta), "cpu")
    _S[mod] = (ours, theirs)


def set_all(mod: str, name: str, shape, dtype: str, seed: int, param: bool) -> None:
    """Every rank assigns the same value (collective where it offloads: a new name or shape)."""
    for cache in _S[mod]:
        cache[name] = make(shape, dtype, seed, param)


def update_one(mod: str, name: str, seed: int, writer: int) -> None:
    """Rank `writer` alone assigns a value of the offloaded shape and dtype; then a barrier."""
    import torch.distributed as dist

    for cache in _S[mod]:
        with_none = cache.offloaded_values.get(name)
        if dist.get_rank() == writer and with_none is not None:
            cache[name] = make(with_none.shape, str(with_none.dtype).removeprefix("torch."), seed)
    dist.barrier()


def delete(mod: str, name: str) -> None:
    for cache in _S[mod]:
        del cache[name]


def set_disabled(mod: str, name: str, shape, dtype: str, seed: int) -> None:
    """Under disable_onloading(): a local tensor assigned as it is (every rank the same)."""
    from compressed_tensors.offload import disable_onloading

    with disable_onloading():
        for cache in _S[mod]:
            cache[name] = make(shape, dtype, seed)


def _describe(t):
    if t is None:
        return None
    raw = t.detach().contiguous().view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return (type(t).__name__, str(t.dtype), tuple(t.shape), hashlib.sha1(raw.numpy().tobytes()).hexdigest())


def snapshot(mod: str, onloading: bool, offloading: bool = False) -> list:
    """What each class hands out, name by name, and which names give the same object (tied)."""
    from compressed_tensors.offload import disable_offloading, disable_onloading

    out = []
    for cache in _S[mod]:
        ctx = disable_onloading() if not onloading else (disable_offloading() if offloading else _null())
        with ctx:
            values = {name: cache[name] for name in sorted(cache, key=str)}
            again = {name: cache[name] for name in sorted(cache, key=str)}
        names = list(values)
        pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
        ties = sorted((a, b) for a, b in pairs if values[a] is not None and values[a] is values[b])
        same_again = sorted(n for n in names if values[n] is again[n])
        out.append(({n: _describe(v) for n, v in values.items()}, ties, same_again))
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def dev_shm() -> list[str]:
    return sorted(os.listdir("/dev/shm"))


def node_stats() -> dict:
    from offcache.weights import node as weights_node

    return weights_node.stats()


def debug_ptrs(mod: str) -> list:
    return [{n: (v.data_ptr(), v.untyped_storage().data_ptr()) for n, v in c.offloaded_values.items()} for c in _S[mod]]


def offload_ours(mod: str, spec, meta_elsewhere: bool) -> None:
    """offcache's class only (a spec per rank may differ: the disagreement tests)."""
    from compressed_tensors.distributed import is_source_process

    from offcache.weights.node import NodeSharedCPUCache

    _S[mod] = (NodeSharedCPUCache.from_mapping(_mapping(spec, meta_elsewhere and not is_source_process()), "cpu"),)


def ours_values(mod: str) -> dict:
    cache = _S[mod][0]
    names = sorted(cache, key=str)
    values = {n: cache[n] for n in names}
    offloaded = cache.offloaded_values  # ties: one offloaded tensor (an onload is a copy of it)
    return {
        "values": {n: _describe(v) for n, v in values.items()},
        "ties": sorted((a, b) for a in names for b in names if a < b and offloaded[a] is offloaded[b]),
    }


def count_collectives(cls_name: str, n: int) -> dict:
    """Collective calls (by torch.distributed function) to offload one module of `n` tensors."""
    import torch.distributed as dist
    from compressed_tensors.offload.cache import DistributedCPUCache

    from offcache.weights.node import NodeSharedCPUCache

    cls = {"ours": NodeSharedCPUCache, "theirs": DistributedCPUCache}[cls_name]
    names = ["broadcast_object_list", "all_gather_object", "barrier", "broadcast", "all_gather", "all_reduce"]
    counts = dict.fromkeys(names, 0)
    saved = {name: getattr(dist, name) for name in names}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return saved[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, counting(name))
    try:
        mapping = {f"t{i}": make((8, 8), "float32", i) for i in range(n)}
        cls.from_mapping(mapping, "cpu")
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return {k: v for k, v in counts.items() if v}


def fallback(drop: str) -> dict:
    """cache_class() decided anew with, on this rank, os.memfd_create missing (`drop` "memfd") or the
    /proc hand-over refused ("proc"; rank 0 creates the region, so only the other ranks open it)."""
    import warnings

    from offcache.weights import node as weights_node

    saved, saved_open = os.memfd_create, weights_node.NodeRegion.open

    def refused(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted", "/proc/<pid>/fd/<n>")

    weights_node.reset()
    if drop == "memfd":
        del os.memfd_create
    elif drop == "proc":
        weights_node.NodeRegion.open = classmethod(lambda cls, *a: refused())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cls = weights_node.cache_class()
            assert weights_node.cache_class() is cls  # decided once: no second warning either
    finally:
        os.memfd_create = saved
        weights_node.NodeRegion.open = saved_open
    weights_node.reset()
    setup_node()
    return {"class": cls.__name__, "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


def region_fds() -> list[str]:
    """This process's open memfd files (their /proc/self/fd link targets)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:"):
            out.append(target)
    return sorted(set(out))


def region_inode() -> int:
    from offcache.weights import node as weights_node

    return os.fstat(weights_node.GROUP.node.region.fd).st_ino


def set_limit(limit: int) -> int:
    from offcache.weights import node as weights_node

    region = weights_node.GROUP.node.region
    old, region.limit = region.limit, limit
    return old


def patched_classes() -> dict:
    """cls_from_device('cpu') patched and unpatched, and a module offloaded while patched."""
    from compressed_tensors.offload import offload_module
    from compressed_tensors.offload.cache import OffloadCache

    import offcache

    offcache.patch_llmcompressor(weights=True)
    try:
        patched = OffloadCache.cls_from_device("cpu").__name__
        linear = torch.nn.Linear(4, 3)
        offload_module(linear, "cpu", "cpu")
        module_cache = type(linear._parameters).__name__
        out = linear(torch.ones(2, 4))
    finally:
        offcache.unpatch_llmcompressor()
    return {
        "patched": patched,
        "module": module_cache,
        "forward": tuple(out.shape),
        "unpatched": OffloadCache.cls_from_device("cpu").__name__,
    }


def upstream_scenarios(cls_name: str) -> list[str]:
    """compressed-tensors' own distributed CPU cache checks (its tests/test_offload/cache/test_dist_cpu.py,
    with the CPU as the onload device), run on `cls_name`; returns the ones that fail."""
    import gc
    from weakref import ref

    import torch.distributed as dist
    from compressed_tensors.offload import disable_offloading, disable_onloading
    from compressed_tensors.offload.cache import DistributedCPUCache

    from offcache.weights.node import NodeSharedCPUCache

    cls = {"ours": NodeSharedCPUCache, "theirs": DistributedCPUCache}[cls_name]
    rank = dist.get_rank()
    failed = []

    def check(name, ok):
        if not ok:
            failed.append(name)

    # each rank updates its own tensor; after a barrier every rank sees both updates
    cache = cls("cpu")
    cache["t0"], cache["t1"] = torch.zeros(10), torch.zeros(10)
    cache[f"t{rank}"] = torch.full((10,), float(rank + 1))
    dist.barrier()
    check("async update", torch.equal(cache["t0"], torch.ones(10)) and torch.equal(cache["t1"], torch.full((10,), 2.0)))
    with disable_onloading():
        check("async update, offloaded", torch.equal(cache["t1"], torch.full((10,), 2.0)))

    # an edit of the offloaded tensor itself (under disable_onloading) by rank 0 reaches rank 1
    cache = cls("cpu")
    cache["t"] = torch.zeros(5, 2)
    if rank == 0:
        with disable_onloading():
            cache["t"].copy_(torch.ones(5, 2))
    dist.barrier()
    check("edit of the offloaded tensor", torch.equal(cache["t"], torch.ones(5, 2)))
    dist.barrier()  # every rank has read before any writes again

    # replacement by a value of the same shape, then of another shape
    cache["t"] = torch.full((5, 2), 3.0)
    check("replace, same shape", torch.equal(cache["t"], torch.full((5, 2), 3.0)))
    cache["t"] = torch.full((7,), 4.0)
    check("replace, new shape", torch.equal(cache["t"], torch.full((7,), 4.0)))

    # tensor subclasses keep their class, onloaded and offloaded
    cache = cls("cpu")
    values = {
        "tensor": torch.ones(10),
        "param": torch.nn.Parameter(torch.ones(10), requires_grad=False),
        "buffer": torch.nn.Buffer(torch.ones(10)),
    }
    for name, value in values.items():
        cache[name] = value
    for name, value in values.items():
        check(f"subclass {name}", type(cache[name]) is type(value) and torch.equal(cache[name], value))
        with disable_onloading():
            check(f"subclass {name}, offloaded", type(cache[name]) is type(value))

    # disable_offloading keeps the onloaded value until the context ends; deletes drop it
    cache = cls("cpu")
    cache["w"] = torch.ones(10)
    with disable_offloading():
        inside = ref(cache["w"])
        check("disable_offloading keeps", inside() is not None and cache["w"] is inside())
        del cache["w"]
        gc.collect()
        check("delete", "w" not in cache)
    check("shared attributes", cache.keep_onloaded_values is cls.keep_onloaded_values)
    return failed


def tie_across_modules() -> dict:
    """A weight tied between two modules (embeddings and lm_head), offloaded one module at a time;
    the other rank holds meta tensors. Then rank 1 updates it through the second module."""
    import torch.distributed as dist
    from compressed_tensors.distributed import is_source_process

    from offcache.weights import node as weights_node
    from offcache.weights.node import NodeSharedCPUCache

    if is_source_process():
        weight = make((64, 64), "float32", 3, param=True)
    else:
        weight = torch.nn.Parameter(torch.empty(64, 64, device="meta"), requires_grad=False)
    embed = NodeSharedCPUCache.from_mapping({"weight": weight}, "cpu")
    used = weights_node.stats()["used_bytes"]
    head = NodeSharedCPUCache.from_mapping({"weight": embed.offloaded_values["weight"]}, "cpu")
    grew = weights_node.stats()["used_bytes"] - used
    if dist.get_rank() == 1:
        head["weight"] = make((64, 64), "float32", 4)
    dist.barrier()
    return {
        "same_object": head.offloaded_values["weight"] is embed.offloaded_values["weight"],
        "grew": grew,
        "embed": _describe(embed["weight"]),
        "head": _describe(head["weight"]),
    }


def inside_batch_offload_sync() -> dict:
    """compressed-tensors 0.20's dispatch offloads a whole model inside batch_offload_sync: offcache's
    class does its own exchange per module there (and the batch completes with nothing of ours)."""
    from compressed_tensors.distributed import is_source_process
    from compressed_tensors.offload.cache.dist_batch import batch_offload_sync

    from offcache.weights.node import NodeSharedCPUCache

    caches = []
    with batch_offload_sync() as batch:
        for i in range(2):
            batch.module_name = f"m{i}"
            spec = [("weight", (4, 5), "float32", i, True, None), ("bias", (5,), "float32", 10 + i, False, None)]
            caches.append(NodeSharedCPUCache.from_mapping(_mapping(spec, not is_source_process()), "cpu"))
    return {f"m{i}": {n: _describe(c[n]) for n in sorted(c)} for i, c in enumerate(caches)}


def edge_cases() -> list[str]:
    """Tensors an offload meets besides plain ones: grad-requiring parameters, empty tensors, bool and
    float8 dtypes, a non-contiguous view; the other rank holds meta tensors. Returns what differs."""
    from compressed_tensors.distributed import is_source_process

    from offcache.weights.node import NodeSharedCPUCache

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    values = {
        "grad": torch.nn.Parameter(torch.ones(3, 3)),
        "empty": torch.empty(0, 4),
        "bool": torch.tensor([True, False, True]),
        "fp8": torch.linspace(-2, 2, 8).to(torch.float8_e4m3fn),
        "strided": base.t(),
    }
    mapping = values if is_source_process() else {n: v.to("meta") for n, v in values.items()}
    if not is_source_process():
        mapping["grad"] = torch.nn.Parameter(torch.empty(3, 3, device="meta"))
    cache = NodeSharedCPUCache.from_mapping(mapping, "cpu")
    bad = []
    for name, want in values.items():
        got = cache[name]
        same = type(got) is type(want) and got.dtype == want.dtype and got.shape == want.shape
        if not same or not torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)):
            bad.append(name)
        if got.requires_grad != want.requires_grad:
            bad.append(f"{name}: requires_grad")
    return bad


def recouple(mod: str, source: int) -> None:
    """compressed-tensors' replace_module_parallel, step 4: rank `source` processed the module, the
    others hold meta tensors; each offloaded value is offloaded again with `source` as the source."""
    import torch.distributed as dist
    from compressed_tensors.distributed import set_source_process
    from compressed_tensors.offload import disable_onloading
    from compressed_tensors.offload.utils import send_tensors

    for cache in _S[mod]:
        with disable_onloading():
            if dist.get_rank() != source:
                cache.offloaded_values = {n: send_tensors(v, device="meta") for n, v in cache.offloaded_values.items()}
            with set_source_process(source):
                cache.offloaded_values = {n: cache.offload(v) for n, v in cache.offloaded_values.items()}
