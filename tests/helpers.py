"""Deep comparison of cached values and the value shapes the tests store."""

import os
import subprocess
import sys
from collections import OrderedDict, namedtuple
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path

import torch

Pair = namedtuple("Pair", ["cos", "sin"])


@dataclass(frozen=True)
class Frozen:
    hidden: torch.Tensor
    extra: object = None


@dataclass
class Outer:
    inner: Frozen
    items: list
    scale: float = 1.0


def assert_same(got, want, path="value"):
    """Equal structure, container types, dtypes, shapes and bits."""
    assert type(got) is type(want), f"{path}: {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{path}: {got.dtype}{tuple(got.shape)}"
        assert got.device == want.device, f"{path}: device {got.device} != {want.device}"
        assert torch.equal(
            got.cpu().view(torch.uint8) if want.dtype == torch.bool else got.cpu(),
            want.cpu().view(torch.uint8) if want.dtype == torch.bool else want.cpu(),
        ), path
    elif is_dataclass(want):
        for f in fields(want):
            assert_same(getattr(got, f.name), getattr(want, f.name), f"{path}.{f.name}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, dict):
        assert list(got.keys()) == list(want.keys()), path
        for k in want:
            assert_same(got[k], want[k], f"{path}[{k!r}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def snapshot(value):
    """A deep copy with cloned tensors: what the cache must give back later."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if is_dataclass(value) and not isinstance(value, type):
        return type(value)(**{f.name: snapshot(getattr(value, f.name)) for f in fields(value)})
    if isinstance(value, tuple):
        items = [snapshot(v) for v in value]
        return type(value)(*items) if hasattr(type(value), "_fields") else type(value)(items)
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    if isinstance(value, dict):
        return type(value)((k, snapshot(v)) for k, v in value.items())
    return value


CPU = torch.device("cpu")

# The tiny random Llama the oneshot tests quantize, and its calibration rows.
TINY_VOCAB = 96


def save_tiny_llama(folder):
    from offcache.bench.models import save_llama

    return save_llama(
        folder, vocab_size=TINY_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip


def calibration_set(n: int, length: int):
    """n rows of `length` random token ids (seeded), as a datasets.Dataset."""
    import datasets

    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(4, TINY_VOCAB, (length,), generator=g).tolist() for _ in range(n)]
    return datasets.Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * length] * n})


__all__ = [
    "CPU", "TINY_VOCAB", "Frozen", "OrderedDict", "Outer", "Pair", "assert_same", "calibration_set",
    "save_tiny_llama", "snapshot",
]  # fmt: skip


def checkpoint_disk_cache(folder, weights: dict, dtypes: dict | None = None):
    """An OffloadCache for "disk" (the patched class, if patched) whose entries are symlinks into
    one checkpoint file, as compressed-tensors' from_accelerate makes them: `weights` saved to
    folder/model.safetensors, each entered through DiskCache.create_checkpoint_symlink with the
    index dtype dtypes[name] (default: the tensor's own). Returns (cache, checkpoint path)."""
    from compressed_tensors.offload import disable_onloading
    from compressed_tensors.offload.cache import DiskCache, OffloadCache
    from safetensors.torch import save_file

    checkpoint = folder / "model.safetensors"
    save_file(weights, str(checkpoint))
    offload_dir = folder / "offload"
    offload_dir.mkdir()
    cache = OffloadCache.cls_from_device("disk")(torch.device("cpu"), offload_dir=str(offload_dir))
    for name, tensor in weights.items():
        dtype = (dtypes or {}).get(name, tensor.dtype)
        meta = torch.empty(tensor.shape, dtype=dtype, device="meta")
        info = {"safetensors_file": str(checkpoint), "weight_name": name, "dtype": str(dtype).removeprefix("torch.")}
        DiskCache.create_checkpoint_symlink(meta, info, str(offload_dir))
        with disable_onloading():
            cache[name] = meta
    return cache, checkpoint


def random_file(path, nbytes: int, seed: int = 0):
    """Writes `nbytes` random bytes (numpy's generator, `seed`) to `path`; returns them (uint8 array)."""
    import numpy as np

    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    data.tofile(path)
    return data


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes, as written (any dtype)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def child_pythonpath(*first: str) -> str:
    """PYTHONPATH for a child interpreter: `first`, then this one's PYTHONPATH with every entry made absolute.

    The overlays (scripts/test.sh: ``PYTHONPATH=.venv-tf-newest``) are relative to the checkout's root; a
    child started in another directory, or with PYTHONPATH replaced, would import the pinned peer instead
    of the overlay's and test the wrong version without a word.
    """
    inherited = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([str(p) for p in first] + inherited)


def run_with_this_checkout(script: str, cwd, timeout: float) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter in `cwd`, importing this checkout's offcache first."""
    root = str(Path(__file__).resolve().parent.parent)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": child_pythonpath(root)})  # fmt: skip


def gpu_memory_fraction(workers: int | None = None) -> float:
    """The share of each GPU's memory that one test process may take: 0.9 of it split between the pytest-xdist
    workers sharing the GPU (PYTEST_XDIST_WORKER_COUNT; one process: 0.9). On the H200, one test that filled
    the GPU (132.8 of 139.8 GiB) beside 7 workers made 4 of their tests fail out of memory."""
    if workers is None:
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    return 0.9 / max(1, workers)


def cap_gpu_memory(device=None) -> None:
    """Caps this process's caching allocator at gpu_memory_fraction() of `device` (default: every visible GPU).
    tests/conftest.py does it before the first gpu-marked test; a test that sets a lower cap of its own puts
    this one back afterwards (never 1.0: the whole GPU is the other workers' too)."""
    for d in range(torch.cuda.device_count()) if device is None else [device]:
        torch.cuda.set_per_process_memory_fraction(gpu_memory_fraction(), d)
