"""Worker functions for tests/weights/node/test_weights_node_engine.py and test_gpu_weights_node.py: the node
region's registration with the engine, engine onloads, prefetch and cross-process invalidation.

Run on the ranks of tests/weights/node/weights_node_worker.py's ``Group`` as
``group.call("tests.weights.node.weights_node_engine_worker:<function>", ...)``.
"""

from __future__ import annotations

import gc
import os
import warnings
from typing import Any

import torch

from tests.weights.node.weights_node_worker import _describe, make

W = "tests.weights.node.weights_node_engine_worker:"
_S: dict[str, Any] = {}


def _counters() -> dict:
    from offcache import engine

    return dict(engine.stats())


def delta(before: dict) -> dict:
    now = _counters()
    return {k: now[k] - before[k] for k in now if isinstance(now[k], (int, float)) and now[k] != before.get(k)}


def mark() -> None:
    _S["before"] = _counters()


def since() -> dict:
    return delta(_S["before"])


def engine_stats() -> dict:
    return {k: v for k, v in _counters().items() if isinstance(v, (int, float, bool))}


def offload_pair(mod: str, shapes: list, device: str = "cpu", seed: int = 0) -> dict:
    """The same tensors offloaded by offcache's class and compressed-tensors' (a module's batch each)."""
    from compressed_tensors.offload.cache import DistributedCPUCache

    from offcache import engine
    from offcache.weights.node import NodeSharedCPUCache

    def mapping():
        return {f"t{i}": make(shape, dtype, seed + i, param=i == 0) for i, (shape, dtype) in enumerate(shapes)}

    ours = NodeSharedCPUCache.from_mapping(mapping(), device)
    theirs = DistributedCPUCache.from_mapping(mapping(), device)
    _S[mod] = (ours, theirs)
    return {
        "shared": [engine.is_shared_tensor(t) for t in ours.offloaded_values.values()],
        "pinned": [engine.is_pinned_shared_tensor(t) for t in ours.offloaded_values.values()],
    }


def onload_both(mod: str) -> dict:
    """Every tensor onloaded by both classes: their descriptions (type, dtype, shape, bytes)."""
    ours, theirs = _S[mod]
    out = {}
    for name in sorted(ours.offloaded_values):
        a, b = ours[name], theirs[name]
        assert a.device == b.device, (a.device, b.device)
        out[name] = (_describe(a.cpu()), _describe(b.cpu()), a.requires_grad == b.requires_grad)
    return out


def prefetch(mod: str, target: int = 0) -> int:
    from types import SimpleNamespace

    from offcache.weights import compressed_tensors as oc_ct

    ours = _S[mod][0]
    return oc_ct.prefetch([SimpleNamespace(_parameters=ours, _buffers={})], target=target)


def write(mod: str, name: str, seed: int, writer: int) -> None:
    """Rank `writer` alone assigns a new value of the offloaded shape and dtype to both classes."""
    import torch.distributed as dist

    for cache in _S[mod]:
        old = cache.offloaded_values[name]
        if dist.get_rank() == writer:
            cache[name] = make(old.shape, str(old.dtype).removeprefix("torch."), seed)


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def generation(mod: str, name: str, add: int = 0) -> int:
    from offcache import engine

    ours = _S[mod][0]
    return engine.shared_word_add(ours._word(ours.offloaded_values[name]), add)


def node_stats() -> dict:
    from offcache import engine
    from offcache.weights import node

    return {**node.stats(), "pinned_budget": engine.settings()["pinned_limit"]}


def fallback_by_registration(fail: bool) -> dict:
    """cache_class() decided anew with every registration failing on this rank (`fail`) as a low
    memlock limit would (OFFCACHE_FAIL_REGISTER, honoured by the host backend too)."""
    from offcache.weights import node

    node.reset()
    if fail:
        os.environ["OFFCACHE_FAIL_REGISTER"] = "RLIMIT_MEMLOCK is 64 KiB"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cls = node.cache_class()
            assert node.cache_class() is cls
    finally:
        os.environ.pop("OFFCACHE_FAIL_REGISTER", None)
    decided = node.stats()
    node.reset()
    assert node.cache_class() is node.NodeSharedCPUCache  # set up again for the next test
    return {
        "class": cls.__name__,
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        "stats": decided,
    }


def fail_next_registration(rank: int, after: int = 0, chunk: int = 0) -> None:
    import torch.distributed as dist

    from offcache.engine import ops

    ops._set_register_chunk(chunk)
    if dist.get_rank() == rank:
        ops._fail_register(after, "cudaHostRegister: out of memory (injected)")


def reset_register_chunk() -> None:
    from offcache.engine import ops

    ops._set_register_chunk(0)


def caught_offload(mod: str, shapes: list, seed: int = 0) -> dict:
    """offload_pair, recording the warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = offload_pair(mod, shapes, seed=seed)
    result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    return result


def drop_all() -> dict:
    """Every cache and prefetched copy dropped and the node reset: the engine's figures once the
    region's mappings are gone (no tensor views them); then the node is set up again."""
    from offcache import engine
    from offcache.weights import node
    from offcache.weights.bookkeeping import WEIGHTS

    _S.clear()
    WEIGHTS.prefetched.clear()
    node.reset()
    gc.collect()
    engine.synchronize()
    stats = engine_stats()
    assert node.cache_class() is node.NodeSharedCPUCache
    return stats


def set_pinned_limit(limit: int) -> int:
    from offcache import engine

    old = engine.settings()["pinned_limit"]
    engine.set_pinned_limit(limit)
    return old


# --- a pipeline of subgraphs, as the sequential pipeline runs them ------------------------------------


class _Subgraph:
    def __init__(self, module):
        self.module = module

    def forward(self, model, x):
        return self.module(x)

    def submodules(self, model, recurse=True):
        return list(self.module.modules())


def pipeline(n: int, size: int, device: str, patched: bool) -> dict:
    """n linears offloaded to the CPU (compressed-tensors' offload_module: with offcache's weights
    patch, offcache's class), run subgraph by subgraph in disable_offloading() contexts (twice per
    subgraph, as the pipeline's calibration and propagation passes). Returns the outputs' bytes,
    the per-subgraph records and the engine counters' change."""
    from compressed_tensors.offload import disable_offloading, offload_module

    from offcache.weights import compressed_tensors as oc_ct

    torch.manual_seed(0)
    linears = [torch.nn.Linear(size, size) for _ in range(n)]
    x = torch.randn(3, size)
    if patched:
        oc_ct.patch()
    try:
        for linear in linears:
            offload_module(linear, device, "cpu")
        kinds = sorted({type(linear._parameters).__name__ for linear in linears})
        before = _counters()
        history = len(oc_ct.subgraph_stats())
        subgraphs = [_Subgraph(m) for m in linears]
        if patched:
            subgraphs = oc_ct._wrap_subgraphs(subgraphs)
        outs = []
        h = x.to(device)
        for subgraph in subgraphs:
            with disable_offloading():
                subgraph.forward(None, h)
                h = subgraph.forward(None, h)
            outs.append(_describe(h.cpu()))
        counters = delta(before)
        records = oc_ct.subgraph_stats()[history:]
    finally:
        if patched:
            oc_ct.unpatch()
    return {"kinds": kinds, "outs": outs, "records": records, "counters": counters}


# --- CUDA (tests/weights/node/test_gpu_weights_node.py) ----------------------------------------------------


def backend() -> str:
    from offcache import engine

    return engine.backend_name()


def host_pinned(mod: str) -> bool:
    """Whether the driver reports every offloaded tensor of offcache's class as pinned host memory."""
    return all(t.is_pinned() for t in _S[mod][0].offloaded_values.values())


def map_during_capture() -> bool:
    """A mapping of the region registered while this thread captures a CUDA graph (global mode):
    the registration runs in relaxed mode, so the capture survives and replays."""
    from offcache import engine
    from offcache.weights import node

    region = node.GROUP.node.region
    start = region.allocate(1 << 20)  # this rank's own span (not collective)
    x = torch.zeros(16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x + 1  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x + 1
        data, reason = engine.map_shared(region.fd, start, 1 << 20, region.ranks)
    graph.replay()
    torch.cuda.synchronize()
    ok = reason == "" and engine.is_pinned_shared_tensor(data) and data.is_pinned()
    return bool(ok and torch.equal(y.cpu(), torch.ones(16)))
