"""Host instructions per ``update()`` of the activation cache, counted by valgrind's callgrind.

Each implementation runs in a child process under ``valgrind --tool=callgrind`` twice, storing
SMALL and then LARGE new 5-tensor batches (hidden states 1x8x16, a bool mask 1x1x8x8, position
ids, a cos/sin tuple) to the CPU; the difference of the two totals over LARGE - SMALL is the work
of one batch, free of start-up. The "values" child makes the same batches and stores nothing:
what the others do beyond it is the work of ``update()`` itself. The engine's disk folder is in
a new user's state (not made yet). Instructions count every thread (callgrind runs them one at a
time), so a copy thread's work is in them too; they do not depend on the machine's load.

    python -m offcache.bench hostwork [--tiny]

Without valgrind the section says so and measures nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

IMPLS = ("offcache", "llmcompressor", "values")


def batch(torch):
    s = 8
    return {
        "hidden_states": torch.randn(1, s, 16),
        "attention_mask": torch.ones(1, 1, s, s, dtype=torch.bool),
        "position_ids": torch.arange(s)[None],
        "position_embeddings": (torch.randn(1, s, 4), torch.randn(1, s, 4)),
    }


def child(impl: str, n: int) -> None:
    """Store n new batches with `impl` (the process callgrind counts)."""
    import torch

    torch.set_num_threads(1)
    if impl == "offcache":
        import offcache

        cache = offcache.IntermediatesCache.empty(n + 1, "cpu")
    elif impl == "llmcompressor":
        from llmcompressor.pipelines.cache import IntermediatesCache

        cache = IntermediatesCache.empty(n + 1, "cpu")
    else:
        cache = None
    cache is None or cache.update(0, batch(torch))  # the first store's one-time set-up, in both runs
    batches = [batch(torch) for _ in range(n)]
    for i, values in enumerate(batches):
        if cache is not None:
            cache.update(i + 1, values)
    if impl == "offcache":
        import offcache

        offcache.synchronize()


def count(impl: str, n: int) -> int:
    """Instructions callgrind collects for child(impl, n)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={os.path.join(tmp, 'out')}", sys.executable,
               "-m", "offcache.bench.host_work", "--child", impl, str(n)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        found = re.search(r"Collected\s*:\s*(\d+)", proc.stderr)
        if proc.returncode != 0 or not found:
            raise RuntimeError(f"callgrind run of {impl} x{n} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return int(found.group(1))


def run_host_work(ctx) -> list[dict]:
    """Rows: instructions per update() for each implementation, and the ratio to llm-compressor's."""
    if shutil.which("valgrind") is None:
        print("hostwork: valgrind is not installed; nothing measured", file=sys.stderr)
        return []
    small, large = (20, 120) if ctx.tiny else (200, 1200)
    impls = [i for i in IMPLS if i != "llmcompressor" or _has_llmcompressor()]
    per = {i: (count(i, large) - count(i, small)) / (large - small) for i in impls}
    rows = []
    for impl in impls:
        row = {"impl": impl, "direction": "update_batch_of_5", "offload_device": "cpu", "batches": [small, large],
               "instructions_per_batch": per[impl]}  # fmt: skip
        if impl != "values":
            row["update_instructions_per_batch"] = per[impl] - per["values"]
        rows.append(row)
    if "llmcompressor" in per:
        ours = per["offcache"] - per["values"]
        theirs = per["llmcompressor"] - per["values"]
        rows[0]["ratio_to_llmcompressor"] = ours / theirs
    return rows


def _has_llmcompressor() -> bool:
    import importlib.util

    return importlib.util.find_spec("llmcompressor") is not None


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--child":
    child(sys.argv[2], int(sys.argv[3]))
