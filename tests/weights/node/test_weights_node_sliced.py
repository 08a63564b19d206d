"""The node region's sliced onload (OFFCACHE_NODE_ONLOAD=sliced, offcache/weights/node/sliced.py), 2 ranks,
gloo, host backend: each rank fetches its half of a prefetch from the region and the ranks all-gather it,
for real, with the same logic as on GPUs (tests/weights/node/test_gpu_weights_node.py runs it on NCCL).

Results bit-identical to the full mode and to compressed-tensors' DistributedCPUCache; at most 2
collectives per subgraph; ranks that disagree on a prefetch get an error on every rank (not a hang);
a rank without room makes every rank skip; a miss needs no collective; a bad setting is a clear error;
a rank killed mid-run is named by the survivor; a tied weight is one tensor on every rank.
"""

import os
import signal

import pytest

pytest.importorskip("compressed_tensors")

from tests.weights.node.weights_node_sliced_worker import S  # noqa: E402
from tests.weights.node.weights_node_worker import Group, WorkerError  # noqa: E402

N = 4  # subgraphs of the small model
SHAPES = [((16, 24), "float32"), ((7,), "bfloat16"), ((3, 5), "int8"), ((0, 4), "float16"), ((), "float32")]


@pytest.fixture(scope="module")
def group():
    g = Group(2, setup="setup_node", timeout=120)
    yield g
    g.close()


def test_onload_mode_setting_parses_and_names_a_garbage_value(monkeypatch):
    from offcache.weights.node import sliced as node_sliced

    monkeypatch.delenv("OFFCACHE_NODE_ONLOAD", raising=False)
    assert node_sliced.onload_mode() == "full"  # the default
    for value in ("full", "sliced", " sliced "):
        monkeypatch.setenv("OFFCACHE_NODE_ONLOAD", value)
        assert node_sliced.onload_mode() == value.strip()
    for value in ("slice", "FULL", "1", "sliced,full"):
        monkeypatch.setenv("OFFCACHE_NODE_ONLOAD", value)
        with pytest.raises(ValueError, match="OFFCACHE_NODE_ONLOAD must be 'full' or 'sliced', got " + repr(value)):
            node_sliced.onload_mode()


def test_a_garbage_or_disagreeing_setting_raises_on_every_rank_at_set_up():
    g = Group(2, env=[{"OFFCACHE_NODE_ONLOAD": "full"}, {"OFFCACHE_NODE_ONLOAD": "slicd"}], timeout=60)
    try:
        errors = g.call(S + "setup_error")
        for e in errors:  # both ranks, not only the one with the garbage value
            assert e.startswith("ValueError") and "rank 1" in e and "'slicd'" in e, errors
        assert g.call(S + "setup_error") == errors  # no rank was left in a collective: it runs again
    finally:
        g.close()
    g = Group(2, env=[{"OFFCACHE_NODE_ONLOAD": "full"}, {"OFFCACHE_NODE_ONLOAD": "sliced"}], timeout=60)
    try:
        for e in g.call(S + "setup_error"):
            assert "disagree on OFFCACHE_NODE_ONLOAD" in e and "rank 0 'full'" in e and "rank 1 'sliced'" in e, e
    finally:
        g.close()


@pytest.mark.parametrize("depths", [("0", "1"), ("1", "x")], ids=["disagree", "garbage"])
def test_a_prefetch_depth_that_differs_or_is_garbage_on_a_rank_raises_on_every_rank_at_set_up(depths):
    """In the sliced mode every prefetch is a collective: ranks with different OFFCACHE_WEIGHT_PREFETCH
    (0 on one: it never prefetches) or a garbage one (that rank raises when the pipeline starts) left the
    other rank in the agreement until the group's timeout. The set-up checks it on every rank."""
    env = [{"OFFCACHE_NODE_ONLOAD": "sliced", "OFFCACHE_WEIGHT_PREFETCH": d} for d in depths]
    g = Group(2, env=env, timeout=60)
    try:
        errors = g.call(S + "setup_error")
        for e in errors:  # both ranks
            assert e.startswith("ValueError") and "OFFCACHE_WEIGHT_PREFETCH" in e and "rank 1" in e, errors
            assert repr(depths[1]) in e, errors
    finally:
        g.close()
    # the full mode prefetches on each rank alone: no check there
    g = Group(2, env=[{"OFFCACHE_NODE_ONLOAD": "full", "OFFCACHE_WEIGHT_PREFETCH": d} for d in depths], timeout=60)
    try:
        assert g.call(S + "setup_error") == ["", ""]
    finally:
        g.close()


def test_sliced_walk_bit_identical_to_full_and_to_distributed_cpu_cache_in_two_collectives_a_subgraph(group):
    assert group.call(S + "use_mode", "full") == [False, False]
    full = group.call(S + "model_walk", N, 21, "cpu", "ours")
    theirs = group.call(S + "model_walk", N, 21, "cpu", "theirs")
    assert group.call(S + "use_mode", "sliced") == [True, True]
    try:
        sliced = group.call(S + "model_walk", N, 21, "cpu", "ours")
    finally:
        group.call(S + "use_mode", "full")
    for rank in range(2):
        assert sliced[rank]["kinds"] == full[rank]["kinds"] == ["NodeSharedCPUCache"]
        assert theirs[rank]["kinds"] == ["DistributedCPUCache"]
        # bit-identical, subgraph by subgraph
        assert sliced[rank]["outs"] == full[rank]["outs"] == theirs[rank]["outs"]
        records = sliced[rank]["records"]
        assert [r["index"] for r in records] == list(range(N))
        for r in records[1:]:  # every weight of subgraphs 1.. came from the sliced prefetch
            assert r["hits"] == 6 and r["misses"] == 0, r
        c = sliced[rank]["counters"]
        assert c["weight_sliced_prefetches"] == N - 1, c
        assert c.get("weight_prefetch_stale", 0) == 0 and c.get("weight_prefetch_skips", 0) == 0, c
        # each rank fetched about half of each prefetched subgraph from the region, not all of it
        prefetched = c["weight_prefetch_bytes"]
        assert 0.3 * prefetched < c["weight_sliced_fetch_bytes"] < 0.7 * prefetched, c
        # the collectives: the agreement and the gather per prefetched subgraph, nothing else
        assert sum(sliced[rank]["collectives"].values()) == 2 * (N - 1), sliced[rank]["collectives"]
        assert sum(sliced[rank]["collectives"].values()) / N <= 2
        assert sum(full[rank]["collectives"].values()) == 0, full[rank]["collectives"]
        assert full[rank]["counters"].get("weight_sliced_prefetches", 0) == 0
    # the two ranks fetched complementary halves: every byte once
    fetched = [sliced[rank]["counters"]["weight_sliced_fetch_bytes"] for rank in range(2)]
    assert sum(fetched) == sliced[0]["counters"]["weight_prefetch_bytes"], fetched


def test_prefetched_tensors_of_every_dtype_and_shape_match_and_a_miss_makes_no_collective(group):
    group.call(S + "use_mode", "sliced")
    try:
        group.call(S + "offload_pair", "a", SHAPES)
        group.call(S + "offload_pair", "b", [((33,), "float32"), ((5, 3), "bfloat16")])
        group.call(S + "mark")
        got = group.call(S + "prefetch", ["a", "b"], 1)
        for r in got:
            assert r["issued"] == 16 * 24 * 4 + 14 + 15 + 0 + 4 + 33 * 4 + 30, r
            assert sum(r["collectives"].values()) == 2, r
        results = group.call(S + "onload", "a")
        for r in results:
            assert r["collectives"] == {}, r
            for name, (ours, theirs) in r["values"].items():
                assert ours == theirs, name
        for d in group.call(S + "since"):
            assert d["weight_prefetch_hits"] == 5, d
        # b's tensors: one prefetched copy made stale by a write of rank 0 (after a barrier); the other
        # dropped on rank 1: both fetched whole by each rank alone, no collective
        group.call(S + "write", "b", "t0", 99, 0)
        group.call(S + "clear_prefetched")
        group.call(S + "mark")
        results = group.call(S + "onload", "b")
        for r in results:
            assert r["collectives"] == {}, r
            assert all(ours == theirs for ours, theirs in r["values"].values()), r
        for d in group.call(S + "since"):
            assert d.get("weight_prefetch_hits", 0) == 0 and d["shared_fetches"] >= 2, d
    finally:
        group.call(S + "use_mode", "full")


def test_a_write_after_a_barrier_makes_a_sliced_prefetch_stale(group):
    group.call(S + "use_mode", "sliced")
    try:
        group.call(S + "offload_pair", "c", [((40, 9), "float32"), ((11,), "float32")])
        group.call(S + "prefetch", ["c"], 1)
        group.call(S + "write", "c", "t0", 7, 1)
        group.call(S + "mark")
        for r in group.call(S + "onload", "c"):
            assert r["collectives"] == {}
            assert all(ours == theirs for ours, theirs in r["values"].values()), r
        reader, writer = group.call(S + "since")
        assert reader["weight_prefetch_stale"] == 1 and reader["weight_prefetch_hits"] == 1, reader
        # the writer dropped its own copy of t0 when it wrote it: a miss, not a stale copy
        assert writer.get("weight_prefetch_stale", 0) == 0 and writer["weight_prefetch_hits"] == 1, writer
    finally:
        group.call(S + "use_mode", "full")


def test_a_prefetch_again_after_one_rank_s_write_is_planned_alike_on_every_rank(group):
    # The writer dropped its own copy, the reader holds a stale one: the plan (every region tensor of
    # the modules) must still be the same on both ranks, not "what this rank has not prefetched".
    group.call(S + "use_mode", "sliced")
    try:
        group.call(S + "offload_pair", "h", [((), "bfloat16"), ((6, 5), "float32")])
        group.call(S + "prefetch", ["h"], 1)
        group.call(S + "write", "h", "t0", 3, 0)
        for r in group.call(S + "prefetch", ["h"], 2):
            assert r["issued"] == 2 + 6 * 5 * 4 and sum(r["collectives"].values()) == 2, r
        group.call(S + "mark")
        for r in group.call(S + "onload", "h"):
            assert r["collectives"] == {} and all(a == b for a, b in r["values"].values()), r
        for d in group.call(S + "since"):
            assert d["weight_prefetch_hits"] == 2 and d.get("weight_prefetch_stale", 0) == 0, d
    finally:
        group.call(S + "use_mode", "full")


def test_ranks_that_disagree_on_a_sliced_prefetch_get_an_error_not_a_hang(group):
    group.call(S + "use_mode", "sliced")
    try:
        group.call(S + "offload_pair", "d", [((12, 12), "float32")])
        group.call(S + "offload_pair", "e", [((12, 12), "float32")])
        group.call(S + "clear_prefetched")
        # rank 1 prefetches another module than rank 0 (the group's 120 s timeout would show a hang)
        with pytest.raises(WorkerError) as info:
            group.call(S + "prefetch", per_rank=[(["d"], 1), (["e"], 1)])
        text = str(info.value)
        assert text.count("NodeSlicedPlanError") >= 2 and "rank 0:" in text and "rank 1:" in text, text
        assert "disagree on what to prefetch" in text, text
        # rank 1 has nothing to prefetch while rank 0 has: an error too (it still takes part)
        group.call(S + "clear_prefetched")
        with pytest.raises(WorkerError, match="rank 1: subgraph 2, 0 tensors, 0 bytes"):
            group.call(S + "prefetch", per_rank=[(["d"], 2), ([], 2)])
        # and another subgraph on each rank
        group.call(S + "clear_prefetched")
        with pytest.raises(WorkerError, match="rank 0: subgraph 3, 1 tensors, 576 bytes, rank 1: subgraph 4"):
            group.call(S + "prefetch", per_rank=[(["d"], 3), (["d"], 4)])
        # the group still works afterwards: an agreed prefetch
        group.call(S + "clear_prefetched")
        for r in group.call(S + "prefetch", ["d", "e"], 3):
            assert r["issued"] == 2 * 12 * 12 * 4, r
    finally:
        group.call(S + "use_mode", "full")


def test_a_rank_without_room_makes_every_rank_skip_and_onload_alone(group):
    group.call(S + "use_mode", "sliced")
    try:
        group.call(S + "offload_pair", "f", [((30, 30), "float32")])
        group.call(S + "clear_prefetched")
        got = group.call(S + "prefetch", per_rank=[(["f"], 1, False), (["f"], 1, True)])
        for r in got:
            assert r["issued"] == 0 and r["counters"]["weight_prefetch_skips"] == 1, r
            assert sum(r["collectives"].values()) == 1, r  # the agreement only
        group.call(S + "mark")
        for r in group.call(S + "onload", "f"):
            assert r["collectives"] == {} and all(a == b for a, b in r["values"].values()), r
        for d in group.call(S + "since"):
            assert d.get("weight_prefetch_hits", 0) == 0, d
    finally:
        group.call(S + "use_mode", "full")


def test_two_nodes_of_two_ranks_gather_within_each_node():
    env = [
        {"GROUP_RANK": str(r // 2), "LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2", "OFFCACHE_NODE_ONLOAD": "sliced"}
        for r in range(4)
    ]
    g = Group(4, env=env, setup="setup_node", timeout=180)
    try:
        assert g.call(S + "use_mode", "sliced") == [True] * 4
        sliced = g.call(S + "model_walk", 3, 19, "cpu", "ours")
        theirs = g.call(S + "model_walk", 3, 19, "cpu", "theirs")
    finally:
        g.close()
    for rank in range(4):
        assert sliced[rank]["outs"] == theirs[rank]["outs"]
        c = sliced[rank]["counters"]
        assert c["weight_sliced_prefetches"] == 2 and c.get("weight_prefetch_skips", 0) == 0, c
        assert sum(sliced[rank]["collectives"].values()) == 2 * 2, sliced[rank]["collectives"]
        for r in sliced[rank]["records"][1:]:
            assert r["hits"] == 6 and r["misses"] == 0, r
    # within each node the two ranks' slices make the whole (halves of the node's 2, not quarters of 4)
    for node in (0, 1):
        fetched = [sliced[r]["counters"]["weight_sliced_fetch_bytes"] for r in (2 * node, 2 * node + 1)]
        assert sum(fetched) == sliced[2 * node]["counters"]["weight_prefetch_bytes"], fetched


def test_ranks_that_saw_different_generations_before_their_fetches_all_skip(group):
    # A write landing between two ranks' fetches: the gathered bytes could mix old and new.
    group.call(S + "use_mode", "sliced")
    try:
        group.call(S + "offload_pair", "k", [((9, 9), "float32")])
        group.call(S + "clear_prefetched")
        group.call(S + "skew_generations", per_rank=[(False,), (True,)])
        try:
            got = group.call(S + "prefetch", ["k"], 1)
        finally:
            group.call(S + "skew_generations", False)
        for r in got:
            assert r["issued"] == 0 and r["counters"]["weight_prefetch_skips"] == 1, r
            assert sum(r["collectives"].values()) == 1, r  # the agreement only
        for r in group.call(S + "onload", "k"):
            assert r["collectives"] == {} and all(a == b for a, b in r["values"].values()), r
        # the same generations on both: gathered
        for r in group.call(S + "prefetch", ["k"], 2):
            assert r["issued"] == 9 * 9 * 4 and sum(r["collectives"].values()) == 2, r
    finally:
        group.call(S + "use_mode", "full")


@pytest.mark.parametrize("mode", ["full", "sliced"])
def test_a_weight_tied_within_a_subgraph_is_one_tensor_on_every_rank_fetched_once(group, mode):
    """An embedding and a linear tied to it, prefetched together, the other rank's model on meta. The
    source rank's two offloaded tensors are one object; the other rank adopted two objects over the same
    region bytes, so in the sliced mode the ranks planned 1 and 2 tensors (NodeSlicedPlanError on every
    rank), and the full mode fetched the tied weight twice there. One object per region entry on every
    rank: bit-identical to compressed-tensors' DistributedCPUCache, the tied weight fetched once."""
    theirs = group.call(S + "tied_walk", "cpu", "theirs")
    assert group.call(S + "use_mode", mode) == [mode == "sliced"] * 2
    try:
        ours = group.call(S + "tied_walk", "cpu", "ours")
    finally:
        group.call(S + "use_mode", "full")
    tied_bytes, first_bytes = 24 * 16 * 4, (16 * 16 + 16) * 4
    for rank in range(2):
        assert ours[rank]["outs"] == theirs[rank]["outs"] == theirs[0]["outs"], rank
        assert ours[rank]["one_tensor"], rank  # as on the source rank
        c = ours[rank]["counters"]
        # subgraph 1 (the tied pair) prefetched once: one tensor, its bytes once, served by one hit
        assert c["weight_prefetch_bytes"] == tied_bytes, c
        assert ours[rank]["records"][1]["hits"] == 1 and ours[rank]["records"][1]["misses"] == 0, ours[rank]
        if mode == "full":
            # the region read: subgraph 0's onloads (2 tensors), then the tied weight once
            assert c["shared_fetch_bytes"] == first_bytes + tied_bytes, c
            assert sum(ours[rank]["collectives"].values()) == 0, ours[rank]["collectives"]
        else:
            assert c["weight_sliced_prefetches"] == 1 and c.get("weight_prefetch_skips", 0) == 0, c
            assert sum(ours[rank]["collectives"].values()) == 2, ours[rank]["collectives"]
    if mode == "sliced":  # every byte of the tied weight fetched from the region once, between the ranks
        fetched = [ours[rank]["counters"]["weight_sliced_fetch_bytes"] for rank in range(2)]
        assert sum(fetched) == tied_bytes, fetched


def test_a_rank_killed_mid_run_is_named_by_the_survivor_s_sliced_prefetch():
    """Rank 1 SIGKILLed (a zombie: not reaped yet) while rank 0 starts a sliced prefetch: rank 0's
    agreement fails on the closed connection, and its error names the rank that stopped (it read
    "the node's ranks did not agree on the prefetch")."""
    env = [{"OFFCACHE_NODE_ONLOAD": "sliced"}] * 2
    g = Group(2, env=env, timeout=60)
    try:
        assert g.call(S + "use_mode", "sliced") == [True, True]
        g.call(S + "offload_pair", "a", [((12, 12), "float32")])
        os.kill(g.pids[1], signal.SIGKILL)
        g.conns[0].send((S + "prefetch", (["a"], 1)))
        reply = g._recv(0)
    finally:
        g.close(force=True)
    assert reply[0] == "err", reply
    assert reply[1].startswith("NodeRankLostError: rank 0:"), reply[1]
    assert f"rank 1 (pid {g.pids[1]}) exited during the agreement" in reply[1], reply[1]
