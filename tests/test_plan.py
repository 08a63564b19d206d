"""The planner, python -m offcache.plan: its arithmetic, its checks and its command line."""

import dataclasses

import pytest
import torch

import offcache
from offcache import kv, plan

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2)  # fmt: skip


def test_estimate_returns_the_numbers_of_every_boundary():
    p = plan.estimate(transformers.LlamaConfig(**TINY), samples=7, seq_len=24, dtype="float32", batch_size=2)
    assert isinstance(p, plan.Plan) and dataclasses.is_dataclass(p)
    assert p.batches == 4 and len(p.boundaries) == 3  # batches of 2, 2, 2, 1; one boundary per layer
    first, later = p.boundaries[0], p.boundaries[1]
    assert first.hidden_bytes == 2 * 24 * 128 * 4 and first.mask_bytes == 2 * 24 * 24 * 4
    assert first.position_bytes == 24 * 8 + 2 * 24 * 32 * 4
    assert first.total_bytes == sum(plan._stored(p.shape, b, 24, 4, True)[k] for b in (2, 2, 2, 1)
                                    for k in ("hidden_states", "position_ids", "causal_mask", "rotary_cos",
                                              "rotary_sin"))  # fmt: skip
    assert later.batch_bytes == later.hidden_bytes == 2 * 24 * 128 * 4 and later.mask_bytes == 0
    assert p.cache_peak_bytes == max(b.cache_peak_bytes for b in p.boundaries)
    assert p.d2h_bytes == p.input_bytes + sum(b.total_bytes for b in p.boundaries)
    assert p.seconds_pinned == pytest.approx((p.d2h_bytes + p.h2d_bytes) / 64e9)
    assert p.seconds_pageable > p.seconds_pinned and "published" in p.pinned_source
    assert "assumed" in p.pageable_source


def test_the_peak_holds_subgraph_0s_block_and_one_layer_of_hidden_states():
    p = plan.estimate(transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 6}), samples=8, seq_len=64)
    first, later = p.boundaries[0], p.boundaries[2]
    # One update() is one arena block: subgraph 0's hidden states share theirs with the position
    # ids, mask and rotary that every later subgraph reads, so deleting them frees nothing. Past
    # subgraph 1 the cache holds that block, one layer's hidden states and the batch being stored.
    assert p.boundaries[-1].cache_peak_bytes == first.total_bytes + later.total_bytes + later.batch_bytes
    assert p.boundaries[-1].cache_peak_bytes == later.cache_peak_bytes
    on_cpu = plan.estimate(transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 6}), samples=8, seq_len=64,
                           onload="cpu")  # fmt: skip
    assert on_cpu.cache_peak_bytes == p.cache_peak_bytes + later.batch_bytes  # the snapshot is host memory too


def test_weight_bytes_are_the_models_own():
    config = transformers.LlamaConfig(**TINY)
    p = plan.estimate(config, samples=1, seq_len=8, dtype="float16")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    assert p.weight_bytes_total == sum(t.numel() for t in model.parameters()) * 2
    assert p.weight_bytes_per_layer == sum(t.numel() for t in model.model.layers[0].parameters()) * 2
    shape = plan.Shape(layers=3, hidden_size=128, heads=4, kv_heads=2, head_dim=32, intermediate_size=256,
                       vocab_size=96)  # fmt: skip
    by_formula = plan.estimate(shape=shape, samples=1, seq_len=8, dtype="float16")
    assert by_formula.weight_bytes_per_layer == p.weight_bytes_per_layer
    assert by_formula.weight_bytes_total == p.weight_bytes_total
    assert shape.weight_bytes_per_layer == []  # the caller's Shape is not changed


@pytest.mark.parametrize("name", ["Qwen3MoeConfig", "MixtralConfig"])
def test_moe_weights_count_every_expert(name):
    config = getattr(transformers, name)(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100)  # fmt: skip
    p = plan.estimate(config, samples=2, seq_len=8)
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    per_expert = 3 * 64 * (getattr(config, "moe_intermediate_size", None) or 128) * 2
    assert p.weight_bytes_per_layer > experts * per_expert


def test_tiers_follow_the_configuration(engine_config, tmp_path):
    engine_config(backend="host", pinned_limit="1MiB", host_limit="2MiB", disk_dir="none")
    p = plan.estimate(transformers.LlamaConfig(**TINY), samples=64, seq_len=128)
    t = p.tiers
    assert (t.pinned_bytes, t.pageable_bytes) == (1 << 20, 1 << 20) and t.disk_bytes == p.cache_peak_bytes - (2 << 20)
    assert not t.fits and t.disk_dir == "" and t.host_limit_bytes == offcache.stats()["host_limit_bytes"]
    engine_config(backend="host", pinned_limit="1MiB", host_limit="2MiB", disk_dir=tmp_path)
    t = plan.estimate(transformers.LlamaConfig(**TINY), samples=64, seq_len=128).tiers
    assert t.fits and t.disk_dir == str(tmp_path) and t.disk_free_bytes > 0


@pytest.mark.parametrize(
    "kwargs, match",
    [({"samples": 0}, "samples"), ({"samples": True}, "samples"), ({"seq_len": 2.5}, "seq_len"),
     ({"batch_size": -1}, "batch_size"), ({"dtype": "float33"}, "dtype"), ({"onload": "tpu"}, "onload"),
     ({"pinned_gbps": 0}, "pinned_gbps"), ({"pageable_gbps": float("nan")}, "pageable_gbps"),
     ({"pinned_gbps": float("inf")}, "pinned_gbps")],
)  # fmt: skip
def test_bad_arguments_are_named(kwargs, match):
    args = {"samples": 4, "seq_len": 16, **kwargs}
    with pytest.raises(ValueError, match=match):
        plan.estimate(transformers.LlamaConfig(**TINY), **args)


def test_the_command_line_prints_the_plan(tmp_path, capsys):
    transformers.LlamaConfig(**TINY).save_pretrained(tmp_path)
    assert plan.main(["--config", str(tmp_path), "--samples", "6", "--seq-len", "24", "--dtype", "float32"]) == 0
    text = capsys.readouterr().out
    p = plan.estimate(tmp_path, samples=6, seq_len=24, dtype="float32")  # a path works as well as a str
    assert f"Cache peak: {p.cache_peak_bytes} bytes" in text and "after subgraph 0:" in text
    assert f"{p.weight_bytes_total} bytes" in text and "published: NVIDIA H200" in text
    with pytest.raises(SystemExit):
        plan.main(["--samples", "6", "--seq-len", "24"])  # neither --config nor the sizes
    assert "without --config, give --layers, --hidden-size, --heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan.main(["--layers", "2", "--hidden-size", "64", "--heads", "4", "--samples", "0", "--seq-len", "8"])
    assert "samples must be an integer >= 1" in capsys.readouterr().err


def test_plan_kv_is_kv_size(capsys):
    args = ["--layers", "32", "--tokens", "8192", "--kv-heads", "8", "--head-dim", "128", "--bandwidth-gbps", "50"]
    assert plan.main(["kv", *args]) == 0
    folded = capsys.readouterr().out
    assert kv.main(["size", *args]) == 0
    assert capsys.readouterr().out == folded and "KV cache: 1073741824 bytes" in folded


def test_json_output_is_the_plan(capsys):
    import json

    args = ["--layers", "2", "--hidden-size", "64", "--heads", "4", "--samples", "3", "--seq-len", "8"]
    assert plan.main([*args, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    shape = plan.Shape(layers=2, hidden_size=64, heads=4, kv_heads=4, head_dim=16, intermediate_size=256, vocab_size=0)
    want = plan.estimate(shape=shape, samples=3, seq_len=8).to_dict()
    for key in ("cache_peak_bytes", "d2h_bytes", "h2d_bytes", "weight_bytes_total", "boundaries"):
        assert got[key] == want[key], key
