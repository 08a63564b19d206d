"""offcache's node classes (NodeSharedCPUCache, NodeDiskCache) beside compressed-tensors' DistributedCPUCache /
DistributedDiskCache where compressed-tensors' own code drives them: 2 ranks, gloo
(tests/weights/node/weights_node_edges_worker.py)."""

import pytest

pytest.importorskip("compressed_tensors")

from tests.weights.node.weights_node_edges_worker import E  # noqa: E402
from tests.weights.node.weights_node_worker import Group  # noqa: E402


@pytest.fixture(scope="module")
def group():
    g = Group(2, setup="setup_node", timeout=30)  # a hang fails the test in 30 s
    yield g
    g.close(force=True)


@pytest.mark.parametrize("where", ["cpu", "disk"])
@pytest.mark.parametrize("outs", [[4, 4, 4, 4], [3, 5, 7]], ids=["same-shapes", "uneven"])
def test_replace_module_parallel_offloads_each_rank_s_modules_alone_then_recouples(group, tmp_path, where, outs):
    """compressed-tensors' distributed compress_model (replace_module_parallel): under as_single_threaded()
    a rank offloads its own modules' new tensors alone (no collective: the other ranks are busy with their
    own modules), then every module is offloaded again from its rank. offcache's classes made their
    collective offload there: with as many modules per rank, each rank took the other rank's index (every
    module read another's weight); with 2 modules on one rank and 1 on the other, a hang."""
    folder = "cpu" if where == "cpu" else str(tmp_path)
    theirs = group.call(E + "module_parallel", "theirs", folder, outs)
    if where != "cpu":
        (tmp_path / "ours").mkdir()
        folder = str(tmp_path / "ours")
    ours = group.call(E + "module_parallel", "ours", folder, outs)
    for rank in range(2):
        assert theirs[rank]["got"] == theirs[rank]["want"], (rank, theirs[rank])  # compressed-tensors' answer
        assert ours[rank]["kinds"] == (["NodeSharedCPUCache"] if where == "cpu" else ["NodeDiskCache"])
        assert ours[rank]["got"] == ours[rank]["want"], (rank, ours[rank])


@pytest.mark.parametrize("meta_elsewhere", [False, True])
def test_a_conjugate_or_negative_view_is_offloaded_with_its_values(group, meta_elsewhere):
    """A contiguous view with a lazy conjugate (or negative) bit: the region holds its values (copy_
    resolves the bit), and the offloaded tensor must not keep the bit on top of them. offcache's source
    rank pointed the view itself at the region, bit and all: the conjugate of the value (compressed-tensors'
    source rank keeps the view on its own bytes: right there)."""
    results = group.call(E + "lazy_views", meta_elsewhere)
    assert results[0]["theirs"] == results[0]["want"]  # compressed-tensors' source rank
    for rank, result in enumerate(results):
        assert result["ours"] == result["want"], (rank, result)
