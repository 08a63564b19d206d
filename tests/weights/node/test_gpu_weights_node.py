"""The node region on CUDA: two ranks on one GPU (gloo), each registering its mappings of the region
with cudaHostRegister (in chunks, at the same time as the other rank), onloading from pinned memory
asynchronously, prefetching, and unregistering before unmapping."""

import pytest

pytest.importorskip("compressed_tensors")

from tests.weights.node.weights_node_engine_worker import W  # noqa: E402
from tests.weights.node.weights_node_worker import Group  # noqa: E402

pytestmark = pytest.mark.gpu

CUDA_ENV = [{"OFFCACHE_BACKEND": "cuda", "CUDA_VISIBLE_DEVICES": "0"}] * 2


@pytest.fixture(scope="module")
def group():
    g = Group(2, env=CUDA_ENV, setup="setup_node", timeout=180)
    yield g
    g.close()


def test_cuda_registration_of_every_rank_s_mappings_and_pinned_onloads(group):
    assert group.call(W + "backend") == ["cuda", "cuda"]
    before = group.call(W + "engine_stats")
    flags = group.call(W + "offload_pair", "a", [((1024, 2048), "float32"), ((2048,), "bfloat16")], "cuda")
    after = group.call(W + "engine_stats")
    for f, b, a in zip(flags, before, after):
        assert f["pinned"] == [True, True], f
        assert a["shared_registrations"] - b["shared_registrations"] == 1, (b, a)  # one 64 GiB chunk at most
        assert a["shared_register_failures"] == b["shared_register_failures"]
    assert group.call(W + "host_pinned", "a") == [True, True]  # the driver sees the mapping as pinned
    group.call(W + "mark")
    results = group.call(W + "onload_both", "a")
    assert results[0] == results[1]
    assert all(ours == theirs and grad for ours, theirs, grad in results[0].values())
    for d in group.call(W + "since"):
        assert d["shared_pinned_fetch_bytes"] == d["shared_fetch_bytes"] == 1024 * 2048 * 4 + 2048 * 2, d
        assert d.get("syncs", 0) == 0, d  # no copy from pageable memory blocked the caller


def test_cuda_registration_in_chunks_and_copies_across_their_boundaries(group):
    # 2 MiB registration chunks: a 8 MiB batch is registered in 5 (4 and the generation words' page);
    # the 8 MiB tensor crosses 4 chunk boundaries.
    group.call(W + "fail_next_registration", -1, -1, 2 << 20)
    try:
        before = group.call(W + "engine_stats")
        flags = group.call(W + "offload_pair", "b", [((1024, 2048), "float32"), ((2048,), "bfloat16")], "cuda", 5)
        after = group.call(W + "engine_stats")
    finally:
        group.call(W + "reset_register_chunk")
    for f, b, a in zip(flags, before, after):
        assert f["pinned"] == [True, True], f
        assert a["shared_registrations"] - b["shared_registrations"] == 5, (b, a)
    results = group.call(W + "onload_both", "b")
    assert all(ours == theirs for ours, theirs, _ in results[0].values())


def test_cuda_registration_failure_undoes_the_chunks_made(group):
    group.call(W + "fail_next_registration", 1, 2, 2 << 20)
    try:
        flags = group.call(W + "caught_offload", "e", [((1024, 1024), "float32")])
    finally:
        group.call(W + "reset_register_chunk")
    assert flags[0]["pinned"] == [True] and flags[1]["pinned"] == [False]
    assert group.call(W + "host_pinned", "e") == [True, False]  # rank 1's 2 chunks made were unregistered
    results = group.call(W + "onload_both", "e")
    assert all(ours == theirs for ours, theirs, _ in results[1].values())


def test_cuda_prefetch_one_subgraph_ahead_bit_identical(group):
    ours = group.call(W + "pipeline", 4, 256, "cuda", True)
    theirs = group.call(W + "pipeline", 4, 256, "cuda", False)
    for rank in range(2):
        assert ours[rank]["kinds"] == ["NodeSharedCPUCache"]
        assert ours[rank]["outs"] == theirs[rank]["outs"]
        for r in ours[rank]["records"][1:]:
            assert r["hits"] == 2 and r["misses"] == 0 and r["host_waits"] == 0, r


def test_cuda_write_after_a_barrier_makes_a_prefetched_copy_stale(group):
    group.call(W + "offload_pair", "c", [((64, 64), "float32")], "cuda")
    group.call(W + "prefetch", "c")
    group.call(W + "barrier")
    group.call(W + "mark")
    group.call(W + "write", "c", "t0", 7, 0)
    group.call(W + "barrier")
    results = group.call(W + "onload_both", "c")
    assert all(ours == theirs for ours, theirs, _ in results[1].values())
    assert group.call(W + "since")[1]["weight_prefetch_stale"] == 1


def test_cuda_registration_during_a_graph_capture_keeps_the_capture(group):
    assert group.call(W + "map_during_capture") == [True, True]


def test_cuda_mappings_unregistered_before_unmap(group):
    group.call(W + "offload_pair", "d", [((512, 512), "float32")], "cuda")
    for stats in group.call(W + "drop_all"):
        assert stats["shared_mappings"] == stats["shared_registered_bytes"] == 0, stats
        assert stats["shared_unregister_failures"] == 0, stats


# --- the sliced mode (offcache/weights/node/sliced.py): NCCL between two GPUs -------------------------


@pytest.fixture(scope="module")
def nccl_group():
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        pytest.skip(f"the sliced mode's CUDA path needs 2 GPUs (an NCCL all-gather between them); found {gpus}")
    env = [{"OFFCACHE_BACKEND": "cuda", "CUDA_VISIBLE_DEVICES": str(r), "OFFCACHE_TEST_PG": "nccl"} for r in range(2)]
    g = Group(2, env=env, setup="setup_node", timeout=300)
    yield g
    g.close()


def test_cuda_sliced_walk_bit_identical_to_full_and_to_distributed_cpu_cache(nccl_group):
    from tests.weights.node.weights_node_sliced_worker import S

    group = nccl_group
    assert group.call(W + "backend") == ["cuda", "cuda"]
    assert group.call(S + "use_mode", "full") == [False, False]
    full = group.call(S + "model_walk", 4, 257, "cuda", "ours")
    theirs = group.call(S + "model_walk", 4, 257, "cuda", "theirs")
    assert group.call(S + "use_mode", "sliced") == [True, True]
    try:
        sliced = group.call(S + "model_walk", 4, 257, "cuda", "ours")
    finally:
        group.call(S + "use_mode", "full")
    for rank in range(2):
        assert sliced[rank]["outs"] == full[rank]["outs"] == theirs[rank]["outs"]  # bit-identical
        for r in sliced[rank]["records"][1:]:
            # every weight came from the gather; the consumer's stream waited on it, the host did not
            assert r["hits"] == 6 and r["misses"] == 0 and r["host_waits"] == 0, r
        c = sliced[rank]["counters"]
        assert c["weight_sliced_prefetches"] == 3 and c.get("weight_prefetch_skips", 0) == 0, c
        assert 0.3 * c["weight_prefetch_bytes"] < c["weight_sliced_fetch_bytes"] < 0.7 * c["weight_prefetch_bytes"], c
        assert sum(sliced[rank]["collectives"].values()) == 2 * 3, sliced[rank]["collectives"]


def test_cuda_sliced_prefetch_then_write_and_misses_need_no_collective(nccl_group):
    from tests.weights.node.weights_node_sliced_worker import S

    group = nccl_group
    group.call(S + "use_mode", "sliced")
    try:
        group.call(S + "offload_pair", "g", [((333, 77), "float32"), ((7,), "bfloat16"), ((3, 5), "int8")], "cuda")
        for r in group.call(S + "prefetch", ["g"], 1):
            assert sum(r["collectives"].values()) == 2 and r["counters"]["weight_sliced_prefetches"] == 1, r
        group.call(S + "write", "g", "t0", 5, 0)
        group.call(S + "mark")
        for r in group.call(S + "onload", "g"):
            assert r["collectives"] == {}, r  # a stale copy (rank 1) or a dropped one (rank 0) fetched alone
            assert all(ours == theirs for ours, theirs in r["values"].values()), r
        writer, reader = group.call(S + "since")
        assert reader["weight_prefetch_stale"] == 1 and reader["weight_prefetch_hits"] == 2, reader
        assert writer["weight_prefetch_hits"] == 2, writer
    finally:
        group.call(S + "use_mode", "full")
