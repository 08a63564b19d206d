"""Never a silent torch mismatch: what a build records, and what an import under another torch does."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import offcache
from offcache import engine as _engine

ROOT = Path(__file__).resolve().parent.parent
BUILT = offcache.build_info()["torch"]  # the torch this engine was compiled against


def python(code: str, pythonpath: Path = ROOT, cwd: Path = ROOT, **env) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(pythonpath), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def package_copy(tmp_path: Path, record: dict | None) -> Path:
    """A copy of the offcache package (engine included) with `record` as its build record."""
    dst = tmp_path / "site" / "offcache"
    shutil.copytree(ROOT / "offcache", dst, ignore=shutil.ignore_patterns("__pycache__", "_C_build.json"))
    if record is not None:
        engine = next(dst.glob("_C*.so"))
        full = {"engine": engine.name, "engine_bytes": engine.stat().st_size, **record}
        (dst / _engine.BUILD_RECORD).write_text(json.dumps(full))
    return dst.parent


def test_an_engine_without_a_record_is_refused_under_another_torch():
    """The engine's own compiled-in version is compared once it loads (an engine copied in, an older build)."""
    proc = python("""
        import torch
        torch.__version__ = "2.99.1+cu999"
        import offcache
    """)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ") and f"built against torch {BUILT}" in last, proc.stderr[-2000:]
    assert "torch 2.99.1+cu999 is running" in last and f"install torch=={BUILT}" in last
    assert "--no-build-isolation" in last


def _other_torches(built: str) -> list[str]:
    """A patch release, the minor release before and the one after the torch the engine was built against."""
    major, minor, patch = (int(x) for x in re.match(r"(\d+)\.(\d+)\.(\d+)", built).groups())
    return [f"{major}.{minor}.{patch + 1}+cu130", f"{major}.{minor - 1}.0+cu130", f"{major}.{minor + 1}.0+cu132"]


@pytest.mark.parametrize("running", _other_torches(BUILT))
def test_the_build_record_refuses_another_torch_before_the_engine_loads(tmp_path, running):
    """Patch releases included: PyTorch keeps no C++ ABI between releases (a real 2.13 run hit an
    undefined c10 symbol), so any other version is refused, with both named, before dlopen."""
    site = package_copy(tmp_path, {"torch": BUILT, "cuda": torch.version.cuda})
    proc = python(
        f"""
        import sys, torch
        torch.__version__ = {running!r}
        try:
            import offcache
        except ImportError as exc:
            print(exc)
            print("loaded" if "offcache._C" in sys.modules else "not loaded")
        """,
        pythonpath=site,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    message, loaded = proc.stdout.strip().splitlines()
    assert f"built against torch {BUILT}" in message and f"torch {running} is running" in message
    assert loaded == "not loaded"


def test_a_cuda_build_under_a_cpu_only_torch_says_what_it_needs(tmp_path):
    site = package_copy(tmp_path, {"torch": "2.14.0+cu130", "cuda": "13.0"})
    proc = python(
        """
        import torch
        torch.__version__, torch.version.cuda = "2.14.0+cpu", None
        try:
            import offcache
        except ImportError as exc:
            print(exc)
        """,
        pythonpath=site,
        cwd=tmp_path,
    )
    assert "This build needs a CUDA build of torch (CUDA 13.0); torch 2.14.0+cpu is CPU-only" in proc.stdout


def test_a_stale_record_is_ignored_and_the_engine_decides(tmp_path):
    site = package_copy(tmp_path, {"torch": "1.0.0"})
    record = site / "offcache" / _engine.BUILD_RECORD
    record.write_text(json.dumps({**json.loads(record.read_text()), "engine_bytes": 1}))  # another engine's
    proc = python("import offcache; print(offcache.build_info()['torch'])", pythonpath=site, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == BUILT, proc.stderr[-2000:]


def test_the_in_place_build_recorded_the_torch_it_used():
    record = ROOT / "offcache" / _engine.BUILD_RECORD
    if not record.exists():
        # setuptools builds in build/ and copies the engine in: the record must come along.
        left = sorted(ROOT.glob("build/lib*/offcache/" + _engine.BUILD_RECORD))
        assert not left, f"the in-place build left its record in {left[0].parent}, not beside the engine"
        pytest.skip("this engine was not built by setup.py in this checkout (copied in)")
    got = json.loads(record.read_text())
    assert got["torch"] == BUILT == torch.__version__
    assert (ROOT / "offcache" / got["engine"]).stat().st_size == got["engine_bytes"]


def test_metadata_names_the_torch_in_the_version_and_the_requirements(tmp_path):
    """What a wheel would carry, from setup.py's metadata step (no compile): torch==X and +torchX.cuNNN."""
    proc = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = next(tmp_path.glob("*.egg-info"))
    public = torch.__version__.split("+")[0]
    variant = "cu" + torch.version.cuda.replace(".", "") if offcache.build_info()["cuda"] else "cpu"
    version = re.search(r"^Version: (.*)$", (info / "PKG-INFO").read_text(), re.MULTILINE)[1]
    assert version == f"{offcache.__version__}+torch{public}.{variant}"
    assert f"torch=={public}" in (info / "requires.txt").read_text().split("\n[")[0].splitlines()


BLOCK_TORCH = """
import runpy, sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
sys.argv = ["setup.py", "--version"]
runpy.run_path("setup.py", run_name="__main__")
"""


def test_a_build_without_torch_stops_with_one_line():
    proc = python(BLOCK_TORCH)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("offcache: no torch in the build environment"), proc.stderr
    assert "--no-build-isolation" in lines[0]


def test_an_isolated_build_stops_instead_of_compiling_against_another_torch(tmp_path):
    """pip's build isolation puts its own torch in a throwaway environment: refused, naming the way out."""
    fake = tmp_path / "pip-build-env-abc" / "overlay" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '2.99.0+cu999'\n")
    proc = python("import runpy, sys; sys.argv = ['setup.py', '--version']; runpy.run_path('setup.py')",
                  pythonpath=fake.parent)  # fmt: skip
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "torch 2.99.0+cu999 from an isolated build environment" in lines[0], proc.stderr
    assert "--no-build-isolation" in lines[0]


def test_the_build_system_does_not_ask_for_torch_and_its_setuptools_reads_the_license():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    requires = meta["build-system"]["requires"]
    assert not [r for r in requires if re.match(r"torch\b", r)]  # an isolated build would use another torch
    floor = next(r for r in requires if r.startswith("setuptools"))
    # project.license as a string (an SPDX expression, PEP 639) needs setuptools 77
    assert isinstance(meta["project"]["license"], str)
    assert tuple(int(x) for x in floor.split(">=")[1].split(".")) >= (77,)


def test_a_cuda_engine_that_cannot_load_under_a_cpu_only_torch_says_it_needs_a_cuda_torch(tmp_path):
    """As a CUDA wheel under a CPU-only torch: the engine's library needs libc10_cuda.so, which is absent."""
    import importlib.machinery

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to make a library that needs a missing libc10_cuda.so")
    site = package_copy(tmp_path, None)
    for engine in (site / "offcache").glob("_C*.so"):
        engine.unlink()
    lib = tmp_path / "lib"
    lib.mkdir()
    (tmp_path / "empty.c").write_text("int offcache_test_symbol;\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", lib / "libc10_cuda_absent.so", tmp_path / "empty.c"], check=True)
    engine = site / "offcache" / ("_C" + importlib.machinery.EXTENSION_SUFFIXES[0])
    subprocess.run([cc, "-shared", "-fPIC", "-o", engine, tmp_path / "empty.c", f"-L{lib}", "-Wl,--no-as-needed",
                    "-lc10_cuda_absent"], check=True)  # fmt: skip
    (lib / "libc10_cuda_absent.so").unlink()  # (torch has loaded the real libc10_cuda.so)
    proc = python(
        """
        import torch
        torch.__version__, torch.version.cuda = "2.14.0+cpu", None
        try:
            import offcache
        except ImportError as exc:
            print(exc)
        """,
        pythonpath=site,
        cwd=tmp_path,
    )
    assert "libc10_cuda_absent.so: cannot open shared object file" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "needs a CUDA build of torch (torch 2.14.0+cpu is CPU-only)" in proc.stdout
