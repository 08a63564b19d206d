"""Builds offcache and its extension offcache._C.

The CUDA backend is compiled when torch is a CUDA build and a CUDA toolkit is
found; the decision never depends on a GPU being present, since build hosts
usually have none. OFFCACHE_FORCE_CUDA=1 turns "CUDA could not be built" into
an error. Install with: pip install --no-build-isolation .

The engine runs only with the torch it was compiled against (offcache/_engine.py refuses any
other), so the build uses the torch installed where it will run: the wheel records that torch in
its requirements (torch==X) and in its version's local label (0.2.0+torch2.14.0.cu130), and
offcache/_C_build.json records it next to the engine.
"""

import json
import os
import re
import shutil
import sys
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
    "csrc/backend_host.cpp",
    "csrc/backend_select.cpp",
    "csrc/dedup.cpp",
    "csrc/engine.cpp",
    "csrc/engine_copy.cpp",
    "csrc/engine_disk.cpp",
    "csrc/engine_fetch.cpp",
    "csrc/engine_file.cpp",
    "csrc/engine_in_flight.cpp",
    "csrc/engine_store.cpp",
    "csrc/host_block.cpp",
    "csrc/bindings.cpp",
]
CUDA_SOURCES = ["csrc/backend_cuda.cpp"]
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
    if with_cuda:
        macros.append(("OFFCACHE_WITH_CUDA", None))
        return CUDAExtension(
            "offcache._C",
            CORE + ENGINE + CUDA_SOURCES,
            define_macros=macros,
            depends=HEADERS,
            extra_compile_args={"cxx": flags, "nvcc": []},
        )
    return CppExtension(
        "offcache._C", CORE + ENGINE, define_macros=macros, depends=HEADERS, extra_compile_args={"cxx": flags}
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


# Static metadata (name, extras, scripts) is in pyproject.toml; the version and the requirements
# name the torch this build is for, so they are computed here.
setup(
    version=version(),
    install_requires=requirements(),
    ext_modules=ext_modules(),
    cmdclass={"build_ext": Build},
)
