"""offcache's NodeDiskCache (offcache/weights/node/disk.py) against compressed-tensors' DistributedDiskCache,
under a real gloo group of 2 ranks on localhost (the host backend: no GPU).

Bit-identical onloads, an update by either rank seen by both after a barrier (a prefetched copy of
the old value not served), deletes, a disagreement on a tensor's shape or dtype naming the tensor
on every rank (the group goes on), the prefetch, the checkpoint read from storage once per node
(/proc/self/io read_bytes, the file dropped from the page cache first), a seeded random sequence
of operations on both classes side by side, and the patch's switch.
"""

import os

import pytest

pytest.importorskip("compressed_tensors")

from tests.weights.node.weights_node_worker import Group, WorkerError  # noqa: E402

W = "tests.weights.node.weights_node_disk_worker:"
SPEC = [
    ("weight", (4, 5), "float32", 1, True, None),
    ("bias", (5,), "bfloat16", 2, False, None),
    ("tied", (4, 5), "float32", 1, True, "weight"),
    ("scale", (), "float16", 3, False, None),
]


@pytest.fixture(scope="module")
def group():
    g = Group(2)
    yield g
    g.close()


def _same(values):
    """Every rank's onloads, ours equal to theirs: returns ours."""
    for rank_values in values:
        ours, theirs = rank_values
        assert ours == theirs
    assert values[0] == values[1]
    return values[0][0]


def test_onloads_bit_identical_to_compressed_tensors_class_on_every_rank(group, tmp_path):
    group.call(W + "offload", "a", str(tmp_path), SPEC)
    ours = _same(group.call(W + "values", "a"))
    assert ours["weight"][0] == "Parameter" and ours["scale"][2] == ()
    assert ours["tied"] == ours["weight"]


def test_update_by_any_rank_is_seen_by_every_rank_after_a_barrier(group, tmp_path):
    group.call(W + "offload", "u", str(tmp_path), SPEC)
    before = _same(group.call(W + "values", "u"))
    for writer, seed in ((1, 7), (0, 8), (1, 9)):
        group.call(W + "update", "u", "weight", seed, writer)
        after = _same(group.call(W + "values", "u"))
        assert after["weight"] != before["weight"] and after["bias"] == before["bias"]
        assert after["tied"] == after["weight"]
        before = after


def test_a_prefetched_copy_of_a_value_another_rank_updated_is_not_served(group, tmp_path):
    group.call(W + "offload", "p", str(tmp_path), SPEC)
    old = _same(group.call(W + "values", "p"))
    results = group.call(W + "prefetch_update_onload", "p", "bias", 11, 1)
    new = _same(group.call(W + "values", "p"))
    assert new["bias"] != old["bias"]
    for rank, result in enumerate(results):
        assert result["issued"] > 0
        assert result["values"] == new, rank
        assert result["weight_prefetch_hits"] >= 2, result  # weight (tied: the same tensor), scale
        assert result["file_fetches"] >= 1 and result["weight_page_cache_bytes"] > 0, result
    assert results[0]["weight_prefetch_stale"] == 1  # rank 0's copy of the old bias: read again


def test_an_update_never_hands_a_reading_rank_a_truncated_file(group, tmp_path):
    spec = [("weight", (512, 512), "float32", 1, True, None)]  # 1 MiB: a rewrite takes a while
    group.call(W + "offload", "w", str(tmp_path), spec, ("ours",))
    rounds = 30
    seen = group.call(W + "update_while_reading", "w", rounds, 1)[0]
    valid = set(group.call(W + "describe_seeds", (512, 512), "float32", [1, *range(100, 100 + rounds)])[0])
    assert len(seen) == rounds and set(seen) <= valid


def test_a_prefetch_whose_file_is_gone_fails_that_onload_only(group, tmp_path):
    group.call(W + "offload", "g", str(tmp_path), SPEC, ("ours",))
    before = group.call(W + "values", "g")[0][0]
    for result in group.call(W + "prefetch_then_file_gone", "g", "bias"):
        assert "ct_disk_cache" in result["bias"] and "No such file" in result["bias"], result
        assert {k: v for k, v in result.items() if k != "bias"} == {k: v for k, v in before.items() if k != "bias"}


def test_delete_on_every_rank(group, tmp_path):
    group.call(W + "offload", "d", str(tmp_path), SPEC)
    assert group.call(W + "delete", "d", "bias") == [[False, False]] * 2
    values = _same(group.call(W + "values", "d"))
    assert "bias" not in values and "weight" in values
    group.call(W + "update", "d", "weight", 5, 1)
    _same(group.call(W + "values", "d"))


def test_shape_or_dtype_disagreement_names_the_tensor_on_every_rank(group, tmp_path):
    spec = [("weight", (4, 5), "float32", 1, True, None), ("bias", (5,), "bfloat16", 2, False, None)]
    other = [spec[0], ("bias", (6,), "bfloat16", 2, False, None)]
    with pytest.raises(WorkerError) as info:
        group.call(W + "offload_local", per_rank=[("x", str(tmp_path), spec), ("x", str(tmp_path), other)])
    text = str(info.value)
    assert text.count("NodeShapeMismatchError") >= 2 and "rank 0:" in text and "rank 1:" in text
    assert "'bias'" in text and "(6,)" in text and "(5,)" in text
    other = [("weight", (4, 5), "float16", 1, True, None), spec[1]]
    with pytest.raises(WorkerError, match="'weight'.*float16"):
        group.call(W + "offload_local", per_rank=[("y", str(tmp_path), spec), ("y", str(tmp_path), other)])
    # The group goes on: no rank was left waiting in a collective.
    group.call(W + "offload", "z", str(tmp_path), SPEC)
    _same(group.call(W + "values", "z"))


def test_a_failed_write_on_the_source_raises_on_every_rank(group, tmp_path):
    with pytest.raises(WorkerError) as info:
        group.call(W + "offload_unwritable", str(tmp_path))
    text = str(info.value)
    assert "rank 0:" in text and "rank 1:" in text and text.count("distributed disk offload failed") >= 2
    assert "'w'" in text
    group.call(W + "offload", "after", str(tmp_path), SPEC)


@pytest.mark.parametrize("prefetched", [True, False])
def test_the_checkpoint_is_read_from_storage_once_per_node(group, tmp_path, prefetched):
    mib = 16
    on = group.call(W + "storage_reads", f"r{prefetched}", str(tmp_path), mib, True, prefetched)
    total = sum(r["read_bytes"] for r in on)
    size = on[0]["file_bytes"]
    assert 0.9 * size <= total <= 1.25 * size, on
    if prefetched:
        assert all(r["hits"] == mib for r in on), on
        # The control: without the page-cache read every rank reads the disk itself (O_DIRECT). (Not
        # for one-tensor onloads: the engine's page-cache probe, preadv2 RWF_NOWAIT, starts the kernel's
        # readahead, which another rank's later probes may find: their sum is anywhere from 1x to 2x.)
        off = group.call(W + "storage_reads", f"o{prefetched}", str(tmp_path), mib, False, prefetched)
        assert sum(r["read_bytes"] for r in off) >= 1.5 * size, off


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_seeded_random_sequence_matches_compressed_tensors_class(group, tmp_path, seed):
    log = group.call(W + "random_sequence", str(tmp_path), seed, 14)
    assert log[0] == log[1]  # every rank sees the same
    for entry in log[0]:
        if entry[1] == "disabled":
            ours, theirs = entry[3]
        else:
            ours, theirs = entry[2]
        assert ours == theirs, entry


def test_patch_gives_node_disk_cache_for_distributed_disk_and_unpatch_restores(group):
    classes = group.call(W + "patched_classes")
    for result in classes:
        assert result == {"patched": "NodeDiskCache", "unpatched": "DistributedDiskCache"}, result


def test_page_cache_setting_is_checked():
    os.environ["OFFCACHE_NODE_PAGE_CACHE"] = "yes"
    try:
        from offcache.weights.node.warm import page_cache_on

        with pytest.raises(ValueError, match="OFFCACHE_NODE_PAGE_CACHE.*'yes'"):
            page_cache_on()
    finally:
        del os.environ["OFFCACHE_NODE_PAGE_CACHE"]


def test_a_garbage_page_cache_setting_on_one_rank_raises_on_every_rank_at_its_first_offload(group, tmp_path):
    """OFFCACHE_NODE_PAGE_CACHE was read at a rank's first disk onload only: a garbage value on one
    rank raised there alone, and the other ranks waited in their next collective until the group's
    timeout. Every offload (a collective of every rank) checks it: ValueError on every rank, naming
    the rank and the value; the group goes on."""
    got = group.call(W + "offload_with_page_cache", per_rank=[("pc", str(tmp_path), SPEC, None),
                                                              ("pc", str(tmp_path), SPEC, "yes")])  # fmt: skip
    for e in got:  # both ranks, not only the one with the garbage value
        assert e.startswith("ValueError") and "rank 1" in e and "OFFCACHE_NODE_PAGE_CACHE" in e and "'yes'" in e, got
        assert "rank 0" not in e, got
    assert group.call(W + "offload_with_page_cache", "pc2", str(tmp_path), SPEC, "0") == ["", ""]
