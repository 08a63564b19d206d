"""The build's own checks: the compiler it picks, and an engine whose numbers come out wrong.

On a GPU machine whose CXX was a Red Hat devtoolset compiler (it links pieces of libstdc++ into
every shared object), every engine message with a number crashed the process: the pieces keep a
std::locale numbering of their own. Here a module linked with -static-libstdc++ shows the same
fault beside some torch builds (its numbers come out empty); a module built to answer wrong tests
the check on any machine.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from offcache import _C

ROOT = Path(__file__).resolve().parent.parent

FORMATTER = r"""
#include <Python.h>
#include <csignal>
#include <sstream>
static PyObject* format_check(PyObject*, PyObject* arg) {
  std::ostringstream s;
#ifdef OFFCACHE_TEST_WRONG_NUMBERS  // what the devtoolset build printed: numbers come out empty
  (void)arg;
  s << "[, ]";
#elif defined(OFFCACHE_TEST_CRASH)  // what it did beside torch 2.11 on the H200: a segfault
  (void)arg;
  std::raise(SIGSEGV);
#else
  s << "[" << static_cast<unsigned long>(PyLong_AsUnsignedLongLong(arg)) << ", " << 0.5 << "]";
#endif
  return PyUnicode_FromString(s.str().c_str());
}
static PyMethodDef methods[] = {{"_format_check", format_check, METH_O, ""}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&module); }
"""


@pytest.fixture
def setup_py(monkeypatch):
    """setup.py as a module (its setup() call runs only as __main__); the environment it touches is restored."""
    for name in ("CXX", "CC", "LDSHARED", "LDCXXSHARED", "CUDA_HOME"):  # registered with monkeypatch: restored
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)
    spec = importlib.util.spec_from_file_location("offcache_setup_under_test", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_engine_formats_numbers_as_its_messages_need():
    assert _C._format_check(2147483648) == "[2147483648, 0.5]"
    with pytest.raises(ValueError) as raised:
        _C.configure("host", 1 << 30, 2 << 30, 1 << 30, 0)
    assert "[1, 1073741824] bytes, got 2147483648" in str(raised.value)


def _compile(tmp_path: Path, name: str, *flags: str) -> Path:
    source = tmp_path / "formatter.cpp"
    source.write_text(FORMATTER)
    out = tmp_path / name / "_C.so"
    out.parent.mkdir()
    include = sysconfig.get_paths()["include"]
    subprocess.run(["g++", "-O1", "-fPIC", "-shared", f"-I{include}", str(source), "-o", str(out), *flags],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    return out


def _static_libstdcxx_available() -> bool:
    if shutil.which("g++") is None:
        return False
    found = subprocess.run(["g++", "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    return os.path.isabs(found) and os.path.exists(found)


def test_the_build_check_removes_an_engine_whose_numbers_come_out_wrong(setup_py, tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    good = _compile(tmp_path, "good")
    setup_py.check_engine(good)  # loads beside torch, formats right: kept
    assert good.exists()
    bad = _compile(tmp_path, "bad", "-DOFFCACHE_TEST_WRONG_NUMBERS")
    with pytest.raises(RuntimeError, match=r"formats 2147483648 and 0\.5 as '\[, \]', not '\[2147483648, 0\.5\]'") as e:
        setup_py.check_engine(bad)
    assert not bad.exists(), "a broken engine must not stay where the package would load it"
    assert "CXX=/usr/bin/g++" in str(e.value)


def _formats_beside_torch(engine: Path) -> str:
    done = subprocess.run([sys.executable, "-c", FORMAT_BESIDE_TORCH, str(engine)], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    return done.stdout.strip() if done.returncode == 0 else f"<exit status {done.returncode}>"


FORMAT_BESIDE_TORCH = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("_C", sys.argv[1])
engine = importlib.util.module_from_spec(spec)
spec.loader.exec_module(engine)
print(engine._format_check(2147483648))
"""


@pytest.mark.skipif(not _static_libstdcxx_available(), reason="needs g++ with a static libstdc++ (libstdc++.a)")
def test_an_engine_with_libstdcxx_linked_in_is_kept_exactly_when_it_formats_right(setup_py, tmp_path):
    """libstdc++ linked into the module (as devtoolset does) breaks its numbers beside some torch builds
    and not others; the check keeps it exactly when it formats right where it will be loaded."""
    linked = _compile(tmp_path, "linked", "-static-libstdc++", "-Wl,-Bsymbolic-functions")
    printed = _formats_beside_torch(linked)
    if printed == "[2147483648, 0.5]":
        setup_py.check_engine(linked)
        assert linked.exists()
    else:
        with pytest.raises(RuntimeError, match=r"formats 2147483648 and 0\.5 as"):
            setup_py.check_engine(linked)
        assert not linked.exists()


def test_an_engine_that_does_not_load_here_is_a_failure_with_its_reason(setup_py, tmp_path):
    """An engine that does not load beside torch on the host that built it (an ImportError, not a crash) is a
    failed build, with the reason: it used to be kept as "not checked", and then failed or crashed at import."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    source = tmp_path / "empty.cpp"
    source.write_text("int offcache_not_a_module = 1;\n")  # no PyInit__C: the import fails cleanly
    engine = tmp_path / "_C.so"
    subprocess.run(["g++", "-fPIC", "-shared", str(source), "-o", str(engine)], check=True, timeout=300)
    with pytest.raises(RuntimeError, match=r"does not load beside torch") as e:
        setup_py.check_engine(engine)
    assert "PyInit__C" in str(e.value), "the reason: what loading it said"
    assert not engine.exists(), "a broken engine must not stay where the package would load it"


def _fake_devtoolset(tmp_path: Path) -> Path:
    """A compiler that says it links libstdc++_nonshared.a, as Red Hat's devtoolset does; every other call is
    logged to calls.log (one line each) and handed to g++."""
    archive = tmp_path / "libstdc++_nonshared.a"
    archive.write_bytes(b"!<arch>\n")
    cxx = tmp_path / "devtoolset-g++"
    cxx.write_text(f'#!/bin/sh\n[ "$1" = -print-file-name=libstdc++_nonshared.a ] && echo {archive} && exit 0\n'
                   f'echo "$@" >>{tmp_path / "calls.log"}\nexec g++ "$@"\n')  # fmt: skip
    cxx.chmod(0o755)
    return cxx


@pytest.mark.skipif(not os.path.exists("/usr/bin/g++"), reason="needs a system g++ in /usr/bin")
def test_a_compiler_that_links_libstdcxx_pieces_is_replaced_by_the_system_one(setup_py, tmp_path, monkeypatch,
                                                                               capsys):  # fmt: skip
    if setup_py.static_libstdcxx(["/usr/bin/g++"]) is not None:
        pytest.skip("the system g++ itself links libstdc++ pieces here")
    fake = _fake_devtoolset(tmp_path)
    assert setup_py.static_libstdcxx([str(fake)]) == str(tmp_path / "libstdc++_nonshared.a")
    monkeypatch.setenv("CXX", str(fake))
    setup_py.choose_cxx()
    assert os.environ["CXX"] in ("/usr/bin/g++", "/usr/bin/c++", shutil.which("g++"), shutil.which("c++"))
    assert os.environ["CXX"] != str(fake)
    assert f"not {fake}" in capsys.readouterr().out


def test_an_ordinary_compiler_is_kept(setup_py, monkeypatch):
    if shutil.which("g++") is None or setup_py.static_libstdcxx(["g++"]) is not None:
        pytest.skip("needs a g++ that links libstdc++ only as a shared library")
    monkeypatch.setenv("CXX", "g++")
    setup_py.choose_cxx()
    assert os.environ["CXX"] == "g++"


@pytest.mark.skipif(not os.path.exists("/usr/bin/g++"), reason="needs a system g++ in /usr/bin")
def test_the_link_step_leaves_a_compiler_that_links_libstdcxx_pieces_too(setup_py, tmp_path, monkeypatch):
    """The H200's image named its devtoolset g++ for the link as well (the diagnosis log's link line starts
    with /opt/gcc/bin/g++): replacing CXX alone left LDSHARED (and LDCXXSHARED) on it. Links of C++ and of C
    objects, made the way setuptools makes them, must not call it."""
    from setuptools._distutils.ccompiler import new_compiler
    from setuptools._distutils.sysconfig import customize_compiler

    if setup_py.static_libstdcxx(["/usr/bin/g++"]) is not None:
        pytest.skip("the system g++ itself links libstdc++ pieces here")
    fake = _fake_devtoolset(tmp_path)
    for name in ("CXX", "LDSHARED", "LDCXXSHARED"):
        monkeypatch.setenv(name, f"{fake} -shared" if name.startswith("LD") else str(fake))
    setup_py.choose_cxx()
    assert str(fake) not in os.environ["LDSHARED"] and str(fake) not in os.environ["LDCXXSHARED"], os.environ
    source = tmp_path / "x.cpp"
    source.write_text("int offcache_link_check() { return 1; }\n")
    obj = tmp_path / "x.o"
    subprocess.run(["g++", "-fPIC", "-c", str(source), "-o", str(obj)], check=True, timeout=300)
    compiler = new_compiler()
    customize_compiler(compiler)
    for lang in ("c++", "c"):
        out = tmp_path / f"linked-{lang}.so"
        compiler.link_shared_object([str(obj)], str(out), target_lang=lang)
        assert out.exists()
    calls = tmp_path / "calls.log"
    assert not calls.exists(), f"the devtoolset compiler was called: {calls.read_text()}"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location("_C", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_import_check_refuses_an_engine_whose_numbers_come_out_wrong_or_crash(tmp_path):
    """A wheel built elsewhere meets this machine's libstdc++ only at import: the loader formats a number
    through the engine (in a forked child, so that a crash is reported, not suffered) and refuses it."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    from offcache.engine import loader

    loader.check_number_formatting(_load(_compile(tmp_path, "good")), "good")
    bad = _load(_compile(tmp_path, "bad", "-DOFFCACHE_TEST_WRONG_NUMBERS"))
    with pytest.raises(ImportError, match=r"formats 2147483648 and 0\.5 as '\[, \]', not '\[2147483648, 0\.5\]'") as e:
        loader.check_number_formatting(bad, "bad/_C.so")
    assert "bad/_C.so" in str(e.value) and "libstdc++" in str(e.value) and "CXX=g++" in str(e.value)
    crash = _load(_compile(tmp_path, "crash", "-DOFFCACHE_TEST_CRASH"))
    with pytest.raises(ImportError, match=r"crashed \(signal 11, SIGSEGV\) formatting 2147483648") as e:
        loader.check_number_formatting(crash, "crash/_C.so")
    assert "CXX=g++" in str(e.value)


def test_the_engine_is_checked_when_it_is_imported(tmp_path, monkeypatch):
    """offcache.engine.loader runs the check on the engine it loads, not only setup.py on the build host."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    import torch

    import offcache
    from offcache.engine import loader

    bad = _load(_compile(tmp_path, "bad", "-DOFFCACHE_TEST_WRONG_NUMBERS"))
    bad.torch_version, bad.cuda_version = str(torch.__version__), None
    monkeypatch.setattr(offcache, "_C", bad)
    monkeypatch.setitem(sys.modules, "offcache._C", bad)
    with pytest.raises(ImportError, match=r"formats 2147483648 and 0\.5 as '\[, \]'"):
        loader._load_engine()


@pytest.mark.skipif(not _static_libstdcxx_available(), reason="needs g++ with a static libstdc++ (libstdc++.a)")
def test_an_engine_with_libstdcxx_linked_in_passes_the_import_check_exactly_when_it_formats_right(tmp_path):
    linked = _compile(tmp_path, "linked", "-static-libstdc++", "-Wl,-Bsymbolic-functions")
    printed = _formats_beside_torch(linked)
    script = f"""
import importlib.util, torch
from offcache.engine.loader import check_number_formatting
spec = importlib.util.spec_from_file_location("_C", {str(linked)!r})
engine = importlib.util.module_from_spec(spec)
spec.loader.exec_module(engine)
try:
    check_number_formatting(engine, "linked")
    print("kept")
except ImportError as e:
    print("refused:", e)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("kept" if printed == "[2147483648, 0.5]" else "refused:"), (printed, done.stdout)


def test_an_engine_checked_at_its_build_beside_this_libstdcxx_forks_no_child_at_import(tmp_path, monkeypatch):
    """setup.py records the libstdc++ its check passed beside; an import beside the same one skips the fork,
    an import beside another (a wheel built elsewhere) runs it, and a wrong engine is refused either way."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    import json

    import offcache
    from offcache.engine import loader

    here = loader.loaded_libstdcxx()
    assert here and all("libstdc++" in x for x in here)
    record = json.loads((Path(offcache.__file__).parent / loader.BUILD_RECORD).read_text())
    assert record["format_checked_with"] == here, "the build's check and the import name libstdc++ alike"
    forks = []
    real = loader._format_in_child
    monkeypatch.setattr(loader, "_format_in_child", lambda engine: forks.append(engine) or real(engine))
    good = _load(_compile(tmp_path, "good"))
    loader.check_number_formatting(good, "good", here)
    assert forks == []
    loader.check_number_formatting(good, "good", ["/elsewhere/libstdc++.so.6:1:1"])
    loader.check_number_formatting(good, "good", None)
    assert len(forks) == 2
    bad = _load(_compile(tmp_path, "bad", "-DOFFCACHE_TEST_WRONG_NUMBERS"))
    with pytest.raises(ImportError, match="formats 2147483648"):
        loader.check_number_formatting(bad, "bad", ["/elsewhere/libstdc++.so.6:1:1"])
