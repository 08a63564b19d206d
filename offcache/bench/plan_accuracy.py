"""The planner against the engine: predicted cache peak vs the peak a real oneshot measures.

For each family (a tiny random model built from its transformers config, no downloads) and
batch size, llm-compressor's ``oneshot`` runs GPTQ W4A16 through the sequential pipeline with
offcache patched in, on a fresh host-backend engine; the engine's measured peak
(``stats()``: peak pinned in use + peak pageable) is compared with ``plan.estimate``'s
``cache_peak_bytes`` for the same run.

``python -m offcache.bench.plan_accuracy --out benchmarks/results/DATE-plan-accuracy.md``
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

TINY = dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
HEAD = dict(head_dim=32)  # GPTQ W4A16 groups 128 input features: every Linear takes 128 or more


def _gemma3_multimodal(t):
    text = {**TINY, **HEAD, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "sliding_window": 8}  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    return t.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)


# family -> config builder (transformers module -> config)
FAMILIES = {
    "llama": lambda t: t.LlamaConfig(**TINY),
    "qwen2": lambda t: t.Qwen2Config(**TINY),
    "qwen3": lambda t: t.Qwen3Config(**TINY, **HEAD),
    "mistral": lambda t: t.MistralConfig(**TINY, sliding_window=8),
    "gemma2": lambda t: t.Gemma2Config(**TINY, **HEAD, sliding_window=8),
    "gemma3": lambda t: t.Gemma3TextConfig(
        **TINY, **HEAD, sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"]
    ),
    "phi3": lambda t: t.Phi3Config(**TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "opt": lambda t: t.OPTConfig(
        vocab_size=96,
        hidden_size=128,
        ffn_dim=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        word_embed_proj_dim=128,
        max_position_embeddings=256,
        pad_token_id=1,
    ),  # fmt: skip
    "qwen3_moe": lambda t: t.Qwen3MoeConfig(
        **TINY, **HEAD, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128
    ),  # fmt: skip
    "mixtral": lambda t: t.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
    "gemma3_multimodal": _gemma3_multimodal,
}


def config_of(family: str):
    import transformers

    return FAMILIES[family](transformers)


def save_family(family: str, folder: Path, seed: int = 0) -> Path:
    """A random `family` model (float32) and a word tokenizer saved under `folder`."""
    import transformers

    from offcache.bench.models import word_tokenizer

    config = config_of(family)
    torch.manual_seed(seed)
    model = None
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
        try:
            model = auto.from_config(config, dtype=torch.float32)
            break
        except ValueError:
            continue
    model.save_pretrained(folder)
    text = config.get_text_config(decoder=True)
    word_tokenizer(text.vocab_size).save_pretrained(folder)
    return Path(folder)


def calibration_rows(n: int, length: int, vocab: int, seed: int = 1):
    import datasets

    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(4, vocab, (length,), generator=g).tolist() for _ in range(n)]
    return datasets.Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * length] * n})


def measure(folder: Path, samples: int, seq_len: int, batch_size: int) -> int:
    """The engine's cache peak in a real GPTQ oneshot of the model in `folder` (host backend, fresh engine)."""
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    import offcache

    offcache.synchronize()
    offcache.configure(backend="host")  # a fresh engine: its peaks are this run's
    config = transformers.AutoConfig.from_pretrained(folder)
    model = None
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
        try:
            model = auto.from_pretrained(folder, dtype=torch.float32)
            break
        except ValueError:
            continue
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    vocab = config.get_text_config(decoder=True).vocab_size
    offcache.patch_llmcompressor()
    try:
        oneshot(
            model=model, tokenizer=tokenizer, dataset=calibration_rows(samples, seq_len, vocab),
            recipe=GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head", "re:.*vision.*",
                                                                          "re:.*multi_modal.*"]),
            num_calibration_samples=samples, max_seq_length=seq_len, batch_size=batch_size,
            pipeline="sequential", shuffle_calibration_samples=False,
        )  # fmt: skip
    finally:
        offcache.unpatch_llmcompressor()
    offcache.synchronize()
    s = offcache.stats()
    peak = s["peak_pinned_in_use_bytes"] + s["peak_pageable_bytes"]
    offcache.configure()
    return peak


def compare(family: str, folder: Path, samples: int, seq_len: int, batch_size: int) -> dict:
    """One row: the prediction, the measurement, their ratio and the planner's method."""
    from offcache import plan

    t0 = time.perf_counter()
    p = plan.estimate(folder, samples=samples, seq_len=seq_len, dtype="float32", batch_size=batch_size,
                      onload="cpu", uniform_lengths=True)  # fmt: skip
    plan_s = time.perf_counter() - t0
    measured = measure(folder, samples, seq_len, batch_size)
    return {
        "family": family, "samples": samples, "seq_len": seq_len, "batch_size": batch_size,
        "predicted": p.cache_peak_bytes, "measured": measured, "ratio": p.cache_peak_bytes / measured,
        "method": p.method, "plan_seconds": plan_s, "notes": "; ".join(p.notes) or p.method_reason,
    }  # fmt: skip


def within_bar(row: dict) -> bool:
    """The issue's bar: within 10 %, and never under by more than 2 %."""
    return 0.98 <= row["ratio"] <= 1.10


def table(rows: list[dict]) -> str:
    lines = ["| family | samples x tokens | batch | predicted bytes | measured bytes | predicted / measured | "
             "method | within bar |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['samples']} x {r['seq_len']} | {r['batch_size']} | {r['predicted']} | "
            f"{r['measured']} | {r['ratio']:.4f} | {r['method']} | {'yes' if within_bar(r) else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m offcache.bench.plan_accuracy", description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 3])
    ap.add_argument("--samples", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=24)
    ap.add_argument("--out", help="write the table (markdown) here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in a.families:
            folder = save_family(family, Path(tmp) / family)
            for bs in a.batch_sizes:
                row = compare(family, folder, a.samples, a.seq_len, bs)
                rows.append(row)
                print(f"{family} bs={bs}: predicted {row['predicted']} measured {row['measured']} "
                      f"ratio {row['ratio']:.4f} {row['method']}", flush=True)  # fmt: skip
    text = table(rows)
    print(text)
    if a.out:
        import offcache

        head = [
            "# The planner's cache peak against the engine's measured peak",
            "",
            f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}. Machine: {platform.node()}, "
            f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"offcache {offcache.__version__}.",
            f"Command: `python -m offcache.bench.plan_accuracy {' '.join(argv if argv is not None else sys.argv[1:])}`",
            "",
            "Each row: a tiny random model of the family (float32, 3 decoder layers, hidden 128), GPTQ W4A16 "
            "through llm-compressor's oneshot (sequential pipeline, offcache patched in, host backend, model "
            "on the CPU); measured = the engine's stats() peak pinned in use + peak pageable; predicted = "
            "plan.estimate(...).cache_peak_bytes. Bar: 0.98 <= predicted / measured <= 1.10.",
            "",
        ]
        notes = sorted({f"{r['family']}: {r['notes']}" for r in rows if r["notes"]})
        body = head + [text, ""] + ([f"Notes: {n}" for n in notes] if notes else [])
        Path(a.out).write_text("\n".join(body) + "\n")
    return 0 if all(within_bar(r) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
