"""Worker functions for tests/weights/node/test_weights_node_edges.py, run on the ranks of
tests/weights/node/weights_node_worker.py's ``Group`` as ``group.call(E + "<function>", ...)``: offcache's node
classes and compressed-tensors' distributed ones driven the same way, through compressed-tensors' own
entry points.
"""

from __future__ import annotations

import torch

from tests.weights.node.weights_node_worker import _describe

E = "tests.weights.node.weights_node_edges_worker:"


def module_parallel(impl: str, where: str, outs: list[int]) -> dict:
    """compressed-tensors' replace_module_parallel (its distributed compress_model: step 3 runs each rank's
    modules under as_single_threaded(), step 4 offloads them again from their rank) over Linear(8, n)
    modules, one per n in `outs`, offloaded to `where` ("cpu", or a folder: disk), each rank's apply_fn
    replacing the weight with a value of a new shape (as compress_module replaces weight by weight_packed).
    impl "ours": offcache's patch (NodeSharedCPUCache / NodeDiskCache); "theirs": compressed-tensors'
    classes. Returns, module by module, what every rank reads afterwards and what it should read."""
    from compressed_tensors.distributed import replace_module_parallel
    from compressed_tensors.offload import offload_module

    from offcache.weights import compressed_tensors as oc_ct

    torch.manual_seed(0)
    modules = [torch.nn.Linear(8, n) for n in outs]
    want = [_describe(torch.nn.Parameter(m.weight.detach().flatten() * 2, requires_grad=False)) for m in modules]

    def apply_fn(module):
        new = module.weight.detach().flatten() * 2  # a meta tensor on the ranks that do not process it
        module._parameters["weight"] = torch.nn.Parameter(new, requires_grad=False)

    if impl == "ours":
        oc_ct.patch()
    try:
        for module in modules:
            if where == "cpu":
                offload_module(module, "cpu", "cpu")
            else:
                offload_module(module, "cpu", "disk", offload_dir=where)
        kinds = sorted({type(m._parameters).__name__ for m in modules})
        replace_module_parallel(list(modules), apply_fn)  # (it sorts the list it is given)
        got = [_describe(m.weight) for m in modules]
    finally:
        if impl == "ours":
            oc_ct.unpatch()
    return {"kinds": kinds, "got": got, "want": want}


def lazy_views(meta_elsewhere: bool) -> dict:
    """Tensors carrying a lazy conjugate or negative bit (``Tensor.conj()``, ``torch._neg_view``: a
    contiguous view whose stored bytes are not its values) offloaded by both classes from the source;
    the other rank holds the same views (or meta tensors). What each class hands out on this rank, and
    what it should be (the values, made plain)."""
    from compressed_tensors.distributed import is_source_process
    from compressed_tensors.offload.cache import DistributedCPUCache

    from offcache.weights.node import NodeSharedCPUCache

    def views():
        g = torch.Generator().manual_seed(5)
        return {
            "conj": torch.randn(6, dtype=torch.complex64, generator=g).conj(),
            "neg": torch._neg_view(torch.randn(2, 3, dtype=torch.complex64, generator=g)),
        }

    meta = meta_elsewhere and not is_source_process()
    out = {"want": {n: _describe(v.resolve_conj().resolve_neg()) for n, v in views().items()}}
    for label, cls in (("ours", NodeSharedCPUCache), ("theirs", DistributedCPUCache)):
        mapping = {n: v.to("meta") if meta else v for n, v in views().items()}
        cache = cls.from_mapping(mapping, "cpu")
        out[label] = {n: _describe(cache[n].resolve_conj().resolve_neg()) for n in mapping}
    return out
