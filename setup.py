"""Builds offcache and its extension offcache._C.

The CUDA backend is compiled when torch is a CUDA build and a CUDA toolkit is
found; the decision never depends on a GPU being present, since build hosts
usually have none. OFFCACHE_FORCE_CUDA=1 turns "CUDA could not be built" into
an error. Install with: pip install --no-build-isolation .
"""

import os
import shutil
from pathlib import Path

import torch
from setuptools import setup

ROOT = Path(__file__).parent


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


# Metadata (name, version, dependencies, scripts) is in pyproject.toml; this file builds the engine.
setup(
    ext_modules=ext_modules(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
