"""The planner with offloaded weights under a memory limit (offcache.plan.offload): the run-time placement rule,
the activations' tiers, disk reads and time, the expected peak, and the command line."""

from __future__ import annotations

import json

import pytest
import torch

import offcache.plan as plan
from offcache.engine import machine
from offcache.plan import offload as plan_offload
from offcache.weights.bookkeeping import prefetch_depth

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from offcache.weights.memory import placement  # noqa: E402

MiB = 1 << 20
ARGS = dict(samples=4, seq_len=16, uniform_lengths=True, onload="cpu", dtype="float32")


def test_the_plan_places_the_weights_as_the_run_does(tiny_model_dir, engine_config, tmp_path, monkeypatch):
    """The same host limit in the planner and in a real load_offloaded_model(device_map="auto_offload") under
    patch_llmcompressor(weights=True): the same bytes on the CPU and on disk, the same reason."""
    from compressed_tensors.offload import load_offloaded_model

    import offcache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(placement, "_folder", [])  # the offload folder this test's load makes, not kept for later
    (tmp_path / "tier").mkdir()
    engine_config(backend="host", host_limit="512KiB", disk_dir=str(tmp_path / "tier"))
    p = plan.estimate(checkpoint=tiny_model_dir, offload_weights=True, working_set=0, **ARGS)
    o = p.offload
    assert o.checkpoint == str(tiny_model_dir) and o.cpu_share_bytes == 512 << 10
    assert o.cpu_bytes <= 512 << 10 < o.disk_bytes
    offcache.patch_llmcompressor(weights=True)
    try:
        with load_offloaded_model():
            model = transformers.AutoModelForCausalLM.from_pretrained(
                tiny_model_dir, dtype=torch.float32, device_map="auto_offload"
            )
        where = placement.placement(model)
        _, why = placement.cpu_share(placement.upstream_share())
    finally:
        offcache.unpatch_llmcompressor()
    assert (where["cpu"], where["disk"]) == (o.cpu_bytes, o.disk_bytes)
    assert o.why.split(", under ")[0] == why.split(", under ")[0]  # compressed-tensors' share is read at each call
    assert p.weights.placement == "cpu+disk"
    assert (p.weights.ram_bytes, p.weights.disk_bytes) == (o.cpu_bytes, o.disk_bytes)


def test_the_memory_limit_sets_the_default_host_limit_and_the_cpu_share(tiny_model_dir, engine_config):
    engine_config(backend="host", disk_dir="none")  # the default host limit: 25 % of memory
    limit = 4 * MiB
    p = plan.estimate(checkpoint=tiny_model_dir, offload_weights=True, memory_limit=limit, working_set=0, **ARGS)
    o = p.offload
    assert (p.tiers.memory_bytes, p.tiers.host_limit_bytes, o.host_limit_bytes) == (limit, limit // 4, limit // 4)
    assert o.memory_limit_source == "given" and o.cpu_share_bytes == limit // 4
    assert "25% of the cgroup's limit 4194304 bytes" in o.why and o.why.startswith("offcache's host limit")
    bounds = plan_offload.bounds(limit, limit // 4, "25%")
    assert o.why.split(", under ")[0] == placement.cpu_share(1 << 40, bounds)[1].split(", under ")[0]
    assert o.cpu_bytes + o.disk_bytes == o.weight_bytes and o.cpu_bytes <= limit // 4 < o.weight_bytes
    # The activations: the cache peak in the tiers of that host limit.
    assert o.activation_host_bytes == p.tiers.pinned_bytes + p.tiers.pageable_bytes == p.cache_peak_bytes
    assert o.activation_disk_bytes == 0
    # Without a limit given: this process's memory (its cgroup's limit, else RAM).
    mine = plan.estimate(checkpoint=tiny_model_dir, offload_weights=True, working_set=0, **ARGS).offload
    assert mine.memory_limit_bytes == machine.usable_memory_bytes()
    assert mine.memory_limit_source in ("RAM", "the cgroup's limit")


def test_a_checkpoint_s_bytes_are_placed_and_what_it_lacks_stays_on_the_cpu(tiny_model_dir):
    tensors = plan_offload.checkpoint_tensors(str(tiny_model_dir))
    config = transformers.AutoConfig.from_pretrained(tiny_model_dir)
    cpu, disk, method = plan_offload.place(config, torch.float32, 0, tensors)
    assert "device map" in method
    # No room on the CPU: every checkpoint tensor on disk, the computed rotary buffers (not in the files) on the CPU.
    assert disk == sum(tensors.values())
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert cpu == sum(b.nbytes for n, b in model.named_buffers() if n not in tensors)
    cpu, disk, _ = plan_offload.place(config, torch.float32, 1 << 40, tensors)
    assert disk == 0 and cpu >= sum(tensors.values())


def test_disk_reads_per_pass_and_their_time(tiny_model_dir, engine_config, tmp_path):
    engine_config(backend="host", host_limit="1MiB", disk_dir=str(tmp_path))
    p = plan.estimate(checkpoint=tiny_model_dir, offload_weights=True, working_set=0, disk_write_gbps=1.0,
                      disk_read_gbps=4.0, **{**ARGS, "samples": 64, "seq_len": 128})  # fmt: skip
    o = p.offload
    assert o.activation_read_bytes == p.disk_read_bytes > 0 and o.activation_disk_bytes == p.tiers.disk_bytes > 0
    assert o.pass_read_bytes == o.disk_bytes + p.disk_read_bytes
    assert o.cold_pass_read_bytes == o.cpu_bytes + o.disk_bytes + p.disk_read_bytes
    assert o.save_read_bytes == o.disk_bytes
    assert o.seconds_per_pass == pytest.approx(o.pass_read_bytes / 4e9 + p.disk_write_bytes / 1e9)
    assert o.seconds_cold_pass == pytest.approx(o.cold_pass_read_bytes / 4e9 + p.disk_write_bytes / 1e9)
    assert o.disk_source == "given"


def test_the_expected_peak_and_what_to_do_past_the_limit(tiny_model_dir, engine_config):
    engine_config(backend="host", host_limit="4MiB", disk_dir="none")
    ws = 100 * MiB
    o = plan.estimate(checkpoint=tiny_model_dir, offload_weights=True, working_set=ws, memory_limit=1 << 30,
                      **ARGS).offload  # fmt: skip
    largest = max(sg for sg in plan.estimate(checkpoint=tiny_model_dir, **ARGS).weights.per_subgraph)
    assert o.largest_subgraph_bytes == largest and o.onloads_at_once == 1 + prefetch_depth()
    assert o.expected_peak_bytes == ws + 4 * MiB + o.onloads_at_once * largest
    assert o.peak_if_rewritten_bytes == o.expected_peak_bytes + o.cpu_bytes
    assert o.working_set_source == "given" and o.fits
    # Past the limit: the host limit that keeps offcache within it.
    p = plan.estimate(checkpoint=tiny_model_dir, offload_weights=True, working_set=ws, memory_limit=ws + 3 * MiB,
                      **ARGS)  # fmt: skip
    assert not p.offload.fits
    (said,) = [a for a in p.advice if a.startswith("With offloaded weights")]
    assert "past the memory limit" in said and "OFFCACHE_HOST_LIMIT=" in said
    # Below even one subgraph's weights beside the working set: no placement runs it.
    p = plan.estimate(checkpoint=tiny_model_dir, offload_weights=True, working_set=ws, memory_limit=ws, **ARGS)
    (said,) = [a for a in p.advice if a.startswith("With offloaded weights")]
    assert "DOES NOT FIT" in said and "SubgraphMemoryError" in said


def test_the_working_set_is_measured_here_by_default(tiny_model_dir):
    o = plan.estimate(checkpoint=tiny_model_dir, offload_weights=True, **ARGS).offload
    assert o.working_set_source.startswith("measured") and 50 * MiB < o.working_set_bytes < 64 << 30


def test_the_command_line_says_where_everything_lives(tiny_model_dir, engine_config, capsys):
    engine_config(backend="host", disk_dir="none")
    args = ["--checkpoint", str(tiny_model_dir), "--offload-weights", "--memory-limit", "8MiB", "--onload", "cpu",
            "--samples", "4", "--seq-len", "16", "--dtype", "float32", "--working-set", "1MiB"]  # fmt: skip
    assert plan.main([*args, "--disk-gbps", "3"]) == 0
    text = capsys.readouterr().out
    for said in ("Offloaded weights (patch_llmcompressor(weights=True)", "memory limit 8388608 bytes (8MiB) (given",
                 "  weights placed: ", " on the CPU (the checkpoint's mapping)", "  activations placed: ",
                 "  disk reads: ", "  expected disk time: ", "at 3 GB/s read", "  expected peak: "):  # fmt: skip
        assert said in text, said
    assert plan.main([*args, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["offload"]
    want = plan.estimate(checkpoint=tiny_model_dir, offload_weights=True, memory_limit=8 * MiB, working_set=MiB,
                         **{**ARGS, "uniform_lengths": False}).offload  # fmt: skip
    for key in ("cpu_bytes", "disk_bytes", "host_limit_bytes", "pass_read_bytes", "expected_peak_bytes"):
        assert got[key] == getattr(want, key), key


@pytest.mark.parametrize("bad, flag", [(["--memory-limit", "25%"], "--memory-limit"),
                                       (["--memory-limit", "lots"], "--memory-limit"),
                                       (["--working-set", "-1"], "--working-set")])  # fmt: skip
def test_bad_limits_are_argparse_errors(tiny_model_dir, capsys, bad, flag):
    with pytest.raises(SystemExit) as exc:
        plan.main(["--checkpoint", str(tiny_model_dir), "--offload-weights", "--samples", "2", "--seq-len", "8", *bad])
    assert exc.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_offloaded_weights_need_a_model_not_only_its_sizes(tmp_path):
    shape = plan.Shape(layers=2, hidden_size=64, heads=4, kv_heads=4, head_dim=16, intermediate_size=256, vocab_size=0)
    with pytest.raises(ValueError, match="offload_weights needs the model's config"):
        plan.estimate(shape=shape, samples=2, seq_len=8, offload_weights=True)
    with pytest.raises(ValueError, match="checkpoint"):
        plan.estimate(checkpoint=tmp_path / "missing", samples=2, seq_len=8, offload_weights=True)
    (tmp_path / "config.json").write_text(json.dumps(transformers.LlamaConfig(num_hidden_layers=1).to_dict()))
    with pytest.raises(ValueError, match="no .safetensors file"):
        plan.estimate(checkpoint=tmp_path, samples=2, seq_len=8, offload_weights=True)
