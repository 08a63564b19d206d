"""The benchmark harness runs end to end (on the tiniest sizes) and writes what it promises."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from offcache.bench.__main__ import main, parse_args, sections_of

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("transfer", "overlap", "small", "pipeline", "pinned", "kv")


def test_all_tiny_from_the_checkout_root_writes_results_and_plots(tmp_path):
    """The README's main job as typed (from the repository root), at --tiny sizes: every section of
    `all`, kv included, in well under a minute on a 2-core CPU."""
    out = tmp_path / "bench"
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "offcache.bench", "--quick", "--tiny", "--out", str(out)],
        capture_output=True,
        cwd=ROOT,
        text=True,
        timeout=600,
    )
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert elapsed < 120, f"--tiny took {elapsed:.0f} s"
    results = json.loads((out / "results.json").read_text())
    assert {"device", "backend", "runs", *SECTIONS} <= set(results)
    assert set(results["runs"]) == {"transfer", "overlap", "small", "pipeline", "kv"}
    for run in results["runs"].values():
        assert run["command"] == "python -m offcache.bench --quick --tiny --out " + str(out)
        assert {"date", "device", "backend", "build_info", "torch"} <= set(run)
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
    baseline = "ideal_on_gpu" if results["device"]["type"] == "cuda" else "no_offload"  # no GPU-only row on a CPU
    assert {"offcache_iter", "offcache_iter_prefetch", baseline} <= pipeline_impls
    assert "ideal_on_gpu" in pipeline_impls or results["device"]["type"] != "cuda"
    assert results["device"]["type"] == "cuda" or "ideal_on_gpu" not in pipeline_impls
    duplex = next(r for r in results["overlap"] if r["case"] == "duplex")
    assert duplex["ratio_to_one_direction"] > 0
    for png in ("bandwidth.png", "pipeline.png", "timeline.png"):
        assert (out / png).stat().st_size > 1000, png
    assert sorted(Path(p).name for p in results["plots"]) == ["bandwidth.png", "pipeline.png", "timeline.png"]
    timeline = results["timeline"]
    assert len(timeline["compute"]) == timeline["steps"]
    assert {r["stream"] for r in timeline["copies"]} == {"d2h", "h2d"}
    assert all(0 <= r["start_ms"] <= r["end_ms"] for r in timeline["copies"])
    assert "offcache.bench" in proc.stdout and "kv decode" in proc.stdout
    bookkeeping = [r for r in results["small"] if r.get("direction") == "fetch_batch_of_5"]
    assert {r["impl"] for r in bookkeeping} >= {"offcache"} and all(r["us_per_batch"] > 0 for r in bookkeeping)
    updates = {r["impl"]: r for r in results["small"] if r.get("direction") == "update_batch_of_5"}
    assert "offcache" in updates and all(r["cpu_us_per_batch"] > 0 for r in updates.values())
    assert all(isinstance(r["disk_folder_pending"], bool) for r in updates.values())
    assert "update of a 5-tensor batch, host CPU" in proc.stdout
    rows = {r["impl"]: r for r in results["kv"] if r["case"] == "short"}
    assert {"dynamic", "transformers_offloaded", "offcache"} <= set(rows)
    assert rows["offcache"]["completed"] and rows["offcache"]["equal_to_dynamic"] is True
    assert rows["offcache"]["tokens_generated"] == rows["dynamic"]["tokens_generated"]
    assert all(r["completed"] in (True, False, None) for r in results["kv"])
    if results["device"]["type"] != "cuda":  # transformers' offloaded caches use CUDA streams: not run, and why
        for r in results["kv"]:
            if r["impl"] in ("transformers_offloaded", "transformers_static_offloaded"):
                assert r["completed"] is None and r["note"].startswith("needs a GPU"), r
        from offcache.bench.common import cpu_model

        assert results["device"]["name"] == (cpu_model() or results["device"]["name"])


def test_main_returns_0_and_a_later_section_keeps_earlier_results(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["transfer", "--tiny", "--out", str(out)]) == 0
    first = json.loads((out / "results.json").read_text())
    assert main(["soak", "--tiny", "--ops", "600", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["transfer"] == first["transfer"]  # kept as measured
    assert results["runs"]["transfer"] == first["runs"]["transfer"]
    assert results["runs"]["soak"]["command"].endswith("soak --tiny --ops 600 --out " + str(out))
    assert results["soak"]["ops"] == 600 and results["soak"]["pinned_in_use_after_gc"] == 0
    assert (out / "bandwidth.png").exists()  # redrawn from the kept transfer rows
    captured = capsys.readouterr()
    assert "transfer at 1 MiB" in captured.out and "soak: 600 ops" in captured.out
    assert "{'" not in captured.err


def test_console_script_exits_0_and_prints_no_dict(tmp_path):
    script = shutil.which("offcache-bench") or str(Path(sys.executable).parent / "offcache-bench")
    if not Path(script).exists():
        pytest.skip("offcache-bench is not installed (pip install -e .)")
    proc = subprocess.run(
        [script, "soak", "--tiny", "--ops", "300", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "soak: 300 ops" in proc.stdout
    assert "{'" not in proc.stderr and "{'" not in proc.stdout


def test_section_names():
    assert sections_of(parse_args([])) == ["transfer", "overlap", "small", "pipeline", "kv"]
    assert sections_of(parse_args(["kv", "all", "soak"])) == ["kv", "transfer", "overlap", "small", "pipeline", "soak"]
    with pytest.raises(SystemExit):
        parse_args(["nosuchsection"])
