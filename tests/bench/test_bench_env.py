"""The benchmark's own variables are read as the engine's are: blank is unset, garbage is an error at start."""

import os

import pytest

from offcache.bench import __main__ as bench
from offcache.bench import disk, oneshot


@pytest.mark.parametrize("raw, runs", [("0", False), ("1", True), ("", True), (" 0 ", False)])
def test_oneshot_weights_switch_reads_0_1_and_blank(monkeypatch, raw, runs):
    monkeypatch.setenv("OFFCACHE_BENCH_ONESHOT_WEIGHTS", raw)
    assert bool(oneshot.weight_runs()) is runs


@pytest.mark.parametrize("raw", ["no", "false", "2", "off"])
def test_oneshot_weights_garbage_stops_the_bench_before_it_runs(monkeypatch, capsys, raw):
    """'no' used to count as on: the weights rows ran although the user asked them away."""
    monkeypatch.setenv("OFFCACHE_BENCH_ONESHOT_WEIGHTS", raw)
    with pytest.raises(ValueError, match=f"OFFCACHE_BENCH_ONESHOT_WEIGHTS must be 0 or 1, got '{raw}'"):
        oneshot.weight_runs()
    with pytest.raises(SystemExit):
        bench.parse_args(["oneshot", "--tiny"])
    assert "OFFCACHE_BENCH_ONESHOT_WEIGHTS" in capsys.readouterr().err


@pytest.mark.parametrize("raw", ["", "   "])
def test_a_blank_disk_dir_is_the_temp_folder_not_the_current_one(monkeypatch, tmp_path, raw):
    """A blank OFFCACHE_BENCH_DISK_DIR made the bench's files in the current folder."""
    monkeypatch.setenv("OFFCACHE_BENCH_DISK_DIR", raw)
    monkeypatch.chdir(tmp_path)
    folder = disk._folder()
    try:
        assert os.path.isabs(folder) and os.path.dirname(folder) != str(tmp_path)
        assert not list(tmp_path.iterdir())
    finally:
        os.rmdir(folder)


def test_a_disk_dir_that_is_no_folder_stops_the_bench_before_it_runs(monkeypatch, tmp_path, capsys):
    missing = tmp_path / "nowhere"
    monkeypatch.setenv("OFFCACHE_BENCH_DISK_DIR", str(missing))
    with pytest.raises(SystemExit):
        bench.parse_args(["disk", "--tiny"])
    assert f"OFFCACHE_BENCH_DISK_DIR: '{missing}' is not a folder" in capsys.readouterr().err
    monkeypatch.setenv("OFFCACHE_BENCH_DISK_DIR", str(tmp_path))
    folder = disk._folder()
    assert os.path.dirname(folder) == str(tmp_path)
    os.rmdir(folder)
