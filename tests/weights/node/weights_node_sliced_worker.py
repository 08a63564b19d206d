"""Worker functions for tests/weights/node/test_weights_node_sliced.py and test_gpu_weights_node.py: the node
region's sliced onload (offcache/weights/node/sliced.py), run on the ranks of
tests/weights/node/weights_node_worker.py's ``Group`` as ``group.call(S + "<function>", ...)``.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch

from tests.weights.node.weights_node_engine_worker import _Subgraph
from tests.weights.node.weights_node_worker import _describe

S = "tests.weights.node.weights_node_sliced_worker:"
_S: dict[str, Any] = {}
# Every torch.distributed function a cache could call (counted while a pipeline runs).
_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "barrier", "broadcast", "all_gather", "all_reduce",
                "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "gather_object",
                "scatter_object_list", "send", "recv")  # fmt: skip


def use_mode(mode: str) -> bool:
    """OFFCACHE_NODE_ONLOAD=`mode` on this rank, and the node set up anew (collective): whether sliced."""
    from offcache.weights import node
    from offcache.weights.node import sliced as node_sliced

    os.environ["OFFCACHE_NODE_ONLOAD"] = mode
    node.reset()
    assert node.cache_class() is node.NodeSharedCPUCache, node.stats()
    return node_sliced.active()


def setup_error() -> str:
    """cache_class() (collective) with this rank's environment: the error it raises, '' if none."""
    from offcache.weights import node

    node.reset()
    try:
        node.cache_class()
    except ValueError as exc:
        return f"ValueError: {exc}"
    return ""


class _Counting:
    """Counts the calls of torch.distributed's collectives while entered."""

    def __enter__(self):
        import torch.distributed as dist

        self.dist, self.counts = dist, {}
        self.saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
        for name, fn in self.saved.items():
            setattr(dist, name, self._wrap(name, fn))
        return self

    def _wrap(self, name, fn):
        def call(*args, **kwargs):
            self.counts[name] = self.counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        return call

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.dist, name, fn)


class _Block(torch.nn.Module):
    """A small decoder-like block: odd sizes (slices cut tensors mid-way), a bias-less linear, a
    LayerNorm, and a bf16 buffer of 7 values (a 14-byte tensor)."""

    def __init__(self, h: int):
        super().__init__()
        self.up = torch.nn.Linear(h, h + 3)
        self.norm = torch.nn.LayerNorm(h + 3)
        self.down = torch.nn.Linear(h + 3, h, bias=False)
        self.register_buffer("scale", (torch.rand(7) + 0.5).to(torch.bfloat16))

    def forward(self, x):
        return self.down(torch.relu(self.norm(self.up(x)))) * self.scale.float().mean() + x


def _counters() -> dict:
    from offcache import engine

    return {k: v for k, v in engine.stats().items() if k.startswith(("weight_", "shared_fetch"))}


def model_walk(n: int, h: int, device: str, impl: str) -> dict:
    """n blocks offloaded with compressed-tensors' offload_module (impl "ours": offcache's weights
    patch, in the mode use_mode() set; "theirs": compressed-tensors' DistributedCPUCache), run
    subgraph by subgraph in disable_offloading() contexts, two passes each (as the sequential
    pipeline's calibration and propagation). Returns every subgraph's output bytes, the classes,
    the per-subgraph records, the counters' change and the collectives made while running."""
    from compressed_tensors.offload import offload_module

    from offcache.weights import compressed_tensors as oc_ct

    torch.manual_seed(0)
    blocks = [_Block(h) for _ in range(n)]
    x = torch.randn(5, h)
    if impl == "ours":
        oc_ct.patch()
    try:
        for block in blocks:
            for module in block.modules():
                offload_module(module, device, "cpu")
        kinds = sorted({type(m._parameters).__name__ for b in blocks for m in b.modules()})
        ran = _run_subgraphs([_Subgraph(b) for b in blocks], x.to(device), impl)
    finally:
        if impl == "ours":
            oc_ct.unpatch()
    return {"kinds": kinds, **ran}


def _run_subgraphs(subgraphs: list, h_: torch.Tensor, impl: str) -> dict:
    """Each subgraph run twice in a disable_offloading() context (calibration, then propagation; offcache's
    prefetch wrapping them for impl "ours"): every output's bytes, the per-subgraph records, the counters'
    change and the collectives made."""
    from compressed_tensors.offload import disable_offloading

    from offcache.weights import compressed_tensors as oc_ct

    before = _counters()
    history = len(oc_ct.subgraph_stats())
    if impl == "ours":
        subgraphs = oc_ct._wrap_subgraphs(subgraphs)
    outs = []
    with _Counting() as counting:
        for subgraph in subgraphs:
            with disable_offloading():
                subgraph.forward(None, h_)
                h_ = subgraph.forward(None, h_)
            outs.append(_describe(h_.cpu()))
    now = _counters()
    counters = {k: now[k] - before[k] for k in now if now[k] != before[k]}
    return {"outs": outs, "records": oc_ct.subgraph_stats()[history:], "counters": counters,
            "collectives": counting.counts}  # fmt: skip


def offload_pair(mod: str, shapes: list, device: str = "cpu") -> None:
    """A module's tensors offloaded by offcache's class and compressed-tensors' (`shapes`: (shape, dtype))."""
    from compressed_tensors.offload.cache import DistributedCPUCache

    from offcache.weights.node import NodeSharedCPUCache
    from tests.weights.node.weights_node_worker import make

    def mapping():
        return {f"t{i}": make(shape, dtype, 10 + i) for i, (shape, dtype) in enumerate(shapes)}

    _S[mod] = (NodeSharedCPUCache.from_mapping(mapping(), device), DistributedCPUCache.from_mapping(mapping(), device))


def prefetch(mods: list[str], target: int = 0, no_room: bool = False) -> dict:
    """offcache's prefetch of the modules `mods` (offcache's class of each) for subgraph `target`;
    `no_room`: this rank's device has no room for it. The bytes issued, the collectives made and
    the counters' change."""
    from offcache.weights import compressed_tensors as oc_ct

    modules = [SimpleNamespace(_parameters=_S[m][0], _buffers={}) for m in mods]
    saved = oc_ct._device_free_bytes
    if no_room:
        oc_ct._device_free_bytes = lambda device: 0
    before = _counters()
    try:
        with _Counting() as counting:
            issued = oc_ct.prefetch(modules, target=target)
    finally:
        oc_ct._device_free_bytes = saved
    now = _counters()
    return {
        "issued": issued,
        "collectives": counting.counts,
        "counters": {k: now[k] - before[k] for k in now if now[k] != before[k]},
    }


def onload(mod: str, names: list[str] | None = None) -> dict:
    """Onloads of both classes (all names, or `names`): their descriptions, the collectives made."""
    ours, theirs = _S[mod]
    out = {}
    with _Counting() as counting:
        for name in names or sorted(ours.offloaded_values):
            a, b = ours[name], theirs[name]
            out[name] = (_desc(a), _desc(b))
    return {"values": out, "collectives": counting.counts}


def _desc(t: torch.Tensor) -> tuple:
    """type, dtype, shape and bytes (a 0-dim tensor too)."""
    return (type(t).__name__, tuple(t.shape), _describe(t.detach().cpu().reshape(-1)))


def write(mod: str, name: str, seed: int, writer: int) -> None:
    """Rank `writer` alone assigns a new value to both classes' `name`; then a barrier."""
    import torch.distributed as dist

    from tests.weights.node.weights_node_worker import make

    for cache in _S[mod]:
        old = cache.offloaded_values[name]
        if dist.get_rank() == writer:
            cache[name] = make(old.shape, str(old.dtype).removeprefix("torch."), seed)
    dist.barrier()


def skew_generations(on: bool) -> None:
    """This rank's NodeSharedCPUCache sees every generation 2 lower before its fetch (as if it had
    fetched before a write that another rank fetched after); off: as it is."""
    from offcache.weights.node import NodeSharedCPUCache

    if on:
        real = NodeSharedCPUCache.tag
        _S["real_tag"] = real
        NodeSharedCPUCache.tag = lambda self, offloaded: real(self, offloaded) - 2
    elif "real_tag" in _S:
        NodeSharedCPUCache.tag = _S.pop("real_tag")


def clear_prefetched() -> None:
    from offcache.weights.bookkeeping import WEIGHTS

    WEIGHTS.prefetched.clear()


def mark() -> None:
    _S["before"] = _counters()


def since() -> dict:
    now = _counters()
    return {k: now[k] - _S["before"][k] for k in now if now[k] != _S["before"][k]}


def device_count() -> int:
    return torch.cuda.device_count()


class _Tied(torch.nn.Module):
    """An embedding and a bias-less linear tied to it (an lm_head), in one subgraph."""

    def __init__(self, vocab: int, h: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, h)
        self.head = torch.nn.Linear(h, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        ids = torch.arange(3, device=x.device)
        return self.head(x + self.embed(ids).mean(0))


def tied_walk(device: str, impl: str) -> dict:
    """A linear, then an embedding and a linear tied to it (one subgraph, prefetched whole), offloaded
    with compressed-tensors' offload_module; ranks other than the source build the model on meta (as
    a model loaded on the source rank only). As model_walk, plus whether the tie is one offloaded
    tensor here and the bytes fetched from the node region."""
    from compressed_tensors.distributed import is_source_process
    from compressed_tensors.offload import offload_module

    from offcache.weights import compressed_tensors as oc_ct

    torch.manual_seed(0)
    with torch.device("cpu" if is_source_process() else "meta"):  # (meta draws no random numbers)
        first, tied = torch.nn.Linear(16, 16), _Tied(24, 16)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    if impl == "ours":
        oc_ct.patch()
    try:
        for module in [first, *tied.modules()]:
            offload_module(module, device, "cpu")
        offloaded = [m._parameters.offloaded_values["weight"] for m in (tied.embed, tied.head)]
        ran = _run_subgraphs([_Subgraph(first), _Subgraph(tied)], x.to(device), impl)
    finally:
        if impl == "ours":
            oc_ct.unpatch()
    return {**ran, "one_tensor": offloaded[0] is offloaded[1]}
