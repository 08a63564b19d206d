"""One oneshot over a disk-offloaded checkpoint, run under torchrun by tests/weights/node/test_disk_oneshot_torchrun.py:

    python -m torch.distributed.run --nproc-per-node N disk_oneshot_torchrun_script.py MODEL_DIR OFFLOAD_DIR
    python disk_oneshot_torchrun_script.py MODEL_DIR OFFLOAD_DIR   (one process, no torch.distributed)

Each rank (gloo) patches llm-compressor (``patch_llmcompressor(weights=True)``), loads MODEL_DIR with
``load_offloaded_model(device_map="auto_offload")`` (the CPU's share: OFFCACHE_HOST_LIMIT; the rest on
disk, its links in OFFLOAD_DIR, which the ranks share) and runs ``oneshot`` (FP8 with static activation
scales, calibrated, the sequential pipeline; llm-compressor splits the samples between the ranks). It
prints one ``RESULT <json>`` line: the bytes it read from storage (/proc/self/io) while loading and
while calibrating (the checkpoint's pages dropped from the page cache in between), its resident memory
after the imports and at its peak (VmHWM), and the weights' placement.
"""

from __future__ import annotations

import json
import os
import sys


def _io_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _drop_page_cache(folder: str) -> None:
    import glob

    for name in glob.glob(os.path.join(folder, "*.safetensors")):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(model_dir: str, offload_dir: str) -> None:
    import datasets
    import torch
    import torch.distributed as dist
    import transformers
    from compressed_tensors.offload import load_offloaded_model
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    import offcache
    from offcache.weights.memory.placement import placement

    if "RANK" in os.environ:  # under torchrun; else one process, as a user runs it without
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    offcache.patch_llmcompressor(weights=True)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(4, 128, (16,), generator=g).tolist() for _ in range(4)]
    dataset = datasets.Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * 16] * 4})
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    rss_imported = _status("VmRSS")
    if dist.is_initialized():
        dist.barrier()
    read = _io_read_bytes()
    with load_offloaded_model():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16, device_map="auto_offload", offload_folder=offload_dir
        )
    where = placement(model)
    # Loading read the whole checkpoint (transformers does): its pages out of the page cache, so that
    # calibration reads what it needs from storage, as when the checkpoint is larger than memory.
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        _drop_page_cache(model_dir)
    if dist.is_initialized():
        dist.barrier()
    read_loaded = _io_read_bytes() - read
    oneshot(
        model=model, tokenizer=tokenizer, dataset=dataset,
        recipe=QuantizationModifier(targets="Linear", scheme="FP8", ignore=["lm_head"]),
        num_calibration_samples=4, max_seq_length=16, pipeline="sequential", shuffle_calibration_samples=False,
    )  # fmt: skip
    result = {
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "world": dist.get_world_size() if dist.is_initialized() else 1,
        "read_bytes": _io_read_bytes() - read, "read_loaded_bytes": read_loaded,
        "read_calibration_bytes": _io_read_bytes() - read - read_loaded,
        "rss_imported": rss_imported, "hwm": _status("VmHWM"), "placement": where,
        "page_cache_reads": offcache.stats().get("weight_page_cache_bytes", 0),
        "file_read_bytes": offcache.stats()["file_read_bytes"],
    }  # fmt: skip
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
