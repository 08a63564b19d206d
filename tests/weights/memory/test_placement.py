"""Issue 43, item 1: load_offloaded_model(device_map="auto_offload")'s CPU share follows offcache's host
limit (the cgroup's share by default), said in one log line; a disk share needs no offload_folder."""

from __future__ import annotations

import os

import pytest
import torch

from offcache import engine as offcache_engine

pytest.importorskip("llmcompressor")
transformers = pytest.importorskip("transformers")

from offcache.weights.memory import placement  # noqa: E402

MiB = 1 << 20


def _load(model_dir, **kwargs):
    from compressed_tensors.offload import load_offloaded_model

    with load_offloaded_model():
        return transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, device_map="auto_offload", **kwargs
        )


def test_cpu_share_is_the_smaller_of_compressed_tensors_and_the_host_limit(engine_config):
    engine_config(backend="host", host_limit="3MiB", disk_dir="none")
    share, why = placement.cpu_share(10 * MiB)
    assert share == 3 * MiB and why.startswith("offcache's host limit 3145728 bytes") and "set to 3MiB" in why
    share, why = placement.cpu_share(2 * MiB)
    assert share == 2 * MiB and why.startswith("compressed-tensors' share 2097152 bytes")
    assert placement.cpu_share(-5)[0] == 0  # available less extra_cpu_mem below zero: nothing on the CPU


def test_outside_a_cgroup_the_default_host_limit_leaves_compressed_tensors_share(engine_config, monkeypatch):
    """No memory cgroup and no host limit given: the host's available memory is the bound, and the peer's
    own share stands (a default quarter of RAM would send to disk what compressed-tensors keeps in memory).
    In a cgroup smaller than RAM, the default host limit bounds it."""
    from offcache.engine import machine

    engine_config(backend="host", disk_dir="none")
    host = int(offcache_engine.settings()["host_limit"])
    monkeypatch.setattr(machine, "cgroup_memory_limit", lambda: None)
    share, why = placement.cpu_share(host * 3)
    assert share == host * 3 and "no memory cgroup" in why, why
    monkeypatch.setattr(machine, "cgroup_memory_limit", lambda: machine.total_ram_bytes() // 2)
    share, why = placement.cpu_share(machine.total_ram_bytes())
    assert share == host and why.startswith("offcache's host limit"), why


def test_auto_offload_under_a_small_host_limit_puts_the_rest_on_disk_and_says_so(tiny_model_dir, engine_config,
                                                                                 tmp_path, monkeypatch):  # fmt: skip
    from loguru import logger

    import offcache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    (tmp_path / "tier").mkdir()
    engine_config(backend="host", host_limit="512KiB", disk_dir=str(tmp_path / "tier"))
    total = sum(p.nbytes for p in transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert total > 2 * (MiB // 2)
    lines: list[str] = []
    handler = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    offcache.patch_llmcompressor(weights=True)
    try:
        model = _load(tiny_model_dir)  # no offload_folder: offcache's, under its disk tier
        where = placement.placement(model)
        kinds = {type(m._parameters).__name__ for m in model.modules()}
    finally:
        offcache.unpatch_llmcompressor()
        logger.remove(handler)
    said = [line for line in lines if line.startswith("offcache weights placement:")]
    assert len(said) == 1, lines
    assert where["cpu"] <= MiB // 2 and where["disk"] >= total - MiB // 2
    assert where["cpu"] + where["disk"] >= total  # the parameters, and the buffers
    assert f"{where['cpu']} bytes" in said[0] and f"{where['disk']} bytes" in said[0]
    assert "offcache's host limit 524288 bytes" in said[0]
    assert "OffcacheDiskCache" in kinds
    folder = tmp_path / "tier" / f"weights-{os.getpid()}"
    assert folder.is_dir() and any(os.path.islink(folder / f) for f in os.listdir(folder))


def test_unpatched_load_is_compressed_tensors_own(tiny_model_dir):
    import compressed_tensors.offload.load as load

    import offcache

    offcache.patch_llmcompressor(weights=True)
    offcache.unpatch_llmcompressor()
    assert load._get_cpu_memory.__module__ == "compressed_tensors.offload.load"
    assert load.from_accelerate.__module__.startswith("compressed_tensors")


def test_no_default_offload_folder_without_a_disk_tier_or_across_ranks(engine_config, tmp_path, monkeypatch):
    monkeypatch.setattr(placement, "_folder", [])
    engine_config(backend="host", disk_dir="none")
    assert placement.default_offload_dir() is None
    engine_config(backend="host", disk_dir=str(tmp_path))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    assert placement.default_offload_dir() is None  # each rank would make its own
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    assert placement.default_offload_dir() == str(tmp_path / f"weights-{os.getpid()}")
    assert (tmp_path / f"weights-{os.getpid()}").is_dir()
