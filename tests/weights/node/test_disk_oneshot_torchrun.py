"""oneshot over a disk-offloaded checkpoint under torchrun (2 ranks, gloo): the node reads each checkpoint
byte from storage once, and its peak memory is one process's plus the other rank's own working set.

The same script (tests/weights/node/disk_oneshot_torchrun_script.py: ``patch_llmcompressor(weights=True)``,
``load_offloaded_model(device_map="auto_offload")`` with offcache's host limit at a quarter of the
checkpoint, FP8 oneshot on the sequential pipeline) runs once as one process and once as two torchrun
ranks, each in a fresh memory cgroup (its peak: every page charged once, page cache included), the
checkpoint's pages dropped from the page cache first and again between loading and calibration.

The per-rank working set is stated, not measured: a rank's resident memory once torch, transformers and
llm-compressor are imported (its interpreter and libraries, measured in the rank) plus WORKING_SET
(what oneshot's lazy imports, one subgraph's weights and activations and the allocator add). The model
is larger than WORKING_SET: a second copy of its weights in the node would break the bound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("llmcompressor")

from offcache.bench.pastram import drop_page_cache, worker_env  # noqa: E402
from offcache.engine import machine as _machine  # noqa: E402
from tests.engine.test_memory import memory_cgroup  # noqa: E402
from tests.weights.node.weights_node_worker import free_port  # noqa: E402

pytestmark = pytest.mark.slow

MiB = 1 << 20
SCRIPT = Path(__file__).with_name("disk_oneshot_torchrun_script.py")
WORKING_SET = 160 * MiB
LAYERS, HIDDEN, INTERMEDIATE = 24, 512, 2048  # 0.18 GiB of bf16 weights


def _peak(procs: str) -> int:
    folder = os.path.dirname(procs)
    for name in ("memory.peak", "memory.max_usage_in_bytes"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as f:
                return int(f.read().split()[0])
    pytest.skip("the memory cgroup reports no peak")


def _run(model: Path, offload: Path, ranks: int, env: dict) -> tuple[list[dict], int]:
    offload.mkdir()
    drop_page_cache(model)
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1",
                f"--master-port={free_port()}"] if ranks > 1 else [sys.executable]  # fmt: skip
    with memory_cgroup(8 << 30) as procs:
        script = f'echo $$ > {procs} && exec "$@"'
        out = subprocess.run(["sh", "-c", script, "sh", *launcher, str(SCRIPT), str(model), str(offload)], env=env,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        peak = _peak(procs)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in text.splitlines() if "RESULT " in line]
    assert len(results) == ranks, text[-4000:]
    return sorted(results, key=lambda r: r["rank"]), peak


def test_two_ranks_read_the_checkpoint_once_and_peak_at_one_process_plus_a_rank(tmp_path):
    if _machine.filesystem_type(str(tmp_path)) in _machine._MEMORY_FS:
        pytest.skip(f"{tmp_path} is on a memory file system: its pages are never read from storage")
    if not os.path.exists("/proc/self/io"):
        pytest.skip("no /proc/self/io")
    from offcache.bench.models import save_llama

    shape = dict(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=128)  # fmt: skip
    model = save_llama(tmp_path / "model", dtype=torch.bfloat16, **shape)
    checkpoint = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    env = worker_env()
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), OFFCACHE_HOST_LIMIT=str(checkpoint // 4))
    (one,), one_peak = _run(model, tmp_path / "off1", 1, env)
    pair, pair_peak = _run(model, tmp_path / "off2", 2, env)
    summary = {"checkpoint": checkpoint, "one": one, "one_peak": one_peak, "pair": pair, "pair_peak": pair_peak}
    print("MEASURED " + json.dumps(summary))

    assert one["placement"]["disk"] > checkpoint // 2, one["placement"]  # most of it on disk
    assert all(r["placement"] == one["placement"] for r in pair), summary
    # Loading reads the checkpoint once per node (the source rank loads). Calibration, its pages dropped
    # first, reads each disk-offloaded byte from storage once per node, not once per rank.
    disk = one["placement"]["disk"]
    assert 0.9 * checkpoint <= sum(r["read_loaded_bytes"] for r in pair) <= 1.25 * checkpoint, summary
    assert 0.9 * disk <= sum(r["read_calibration_bytes"] for r in pair) <= 1.25 * disk, summary
    # The node's peak: one process's, plus the second rank's own working set.
    assert checkpoint > WORKING_SET
    assert pair_peak <= one_peak + pair[1]["rss_imported"] + WORKING_SET, summary
