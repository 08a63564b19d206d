"""OffloadedKVCache: greedy generations identical to DynamicCache, on both backends."""

import pytest
import torch

import offcache
from offcache.bench.models import causal_lm

transformers = pytest.importorskip("transformers")


def tiny_model(kind: str):
    return causal_lm(kind, sliding_window=8) if kind == "mistral" else causal_lm(kind)


def generate(model, input_ids, cache, new_tokens):
    with torch.no_grad():
        return model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            past_key_values=cache,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )


# The default and host engines (the slow 1 MiB configuration adds nothing here).
both_backends = pytest.mark.parametrize("engine", ["default", "host"], indirect=True)


@both_backends
@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("batch, prompt, new", [(1, 1, 20), (3, 5, 24), (2, 12, 30)])
def test_greedy_tokens_identical_to_dynamic_cache(engine, kind, batch, prompt, new):
    model = tiny_model(kind)
    ids = torch.randint(1, 128, (batch, prompt), generator=torch.Generator().manual_seed(batch + prompt))
    want = generate(model, ids, transformers.DynamicCache(config=model.config), new)
    got = generate(model, ids, offcache.OffloadedKVCache(config=model.config, compact_every=4), new)
    assert torch.equal(got, want)
    assert got.shape[1] == prompt + new  # past the sliding window of 8


@both_backends
def test_sliding_layers_can_be_offloaded_too(engine):
    model = tiny_model("mistral")
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    want = generate(model, ids, transformers.DynamicCache(config=model.config), 20)
    cache = offcache.OffloadedKVCache(config=model.config, offload_sliding=True)
    assert all(type(layer).__name__ == "OffloadedSlidingLayer" for layer in cache.layers)
    got = generate(model, ids, cache, 20)
    assert torch.equal(got, want)


@both_backends
def test_layer_kinds_and_seq_length(engine):
    model = tiny_model("llama")
    cache = offcache.OffloadedKVCache(config=model.config)
    assert all(type(layer).__name__ == "OffloadedLayer" for layer in cache.layers)
    mistral = offcache.OffloadedKVCache(config=tiny_model("mistral").config)
    assert all(type(layer).__name__ == "DynamicSlidingWindowLayer" for layer in mistral.layers)  # resident
    ids = torch.randint(1, 128, (1, 7))
    generate(model, ids, cache, 5)
    assert cache.get_seq_length() == 7 + 5 - 1
    offcache.synchronize()
    assert offcache.stats()["pinned_in_use_bytes"] > 0  # the K/V live in the arena


@both_backends
def test_manual_forward_loop_without_config(engine):
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (2, 4), generator=torch.Generator().manual_seed(9))
    outs = {}
    for name, cache in (("dynamic", transformers.DynamicCache()), ("offcache", offcache.OffloadedKVCache())):
        step_ids, tokens = ids, []
        with torch.no_grad():
            for _ in range(10):
                logits = model(input_ids=step_ids, past_key_values=cache, use_cache=True).logits
                step_ids = logits[:, -1:].argmax(-1)
                tokens.append(step_ids)
        outs[name] = torch.cat(tokens, dim=1)
    assert torch.equal(outs["offcache"], outs["dynamic"])


def test_kv_bytes_of_32_layers_8192_tokens_is_exactly_one_gib():
    assert offcache.kv_bytes(32, 1, 8192, 8, 128, torch.bfloat16) == 1 << 30
    assert offcache.kv_bytes(32, 1, 8192, 8, 128, 2) == 1 << 30
    assert offcache.kv_bytes(32, 1, 16384, 8, 128, "float16") == 2 << 30
    with pytest.raises(ValueError, match="tokens"):
        offcache.kv_bytes(32, 1, -1, 8, 128)


def test_kv_bytes_for_config_counts_sliding_windows():
    llama = transformers.LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                     hidden_size=4096)  # fmt: skip
    assert offcache.kv_bytes_for_config(llama, 1, 8192, torch.bfloat16) == 1 << 30
    mistral = transformers.MistralConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                         hidden_size=4096, sliding_window=4096)  # fmt: skip
    assert offcache.kv_bytes_for_config(mistral, 1, 8192, torch.bfloat16) == 1 << 29


def test_kv_size_cli(capsys):
    from offcache.kv import main

    main(["size", "--layers", "32", "--batch", "1", "--tokens", "8192", "--kv-heads", "8", "--head-dim", "128",
          "--dtype", "bfloat16", "--bandwidth-gbps", "50"])  # fmt: skip
    out = capsys.readouterr().out
    assert "1073741824 bytes = 1.0000 GiB" in out
    assert "21.475 ms" in out  # 2^30 B / 50 GB/s
