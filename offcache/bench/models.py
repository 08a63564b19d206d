"""Random-weight transformers models and a word-level tokenizer, built in code (no hub access).

The one builder shared by the benchmarks and the tests: a tiny model checks semantics on a
CPU; the same builder at real layer shapes measures a GPU.
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)  # fmt: skip


def causal_lm(kind: str = "llama", device=None, dtype=torch.float32, seed: int = 0, **shape):
    """A random `kind` ("llama", or "mistral": every layer a sliding window) causal LM in eval mode.

    `shape` overrides TINY's config fields (and, for mistral, sets `sliding_window`).
    """
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **shape})
    with torch.device(device or "cpu"):
        model = model_cls(config).to(dtype)
    return model.eval()


def word_tokenizer(vocab_size: int):
    """A fast tokenizer over the words w0, w1, ... with <unk>, <pad>, <s> and </s> as ids 0-3."""
    import tokenizers
    import transformers

    words = [f"w{i}" for i in range(vocab_size - 4)]
    vocab = {"<unk>": 0, "<pad>": 1, "<s>": 2, "</s>": 3} | {w: i + 4 for i, w in enumerate(words)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def save_llama(path: Path, dtype=torch.float32, seed: int = 0, **shape) -> Path:
    """A random Llama and its word tokenizer saved under `path`, for from_pretrained / oneshot."""
    model = causal_lm("llama", dtype=dtype, seed=seed, **shape)
    model.save_pretrained(path)
    word_tokenizer(model.config.vocab_size).save_pretrained(path)
    return Path(path)
