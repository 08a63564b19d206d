"""The benchmark harness runs end to end (on the tiniest sizes) and writes what it promises."""

import json
import subprocess
import sys

SECTIONS = ("transfer", "overlap", "small", "pipeline", "pinned")


def test_bench_quick_tiny_writes_results_and_plots(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "offcache.bench", "--quick", "--tiny", "--out", str(out)],
        capture_output=True,
        cwd=tmp_path,  # not the source tree, which would shadow the installed package
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert {"device", "backend", *SECTIONS} <= set(results)
    assert results["backend"] in ("host", "cuda")
    assert "name" in results["device"]
    for section in SECTIONS:
        rows = results[section]
        assert isinstance(rows, list) and rows, section
        assert all("impl" in row for row in rows), section
    transfer_impls = {r["impl"] for r in results["transfer"]}
    assert {"offcache", "raw_pinned", "pageable_to"} <= transfer_impls
    assert all(r["gbps"] > 0 for r in results["transfer"])
    pipeline_impls = {r["impl"] for r in results["pipeline"]}
    assert {"offcache_iter", "offcache_iter_prefetch", "ideal_on_gpu"} <= pipeline_impls
    duplex = next(r for r in results["overlap"] if r["case"] == "duplex")
    assert duplex["ratio_to_one_direction"] > 0
    assert (out / "bandwidth.png").stat().st_size > 1000
    assert (out / "pipeline.png").stat().st_size > 1000
    assert (out / "timeline.png").stat().st_size > 1000
    timeline = results["timeline"]
    assert len(timeline["compute"]) == timeline["steps"]
    assert {r["stream"] for r in timeline["copies"]} == {"d2h", "h2d"}
    assert all(0 <= r["start_ms"] <= r["end_ms"] for r in timeline["copies"])
    assert "offcache.bench" in proc.stdout
    bookkeeping = [r for r in results["small"] if r.get("direction") == "fetch_batch_of_5"]
    assert {r["impl"] for r in bookkeeping} >= {"offcache"} and all(r["us_per_batch"] > 0 for r in bookkeeping)

    kv = subprocess.run(
        [sys.executable, "-m", "offcache.bench", "kv", "--tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert kv.returncode == 0, kv.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert set(SECTIONS) <= set(results)  # kept
    rows = {r["impl"]: r for r in results["kv"] if r["case"] == "short"}
    assert {"dynamic", "transformers_offloaded", "offcache"} <= set(rows)
    assert rows["offcache"]["completed"] and rows["offcache"]["equal_to_dynamic"] is True
    assert rows["offcache"]["tokens_generated"] == rows["dynamic"]["tokens_generated"]
    assert all(r["completed"] in (True, False, None) for r in results["kv"])
