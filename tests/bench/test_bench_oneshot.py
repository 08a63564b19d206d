"""The oneshot section at its reduced CPU size: llm-compressor's real sequential GPTQ, four runs
(llm-compressor's cache and offcache's, sequential prefetch off and on) and three with the weights
offloaded (llm-compressor, offcache's activations, offcache's activations and weights), weights
bit-identical."""

import json

import pytest

pytest.importorskip("llmcompressor")
pytest.importorskip("datasets")

from offcache.bench.__main__ import main  # noqa: E402
from offcache.bench.oneshot import RUNS, WEIGHT_RUNS  # noqa: E402

pytestmark = pytest.mark.slow


def test_oneshot_section_gives_bit_identical_weights(tmp_path, capsys):
    assert main(["oneshot", "--tiny", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    rows = results["oneshot"]
    assert [(r["impl"], r["prefetch"]) for r in rows] == RUNS + WEIGHT_RUNS
    assert [r["weights"] for r in rows] == ["on the device"] * 4 + ["offloaded to the CPU"] * 3
    assert rows[0]["reference"] is None  # llm-compressor without prefetch: what the others are compared with
    assert [r["reference"] for r in rows[1:]] == [
        "llmcompressor, prefetch False",
        "llmcompressor, prefetch False",
        "llmcompressor, prefetch True",
        "llmcompressor, prefetch False",
        "llmcompressor, prefetch False, weights offloaded",
        "llmcompressor, prefetch False, weights offloaded",
    ]
    assert all(r["bit_identical"] is True for r in rows[1:]), rows
    assert all(r["quantized"] for r in rows)
    assert all(r["repeats"] == 1 and r["wall_min_s"] <= r["wall_s"] <= r["wall_max_s"] for r in rows)
    assert [r["impl"] for r in rows if "prefetch_speedup" in r] == ["offcache"]
    # Every prefetch row: its time against the same cache's without prefetch, round by round.
    assert [(r["impl"], r["prefetch"]) for r in rows if "prefetch_ratio_paired" in r] == [
        ("llmcompressor", True),
        ("offcache", True),
    ]
    for r in rows:  # the pipeline's wait for its batches: 2 passes of every batch through every subgraph
        assert r["batches"] > 0 and r["batches"] % (2 * 6) == 0, r["batches"]
        assert 0 < r["batch_wait_s"] < r["wall_s"] and r["batch_wait_us_per_batch"] > 0
    for r in rows:
        assert r["wall_s"] > 0
        if r["impl"] != "llmcompressor":
            assert r["offcache_stores"] > 0, "offcache's cache was not used"
            assert r["speedup_vs_llmcompressor"] > 0
        else:
            assert r["offcache_stores"] == 0, "offcache's cache was used while unpatched"
        if r["impl"] == "offcache+weights":
            assert r["weight_onload_bytes"] > 0 and r["weight_prefetch_hits"] > 0
            assert 0 <= r["weight_wait_fraction"] < 1
            subgraphs = [x for x in r["weight_subgraphs"] if x["index"] is not None]
            assert len(subgraphs) >= 2 and all(x["misses"] == 0 and x["hits"] > 0 for x in subgraphs[1:])
        else:
            assert r["weight_onload_bytes"] == 0, "offcache's weight offloading was used while not patched in"
    assert results["runs"]["oneshot"]["command"].endswith("oneshot --tiny --out " + str(tmp_path))
    assert (tmp_path / "pipeline.png").stat().st_size > 1000
    assert "weights bit-identical 6/6" in capsys.readouterr().out
    import llmcompressor.pipelines.cache as lc_cache

    import offcache

    assert lc_cache.IntermediatesCache is not offcache.IntermediatesCache  # unpatched afterwards


def test_paired_ratio_is_per_round_and_batch_waits_per_batch():
    from offcache.bench.oneshot import batch_waits, paired_ratio

    # Drift: the machine slows down over the rounds; each round's pair sees it alike.
    assert paired_ratio([1.0, 2.2, 3.0], [1.0, 2.0, 3.3]) == {
        "prefetch_ratio_paired": 1.0,
        "prefetch_ratio_min": 3.0 / 3.3,
        "prefetch_ratio_max": 1.1,
    }
    assert batch_waits([0.2, 0.1, 0.3], 100) == {"batch_wait_s": 0.2, "batch_wait_us_per_batch": 2000.0}
    assert batch_waits([None], None) == {"batch_wait_s": None, "batch_wait_us_per_batch": None}


def test_rounds_alternate_their_order(monkeypatch, tmp_path):
    """ABBA: a kind's place in the round alternates, so a place's cost touches every kind alike."""
    from offcache.bench import oneshot
    from offcache.bench.common import Context

    order = []

    def fake_run(ctx, model_dir, dtype, shape, dataset, run):
        order.append(run)
        return 1.0, {}, {"batch_wait_s": 0.5, "batches": 1, "weight_host_wait_seconds": 0.0, "wall_s_first": 1.0}

    monkeypatch.setattr(oneshot, "_one_run", fake_run)
    monkeypatch.setattr(oneshot, "_warm_up", lambda *a: None)
    monkeypatch.setattr(oneshot, "calibration_set", lambda shape: None)
    monkeypatch.setattr(oneshot, "save_llama", lambda folder, **kw: folder)
    monkeypatch.setenv("OFFCACHE_BENCH_ONESHOT_REPEATS", "3")
    monkeypatch.setenv("OFFCACHE_BENCH_ONESHOT_WEIGHTS", "0")
    rows = oneshot.run_oneshot(
        Context(device=__import__("torch").device("cpu"), quick=True, tiny=False, backend="host")
    )
    runs = [(i, p, False) for i, p in RUNS]
    assert order == runs + runs[::-1] + runs
    assert all(r["repeats"] == 3 for r in rows)
