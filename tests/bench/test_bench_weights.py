"""The weights section at its tiniest: every row measured, counters consistent with the rows."""

import json

import pytest

pytest.importorskip("compressed_tensors")
pytest.importorskip("llmcompressor")

from offcache.bench.__main__ import main  # noqa: E402


def test_weights_section_rows(tmp_path, capsys):
    assert main(["weights", "--tiny", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {r["impl"]: r for r in results["weights"]}
    assert set(rows) == {
        "compute_only", "compressed_tensors", "offcache", "offcache_prefetch",
        "raw_pinned_vs_engine_fetch", "disk_compressed_tensors", "disk_offcache", "disk_offcache_prefetch",
        "disk_raw_sequential_read", "bars",
    }  # fmt: skip
    shape = rows["compute_only"]["shape"]
    weights = shape["S"] * shape["L"] * 2  # weight and bias per layer
    for impl in ("offcache", "offcache_prefetch"):
        r = rows[impl]
        assert r["wall_s"] > 0 and r["vs_compute_only"] > 0
        assert r["h2d_bytes"] >= r["weight_bytes"], "every weight crosses the engine once per subgraph"
    plain, ahead = rows["offcache"], rows["offcache_prefetch"]
    assert plain["prefetch_hits"] == 0 and ahead["prefetch_hits"] == weights - shape["L"] * 2
    assert ahead["prefetch_misses"] == shape["L"] * 2, "only the first subgraph's weights are fetched on demand"
    assert plain["host_waits_per_subgraph"] >= ahead["host_waits_per_subgraph"]
    assert rows["raw_pinned_vs_engine_fetch"]["engine_gbps"] > 0
    assert rows["disk_compressed_tensors"]["file_bytes"] > rows["compressed_tensors"]["weight_bytes"] / 2
    for impl in ("disk_compressed_tensors", "disk_offcache", "disk_offcache_prefetch"):
        assert rows[impl]["wall_s"] > 0
    assert rows["disk_offcache"]["prefetch_misses"] == 0  # prefetch off: none counted
    disk, disk_ahead = rows["disk_offcache"], rows["disk_offcache_prefetch"]
    # Every onload and prefetch reads its file through the engine: one fetch_file per weight file.
    assert disk["file_fetches"] == weights and disk["file_read_bytes"] >= disk["h2d_bytes"] > 0
    assert disk_ahead["prefetch_hits"] == weights - shape["L"] * 2
    assert disk_ahead["host_waits_per_subgraph"] <= disk["host_waits_per_subgraph"]
    bars = rows["bars"]
    assert bars["judged"] is False  # no GPU here: reported, not judged
    assert bars["weight_h2d_over_raw_pinned"]["value"] == rows["raw_pinned_vs_engine_fetch"]["engine_over_raw"]
    assert bars["wait_share_prefetch"]["pass"] is None and 0 <= bars["wait_share_prefetch"]["value"] < 1
    assert results["runs"]["weights"]["command"].endswith("weights --tiny --out " + str(tmp_path))
    assert "weight H2D: engine" in capsys.readouterr().out
