"""The planner, python -m offcache.plan: what it traces, its arithmetic, its checks and its command line."""

import dataclasses
import itertools
import json

import pytest
import torch

import offcache
import offcache.plan as plan
from offcache import engine as _engine
from offcache.kv import size as kv
from offcache.plan import sim as plan_sim
from offcache.plan import trace as plan_trace

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from offcache.bench.plan_accuracy import FAMILIES, config_of  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2)  # fmt: skip
SHAPE = plan.Shape(layers=3, hidden_size=128, heads=4, kv_heads=2, head_dim=32, intermediate_size=256, vocab_size=96)


def _values(subgraphs):
    """Per subgraph: consumed names, and per stored name its tensors' (bytes, which distinct tensor)."""
    out = []
    for sg in subgraphs:
        order: dict = {}
        stored = {n: [(b, order.setdefault(k, len(order))) for k, b in leaves] for n, leaves in sg.outputs.items()}
        out.append((sg.input_names, sg.consumed_names, stored, sg.shapes))
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_meta_run_stores_what_a_real_run_stores(family):
    # The planner runs the traced subgraphs on meta tensors; the same subgraphs run on a real model
    # with real tensors must give the same names, shapes, dtypes and shared tensors at every boundary.
    config = config_of(family)
    torch.manual_seed(0)
    real = None
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
        try:
            real = auto.from_config(config, dtype=torch.float32).eval()
            break
        except ValueError:
            continue
    got_real = plan_trace.trace_model(real, 2, 12).run(2, 12)
    got_meta = plan_trace.trace(config, torch.float32, 2, 12).run(2, 12)
    assert _values(got_meta) == _values(got_real)
    assert len(got_meta) == config.get_text_config(decoder=True).num_hidden_layers + 1


def test_gemma_stores_every_mask_name_and_shares_their_tensors():
    config = config_of("gemma2")  # layers: sliding, full, sliding
    p = plan.estimate(config, samples=4, seq_len=24, dtype="float32", batch_size=2, uniform_lengths=True)
    assert p.method == "traced" and p.notes == []
    first = p.boundaries[0]
    masks = [name for name, desc in first.values.items() if desc == "2x1x24x24 float32"]
    assert len(masks) == 3  # one name per layer
    hidden, mask, rotary, positions = 2 * 24 * 128 * 4, 2 * 24 * 24 * 4, 2 * 24 * 32 * 4, 24 * 8
    # Two distinct masks (sliding, full): the sliding one is given under two names and stored once.
    assert first.batch_bytes == hidden + positions + 2 * mask + rotary
    assert p.boundaries[1].batch_bytes == hidden  # a layer's hidden states


def test_a_traced_llama_is_the_formula():
    config = transformers.LlamaConfig(**TINY)
    traced = plan.estimate(config, samples=7, seq_len=24, dtype="float32", batch_size=2)
    formula = plan.estimate(shape=SHAPE, samples=7, seq_len=24, dtype="float32", batch_size=2)
    assert traced.method == "traced" and formula.method == "formula"
    assert traced.batches == 4 and len(traced.boundaries) == 3
    for t, f in zip(traced.boundaries, formula.boundaries):
        assert (t.batch_bytes, t.total_bytes, t.cache_peak_bytes) == (f.batch_bytes, f.total_bytes, f.cache_peak_bytes)
    assert (traced.d2h_bytes, traced.h2d_bytes) == (formula.d2h_bytes, formula.h2d_bytes)
    model = transformers.LlamaForCausalLM(config)
    tensors = [*model.parameters(), *model.buffers()]  # the buffers: rotary inv_freq (onloaded too)
    assert traced.weights.total_bytes == sum(t.numel() for t in tensors) * 4
    assert traced.weight_bytes_per_layer == sum(t.numel() for t in model.model.layers[0].parameters()) * 4


def test_estimate_returns_the_numbers_of_every_boundary():
    p = plan.estimate(shape=SHAPE, samples=7, seq_len=24, dtype="float32", batch_size=2)
    assert isinstance(p, plan.Plan) and dataclasses.is_dataclass(p)
    assert p.batches == 4 and len(p.boundaries) == 3  # batches of 2, 2, 2, 1; one boundary per layer
    first, later = p.boundaries[0], p.boundaries[1]
    assert first.batch_bytes == 2 * 24 * 128 * 4 + 24 * 8 + 2 * 24 * 24 * 4 + 2 * 24 * 32 * 4
    assert first.total_bytes == sum(b * 24 * 128 * 4 + 24 * 8 + b * 24 * 24 * 4 + 2 * 24 * 32 * 4 for b in (2, 2, 2, 1))
    assert later.batch_bytes == 2 * 24 * 128 * 4
    assert p.cache_peak_bytes == max(b.cache_peak_bytes for b in p.boundaries)
    assert p.d2h_bytes == p.input_bytes + sum(b.total_bytes for b in p.boundaries)
    assert p.seconds_pinned == pytest.approx((p.d2h_bytes + p.h2d_bytes) / 64e9)
    assert p.seconds_pageable > p.seconds_pinned and "published" in p.pinned_source
    assert "assumed" in p.pageable_source and "assumed" in p.disk_source
    assert p.method == "formula" and "no model config" in p.method_reason
    assert any("Llama formula (fallback)" in a for a in p.advice)


def test_the_peak_holds_subgraph_0s_block_and_one_layer_of_hidden_states(engine_config):
    shape = dataclasses.replace(SHAPE, layers=6)
    engine_config(backend="host")
    p = plan.estimate(shape=shape, samples=8, seq_len=64)
    first, later = p.boundaries[0], p.boundaries[2]
    # One update() is one arena block: subgraph 0's hidden states share theirs with the position
    # ids, mask and rotary that every later subgraph reads, so deleting them frees nothing.
    assert p.boundaries[-1].cache_peak_bytes == first.total_bytes + later.total_bytes + later.batch_bytes
    # A CPU model's stores are copied by the calling thread: no snapshot, nothing in flight.
    inline = plan.estimate(shape=shape, samples=8, seq_len=64, onload="cpu")
    assert inline.cache_peak_bytes == inline.peak_bound_bytes == p.cache_peak_bytes
    assert not any("OFFCACHE_MAX_IN_FLIGHT" in a for a in inline.advice)
    engine_config(backend="host", host_copy_delay_us=1)  # copies queued on the copy thread
    on_cpu = plan.estimate(shape=shape, samples=8, seq_len=64, onload="cpu")
    assert on_cpu.cache_peak_bytes == p.cache_peak_bytes + later.batch_bytes  # the snapshot is host memory too
    assert any("OFFCACHE_MAX_IN_FLIGHT" in a for a in on_cpu.advice)  # more snapshots may be in flight
    assert not any("OFFCACHE_MAX_IN_FLIGHT" in a for a in p.advice)


def test_a_cpu_models_snapshots_in_flight_are_in_the_bound(engine_config):
    # With two passes a subgraph's stores are waited for only by the next subgraph's first pass: the
    # snapshots of all 8 batches may be in flight (the one being stored is in the cache peak already),
    # unless OFFCACHE_MAX_IN_FLIGHT holds fewer. On a GPU the snapshot is device memory: nothing more.
    shape = dataclasses.replace(SHAPE, layers=6)
    engine_config(backend="host")  # the host backend's own copy threads at full speed: the caller copies
    inline = plan.estimate(shape=shape, samples=8, seq_len=64, onload="cpu")
    assert inline.in_flight_bytes == 0 and inline.peak_bound_bytes == inline.cache_peak_bytes
    # Slowed copy threads queue the copies: OFFCACHE_MAX_IN_FLIGHT's default, 1 GiB, the stores bound it
    engine_config(backend="host", host_copy_delay_us=1)
    on_cpu = plan.estimate(shape=shape, samples=8, seq_len=64, onload="cpu")
    later = on_cpu.boundaries[2]
    assert later.in_flight_bytes == 7 * later.batch_bytes
    assert on_cpu.peak_bound_bytes == max(b.cache_peak_bytes + b.in_flight_bytes for b in on_cpu.boundaries)
    assert on_cpu.in_flight_bytes == on_cpu.peak_bound_bytes - on_cpu.cache_peak_bytes > 0
    text = plan.render(on_cpu)
    assert f"in flight: up to {on_cpu.in_flight_bytes} bytes" in text and "OFFCACHE_MAX_IN_FLIGHT" in text
    assert f"peak bound {on_cpu.peak_bound_bytes} bytes" in text
    single = plan.estimate(shape=shape, samples=8, seq_len=64, onload="cpu", propagate_error=False)
    # One pass: the previous subgraph's stores are waited for batch by batch, so those of this batch on
    # may be in flight too (this one's freed by the engine's next reap): 8 - b of them and b of these.
    assert single.boundaries[2].in_flight_bytes == 8 * later.batch_bytes
    engine_config(backend="host", host_copy_delay_us=1, max_in_flight=later.batch_bytes)  # one at a time
    bounded = plan.estimate(shape=shape, samples=8, seq_len=64, onload="cpu")
    assert later.batch_bytes <= bounded.boundaries[2].in_flight_bytes < 2 * later.batch_bytes
    assert bounded.cache_peak_bytes == on_cpu.cache_peak_bytes < bounded.peak_bound_bytes < on_cpu.peak_bound_bytes
    on_gpu = plan.estimate(shape=shape, samples=8, seq_len=64)
    assert on_gpu.in_flight_bytes == 0 and on_gpu.peak_bound_bytes == on_gpu.cache_peak_bytes
    assert "in flight" not in plan.render(on_gpu)


def test_the_calibration_sets_snapshots_in_flight_stay_under_the_bound(engine_config):
    # from_dataloader stores every batch with nothing waiting for a copy: with the copy thread slowed
    # down, every batch's snapshot may still be in the arena when the last batch is stored.
    from offcache.activations.cache import IntermediatesCache

    samples, seq = 8, 64
    engine_config(backend="host", host_copy_delay_us=20_000)
    batches = [{"input_ids": torch.full((1, seq), i), "attention_mask": torch.ones(1, seq, dtype=torch.long)}
               for i in range(samples)]  # fmt: skip
    cache = IntermediatesCache.from_dataloader(batches, torch.device("cpu"))
    offcache.synchronize()
    s = offcache.stats()
    measured = s["peak_pinned_in_use_bytes"] + s["peak_pageable_bytes"]
    del cache
    replay = plan_sim.simulate_groups([(samples, [], plan_sim.inputs_of(1, seq))], onload="cpu", host_limit=1 << 40,
                                      max_in_flight=_engine.settings()["max_in_flight"])  # fmt: skip
    assert replay.peak_bytes == samples * 2 * seq * 8 + 2 * seq * 8  # the stored batches and one snapshot
    assert replay.in_flight == [(samples - 1) * 2 * seq * 8]
    assert measured <= replay.bound_bytes == replay.peak_bytes + replay.in_flight[0], (measured, replay)


def test_stores_no_subgraph_reads_yet_stay_in_flight_until_one_does():
    # With Linear targets a subgraph may read only older values (k_proj reads what q_proj read): nothing
    # waits for the previous subgraph's stores, so all of them may be in flight through this one's.
    sgs = plan_trace.trace(config_of("llama"), torch.float32, 1, 24, ["Linear"]).run(1, 24)
    template = plan_sim._template(sgs, plan_sim.inputs_of(1, 24))
    reads = [max(block for block, _ in fetched) for fetched in template.fetches]  # a template's block k: phase k
    k = next(k for k in range(1, len(reads) - 1) if reads[k] < k)
    grouped = plan_sim.simulate_groups([(6, sgs, plan_sim.inputs_of(1, 24))], onload="cpu", host_limit=1 << 40)
    assert grouped.in_flight[k + 1] == 6 * template.stores[k].size + 5 * template.stores[k + 1].size
    assert grouped.in_flight[k] == 5 * template.stores[k].size  # read by the next subgraph: only its own
    each = plan_sim.simulate_each([sgs] * 6, [plan_sim.inputs_of(1, 24)] * 6, onload="cpu", host_limit=1 << 40)
    assert each == grouped


def test_the_dtype_and_the_batch_size_change_what_is_stored():
    config = transformers.Qwen3Config(**TINY, head_dim=32)
    f32 = plan.estimate(config, samples=4, seq_len=16, dtype="float32")
    b16 = plan.estimate(config, samples=4, seq_len=16, dtype="bfloat16")
    assert b16.boundaries[1].batch_bytes * 2 == f32.boundaries[1].batch_bytes
    assert b16.weights.total_bytes < f32.weights.total_bytes
    assert "1x16 int64" in b16.boundaries[0].values.values()  # position ids keep their dtype
    by4 = plan.estimate(config, samples=4, seq_len=16, dtype="float32", batch_size=4)
    assert by4.batches == 1 and by4.boundaries[1].batch_bytes == 4 * f32.boundaries[1].batch_bytes
    assert by4.boundaries[1].total_bytes == f32.boundaries[1].total_bytes


def test_sequential_targets_and_targets_per_subgraph():
    config = transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 2})
    layers = plan.estimate(config, samples=2, seq_len=8, dtype="float32")
    linear = plan.estimate(config, samples=2, seq_len=8, dtype="float32", sequential_targets=["Linear"])
    assert len(layers.weights.per_subgraph) == 3
    assert len(linear.weights.per_subgraph) == 2 * 7 + 1 + 1  # q, k, v, o, gate, up, down per layer; the head
    assert linear.sequential_targets == ["Linear"] and linear.boundaries[1].targets.endswith("q_proj")
    assert sum(linear.weights.per_subgraph) == sum(layers.weights.per_subgraph)
    pairs = plan.estimate(config, samples=2, seq_len=8, dtype="float32", sequential_targets=["Linear"],
                          targets_per_subgraph=2)  # fmt: skip
    assert len(pairs.weights.per_subgraph) == 7 + 1 + 1
    custom = plan.estimate(config, samples=2, seq_len=8, dtype="float32", sequential_targets=["LlamaMLP"])
    assert len(custom.weights.per_subgraph) == 3
    with pytest.raises(ValueError, match="need a traced model"):
        plan.estimate(shape=SHAPE, samples=2, seq_len=8, sequential_targets=["Linear"])


def test_a_multimodal_config_plans_its_language_model():
    config = config_of("gemma3_multimodal")
    p = plan.estimate(config, samples=2, seq_len=16, dtype="float32")
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    layer = sum(t.numel() for t in model.model.language_model.layers[0].parameters()) * 4
    vision = sum(t.numel() for t in model.model.vision_tower.parameters()) * 4
    assert p.weight_bytes_per_layer == layer and len(p.boundaries) == 3
    assert p.weights.total_bytes - p.weights.walked_bytes >= vision  # the vision tower is not walked


def test_a_layer_that_cannot_run_on_meta_in_float32_runs_in_bfloat16_and_is_said_so():
    config = config_of("mixtral")  # fp32 experts: grouped_mm's meta kernel takes bf16/fp16 only
    f32 = plan.estimate(config, samples=2, seq_len=8, dtype="float32")
    assert f32.method == "traced" and any("in bfloat16, reported as float32" in n for n in f32.notes)
    assert "note: run on meta tensors in bfloat16" in plan.render(f32)
    b16 = plan.estimate(config, samples=2, seq_len=8, dtype="bfloat16")
    assert b16.notes == [] and [b.batch_bytes * 2 for b in b16.boundaries[1:]] == [
        b.batch_bytes for b in f32.boundaries[1:]
    ]
    assert f32.boundaries[1].values == {"model_layers_0": "1x8x128 float32"}  # batch size 1
    assert f32.weights.total_bytes == 2 * b16.weights.total_bytes
    assert f32.weight_bytes_per_layer > config.num_local_experts * 3 * 128 * 256 * 4


def test_a_layer_that_cannot_run_on_meta_at_all_is_stood_in_for_and_said_so(monkeypatch):
    from transformers.models.mixtral import modeling_mixtral

    def data_dependent(self, *args, **kwargs):
        raise RuntimeError("nonzero is data-dependent")

    monkeypatch.setattr(modeling_mixtral.MixtralSparseMoeBlock, "forward", data_dependent)
    p = plan.estimate(config_of("mixtral"), samples=2, seq_len=8, dtype="bfloat16")
    assert any(n.startswith("MixtralDecoderLayer's output is taken to be shaped like") for n in p.notes)
    assert p.boundaries[1].values == {"model_layers_0": "1x8x128 bfloat16"}


def test_an_untraceable_model_falls_back_to_the_formula_and_says_why(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("symbolically traced variables cannot be used as inputs to control flow")

    monkeypatch.setattr(plan_trace, "trace", refuse)
    p = plan.estimate(transformers.LlamaConfig(**TINY), samples=2, seq_len=8)
    assert p.method == "formula" and "trace of the model, or a run of its subgraphs, fails" in p.method_reason
    assert (
        "Llama formula (FALLBACK: llm-compressor's trace" in plan.render(p)
        and "RuntimeError: symbolic" in p.method_reason
    )


def test_tiers_disk_time_and_advice_follow_the_configuration(engine_config, tmp_path):
    engine_config(backend="host", pinned_limit="1MiB", host_limit="2MiB", disk_dir="none")
    p = plan.estimate(shape=SHAPE, samples=64, seq_len=128)
    t = p.tiers
    assert (t.pinned_bytes, t.pageable_bytes) == (1 << 20, 1 << 20) and t.disk_bytes == p.cache_peak_bytes - (2 << 20)
    assert not t.fits and t.disk_dir == "" and t.host_limit_bytes == offcache.stats()["host_limit_bytes"]
    assert any("DOES NOT FIT" in a for a in p.advice)
    assert any("OFFCACHE_HOST_LIMIT=" in a for a in p.advice)  # the peak fits in this machine's memory
    engine_config(backend="host", pinned_limit="1MiB", host_limit="2MiB", disk_dir=tmp_path)
    p = plan.estimate(shape=SHAPE, samples=64, seq_len=128, disk_write_gbps=1.0, disk_read_gbps=4.0)
    assert p.tiers.fits and p.tiers.disk_dir == str(tmp_path) and p.tiers.disk_free_bytes > 0
    assert 0 < p.disk_write_bytes <= p.d2h_bytes + 256 * 4 * 64 and 0 < p.disk_read_bytes <= p.h2d_bytes
    assert p.seconds_disk == pytest.approx(p.disk_write_bytes / 1e9 + p.disk_read_bytes / 4e9)
    assert p.disk_source == "given" and not any("DOES NOT FIT" in a for a in p.advice)
    engine_config(backend="host", host_limit=0, disk_dir=tmp_path)  # every block on disk
    p = plan.estimate(shape=SHAPE, samples=4, seq_len=16)
    assert p.disk_read_bytes == p.h2d_bytes and p.disk_write_bytes >= p.d2h_bytes


def test_the_host_limit_advice_names_a_limit_that_holds_the_peak(engine_config, tmp_path):
    engine_config(backend="host", pinned_limit="1MiB", host_limit="1MiB", disk_dir=tmp_path)
    p = plan.estimate(shape=SHAPE, samples=64, seq_len=128)
    (advice,) = [a for a in p.advice if "OFFCACHE_HOST_LIMIT=" in a]
    limit = advice.split("OFFCACHE_HOST_LIMIT=")[1].split()[0]
    assert offcache.engine.parse_size(limit) >= p.cache_peak_bytes


def test_the_host_limit_advice_stays_inside_what_the_engine_deems_safe(engine_config, tmp_path, monkeypatch):
    """The advice once named a limit of 70-80 % of memory (the whole peak) where the engine's own default is 25 %:
    it must leave the weights, each rank's working set and as much again as the limit (the engine's rule)."""
    from offcache.engine import machine
    from offcache.plan import core

    engine_config(backend="host", pinned_limit="1MiB", host_limit="1MiB", disk_dir=tmp_path)
    peak = plan.estimate(shape=SHAPE, samples=64, seq_len=128).cache_peak_bytes
    monkeypatch.setattr(core, "PROCESS_WORKING_SET", 1 << 20)
    for memory, nproc in ((peak * 5 // 4, 1), (peak * 3, 2), (peak * 8, 2)):
        monkeypatch.setattr(machine, "usable_memory_bytes", lambda m=memory: m)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(nproc))
        p = plan.estimate(shape=SHAPE, samples=64, seq_len=128, nproc_per_node=nproc)
        safe = (memory - p.weights.ram_bytes - nproc * (1 << 20)) // (2 * nproc)
        assert core.safe_host_limit(memory, p.weights.ram_bytes, nproc) == safe
        (advice,) = [a for a in p.advice if "OFFCACHE_HOST_LIMIT=" in a]
        limit = offcache.engine.parse_size(advice.split("OFFCACHE_HOST_LIMIT=")[1].split()[0])
        assert 1 << 20 < limit <= safe, (memory, nproc, advice)
        if p.cache_peak_bytes <= safe:  # a rank's whole peak fits safely: the advice holds it
            assert limit >= p.cache_peak_bytes and "keeps it in memory" in advice
        else:
            assert "rest on the disk tier" in advice
    # A host limit already above what is safe is named, with the safe one.
    engine_config(backend="host", pinned_limit="1MiB", host_limit=peak, disk_dir=tmp_path)
    monkeypatch.setattr(machine, "usable_memory_bytes", lambda: peak)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    p = plan.estimate(shape=SHAPE, samples=64, seq_len=128)
    (advice,) = [a for a in p.advice if "OFFCACHE_HOST_LIMIT=" in a]
    assert "risking the kernel's OOM killer" in advice
    assert offcache.engine.parse_size(advice.split("OFFCACHE_HOST_LIMIT=")[1].split()[0]) <= peak // 2
    # With no disk tier the advice says where the rest would have to go.
    engine_config(backend="host", pinned_limit="1MiB", host_limit=peak, disk_dir="none")
    monkeypatch.setattr(machine, "usable_memory_bytes", lambda: peak)
    (advice,) = [a for a in plan.estimate(shape=SHAPE, samples=64, seq_len=128).advice if "OFFCACHE_HOST_LIMIT=" in a]
    assert "OFFCACHE_DISK_DIR" in advice and "there is none now" in advice


def test_weights_are_placed_and_onloaded_per_subgraph(engine_config):
    config = transformers.LlamaConfig(**TINY)
    big = plan.estimate(config, samples=2, seq_len=8, gpu_bytes=1 << 40)
    assert big.weights.placement == "gpu" and big.weights.onload_bytes == 0 and big.seconds_weights == 0
    small = plan.estimate(config, samples=2, seq_len=8, gpu_bytes=1 << 10)
    w = small.weights
    assert w.placement == "cpu" and w.ram_bytes == w.total_bytes and w.onload_bytes == sum(w.per_subgraph)
    assert small.seconds_weights == pytest.approx(w.onload_bytes / 16e9)
    assert plan.estimate(config, samples=2, seq_len=8, onload="cpu").weights.onload_bytes == 0


def test_the_weights_past_memory_go_to_disk(monkeypatch):
    monkeypatch.setattr(offcache.engine.machine, "usable_memory_bytes", lambda: 1 << 20)
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": 4096})
    p = plan.estimate(config, samples=2, seq_len=8, dtype="float32", gpu_bytes=1 << 10)
    w = p.weights
    assert w.placement == "cpu+disk" and w.disk_bytes == w.total_bytes - w.ram_bytes > 0
    assert 0 < w.onload_disk_bytes < w.onload_bytes
    assert p.seconds_weights == pytest.approx((w.onload_bytes - w.onload_disk_bytes) / 16e9 + w.onload_disk_bytes / 2e9)


@pytest.mark.parametrize(
    "kwargs, match",
    [({"samples": 0}, "samples"), ({"samples": True}, "samples"), ({"seq_len": 2.5}, "seq_len"),
     ({"batch_size": -1}, "batch_size"), ({"dtype": "float33"}, "dtype"), ({"dtype": "int8"}, "dtype"),
     ({"onload": "tpu"}, "onload"), ({"pinned_gbps": 0}, "pinned_gbps"),
     ({"pageable_gbps": float("nan")}, "pageable_gbps"), ({"pinned_gbps": float("inf")}, "pinned_gbps"),
     ({"disk_read_gbps": -1}, "disk_read_gbps"), ({"collator": "pad"}, "collator"),
     ({"targets_per_subgraph": 0}, "targets_per_subgraph"), ({"sequential_targets": []}, "sequential_targets")],
)  # fmt: skip
def test_bad_arguments_are_named(kwargs, match):
    args = {"samples": 4, "seq_len": 16, **kwargs}
    with pytest.raises(ValueError, match=match):
        plan.estimate(transformers.LlamaConfig(**TINY), **args)


SIZES = ["--layers", "2", "--hidden-size", "64", "--heads", "4", "--samples", "3", "--seq-len", "8"]


@pytest.mark.parametrize(
    "change, flag",
    [(("--heads", "0"), "--heads"), (("--hidden-size", "-64"), "--hidden-size"), (("--layers", "-3"), "--layers"),
     (("--samples", "0"), "--samples"), (("--seq-len", "x"), "--seq-len"), (("--batch-size", "0"), "--batch-size"),
     (("--pinned-gbps", "0"), "--pinned-gbps"), (("--disk-gbps", "-2"), "--disk-gbps"),
     (("--targets-per-subgraph", "0"), "--targets-per-subgraph"), (("--gpu-gib", "inf"), "--gpu-gib")],
)  # fmt: skip
def test_bad_command_lines_are_argparse_errors_naming_the_flag(capsys, change, flag):
    args = list(SIZES)
    if change[0] in args:
        args[args.index(change[0]) + 1] = change[1]
    else:
        args += list(change)
    with pytest.raises(SystemExit) as exc:
        plan.main(args)
    assert exc.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_a_config_that_is_not_there_is_named_without_a_network_wait(tmp_path, capsys):
    for given in (str(tmp_path / "missing"), str(tmp_path), "no-such-org/no-such-model"):
        with pytest.raises(SystemExit):
            plan.main(["--config", given, "--samples", "2", "--seq-len", "8"])
        err = capsys.readouterr().err
        assert repr(given) in err and ("no config.json" in err or "neither a folder" in err), err
    with pytest.raises(SystemExit):
        plan.main(["--model-type", "not-a-model", "--samples", "2", "--seq-len", "8"])
    assert "--model-type 'not-a-model' is not a transformers model type" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan.main(["--hidden-size", "66", "--heads", "4", "--layers", "2", "--samples", "2", "--seq-len", "8"])
    assert "give --head-dim" in capsys.readouterr().err


def test_the_command_line_prints_the_plan(tmp_path, capsys):
    transformers.Gemma2Config(**TINY, head_dim=32).save_pretrained(tmp_path)
    assert plan.main(["--config", str(tmp_path), "--samples", "6", "--seq-len", "24", "--dtype", "float32"]) == 0
    text = capsys.readouterr().out
    p = plan.estimate(tmp_path, samples=6, seq_len=24, dtype="float32")  # a path works as well as a str
    assert f"Cache peak: {p.cache_peak_bytes} bytes" in text and "subgraph 0 (no target):" in text
    assert "traced from the model" in text and "published: NVIDIA H200" in text
    assert f"Weights: {p.weights.total_bytes} bytes" in text and "at 2 GB/s write, 2 GB/s read" in text
    assert "upper bound" in text
    with pytest.raises(SystemExit):
        plan.main(["--samples", "6", "--seq-len", "24"])  # neither --config nor the sizes
    assert "without --config, give --layers, --hidden-size, --heads" in capsys.readouterr().err


def test_bench_results_give_the_disk_bandwidth(tmp_path, capsys):
    rows = [{"direction": "store", "bytes": 1, "offcache_gbps": 9.0}, {"direction": "store", "bytes": 8,
            "offcache_gbps": 1.5}, {"direction": "fetch", "bytes": 8, "offcache_gbps": 3.0}]  # fmt: skip
    (tmp_path / "r.json").write_text(json.dumps({"disk": {"throughput": rows}}))
    assert plan.main([*SIZES, "--bench-results", str(tmp_path / "r.json"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["disk_write_gbps"], got["disk_read_gbps"], got["disk_source"]) == (1.5, 3.0, "given")
    (tmp_path / "r.json").write_text(json.dumps({"transfer": []}))
    with pytest.raises(SystemExit):
        plan.main([*SIZES, "--bench-results", str(tmp_path / "r.json")])
    assert "holds no disk store row" in capsys.readouterr().err


def test_plan_kv_is_kv_size(capsys):
    args = ["--layers", "32", "--tokens", "8192", "--kv-heads", "8", "--head-dim", "128", "--bandwidth-gbps", "50"]
    assert plan.main(["kv", *args]) == 0
    folded = capsys.readouterr().out
    assert kv.main(["size", *args]) == 0
    assert capsys.readouterr().out == folded and "KV cache: 1073741824 bytes = 1.0000 GiB" in folded
    assert plan.main(["kv", "--layers", "1", "--tokens", "2", "--kv-heads", "1", "--head-dim", "128"]) == 0
    assert "KV cache: 1024 bytes = 1 KiB" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        plan.main(["kv", "--layers", "0", "--tokens", "2", "--kv-heads", "1", "--head-dim", "128"])
    assert "argument --layers" in capsys.readouterr().err


def test_json_output_is_the_plan(capsys):
    assert plan.main([*SIZES, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    shape = plan.Shape(layers=2, hidden_size=64, heads=4, kv_heads=4, head_dim=16, intermediate_size=256, vocab_size=0)
    want = plan.estimate(shape=shape, samples=3, seq_len=8).to_dict()
    for key in ("cache_peak_bytes", "d2h_bytes", "h2d_bytes", "weights", "boundaries", "method", "advice"):
        assert got[key] == want[key], key


def test_the_replay_deletes_and_dedups_as_the_engine_does():
    sg = plan_trace.SubgraphValues
    first = sg(["input_ids"], ["input_ids"], {"a": [((0, 0), 100)], "b": [((0, 0), 100)], "c": [((0, 1), 300)]},
               [], 0)  # fmt: skip
    middle = sg(["a", "c"], ["a"], {"d": [((1, 0), 1000)]}, [], 0)
    last = sg(["b", "c", "d"], ["b", "c", "d"], {}, [], 0)
    r = plan_sim.simulate([[first, middle, last]], [{"input_ids": [(("in", 0), 8)]}], onload="cuda", host_limit=1 << 30)
    # a and b are one tensor: stored once (256 bytes aligned), with c (512 aligned) in the same block,
    # which deleting a does not free (b and c live on).
    assert r.peaks == [256, 256 + 768, 768 + 1024, 768 + 1024] and r.d2h_bytes == 8 + 400 + 1000
    assert r.h2d_bytes == 2 * (8 + 400 + (100 + 300 + 1000))


def _groups(per_size, sizes, seq):
    """(count, subgraphs, inputs) runs of consecutive batches of one size, in batch order."""
    out = []
    for b in sizes:
        if out and out[-1][1] is per_size[b]:
            out[-1][0] += 1
        else:
            out.append([1, per_size[b], plan_sim.inputs_of(b, seq)])
    return [tuple(g) for g in out]


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("samples, batch_size, seq", [(1, 1, 8), (7, 2, 24), (10, 3, 16), (9, 4, 40), (5, 5, 12)])
def test_the_grouped_replay_is_the_batch_by_batch_one(family, samples, batch_size, seq):
    # The replay groups batches by shape (full batches, then a remainder batch): the same numbers as
    # replaying every batch, whether its blocks fit under the host limit, spill to disk, or alternate.
    config = config_of(family)
    traced = plan_trace.trace(config, torch.float32, batch_size, seq)
    sizes = [batch_size] * (samples // batch_size) + ([samples % batch_size] if samples % batch_size else [])
    per_size = {b: traced.run(b, seq) for b in set(sizes)}
    for passes, onload, host_limit in itertools.product((1, 2), ("cuda", "cpu"), (1 << 40, 0, 6000, 40000, 123457)):
        each = plan_sim.simulate_each([per_size[b] for b in sizes], [plan_sim.inputs_of(b, seq) for b in sizes],
                                      onload=onload, host_limit=host_limit, passes=passes)  # fmt: skip
        grouped = plan_sim.simulate_groups(_groups(per_size, sizes, seq), onload=onload, host_limit=host_limit,
                                           passes=passes)  # fmt: skip
        assert grouped == each, (passes, onload, host_limit)


@pytest.mark.parametrize("host_limit", [1 << 40, 0, 3000, 50000, 10**6])
def test_the_grouped_replay_of_the_formula_at_many_sizes(host_limit):
    shape = dataclasses.replace(plan.core._formula_weights(dataclasses.replace(SHAPE), torch.float32), layers=4,
                                weight_bytes_per_layer=[1] * 4)  # fmt: skip
    for samples, batch_size, seq in [(40, 3, 8), (33, 8, 5), (64, 1, 3), (17, 16, 7)]:
        sizes = [batch_size] * (samples // batch_size) + ([samples % batch_size] if samples % batch_size else [])
        per_size = {b: plan_sim.formula_subgraphs(shape, b, seq, torch.float32) for b in set(sizes)}
        for onload in ("cuda", "cpu"):
            each = plan_sim.simulate_each([per_size[b] for b in sizes], [plan_sim.inputs_of(b, seq) for b in sizes],
                                          onload=onload, host_limit=host_limit)  # fmt: skip
            grouped = plan_sim.simulate_groups(_groups(per_size, sizes, seq), onload=onload, host_limit=host_limit)
            assert grouped == each, (samples, batch_size, seq, onload)


def test_a_billion_samples_cost_what_ten_do(engine_config, tmp_path):
    import time

    config = config_of("llama")
    for limits in ({}, {"host_limit": "64MiB", "disk_dir": tmp_path}):
        engine_config(backend="host", **limits)
        start = time.perf_counter()
        big = plan.estimate(config, samples=10**9 + 1, seq_len=16, batch_size=4, dtype="float32")
        assert time.perf_counter() - start < 5
        assert big.batches == 250_000_001 and big.input_bytes == (10**9 + 1) * 16 * 16
        small = plan.estimate(config, samples=9, seq_len=16, batch_size=4, dtype="float32")
        assert big.boundaries[1].batch_bytes == small.boundaries[1].batch_bytes
        assert big.boundaries[1].total_bytes == (10**9 + 1) * 16 * 128 * 4
        assert big.cache_peak_bytes > 10**9 * 16 * 128 * 4
    assert big.tiers.disk_bytes > 0 and big.disk_write_bytes > 0
    start = time.perf_counter()
    assert plan.main(["--layers", "2", "--hidden-size", "64", "--heads", "4", "--samples", "100000000",
                      "--seq-len", "2048", "--batch-size", "3"]) == 0  # fmt: skip
    assert time.perf_counter() - start < 5


def test_the_grouped_replay_of_random_pipelines_is_the_batch_by_batch_one():
    # Blocks of random sizes, names kept across subgraphs, stored again, deleted late: with host limits
    # around the blocks' sizes, runs of batches split where stores alternate between memory and disk.
    import random

    rng = random.Random(31)
    sg = plan_trace.SubgraphValues
    for case in range(150):
        kinds, layers = [], rng.randint(1, 5)
        for _size in range(2):
            subgraphs, key = [], 0
            names = ["input_ids"]
            for k in range(layers):
                outputs = {}
                for j in range(rng.randint(0, 3)):
                    name = rng.choice([f"v{k}_{j}", f"v{k}_{j}", *names])  # sometimes a name stored again
                    key += 1
                    outputs[name] = [((k, key), rng.randint(1, 3000))]
                consumed = sorted(set(rng.sample(names, rng.randint(0, len(names)))))
                inputs = sorted(set(rng.sample(names, rng.randint(0, len(names)))))
                subgraphs.append(sg(inputs, consumed, outputs, [], 0))
                names = sorted((set(names) - set(consumed)) | set(outputs))
            subgraphs.append(sg(names, names, {}, [], 0))
            kinds.append((subgraphs, {"input_ids": [(("in", 0), rng.randint(1, 600))]}))
        counts = [rng.randint(1, 40), rng.randint(0, 1)]
        every = [k for k, n in zip(kinds, counts) for _ in range(n)]
        limit = rng.choice([0, rng.randint(1, 5000), rng.randint(1, 40000), 1 << 40])
        onload = rng.choice(["cuda", "cpu"])
        each = plan_sim.simulate_each([s for s, _ in every], [i for _, i in every], onload=onload, host_limit=limit)
        grouped = plan_sim.simulate_groups([(n, s, i) for (s, i), n in zip(kinds, counts)], onload=onload,
                                           host_limit=limit)  # fmt: skip
        assert grouped == each, case
        assert plan_sim.simulate([s for s, _ in every], [i for _, i in every], onload=onload,
                                 host_limit=limit) == each  # fmt: skip


def test_a_long_alternating_run_is_taken_at_once_and_exactly(monkeypatch):
    # Stores that alternate between memory and disk (a big block fits each time the small freed ones
    # make room) are a rotation: taken at once, the totals are those of every batch. With one store
    # per batch, which batches fitted does not matter later, so every number but the disk's peak (a
    # bound) is exact.
    import random

    rng = random.Random(5)
    monkeypatch.setattr(plan_sim, "FAST_FORWARD", 1)
    sg = plan_trace.SubgraphValues
    taken = 0
    for case in range(600):
        first = sg(["input_ids"], ["input_ids"], {"h": [((0, 0), rng.randint(1, 20000))]}, [], 0)
        last = sg(["h"], ["h"], {}, [], 0)
        inputs = {"input_ids": [(("in", 0), rng.randint(1, 3000))]}
        n, limit = rng.randint(1, 300), rng.choice([rng.randint(0, 10**5), rng.randint(0, 3 * 10**6)])
        onload = rng.choice(["cuda", "cpu"])
        each = plan_sim.simulate_each([[first, last]] * n, [inputs] * n, onload=onload, host_limit=limit)
        grouped = plan_sim.simulate_groups([(n, [first, last], inputs)], onload=onload, host_limit=limit)
        taken += grouped.approximate
        assert dataclasses.replace(grouped, disk_peak_bytes=0, approximate=False) == dataclasses.replace(
            each, disk_peak_bytes=0
        ), case
        assert grouped.disk_peak_bytes >= each.disk_peak_bytes
    assert taken > 100


def test_an_approximate_disk_split_is_said_so(engine_config, tmp_path):
    engine_config(backend="host", host_limit="1MiB", disk_dir=tmp_path)
    p = plan.estimate(shape=SHAPE, samples=10**6, seq_len=16)
    assert plan.core.SPLIT_APPROXIMATE in p.advice and "approximate" in plan.render(p)
    engine_config(backend="host", host_limit="1TiB", disk_dir=tmp_path)
    assert plan.core.SPLIT_APPROXIMATE not in plan.estimate(shape=SHAPE, samples=10**6, seq_len=16).advice


@pytest.mark.parametrize(
    "make, limit, name",
    [(lambda t: t.OPTConfig(**config_of("opt").to_dict() | {"max_position_embeddings": 32}), 32,
      "max_position_embeddings"),
     (lambda t: t.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=96, n_positions=32), 32, "n_positions"),
     (lambda t: t.GPTNeoConfig(hidden_size=64, num_layers=2, num_heads=4, vocab_size=96,
                               attention_types=[[["global"], 2]], max_position_embeddings=32), 32,
      "max_position_embeddings")],
)  # fmt: skip
def test_a_sequence_past_learned_positions_is_an_error_naming_the_limit(make, limit, name, capsys, tmp_path):
    config = make(transformers)
    assert plan.estimate(config, samples=2, seq_len=limit, dtype="float32").method == "traced"
    with pytest.raises(ValueError, match=f"seq_len 48 .* {limit} learned positions .*{name}={limit}"):
        plan.estimate(config, samples=2, seq_len=48, dtype="float32")
    config.save_pretrained(tmp_path)
    with pytest.raises(SystemExit):
        plan.main(["--config", str(tmp_path), "--samples", "2", "--seq-len", "48"])
    assert f"{name}={limit}" in capsys.readouterr().err


def test_a_sequence_past_rope_positions_is_a_warning_and_alibi_has_none():
    config = transformers.LlamaConfig(**{**TINY, "max_position_embeddings": 32})
    within = plan.estimate(config, samples=2, seq_len=32, dtype="float32")
    assert not any("max_position_embeddings" in a for a in within.advice)
    past = plan.estimate(config, samples=2, seq_len=48, dtype="float32")
    (line,) = [a for a in past.advice if "max_position_embeddings=32" in a]
    assert "--seq-len 48" in line and "rotary" in line and past.method == "traced"
    bloom = transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=96)
    p = plan.estimate(bloom, samples=2, seq_len=4096, dtype="float32")
    assert not any("position" in a for a in p.advice)


def test_compressed_tensors_share_without_compressed_tensors_is_read_from_meminfo(monkeypatch):
    """The planner's offload section where compressed-tensors (and psutil) are not installed: the host's
    available memory from /proc/meminfo, less extra_cpu_mem, as compressed-tensors computes it."""
    import sys

    from offcache.engine import machine
    from offcache.weights.memory import placement

    monkeypatch.setitem(sys.modules, "compressed_tensors.offload.load", None)  # its import raises ImportError
    monkeypatch.setattr(machine, "available_ram_bytes", lambda: 7 << 30)
    assert placement.upstream_share(1 << 30) == 6 << 30
    monkeypatch.undo()
    assert 0 < machine.available_ram_bytes() <= machine.total_ram_bytes()
