"""offcache.weights.compressed_tensors: compressed-tensors' CPU weight offloading on the engine.

Covers what compressed-tensors' own tests of its offload caches check (onload, offload,
garbage collection, the disable_* contexts, delete, shared class attributes, tensor
subclasses, update_offload), then what the engine changes: snapshots, asynchronous
write-backs visible to later reads, tied weights, views and dtypes, prefetch (hits, stale
copies, skips, expiry) and the patch itself (unpatch, distributed classes).
All on the host backend (the CPU is the onload device); the GPU test is marked.
"""

import gc
import os
import tempfile
import time
from types import SimpleNamespace
from weakref import ref

import pytest
import torch

pytest.importorskip("compressed_tensors")
pytest.importorskip("llmcompressor")

from compressed_tensors.offload import (  # noqa: E402
    disable_offloading,
    disable_onloading,
    offload_module,
    update_offload_parameter,
)
from compressed_tensors.offload.cache import (  # noqa: E402
    CPUCache,
    DeviceCache,
    DiskCache,
    DistributedDiskCache,
    OffloadCache,
)

import offcache  # noqa: E402
from offcache import engine as _engine  # noqa: E402
from offcache.weights import compressed_tensors as oc_ct  # noqa: E402
from offcache.weights.compressed_tensors import OffcacheCPUCache, OffcacheDiskCache  # noqa: E402
from tests.helpers import cap_gpu_memory, checkpoint_disk_cache  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture
def cache(patched):
    return OffloadCache.cls_from_device("cpu")(CPU)


def counters():
    return {k: v for k, v in offcache.stats().items() if k.startswith("weight_")}


def release():
    """Collect garbage. The engine drops its hold on a fetch's copy at its next call (or here)."""
    offcache.synchronize()
    gc.collect()


def delta(before):
    after = counters()
    return {k: after[k] - before[k] for k in after}


# --- the patch ---------------------------------------------------------------------------------


def test_patch_picks_offcache_for_cpu_only_and_unpatch_restores(engine_config):
    engine_config(backend="host")
    offcache.patch_llmcompressor(weights=True)
    offcache.patch_llmcompressor(weights=True)  # idempotent
    try:
        assert OffloadCache.cls_from_device("cpu") is OffcacheCPUCache
        assert OffloadCache.cls_from_device(torch.device("cpu")) is OffcacheCPUCache
        assert OffloadCache.cls_from_device("disk") is OffcacheDiskCache
        if torch.cuda.is_available():  # without one, compressed-tensors refuses "cuda" itself
            assert OffloadCache.cls_from_device("cuda:0") is DeviceCache
        linear = torch.nn.Linear(3, 3)
        offload_module(linear, CPU, CPU)
        assert type(linear._parameters) is OffcacheCPUCache
    finally:
        offcache.unpatch_llmcompressor()
    assert OffloadCache.cls_from_device("cpu") is CPUCache
    assert OffloadCache.cls_from_device("disk") is DiskCache
    assert "disable_offloading" in OffloadCache.__dict__
    assert OffloadCache.__dict__["disable_offloading"].__func__.__module__ == OffloadCache.__module__
    import llmcompressor.pipelines.sequential.helpers as helpers
    import llmcompressor.pipelines.sequential.pipeline as pipeline

    assert pipeline.trace_subgraphs is helpers.trace_subgraphs
    assert not oc_ct.is_patched()
    # The module offloaded while patched still works, unpatched.
    x = torch.randn(2, 3)
    assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias))


def test_patch_without_weights_leaves_weights_alone():
    offcache.patch_llmcompressor()
    try:
        assert OffloadCache.cls_from_device("cpu") is CPUCache
    finally:
        offcache.unpatch_llmcompressor()


def test_distributed_gets_the_node_shared_cpu_cache_and_the_node_disk_cache(patched):
    import torch.distributed as dist

    from offcache.weights.node import NodeSharedCPUCache  # tests/weights/node/test_weights_node*.py
    from offcache.weights.node.disk import NodeDiskCache  # tests/weights/node/test_weights_node_disk.py

    for _ in range(2):  # a second process group decides again, with a region of its own
        with tempfile.TemporaryDirectory() as tmp:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
            try:
                assert OffloadCache.cls_from_device("cpu") is NodeSharedCPUCache
                assert OffloadCache.cls_from_device("disk") is NodeDiskCache
                cache = NodeSharedCPUCache.from_mapping({"w": torch.arange(4.0)}, "cpu")
                assert torch.equal(cache["w"], torch.arange(4.0))
            finally:
                dist.destroy_process_group()
    assert OffloadCache.cls_from_device("cpu") is OffcacheCPUCache
    oc_ct.unpatch()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            assert OffloadCache.cls_from_device("disk") is DistributedDiskCache  # unpatched: theirs again
        finally:
            dist.destroy_process_group()
    oc_ct.patch()


# --- compressed-tensors' cache behaviour -------------------------------------------------------


def test_onloading_gives_equal_copy_of_the_same_type(cache):
    tensor = torch.arange(10.0)
    cache["weight"] = tensor
    onloaded = cache["weight"]
    assert type(onloaded) is torch.Tensor and onloaded.device == CPU
    assert torch.equal(onloaded, tensor)
    with disable_onloading():
        offloaded = cache["weight"]
    assert _engine.is_arena_tensor(offloaded)
    assert onloaded.data_ptr() != offloaded.data_ptr(), "an onload is a fetch, not the arena itself"


def test_onloaded_value_is_garbage_collected(cache):
    cache["weight"] = torch.ones(10)
    onloaded = cache["weight"]
    r = ref(onloaded)
    del onloaded
    release()
    assert r() is None


def test_a_dropped_onloaded_weight_dies_at_once(cache):
    # Without an engine call or synchronize(): the engine held the fetch's output until its next
    # call (compressed-tensors' test_delete checks exactly this).
    cache["weight"] = torch.ones(10)
    onloaded = cache["weight"]
    r = ref(onloaded)
    del onloaded
    gc.collect()
    assert r() is None


def test_offload_and_onload(cache):
    tensor = torch.randn(10)
    offloaded = cache.offload(tensor)
    assert offloaded.device == CPU and _engine.is_arena_tensor(offloaded)
    assert torch.equal(offloaded, tensor), "readable on the host on return, as CPUCache's"
    assert torch.equal(cache.onload(offloaded), tensor)
    assert cache.offload(None) is None and cache.onload(None) is None
    assert cache.offload(offloaded) is offloaded, "an arena tensor is offloaded already"


def test_disable_offloading_keeps_onloaded_values_until_exit(cache):
    cache["weight"] = torch.ones(10)
    outside = cache["weight"]
    outside_ref = ref(outside)
    with disable_offloading():
        inside = cache["weight"]
        assert cache["weight"] is inside
        inside_ref = ref(inside)
        del outside, inside
        release()
        assert outside_ref() is None
        assert inside_ref() is not None
    release()
    assert inside_ref() is None


def test_nested_disable_offloading_only_the_outermost_releases(cache):
    cache["weight"] = torch.ones(10)
    with disable_offloading():
        first = cache["weight"]
        with disable_offloading():
            assert cache["weight"] is first
        assert cache["weight"] is first, "the inner exit released the outer context's values"
        assert OffloadCache.offloading_disabled
    assert not OffloadCache.offloading_disabled
    assert cache["weight"] is not first


def test_disable_onloading_returns_and_assigns_directly(cache):
    tensor = torch.ones(10)
    cache.offloaded_values["weight"] = tensor
    with disable_onloading():
        assert cache["weight"] is tensor
        other = torch.zeros(3)
        cache["other"] = other
        assert cache.offloaded_values["other"] is other
    # A tensor assigned so is not offcache's: onloads copy it, updates write it in place.
    onloaded = cache["weight"]
    assert torch.equal(onloaded, tensor) and onloaded is not tensor
    cache["weight"] = torch.full((10,), 4.0)
    assert cache.offloaded_values["weight"] is tensor and torch.equal(tensor, torch.full((10,), 4.0))


def test_delete_releases_the_kept_value_and_the_prefetch(cache):
    cache["weight"] = torch.ones(10)
    module = SimpleNamespace(_parameters=cache, _buffers={})
    oc_ct.prefetch([module], target=0)
    assert oc_ct.WEIGHTS.prefetched
    with disable_offloading():
        onloaded = cache["weight"]
        r = ref(onloaded)
        del cache["weight"]
        del onloaded
        release()
        assert r() is None
    assert "weight" not in cache and not oc_ct.WEIGHTS.prefetched


def test_shared_class_attributes(cache):
    assert cache.offloading_disabled is OffloadCache.offloading_disabled
    assert cache.keep_onloaded_values is OffloadCache.keep_onloaded_values
    assert not hasattr(type(cache), "onload_device") and not hasattr(type(cache), "offloaded_values")


def test_tensor_subclasses_and_attributes_kept(cache):
    param = torch.nn.Parameter(torch.ones(10), requires_grad=False)
    param.quant_tag = "w4"
    buffer = torch.nn.Buffer(torch.ones(10))
    cache["tensor"], cache["param"], cache["buffer"] = torch.ones(10), param, buffer
    for name, want in (("tensor", torch.Tensor), ("param", torch.nn.Parameter), ("buffer", torch.Tensor)):
        assert type(cache[name]) is want
        with disable_onloading():
            assert type(cache[name]) is want and torch.equal(cache[name], torch.ones(10))
    assert cache["param"].quant_tag == "w4"


def test_update_offload_in_place_and_in_context(cache):
    cache["weight"] = torch.ones(10)
    with disable_onloading():
        offloaded = cache["weight"]
    cache["weight"] = torch.full((10,), 2.0)
    assert torch.equal(cache["weight"], torch.full((10,), 2.0))
    with disable_onloading():
        assert cache["weight"] is offloaded, "updated in place, not replaced"
        assert torch.equal(offloaded, torch.full((10,), 2.0))
    with disable_offloading():
        kept = cache["weight"]
        cache["weight"] = torch.full((10,), 3.0)
        assert cache["weight"] is kept and torch.equal(kept, torch.full((10,), 3.0))
    assert torch.equal(cache["weight"], torch.full((10,), 3.0))
    cache["weight"] = torch.ones(4)  # another shape: a new offload
    assert torch.equal(cache["weight"], torch.ones(4))


def test_interface_helpers_keep_working(patched, tmp_path):
    """compressed-tensors' helpers around the caches: register_offload_module, get_cache_init_kwargs,
    align_module_device, get_execution_device / get_offloaded_device, remove_module_offload."""
    from compressed_tensors.offload import (
        align_module_device,
        get_cache_init_kwargs,
        get_execution_device,
        get_offloaded_device,
        register_offload_module,
    )
    from compressed_tensors.offload.module import remove_module_offload

    parent = torch.nn.Linear(4, 4)
    offload_module(parent, CPU, CPU)
    register_offload_module(parent, "child", torch.nn.Linear(3, 3))
    assert type(parent.child._parameters) is OffcacheCPUCache
    assert get_execution_device(parent) == CPU and get_offloaded_device(parent) == CPU
    disk = torch.nn.Linear(4, 4)
    offload_module(disk, CPU, "disk", offload_dir=str(tmp_path))
    assert get_cache_init_kwargs(disk)["offload_dir"] == tmp_path.resolve()
    with align_module_device(parent):
        assert parent.weight is parent.weight  # kept onloaded in the context
    want = parent.weight.detach().clone()
    update_offload_parameter(parent, "weight", want + 1)
    remove_module_offload(parent)  # the arena tensors become the module's own
    assert type(parent._parameters) is dict and torch.equal(parent.weight, want + 1)
    assert _engine.is_arena_tensor(parent.weight)


# --- what the engine changes -------------------------------------------------------------------


def test_offload_is_a_snapshot_and_frees_the_source(cache):
    source = torch.randn(1000)
    want = source.clone()
    cache["weight"] = source
    source.add_(1)  # edited right after: the offload holds what it held at the call
    assert torch.equal(cache["weight"], want)
    # Loading then offloading a model holds one copy: the module's tensor dies once offloaded.
    linear = torch.nn.Linear(64, 64)
    r = ref(linear.weight)
    offload_module(linear, CPU, CPU)
    offcache.synchronize()
    gc.collect()
    assert r() is None


def test_offloading_a_loaded_model_keeps_one_copy_of_its_weights(patched):
    """set_onload_device (what the pipeline calls) on a model loaded on the CPU: every original
    parameter dies once offloaded, tied ones included, and the arena holds each weight once."""
    from compressed_tensors.offload import set_onload_device

    from offcache.bench.models import causal_lm

    model = causal_lm("llama", tie_word_embeddings=True)
    originals = [ref(p) for p in model.parameters()]
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    unique_bytes = sum(p.nbytes for p in model.parameters())  # parameters() yields a tied one once
    in_use = offcache.stats()["pinned_in_use_bytes"]
    set_onload_device(model, CPU)
    release()
    assert all(r() is None for r in originals), "an original parameter outlived its offload"
    assert (
        model.lm_head._parameters.offloaded_values["weight"]
        is (model.model.embed_tokens._parameters.offloaded_values["weight"])
    )
    grown = offcache.stats()["pinned_in_use_bytes"] - in_use
    assert unique_bytes <= grown < unique_bytes + 2**20, (grown, unique_bytes)
    got = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_write_back_visible_to_every_later_read(cache):
    """Slow host copies: each read below would see the old bytes if it did not wait."""
    cache["weight"] = torch.zeros(256, 256)
    new = torch.randn(256, 256)
    with disable_offloading():
        cache["weight"] = new
        assert torch.equal(cache.onload(cache.offloaded_values["weight"]), new)  # a later onload
        cache["weight"] = new + 1
        with disable_onloading():
            assert torch.equal(cache["weight"], new + 1)  # a host read of the offloaded tensor
        cache["weight"] = new + 2
    assert torch.equal(cache.offloaded_values["weight"], new + 2)  # landed at the context's end
    cache["weight"] = new + 3  # outside a context: landed at once
    assert torch.equal(cache.offloaded_values["weight"], new + 3)


def test_write_back_reads_a_private_copy_of_the_data(cache):
    cache["weight"] = torch.zeros(512, 512)
    data = torch.ones(512, 512)
    with disable_offloading():
        cache["weight"] = data
        data.fill_(7)  # the caller reuses its tensor while the copy may be in flight
    assert torch.equal(cache["weight"], torch.ones(512, 512))


def test_write_back_the_engine_refuses_is_copied_directly(cache, monkeypatch):
    cache["weight"] = torch.zeros(64, 64)
    module = SimpleNamespace(_parameters=cache, _buffers={})
    oc_ct.prefetch([module], target=0)  # a copy in flight when the update comes

    def refuse(*args, **kwargs):
        raise RuntimeError("offcache: copy_into pair 0: not on this backend (simulated)")

    monkeypatch.setattr(oc_ct._engine, "copy_into", refuse)
    with disable_offloading():
        cache["weight"] = torch.ones(64, 64)
        assert torch.equal(cache["weight"], torch.ones(64, 64))
    monkeypatch.undo()
    assert torch.equal(cache.offloaded_values["weight"], torch.ones(64, 64))


def test_write_back_counted(cache):
    cache["weight"] = torch.zeros(100)
    before = counters()
    cache["weight"] = torch.ones(100)
    _ = cache["weight"]
    d = delta(before)
    assert d["weight_writeback_bytes"] == 400 and d["weight_onload_bytes"] == 400


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.bool])
def test_dtypes_and_casting_updates(cache, dtype):
    source = (torch.randn(6, 5) * 4).to(dtype)
    cache["w"] = source
    assert cache["w"].dtype == dtype and torch.equal(cache["w"], source)
    update = torch.randn(6, 5, dtype=torch.float64) * 4
    cache.update_offload(cache.offloaded_values["w"], update)  # cast as Tensor.copy_ casts
    assert torch.equal(cache["w"], update.to(dtype))


def test_views_offload_and_update(cache):
    base = torch.randn(8, 6)
    cache["t"] = base.t()  # a transposed view: strides kept or not, values must be
    assert torch.equal(cache["t"], base.t())
    cache["t"] = torch.ones(6, 8)
    assert torch.equal(cache["t"], torch.ones(6, 8))
    cache["row"] = base[2]
    cache.update_offload(cache.offloaded_values["row"], torch.tensor(5.0))  # broadcast, as copy_
    assert torch.equal(cache["row"], torch.full((6,), 5.0))
    assert torch.equal(base[2], base[2].clone()) and not torch.equal(base[2], torch.full((6,), 5.0))


def test_tied_weights_stay_tied(patched):
    embed = torch.nn.Embedding(16, 8)
    head = torch.nn.Linear(8, 16, bias=False)
    head.weight = embed.weight
    offload_module(embed, CPU, CPU)
    offload_module(head, CPU, CPU)
    with disable_onloading():
        assert embed.weight is head.weight, "one offloaded tensor for a tied weight"
    with disable_offloading():
        assert embed.weight is head.weight, "onloaded once in a context"
        update_offload_parameter(head, "weight", torch.ones(16, 8))
        assert torch.equal(embed.weight, torch.ones(16, 8))
    assert torch.equal(embed.weight, torch.ones(16, 8))


def test_module_forward_and_update_offload_parameter(patched):
    torch.manual_seed(0)
    linear = torch.nn.Linear(5, 4)
    plain = torch.nn.Linear(5, 4)
    plain.load_state_dict(linear.state_dict())
    offload_module(linear, CPU, CPU)
    x = torch.randn(3, 5)
    assert torch.equal(linear(x), plain(x))
    new = torch.randn(4, 5)
    update_offload_parameter(linear, "weight", new)
    plain.weight.data.copy_(new)
    assert torch.equal(linear(x), plain(x))
    assert torch.equal(linear.state_dict()["weight"], new)


# --- weights on disk ---------------------------------------------------------------------------


@pytest.fixture
def disk_cache(patched, tmp_path):
    return OffloadCache.cls_from_device("disk")(CPU, offload_dir=str(tmp_path))


def test_disk_cache_behaviour(disk_cache, tmp_path):
    """DiskCache's own semantics kept: meta offloads, an index entry and a file per new tensor,
    updates rewrite that file, delete removes it; onloads read the file (through the engine)."""
    assert type(disk_cache) is OffcacheDiskCache
    param = torch.nn.Parameter(torch.randn(6, 4), requires_grad=False)
    disk_cache["weight"] = param
    with disable_onloading():
        offloaded = disk_cache["weight"]
    assert offloaded.device.type == "meta" and offloaded in DiskCache.index
    path = DiskCache.index[offloaded]["safetensors_file"]
    assert os.path.exists(path) and os.path.dirname(path) == str(tmp_path)
    onloaded = disk_cache["weight"]
    assert type(onloaded) is torch.nn.Parameter and torch.equal(onloaded, param)
    before = counters()
    for value in (torch.ones(6, 4), torch.full((6, 4), 2.0)):  # rewritten twice: never a stale mapping
        disk_cache["weight"] = value
        assert torch.equal(disk_cache["weight"], value)
    assert delta(before)["weight_onload_bytes"] == 2 * 6 * 4 * 4
    with disable_offloading():
        assert disk_cache["weight"] is disk_cache["weight"]
    del disk_cache["weight"]
    assert not os.path.exists(path) and offloaded not in DiskCache.index


def test_disk_onload_reads_the_checkpoint_through_a_symlink(patched, tmp_path):
    """from_accelerate's symlinks into the checkpoint: read in place; an update replaces the link
    by a file of its own (the checkpoint is never written)."""
    weights = {"a.weight": torch.randn(5, 3), "b.weight": torch.randn(7).to(torch.bfloat16)}
    cache, checkpoint = checkpoint_disk_cache(tmp_path, weights)
    for name, tensor in weights.items():
        assert torch.equal(cache[name], tensor) and cache[name].dtype == tensor.dtype
    before = checkpoint.read_bytes()
    cache["a.weight"] = torch.zeros(5, 3)
    assert torch.equal(cache["a.weight"], torch.zeros(5, 3))
    assert checkpoint.read_bytes() == before, "the checkpoint was written"
    with disable_onloading():
        link = DiskCache.index[cache["a.weight"]]["safetensors_file"]
        other = DiskCache.index[cache["b.weight"]]["safetensors_file"]
    assert not os.path.islink(link) and os.path.islink(other)
    assert torch.equal(cache["b.weight"], weights["b.weight"])


# --- prefetch ----------------------------------------------------------------------------------


def _offloaded_linears(n, size=64):
    torch.manual_seed(0)
    linears = [torch.nn.Linear(size, size) for _ in range(n)]
    plain = [torch.nn.Linear(size, size) for _ in range(n)]
    for a, b in zip(linears, plain):
        b.load_state_dict(a.state_dict())
        offload_module(a, CPU, CPU)
    return linears, plain


def test_prefetch_hit_serves_the_prefetched_copy(patched):
    (linear,), (plain,) = _offloaded_linears(1)
    before = counters()
    assert oc_ct.prefetch([linear], target=0) == 64 * 65 * 4  # (reading linear.weight here would take it)
    with disable_offloading():
        assert torch.equal(linear.weight, plain.weight) and torch.equal(linear.bias, plain.bias)
    d = delta(before)
    assert d["weight_prefetch_hits"] == 2 and d["weight_prefetch_misses"] == 0
    assert d["weight_prefetch_bytes"] == d["weight_onload_bytes"] == 64 * 65 * 4


def test_prefetched_copy_is_not_served_stale(patched):
    (linear,), (plain,) = _offloaded_linears(1)
    oc_ct.prefetch([linear], target=0)
    update_offload_parameter(linear, "weight", torch.ones(64, 64))  # after the prefetch
    with disable_onloading(), torch.no_grad():
        linear.bias.add_(1)  # an in-place edit of the offloaded tensor after the prefetch
    before = counters()
    with disable_offloading():
        assert torch.equal(linear.weight, torch.ones(64, 64))
        assert torch.equal(linear.bias, plain.bias + 1)
    assert delta(before)["weight_prefetch_hits"] == 0


@pytest.mark.parametrize("edit", ["data", "numpy"])
@pytest.mark.parametrize("cache_cls", [OffcacheCPUCache, CPUCache])
def test_prefetched_copy_edited_through_data_or_numpy_is_not_served(patched, cache_cls, edit):
    """An edit of the offloaded tensor that bumps no version counter (.data, numpy) after a
    prefetch: the next onload sees it, as compressed-tensors' CPUCache does (issue 24, item 4)."""
    cache = cache_cls(CPU)
    cache["w"] = torch.zeros(8, 8)
    with disable_onloading():
        held = cache["w"]  # a reference taken before the prefetch: the hand-out rule cannot see it
    for source, value in (("handed out after", 5.0), ("held from before", 7.0)):
        issued = oc_ct.prefetch([SimpleNamespace(_parameters=cache, _buffers={})], target=0)
        assert issued == (8 * 8 * 4 if cache_cls is OffcacheCPUCache else 0)
        offcache.synchronize()
        with disable_onloading():
            offloaded = cache["w"] if source == "handed out after" else held
            if edit == "data":
                offloaded.data.fill_(value)
            else:
                offloaded.numpy()[:] = value
        with disable_offloading():
            assert torch.equal(cache["w"], torch.full((8, 8), value)), source


def test_prefetch_skipped_without_device_memory(patched, monkeypatch):
    (linear,), (plain,) = _offloaded_linears(1)
    monkeypatch.setattr(oc_ct, "_device_free_bytes", lambda device: 100)
    before = counters()
    assert oc_ct.prefetch([linear], target=0) == 0
    assert torch.equal(linear.weight, plain.weight)
    d = delta(before)
    assert d["weight_prefetch_skips"] == 1 and d["weight_prefetch_misses"] == 1


def test_a_cpu_prefetch_takes_only_the_memory_the_limit_leaves(patched, monkeypatch):
    """Onloaded to the CPU, a prefetch is skipped where the memory left under the limit (less a tenth of
    it for the running subgraph) cannot hold it: in a memory cgroup a prefetch never kills the run."""
    from offcache.engine import machine
    from offcache.weights.memory import fit

    monkeypatch.setattr(machine, "usable_memory_bytes", lambda: 1000 * 1024)
    monkeypatch.setattr(fit, "host_room", lambda: (100 * 1024 + 64 * 65 * 4 - 1, "the cgroup's limit"))
    assert oc_ct._device_free_bytes(CPU) == 64 * 65 * 4 - 1
    (linear,), (plain,) = _offloaded_linears(1)
    before = counters()
    assert oc_ct.prefetch([linear], target=0) == 0  # one byte short
    assert torch.equal(linear.weight, plain.weight)
    assert delta(before)["weight_prefetch_skips"] == 1
    monkeypatch.setattr(fit, "host_room", lambda: (100 * 1024 + 64 * 65 * 4, "the cgroup's limit"))
    assert oc_ct.prefetch([linear], target=0) == 64 * 65 * 4


def test_prefetch_failure_never_fails_the_run(patched, monkeypatch):
    (linear,), (plain,) = _offloaded_linears(1)

    def broken_fetch(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(oc_ct._engine, "fetch", broken_fetch)
    before = counters()
    assert oc_ct.prefetch([linear], target=0) == 0
    monkeypatch.undo()
    assert torch.equal(linear.weight, plain.weight)
    assert delta(before)["weight_prefetch_skips"] == 1


class FakeSubgraph:
    """What the pipeline uses of llm-compressor's Subgraph: forward(model, ...) and submodules(model)."""

    def __init__(self, module, work_s):
        self.module, self.work_s = module, work_s

    def forward(self, model, x):
        out = self.module(x)
        time.sleep(self.work_s)  # compute that outlasts the next subgraph's (slowed) weight copies
        return out

    def submodules(self, model, recurse=True):
        return list(self.module.modules())  # as llm-compressor's: every module, recursively


def run_pipeline(subgraphs, batches):
    """The sequential pipeline's shape: per subgraph a disable_offloading() context, two passes."""
    outs = []
    for subgraph in subgraphs:
        with disable_offloading():
            for x in batches:
                subgraph.forward(None, x)
            outs.append([subgraph.forward(None, x) for x in batches])
    return outs


@pytest.mark.parametrize("depth", ["1", "2", "0"])
def test_pipeline_prefetch_hits_after_the_first_subgraph_no_host_waits(patched, monkeypatch, depth):
    monkeypatch.setenv("OFFCACHE_WEIGHT_PREFETCH", depth)
    linears, plain = _offloaded_linears(5, size=128)
    subgraphs = oc_ct._wrap_subgraphs([FakeSubgraph(m, 0.01) for m in linears])
    batches = [torch.randn(2, 128) for _ in range(3)]
    before = len(oc_ct.subgraph_stats())
    outs = run_pipeline(subgraphs, batches)
    for out, p in zip(outs, plain):
        for o, x in zip(out, batches):
            assert torch.equal(o, p(x))
    history = oc_ct.subgraph_stats()[before:]
    assert [s["index"] for s in history] == list(range(5))
    assert history[0]["misses"] == 2 and history[0]["hits"] == 0
    for s in history[1:]:
        if depth == "0":
            assert s["hits"] == 0 and s["misses"] == 2
        else:
            assert s["hits"] == 2 and s["misses"] == 0, s
            assert s["host_waits"] == 0, f"steady state waited for weights: {s}"
            assert s["prefetched_bytes"] == s["onloaded_bytes"] == 128 * 129 * 4
    assert not oc_ct.WEIGHTS.prefetched, "prefetched copies outlived their subgraph's context"


def test_prefetched_copies_die_with_their_subgraph_context(patched):
    linears, _ = _offloaded_linears(3)
    subgraphs = oc_ct._wrap_subgraphs([FakeSubgraph(m, 0) for m in linears])
    with disable_offloading():
        subgraphs[0].forward(None, torch.randn(1, 64))
    # Subgraph 1's copies survive subgraph 0's context, for subgraph 1's.
    copies = [ref(e.onloaded) for e in oc_ct.WEIGHTS.prefetched.values()]
    assert len(copies) == 2 and all(e.target == 1 for e in oc_ct.WEIGHTS.prefetched.values())
    with disable_offloading():
        pass  # subgraph 1 never ran: a context in which no subgraph runs keeps them
    assert len(oc_ct.WEIGHTS.prefetched) == 2
    with disable_offloading():
        subgraphs[1].forward(None, torch.randn(1, 64))
    release()
    assert all(r() is None for r in copies)
    assert {e.target for e in oc_ct.WEIGHTS.prefetched.values()} == {2}
    with pytest.raises(KeyError), disable_offloading():
        raise KeyError("a failing subgraph")
    assert not oc_ct.WEIGHTS.prefetched, "a failed context drops every prefetch"


def test_shared_weight_edited_in_place_in_one_subgraph_is_fresh_in_the_next(patched):
    """A weight two subgraphs share: the first edits its onloaded copy through .data (no version
    bump), as AWQ's grid search does; compressed-tensors drops that copy at the context's end, so
    the next subgraph must see the offloaded value, prefetched or not."""
    shared = torch.nn.Linear(16, 16, bias=False)
    want = shared.weight.detach().clone()
    first, second = torch.nn.Sequential(shared), torch.nn.Sequential(shared)
    offload_module(shared, CPU, CPU)
    subgraphs = oc_ct._wrap_subgraphs([FakeSubgraph(first, 0), FakeSubgraph(second, 0)])
    with disable_offloading():
        subgraphs[0].forward(None, torch.randn(1, 16))  # prefetches the second's (the same) weight
        shared.weight.data.mul_(0)
    with disable_offloading():
        assert torch.equal(shared.weight, want)


def test_prefetch_depth_parsing(monkeypatch):
    for raw, want in (("", 1), ("0", 0), ("3", 3)):
        monkeypatch.setenv("OFFCACHE_WEIGHT_PREFETCH", raw)
        assert oc_ct.prefetch_depth() == want
    for bad in ("-1", "two"):
        monkeypatch.setenv("OFFCACHE_WEIGHT_PREFETCH", bad)
        with pytest.raises(ValueError, match="OFFCACHE_WEIGHT_PREFETCH"):
            oc_ct.prefetch_depth()
    monkeypatch.delenv("OFFCACHE_WEIGHT_PREFETCH")
    assert oc_ct.prefetch_depth() == 1 and "OFFCACHE_WEIGHT_PREFETCH" not in os.environ


@pytest.mark.gpu
def test_gpu_disk_weights_prefetched_from_the_file(tmp_path):
    device = torch.device("cuda", torch.cuda.current_device())
    offcache.configure()
    oc_ct.patch()
    try:
        torch.manual_seed(0)
        linears = [torch.nn.Linear(256, 256) for _ in range(2)]
        plain = [(m.weight.detach().clone(), m.bias.detach().clone()) for m in linears]
        for m in linears:
            offload_module(m, device, "disk", offload_dir=str(tmp_path))
        before = counters()
        assert oc_ct.prefetch(linears, target=0) == 2 * 256 * 257 * 4
        offcache.synchronize()  # landed: handing them out makes no stream wait
        with disable_offloading():
            for m, (w, b) in zip(linears, plain):
                assert m.weight.device == device and torch.equal(m.weight.cpu(), w) and torch.equal(m.bias.cpu(), b)
        d = delta(before)
        assert d["weight_prefetch_hits"] == 4 and d["weight_host_waits"] == 0
        assert d["weight_stream_waits"] == 0
    finally:
        oc_ct.unpatch()


@pytest.mark.gpu
def test_gpu_prefetch_skipped_under_a_device_memory_limit():
    device = torch.device("cuda", torch.cuda.current_device())
    offcache.configure()
    oc_ct.patch()
    try:
        linears = [torch.nn.Linear(2048, 2048) for _ in range(2)]
        for m in linears:
            offload_module(m, device, CPU)
        torch.cuda.empty_cache()
        total = torch.cuda.mem_get_info(device)[1]
        allowed = (torch.cuda.memory_allocated(device) + 2**20) / total  # 1 MiB more than in use
        torch.cuda.set_per_process_memory_fraction(allowed, device)
        before = counters()
        try:
            assert oc_ct.prefetch(linears, target=0) == 0
        finally:
            cap_gpu_memory(device)  # this worker's share again, not the whole GPU
        assert delta(before)["weight_prefetch_skips"] == 1
        assert oc_ct.prefetch(linears, target=0) == 2 * 2048 * 2049 * 4
        with disable_offloading():
            assert linears[0].weight.device == device
        assert delta(before)["weight_prefetch_hits"] >= 1
    finally:
        oc_ct.unpatch()


def _disk_offloaded_linears(n, folder, size=64):
    torch.manual_seed(0)
    linears = [torch.nn.Linear(size, size) for _ in range(n)]
    plain = [torch.nn.Linear(size, size) for _ in range(n)]
    for a, b in zip(linears, plain):
        b.load_state_dict(a.state_dict())
        offload_module(a, CPU, "disk", offload_dir=str(folder))
    return linears, plain


def test_disk_pipeline_prefetch_reads_files_through_the_engine_no_host_waits(patched, monkeypatch, tmp_path):
    """Weights on disk: every subgraph after the first finds its weights prefetched (read from
    their safetensors files by the engine's I/O thread), and the steady state never waits."""
    monkeypatch.setenv("OFFCACHE_WEIGHT_PREFETCH", "1")
    linears, plain = _disk_offloaded_linears(4, tmp_path, size=128)
    subgraphs = oc_ct._wrap_subgraphs([FakeSubgraph(m, 0.01) for m in linears])
    batches = [torch.randn(2, 128) for _ in range(3)]
    before, engine_before = len(oc_ct.subgraph_stats()), offcache.stats()
    outs = run_pipeline(subgraphs, batches)
    for out, p in zip(outs, plain):
        for o, x in zip(out, batches):
            assert torch.equal(o, p(x))
    history = oc_ct.subgraph_stats()[before:]
    assert history[0]["misses"] == 2
    for s in history[1:]:
        assert s["hits"] == 2 and s["misses"] == 0 and s["host_waits"] == 0, s
    s = offcache.stats()
    assert s["file_fetches"] - engine_before["file_fetches"] == 4 * 2  # a file per weight, as DiskCache writes
    assert s["file_read_bytes"] - engine_before["file_read_bytes"] >= 4 * 128 * 129 * 4


def test_disk_update_while_a_prefetch_reads_the_file(patched, engine_config, tmp_path):
    """DiskCache rewrites its file in place: a read of it still in flight lands first (slowed
    copies hold it), and the next onload reads the new bytes."""
    engine_config(backend="host", host_copy_delay_us=30_000)
    (linear,), (plain,) = _disk_offloaded_linears(1, tmp_path, size=256)
    assert oc_ct.prefetch([linear], target=0) == 256 * 257 * 4
    update_offload_parameter(linear, "weight", torch.ones(256, 256))
    with disable_offloading():
        assert torch.equal(linear.weight, torch.ones(256, 256))
        assert torch.equal(linear.bias, plain.bias)  # the prefetched copy of the untouched bias
    assert not oc_ct.WEIGHTS.prefetched


def test_disk_prefetch_cast_to_the_index_dtype_waits_for_the_read(patched, engine_config, tmp_path):
    """A checkpoint tensor whose index dtype differs from the file's is cast at onload (as
    DiskCache does): the cast of a prefetched copy must follow its read (slowed copies)."""
    engine_config(backend="host", host_copy_delay_us=50_000)
    weight = torch.randn(512, 512).to(torch.bfloat16)
    cache, _ = checkpoint_disk_cache(tmp_path, {"weight": weight}, dtypes={"weight": torch.float32})
    linear = torch.nn.Linear(512, 512, bias=False)
    linear._parameters = cache  # the module's parameters are that cache, as offload_module makes them
    assert oc_ct.prefetch([linear], target=0) == 512 * 512 * 4
    with disable_offloading():
        got = linear.weight
        assert got.dtype == torch.float32 and torch.equal(got, weight.float())


def test_updating_a_checkpoint_symlink_does_not_wait_for_reads_of_the_checkpoint(
    patched, engine_config, tmp_path, monkeypatch
):
    """DiskCache only unlinks a checkpoint symlink on update: reads of the shard go on."""
    engine_config(backend="host", host_copy_delay_us=50_000)
    weights = {"a": torch.randn(512, 512), "b": torch.randn(512, 512)}
    cache, checkpoint = checkpoint_disk_cache(tmp_path, weights)
    module = torch.nn.Module()
    module._parameters = cache
    assert oc_ct.prefetch([module], target=0) == 2 * 512 * 512 * 4  # both read from the shard
    synchronized = []
    monkeypatch.setattr(oc_ct._engine, "synchronize", lambda: synchronized.append(1))
    cache["a"] = torch.zeros(512, 512)  # an update: the symlink becomes a file of its own
    monkeypatch.undo()
    assert not synchronized, "the update waited for every read in flight"
    with disable_offloading():
        assert torch.equal(cache["a"], torch.zeros(512, 512))
        assert torch.equal(cache["b"], weights["b"])  # its prefetch, from the untouched shard
