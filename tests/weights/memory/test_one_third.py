"""A checkpoint three times the memory limit: ``patch_llmcompressor(weights=True)`` loads it with
``load_offloaded_model(device_map="auto_offload")``, quantizes it (FP8 with static activation scales,
calibrated, sequential pipeline) and saves it compressed, in a memory cgroup of a third of its bytes.

The smallest size this machine allows at that ratio: importing torch and llm-compressor takes about
0.8 GiB, so the cgroup is 1024 MiB and the checkpoint 3.05 GiB of bf16. At that ratio llm-compressor
alone is OOM-killed while compressing the model for saving (it plans every weight onto the CPU), so the
saved checkpoint is checked here against its own shape and dtypes; byte-for-byte equality with
llm-compressor alone without a limit is measured at 4.22 GiB in 1440 MiB
(benchmarks/results/2026-12-08-cpu-2core-past-ram-one-third.md), and in test_past_ram.py where both
complete.
"""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("llmcompressor")

from offcache.bench import pastram  # noqa: E402
from offcache.bench.cgroup import NoCgroupError  # noqa: E402
from offcache.engine import machine as _machine  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
LIMIT = 1024 * MiB
SIZE = (26, 2048, 8192)  # layers, hidden, intermediate: 3.05 GiB of bf16 weights


def test_a_checkpoint_three_times_the_cgroup_is_quantized_and_saved_inside_it(tmp_path):
    if _machine.filesystem_type(str(tmp_path)) in _machine.MEMORY_FS:
        pytest.skip(f"{tmp_path} is on a memory file system: its pages are not reclaimable as a disk file's")
    if shutil.disk_usage(tmp_path).free < 10 * GiB:
        pytest.skip(f"{tmp_path} has under 10 GiB free: the checkpoint, its offload files and the saved model")
    env = pastram.worker_env(str(tmp_path / "xdg"))
    model = tmp_path / "model"
    pastram.make_model(model, SIZE, env)
    size = pastram.checkpoint_bytes(model)
    assert size >= 3 * LIMIT, f"the checkpoint ({size} bytes) is not three times the limit"
    try:
        run = pastram.run_one(model, tmp_path / "out", "weights", env, LIMIT, timeout=1500)
    except NoCgroupError as exc:
        pytest.skip(str(exc))
    assert run["completed"], f"{run['outcome']} after {run['phases']}\n{run['stderr_tail']}"
    assert run["oom_kills"] == 0 and run["max_anon_bytes"] < LIMIT, run["max_anon_bytes"]
    said = run["placement"]  # the CPU's share: a quarter of the cgroup's limit at most, the rest on disk
    assert said and "of the cgroup's limit" in said, said
    cpu_bytes = int(said.split(" bytes", 1)[0])
    disk_bytes = int(said.split(" on the CPU, ", 1)[1].split(" bytes", 1)[0])
    assert cpu_bytes <= LIMIT // 4 and cpu_bytes + disk_bytes >= size * 0.99, said
    out = pastram.saved(tmp_path / "out")
    fp8 = [k for k, t in out.items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) == 7 * SIZE[0], f"{len(fp8)} FP8 weights saved, expected every Linear's but lm_head"
    assert sum(t.nbytes for t in out.values()) < size * 0.6, "the saved model is not the compressed one"
