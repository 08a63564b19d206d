"""``python -m offcache.bench weights --ranks 2 --tiny``: every row measured, and its figures consistent
with each other and with what each class does (not timed: counts, bytes and checksums)."""

import json

import pytest

pytest.importorskip("compressed_tensors")
pytest.importorskip("llmcompressor")

from offcache.bench.__main__ import main, parse_args  # noqa: E402
from offcache.bench.ranks import pss_bytes  # noqa: E402
from offcache.bench.weights_ranks import WIDE  # noqa: E402


def test_ranks_needs_two_ranks_and_the_weights_section(capsys):
    for argv, words in ((["weights", "--ranks", "1"], "--ranks must be >= 2, got 1"),
                        (["transfer", "--ranks", "2"], "--ranks applies to the weights section")):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert words.replace(">= 2,", ">= 2 (the ranks of one node),") in capsys.readouterr().err


def test_pss_reads_this_process():
    before = pss_bytes()
    block = bytearray(64 << 20)  # 64 MiB, touched
    assert pss_bytes() - before > 48 << 20
    del block


def test_weights_ranks_rows(tmp_path, capsys):
    assert main(["weights", "--ranks", "2", "--tiny", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {r["impl"]: r for r in results["weights_ranks"]}
    assert set(rows) == {"compressed_tensors", "offcache", "per_rank", "offcache_sliced", "goals"}
    ct, ours, per_rank = rows["compressed_tensors"], rows["offcache"], rows["per_rank"]
    assert ct["cache_class"] == "DistributedCPUCache"
    assert ours["cache_class"] == "NodeSharedCPUCache" and ours["region"]["decided"] == "node"
    assert per_rank["cache_class"] == "OffcacheCPUCache"
    shape, weights = ours["shape"], ours["weight_bytes"]
    modules, tensors = shape["S"] * shape["L"], shape["S"] * shape["L"] * 2

    # Host bytes: one copy per node for the two shared classes, one per rank for per_rank.
    assert ours["pss_over_weights"] < 1.3 and ct["pss_over_weights"] < 1.3
    assert per_rank["pss_over_weights"] > 1.7
    assert ours["pss_over_weights"] < per_rank["pss_over_weights"] / 1.5
    assert all(p > 0.7 * weights for p in per_rank["rank_pss_bytes"]), "every rank holds its own copy"
    assert ours["rank_pss_bytes"][0] > 0.7 * weights, "the source rank wrote the region"
    assert 1.0 <= ours["region_over_weights"] < 1.05
    assert ours["region"]["node_ranks"] == 2

    # Collectives: compressed-tensors' a broadcast and a barrier per tensor; offcache's a broadcast
    # and an all_gather per batch (a module's parameters, its buffers); none per rank, none at onload.
    assert ct["load_collectives"] == {"broadcast_object_list": tensors, "barrier": tensors}
    assert ct["barriers_per_tensor"] == 1.0 and ct[f"collectives_{WIDE}_tensor_module"] == 2 * WIDE
    assert ours["load_collectives"] == {"broadcast_object_list": 2 * modules, "all_gather_object": 2 * modules}
    assert (
        ours["barriers_per_module"] == 0 and ours[f"collectives_{WIDE}_tensor_module"] == ours["collectives_per_module"]
    )
    assert per_rank["load_collectives"] == {} and per_rank["setup_collectives"] == {}
    assert set(ours["setup_collectives"]) == {"all_gather_object"}
    for r in (ct, ours, per_rank):
        assert r["collectives_per_subgraph"] == 0 and r["pipeline_collectives"] == {}
        assert r["collectives_same_on_every_rank"]
        assert r["pipeline_wall_s"] > 0 and r["load_s"] > 0 and len(r["onload_gbps_per_rank"]) == 2

    # Onloads: offcache's are engine fetches from the region (the host backend's), per_rank's from
    # its arena; compressed-tensors' CPUCache hands out the offloaded tensor on a CPU.
    assert ours["onload_copies"] and per_rank["onload_copies"] and not ct["onload_copies"]
    assert ours["engine"]["shared_fetch_bytes"] >= 2 * weights  # every rank onloaded every weight
    assert per_rank["engine"]["shared_fetch_bytes"] == 0 and per_rank["engine"]["chunk_bytes"] >= 2 * weights
    assert ours["engine"]["shared_registrations"] > 0 and ours["pin_s_per_gib"] is not None
    assert ours["engine"]["weight_prefetch_hits"] > 0, "the pipeline prefetched the next subgraph"
    # The same weights onloaded: every rank's outputs are the same with every class.
    assert ct["checksums"] == ours["checksums"] == per_rank["checksums"]
    assert ct["checksums"][0] != ct["checksums"][1], "each rank ran its own batches"

    # The sliced mode (run for real here: gloo, host backend): the same outputs, each rank fetching
    # about half of each prefetched subgraph, an agreement and a gather per prefetch.
    sliced = rows["offcache_sliced"]
    assert sliced["cache_class"] == "NodeSharedCPUCache" and sliced["same_results_as_offcache"] is True
    assert sliced["checksums"] == ours["checksums"]
    prefetches = sliced["engine"]["weight_sliced_prefetches"]
    runs = shape["R"] + 1  # the pipeline runs, a warm-up's too (the onload rounds prefetch nothing)
    assert prefetches == 2 * runs * (shape["S"] - 1), sliced["engine"]  # both ranks, S - 1 prefetches a run
    assert sliced["pipeline_collectives"] == {"all_gather_single": 2 * runs * (shape["S"] - 1)}
    assert 0 < sliced["collectives_per_subgraph"] <= 2 and sliced["collectives_same_on_every_rank"]
    assert sliced["pss_over_weights"] < 1.3
    assert ours["engine"]["weight_sliced_prefetches"] == per_rank["engine"]["weight_sliced_prefetches"] == 0
    assert sliced["load_collectives"] == ours["load_collectives"]

    goals = rows["goals"]
    assert goals["sliced_collectives_per_subgraph"]["pass"] is True
    assert goals["judged_timing"] is False  # no GPU here
    assert goals["node_pss_over_weights"]["value"] == ours["pss_over_weights"]
    assert goals["collectives_per_subgraph"]["pass"] is True
    assert goals["onload_over_raw_pinned"]["pass"] is None  # timing: reported, not judged
    assert results["runs"]["weights_ranks"]["command"].endswith(f"weights --ranks 2 --tiny --out {tmp_path}")
    out = capsys.readouterr().out
    assert "weights --ranks 2" in out and "goals:" in out
