"""The engine's settings (a model's config is offcache/util/model_config.py): from arguments, the environment
and DEFAULTS, checked here.

Environment (read by the first engine call, or by ``configure()``; nothing is read at import):
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

import os
import re
from decimal import Decimal

from offcache.engine import disk_dir as _disk
from offcache.engine import machine as _machine
from offcache.engine.loader import _C
from offcache.engine.machine import existing_folder
from offcache.util.units import human as _human

# The one place the configuration defaults are written (tests check the README's table against it).
DEFAULTS: dict[str, str | int] = {
    "backend": "auto",
    # Percentages are of the memory the process may use (RAM or its cgroup's limit, the smaller),
    # divided among the local ranks (LOCAL_WORLD_SIZE). The host limit bounds offcache's pinned +
    # pageable memory; the rest of the process needs at least as much again: fetch outputs, the
    # model's CPU weights, the interpreter and torch, the page cache of the disk tier's mappings.
    # In a 2 GiB cgroup a 1 GiB limit (50%) was OOM-killed in the fetch loop while 512 MiB (25%)
    # peaked at 1.6 GiB, so 25%; a pinned budget above the host limit would never
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


def _fraction_hint(number) -> str:
    pct = f"{float(number) * 100:g}%"
    return f"a fraction is not a size: for {pct} of memory write '{pct}', or give bytes (e.g. '512MiB')"


def parse_size(text: str | int, what: str = "a size", low: int = 0, high: int = _SIZE_MAX,
               memory: int | None = None) -> int:  # fmt: skip
    """Bytes from an int, '123', '512MiB', '64GiB', '1.5GB' or '40%' (of memory), in [low, high].

    `what` names the setting in the error (e.g. "OFFCACHE_PINNED_LIMIT"). A unitless number
    must be whole bytes: '0.9' is refused, not read as 0 bytes or as 90%. `memory`: what a
    percentage is of (default: this process's memory, RAM or its cgroup's limit; the planner
    gives a run's).
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
            n = int((_machine.usable_memory_bytes() if memory is None else memory) * pct / 100)
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


def memory_share(value: str | int, what: str, ranks: int | None = None, memory: int | None = None) -> int:
    """A memory limit for this process: bytes as given; a percentage of memory divided among the local ranks.

    The ranks of a torchrun job on one host share its memory (and its cgroup), so '50%' means
    half of it for all of them together, not for each. `ranks`: the local ranks (default:
    LOCAL_WORLD_SIZE; the planner gives the job's). `memory`: what a percentage is of (default: this
    process's memory; the planner gives a run's).
    """
    n = parse_size(value, what, memory=memory)
    ranks = local_world_size() if ranks is None else ranks
    return n // ranks if isinstance(value, str) and value.strip().endswith("%") else n


def default_pinned_limit() -> int:
    """DEFAULTS' share of usable memory, divided among the local ranks of a torchrun/DDP job.

    Several processes pinning independently can exhaust the host (llm-compressor
    #2790), so each rank takes its share.
    """
    return memory_share(DEFAULTS["pinned_limit"], "the default pinned_limit")


def default_host_limit() -> int:
    """DEFAULTS' share of usable memory, divided among the local ranks like the pinned budget."""
    return memory_share(DEFAULTS["host_limit"], "the default host_limit")


# What the last configure() resolved (the engine's view of it, for stats() and error messages).
_resolved: dict = {}


def capacity() -> tuple[int, str]:
    """Bytes offcache can hold on the host and disk, and a description of them for messages."""
    ensure_configured()
    host = _resolved.get("host_limit", 0)
    disk = _resolved.get("disk_dir", "")
    where = f"the host limit ({host} bytes, OFFCACHE_HOST_LIMIT)"
    if not disk:
        reason = _resolved.get("disk_auto_reason")
        return host, where + (f" with no disk tier (OFFCACHE_DISK_DIR=auto found no folder: {reason})" if reason
                              else " with no disk tier (OFFCACHE_DISK_DIR=none)")  # fmt: skip
    try:
        st = os.statvfs(existing_folder(disk))
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    return host + free, where + f" plus the disk tier's free space ({free} bytes in {disk})"


def settings() -> dict:
    """The engine's configuration as resolved: bytes, the backend, and the disk tier.

    disk_dir is '' without a disk tier; disk_auto_reason says why OFFCACHE_DISK_DIR=auto found
    no usable folder ('' otherwise).
    """
    ensure_configured()
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
    disk_path, auto_reason = _disk.parse(disk, disk_name)
    _C.configure(disk_dir=disk_path, **settings)
    _disk.arm(disk_path, host_bytes)
    _resolved.clear()
    # limit_specs: the limits as given (a percentage is shared by the local ranks: the planner
    # recomputes them for another number of ranks)
    _resolved.update(settings, disk_dir=disk_path, disk_auto_reason=auto_reason,
                     limit_specs={"pinned_limit": limit, "host_limit": host})  # fmt: skip


def ensure_configured() -> None:
    """Configure the engine from the environment unless ``configure()`` ran: every engine call
    starts here, so the first one configures it as an import used to (a bad variable raises there)."""
    if not _resolved:
        configure()


def set_pinned_limit(limit: str | int) -> None:
    """Set the pinned budget (bytes, '64GiB', '40%' of memory for the local ranks together).

    Values past it spill to pageable memory.
    """
    ensure_configured()
    n = memory_share(limit, "set_pinned_limit(limit)")
    _C.set_pinned_limit(n)
    _resolved["pinned_limit"] = n
    _resolved.setdefault("limit_specs", {})["pinned_limit"] = limit
