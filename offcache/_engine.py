"""Thin typed wrappers over the compiled engine, offcache._C, and its configuration.

Environment (read when offcache is imported; ``configure`` changes it later):
  OFFCACHE_BACKEND             auto | cuda | host (default auto: CUDA when a GPU is visible)
  OFFCACHE_PINNED_LIMIT        pinned budget: bytes, a size such as 64GiB, or a % of RAM
  OFFCACHE_CHUNK_BYTES         smallest arena chunk (default 2MiB)
  OFFCACHE_MAX_IN_FLIGHT       bound on bytes being copied at once (default 1GiB)
  OFFCACHE_HOST_COPY_DELAY_US  slows each host-backend copy (tests widen race windows)
"""

from __future__ import annotations

import os
import re
import warnings

import torch

try:
    from offcache import _C
except ImportError as exc:  # no silent fallback: the engine is the product
    from pathlib import Path

    here = Path(__file__).parent
    built = list(here.glob("_C*.so"))
    where = (
        f"{exc}"
        if built
        else f"{here} holds no compiled engine (a source checkout on sys.path ahead of the installed package?)"
    )
    raise ImportError(
        f"offcache's compiled engine (offcache._C) is missing or does not load: {where}. "
        "Build it against the torch you run with: `pip install --no-build-isolation .` from a checkout "
        "(or `python setup.py build_ext --inplace` for development)."
    ) from exc

__all__ = [
    "SpillWarning",
    "build_info",
    "configure",
    "empty_cache",
    "parse_size",
    "set_pinned_limit",
    "stats",
    "synchronize",
]

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}  # fmt: skip


class SpillWarning(UserWarning):
    """Values no longer fit the pinned budget and now live in pageable memory."""


def total_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_size(text: str | int) -> int:
    """Bytes from an int, '123', '512MiB', '64GiB', '1.5GB' or '40%' (of RAM)."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size must not be negative, got {text}")
        return text
    s = str(text).strip().lower()
    if s.endswith("%"):
        pct = float(s[:-1])
        if not 0 < pct <= 100:
            raise ValueError(f"a percentage of RAM must be in (0, 100], got {text!r}")
        return int(total_ram_bytes() * pct / 100)
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", s)
    if not m or m[2] not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: use bytes, e.g. 512MiB, 64GiB or 40%")
    return int(float(m[1]) * _UNITS[m[2]])


def default_pinned_limit() -> int:
    """40% of RAM, shared among the local ranks of a torchrun/DDP job.

    Several processes pinning independently can exhaust the host (llm-compressor
    #2790), so each rank takes its share.
    """
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return int(total_ram_bytes() * 0.4) // ranks


def configure(
    backend: str | None = None,
    pinned_limit: str | int | None = None,
    min_chunk: str | int | None = None,
    max_in_flight: str | int | None = None,
    host_copy_delay_us: int | None = None,
) -> None:
    """(Re)configure the process-wide engine; unset arguments come from the environment.

    Tensors stored earlier keep working: they stay owned by the engine that made them.
    """
    env = os.environ.get
    backend = backend or env("OFFCACHE_BACKEND", "auto") or "auto"  # _C.configure validates it
    limit = pinned_limit if pinned_limit is not None else env("OFFCACHE_PINNED_LIMIT")
    _C.configure(
        backend=backend,
        pinned_limit=parse_size(limit) if limit else default_pinned_limit(),
        min_chunk=parse_size(min_chunk or env("OFFCACHE_CHUNK_BYTES") or "2MiB"),
        max_in_flight=parse_size(max_in_flight or env("OFFCACHE_MAX_IN_FLIGHT") or "1GiB"),
        host_copy_delay_us=int(
            host_copy_delay_us if host_copy_delay_us is not None else env("OFFCACHE_HOST_COPY_DELAY_US", "0") or 0
        ),
    )


def set_pinned_limit(limit: str | int) -> None:
    """Set the pinned budget (bytes, '64GiB', '40%'). Values past it spill to pageable memory."""
    _C.set_pinned_limit(parse_size(limit))


def stats() -> dict:
    """Counters of the process's engine: bytes pinned, in use, pageable, in flight, copied, ..."""
    return _C.stats()


def synchronize() -> None:
    """Wait for every copy in flight and return freed blocks to the arena."""
    _C.synchronize()


def empty_cache() -> int:
    """synchronize(), then give every empty arena chunk back to the OS. Returns the bytes released."""
    return _C.empty_cache()


def build_info() -> dict:
    return {
        "version": _version(),
        "torch": _C.torch_version,
        "torch_runtime": torch.__version__,
        "cuda": bool(_C.cuda_compiled),
        "cuda_version": _C.cuda_version,
        "backend": _C.backend_name(),
    }


def _version() -> str:
    from offcache import __version__

    return __version__


def warn_if_spilled() -> None:
    notice = _C.take_spill_notice()
    if notice:
        warnings.warn(notice, SpillWarning, stacklevel=3)


configure()
