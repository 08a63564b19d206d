"""The README states what the code does: its configuration table matches the defaults."""

import re
from pathlib import Path

from offcache import _engine

README = Path(__file__).parent.parent / "README.md"


def test_configuration_table_matches_the_defaults():
    rows = re.findall(r"^\| `(OFFCACHE_[A-Z_]+)` \| .* \| `([^`]+)` \|$", README.read_text(), re.MULTILINE)
    documented = dict(rows)
    defaults = {variable: str(_engine.DEFAULTS[name]) for name, variable in _engine._ENV.items()}
    assert documented == {v: d for v, d in defaults.items() if d}
    for variable in (v for v, d in defaults.items() if not d):  # unset by default
        assert re.search(rf"^\| `{variable}` \| .* \| none", README.read_text(), re.MULTILINE), variable


def test_readme_commands_are_the_ones_ci_runs():
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    main_job = "bash scripts/setup.sh && .venv/bin/python -m offcache.bench --quick --out bench-out"
    tests = "bash scripts/setup.sh && bash scripts/test.sh"
    assert main_job in text and tests in text
    assert main_job in ci and tests in ci


def test_readme_plan_output_is_what_the_planner_prints(capsys):
    from offcache import plan

    block = re.search(r"```console\n\$ python -m offcache\.plan ([^\n]*)\n(.*?)\n```", README.read_text(), re.DOTALL)
    assert block, "the README shows no python -m offcache.plan run"
    assert plan.main(block[1].split()) == 0
    printed = capsys.readouterr().out.splitlines()
    shown = block[2].splitlines()
    # This machine's lines depend on the machine; every other line is the planner's arithmetic.
    from offcache.plan_cli import MACHINE_LINES as machine

    assert [x for x in shown if not x.startswith(machine)] == [x for x in printed if not x.startswith(machine)]
    assert len(shown) == len(printed)
