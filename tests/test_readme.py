"""README.md and docs/ state what the code does: their code blocks run, their tables match the code."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from offcache import engine as _engine
from offcache.engine import config as _config

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
CONFIGURATION = ROOT / "docs" / "configuration.md"
# A fenced block, with the HTML comment right before it if there is one.
# Optional packages a page's blocks may use (a name in the code, patch_llmcompressor() included).
OPTIONAL = ("llmcompressor", "compressed_tensors", "transformers", "matplotlib")
BLOCK = re.compile(r"(?:<!-- (not run: [^>]*?) -->\n)?```(\w*)\n(.*?)\n```", re.DOTALL)


def blocks(page: Path) -> list[tuple[str, str, str]]:
    """(language, code, why it is not run or '') of every fenced block of `page`."""
    return [(m[2], m[3], m[1] or "") for m in BLOCK.finditer(page.read_text())]


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_python_block_runs(page, tmp_path):
    """A page's python blocks run in order in one fresh interpreter, as a reader would type them."""
    code = [c for lang, c, skip in blocks(page) if lang == "python" and not skip]
    if not code:
        pytest.skip(f"{page.name} has no python block")
    missing = [m for m in OPTIONAL if m in "\n".join(code) and importlib.util.find_spec(m) is None]
    if missing:  # the environment without llm-compressor (scripts/test_newest.sh); the pinned one runs it
        pytest.skip(f"{page.name}'s blocks use {', '.join(missing)}, which is not installed")
    proc = run_python("\n\n".join(code), tmp_path)
    assert proc.returncode == 0, f"{page.name}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_shell_block_runs_or_says_why_not(page, tmp_path):
    for lang, code, skip in blocks(page):
        if lang == "console":  # a command with its output: test_planner_output_is_what_the_planner_prints
            assert code.startswith("$ python -m offcache.plan "), code
            continue
        if lang == "python" or skip:
            assert lang == "python" or skip.removeprefix("not run:").strip(), f"{page.name}: a reason is needed"
            continue
        assert lang == "bash", f"{page.name}: a ```{lang} block is neither run nor marked <!-- not run: why -->"
        for line in code.splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            assert line.startswith("python -m offcache."), f"{page.name}: {line!r} is not run by this test"
            args = line.split("#")[0].split()[1:]
            proc = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
            assert proc.returncode == 0, f"{page.name}: {line}\n{proc.stderr[-3000:]}"


def test_readme_is_about_one_screen_and_links_its_pages():
    text = README.read_text()
    assert len(text.splitlines()) < 120
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in text, page.name


def test_links_point_at_files_that_exist():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith("http"):
                assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_nothing_internal():
    """No issue numbers, no word of the machines or sessions the project was written in."""
    internal = re.compile(r"\bissue \d+|#\d{2,}\b|this VM|\bsession|the old defaults|no GPU has been lent", re.I)
    for page in PAGES:
        found = internal.findall(page.read_text())
        assert not found, f"{page.name}: {found}"


def test_readme_commands_are_the_ones_ci_runs():
    text = README.read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    main_job = "bash scripts/setup.sh && .venv/bin/python -m offcache.bench --quick --out bench-out"
    tests = "bash scripts/setup.sh && bash scripts/test.sh"
    assert main_job in text and tests in text
    assert main_job in ci and tests in ci


def test_readme_lists_every_extra():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    listed = set(re.findall(r"^\| `([a-z]+)` \|", README.read_text(), re.MULTILINE))
    assert listed == set(extras) - {"test"}


def variables_in_code() -> set[str]:
    """Every OFFCACHE_ variable the Python code and setup.py read from the environment."""
    read = re.compile(r"""(?:environ(?:\.get\(|\[)|env_switch\(|env_choice\()\s*["'](OFFCACHE_[A-Z_]+)["']""")
    found = set(_config._ENV.values())
    for path in [*(ROOT / "offcache").rglob("*.py"), ROOT / "setup.py"]:
        found |= set(read.findall(path.read_text()))
    return found


def configuration_table() -> dict[str, str]:
    rows = re.findall(r"^\| `(OFFCACHE_[A-Z_]+)` \| .* \| ([^|]+) \|$", CONFIGURATION.read_text(), re.MULTILINE)
    return {name: default.strip() for name, default in rows}


def test_configuration_table_matches_the_defaults():
    table = configuration_table()
    for name, variable in _config._ENV.items():
        assert table[variable] == f"`{_engine.DEFAULTS[name]}`", variable


def test_configuration_table_lists_every_variable_the_code_reads():
    assert set(configuration_table()) == variables_in_code()


def test_configuration_table_weight_prefetch_default(monkeypatch):
    pytest.importorskip("compressed_tensors")
    from offcache.weights import compressed_tensors

    monkeypatch.delenv("OFFCACHE_WEIGHT_PREFETCH", raising=False)
    assert configuration_table()["OFFCACHE_WEIGHT_PREFETCH"] == f"`{compressed_tensors.prefetch_depth()}`"


def test_planner_output_is_what_the_planner_prints(capsys):
    # Not imported here: llm-compressor's logger binds the stdout of the moment it is imported, which
    # would be this test's capture (the planner imports it with stdout sent to stderr, as users run it).
    if importlib.util.find_spec("llmcompressor") is None:
        pytest.skip("the page shows a traced plan; without llm-compressor the planner falls back")
    import offcache.plan as plan

    page = ROOT / "docs" / "planner.md"
    block = re.search(r"```console\n\$ python -m offcache\.plan ([^\n]*)\n(.*?)\n```", page.read_text(), re.DOTALL)
    assert block, "docs/planner.md shows no python -m offcache.plan run"
    assert plan.main(block[1].split()) == 0
    log = re.compile(r"^\d{4}-\d\d-\d\dT\S+ \| \w+ \| [A-Z]+ - ")  # llm-compressor's, if imported earlier
    printed = [x for x in capsys.readouterr().out.splitlines() if not log.match(x)]
    shown = block[2].splitlines()
    # This machine's lines depend on the machine; every other line is the planner's arithmetic.
    from offcache.plan.cli import MACHINE_LINES as machine

    assert [x for x in shown if not x.startswith(machine)] == [x for x in printed if not x.startswith(machine)]
    assert len(shown) == len(printed)
