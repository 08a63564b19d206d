"""The planner for a torchrun job (python -m offcache.plan --nproc-per-node N [--nnodes M]): every rank
its own activation cache over its share of the samples, the offloaded weights once per node."""

import json

import pytest

import offcache
import offcache.plan as plan

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")

TINY = dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2)  # fmt: skip
SHAPE = plan.Shape(layers=3, hidden_size=128, heads=4, kv_heads=2, head_dim=32, intermediate_size=256, vocab_size=96)
SIZES = ["--layers", "2", "--hidden-size", "64", "--heads", "4", "--samples", "12", "--seq-len", "8"]


def _partition(samples: int, world: int) -> list[int]:
    """llm-compressor's split of the calibration set (datasets/utils.py, _get_partition_start_end)."""
    return [samples * (i + 1) // world - samples * i // world for i in range(world)]


@pytest.mark.parametrize("samples, nproc, nnodes", [(64, 4, 1), (10, 4, 1), (10, 2, 2), (7, 3, 1)])
def test_each_rank_caches_its_share_of_the_samples(engine_config, samples, nproc, nnodes):
    engine_config(backend="host", disk_dir="none")
    job = plan.estimate(shape=SHAPE, samples=samples, seq_len=16, nproc_per_node=nproc, nnodes=nnodes)
    share = max(_partition(samples, nproc * nnodes))
    alone = plan.estimate(shape=SHAPE, samples=share, seq_len=16)
    n = job.node
    assert (n.nproc_per_node, n.nnodes, n.world_size, n.samples_per_rank) == (nproc, nnodes, nproc * nnodes, share)
    assert job.samples == samples and job.batches == share  # batch size 1: the largest rank's batches
    # The cache lines are one rank's: the same replay as a run of its share alone.
    assert job.cache_peak_bytes == alone.cache_peak_bytes and job.input_bytes == alone.input_bytes
    assert job.d2h_bytes == alone.d2h_bytes and job.h2d_bytes == alone.h2d_bytes
    t = job.tiers
    assert n.cache_host_bytes == nproc * (t.pinned_bytes + t.pageable_bytes)
    assert n.cache_disk_bytes == nproc * t.disk_bytes


def test_percent_limits_are_shared_by_the_node_s_ranks_and_byte_limits_are_per_rank(engine_config):
    engine_config(backend="host", pinned_limit="8%", host_limit="40%", disk_dir="none")
    one, four = (plan.estimate(shape=SHAPE, samples=8, seq_len=16, nproc_per_node=k) for k in (1, 4))
    assert four.tiers.host_limit_bytes == pytest.approx(one.tiers.host_limit_bytes / 4, abs=4)
    assert four.tiers.pinned_limit_bytes == pytest.approx(one.tiers.pinned_limit_bytes / 4, abs=4)
    assert four.node.weight_region_limit_bytes == pytest.approx(one.tiers.host_limit_bytes, abs=16)
    engine_config(backend="host", pinned_limit="1MiB", host_limit="3MiB", disk_dir="none")
    four = plan.estimate(shape=SHAPE, samples=8, seq_len=16, nproc_per_node=4)
    assert (four.tiers.pinned_limit_bytes, four.tiers.host_limit_bytes) == (1 << 20, 3 << 20)
    assert four.node.weight_region_limit_bytes == 4 * (3 << 20)
    assert four.tiers.pinned_bytes == min(four.cache_peak_bytes, 1 << 20)
    offcache.engine.set_pinned_limit("2%")  # a budget set later is taken as given too
    one, four = (plan.estimate(shape=SHAPE, samples=8, seq_len=8, nproc_per_node=k) for k in (1, 4))
    assert four.tiers.pinned_limit_bytes == pytest.approx(one.tiers.pinned_limit_bytes / 4, abs=4)
    assert four.tiers.pinned_limit_bytes > 0


def test_offloaded_weights_count_once_per_node(engine_config):
    engine_config(backend="host", disk_dir="none")
    config = transformers.LlamaConfig(**TINY)
    one = plan.estimate(config, samples=8, seq_len=8, gpu_bytes=1 << 10)
    job = plan.estimate(config, samples=8, seq_len=8, gpu_bytes=1 << 10, nproc_per_node=8)
    w, n = job.weights, job.node
    assert w.placement == "cpu" and w.ram_bytes == w.total_bytes == one.weights.total_bytes
    assert n.weight_host_bytes == w.ram_bytes  # one region per node, not one copy per rank
    assert n.per_rank_copies_bytes == 8 * w.ram_bytes
    assert n.host_bytes == n.cache_host_bytes + n.weight_host_bytes
    # Every rank still onloads every subgraph's weights.
    assert w.onload_bytes == sum(w.per_subgraph) == one.weights.onload_bytes
    # Weights on the GPU (they fit): nothing in host memory for them.
    big = plan.estimate(config, samples=8, seq_len=8, gpu_bytes=1 << 40, nproc_per_node=8).node
    assert big.weight_host_bytes == 0 and big.per_rank_copies_bytes == 0


def test_room_for_the_weights_is_what_every_rank_s_cache_leaves(engine_config, monkeypatch):
    engine_config(backend="host", pinned_limit="1GiB", host_limit="1GiB", disk_dir="none")
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": 4096})
    alone = plan.estimate(config, samples=64, seq_len=32, dtype="float32", gpu_bytes=1 << 10)
    peak = min(alone.cache_peak_bytes, alone.tiers.host_limit_bytes)
    total = alone.weights.total_bytes
    # Memory for one cache and the weights, not for four caches and the weights.
    monkeypatch.setattr(offcache.engine.machine, "usable_memory_bytes", lambda: peak + total + 4 * peak // 2)
    one = plan.estimate(config, samples=64, seq_len=32, dtype="float32", gpu_bytes=1 << 10)
    assert one.weights.disk_bytes == 0
    job = plan.estimate(config, samples=256, seq_len=32, dtype="float32", gpu_bytes=1 << 10, nproc_per_node=4)
    assert job.node.samples_per_rank == 64 and job.cache_peak_bytes == alone.cache_peak_bytes
    w = job.weights
    assert w.placement == "cpu+disk" and w.ram_bytes == job.tiers.memory_bytes - 4 * peak
    assert job.node.weight_host_bytes == w.ram_bytes and w.disk_bytes == total - w.ram_bytes


def test_weights_past_the_node_region_s_limit_are_advised(engine_config):
    engine_config(backend="host", pinned_limit="4KiB", host_limit="4KiB", disk_dir="none")
    config = transformers.LlamaConfig(**TINY)
    job = plan.estimate(config, samples=4, seq_len=8, gpu_bytes=1 << 10, nproc_per_node=2)
    assert job.node.weight_host_bytes > job.node.weight_region_limit_bytes == 2 * 4096
    (advice,) = [a for a in job.advice if "NodeRegionFullError" in a]
    assert "OFFCACHE_HOST_LIMIT" in advice and str(job.node.weight_region_limit_bytes) in advice
    alone = plan.estimate(config, samples=4, seq_len=8, gpu_bytes=1 << 10)  # one process: no region
    assert not any("NodeRegionFullError" in a for a in alone.advice)


def test_the_node_region_advice_stays_inside_what_the_machine_holds_safely(engine_config, monkeypatch):
    """A limit that would hold the weights but not leave room for the ranks' working sets is not advised."""
    from offcache.plan import core

    engine_config(backend="host", pinned_limit="4KiB", host_limit="4KiB", disk_dir="none")
    config = transformers.LlamaConfig(**TINY)
    job = plan.estimate(config, samples=4, seq_len=8, gpu_bytes=1 << 10, nproc_per_node=2)
    per_rank = -(-job.node.weight_host_bytes // (2 << 20)) << 20
    monkeypatch.setattr(core, "PROCESS_WORKING_SET", 0)
    monkeypatch.setattr(offcache.engine.machine, "usable_memory_bytes", lambda: 2 * 2 * per_rank - 1)
    job = plan.estimate(config, samples=4, seq_len=8, gpu_bytes=1 << 10, nproc_per_node=2)
    (advice,) = [a for a in job.advice if "NodeRegionFullError" in a]
    assert "more than this machine holds safely" in advice and "offload the weights to disk" in advice
    monkeypatch.setattr(offcache.engine.machine, "usable_memory_bytes", lambda: 2 * 2 * per_rank)
    job = plan.estimate(config, samples=4, seq_len=8, gpu_bytes=1 << 10, nproc_per_node=2)
    (advice,) = [a for a in job.advice if "NodeRegionFullError" in a]
    assert f"OFFCACHE_HOST_LIMIT={per_rank >> 20}MiB" in advice and "or more holds them" in advice


@pytest.mark.parametrize(
    "kwargs, match",
    [({"nproc_per_node": 0}, "nproc_per_node"), ({"nnodes": -1}, "nnodes"), ({"nproc_per_node": 2.5}, "nproc_per_node"),
     ({"samples": 3, "nproc_per_node": 2, "nnodes": 2}, "3 samples.*4 ranks")],
)  # fmt: skip
def test_bad_ranks_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan.estimate(shape=SHAPE, **{"samples": 8, "seq_len": 8, **kwargs})


def test_the_job_comes_from_torchrun_s_environment(engine_config, monkeypatch):
    engine_config(backend="host", disk_dir="none")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("WORLD_SIZE", "8")
    n = plan.estimate(shape=SHAPE, samples=16, seq_len=8).node
    assert (n.nproc_per_node, n.nnodes, n.samples_per_rank) == (4, 2, 2)
    n = plan.estimate(shape=SHAPE, samples=16, seq_len=8, nproc_per_node=2, nnodes=1).node  # given wins
    assert (n.nproc_per_node, n.nnodes, n.samples_per_rank) == (2, 1, 8)
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ValueError, match="WORLD_SIZE 6.*LOCAL_WORLD_SIZE 4"):
        plan.estimate(shape=SHAPE, samples=16, seq_len=8)


def test_the_command_line_takes_torchrun_s_flags(engine_config, capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert plan.main([*SIZES]) == 0
    assert "torchrun job" not in capsys.readouterr().out  # one process: as before
    assert plan.main([*SIZES, "--nproc-per-node", "4", "--nnodes", "2"]) == 0
    text = capsys.readouterr().out
    p = plan.estimate(shape=plan.Shape(layers=2, hidden_size=64, heads=4, kv_heads=4, head_dim=16,
                                       intermediate_size=256, vocab_size=0), samples=12, seq_len=8,
                      nproc_per_node=4, nnodes=2)  # fmt: skip
    assert "torchrun job: 4 ranks per node x 2 nodes = 8 ranks; each rank caches its share" in text
    assert f"up to {p.node.samples_per_rank} of 12 samples" in text
    assert "  per node:" in text and "offloaded weights once" in text
    assert plan.main([*SIZES, "--nproc-per-node", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["node"]["nproc_per_node"] == 4
    with pytest.raises(SystemExit):
        plan.main([*SIZES, "--nproc-per-node", "0"])
    assert "--nproc-per-node" in capsys.readouterr().err
