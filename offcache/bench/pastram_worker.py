"""One past-RAM oneshot, run as a script (in a memory cgroup, by ``python -m offcache.bench pastram`` and
tests/weights/memory/test_past_ram.py):

    python -m offcache.bench.pastram_worker make MODEL_DIR LAYERS HIDDEN INTERMEDIATE
    python -m offcache.bench.pastram_worker run MODEL_DIR OUT_DIR MODE [fp8|gptq] [STATS_FILE]

`make` saves a random bf16 Llama checkpoint. `run` loads MODEL_DIR with compressed-tensors'
``load_offloaded_model(device_map="auto_offload")``, patches llm-compressor per MODE ("none":
llm-compressor alone; "acts": ``patch_llmcompressor()``; "weights": ``patch_llmcompressor(weights=True)``),
runs ``oneshot`` (sequential pipeline, FP8 with static activation scales or GPTQ W4A16, calibrated, on
SAMPLES samples of SEQ_LEN tokens) and saves the result with ``save_pretrained(save_compressed=True)``
into OUT_DIR. It prints one line per phase ("phase imported", "phase loaded", "phase calibrated", "phase
saved", each with the process's RssAnon and RssFile) so that a kill says where it happened. With
STATS_FILE, a thread appends a JSON line there every 0.1 s: the time, RssAnon, and (offcache patched)
offcache's host bytes (pinned reserved + pageable) and its disk tier's bytes.
"""

from __future__ import annotations

import json
import sys
import threading
import time

SAMPLES, SEQ_LEN = 4, 16  # the calibration set (the planner is given the same)


def make(model_dir: str, layers: int, hidden: int, intermediate: int) -> None:
    import torch

    from offcache.bench.models import save_llama

    save_llama(
        model_dir, dtype=torch.bfloat16, num_hidden_layers=layers, hidden_size=hidden,
        intermediate_size=intermediate, num_attention_heads=8, num_key_value_heads=4, vocab_size=128,
    )  # fmt: skip


def _status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) << 10 for line in f if line.startswith(("RssAnon", "RssFile"))}


def _rss() -> str:
    return " ".join(f"{k}{v >> 10}" for k, v in _status().items())  # kB, as /proc/self/status gives them


def _sampler(path: str, patched: bool, stop: threading.Event) -> None:
    with open(path, "a") as f:
        while not stop.wait(0.1):
            row = {"t": time.time(), "rss_anon": _status().get("RssAnon")}
            if patched and "offcache" in sys.modules:
                s = sys.modules["offcache"].stats()
                row.update(host_bytes=s["pinned_reserved_bytes"] + s["pageable_bytes"], disk_bytes=s["disk_bytes"])
            f.write(json.dumps(row) + "\n")
            f.flush()


def run(model_dir: str, out_dir: str, mode: str, scheme: str = "fp8", stats: str | None = None) -> None:
    if mode not in ("none", "acts", "weights") or scheme not in ("fp8", "gptq"):
        raise SystemExit(f"usage: run MODEL_DIR OUT_DIR none|acts|weights [fp8|gptq] [STATS_FILE]; got {mode} {scheme}")
    stop = threading.Event()
    if stats:
        threading.Thread(target=_sampler, args=(stats, mode != "none", stop), daemon=True).start()
    import datasets
    import torch
    import transformers
    from compressed_tensors.offload import load_offloaded_model
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    torch.set_num_threads(1)  # bit-identical runs
    print("phase imported", _rss(), flush=True)
    if mode != "none":
        import offcache

        offcache.patch_llmcompressor(weights=mode == "weights")
    with load_offloaded_model():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16, device_map="auto_offload"
        )
    print("phase loaded", _rss(), flush=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(4, 128, (SEQ_LEN,), generator=g).tolist() for _ in range(SAMPLES)]
    dataset = datasets.Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * SEQ_LEN] * SAMPLES})
    oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=dataset,
        recipe=(
            QuantizationModifier(targets="Linear", scheme="FP8", ignore=["lm_head"])
            if scheme == "fp8"
            else GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])
        ),
        num_calibration_samples=SAMPLES,
        max_seq_length=SEQ_LEN,
        pipeline="sequential",
        shuffle_calibration_samples=False,
    )
    print("phase calibrated", _rss(), flush=True)
    model.save_pretrained(out_dir, save_compressed=True)
    print("phase saved", _rss(), flush=True)
    stop.set()


def main(argv: list[str]) -> None:
    if argv[:1] == ["make"] and len(argv) == 5:
        make(argv[1], *map(int, argv[2:5]))
    elif argv[:1] == ["run"] and 4 <= len(argv) <= 6:
        run(*argv[1:])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
