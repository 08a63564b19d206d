"""Builds offcache and its extension offcache._C.

The CUDA backend is compiled when torch is a CUDA build and a CUDA toolkit is
found; the decision never depends on a GPU being present, since build hosts
usually have none. OFFCACHE_FORCE_CUDA=1 turns "CUDA could not be built" into
an error. Install with: pip install --no-build-isolation .

The engine runs only with the torch it was compiled against (offcache/engine/loader.py refuses any
other), so the build uses the torch installed where it will run: the wheel records that torch in
its requirements (torch==X) and in its version's local label (0.2.0+torch2.14.0.cu130), and
offcache/_C_build.json records it next to the engine.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
NO_TORCH = (
    "offcache compiles against the torch that will run it, so install torch first and then "
    "offcache with `pip install --no-build-isolation .` (pip's default build isolation builds in a "
    "throwaway environment, against a torch that would not be the one you run)"
)
# Where build front ends put their isolated build environments.
ISOLATED = ("pip-build-env-", "build-env-", "/builds-v0/")

try:
    import torch
except ModuleNotFoundError:
    sys.exit(f"offcache: no torch in the build environment (not installed, or hidden by build isolation): {NO_TORCH}.")
if any(marker in str(Path(torch.__file__).resolve()) for marker in ISOLATED):
    sys.exit(
        f"offcache: this build would use torch {torch.__version__} from an isolated build environment: {NO_TORCH}."
    )


def find_cuda_toolkit() -> str | None:
    """A CUDA toolkit folder holding include/cuda_runtime_api.h, or None.

    torch guesses CUDA_HOME from the nvcc on PATH; a wrapper script in
    /usr/local/bin makes that guess /usr/local, which has no CUDA headers.
    """
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and (Path(c) / "include" / "cuda_runtime_api.h").exists():
            return c
    return None


def _ask_compiler(cxx: list[str], *args: str) -> str:
    try:
        done = subprocess.run([*cxx, *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def static_libstdcxx(cxx: list[str]) -> str | None:
    """The libstdc++_nonshared.a that the C++ compiler `cxx` links into every shared object, or
    None. Red Hat's devtoolset / gcc-toolset compilers do (so do the manylinux images' /opt
    compilers); copied onto another system, the pieces they link in keep a std::locale of their
    own, unlike the libstdc++ that torch loads, and the engine's numbers in messages come out empty
    or crash the process (seen on a GPU machine whose CXX was such a compiler)."""
    found = _ask_compiler(cxx, "-print-file-name=libstdc++_nonshared.a")
    return found if os.path.isabs(found) and os.path.exists(found) else None


LINKERS = ("LDSHARED", "LDCXXSHARED")  # setuptools' shared-object links: C objects, C++ objects


def _linker(name: str) -> list[str]:
    """The link command setuptools will run for `name` (LINKERS): the environment's, else Python's own."""
    return shlex.split(os.environ.get(name) or sysconfig.get_config_var(name) or "")


def choose_cxx() -> None:
    """Keeps the C++ compiler torch's build helpers would use (CXX, else c++) unless it, or the compiler
    that links (LDSHARED, LDCXXSHARED), links pieces of libstdc++ statically and a system g++ (9 or newer,
    for C++17) that does not is at hand: then CXX, CC and both link commands name that one (their flags
    kept), and the choice is printed. The link matters as much as the compiling: the pieces come in there
    (the H200's image named its devtoolset g++ for both)."""
    chosen = shlex.split(os.environ.get("CXX", "c++")) or ["c++"]
    linkers = {name: _linker(name) for name in LINKERS}
    found = {cmd[0]: static_libstdcxx(cmd) for cmd in (chosen, *([cmd[0]] for cmd in linkers.values() if cmd))}
    offending = {name: nonshared for name, nonshared in found.items() if nonshared is not None}
    if not offending:
        return
    nonshared = next(iter(offending.values()))
    avoid = {os.path.realpath(shutil.which(name) or name) for name in offending}
    for cand in ("/usr/bin/g++", "/usr/bin/c++", shutil.which("g++"), shutil.which("c++")):
        if not cand or not os.path.exists(cand) or os.path.realpath(cand) in avoid:
            continue
        major = _ask_compiler([cand], "-dumpversion").split(".")[0]
        if not major.isdigit() or int(major) < 9 or static_libstdcxx([cand]) is not None:
            continue
        cc = cand[: -len("g++")] + "gcc" if cand.endswith("g++") else cand[: -len("c++")] + "cc"
        os.environ["CXX"] = cand
        if os.path.exists(cc):
            os.environ["CC"] = cc
        for name, cmd in linkers.items():  # the same flags, the system compiler in front
            flags = cmd[1:] if cmd else []
            os.environ[name] = shlex.join([cand, *flags, *([] if "-shared" in flags else ["-shared"])])
        print(
            f"offcache: building and linking with {cand}, not {' '.join(chosen)} (LDSHARED "
            f"{' '.join(linkers['LDSHARED'][:1]) or 'unset'}): that compiler links pieces of libstdc++ into "
            f"every shared object ({nonshared}), which disagree with the libstdc++ torch loads"
        )
        return


TOOLKIT = find_cuda_toolkit()
if torch.version.cuda is not None and TOOLKIT:
    os.environ["CUDA_HOME"] = TOOLKIT

from torch.utils.cpp_extension import (  # noqa: E402  (reads CUDA_HOME at import)
    BuildExtension,
    CppExtension,
    CUDAExtension,
)

CORE = [
    "csrc/core/arena.cpp",
    "csrc/core/deferred_free.cpp",
    "csrc/core/disk_file.cpp",
    "csrc/core/event.cpp",
    "csrc/core/host_stream.cpp",
    "csrc/core/page_source.cpp",
]
ENGINE = [
    "csrc/backends/backend_host.cpp",
    "csrc/engine/backend_select.cpp",
    "csrc/engine/dedup.cpp",
    "csrc/engine/engine.cpp",
    "csrc/engine/engine_copy.cpp",
    "csrc/engine/engine_disk.cpp",
    "csrc/engine/engine_fetch.cpp",
    "csrc/engine/engine_file.cpp",
    "csrc/engine/engine_host_memory.cpp",
    "csrc/engine/engine_in_flight.cpp",
    "csrc/engine/engine_store.cpp",
    "csrc/engine/host_block.cpp",
    "csrc/region/shared_region.cpp",
    "csrc/bindings.cpp",
]
CUDA_SOURCES = ["csrc/backends/backend_cuda.cpp", "csrc/backends/cuda_pinned.cpp"]
# Headers: an edit to one rebuilds the extension (setuptools compares them with the .so's time).
HEADERS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.h"))


def cuda_build_reasons() -> list[str]:
    """Why the CUDA backend cannot be built here (empty: it can)."""
    reasons = []
    if torch.version.cuda is None:
        reasons.append(f"torch {torch.__version__} is a CPU-only build")
    if TOOLKIT is None:
        reasons.append("no CUDA toolkit with headers found (set CUDA_HOME)")
    return reasons


def extension():
    reasons = cuda_build_reasons()
    with_cuda = not reasons
    if reasons:
        if os.environ.get("OFFCACHE_FORCE_CUDA") == "1":
            raise RuntimeError("OFFCACHE_FORCE_CUDA=1 but CUDA cannot be built: " + "; ".join(reasons))
        print("offcache: building the host-only engine: " + "; ".join(reasons))
    macros = [("OFFCACHE_TORCH_VERSION", f'"{torch.__version__}"')]
    flags = ["-O3", "-Wall", "-Wno-unused-parameter"]
    # The libstdc++ ABI torch was built with, named explicitly (torch's build helpers stopped
    # passing it): a compiler whose default differs would lay out std::string unlike libc10 does.
    flags.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
    if with_cuda:
        macros.append(("OFFCACHE_WITH_CUDA", None))
        return CUDAExtension(
            "offcache._C",
            CORE + ENGINE + CUDA_SOURCES,
            define_macros=macros,
            include_dirs=[str(ROOT / "csrc")],
            depends=HEADERS,
            extra_compile_args={"cxx": flags, "nvcc": []},
        )
    return CppExtension(
        "offcache._C",
        CORE + ENGINE,
        define_macros=macros,
        include_dirs=[str(ROOT / "csrc")],
        depends=HEADERS,
        extra_compile_args={"cxx": flags},
    )


def ext_modules():
    # scripts/setup.sh builds the engine in place first (ninja, incremental), then makes the
    # editable install with this set, so that install does not compile it a second time.
    if os.environ.get("OFFCACHE_EDITABLE_NO_BUILD") == "1":
        return []
    return [extension()]


def torch_label() -> str:
    """The local version label of this build: the torch it is compiled against, and CUDA or cpu."""
    public = str(torch.__version__).split("+")[0]
    variant = "cu" + torch.version.cuda.replace(".", "") if not cuda_build_reasons() else "cpu"
    return f"torch{public}.{variant}"


def version() -> str:
    text = (ROOT / "offcache" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE)[1] + "+" + torch_label()


def requirements() -> list[str]:
    # torch==X without the local label matches X+cu130, X+cu128 and X+cpu alike; the engine's
    # import check names the variant it needs.
    return [f"torch=={str(torch.__version__).split('+')[0]}", "tqdm"]


class Build(BuildExtension):  # ninja by default (with_options passes kwargs older setuptools refuse)
    """Builds the engine and records, next to it, the torch it was compiled against."""

    def build_extensions(self):
        super().build_extensions()
        for ext in self.extensions:
            engine = Path(self.get_ext_fullpath(ext.name))
            record = {
                "torch": str(torch.__version__),
                "cuda": torch.version.cuda if not cuda_build_reasons() else None,
                "engine": engine.name,
                "engine_bytes": engine.stat().st_size,
            }
            (engine.parent / "_C_build.json").write_text(json.dumps(record, indent=1) + "\n")
            # The libstdc++ the check passed beside: an import beside the same one needs no second check.
            record["format_checked_with"] = check_engine(engine)
            (engine.parent / "_C_build.json").write_text(json.dumps(record, indent=1) + "\n")

    def copy_extensions_to_source(self):
        """An in-place build (setuptools builds into build/, then copies the engine beside the
        sources) takes the engine's record along: offcache/engine/loader.py reads it there."""
        super().copy_extensions_to_source()
        for ext in self.extensions:
            self.inplace = 0
            built = Path(self.get_ext_fullpath(ext.name)).parent / "_C_build.json"
            self.inplace = 1
            if built.exists():
                shutil.copyfile(built, Path(self.get_ext_fullpath(ext.name)).parent / "_C_build.json")


FORMAT_CHECK = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("offcache._C", sys.argv[1])
engine = importlib.util.module_from_spec(spec)
spec.loader.exec_module(engine)
print(engine._format_check(2147483648))
import os  # the libstdc++ it ran beside, as offcache.engine.loader.loaded_libstdcxx() writes it
try:
    paths = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libstdc++" in line and "/" in line})
    print("\t".join(f"{os.path.realpath(p)}:{os.stat(p).st_size}:{os.stat(p).st_mtime_ns}" for p in paths))
except OSError:  # none recorded: the import then checks again
    print("")
"""


def check_engine(engine: Path) -> list[str]:
    """Loads the engine just built, beside torch, and has it format a number as its messages do.
    A build whose numbers come out wrong (pieces of libstdc++ linked into it), or that does not load
    here at all, is removed and the build fails with the reason, instead of crashing its first error
    message or failing at import. Returns the libstdc++ it passed beside (offcache.engine.loader's
    loaded_libstdcxx()); offcache/engine/loader.py checks the same at import beside any other one."""
    want = "[2147483648, 0.5]"
    try:
        done = subprocess.run(
            [sys.executable, "-c", FORMAT_CHECK, str(engine)], capture_output=True, text=True, timeout=600
        )
    except subprocess.SubprocessError as e:
        engine.unlink(missing_ok=True)
        raise RuntimeError(f"offcache: the engine just built could not be checked beside torch ({e}); removed") from e
    lines = done.stdout.strip().split("\n")
    got, why = lines[0].strip(), done.stderr.strip()[-800:] or f"exit status {done.returncode}"
    if got == want and done.returncode == 0:
        return [x for x in lines[1].split("\t") if x] if len(lines) > 1 else []
    if not got and done.returncode > 0:  # it did not load here (an ImportError): the build is no good
        engine.unlink(missing_ok=True)
        raise RuntimeError(
            f"offcache: the engine just built does not load beside torch {torch.__version__} here ({why}), so it "
            "was removed; it would fail the same way at `import offcache`."
        )
    engine.unlink(missing_ok=True)  # a wrong answer, or a crash (a signal) while loading or formatting
    cxx = os.environ.get("CXX", "c++")
    nonshared = static_libstdcxx(shlex.split(cxx) or ["c++"])
    cause = (
        f"{cxx} links pieces of libstdc++ into it ({nonshared}), which disagree with the libstdc++ torch loads"
        if nonshared
        else f"built with {cxx}"
    )
    ran = f"; loading it: {why}" if not got else ""
    raise RuntimeError(
        f"offcache: the engine just built formats 2147483648 and 0.5 as {got!r}, not {want!r} ({cause}{ran}). "
        "Every error message with a number would be wrong or crash the process, so the build was removed. "
        "Build with the system compiler, e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc pip install --no-build-isolation ."
    )


# Static metadata (name, extras, scripts) is in pyproject.toml; the version and the requirements
# name the torch this build is for, so they are computed here. setuptools' build backend and
# `python setup.py` run this file as __main__; tests import it for its build checks.
if __name__ == "__main__":
    choose_cxx()
    setup(
        version=version(),
        install_requires=requirements(),
        ext_modules=ext_modules(),
        cmdclass={"build_ext": Build},
    )
