"""The host-work section: instructions per update() from two callgrind runs, net of making the values."""

import subprocess
import sys
from pathlib import Path

import pytest

from offcache.bench import host_work

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("impl", host_work.IMPLS)
def test_each_child_stores_its_batches_and_exits_0(impl):
    if impl == "llmcompressor" and not host_work._has_llmcompressor():
        pytest.skip("llm-compressor is not installed in this environment (the newest-peers stage has none)")
    # What callgrind counts: the same command without it (llm-compressor's class is in the test env).
    proc = subprocess.run([sys.executable, "-m", "offcache.bench.host_work", "--child", impl, "5"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_rows_are_the_per_batch_difference_net_of_the_values(monkeypatch):
    # Fixed counts per (impl, n): a start-up cost plus a per-batch cost, which the rows must recover.
    start = {"offcache": 7_000_000, "llmcompressor": 9_000_000, "values": 5_000_000}
    per_batch = {"offcache": 220_000, "llmcompressor": 366_000, "values": 83_000}
    calls = []

    def fake_count(impl, n):
        calls.append((impl, n))
        return start[impl] + per_batch[impl] * n

    monkeypatch.setattr(host_work, "count", fake_count)
    monkeypatch.setattr(host_work.shutil, "which", lambda name: "/usr/bin/valgrind")
    monkeypatch.setattr(host_work, "_has_llmcompressor", lambda: True)  # counted by the fake, not imported

    class Ctx:
        tiny = True

    rows = {r["impl"]: r for r in host_work.run_host_work(Ctx())}
    assert sorted(calls) == sorted((i, n) for i in host_work.IMPLS for n in (20, 120))
    assert rows["offcache"]["update_instructions_per_batch"] == 220_000 - 83_000
    assert rows["llmcompressor"]["update_instructions_per_batch"] == 366_000 - 83_000
    assert "update_instructions_per_batch" not in rows["values"]
    assert rows["offcache"]["ratio_to_llmcompressor"] == pytest.approx(137 / 283)


def test_without_valgrind_nothing_is_measured_and_it_says_so(monkeypatch, capsys):
    monkeypatch.setattr(host_work.shutil, "which", lambda name: None)

    class Ctx:
        tiny = True

    assert host_work.run_host_work(Ctx()) == []
    assert "valgrind is not installed" in capsys.readouterr().err


def test_without_llmcompressor_the_rows_leave_it_out_and_give_no_ratio(monkeypatch):
    monkeypatch.setattr(host_work, "count", lambda impl, n: 1000 * n + (0 if impl == "values" else 500 * n))
    monkeypatch.setattr(host_work.shutil, "which", lambda name: "/usr/bin/valgrind")
    monkeypatch.setattr(host_work, "_has_llmcompressor", lambda: False)

    class Ctx:
        tiny = True

    rows = host_work.run_host_work(Ctx())
    assert [r["impl"] for r in rows] == ["offcache", "values"]
    assert rows[0]["update_instructions_per_batch"] == 500
    assert "ratio_to_llmcompressor" not in rows[0]
