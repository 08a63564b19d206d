"""The engine: the only caller of the compiled offcache._C, its configuration and the machine probe.

    loader.py    loads offcache._C (refusing one built against another torch)
    config.py    settings from arguments, the environment and DEFAULTS; configure()
    disk_dir.py  the disk tier's folder, made only once a run may need it
    ops.py       typed wrappers over the engine's calls (store, fetch, copy_into, stats, ...)
    machine.py   what this machine has: memory, cgroup limits, file systems

Everything above reads the engine through this package (``from offcache import engine``), never
through offcache._C; nothing in it imports another concern of offcache. It exports what the other
concerns use; tests import the rest from the module that holds it (``offcache.engine.ops._fail_*``).

Importing it configures nothing: the first call that needs the engine configures it from the
environment (``configure()`` with no arguments), unless ``configure()`` ran first.

The environment variables it reads, their forms and defaults: config.py's docstring and DEFAULTS.
"""

from offcache.engine.config import (
    DEFAULTS,
    capacity,
    configure,
    default_host_limit,
    default_pinned_limit,
    local_world_size,
    memory_share,
    parse_size,
    set_pinned_limit,
    settings,
)
from offcache.engine.disk_dir import make_disk_dir
from offcache.engine.loader import BUILD_RECORD, torch_mismatch
from offcache.engine.ops import (
    CapacityWarning,
    HostLimitError,
    SpillWarning,
    Ticket,
    add_counters,
    backend_name,
    build_info,
    copy_into,
    empty_cache,
    fetch,
    fetch_file,
    is_arena_tensor,
    is_disk_tensor,
    is_offcache_tensor,
    is_pinned_shared_tensor,
    is_shared_tensor,
    map_shared,
    record_stream,
    set_timing,
    shared_word_add,
    stats,
    store,
    synchronize,
    trace_start,
    trace_stop,
    wait_on_host,
    wait_shared_reads,
    wait_stored,
    warn_if_spilled,
)

__all__ = [
    "add_counters",
    "BUILD_RECORD",
    "DEFAULTS",
    "CapacityWarning",
    "HostLimitError",
    "SpillWarning",
    "Ticket",
    "backend_name",
    "build_info",
    "capacity",
    "configure",
    "copy_into",
    "default_host_limit",
    "default_pinned_limit",
    "empty_cache",
    "fetch",
    "fetch_file",
    "is_arena_tensor",
    "is_disk_tensor",
    "is_offcache_tensor",
    "is_pinned_shared_tensor",
    "is_shared_tensor",
    "local_world_size",
    "make_disk_dir",
    "map_shared",
    "memory_share",
    "parse_size",
    "record_stream",
    "set_pinned_limit",
    "set_timing",
    "settings",
    "shared_word_add",
    "stats",
    "store",
    "synchronize",
    "torch_mismatch",
    "trace_start",
    "trace_stop",
    "wait_on_host",
    "wait_shared_reads",
    "wait_stored",
    "warn_if_spilled",
]
