"""A sequence length against the model's positions: past a learned table an error, past a rotary model's trained
positions an advice line (``estimate()`` checks ``seq_len`` with ``check()``)."""

from __future__ import annotations

# Families whose positions are a learned table of absolute positions: a longer sequence indexes past it.
LEARNED_POSITIONS = ("opt", "gpt2", "gpt_neo", "gpt_bigcode", "biogpt", "bart", "mbart", "bert", "roberta",
                     "xlm-roberta", "megatron-bert")  # fmt: skip
POSITION_LIMITS = ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx")
ROTARY_SIGNS = ("rope_parameters", "rope_theta", "rope_scaling", "rotary_dim", "rotary_pct", "partial_rotary_factor",
                "rotary_emb_base")  # fmt: skip


def position_limit(config) -> tuple[str, str, int] | None:
    """(kind, the config's attribute, its value) of the text model's positions, kind 'learned' or 'rotary';
    None when its config names no limit or its positions have none (ALiBi, computed, no positions)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    name = next((n for n in POSITION_LIMITS if isinstance(getattr(text, n, None), int)), None)
    if name is None or getattr(text, "alibi", False):
        return None
    name = getattr(text, "attribute_map", {}).get(name, name)  # as its config.json names it (GPT-2: n_positions)
    model_type = getattr(text, "model_type", "")
    if model_type in LEARNED_POSITIONS or getattr(text, "learned_pos_emb", False) \
            or getattr(text, "position_embedding_type", None) == "absolute":  # fmt: skip
        return "learned", name, getattr(text, name)
    if any(getattr(text, a, None) is not None for a in ROTARY_SIGNS) or \
            getattr(text, "position_embedding_type", None) == "rotary":  # fmt: skip
        return "rotary", name, getattr(text, name)
    return None


def check(config, seq_len: int) -> str | None:
    """Raise when seq_len is past a learned position table; the advice line when past a rotary model's."""
    found = position_limit(config)
    if found is None or seq_len <= found[2]:
        return None
    kind, name, limit = found
    family = getattr(config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config,
                     "model_type", "") or type(config).__name__  # fmt: skip
    if kind == "learned":
        raise ValueError(
            f"seq_len {seq_len} is past the model's {limit} learned positions ({family}, {name}={limit}): the run "
            f"would fail indexing its position embeddings; give --seq-len {limit} or less"
        )
    return (
        f"--seq-len {seq_len} is past the model's trained positions ({family}, {name}={limit}): its rotary "
        "positions run past it, but the model's outputs (and so the calibration) may degrade there."
    )
