"""Adversarial tests of OffcacheDiskCache (compressed-tensors' DiskCache reading through fetch_file).

Split from test_file_adversarial.py, whose fetch_file tests need neither compressed-tensors nor
llm-compressor: this file is skipped as a whole without compressed-tensors.
"""

import gc
import json
import struct

import pytest
import torch

ct = pytest.importorskip("compressed_tensors", reason="OffcacheDiskCache needs compressed-tensors")

# --- OffcacheDiskCache ----------------------------------------------------------------------------

from compressed_tensors.offload import disable_offloading, disable_onloading, offload_module  # noqa: E402
from compressed_tensors.offload.cache import DiskCache  # noqa: E402

import offcache  # noqa: E402
from offcache.weights import compressed_tensors as oc_ct  # noqa: E402
from tests.helpers import checkpoint_disk_cache, raw  # noqa: E402

CPU = torch.device("cpu")


WEIGHTS_COPY_DELAY_US = 20000  # the patched fixture's slowed copies


def test_disk_cache_unusual_dtypes_scalars_and_empty(patched, tmp_path):
    weights = {
        "f8": torch.randn(33).to(torch.float8_e4m3fn),
        "f8b": torch.randn(5, 3).to(torch.float8_e5m2),
        "e8m0": torch.rand(7).to(torch.float8_e8m0fnu),  # no offcache.weights.files.DTYPES entry: DiskCache reads it
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "c64": torch.randn(4, dtype=torch.complex64),
        "bool": torch.rand(9) > 0.5,
        "u16": torch.arange(11, dtype=torch.int32).to(torch.uint16),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }
    cache, _ = checkpoint_disk_cache(tmp_path, weights)
    for name, tensor in weights.items():
        got = cache[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert raw(got) == raw(tensor), name


def test_disk_cache_name_missing_from_the_file_raises_key_error(patched, tmp_path):
    cache, checkpoint = checkpoint_disk_cache(tmp_path, {"a": torch.randn(4)})
    meta = torch.empty(4, device="meta")
    info = {"safetensors_file": str(checkpoint), "weight_name": "nope", "dtype": "float32"}
    DiskCache.index[meta] = info
    with disable_onloading():
        cache["b"] = meta
    with pytest.raises(KeyError, match="nope"):
        cache["b"]
    assert cache["a"].shape == (4,)  # the cache still works


def test_disk_cache_header_offsets_past_the_file_raise(patched, tmp_path):
    """A safetensors header whose data_offsets point past the file: a clear error, no garbage."""
    cache, checkpoint = checkpoint_disk_cache(tmp_path, {"a": torch.randn(4)})
    header = {"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}
    blob = json.dumps(header).encode()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * 16)  # 16 of 4000 bytes
    meta = torch.empty(1000, device="meta")
    DiskCache.index[meta] = {"safetensors_file": str(bad), "weight_name": "w", "dtype": "float32"}
    with disable_onloading():
        cache["w"] = meta
    with pytest.raises((ValueError, RuntimeError)):
        cache["w"]
    assert cache["a"].shape == (4,)


def test_disk_update_offload_while_prefetch_in_flight(patched, tmp_path):
    """DiskCache.update_offload rewrites (truncates) the file a prefetch is still reading."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(1024, 1024)  # 4 MiB weight: a slow prefetch
    ref = {k: v.detach().clone() for k, v in linear.state_dict().items()}
    offload_module(linear, CPU, "disk", offload_dir=str(tmp_path))
    for _ in range(3):
        assert oc_ct.prefetch([linear], target=0) > 0
        new = torch.full((1024, 1024), 2.0)
        linear._parameters["weight"] = torch.nn.Parameter(new.clone(), requires_grad=False)  # update_offload
        with disable_offloading():
            assert torch.equal(linear.weight, new)
            assert torch.equal(linear.bias, ref["bias"])
        offcache.synchronize()
        ref_w = linear.weight
        assert torch.equal(ref_w, new)


def test_disk_delete_while_prefetch_in_flight(patched, tmp_path):
    """__delitem__ removes the file a prefetch still reads: no crash, later use of other weights fine."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(512, 512)
    bias = linear.bias.detach().clone()
    offload_module(linear, CPU, "disk", offload_dir=str(tmp_path))
    oc_ct.prefetch([linear], target=0)
    del linear._parameters["weight"]
    gc.collect()
    offcache.synchronize()
    assert torch.equal(linear.bias, bias)


def test_a_write_back_past_the_offload_folders_free_space_says_so_and_loses_nothing(patched, tmp_path, monkeypatch):
    """A disk full mid-run: the update that would not fit raises OffloadFolderFullError (an OSError, ENOSPC)
    naming the weight, the bytes and the folder before anything is written; the weight keeps its value and
    a later update that fits goes through."""
    import errno
    import shutil

    from offcache.weights import caches

    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 256)
    ref = linear.weight.detach().clone()
    offload_module(linear, CPU, "disk", offload_dir=str(tmp_path))
    real = shutil.disk_usage
    room = [256 * 256 * 4]  # free bytes the folder reports: less than the weight plus the margin
    monkeypatch.setattr(caches.shutil, "disk_usage", lambda p: real(p)._replace(free=room[0]))
    with pytest.raises(caches.OffloadFolderFullError) as exc:
        linear._parameters["weight"] = torch.nn.Parameter(torch.ones(256, 256), requires_grad=False)
    assert exc.value.errno == errno.ENOSPC and isinstance(exc.value, OSError)
    message = str(exc.value)
    assert "'weight'" in message and f"{256 * 256 * 4} bytes" in message and str(tmp_path) in message
    with disable_offloading():
        assert torch.equal(linear.weight, ref)  # nothing lost
    room[0] = 1 << 40
    linear._parameters["weight"] = torch.nn.Parameter(torch.ones(256, 256), requires_grad=False)
    with disable_offloading():
        assert torch.equal(linear.weight, torch.ones(256, 256))
