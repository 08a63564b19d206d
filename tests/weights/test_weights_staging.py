"""compressed-tensors 0.20's staging API on offcache's caches (OffcacheCPUCache, OffcacheDiskCache).

``stage()`` / ``is_staged`` and the functions built on them (``stage_module_offload``,
``subgraph_stage_modules``, ``subgraph_onload_modules`` / ``subgraph_offload_modules``,
``disk_load_context``), pinned and not, each against compressed-tensors' own cache of the same
kind on a twin module: the same values, dtypes and tensor types, and a staged weight is what the
next onload hands out (edits and prefetches included). Also the type a disk onload returns, on
0.19 and 0.20 alike: the type compressed-tensors' own DiskCache returns. Host backend, slowed
copies (async bugs show).
"""

from unittest import mock

import pytest
import torch

pytest.importorskip("compressed_tensors", reason="offcache.weights.compressed_tensors needs compressed-tensors")
pytest.importorskip("llmcompressor", reason="offcache.weights.compressed_tensors.patch() needs llm-compressor")

from compressed_tensors.offload import disable_offloading, disable_onloading, offload_module  # noqa: E402
from compressed_tensors.offload.cache import CPUCache, DiskCache, OffloadCache  # noqa: E402

import offcache  # noqa: E402
from offcache.weights import compressed_tensors as oc_ct  # noqa: E402
from offcache.weights.compressed_tensors import OffcacheCPUCache, OffcacheDiskCache  # noqa: E402

CPU = torch.device("cpu")
STAGING = hasattr(OffloadCache, "stage")
needs_staging = pytest.mark.skipif(not STAGING, reason="compressed-tensors < 0.20 has no staging API")


def upstream_classes(kind):
    """compressed-tensors' own cache classes for new offloads, while patched."""
    upstream = {"cpu": CPUCache, "disk": DiskCache}[kind]
    return mock.patch.object(OffloadCache, "cls_from_device", classmethod(lambda cls, device=None: upstream))


def twins(kind, tmp_path, dtype=torch.float32):
    """(offcache's module, compressed-tensors' module): equal Linear layers offloaded to `kind`."""
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(16, 8).to(dtype), torch.nn.Linear(16, 8).to(dtype)
    theirs.load_state_dict(ours.state_dict())
    for tag in ("ours", "theirs"):
        (tmp_path / tag).mkdir(parents=True)
    offload_module(ours, CPU, kind, **({"offload_dir": str(tmp_path / "ours")} if kind == "disk" else {}))
    with upstream_classes(kind):
        offload_module(theirs, CPU, kind, **({"offload_dir": str(tmp_path / "theirs")} if kind == "disk" else {}))
    assert type(ours._parameters) is {"cpu": OffcacheCPUCache, "disk": OffcacheDiskCache}[kind]
    assert type(theirs._parameters) is {"cpu": CPUCache, "disk": DiskCache}[kind]
    return ours, theirs


def same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
    assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_onload_type_matches_compressed_tensors(patched, tmp_path, kind):
    """0.20's DiskCache.onload casts, then copies the class (a Parameter); 0.19's copies, then casts."""
    ours, theirs = twins(kind, tmp_path)
    for name in ("weight", "bias"):
        same(getattr(ours, name), getattr(theirs, name))
    with disable_offloading():
        same(ours.weight, theirs.weight)


@needs_staging
@pytest.mark.parametrize("pin", [False, True])
@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_stage_module_offload_then_onload(patched, tmp_path, kind, pin):
    from compressed_tensors.offload.module import stage_module_offload

    ours, theirs = twins(kind, tmp_path)
    oc_ct.prefetch([ours], target=0)  # a prefetch issued before staging: never served stale
    for module in (ours, theirs):
        stage_module_offload(module, pin_memory=pin)
    assert ours._parameters.is_staged and ours._buffers.is_staged
    with disable_onloading():
        staged = ours._parameters.offloaded_values["weight"]
    assert staged.device == CPU  # the disk cache's meta tensor is staged in host memory
    for name in ("weight", "bias"):
        same(getattr(ours, name), getattr(theirs, name))
    # A staged weight is what the next onload hands out: edits to it included (no version bump).
    for module in (ours, theirs):
        with disable_onloading():
            module.weight.data.fill_(3.0)
    oc_ct.prefetch([ours], target=0)
    offcache.synchronize()
    for module in (ours, theirs):
        with disable_onloading():
            module.weight.detach().numpy()[0] = 4.0
    with disable_offloading():
        same(ours.weight, theirs.weight)
        assert ours.weight[0].eq(4.0).all() and ours.weight[1:].eq(3.0).all()
    x = torch.randn(2, 16)
    same(ours(x), theirs(x))  # stage_module_offload restored the forward: no offload wrapper


@needs_staging
@pytest.mark.parametrize("pin", [False, True])
@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_subgraph_stage_onload_offload_round_trip(patched, tmp_path, kind, pin):
    from compressed_tensors.offload.cache.disk_utils import disk_load_context
    from compressed_tensors.offload.module import (
        subgraph_offload_modules,
        subgraph_onload_modules,
        subgraph_stage_modules,
    )

    ours, theirs = twins(kind, tmp_path)
    want = {k: v.detach().clone() for k, v in theirs.state_dict().items()}
    kwargs = {}
    for tag, module in (("ours", ours), ("theirs", theirs)):
        modules = {"m": module}
        subgraph_stage_modules(modules, pin_memory=pin)
        with disk_load_context():
            kwargs[tag] = subgraph_onload_modules(modules)
        assert not isinstance(module._parameters, OffloadCache)  # onloaded: plain dicts
    for name in ("weight", "bias"):
        same(getattr(ours, name), getattr(theirs, name))
        assert torch.equal(getattr(ours, name), want[name])
    with torch.no_grad():
        for module in (ours, theirs):
            module.weight.mul_(2)  # what a modifier does to onloaded weights
    if kind == "disk":  # each writes new files of its own
        for tag in ("ours", "theirs"):
            kwargs[tag]["m"]["offload_dir"] = str(tmp_path / f"{tag}-again")
            (tmp_path / f"{tag}-again").mkdir()
    subgraph_offload_modules({"m": ours}, kwargs["ours"])
    with mock.patch.object(
        OffloadCache,
        "cls_from_device",
        classmethod(lambda cls, device=None: {"cpu": CPUCache, "disk": DiskCache}[kind]),
    ):
        subgraph_offload_modules({"m": theirs}, kwargs["theirs"])
    assert type(ours._parameters) is {"cpu": OffcacheCPUCache, "disk": OffcacheDiskCache}[kind]
    for name in ("weight", "bias"):
        same(getattr(ours, name), getattr(theirs, name))
    assert torch.equal(ours.weight, want["weight"] * 2)


@needs_staging
def test_staged_disk_weight_onloads_without_its_index_entry(patched, tmp_path):
    """The failure issue 25 reports: after staging, onloads looked the staged CPU tensor up in
    DiskCache.index (KeyError)."""
    from compressed_tensors.offload.module import stage_module_offload, subgraph_onload_modules

    ours, theirs = twins("disk", tmp_path)
    stage_module_offload(ours)
    with disable_onloading():
        staged = ours._parameters.offloaded_values["weight"]
    assert staged.device.type == "cpu" and not any(k is staged for k in DiskCache.index)
    assert torch.equal(ours.weight, theirs.weight)
    subgraph_onload_modules({"m": ours})
    assert torch.equal(ours.weight, theirs.weight)


@needs_staging
def test_staged_update_is_what_the_next_onload_hands_out(patched, tmp_path):
    from compressed_tensors.offload import update_offload_parameter
    from compressed_tensors.offload.module import stage_module_offload

    for kind in ("cpu", "disk"):
        ours, _ = twins(kind, tmp_path / kind)
        stage_module_offload(ours, pin_memory=True)
        oc_ct.prefetch([ours], target=0)
        update_offload_parameter(ours, "weight", torch.full((8, 16), 7.0))
        with disable_offloading():
            assert torch.equal(ours.weight, torch.full((8, 16), 7.0)), kind


@pytest.mark.parametrize("prefetch", [False, True])
def test_disk_onload_cast_to_the_index_dtype_keeps_the_type_compressed_tensors_gives(patched, tmp_path, prefetch):
    """A checkpoint's float32 weight whose index dtype is bfloat16, offloaded as a Parameter: 0.20's
    DiskCache.onload casts first, so the Parameter class is kept; 0.19's gives a plain tensor."""
    from safetensors.torch import save_file

    checkpoint = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(8, 16)}, str(checkpoint))
    got = {}
    for tag, cls in (("ours", OffcacheDiskCache), ("theirs", DiskCache)):
        folder = tmp_path / tag
        folder.mkdir()
        cache = cls(CPU, offload_dir=str(folder))
        meta = torch.nn.Parameter(torch.empty(8, 16, dtype=torch.bfloat16, device="meta"), requires_grad=False)
        info = {"safetensors_file": str(checkpoint), "weight_name": "w", "dtype": "bfloat16"}
        DiskCache.create_checkpoint_symlink(meta, info, str(folder))
        with disable_onloading():
            cache["w"] = meta
        if prefetch and cls is OffcacheDiskCache:
            assert oc_ct.prefetch([type("M", (), {"_parameters": cache, "_buffers": {}})()], target=0) > 0
        with disable_offloading():
            got[tag] = cache["w"]
    same(got["ours"], got["theirs"])
    assert type(got["theirs"]) is (torch.nn.Parameter if STAGING else torch.Tensor)  # what is compared
