"""One past-RAM oneshot, run as a script (in a memory cgroup by tests/weights/memory/test_past_ram.py):

    python past_ram_worker.py make MODEL_DIR LAYERS HIDDEN INTERMEDIATE
    python past_ram_worker.py run MODEL_DIR OUT_DIR MODE [fp8|gptq]

`make` saves a random bf16 Llama checkpoint. `run` loads MODEL_DIR with compressed-tensors'
``load_offloaded_model(device_map="auto_offload")``, patches llm-compressor per MODE ("none":
llm-compressor alone; "acts": ``patch_llmcompressor()``; "weights": ``patch_llmcompressor(weights=True)``),
runs ``oneshot`` (sequential pipeline, FP8 with static activation scales, calibrated) and saves the
result with ``save_pretrained(save_compressed=True)`` into OUT_DIR. It prints one line per phase
("phase loaded", "phase calibrated", "phase saved") so that a kill says where it happened.
"""

from __future__ import annotations

import sys


def make(model_dir: str, layers: int, hidden: int, intermediate: int) -> None:
    import torch

    from offcache.bench.models import save_llama

    save_llama(
        model_dir, dtype=torch.bfloat16, num_hidden_layers=layers, hidden_size=hidden,
        intermediate_size=intermediate, num_attention_heads=8, num_key_value_heads=4, vocab_size=128,
    )  # fmt: skip


def _rss() -> str:
    with open("/proc/self/status") as f:
        return " ".join(line.split()[0] + line.split()[1] for line in f if line.startswith(("RssAnon", "RssFile")))


def run(model_dir: str, out_dir: str, mode: str, scheme: str = "fp8") -> None:
    import datasets
    import torch
    import transformers
    from compressed_tensors.offload import load_offloaded_model
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    torch.set_num_threads(1)  # bit-identical runs
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
    rows = [torch.randint(4, 128, (16,), generator=g).tolist() for _ in range(4)]
    dataset = datasets.Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * 16] * 4})
    oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=dataset,
        recipe=(
            QuantizationModifier(targets="Linear", scheme="FP8", ignore=["lm_head"])
            if scheme == "fp8"
            else GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])
        ),
        num_calibration_samples=4,
        max_seq_length=16,
        pipeline="sequential",
        shuffle_calibration_samples=False,
    )
    print("phase calibrated", _rss(), flush=True)
    model.save_pretrained(out_dir, save_compressed=True)
    print("phase saved", _rss(), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], *map(int, sys.argv[3:6]))
    else:
        run(*sys.argv[2:6])
