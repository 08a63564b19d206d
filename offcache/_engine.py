"""Thin typed wrappers over the compiled engine, offcache._C, and its configuration.

Nothing else in offcache calls offcache._C: this module is the seam.

Environment (read when offcache is imported; ``configure`` changes it later):
  OFFCACHE_BACKEND             auto | cuda | host (default auto: CUDA when a GPU is visible)
  OFFCACHE_PINNED_LIMIT        pinned budget: bytes, a size such as 64GiB, or a % of RAM
  OFFCACHE_CHUNK_BYTES         smallest arena chunk
  OFFCACHE_MAX_IN_FLIGHT       bound on bytes being copied at once
  OFFCACHE_HOST_COPY_DELAY_US  slows each host-backend copy (tests widen race windows)
  OFFCACHE_DISK_DIR            folder for the disk tier (default: none, nothing goes to disk)
  OFFCACHE_HOST_LIMIT          host memory (pinned + pageable) offcache uses before it writes
                               to disk: bytes, a size or a % of RAM; only with a disk dir
Defaults: DEFAULTS below.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Sequence

import torch

try:
    from offcache import _C
except ImportError as exc:  # no silent fallback: the engine is the product
    from pathlib import Path

    here = Path(__file__).parent
    built = list(here.glob("_C*.so"))
    where = f"{exc}" if built else f"{here} holds no compiled engine"
    raise ImportError(
        f"offcache's compiled engine (offcache._C) is missing or does not load: {where}. "
        "Build it against the torch you run with: `bash scripts/setup.sh`, or "
        "`pip install --no-build-isolation -e .` from a checkout."
    ) from exc

__all__ = [
    "DEFAULTS",
    "SpillWarning",
    "Ticket",
    "backend_name",
    "build_info",
    "configure",
    "copy_into",
    "empty_cache",
    "fetch",
    "is_arena_tensor",
    "is_disk_tensor",
    "is_offcache_tensor",
    "parse_size",
    "set_pinned_limit",
    "set_timing",
    "stats",
    "store",
    "synchronize",
    "trace_start",
    "trace_stop",
    "wait_stored",
]

Tensor = torch.Tensor
Ticket = _C.Ticket

# The one place the configuration defaults are written (tests check the README's table against it).
DEFAULTS: dict[str, str | int] = {
    "backend": "auto",
    "pinned_limit": "40%",  # of RAM, divided among the local ranks (LOCAL_WORLD_SIZE)
    "min_chunk": "2MiB",
    "max_in_flight": "1GiB",
    "host_copy_delay_us": 0,
    "disk_dir": "",
    "host_limit": "75%",  # of RAM, divided among the local ranks (LOCAL_WORLD_SIZE)
}
_ENV = {
    "backend": "OFFCACHE_BACKEND",
    "pinned_limit": "OFFCACHE_PINNED_LIMIT",
    "min_chunk": "OFFCACHE_CHUNK_BYTES",
    "max_in_flight": "OFFCACHE_MAX_IN_FLIGHT",
    "host_copy_delay_us": "OFFCACHE_HOST_COPY_DELAY_US",
    "disk_dir": "OFFCACHE_DISK_DIR",
    "host_limit": "OFFCACHE_HOST_LIMIT",
}
_SIZE_MAX = 2**64 - 1

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}  # fmt: skip
_SIZE_FORMS = "bytes as an int, or a string such as '512MiB', '64GiB', '1.5GB' or '40%' (of RAM)"


class SpillWarning(UserWarning):
    """Values no longer fit the pinned budget and now live in pageable memory (or on disk)."""


def total_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_size(text: str | int, what: str = "a size") -> int:
    """Bytes from an int, '123', '512MiB', '64GiB', '1.5GB' or '40%' (of RAM).

    `what` names the setting in the error (e.g. "OFFCACHE_PINNED_LIMIT").
    """
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise TypeError(f"{what} must be {_SIZE_FORMS}; got {text!r} ({type(text).__name__})")
    if isinstance(text, int):
        n = text
    else:
        s = text.strip().lower()
        if s.endswith("%"):
            try:
                pct = float(s[:-1])
            except ValueError:
                pct = float("nan")
            if not 0 < pct <= 100:
                raise ValueError(f"{what}: a percentage of RAM must be in (0, 100], got {text!r}")
            return int(total_ram_bytes() * pct / 100)
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", s)
        if not m or m[2] not in _UNITS:
            raise ValueError(f"{what}: cannot read {text!r} as a size; use {_SIZE_FORMS}")
        n = int(float(m[1]) * _UNITS[m[2]])
    if not 0 <= n <= _SIZE_MAX:
        raise ValueError(f"{what} must be between 0 and 2**64 - 1 bytes, got {text!r}")
    return n


def _parse_int(text: str | int, what: str, low: int = 0) -> int:
    try:
        n = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be an integer >= {low}, got {text!r}") from None
    if isinstance(text, float) or n < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {text!r}")
    return n


def local_world_size() -> int:
    """LOCAL_WORLD_SIZE as set by torchrun (1 when unset)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE") or "1"
    return _parse_int(raw, "LOCAL_WORLD_SIZE (set by torchrun: processes on this host)", low=1)


def default_pinned_limit() -> int:
    """40% of RAM, shared among the local ranks of a torchrun/DDP job.

    Several processes pinning independently can exhaust the host (llm-compressor
    #2790), so each rank takes its share.
    """
    return parse_size(DEFAULTS["pinned_limit"]) // local_world_size()


def default_host_limit() -> int:
    """75% of RAM, shared among the local ranks like the pinned budget."""
    return parse_size(DEFAULTS["host_limit"]) // local_world_size()


def _disk_dir(given: str | os.PathLike | None, name: str) -> str:
    """The disk tier's folder, checked now so a bad path fails at configure, not mid-run."""
    path = os.fspath(given) if given else ""
    if not path:
        return ""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{name}: {path!r} is not a folder (make it first)")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{name}: cannot write to {path!r}")
    return path


def _setting(name: str, given):
    """An argument, else its environment variable, else the default; with the name for errors."""
    if given is not None:
        return given, f"configure({name}=...)"
    env = os.environ.get(_ENV[name])
    if env:
        return env, _ENV[name]
    return DEFAULTS[name], f"the default {name}"


def configure(
    backend: str | None = None,
    pinned_limit: str | int | None = None,
    min_chunk: str | int | None = None,
    max_in_flight: str | int | None = None,
    host_copy_delay_us: int | None = None,
    disk_dir: str | os.PathLike | None = None,
    host_limit: str | int | None = None,
) -> None:
    """(Re)configure the process-wide engine; unset arguments come from the environment.

    Tensors stored earlier keep working: the engine that made them serves them until the
    last one dies, then stops its threads and gives its memory back.

    With a `disk_dir`, values stored once offcache holds `host_limit` bytes of host memory
    (pinned + pageable) go to files there instead; without one nothing goes to disk.
    """
    backend, _ = _setting("backend", backend)
    limit, limit_name = _setting("pinned_limit", pinned_limit)
    chunk, chunk_name = _setting("min_chunk", min_chunk)
    flight, flight_name = _setting("max_in_flight", max_in_flight)
    delay, delay_name = _setting("host_copy_delay_us", host_copy_delay_us)
    disk, disk_name = _setting("disk_dir", disk_dir)
    host, host_name = _setting("host_limit", host_limit)
    host_bytes = default_host_limit() if host_name == "the default host_limit" else parse_size(host, host_name)
    if limit_name == "the default pinned_limit":
        limit_bytes = default_pinned_limit()
    else:
        limit_bytes = parse_size(limit, limit_name)
    chunk_bytes = parse_size(chunk, chunk_name)
    if chunk_bytes == 0:
        raise ValueError(f"{chunk_name} must be at least 1 byte, got {chunk!r}")
    _C.configure(
        backend=str(backend),
        pinned_limit=limit_bytes,
        min_chunk=chunk_bytes,
        max_in_flight=parse_size(flight, flight_name),
        host_copy_delay_us=_parse_int(delay, f"{delay_name} (microseconds)"),
        disk_dir=_disk_dir(disk, disk_name),
        host_limit=host_bytes,
    )


def set_pinned_limit(limit: str | int) -> None:
    """Set the pinned budget (bytes, '64GiB', '40%'). Values past it spill to pageable memory."""
    _C.set_pinned_limit(parse_size(limit, "set_pinned_limit(limit)"))


# Model weights (offcache.compressed_tensors counts them; process-wide, never reset).
WEIGHT_COUNTERS: dict[str, int | float] = {
    "weight_onload_bytes": 0,  # onloads of offloaded weights, served by a fetch or a prefetch
    "weight_prefetch_bytes": 0,  # fetched ahead of use
    "weight_writeback_bytes": 0,  # update_offload copies into the arena
    "weight_prefetch_hits": 0,  # onloads served by a prefetched copy
    "weight_prefetch_misses": 0,  # onloads that fetched (with prefetch on)
    "weight_prefetch_skips": 0,  # prefetches not issued: no device memory, or the fetch failed
    "weight_host_waits": 0,  # times the host blocked on a weight copy
    "weight_stream_waits": 0,  # onloads to a GPU whose copy was still in flight: its stream waited
    "weight_host_wait_seconds": 0.0,
}


def stats() -> dict:
    """Counters of the process's engine: bytes pinned, in use, pageable, in flight, copied, ...

    Disk tier: disk_bytes (in use), disk_reserved_bytes (files' size), disk_files,
    disk_write_bytes / disk_read_bytes and disk_write_seconds / disk_read_seconds (I/O thread
    time), disk_fallbacks (direct I/O refused: copied through the mapping), host_limit_bytes.
    Model weights (``patch_llmcompressor(weights=True)``): the ``weight_*`` keys of
    WEIGHT_COUNTERS.
    """
    return {**_C.stats(), **WEIGHT_COUNTERS}


def synchronize() -> None:
    """Wait for every copy in flight and return freed blocks to the arena."""
    _C.synchronize()


def empty_cache() -> int:
    """synchronize(), then give every empty arena chunk back to the OS. Returns the bytes released."""
    return _C.empty_cache()


def backend_name() -> str:
    """'cuda' or 'host': the backend of the process-wide engine."""
    return _C.backend_name()


def build_info() -> dict:
    """Version (with the build variant, e.g. 0.2.0+cu130 or 0.2.0+cpu), torch, CUDA and backend."""
    from offcache import __version__

    variant = "cu" + _C.cuda_version.replace(".", "") if _C.cuda_compiled else "cpu"
    return {
        "version": f"{__version__}+{variant}",
        "torch": _C.torch_version,
        "torch_runtime": torch.__version__,
        "cuda": bool(_C.cuda_compiled),
        "cuda_version": _C.cuda_version,
        "backend": backend_name(),
    }


# The engine calls ---------------------------------------------------------------------------


def store(values: Sequence[Tensor], device: torch.device, allow_spill: bool = True) -> list[Tensor]:
    """Snapshot `values` now and copy them to `device` (CPU: the pinned arena), in order.

    The result holds what the values held at the call, whatever the caller does to them
    afterwards. With allow_spill=False a value that does not fit the arena comes back as is.
    """
    return _C.store(list(values), device, allow_spill)


def fetch(stored: Sequence[Tensor], device: torch.device, wait: bool = True) -> tuple[list[Tensor], Ticket]:
    """Copies of `stored` on `device`, and the ticket of their copy.

    wait=True: the current stream of `device` already waits for the copy. Otherwise call
    ``ticket.wait()`` before using the tensors.
    """
    return _C.fetch(list(stored), device, wait)


def copy_into(dsts: Sequence[Tensor], srcs: Sequence[Tensor], wait: bool = False) -> Ticket:
    """Copy srcs[i] into the existing tensor dsts[i] (same shape and dtype) on the engine's copy streams.

    Device -> host pairs run on the D2H stream after the work queued on the source's current
    stream; host -> device pairs on the H2D stream after the work queued on the destination's
    current stream and after any copy still writing the source. Host memory must be offcache's
    (a view of a tensor returned by store(): the pinned arena). Views are allowed when each side
    is rows of contiguous bytes at one pitch (e.g. ``x[:, :, a:b, :]`` of a contiguous
    ``[B, H, S, D]``): one 2-D copy call per pair. Sources are kept alive until the copy
    completes and must not be modified before then (no snapshot is taken). wait=True: the
    current stream (of the destination's device) waits for the copy; else ``ticket.wait()`` does.
    Bytes count in stats()' d2h_bytes / h2d_bytes.
    """
    return _C.copy_into(list(dsts), list(srcs), wait)


def set_timing(on: bool) -> None:
    """Time every copy batch with timed events (stats' d2h_seconds / h2d_seconds). Off by default."""
    _C.set_timing(bool(on))


def wait_stored(t: Tensor) -> None:
    """Block until the store that produced `t` has written it, so it can be read directly."""
    _C.wait_stored(t)


def is_arena_tensor(t: Tensor) -> bool:
    """True for a stored tensor in the pinned arena of the current engine."""
    return _C.is_arena_tensor(t)


def is_disk_tensor(t: Tensor) -> bool:
    """True for a stored tensor whose bytes live in the disk tier (a mapped file)."""
    return _C.is_disk_tensor(t)


def is_offcache_tensor(t: Tensor) -> bool:
    """True for a CPU tensor whose memory offcache manages (arena or spilled)."""
    return _C.is_offcache_tensor(t)


def trace_start(device: torch.device) -> None:
    """Record copy batches from now on, timed from an event on `device`'s current stream."""
    _C.trace_start(device)


def trace_stop() -> list[dict]:
    """The copy batches since trace_start: stream ('d2h'/'h2d'), bytes, start_ms, end_ms."""
    return _C.trace_stop()


def _fail_next_copy() -> None:
    """Tests only: the next host-backend copy call queues its copies, then raises."""
    _C._fail_next_copy()


def warn_if_spilled(stacklevel: int = 2) -> None:
    """Emit the engine's one-time spill notice as a SpillWarning pointing at the caller's caller."""
    notice = _C.take_spill_notice()
    if notice:
        warnings.warn(notice, SpillWarning, stacklevel=stacklevel + 1)


configure()
