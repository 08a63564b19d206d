"""Loads the compiled engine, offcache._C, refusing one built against another torch.

Nothing else in offcache imports offcache._C: the engine package is the seam.
"""

from __future__ import annotations

import torch

# What setup.py records next to the engine it builds (offcache/_C_build.json): the torch it was
# compiled against, so a mismatch is refused before the library is even loaded.
BUILD_RECORD = "_C_build.json"


def _recorded_build(folder) -> dict | None:
    """The build record next to the compiled engine, if it describes the engine there now."""
    import json
    from pathlib import Path

    folder = Path(folder)
    try:
        record = json.loads((folder / BUILD_RECORD).read_text())
        engine = folder / record["engine"]
        if engine.stat().st_size != record["engine_bytes"]:
            return None  # an engine copied in since: the record is stale, loading will tell
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None


def torch_mismatch(built: str, running: str, built_cuda: str | None = None) -> str:
    """Why an engine built against torch `built` must not run under torch `running`, and the fix.

    PyTorch promises no C++ ABI across releases, patch releases included (inline functions and
    symbols of c10/ATen change between them), so any difference is refused.
    """
    msg = (
        f"offcache's compiled engine was built against torch {built}, but torch {running} is running; "
        "a C++ extension must run with the torch it was compiled against. "
    )
    if built_cuda and torch.version.cuda is None:
        msg += f"This build needs a CUDA build of torch (CUDA {built_cuda}); torch {running} is CPU-only. "
    return msg + (
        f"Fix: install torch=={built}, or rebuild offcache against this torch: "
        "`pip install --no-build-isolation --no-deps --force-reinstall .` from a checkout "
        "(or `bash scripts/setup.sh` there)."
    )


def _load_engine():
    """offcache._C, refused with an ImportError when it was built against another torch."""
    from pathlib import Path

    here = Path(__file__).parent.parent  # offcache/, where the build puts _C
    running = str(torch.__version__)
    record = _recorded_build(here)
    if record is not None and record.get("torch") != running:  # checked before the library loads
        raise ImportError(torch_mismatch(record.get("torch"), running, record.get("cuda")))
    try:
        import offcache._C as _C
    except ImportError as exc:  # no silent fallback: the engine is the product
        built = list(here.glob("_C*.so"))
        where = f"{exc}" if built else f"{here} holds no compiled engine"
        if built and torch.version.cuda is None and "cuda" in str(exc).lower():
            where += f"; this engine was built with CUDA and needs a CUDA build of torch (torch {running} is CPU-only)"
        raise ImportError(
            f"offcache's compiled engine (offcache._C) is missing or does not load under torch {running}: "
            f"{where}. Build it against the torch you run with: `bash scripts/setup.sh`, or "
            "`pip install --no-build-isolation -e .` from a checkout."
        ) from exc
    if _C.torch_version != running:  # an engine with no record (copied in, older build)
        raise ImportError(torch_mismatch(_C.torch_version, running, _C.cuda_version))
    return _C


_C = _load_engine()
