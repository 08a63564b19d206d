"""python -m offcache.bench pastram: kept out of the default run, its record of each run (never a zero), and a
clear non-zero exit where no memory cgroup can be made. Its real runs are tests/weights/memory/test_past_ram.py's."""

from __future__ import annotations

import json

import pytest

from offcache.bench import pastram
from offcache.bench.__main__ import ALL, main, parse_args, sections_of
from offcache.bench.cgroup import NoCgroupError

MiB = 1 << 20


def test_pastram_is_a_section_but_not_in_the_default_run():
    assert "pastram" not in ALL and "pastram" not in sections_of(parse_args([]))
    assert sections_of(parse_args(["pastram"])) == ["pastram"]


def test_without_a_cgroup_nothing_runs_and_the_command_fails_saying_so(tmp_path, monkeypatch, capsys):
    pytest.importorskip("llmcompressor")

    def refuse(limit, name=None):
        raise NoCgroupError("no writable memory cgroup: /sys/fs/cgroup/x: Permission denied")

    monkeypatch.setattr(pastram, "memory_cgroup", refuse)
    monkeypatch.setattr(pastram, "make_model", lambda *a: pytest.fail("the model is made before the cgroup is known"))
    assert main(["pastram", "--tiny", "--out", str(tmp_path)]) == 1
    assert "pastram: NO CGROUP, nothing run: no writable memory cgroup" in capsys.readouterr().out
    saved = json.loads((tmp_path / "pastram.json").read_text())
    assert saved["no_cgroup"].startswith("no writable memory cgroup") and saved["runs"] == []
    assert "**No cgroup**: nothing was run." in (tmp_path / "pastram.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text())["pastram"]["no_cgroup"]


def _run(mode: str, outcome: str, completed: bool, rc: int, anon: int) -> dict:
    samples = [{"t": t / 10, "cgroup_bytes": 1000 * MiB, "anon_bytes": anon, "read_bytes": t * MiB,
                **({"offcache_host_bytes": 64 * MiB} if mode == "weights" else {})} for t in range(20)]  # fmt: skip
    phases = [{"phase": p, "t": i * 0.5, "said": f"phase {p}"} for i, p in enumerate(pastram.PHASES[: 3 + completed])]
    return {"mode": mode, "label": pastram.LABELS[mode], "outcome": outcome, "completed": completed, "rc": rc,
            "oom_kills": 0 if completed else 1, "phases": phases, "wall_s": 2.0, "limit_bytes": pastram.LIMIT,
            "peak_cgroup_bytes": pastram.LIMIT, "max_anon_bytes": anon, "read_bytes": 19 * MiB,
            "read_bytes_by_phase": pastram._reads_by_phase(phases, samples),
            "max_offcache_host_bytes": 64 * MiB if mode == "weights" else None, "placement": None,
            "stderr_tail": "", "samples": samples}  # fmt: skip


def test_a_killed_run_is_recorded_as_killed_with_the_plan_beside_the_measured_run(tmp_path):
    plan = {"command": "python -m offcache.plan ...", "offload": {
        "cpu_bytes": 240 * MiB, "disk_bytes": 240 * MiB, "activation_host_bytes": MiB, "activation_disk_bytes": 0,
        "expected_peak_bytes": 800 * MiB, "cold_pass_read_bytes": 480 * MiB, "save_read_bytes": 240 * MiB}}  # fmt: skip
    killed = _run("none", "killed by the OOM killer (rc -9) after phase calibrated", False, -9, 1090 * MiB)
    done = _run("weights", "completed", True, 0, 700 * MiB)
    result = {"command": "python -m offcache.bench pastram", "date": "2026-12-08T01:00:00+00:00",
              "machine": {"name": "cpu", "cpus": 2, "ram_bytes": 24 << 30, "kernel": "6"}, "limit_bytes": pastram.LIMIT,
              "model": {"layers": 16, "hidden_size": 1024, "intermediate_size": 4096, "dtype": "bfloat16",
                        "scheme": "FP8", "samples": 4, "seq_len": 16, "checkpoint_bytes": 480 * MiB},
              "runs": [killed, done], "identical": None, "plan": plan}  # fmt: skip
    result["prediction"] = pastram.compare(plan, done)
    text = pastram.markdown(result)
    assert "| llm-compressor alone | killed by the OOM killer (rc -9) after phase calibrated |" in text
    assert "Saved checkpoints not compared: a run did not complete." in text
    assert "| peak (anonymous memory) | 800 MiB | 700 MiB | 1.143" in text
    c = result["prediction"]
    assert c["measured_cold_pass_read_bytes"] == done["read_bytes_by_phase"]["loaded"] + done[
        "read_bytes_by_phase"]["calibrated"]  # fmt: skip
    assert pastram.within_tolerance(c)  # the reads here are far from the plan's: outside the tolerance, and said
    assert not pastram.within_tolerance({**c, "measured_cold_pass_read_bytes": 470 * MiB})
    pytest.importorskip("matplotlib")
    assert (tmp_path / "p.png").exists() is False
    pastram.plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000
