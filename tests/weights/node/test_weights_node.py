"""offcache's node-shared weights (offcache/weights/node/) under a real gloo group on localhost.

Updates seen by every rank after a barrier, tied weights, a disagreement on a tensor's shape or
dtype naming the tensor on every rank, the fallback warning without memfd, nothing in /dev/shm,
a killed rank, collectives per module (not per tensor), two torchrun nodes on one host, the
node's host limit, and the patch_llmcompressor(weights=True) switch.
"""

import os
import signal
import time

import pytest

pytest.importorskip("compressed_tensors")

from tests.weights.node.weights_node_worker import Group, WorkerError  # noqa: E402

M = "tests.weights.node.weights_node_memory_worker:"

W = ("weight", (4, 5), "float32", 1, True, None)
B = ("bias", (5,), "bfloat16", 2, False, None)


@pytest.fixture(scope="module")
def group():
    g = Group(2, setup="setup_node")
    yield g
    g.close()


def test_update_by_any_rank_is_seen_by_every_rank_after_a_barrier(group):
    group.call("offload_ours", "m", [W, B, ("tied", (4, 5), "float32", 1, True, "weight")], True)
    before = group.call("ours_values", "m")
    assert before[0] == before[1]
    assert before[0]["ties"] == [("tied", "weight")]  # one tensor on every rank
    for writer, seed in ((1, 7), (0, 8)):
        group.call("update_one", "m", "weight", seed, writer)
        after = group.call("ours_values", "m")
        assert after[0] == after[1], writer
        assert after[0]["values"]["weight"] != before[0]["values"]["weight"]
        assert after[0]["values"]["tied"] == after[0]["values"]["weight"]
        assert after[0]["values"]["bias"] == before[0]["values"]["bias"]
        before = after


def test_shape_or_dtype_disagreement_names_the_tensor_on_every_rank(group):
    other = ("bias", (6,), "bfloat16", 2, False, None)
    with pytest.raises(WorkerError) as info:
        group.call("offload_ours", per_rank=[("x", [W, B], False), ("x", [W, other], False)])
    text = str(info.value)
    assert text.count("NodeShapeMismatchError") >= 2 and "rank 0:" in text and "rank 1:" in text
    assert "'bias'" in text and "(6,)" in text and "(5,)" in text
    other = ("weight", (4, 5), "float16", 1, True, None)
    with pytest.raises(WorkerError, match="'weight'.*float16"):
        group.call("offload_ours", per_rank=[("x", [W], False), ("x", [other], False)])
    with pytest.raises(WorkerError, match="disagree on the tensors offloaded.*'bias'"):
        group.call("offload_ours", per_rank=[("x", [W, B], False), ("x", [W], False)])
    # The group goes on: no rank was left waiting in a collective.
    group.call("offload_ours", "y", [W], True)
    values = group.call("ours_values", "y")
    assert values[0] == values[1]


def test_meta_tensors_take_the_source_s_shape_and_dtype(group):
    group.call("offload_ours", per_rank=[("z", [W], True), ("z", [("weight", (1,), "int8", 0, True, None)], True)])
    values = group.call("ours_values", "z")
    assert values[0] == values[1]
    assert values[1]["values"]["weight"][:3] == ("Parameter", "torch.float32", (4, 5))


def test_fallback_warns_once_naming_the_reason_and_every_rank_uses_compressed_tensors_class(group):
    for drop, reason in (("memfd", "memfd_create is not available"), ("proc", "/proc/")):
        results = group.call("fallback", per_rank=[("",), (drop,)])
        for result in results:
            assert result["class"] == "DistributedCPUCache"
            assert len(result["warnings"]) == 1, result
            assert "NodeRegionFallbackWarning" in result["warnings"][0]
            assert reason in result["warnings"][0], result
    # setup_node() ran again: offcache's class is back
    group.call("offload_ours", "after", [W], True)


def test_region_is_one_memfd_and_nothing_goes_to_dev_shm(group):
    before = set(os.listdir("/dev/shm"))
    big = [(f"t{i}", (256, 1024), "float32", i, False, None) for i in range(8)]  # 8 MiB
    group.call("offload_ours", "big", big, True)
    assert set(os.listdir("/dev/shm")) - before == set()
    fds = group.call("region_fds")
    assert fds[0] == fds[1] and len(fds[0]) == 1 and "offcache-weights" in fds[0][0], fds
    inodes = group.call("region_inode")
    assert inodes[0] == inodes[1]  # one region for the node
    stats = group.call("node_stats")
    assert stats[0]["used_bytes"] >= 8 << 20


def test_collectives_per_module_not_per_tensor(group):
    few, many = group.call("count_collectives", "ours", 2), group.call("count_collectives", "ours", 20)
    assert few == many == [{"broadcast_object_list": 1, "all_gather_object": 1}] * 2
    theirs = group.call("count_collectives", "theirs", 20)
    assert theirs[0] == {"broadcast_object_list": 20, "barrier": 20}


def test_a_batch_past_the_node_s_host_limit_fails_on_every_rank(group):
    old = group.call("set_limit", 1 << 20)
    try:
        with pytest.raises(WorkerError) as info:
            group.call("offload_ours", "full", [("t", (1024, 1024), "float32", 0, False, None)], True)
        assert str(info.value).count("NodeRegionFullError") >= 2
    finally:
        group.call("set_limit", per_rank=[(old[0],), (old[1],)])
    group.call("offload_ours", "fits", [W], True)


def test_two_torchrun_nodes_on_one_host_get_two_regions():
    env = [{"GROUP_RANK": str(r), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"} for r in range(2)]
    g = Group(2, env=env, setup="setup_node")
    try:
        stats = g.call("node_stats")
        assert stats[0]["node"] != stats[1]["node"]
        inodes = g.call("region_inode")
        assert inodes[0] != inodes[1]
        g.call("offload_ours", "m", [W, B], True)  # the bytes go to the other node's region
        values = g.call("ours_values", "m")
        assert values[0] == values[1]
        g.call("offload_ours", "n", [B, W], True)  # same layout on both: the next batch lines up
        values = g.call("ours_values", "n")
        assert values[0] == values[1]
        stats = g.call("node_stats")
        assert stats[0]["used_bytes"] == stats[1]["used_bytes"]
    finally:
        g.close()


def fd_targets(pid: int) -> list[str]:
    """What a process's open files are, skipping any it closes while they are read (gloo's sockets close
    when the peer dies, between the listing and the readlink)."""
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            continue
    return targets


def test_a_killed_rank_leaves_no_shared_memory_behind():
    before = set(os.listdir("/dev/shm"))
    g = Group(2, setup="setup_node")
    try:
        g.call("offload_ours", "m", [W, B], True)
        pids = list(g.pids)
        os.kill(pids[1], signal.SIGKILL)
        g.procs[1].join(10)
        # rank 0 still holds the region (its fd); once it is gone too, so is the memory
        assert any(target.startswith("/memfd:offcache") for target in fd_targets(pids[0]))
    finally:
        g.close(force=True)
    deadline = time.time() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    assert set(os.listdir("/dev/shm")) - before == set()


def test_patch_llmcompressor_weights_switches_the_distributed_cpu_cache(group):
    pytest.importorskip("llmcompressor")
    results = group.call("patched_classes")
    for result in results:
        assert result == {
            "patched": "NodeSharedCPUCache",
            "module": "NodeSharedCPUCache",
            "forward": (2, 3),
            "unpatched": "DistributedCPUCache",
        }


def test_compressed_tensors_own_distributed_checks_pass_on_both_classes(group):
    assert group.call("upstream_scenarios", "theirs") == [[], []]
    assert group.call("upstream_scenarios", "ours") == [[], []]


def test_a_weight_tied_across_modules_is_stored_once_and_updates_through_either(group):
    results = group.call("tie_across_modules")
    for rank, result in enumerate(results):
        assert result["grew"] == 0, result  # the second module's offload found it in the region
        assert result["same_object"], result
        assert result["embed"] == result["head"] == results[0]["head"], (rank, result)


def test_inside_compressed_tensors_batch_offload_sync(group):
    pytest.importorskip("compressed_tensors.offload.cache.dist_batch")  # compressed-tensors 0.20
    results = group.call("inside_batch_offload_sync")
    assert results[0] == results[1] and set(results[0]) == {"m0", "m1"}


def test_grad_parameters_empty_bool_float8_and_strided_tensors(group):
    assert group.call("edge_cases") == [[], []]


def test_a_memory_error_logs_compressed_tensors_hint_on_every_rank(group):
    """compressed-tensors' test_distributed_offload_logs_memory_hint and test_recv_offload_logs_memory_hint
    for offcache's class: the source rank failing to allocate, or another rank failing to map, fails the
    offload on every rank (no rank left in a collective), each logging compressed-tensors' remediation hint."""
    for failing in (0, 1):
        for how in ("setitem", "from_mapping"):
            results = group.call(M + "memory_error", failing, how)
            for rank, result in enumerate(results):
                assert "Cannot allocate memory" in result["error"], (failing, how, rank, result)
                assert result["hint"], (failing, how, rank, result)
    group.call("offload_ours", "after", [W], True)  # the group goes on
    values = group.call("ours_values", "after")
    assert values[0] == values[1]


def test_node_host_memory_is_one_copy_where_per_rank_copies_are_two():
    """PSS summed over the 2 ranks (each shared page counted once, split between the ranks that map it):
    offcache's region adds at most 1.1x the weights' bytes; a copy per rank (compressed-tensors' CPUCache
    on each rank) adds about 2x, measured in the same ranks."""
    from tests.weights.node.weights_node_memory_worker import pss_bytes

    n, mib = 4, 16
    weights = n * mib << 20
    g = Group(2, setup="setup_node")  # fresh ranks: nothing of other tests freed while measuring
    try:
        before = sum(map(pss_bytes, g.pids))
        g.call(M + "hold_weights", "node", "node", n, mib)
        shared = sum(map(pss_bytes, g.pids))
        g.call(M + "hold_weights", "per_rank", "per_rank", n, mib)
        per_rank = sum(map(pss_bytes, g.pids))
    finally:
        g.close()
    node_ratio, per_rank_ratio = (shared - before) / weights, (per_rank - shared) / weights
    print(f"node region: {node_ratio:.3f}x the weights, a copy per rank: {per_rank_ratio:.3f}x")
    assert 0.95 <= node_ratio <= 1.1, (node_ratio, per_rank_ratio)
    assert 1.9 <= per_rank_ratio <= 2.2, (node_ratio, per_rank_ratio)
