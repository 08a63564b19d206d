"""Tiny random models of the layer kinds the KV caches must handle, built in code (no hub access)."""

from __future__ import annotations

import torch

from offcache.kv.dynamic import cache_kwarg


def kw(cache) -> dict:
    """The cache as the installed transformers takes it: ``cache=`` (5.24+), else ``past_key_values=``."""
    return {cache_kwarg(): cache}


def edit_in_place(t: torch.Tensor, how: str, factor: float) -> None:
    """Multiply `t` by `factor` in place: through the tensor, ``.data`` or numpy (which no version
    counter sees)."""
    if how == "tensor":
        t.mul_(factor)
    elif how == "data":
        t.data.mul_(factor)
    else:
        a = t.numpy()
        a *= factor


def edit_layer_in_place(layer, how: str) -> None:
    """Halve the layer's K and negate its V in place, through the tensor, ``.data`` or numpy."""
    edit_in_place(layer.keys, how, 0.5)
    edit_in_place(layer.values, how, -1.0)


def fill(model, cache, prompt):
    """`cache` after one forward of `prompt` (the prompt-reuse recipe's first step)."""
    with torch.no_grad():
        model(input_ids=prompt, **kw(cache), use_cache=True)
    return cache


def copier(how: str):
    """A cache copier: ``copy.deepcopy`` for "deepcopy", else a pickle round trip."""
    import copy
    import pickle

    return copy.deepcopy if how == "deepcopy" else (lambda c: pickle.loads(pickle.dumps(c)))


def select_repeat_decode(model, cache, ids):
    """Prefill `ids` (3 rows), keep rows [2, 0], decode 4 steps, repeat each row twice, decode
    8 more: the last two rows' tokens. Drives batch_select_indices and batch_repeat_interleave."""
    with torch.no_grad():
        step = model(input_ids=ids, **kw(cache), use_cache=True).logits[:, -1:].argmax(-1)
        cache.batch_select_indices(torch.tensor([2, 0]))
        step, tokens = step[[2, 0]], []
        for i in range(12):
            if i == 4:
                cache.batch_repeat_interleave(2)
                step = step.repeat_interleave(2, dim=0)
            step = model(input_ids=step, **kw(cache), use_cache=True).logits[:, -1:].argmax(-1)
            tokens.append(step[-2:])
    return torch.cat(tokens, dim=1)


def tiny_causal_lm(kind: str, sliding_window: int = 8, seed: int = 0):
    """A random causal LM in eval mode with hidden size 32-64 and a few layers:

    gemma3n / gemma4: KV-sharing (the last 2 layers read earlier layers' K/V through shared_kv_states);
    gemma3: alternating sliding and full layers; lfm2: hybrid conv / attention layers.
    """
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=16, max_position_embeddings=256)  # fmt: skip
    alternating = ["sliding_attention", "full_attention"] * 3
    if kind == "gemma3n":
        config = transformers.Gemma3nTextConfig(
            **common, num_hidden_layers=6, layer_types=alternating, sliding_window=sliding_window,
            num_kv_shared_layers=2, vocab_size_per_layer_input=128, hidden_size_per_layer_input=8, laurel_rank=4,
            altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 6,
        )  # fmt: skip
        model = transformers.Gemma3nForCausalLM(config)
    elif kind == "gemma4":
        config = transformers.Gemma4TextConfig(
            **common, num_hidden_layers=6, layer_types=alternating, sliding_window=sliding_window,
            num_kv_shared_layers=2, vocab_size_per_layer_input=128, hidden_size_per_layer_input=8,
            global_head_dim=32,
        )  # fmt: skip
        model = transformers.Gemma4ForCausalLM(config)
    elif kind == "gemma3":
        config = transformers.Gemma3TextConfig(**common, num_hidden_layers=4, sliding_window=sliding_window,
                                               layer_types=alternating[:4])  # fmt: skip
        model = transformers.Gemma3ForCausalLM(config)
    elif kind == "lfm2":
        config = transformers.Lfm2Config(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=256, layer_types=["conv", "full_attention"] * 2,
        )  # fmt: skip
        model = transformers.Lfm2ForCausalLM(config)
    else:
        raise ValueError(kind)
    return model.eval()


def tiny_mlp_moe_lm(seed: int = 0, layers=("mlp", "full_attention", "moe", "full_attention")):
    """NemotronH with "mlp" and "moe" layers beside full-attention ones: layers with no cache of their own
    (transformers' caches give them a DummyLayer)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.NemotronHConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, max_position_embeddings=256, layers_block_type=list(layers),
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
        n_group=1, topk_group=1,
    )  # fmt: skip
    return transformers.NemotronHForCausalLM(config).eval()


def tiny_hybrid_lm(seed: int = 0):
    """FalconH1: every layer "hybrid" (a Mamba2 mixer beside attention), whose cache layers hold K/V and
    linear-attention (conv and recurrent) states at once."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.FalconH1Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, mamba_d_ssm=32, mamba_n_heads=4,
        mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=4, mamba_expand=1,
    )  # fmt: skip
    return transformers.FalconH1ForCausalLM(config).eval()


def outcome(fn, *args, **kwargs):
    """``("returned", fn(...))``, or ``("raised", type name, message)``: where transformers' own cache
    raises (e.g. 5.25's on a model whose first layer holds no cache), offcache's must raise the same."""
    try:
        return "returned", fn(*args, **kwargs)
    except Exception as e:  # compared with the reference's outcome, never swallowed
        return "raised", type(e).__name__, str(e)
