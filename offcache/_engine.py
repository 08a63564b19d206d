"""Thin typed wrappers over the compiled engine, offcache._C, and its configuration.

Nothing else in offcache calls offcache._C: this module is the seam.

Environment (read when offcache is imported; ``configure`` changes it later):
  OFFCACHE_BACKEND             auto | cuda | host (default auto: CUDA when a GPU is visible)
  OFFCACHE_PINNED_LIMIT        pinned budget: bytes, a size such as 64GiB, or a % of memory
  OFFCACHE_CHUNK_BYTES         smallest arena chunk, 1 byte to 1GiB (the largest chunk)
  OFFCACHE_MAX_IN_FLIGHT       bound on bytes being copied at once
  OFFCACHE_HOST_COPY_DELAY_US  slows each host-backend copy (tests widen race windows), 0 to 60000000
  OFFCACHE_DISK_DIR            the disk tier: auto (default: $XDG_CACHE_HOME/offcache or
                               ~/.cache/offcache, where that is a real disk with room),
                               none, or a folder
  OFFCACHE_HOST_LIMIT          host memory (pinned + pageable) offcache holds: bytes, a size or
                               a % of memory; past it values go to disk, or with no disk tier
                               the store raises HostLimitError
"Memory" is the smaller of RAM and the process's cgroup limit.
Defaults: DEFAULTS below. A blank variable counts as unset. Sizes are whole bytes: '0.9' is
refused (a fraction is not a size), '90%' is a percentage.
"""

from __future__ import annotations

import operator
import os
import re
import time
import warnings
from collections.abc import Sequence
from decimal import Decimal

import torch

from offcache import _machine
from offcache._machine import _existing, _human

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

    here = Path(__file__).parent
    running = str(torch.__version__)
    record = _recorded_build(here)
    if record is not None and record.get("torch") != running:  # checked before the library loads
        raise ImportError(torch_mismatch(record.get("torch"), running, record.get("cuda")))
    try:
        from offcache import _C
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

__all__ = [
    "DEFAULTS",
    "CapacityWarning",
    "HostLimitError",
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
    "record_stream",
    "set_pinned_limit",
    "set_timing",
    "settings",
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
    # Percentages are of the memory the process may use (RAM or its cgroup's limit, the smaller),
    # divided among the local ranks (LOCAL_WORLD_SIZE). The host limit bounds offcache's pinned +
    # pageable memory; the rest of the process needs at least as much again: fetch outputs, the
    # model's CPU weights, the interpreter and torch, the page cache of the disk tier's mappings.
    # In a 2 GiB cgroup a 1 GiB limit (50%) was OOM-killed in the fetch loop while 512 MiB (25%)
    # peaked at 1.6 GiB (issue 19), so 25%; a pinned budget above the host limit would never
    # be used, so it is 25% too.
    "pinned_limit": "25%",
    "min_chunk": "2MiB",
    "max_in_flight": "1GiB",
    "host_copy_delay_us": 0,
    "disk_dir": "auto",  # $XDG_CACHE_HOME/offcache (else ~/.cache/offcache) where that is a real disk
    "host_limit": "25%",
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
_SIZE_MAX = 2**64 - 1  # size_t, what the engine takes
_MAX_CHUNK = 1 << 30  # the arena's largest chunk (csrc/core/arena.h, ArenaOptions::max_chunk)
_MAX_DELAY_US = 60_000_000  # a minute per copy: past any test's need, far from int64/chrono overflow

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}  # fmt: skip
_SIZE_FORMS = "bytes as an int, or a string such as '512MiB', '64GiB', '1.5GB' or '40%' (of memory)"
_NUMBER = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)")


class SpillWarning(UserWarning):
    """Values no longer fit the pinned budget and now live in pageable memory (or on disk)."""


class CapacityWarning(UserWarning):
    """A run is projected to need more than the host limit plus the disk tier's free space."""


# A store would cross the host limit and there is no disk tier to take it (a MemoryError).
HostLimitError: type[MemoryError] = _C.HostLimitError


def _fraction_hint(number) -> str:
    pct = f"{float(number) * 100:g}%"
    return f"a fraction is not a size: for {pct} of memory write '{pct}', or give bytes (e.g. '512MiB')"


def parse_size(text: str | int, what: str = "a size", low: int = 0, high: int = _SIZE_MAX) -> int:
    """Bytes from an int, '123', '512MiB', '64GiB', '1.5GB' or '40%' (of memory), in [low, high].

    `what` names the setting in the error (e.g. "OFFCACHE_PINNED_LIMIT"). A unitless number
    must be whole bytes: '0.9' is refused, not read as 0 bytes or as 90%.
    """
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        hint = f"; {_fraction_hint(text)}" if isinstance(text, float) and 0 < text <= 1 else ""
        raise TypeError(f"{what} must be {_SIZE_FORMS}; got {text!r} ({type(text).__name__}){hint}")
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
                raise ValueError(f"{what}: a percentage of memory must be in (0, 100], got {text!r}")
            n = int(_machine.usable_memory_bytes() * pct / 100)
        else:
            m = _NUMBER.fullmatch(s)
            if not m or m[2] not in _UNITS:
                raise ValueError(f"{what}: cannot read {text!r} as a size; use {_SIZE_FORMS}")
            number, unit = Decimal(m[1]), _UNITS[m[2]]
            if unit == 1 and number != number.to_integral_value():
                if 0 < number <= 1:
                    raise ValueError(f"{what}: got {text!r}; {_fraction_hint(number)}")
                raise ValueError(f"{what}: {text!r} is not a whole number of bytes; use {_SIZE_FORMS}")
            n = int(number * unit)
    if not low <= n <= high:
        bounds = "2**64 - 1 bytes" if high == _SIZE_MAX else f"{high} bytes ({_human(high)})"
        raise ValueError(f"{what} must be between {low} and {bounds}, got {text!r}")
    return n


def _parse_int(text: str | int, what: str, low: int = 0, high: int | None = None) -> int:
    """A whole number in [low, high] from an int or a decimal string (no bools, floats or '1e3')."""
    accepted = f"an integer >= {low}" if high is None else f"an integer between {low} and {high}"
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise TypeError(f"{what} must be {accepted}, got {text!r} ({type(text).__name__})")
    if isinstance(text, str):
        if not re.fullmatch(r"\s*[0-9]+\s*", text):
            raise ValueError(f"{what} must be {accepted}, got {text!r}")
        text = int(text)
    if text < low or (high is not None and text > high):
        raise ValueError(f"{what} must be {accepted}, got {text!r}")
    return text


def local_world_size() -> int:
    """LOCAL_WORLD_SIZE as set by torchrun (1 when unset)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE") or "1"
    return _parse_int(raw, "LOCAL_WORLD_SIZE (set by torchrun: processes on this host)", low=1)


def memory_share(value: str | int, what: str) -> int:
    """A memory limit for this process: bytes as given; a percentage of memory divided among the local ranks.

    The ranks of a torchrun job on one host share its memory (and its cgroup), so '50%' means
    half of it for all of them together, not for each.
    """
    n = parse_size(value, what)
    return n // local_world_size() if isinstance(value, str) and value.strip().endswith("%") else n


def default_pinned_limit() -> int:
    """DEFAULTS' share of usable memory, divided among the local ranks of a torchrun/DDP job.

    Several processes pinning independently can exhaust the host (llm-compressor
    #2790), so each rank takes its share.
    """
    return memory_share(DEFAULTS["pinned_limit"], "the default pinned_limit")


def default_host_limit() -> int:
    """DEFAULTS' share of usable memory, divided among the local ranks like the pinned budget."""
    return memory_share(DEFAULTS["host_limit"], "the default host_limit")


# The auto disk tier's folder while it does not exist yet: made by the first store that may need it.
_pending_disk_dir: str = ""
_disk_dir_room = 0  # bytes stores may still ask for before make_disk_dir asks the engine again


def make_disk_dir(request_bytes: int = 0, force: bool = False) -> None:
    """Make the auto disk tier's folder once a store may cross the host limit (or `force`).

    Importing offcache makes nothing on disk; the folder appears only when a run holds enough
    host memory that its next values may go to disk. A folder that cannot be made then fails
    that store with the engine's error naming it.
    """
    global _pending_disk_dir, _disk_dir_room
    folder = _pending_disk_dir
    if not folder:
        return
    if not force:
        # Cheap on every store (update() calls this each time until the folder exists): the
        # engine is asked how much it holds only once the stores since its last answer may have
        # used up the room it then had below half the host limit.
        _disk_dir_room -= 2 * request_bytes
        if _disk_dir_room >= 0:
            return
        s = _C.stats()
        held = s["pinned_reserved_bytes"] + s["pageable_bytes"] + 2 * request_bytes
        if held < _resolved.get("host_limit", 0) // 2:  # far from the limit: not yet
            _disk_dir_room = _resolved.get("host_limit", 0) // 2 - held
            return
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError:
        pass  # the engine's store names the folder and the reason
    _pending_disk_dir = ""


_DISK_FORMS = "'auto' (the default), 'none' (no disk tier) or an existing folder"


def _disk_dir(given: str | os.PathLike, name: str) -> tuple[str, str]:
    """(the disk tier's folder or '', why auto found none): checked now, not mid-run."""
    if isinstance(given, (bool, int, float)) or not isinstance(given, (str, os.PathLike)):
        raise TypeError(f"{name} must be {_DISK_FORMS}, got {given!r}")
    path = os.fspath(given)
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{name} must be {_DISK_FORMS}, got {given!r}")
    word = path.strip().lower() if isinstance(given, str) else ""
    if word == "none":
        return "", ""
    if word == "auto":
        return _machine.auto_disk_dir()
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{name}: {path!r} is not a folder (make it first, or use {_DISK_FORMS})")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{name}: cannot write to {path!r}")
    return path, ""


# What the last configure() resolved (the engine's view of it, for stats() and error messages).
_resolved: dict = {}


def capacity() -> tuple[int, str]:
    """Bytes offcache can hold on the host and disk, and a description of them for messages."""
    host = _resolved.get("host_limit", 0)
    disk = _resolved.get("disk_dir", "")
    where = f"the host limit ({host} bytes, OFFCACHE_HOST_LIMIT)"
    if not disk:
        reason = _resolved.get("disk_auto_reason")
        return host, where + (f" with no disk tier (OFFCACHE_DISK_DIR=auto found no folder: {reason})" if reason
                              else " with no disk tier (OFFCACHE_DISK_DIR=none)")  # fmt: skip
    try:
        st = os.statvfs(_existing(disk))
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    return host + free, where + f" plus the disk tier's free space ({free} bytes in {disk})"


def settings() -> dict:
    """The engine's configuration as resolved: bytes, the backend, and the disk tier.

    disk_dir is '' without a disk tier; disk_auto_reason says why OFFCACHE_DISK_DIR=auto found
    no usable folder ('' otherwise).
    """
    return dict(_resolved)


def _setting(name: str, given):
    """An argument, else its environment variable, else the default; with the name for errors.

    An empty or blank variable counts as unset (``export OFFCACHE_X=`` is a common way to clear one).
    """
    if given is not None:
        return given, f"configure({name}=...)"
    env = os.environ.get(_ENV[name])
    if env and env.strip():
        return env, _ENV[name]
    return DEFAULTS[name], f"the default {name}"


_BACKENDS = ("auto", "cuda", "host")


def _backend(value, name: str) -> str:
    if not isinstance(value, str) or value.strip().lower() not in _BACKENDS:
        raise ValueError(f"{name} must be one of 'auto', 'cuda' or 'host', got {value!r}")
    return value.strip().lower()


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

    Values stored once offcache holds `host_limit` bytes of host memory (pinned + pageable)
    go to files in the disk tier (`disk_dir`: 'auto', 'none' or a folder); with none, the
    store that would cross the limit raises HostLimitError.
    Every value is checked here, in Python, so a bad one names its variable and the
    accepted forms and nothing reaches the engine.
    """
    backend, backend_name_ = _setting("backend", backend)
    limit, limit_name = _setting("pinned_limit", pinned_limit)
    chunk, chunk_name = _setting("min_chunk", min_chunk)
    flight, flight_name = _setting("max_in_flight", max_in_flight)
    delay, delay_name = _setting("host_copy_delay_us", host_copy_delay_us)
    disk, disk_name = _setting("disk_dir", disk_dir)
    host, host_name = _setting("host_limit", host_limit)
    host_bytes = memory_share(host, host_name)
    limit_bytes = memory_share(limit, limit_name)
    settings = dict(
        backend=_backend(backend, backend_name_),
        pinned_limit=limit_bytes,
        min_chunk=parse_size(chunk, f"{chunk_name} (smallest arena chunk)", low=1, high=_MAX_CHUNK),
        max_in_flight=parse_size(flight, flight_name),
        host_copy_delay_us=_parse_int(delay, f"{delay_name} (microseconds)", high=_MAX_DELAY_US),
        host_limit=host_bytes,
    )
    disk_path, auto_reason = _disk_dir(disk, disk_name)
    _C.configure(disk_dir=disk_path, **settings)
    global _pending_disk_dir, _disk_dir_room
    _pending_disk_dir = disk_path if disk_path and not os.path.isdir(disk_path) else ""
    _disk_dir_room = 0
    _resolved.clear()
    _resolved.update(settings, disk_dir=disk_path, disk_auto_reason=auto_reason)


def set_pinned_limit(limit: str | int) -> None:
    """Set the pinned budget (bytes, '64GiB', '40%' of memory for the local ranks together).

    Values past it spill to pageable memory.
    """
    n = memory_share(limit, "set_pinned_limit(limit)")
    _C.set_pinned_limit(n)
    _resolved["pinned_limit"] = n


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
    time), disk_fallbacks (direct I/O refused: buffered I/O instead), host_limit_bytes (with or
    without a disk tier). Model weights (``patch_llmcompressor(weights=True)``): the ``weight_*``
    keys of WEIGHT_COUNTERS.
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
    values = list(values)
    if _pending_disk_dir:
        make_disk_dir(sum(v.numel() * v.element_size() for v in values))
    return _C.store(values, device, allow_spill)


def fetch(stored: Sequence[Tensor], device: torch.device, wait: bool = True) -> tuple[list[Tensor], Ticket]:
    """Copies of `stored` on `device`, and the ticket of their copy.

    wait=True: the current stream of `device` already waits for the copy. Otherwise call
    ``ticket.wait()`` before using the tensors.
    """
    return _C.fetch(list(stored), device, wait)


def fetch_file(
    path: str | os.PathLike,
    items: Sequence[tuple[int, Sequence[int], torch.dtype]],
    device: torch.device,
    wait: bool = True,
) -> tuple[list[Tensor], Ticket]:
    """Tensors read from a file straight onto `device`: items[i] = (byte offset, shape, dtype).

    Tensor i is contiguous and holds the file's bytes [offset, offset + nbytes), as safetensors
    lays a tensor out. The engine's I/O thread reads the file in 8 MiB pieces (O_DIRECT where
    the file system allows it) into bounce buffers (pinned on CUDA) and issues each piece's
    copy as soon as it is read, so the calling thread does not wait for the disk and copies
    overlap reads. The file must not change until the ticket completes. wait: as ``fetch``'s;
    ``ticket.wait()`` raises if a read failed (the path and the reason).
    """
    likes = [torch.empty(tuple(shape), dtype=dtype, device="meta") for _, shape, dtype in items]
    offsets = [operator.index(offset) for offset, _, _ in items]  # a float offset is a TypeError
    return _C.fetch_file(os.fspath(path), offsets, likes, device, wait)


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


def wait_on_host(ticket: Ticket | None) -> None:
    """Block the calling thread until `ticket`'s copies completed (on a GPU too, where ``ticket.wait()``
    only orders a stream): then the host memory they read can be written."""
    while ticket is not None and not ticket.query():
        time.sleep(20e-6)


def wait_stored(t: Tensor) -> None:
    """Block until the store that produced `t` has written it, so it can be read directly."""
    _C.wait_stored(t)


def is_arena_tensor(t: Tensor) -> bool:
    """True for a stored tensor in the pinned arena of the current engine."""
    return _C.is_arena_tensor(t)


def record_stream(t: Tensor, stream: torch.Stream) -> None:
    """``t.record_stream(stream)`` for a fetched tensor: the allocation it lives in is kept from reuse
    until `stream`'s work queued so far is done. A fetched value under 1 MiB is a storage inside one
    allocation shared with the values fetched with it, which ``Tensor.record_stream`` does not reach."""
    _C.allocation_of(t).record_stream(stream)


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


def _fail_next_task() -> None:
    """Tests only: the next host copy task fails on its worker thread (as a CUDA event wait can)."""
    _C._fail_next_task()


def _fail_query_after(skip: int, transient: bool = False) -> None:
    """Tests only: the event query after the next `skip` ones raises, once (transient: as during
    another thread's CUDA graph capture, a state asked again later; else as on a broken context)."""
    _C._fail_query_after(skip, transient)


def warn_if_spilled(stacklevel: int = 2) -> None:
    """Emit the engine's one-time spill notice as a SpillWarning pointing at the caller's caller."""
    notice = _C.take_spill_notice()
    if notice:
        warnings.warn(notice, SpillWarning, stacklevel=stacklevel + 1)


configure()
