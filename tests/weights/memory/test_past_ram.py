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

import mmap

import pytest
import torch

pytest.importorskip("llmcompressor")

from offcache.bench import pastram  # noqa: E402
from offcache.bench.cgroup import NoCgroupError  # noqa: E402
from offcache.engine import machine as _machine  # noqa: E402
from offcache.weights.memory.file_backed import is_file_backed  # noqa: E402

MiB = 1 << 20
LIMIT = pastram.LIMIT  # 1100 MiB
LAYERS, HIDDEN, INTERMEDIATE = pastram.SIZE  # 16, 1024, 4096: 0.47 GiB of bf16 weights


@pytest.fixture(scope="module")
def past_ram(tmp_path_factory) -> dict:
    """llm-compressor alone, then weights=True, each in a fresh 1100 MiB cgroup (offcache.bench.pastram's runs, sampled
    as they run), and the planner's plan of the same run: made once for this module's tests."""
    tmp = tmp_path_factory.mktemp("past-ram")
    if _machine.filesystem_type(str(tmp)) in _machine._MEMORY_FS:
        pytest.skip(f"{tmp} is on a memory file system: its pages are not reclaimable as a disk file's")
    env = pastram.worker_env(str(tmp / "xdg"))
    model = tmp / "model"
    pastram.make_model(model, (LAYERS, HIDDEN, INTERMEDIATE), env)
    runs = {}
    try:
        for mode in ("none", "weights"):
            runs[mode] = pastram.run_one(model, tmp / mode, mode, env, LIMIT)
    except NoCgroupError as exc:
        pytest.skip(str(exc))
    return {"tmp": tmp, "runs": runs, "plan": pastram.plan(model, LIMIT, env)}


def test_weights_oneshot_completes_where_llmcompressor_alone_does_with_the_same_checkpoint(past_ram):
    tmp, runs = past_ram["tmp"], past_ram["runs"]
    for mode, run in runs.items():
        assert run["completed"], f"{mode}: {run['outcome']} after {run['phases']}\n{run['stderr_tail']}"
    # The CPU's share: the host limit, a quarter of the cgroup's limit; the rest on disk.
    said = runs["weights"]["placement"]
    assert said and "of the cgroup's limit 1153433600 bytes" in said, said
    assert not said.startswith("0 bytes") and " 0 bytes on disk" not in said, said
    a, b = pastram.saved(tmp / "none"), pastram.saved(tmp / "weights")
    assert a.keys() == b.keys() and len(a) > 100
    assert any(t.dtype == torch.float8_e4m3fn for t in a.values())
    differ = pastram.differing(a, b)
    assert not differ, f"saved tensors differ from llm-compressor alone's: {differ[:5]}"


def test_the_planners_peak_and_disk_reads_are_the_measured_ones_within_the_tolerance(past_ram):
    """python -m offcache.plan --offload-weights --memory-limit 1100MiB for the same checkpoint and calibration set:
    its placement is the run's log line, its expected peak an upper bound of the measured anonymous memory within
    pastram.PEAK_TOLERANCE, and the checkpoint bytes it says a cold pass reads the measured reads of loading and
    calibration within pastram.READ_TOLERANCE."""
    p, run = past_ram["plan"], past_ram["runs"]["weights"]
    assert "error" not in p, p
    o = p["offload"]
    said = run["placement"]
    assert said.startswith(f"{o['cpu_bytes']} bytes") and f", {o['disk_bytes']} bytes" in said, (said, o)
    compared = pastram.compare(p, run)
    assert not pastram.within_tolerance(compared), compared


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
