"""benchmarks/device_check.sh fits its lease, and its plan follows the H200's own step times.

The step deadlines add up to the budget (no step can be starved by an earlier one running to its own
deadline); each is at least 1.5x the time its workload took on the H200 (benchmarks/device_check_times.json,
every figure with its source), so that a step's expected time is at most two thirds of its deadline;
start-up and two runs fit the 15-minute lease; the steps run in the order of the value of what they
measure; a step killed at its deadline still leaves its numbers (tests/bench/test_bench_partial.py).
"""

import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"
TIMES = ROOT / "benchmarks" / "device_check_times.json"


def _deadlines(text: str, pattern: str) -> dict[str, int]:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not found in {SCRIPT}"
    return {k: int(v) for k, v in re.findall(r"\[(\w+)\]=(\d+)", match.group(1))}


def _plan():
    text = SCRIPT.read_text()
    budget = int(re.search(r"BUDGET=\$\{DEVCHECK_BUDGET_S:-(\d+)\}", text).group(1))
    steps = re.search(r"NAMES=\(([^)]*)\)", text).group(1).split()
    gpu = _deadlines(text, r"\nDEADLINE=\(([^)]*)\)")
    dry = {**gpu, **_deadlines(text, r"DEADLINE\+=\(([^)]*)\)")}
    return text, budget, steps, gpu, dry


def test_the_device_check_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_the_step_deadlines_add_up_to_the_budget_and_two_runs_fit_the_lease():
    _, budget, steps, gpu, dry = _plan()
    times = json.loads(TIMES.read_text())
    assert sorted(gpu) == sorted(steps), "every step has a deadline, and only the steps"
    assert sum(gpu.values()) == budget == times["budget_s"], (gpu, budget)
    # A lent GPU gives 15 minutes, the machine's start-up included: the check must fit twice.
    assert times["startup_s"] + 2 * (budget + times["overhead_s"]) <= times["lease_s"], times
    assert times["lease_s"] == 15 * 60 and times["startup_s"] >= 180
    skipped = {"wheels", "build", "gpu"}
    assert sum(v for k, v in dry.items() if k not in skipped) <= budget, dry


def test_each_deadline_is_at_least_one_and_a_half_times_the_h200s_time_for_its_step():
    _, _, steps, gpu, _ = _plan()
    times = json.loads(TIMES.read_text())
    factor = times["deadline_over_expected"]
    assert factor >= 1.5
    assert sorted(times["steps"]) == sorted(steps), "a recorded time (or why there is none) for every step"
    short = {}
    for name, deadline in gpu.items():
        step = times["steps"][name]
        assert step["source"], name
        if deadline == 0:  # runs in what the budget has left: nothing planned for it
            assert name in times["value"]["leftover"], name
            continue
        expected = step["expected_s"]
        assert expected is not None and expected > 0, (name, step)
        if step["h200_s"] is not None and "cut" not in step and "scaling" not in step:
            assert expected >= step["h200_s"], f"{name}: the workload as measured, or say how it was cut"
        if step["h200_s"] is None:
            assert "estimated" in step["source"], f"{name}: no H200 time, so the source says how it is estimated"
        if deadline < factor * expected:
            short[name] = (deadline, expected)
    assert not short, f"deadlines under {factor}x the H200's time: {short}"


def test_the_gpu_steps_workload_is_the_one_its_time_was_scaled_to():
    times = json.loads(TIMES.read_text())
    gpu = times["steps"]["gpu"]
    h200_tests, h200_workers = 91, 8  # 2026-12-04-h200-diag-gpu-tests.log
    scaled = gpu["h200_s"] * h200_workers / h200_tests * gpu["tests"] / gpu["workers"]
    assert abs(scaled - gpu["expected_s"]) < 0.5, (scaled, gpu)
    log = (ROOT / "benchmarks" / "results" / "2026-12-04-h200-diag-gpu-tests.log").read_text()
    assert f"in {gpu['h200_s']}s" in log and "-n 8" in (ROOT / "benchmarks/diag.sh").read_text()
    text = SCRIPT.read_text()
    assert re.search(r"CMD\[gpu\]=.*\$\(nproc\)", text), "the gpu step runs on every core, as its time assumes"
    assert "--durations" in re.search(r"CMD\[gpu\]=(.*)", text).group(1), (
        "it records each test's time for the next sizing"
    )


def test_the_steps_run_in_the_order_of_the_value_of_what_they_measure():
    text, _, steps, gpu, _ = _plan()
    times = json.loads(TIMES.read_text())
    assert steps == times["order"]
    value = times["value"]
    ranked = [s for group in ("prerequisites", "readme_claims_and_goals", "gpu_tests", "then", "leftover")
              for s in value[group]]  # fmt: skip
    assert steps == ranked, "the order is the value order"
    # The README's claims and issue 41's goals (KV >= 1.2x transformers' offloading, store-and-drop >= 90 % of
    # raw pinned, oneshot prefetch) right after the build, before anything else can eat the budget.
    assert steps[2:5] == ["kv", "bench", "oneshot"]
    assert steps[-2:] == ["soak", "tests"] and gpu["soak"] == gpu["tests"] == 0, "these two in the time left over"
    assert all(gpu[s] > 0 for s in steps[:-2]), "every other step planned"
    # The workload cuts the times assume.
    for step, setting in (("kv", "OFFCACHE_BENCH_KV_CASES=short,long"), ("weights", "OFFCACHE_BENCH_WEIGHTS_DISK=0"),
                          ("ranks", "OFFCACHE_BENCH_RANKS_IMPLS=offcache"),
                          ("oneshot", "OFFCACHE_BENCH_ONESHOT_REPEATS=2")):  # fmt: skip
        assert setting in re.search(rf"CMD\[{step}\]=(.*)", text).group(1), step


def test_the_gpu_tests_carry_what_was_left_for_a_gpu():
    """The allocator and capture tests, the node region on CUDA and the sliced mode on NCCL are gpu-marked, so
    the gpu step runs them (the sliced mode skips below two GPUs, saying so: -rs)."""
    tests = ROOT / "tests"
    for path, marker in (("engine/test_gpu_allocators.py", "pytest.mark.gpu"),
                         ("weights/node/test_gpu_weights_node.py", "pytest.mark.gpu")):  # fmt: skip
        assert marker in (tests / path).read_text(), path
    assert "OFFCACHE_TEST_PG" in (tests / "weights/node/test_gpu_weights_node.py").read_text()
    assert "-rfEs" in SCRIPT.read_text()


def test_the_oneshot_steps_time_is_scaled_to_its_runs_now():
    """The section warms up and repeats each kind since the H200 run: its time is scaled from that run's rows."""
    times = json.loads(TIMES.read_text())
    step = times["steps"]["oneshot"]
    rows = json.loads((ROOT / "benchmarks/results/2026-12-04-h200-device-check.json").read_text())["oneshot"]
    runs = sum(r["wall_s"] for r in rows)
    first = rows[0]["wall_s"]  # llm-compressor's first run, with 0.91 s of first-use costs in it
    repeats = int(re.search(r"OFFCACHE_BENCH_ONESHOT_REPEATS=(\d+)", SCRIPT.read_text()).group(1))
    expected = (step["h200_s"] - runs) + first + repeats * (runs - 0.91)
    assert abs(expected - step["expected_s"]) < 0.1, (expected, step)
