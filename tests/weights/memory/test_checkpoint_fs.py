"""A disk-offloaded checkpoint on a network or memory file system: one warning naming the folder, the file
system, the bytes and the expected cost; on a local disk, none."""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch

from offcache.engine import machine
from offcache.weights.memory import checkpoint_fs

MiB = 1 << 20


def test_network_memory_and_local_file_systems(monkeypatch):
    kinds = {"/ckpt/nfs": "nfs4", "/ckpt/fuse": "fuse.gcsfuse", "/ckpt/shm": "tmpfs", "/ckpt/local": "ext4"}
    monkeypatch.setattr(machine, "filesystem_type", lambda path: kinds[path])
    said = checkpoint_fs.messages({"/ckpt/nfs": 2500 * MiB, "/ckpt/fuse": MiB, "/ckpt/shm": 3 * MiB, "/ckpt/local": 9})
    assert len(said) == 3, said  # the local disk says nothing
    fuse, nfs, shm = said  # sorted by folder
    assert "/ckpt/nfs" in nfs and "(nfs4)" in nfs and f"{2500 * MiB} bytes" in nfs
    assert f"about {2500 * MiB / 1.25e9:.1f} s per pass at 10 Gb/s" in nfs
    assert "/ckpt/fuse" in fuse and "network file system (fuse.gcsfuse)" in fuse
    assert "/ckpt/shm" in shm and "memory file system (tmpfs)" in shm and "frees nothing" in shm


def test_noted_bytes_are_summed_per_folder_and_taken_once(monkeypatch, tmp_path):
    monkeypatch.setattr(machine, "filesystem_type", lambda path: "nfs")
    checkpoint_fs.note(str(tmp_path / "a.safetensors"), 100)
    checkpoint_fs.note(str(tmp_path / "b.safetensors"), 23)
    said = checkpoint_fs.take_messages()
    assert len(said) == 1 and "123 bytes" in said[0] and str(tmp_path) in said[0]
    assert checkpoint_fs.take_messages() == []


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or machine.filesystem_type("/dev/shm") != "tmpfs",
                    reason="no tmpfs at /dev/shm")  # fmt: skip
def test_a_checkpoint_on_tmpfs_loaded_with_a_disk_share_warns(tiny_model_dir, engine_config, tmp_path):
    pytest.importorskip("llmcompressor")
    transformers = pytest.importorskip("transformers")
    from compressed_tensors.offload import load_offloaded_model

    import offcache
    from offcache.weights.memory import placement

    shm = f"/dev/shm/offcache-test-{os.getpid()}"
    shutil.copytree(tiny_model_dir, shm)
    (tmp_path / "tier").mkdir()
    engine_config(backend="host", host_limit="512KiB", disk_dir=str(tmp_path / "tier"))
    offcache.patch_llmcompressor(weights=True)
    try:
        with warnings.catch_warnings(record=True) as caught, load_offloaded_model():
            warnings.simplefilter("always")
            model = transformers.AutoModelForCausalLM.from_pretrained(
                shm, dtype=torch.float32, device_map="auto_offload"
            )
        disk = placement.placement(model)["disk"]
    finally:
        offcache.unpatch_llmcompressor()
        shutil.rmtree(shm, ignore_errors=True)
    said = [str(w.message) for w in caught if w.category is checkpoint_fs.CheckpointFileSystemWarning]
    assert disk > 0 and len(said) == 1, (disk, said)
    assert shm in said[0] and "(tmpfs)" in said[0]
