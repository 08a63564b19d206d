"""benchmarks/device_check.sh fits its lease: its step deadlines add up to its budget, so
that no step can be starved by an earlier one running to its own deadline."""

import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "device_check.sh"


def _deadlines(text: str, pattern: str) -> dict[str, int]:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not found in {SCRIPT}"
    return {k: int(v) for k, v in re.findall(r"\[(\w+)\]=(\d+)", match.group(1))}


def test_the_device_check_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_the_step_deadlines_add_up_to_the_budget():
    text = SCRIPT.read_text()
    budget = int(re.search(r"BUDGET=\$\{DEVCHECK_BUDGET_S:-(\d+)\}", text).group(1))
    steps = re.search(r"NAMES=\(([^)]*)\)", text).group(1).split()
    gpu = _deadlines(text, r"\nDEADLINE=\(([^)]*)\)")
    assert sorted(gpu) == sorted(steps), "every step has a deadline, and only the steps"
    assert sum(gpu.values()) <= budget, (gpu, budget)
    # A lent GPU gives 15 minutes, start-up (1-2 min) included: two runs of the check must fit.
    assert 2 * budget + 180 <= 15 * 60, budget
    dry = {**gpu, **_deadlines(text, r"DEADLINE\+=\(([^)]*)\)")}
    skipped = {"wheels", "build", "gpu"}
    assert sum(v for k, v in dry.items() if k not in skipped) <= budget, dry
