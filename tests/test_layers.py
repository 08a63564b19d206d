"""The package's layers: every import points down, and nothing imports in a circle (docs/design.md's map);
few private names cross a module's border, no folder is past 10 modules and no module past 600 lines.

Read from the source (every import statement, those inside functions too), in offcache/ and in csrc/.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "offcache"

# Lowest first. Folders of one layer are siblings: neither imports the other.
LAYERS = [
    ("util",),
    ("engine",),
    ("activations", "weights", "kv"),
    ("plan",),
    ("patch",),
    ("__init__",),
    ("bench",),
]
RANK = {concern: i for i, layer in enumerate(LAYERS) for concern in layer}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def concern(module: str) -> str:
    """offcache.kv.static -> 'kv'; offcache.patch -> 'patch'; offcache -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py")}


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """The offcache modules `path` imports, each resolved to the module it names (a name taken from a
    package that is a module of its own counts as that module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "offcache")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "offcache":
                continue
            for a in node.names:
                sub = f"{source}.{a.name}"
                out.add(sub if sub in known else source)
    return {m for m in out if m != module}


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found) | {"offcache._C"}
    return {m: imports_of(p, m, known) for m, p in found.items()}


def test_every_module_belongs_to_a_layer():
    strays = sorted(m for m in modules() if concern(m) not in RANK)
    assert not strays, f"modules outside every layer of LAYERS (give them a folder, or a layer): {strays}"


def test_every_import_points_down():
    upward = []
    for module, targets in graph().items():
        for target in targets:
            if target == "offcache._C":
                if concern(module) != "engine":
                    upward.append(f"{module} -> offcache._C (only offcache.engine calls the compiled engine)")
                continue
            a, b = concern(module), concern(target)
            if RANK[b] > RANK[a] or (RANK[b] == RANK[a] and a != b):
                upward.append(f"{module} ({a}) -> {target} ({b})")
    assert not upward, "imports that do not point down:\n" + "\n".join(sorted(upward))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one node (Tarjan), and every self-loop."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_in_a_circle():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_circle():
    """The checks above can fail: a circle of three and an upward arrow are seen."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert concern("offcache.kv.static") == "kv" and RANK["plan"] > RANK["kv"]


def _includes(path: Path) -> set[Path]:
    out = set()
    for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.M):
        target = (path.parent / name).resolve()
        if not target.exists():
            target = (ROOT / "csrc" / name).resolve()
        out.add(target)
    return out


def test_csrc_core_is_torch_free_and_includes_only_itself():
    core = ROOT / "csrc" / "core"
    for path in sorted(core.iterdir()):
        text = path.read_text()
        assert not re.search(r"#\s*include\s+<(torch|ATen|c10|cuda|pybind11)", text), f"{path.name} includes torch/CUDA"
        for target in _includes(path):
            assert target.parent == core, f"csrc/core/{path.name} includes {target} (outside csrc/core: upward)"


def test_csrc_headers_include_no_circle():
    files = list((ROOT / "csrc").rglob("*.h"))
    edges = {str(p.resolve()): {str(t) for t in _includes(p)} for p in files}
    assert cycles(edges) == []


# csrc/'s folders, lowest first: each includes only its own folder and those below it.
CSRC_LAYERS = ["core", "backends", "region", "engine", ""]  # "": bindings.cpp, on top


def _csrc_folder(path: Path) -> str:
    rel = path.resolve().relative_to((ROOT / "csrc").resolve())
    return rel.parts[0] if len(rel.parts) > 1 else ""


def csrc_upward_includes(root: Path = ROOT / "csrc") -> list[str]:
    bad = []
    for path in sorted([*root.rglob("*.h"), *root.rglob("*.cpp")]):
        here = _csrc_folder(path)
        assert here in CSRC_LAYERS, f"csrc/{here}/ is in no layer of CSRC_LAYERS"
        for target in _includes(path):
            there = _csrc_folder(target)
            assert target.exists(), f"{path.relative_to(ROOT)} includes {target}, which does not exist"
            if CSRC_LAYERS.index(there) > CSRC_LAYERS.index(here):
                bad.append(f"{path.relative_to(ROOT)} -> {target.relative_to(ROOT)}")
    return bad


def test_csrc_includes_point_down():
    assert csrc_upward_includes() == [], "csrc includes pointing up a layer"


def test_csrc_shows_its_layers_as_folders():
    top = [p.name for p in (ROOT / "csrc").iterdir() if p.is_file()]
    folders = [p.name for p in (ROOT / "csrc").iterdir() if p.is_dir()]
    assert len(top) <= 6, f"csrc/ has {len(top)} files at its top: {top}"
    assert len(folders) >= 3 and set(folders) <= set(CSRC_LAYERS), folders


@pytest.mark.parametrize(
    "path",
    sorted([*(ROOT / "csrc").rglob("*.h"), *(ROOT / "csrc").rglob("*.cpp")]),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_csrc_file_is_past_600_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= 600, f"{path.relative_to(ROOT)} has {n} lines: the concern it holds wants its own file"


def test_csrc_blocks_know_no_engine():
    """A host block frees itself through its owner's release callback (BlockOwner), not a pointer to
    the Engine class: host_block.* include nothing of the engine's."""
    for name in ("host_block.h", "host_block.cpp"):
        path = ROOT / "csrc" / "engine" / name
        assert all(t.name != "engine.h" for t in _includes(path)), f"{name} includes engine.h"
        assert "Engine" not in re.sub(r"//.*", "", path.read_text()), f"{name} names the Engine class"


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_is_past_600_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= 600, f"{path.relative_to(ROOT)} has {n} lines: the concern it holds wants its own file"


# Private names (a leading underscore) one module of offcache imports from another: each is a seam
# that is not declared. The engine's own handle on the compiled module (offcache._C, imported by
# the engine's modules from its loader) is most of what is left.
MAX_PRIVATE_IMPORTS = 8


def private_imports() -> list[str]:
    """Every `from offcache... import _name` in offcache/ (relative ones too), as 'module: source._name'."""
    out = []
    for module, path in sorted(modules().items()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if not node.level and (node.module or "").split(".")[0] != "offcache":
                continue
            source = "." * node.level + (node.module or "")
            out += [
                f"{module}: {source}.{a.name}" for a in node.names if a.name.startswith("_") and a.name != "__future__"
            ]
    return out


def test_few_private_names_cross_a_module_border():
    found = private_imports()
    assert len(found) <= MAX_PRIVATE_IMPORTS, (
        f"{len(found)} private names imported across modules (at most {MAX_PRIVATE_IMPORTS}): give what "
        "another module needs a public name, or keep it where it is used:\n" + "\n".join(found)
    )


def test_the_private_import_count_sees_one():
    assert private_imports() and all(": " in line for line in private_imports())


# Folders whose modules sit side by side; offcache/bench is the benchmarks' command (one module per
# benchmark) and stays out of the count.
MAX_MODULES_PER_FOLDER = 10


def test_no_folder_holds_more_than_10_modules():
    crowded = {}
    for folder in sorted({p.parent for p in PKG.rglob("*.py")}):
        if folder == PKG / "bench":
            continue
        n = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
        if n > MAX_MODULES_PER_FOLDER:
            crowded[str(folder.relative_to(ROOT))] = n
    assert crowded == {}, f"folders past {MAX_MODULES_PER_FOLDER} modules (give a concern its own folder): {crowded}"


# A repository path in a csrc comment (offcache/..., tests/..., docs/..., csrc/...): a file moved since.
_CSRC_PATH = re.compile(
    r"\b((?:offcache|tests|docs|benchmarks|scripts|csrc|cpp_tests)/[\w/.-]*\w\.(?:py|pyi|md|h|cpp|sh))\b"
)


def test_csrc_comments_name_files_that_exist():
    stale = []
    for path in sorted(
        [*(ROOT / "csrc").rglob("*.h"), *(ROOT / "csrc").rglob("*.cpp"), *(ROOT / "cpp_tests").rglob("*.cpp")]
    ):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            stale += [f"{path.relative_to(ROOT)}:{n}: {p}" for p in _CSRC_PATH.findall(line) if not (ROOT / p).exists()]
    assert stale == [], "csrc comments name files that do not exist (moved?):\n" + "\n".join(stale)


def test_an_upward_csrc_include_is_seen(tmp_path, monkeypatch):
    """The csrc check can fail: a core file including an engine header is reported."""
    (tmp_path / "csrc" / "core").mkdir(parents=True)
    (tmp_path / "csrc" / "engine").mkdir()
    (tmp_path / "csrc" / "engine" / "engine.h").write_text("#pragma once\n")
    (tmp_path / "csrc" / "core" / "arena.h").write_text('#include "engine/engine.h"\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert csrc_upward_includes(tmp_path / "csrc") == ["csrc/core/arena.h -> csrc/engine/engine.h"]


# A repository path named in a live file (the package, the tests, the docs, the scripts): a file or
# folder moved since. The changelog names old paths on purpose, and results are records of their day.
_LIVE_PATH = re.compile(
    r"(?<![\w/.-])((?:offcache|tests|docs|benchmarks|scripts|csrc|cpp_tests)/[\w/.-]*\w"
    r"(?:\.(?:py|pyi|md|h|cpp|sh|json|png)\b|/))"
)
_NOT_OURS = ("tests/test_offload/",)  # compressed-tensors' own tests, which a test here runs from its repo


def _live_files() -> list[Path]:
    files = [*PKG.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "docs").glob("*.md")]
    files += [ROOT / "README.md", *(ROOT / "benchmarks").glob("*.md"), *(ROOT / "benchmarks").glob("*.sh")]
    files += [p for p in (ROOT / "scripts").glob("*") if p.is_file()] + [ROOT / "setup.py", ROOT / "pyproject.toml"]
    files += [p for p in (ROOT / ".ci").glob("*") if p.is_file()]
    return sorted(p for p in files if p.is_file() and p != ROOT / "docs" / "changelog.md")


def test_live_files_name_paths_that_exist():
    stale = []
    for path in _live_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for named in _LIVE_PATH.findall(line):
                if "DATE" in named or named.startswith(_NOT_OURS) or (ROOT / named).exists():
                    continue
                stale.append(f"{path.relative_to(ROOT)}:{n}: {named}")
    assert stale == [], "live files name paths that do not exist (moved?):\n" + "\n".join(stale)


def test_the_path_check_sees_a_moved_file():
    moved = "offcache/weights/" + "node_disk.py"  # (written in two pieces: this file is checked too)
    assert _LIVE_PATH.findall(f"see {moved} and tests/weights/node/") == [moved, "tests/weights/node/"]
