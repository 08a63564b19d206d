"""A bench section cut short keeps what it measured, and the device check's workload settings.

The device check kills a step at its deadline: every row a section had measured must be in
results.json by then (marked partial), and the step's headline must read it. The cut happens here by
an exception where the kill would land; results.json is replaced atomically, so a SIGKILL at that
point leaves the same file.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from offcache.bench import common
from offcache.bench.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
HEADLINE = ROOT / "benchmarks" / "device_check_headline.py"


class Killed(BaseException):
    """Where the deadline's SIGKILL would land (a BaseException: nothing in the bench catches it)."""


def _killed_at(monkeypatch, module, name: str):
    def kill(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(module, name, kill)


def _headline(step: str, results: Path) -> str:
    done = subprocess.run([sys.executable, str(HEADLINE), step, str(results)], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    return done.stdout.strip()


def test_the_workload_settings_parse_strictly(monkeypatch):
    monkeypatch.delenv("X_CASES", raising=False)
    assert common.env_choice("X_CASES", ("a", "b", "c")) == ("a", "b", "c")
    monkeypatch.setenv("X_CASES", "c, a")
    assert common.env_choice("X_CASES", ("a", "b", "c")) == ("c", "a")
    monkeypatch.setenv("X_CASES", " ")  # blank: unset, as the engine's own variables
    assert common.env_choice("X_CASES", ("a", "b", "c"), default=("b",)) == ("b",)
    for bad in ("d", "a,d", ","):
        monkeypatch.setenv("X_CASES", bad)
        with pytest.raises(ValueError, match=r"X_CASES=.*a, b, c"):
            common.env_choice("X_CASES", ("a", "b", "c"))
    monkeypatch.delenv("X_SWITCH", raising=False)
    assert common.env_switch("X_SWITCH") is True and common.env_switch("X_SWITCH", default=False) is False
    for value, want in (("0", False), ("1", True), (" 1", True), ("", True)):  # blank: unset, as the engine's
        monkeypatch.setenv("X_SWITCH", value)
        assert common.env_switch("X_SWITCH") is want
    for bad in ("no", "true", "00"):
        monkeypatch.setenv("X_SWITCH", bad)
        with pytest.raises(ValueError, match="X_SWITCH"):
            common.env_switch("X_SWITCH")


def test_a_kv_run_killed_after_its_first_case_keeps_it_and_the_headline_reads_it(tmp_path, monkeypatch):
    from offcache.bench import kv

    monkeypatch.setenv("OFFCACHE_BENCH_KV_CASES", "short,static_4x")
    _killed_at(monkeypatch, kv, "run_static_cases")  # after the short case, in the static ones
    with pytest.raises(Killed):
        main(["kv", "--tiny", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["runs"]["kv"]["partial"] is True
    assert {r["case"] for r in results["kv"]} == {"short"}
    assert {r["impl"] for r in results["kv"]} >= {"dynamic", "offcache"}
    line = _headline("kv", tmp_path / "results.json")
    assert line.startswith("partial: cut short") and "short 8: " in line and "tok/s" in line, line


def test_kv_cases_chosen_by_the_setting_and_a_wrong_one_named_before_any_work(tmp_path, monkeypatch, capsys):
    from offcache.bench import kv

    monkeypatch.setenv("OFFCACHE_BENCH_KV_CASES", "short,sideways")
    _killed_at(monkeypatch, kv, "_model")
    with pytest.raises(SystemExit):
        main(["kv", "--tiny", "--out", str(tmp_path)])
    assert "OFFCACHE_BENCH_KV_CASES='short,sideways'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="OFFCACHE_BENCH_KV_CASES='short,sideways'"):  # the section's own check
        kv.run_kv(None)


def test_a_weights_run_killed_in_its_disk_rows_keeps_the_rows_before(tmp_path, monkeypatch):
    pytest.importorskip("compressed_tensors")
    from offcache.bench import weights

    monkeypatch.delenv("OFFCACHE_BENCH_WEIGHTS_DISK", raising=False)
    _killed_at(monkeypatch, weights, "_disk")
    with pytest.raises(Killed):
        main(["weights", "--tiny", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["runs"]["weights"]["partial"] is True
    impls = [r["impl"] for r in results["weights"]]
    assert impls == ["compute_only", "compressed_tensors", "offcache", "offcache_prefetch",
                     "raw_pinned_vs_engine_fetch"]  # fmt: skip
    assert _headline("weights", tmp_path / "results.json").startswith("partial: cut short")


def test_the_device_checks_weights_rows_leave_the_disk_out(tmp_path, monkeypatch, capsys):
    pytest.importorskip("compressed_tensors")
    from offcache.bench import weights

    monkeypatch.setenv("OFFCACHE_BENCH_WEIGHTS_DISK", "0")
    _killed_at(monkeypatch, weights, "_disk")  # not reached
    assert main(["weights", "--tiny", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert "partial" not in results["runs"]["weights"]
    by = {r["impl"]: r for r in results["weights"]}
    assert by["disk"]["skipped"] == "left out by OFFCACHE_BENCH_WEIGHTS_DISK=0"
    assert "disk_host_waits_per_subgraph_prefetch" not in by["bars"] and "wait_share_prefetch" in by["bars"]
    monkeypatch.setenv("OFFCACHE_BENCH_WEIGHTS_DISK", "no")
    with pytest.raises(SystemExit):
        main(["weights", "--tiny", "--out", str(tmp_path)])
    assert "OFFCACHE_BENCH_WEIGHTS_DISK must be 0 or 1, got 'no'" in capsys.readouterr().err


def test_the_oneshot_repeats_setting_and_a_garbage_one_stops_the_run_before_it_starts(monkeypatch, capsys):
    from offcache.bench.oneshot import repeats_for

    monkeypatch.delenv("OFFCACHE_BENCH_ONESHOT_REPEATS", raising=False)
    assert repeats_for(None) == 5
    monkeypatch.setenv("OFFCACHE_BENCH_ONESHOT_REPEATS", "2")
    assert repeats_for(None) == 2
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("OFFCACHE_BENCH_ONESHOT_REPEATS", bad)
        with pytest.raises(SystemExit):
            main(["oneshot", "--tiny"])
        assert "OFFCACHE_BENCH_ONESHOT_REPEATS must be a whole number >= 1" in capsys.readouterr().err
    monkeypatch.delenv("OFFCACHE_BENCH_ONESHOT_REPEATS")
    monkeypatch.setenv("OFFCACHE_BENCH_KV_CASES", "short,sideways")
    with pytest.raises(SystemExit):
        main(["transfer", "--tiny"])
    assert "OFFCACHE_BENCH_KV_CASES='short,sideways'" in capsys.readouterr().err
