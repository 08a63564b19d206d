"""Issue 43: a model larger than a memory cgroup allows, through llm-compressor's oneshot and save.

A 0.5 GiB bf16 checkpoint is loaded with ``load_offloaded_model(device_map="auto_offload")``,
quantized (FP8 with static activation scales, calibrated, sequential pipeline) and saved with
``save_pretrained(save_compressed=True)``, in an 1100 MiB memory cgroup (importing torch and
llm-compressor takes ~0.8 GiB of it). llm-compressor alone completes there: its CPU weights stay
pages of the checkpoint's mapping, which the kernel reclaims under the limit. So must
``patch_llmcompressor(weights=True)``, with the same saved tensors, byte for byte, its weights placed
by offcache's host limit (a quarter of the cgroup's: about half the checkpoint on the CPU, the rest
read from the checkpoint's files as a disk offload) and said in one log line. (It was OOM-killed
while saving: offcache copied the mapped weights into anonymous memory, and the heap its host
copies left freed stayed resident.)
"""

from __future__ import annotations

import glob
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("llmcompressor")

from offcache.engine import machine as _machine  # noqa: E402
from offcache.weights.memory.file_backed import is_file_backed  # noqa: E402
from tests.engine.test_memory import memory_cgroup  # noqa: E402

pytestmark = pytest.mark.slow

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("past_ram_worker.py")
LIMIT = 1100 * MiB
LAYERS, HIDDEN, INTERMEDIATE = 16, 1024, 4096  # 0.47 GiB of bf16 weights


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFCACHE_") and k != "LOCAL_WORLD_SIZE"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def _drop_page_cache(folder: Path) -> None:
    """The checkpoint's pages out of the page cache, so that a run in a cgroup reads (and is charged) them."""
    for name in glob.glob(str(folder / "*.safetensors")):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _run_in_cgroup(model: Path, out: Path, mode: str, env: dict) -> subprocess.CompletedProcess:
    _drop_page_cache(model)
    with memory_cgroup(LIMIT) as procs:
        script = f'echo $$ > {procs} && exec "{sys.executable}" "{WORKER}" run "$0" "$1" "$2"'
        return subprocess.run(["sh", "-c", script, str(model), str(out), mode], env=env, capture_output=True,
                              text=True, timeout=600)  # fmt: skip


def _saved(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for name in sorted(glob.glob(str(folder / "*.safetensors"))):
        out.update(load_file(name))
    return out


def test_weights_oneshot_completes_where_llmcompressor_alone_does_with_the_same_checkpoint(tmp_path):
    if _machine.filesystem_type(str(tmp_path)) in _machine._MEMORY_FS:
        pytest.skip(f"{tmp_path} is on a memory file system: its pages are not reclaimable as a disk file's")
    env = _env()
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    model = tmp_path / "model"
    made = subprocess.run([sys.executable, str(WORKER), "make", str(model), str(LAYERS), str(HIDDEN),
                           str(INTERMEDIATE)], env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    runs = {}
    for mode in ("none", "weights"):
        out = _run_in_cgroup(model, tmp_path / mode, mode, env)
        phases = [line for line in out.stdout.splitlines() if line.startswith("phase")]
        runs[mode] = (out.returncode, phases)
        assert out.returncode == 0, f"{mode}: rc {out.returncode} (-9: OOM-killed) after {phases}\n{out.stderr[-3000:]}"
        if mode == "weights":  # the CPU's share: the host limit, a quarter of the cgroup's limit; the rest on disk
            said = [line for line in (out.stdout + out.stderr).splitlines() if "offcache weights placement:" in line]
            assert len(said) == 1 and "of the cgroup's limit 1153433600 bytes" in said[0], said or out.stderr[-3000:]
            assert " 0 bytes on disk" not in said[0], said[0]
    a, b = _saved(tmp_path / "none"), _saved(tmp_path / "weights")
    assert a.keys() == b.keys() and len(a) > 100
    assert any(t.dtype == torch.float8_e4m3fn for t in a.values())

    def same(x, y) -> bool:
        return x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))

    differ = [k for k in a if not same(a[k], b[k])]
    assert not differ, f"saved tensors differ from llm-compressor alone's: {differ[:5]}"


def test_a_checkpoint_mapping_is_file_backed_and_a_copy_is_not(tmp_path):
    from safetensors.torch import save_file

    if _machine.filesystem_type(str(tmp_path)) in _machine._MEMORY_FS:
        pytest.skip(f"{tmp_path} is on a memory file system")
    save_file({"w": torch.arange(1 << 20, dtype=torch.float32)}, str(tmp_path / "x.safetensors"))
    with open(tmp_path / "x.safetensors", "rb") as f:  # a private mapping, as safetensors makes
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    mapped = torch.frombuffer(mm, dtype=torch.uint8)
    assert is_file_backed(mapped) and is_file_backed(mapped[128:256])
    assert not is_file_backed(mapped.clone()) and not is_file_backed(torch.ones(3))
    assert not is_file_backed(torch.empty(0))


def _mapped(tmp_path, n: int = 1 << 16) -> torch.Tensor:
    """A float32 tensor of n values viewing a private mapping of a file (as safetensors maps a checkpoint)."""
    path = tmp_path / "w.bin"
    torch.arange(n, dtype=torch.float32).numpy().tofile(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mm, dtype=torch.float32)


def test_a_file_backed_weight_is_kept_as_is_and_onloaded_to_the_cpu_without_a_copy(patched, tmp_path):
    from offcache import engine as _engine
    from offcache.weights.compressed_tensors import OffcacheCPUCache

    if _machine.filesystem_type(str(tmp_path)) in _machine._MEMORY_FS:
        pytest.skip(f"{tmp_path} is on a memory file system")
    weight = torch.nn.Parameter(_mapped(tmp_path), requires_grad=True)
    cache = OffcacheCPUCache.from_mapping({"weight": weight, "anon": torch.ones(1 << 16)}, "cpu")
    assert cache.offloaded_values["weight"] is weight, "a checkpoint-backed weight was copied"
    assert _engine.is_offcache_tensor(cache.offloaded_values["anon"]), "an anonymous tensor is still the arena's"
    assert cache["weight"] is weight  # as CPUCache's onload: the tensor itself
    # An update writes the mapping in place (its pages become the process's own, as under CPUCache).
    cache["weight"] = torch.zeros(1 << 16)
    assert cache.offloaded_values["weight"] is weight and not bool(weight.detach().any())


def test_host_copies_return_the_freed_heap_every_trim_bytes(monkeypatch):
    from offcache.weights.memory import host_trim

    calls = []
    monkeypatch.setattr(host_trim, "_malloc_trim", lambda: calls.append)
    monkeypatch.setattr(host_trim, "_since", 0)
    host_trim.note(host_trim.TRIM_BYTES - 1)
    assert calls == []
    host_trim.note(1)
    assert calls == [0]
    host_trim.note(host_trim.TRIM_BYTES // 2)
    assert calls == [0]


def test_a_file_backed_weight_onloaded_to_a_device_is_copied_while_the_host_limit_allows(patched, tmp_path,
                                                                                         engine_config):  # fmt: skip
    """The arena copy (fast device transfers) where it fits the host limit; past it the mapping, never spilled."""
    from offcache import engine as _engine
    from offcache.weights.compressed_tensors import OffcacheCPUCache

    if _machine.filesystem_type(str(tmp_path)) in _machine._MEMORY_FS:
        pytest.skip(f"{tmp_path} is on a memory file system")
    weight = _mapped(tmp_path, 1 << 20)  # 4 MiB
    # "meta" stands for a device here: any onload device but the CPU takes the same path.
    engine_config(backend="host", host_limit="1MiB", disk_dir="none")
    kept = OffcacheCPUCache("meta").offload(weight)
    assert kept is weight and offcache_stats()["disk_bytes"] == 0
    engine_config(backend="host", host_limit="64MiB", disk_dir="none")
    copied = OffcacheCPUCache("meta").offload(weight)
    assert _engine.is_offcache_tensor(copied) and torch.equal(copied, weight)


def offcache_stats() -> dict:
    import offcache

    return offcache.stats()
