"""The node region on the engine (offcache/weights/node/: cpu.py, region.py), 2 ranks, gloo, host backend.

Every rank registers its mappings of the region once (the host backend's bookkeeping; CUDA's
cudaHostRegister in tests/weights/node/test_gpu_weights_node.py), the region counts once per node
against the pinned budget, onloads are engine fetches from it, prefetched one subgraph ahead as
with one process, bit-identical to compressed-tensors' DistributedCPUCache, and a write by one
rank after a barrier makes another rank's prefetched copy stale (the region's generation words).
A registration that fails at set-up falls back to compressed-tensors' class; one that fails later
leaves that mapping pageable, with one warning.
"""

import pytest

pytest.importorskip("compressed_tensors")

from tests.weights.node.weights_node_engine_worker import W  # noqa: E402
from tests.weights.node.weights_node_worker import Group  # noqa: E402

SHAPES = [((16, 24), "float32"), ((24,), "bfloat16"), ((3, 5), "int8"), ((0, 4), "float16")]


@pytest.fixture(scope="module")
def group():
    g = Group(2, setup="setup_node")
    yield g
    g.close()


def test_onloads_are_engine_fetches_from_the_registered_region_and_match_compressed_tensors(group):
    flags = group.call(W + "offload_pair", "a", SHAPES)
    for f in flags:
        assert all(f["shared"]) and all(f["pinned"]), f  # every offloaded tensor views a registered mapping
    group.call(W + "mark")
    results = group.call(W + "onload_both", "a")
    assert results[0] == results[1]
    for name, (ours, theirs, same_grad) in results[0].items():
        assert ours == theirs and same_grad, name  # type, dtype, shape and bytes
    for d in group.call(W + "since"):
        assert d.get("shared_fetches", 0) >= 3, d  # the empty tensor needs no copy
        assert d["shared_fetch_bytes"] == d["shared_pinned_fetch_bytes"] == 16 * 24 * 4 + 24 * 2 + 15, d
        assert "shared_registrations" not in d, d  # onloads register nothing: mapped once


def test_the_region_is_registered_once_per_rank_and_counts_once_per_node(group):
    group.call(W + "offload_pair", "b", [((256, 256), "float32")])  # 256 KiB: a span of its own
    before = group.call(W + "engine_stats")
    for _ in range(3):
        group.call(W + "onload_both", "b")
    after = group.call(W + "engine_stats")
    stats = group.call(W + "node_stats")
    for b, a, s in zip(before, after, stats):
        assert a["shared_registrations"] == b["shared_registrations"]  # no registration per onload
        assert a["shared_register_failures"] == 0
        assert s["registered_bytes"] == s["mapped_bytes"] > 256 * 256 * 4
        # each of the node's 2 ranks counts half of every mapping: the node counts it once
        assert s["node_ranks"] == 2
        assert abs(2 * s["pinned_share_bytes"] - s["registered_bytes"]) <= 4096 * s["mapped_spans"]
        # the arena's budget is the pinned budget less the share
        assert a["pinned_limit_bytes"] + s["pinned_share_bytes"] == s["pinned_budget"]
    assert stats[0]["mapped_bytes"] == stats[1]["mapped_bytes"]


def test_prefetch_one_subgraph_ahead_bit_identical_to_distributed_cpu_cache(group):
    ours = group.call(W + "pipeline", 4, 32, "cpu", True)
    theirs = group.call(W + "pipeline", 4, 32, "cpu", False)
    for rank in range(2):
        assert ours[rank]["kinds"] == ["NodeSharedCPUCache"], ours[rank]["kinds"]
        assert theirs[rank]["kinds"] == ["DistributedCPUCache"], theirs[rank]["kinds"]
        assert ours[rank]["outs"] == theirs[rank]["outs"]  # bit-identical, subgraph by subgraph
        records = ours[rank]["records"]
        assert [r["index"] for r in records] == [0, 1, 2, 3]
        assert records[0]["hits"] == 0 and records[0]["misses"] == 2
        for r in records[1:]:
            assert r["hits"] == 2 and r["misses"] == 0, r  # weight and bias came prefetched
        c = ours[rank]["counters"]
        assert c["weight_prefetch_hits"] == 6 and c["shared_fetches"] >= 4, c
        assert c.get("weight_prefetch_stale", 0) == 0, c


def test_a_write_after_a_barrier_makes_another_rank_s_prefetched_copy_stale(group):
    group.call(W + "offload_pair", "c", [((8, 8), "float32"), ((8,), "float32")])
    issued = group.call(W + "prefetch", "c")
    assert issued == [8 * 8 * 4 + 8 * 4] * 2
    g0 = group.call(W + "generation", "c", "t0")
    group.call(W + "barrier")
    group.call(W + "mark")
    group.call(W + "write", "c", "t0", 99, 0)  # rank 0 writes t0
    group.call(W + "barrier")
    g1 = group.call(W + "generation", "c", "t0")
    assert g1[0] == g1[1] == g0[0] + 2
    results = group.call(W + "onload_both", "c")
    for rank, result in enumerate(results):
        for name, (ours, theirs, _) in result.items():
            assert ours == theirs, (rank, name)  # the new t0 everywhere, as compressed-tensors' class
    d0, d1 = group.call(W + "since")
    # rank 1 had prefetched the old t0: its generation changed, so the copy was not served
    assert d1["weight_prefetch_stale"] == 1 and d1["weight_prefetch_hits"] == 1, d1
    # rank 0 wrote it: its own update dropped its copy (no generation check needed)
    assert d0.get("weight_prefetch_stale", 0) == 0 and d0["weight_prefetch_hits"] == 1, d0


def test_a_prefetch_issued_while_a_rank_writes_is_never_served(group):
    group.call(W + "offload_pair", "d", [((4, 4), "float32")])
    group.call(W + "generation", "d", "t0", per_rank=[("d", "t0", 1), ("d", "t0", 0)])  # rank 0: writing
    group.call(W + "barrier")
    group.call(W + "prefetch", "d")
    group.call(W + "generation", "d", "t0", per_rank=[("d", "t0", 1), ("d", "t0", 0)])  # done, no new bytes
    group.call(W + "mark")
    group.call(W + "onload_both", "d")
    for d in group.call(W + "since"):
        assert d["weight_prefetch_stale"] == 1 and d.get("weight_prefetch_hits", 0) == 0, d


def test_registration_failing_at_set_up_falls_back_to_compressed_tensors_class(group):
    results = group.call(W + "fallback_by_registration", per_rank=[(False,), (True,)])
    for result in results:
        assert result["class"] == "DistributedCPUCache", result
        assert len(result["warnings"]) == 1, result
        text = result["warnings"][0]
        assert "NodeRegionFallbackWarning" in text and "registering the node region" in text, text
        assert "RLIMIT_MEMLOCK is 64 KiB" in text, text  # the reason, named on every rank
        assert result["stats"]["decided"] == "fallback"


def test_a_later_registration_failure_leaves_that_mapping_pageable_with_one_warning(group):
    group.call(W + "fail_next_registration", 1)
    try:
        first = group.call(W + "caught_offload", "e", [((64, 64), "float32")])
        second = group.call(W + "caught_offload", "f", [((64, 64), "float32")], 1)
    finally:
        group.call(W + "reset_register_chunk")
    assert first[0]["pinned"] == [True] and first[0]["warnings"] == []
    assert first[1]["pinned"] == [False] and first[1]["shared"] == [True]
    assert len(first[1]["warnings"]) == 1 and "NodeRegionPinWarning" in first[1]["warnings"][0]
    assert "out of memory (injected)" in first[1]["warnings"][0]
    assert second[1]["pinned"] == [True] and second[1]["warnings"] == []  # once, and the next one pins
    group.call(W + "mark")
    for name in ("e", "f"):
        results = group.call(W + "onload_both", name)
        assert results[0] == results[1]
        assert all(ours == theirs for ours, theirs, _ in results[0].values())
    d0, d1 = group.call(W + "since")
    assert d0["shared_pinned_fetch_bytes"] == d0["shared_fetch_bytes"] == 2 * 64 * 64 * 4
    assert d1["shared_fetch_bytes"] == 2 * 64 * 64 * 4 and d1["shared_pinned_fetch_bytes"] == 64 * 64 * 4
    stats = group.call(W + "node_stats")
    assert stats[0]["unpinned"] == [] and len(stats[1]["unpinned"]) == 1
    assert stats[1]["registered_bytes"] < stats[1]["mapped_bytes"]


def test_chunked_registration_undoes_the_chunks_made_when_one_fails(group):
    # 16 KiB registration chunks: a 64 KiB batch is 4 of them (plus the generation words' page).
    group.call(W + "fail_next_registration", 1, 2, 16 << 10)
    try:
        before = group.call(W + "engine_stats")
        group.call(W + "caught_offload", "g", [((128, 128), "float32")])
        after = group.call(W + "engine_stats")
        group.call(W + "caught_offload", "h", [((128, 128), "float32")])
        last = group.call(W + "engine_stats")
    finally:
        group.call(W + "reset_register_chunk")
    span = 64 << 10
    pages = -(-(span + 64) // 4096) * 4096  # the batch: its generation words, then the tensor
    chunks = -(-pages // (16 << 10))
    assert after[0]["shared_registrations"] - before[0]["shared_registrations"] == chunks
    # rank 1: chunks 0 and 1 made, chunk 2 failed: the two made were undone, the mapping is pageable
    assert after[1]["shared_registrations"] - before[1]["shared_registrations"] == 2
    assert after[1]["shared_register_failures"] == before[1]["shared_register_failures"] + 1
    assert after[1]["shared_registered_bytes"] == before[1]["shared_registered_bytes"]
    assert after[1]["shared_pinned_share_bytes"] == before[1]["shared_pinned_share_bytes"]
    for b, a in zip(after, last):
        assert a["shared_registrations"] - b["shared_registrations"] == chunks
        assert a["shared_registered_bytes"] - b["shared_registered_bytes"] == pages


def test_a_mapping_past_the_pinned_budget_is_left_pageable(group):
    old = group.call(W + "set_pinned_limit", 1)  # no room: the share of any new mapping is past it
    try:
        results = group.call(W + "caught_offload", "i", [((8, 8), "float32")])
    finally:
        group.call(W + "set_pinned_limit", per_rank=[(o,) for o in old])
    for result in results:
        assert result["pinned"] == [False] and result["shared"] == [True]
    stats = group.call(W + "node_stats")
    assert all("pinned budget" in s["unpinned"][-1] for s in stats), stats
    values = group.call(W + "onload_both", "i")
    assert all(ours == theirs for ours, theirs, _ in values[0].values())


def test_a_dropped_region_is_unregistered_and_unmapped_once_no_tensor_views_it(group):
    group.call(W + "offload_pair", "j", [((512, 512), "float32")])  # 1 MiB
    group.call(W + "prefetch", "j")
    for stats in group.call(W + "engine_stats"):
        assert stats["shared_mappings"] >= 2 and stats["shared_registered_bytes"] > 1 << 20
    for stats in group.call(W + "drop_all"):  # every cache and prefetched copy dropped, the node reset
        assert stats["shared_mappings"] == stats["shared_mapped_bytes"] == 0, stats
        assert stats["shared_registered_bytes"] == stats["shared_pinned_share_bytes"] == 0, stats
        assert stats["shared_deferred_unmaps"] == 0, stats
