"""Weights placed on disk by ``load_offloaded_model(device_map="auto_offload")``, under
``patch_llmcompressor(weights=True)``: read from the checkpoint's own files, once per calibration pass;
what calibration changes written back, and nothing else copied.

A small bf16 Llama checkpoint is loaded with offcache's host limit at a quarter of its bytes (the CPU's
share; the rest on disk, in offcache's default offload folder under its disk tier) and quantized with
GPTQ W4A16 (which rewrites every Linear weight) on the sequential pipeline. Every engine ``fetch_file``
is tallied by file and byte offset.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("llmcompressor")
transformers = pytest.importorskip("transformers")

import offcache  # noqa: E402
from offcache import engine as _engine  # noqa: E402
from offcache.bench import checkpoint_read  # noqa: E402
from offcache.engine import machine as _machine  # noqa: E402
from offcache.weights.bookkeeping import WEIGHTS  # noqa: E402
from offcache.weights.files import header, locate  # noqa: E402
from tests.helpers import calibration_set  # noqa: E402

pytestmark = pytest.mark.slow


def _checkpoint(folder: Path) -> Path:
    from offcache.bench.models import save_llama

    return save_llama(folder, dtype=torch.bfloat16, num_hidden_layers=4, hidden_size=256, intermediate_size=1024,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=128)  # fmt: skip


def _disk_caches(model):
    from compressed_tensors.offload.cache import DiskCache

    for module in model.modules():
        for cache in (module._parameters, module._buffers):
            if isinstance(cache, DiskCache):
                yield cache


def test_each_disk_byte_is_read_once_per_pass_and_only_changed_weights_are_written(tmp_path, engine_config,
                                                                                   monkeypatch):  # fmt: skip
    from compressed_tensors.offload import load_offloaded_model
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    if _machine.filesystem_type(str(tmp_path)) in _machine._MEMORY_FS:
        pytest.skip(f"{tmp_path} is on a memory file system")
    model_dir = _checkpoint(tmp_path / "model")
    files = sorted(model_dir.glob("*.safetensors"))
    checkpoint_bytes = sum(f.stat().st_size for f in files)
    tier = tmp_path / "tier"
    tier.mkdir()
    engine_config(backend="host", host_limit=checkpoint_bytes // 4, disk_dir=str(tier))

    # (real file, offset) -> times fetched, by the subgraphs (their onloads and prefetches: the
    # calibration pass) and outside them
    reads: dict[tuple[str, int], int] = {}
    outside: dict[tuple[str, int], int] = {}
    fetched_bytes: dict[str, int] = {}
    real_fetch_file = _engine.fetch_file

    def counting_fetch_file(path, items, device, wait=True):
        real = os.path.realpath(path)
        tally = reads if WEIGHTS.current is not None else outside
        for offset, shape, dtype in items:
            tally[(real, offset)] = tally.get((real, offset), 0) + 1
            key = real if tally is reads else "outside"
            fetched_bytes[key] = fetched_bytes.get(key, 0) + torch.Size(shape).numel() * dtype.itemsize
        return real_fetch_file(path, items, device, wait)

    monkeypatch.setattr(_engine, "fetch_file", counting_fetch_file)
    torch.manual_seed(0)
    offcache.patch_llmcompressor(weights=True)
    try:
        with load_offloaded_model():
            model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                                      device_map="auto_offload")  # fmt: skip
        from offcache.weights.memory.placement import placement

        where = placement(model)
        assert where["disk"] > checkpoint_bytes // 2 and where["cpu"] > 0, where
        caches = list(_disk_caches(model))
        disk_entries = {id(t): dict(c.index[t]) for c in caches for t in c.offloaded_values.values() if t is not None}
        folder = Path(os.path.dirname(next(iter(disk_entries.values()))["safetensors_file"]))
        # Loaded: the offload folder holds links to the checkpoint's files, no bytes of its own.
        assert all(os.path.islink(folder / n) for n in os.listdir(folder)), os.listdir(folder)
        assert {os.path.realpath(folder / n) for n in os.listdir(folder)} <= {str(f.resolve()) for f in files}
        before = offcache.stats()
        oneshot(model=model, tokenizer=transformers.AutoTokenizer.from_pretrained(model_dir),
                dataset=calibration_set(4, 16), recipe=GPTQModifier(targets="Linear", scheme="W4A16",
                                                                    ignore=["lm_head"]),
                num_calibration_samples=4, max_seq_length=16, pipeline="sequential",
                shuffle_calibration_samples=False)  # fmt: skip
        after = offcache.stats()
    finally:
        offcache.unpatch_llmcompressor()

    # (a) One calibration pass read every disk-offloaded checkpoint tensor exactly once: the bytes the
    # engine read from the checkpoint's files are the disk share's bytes, not twice them. Outside the
    # subgraphs llm-compressor itself reads the embeddings' and the lm_head's weights, nothing else.
    real_files = {str(f.resolve()) for f in files}
    names = ("lm_head.weight", "model.embed_tokens.weight")
    ends = {(real, locate(real, name)[0]) for real in real_files for name in names if name in header(real)[0]}
    assert set(outside) <= ends, sorted(outside.items())
    from_checkpoint = {k: n for k, n in reads.items() if k[0] in real_files}
    assert from_checkpoint and set(from_checkpoint.values()) == {1}, sorted(from_checkpoint.items())[:5]
    assert sum(fetched_bytes[f] for f in real_files if f in fetched_bytes) == where["disk"]
    engine_read = after["file_read_bytes"] - before["file_read_bytes"] - fetched_bytes.pop("outside", 0)
    requested = sum(fetched_bytes.values())
    # The engine's own count: the same bytes, once (it reads whole 4 KiB blocks and merges spans across
    # gaps under 1 MiB: a little past them at most), not twice.
    assert 0.9 * requested <= engine_read <= requested + sum(reads.values()) * 8192 + (2 << 20) * len(fetched_bytes)

    # (b) Written back: a file in the offload folder for each weight calibration changed (GPTQ: the
    # Linear weights) or added (their quantization parameters), as big as that tensor, and links to
    # the checkpoint for the rest. No copy of the model.
    written, changed = 0, 0
    for cache in caches:
        for meta in cache.offloaded_values.values():
            if meta is None:
                continue
            path = cache.index[meta]["safetensors_file"]
            if os.path.islink(path):
                assert os.path.realpath(path) in real_files
                continue
            changed += meta.nbytes
            written += os.path.getsize(path)
    assert changed > 0
    assert written <= changed + 1024 * len(os.listdir(folder)), (written, changed)  # each file's header
    regular = sum(os.path.getsize(folder / n) for n in os.listdir(folder) if not os.path.islink(folder / n))
    assert regular == written and regular < where["disk"], (regular, where)


def test_a_cold_checkpoint_file_is_read_from_storage_once(tmp_path, engine_config):
    """The engine's cold read of a checkpoint file asks the disk for its bytes once (O_DIRECT)."""
    if _machine.filesystem_type(str(tmp_path)) in _machine._MEMORY_FS:
        pytest.skip(f"{tmp_path} is on a memory file system")
    if not checkpoint_read.storage_read_bytes() and not os.path.exists("/proc/self/io"):
        pytest.skip("no /proc/self/io")
    engine_config(backend="host")
    paths = checkpoint_read.write_checkpoint(str(tmp_path), 64 << 20, hidden=512, shard=32 << 20)
    checkpoint_read.drop_page_cache(paths)
    seconds, nbytes, counters = checkpoint_read.engine_read(paths)
    assert counters["file_read_bytes"] >= nbytes
    # Not 2x: the page-cache probe before each O_DIRECT piece (cachestat) reads nothing and starts no readahead.
    assert 0.9 * nbytes <= counters["storage_read_bytes"] <= 1.1 * nbytes, counters["storage_read_bytes"] / nbytes
