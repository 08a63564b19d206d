"""Where ``load_offloaded_model(device_map="auto_offload")`` puts a model's weights, under offcache.

compressed-tensors sizes the CPU's share as ``psutil.virtual_memory().available`` less
``extra_cpu_mem`` (5 GB by default): the host's free memory, not a container's. In a memory cgroup
smaller than the host that plans every weight onto the CPU, and a weight calibration writes
(GPTQ's update) becomes anonymous memory nothing reclaims. While patched, the CPU's share is
also at most offcache's host limit (OFFCACHE_HOST_LIMIT; by default a quarter of the memory the
process may use, the cgroup's limit where that is smaller than RAM): the memory offcache may hold
on the host, which counts every weight copy. The rest goes to disk, read from the checkpoint's own
files (compressed-tensors links them; nothing is copied). One log line says, once the model is
dispatched, the bytes on the CPU, on disk and on devices, and why; a disk share read from a network
or memory file system gets a CheckpointFileSystemWarning (checkpoint_fs.py). The planner
(``python -m offcache.plan --offload-weights``) places a run's weights with the same ``cpu_share()``,
given that run's ``Limits``.

A disk share needs a folder: where the caller gave no ``offload_folder``, one under offcache's disk
tier (``<OFFCACHE_DISK_DIR>/weights-<pid>``, made when first needed) holds compressed-tensors'
links and the weights calibration rewrites. Without a disk tier, or under torch.distributed (the
ranks share one folder the caller names), compressed-tensors' own error asks for ``offload_folder``.
"""

from __future__ import annotations

import atexit
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from offcache import engine as _engine
from offcache.engine import config as _engine_settings
from offcache.engine import machine as _machine
from offcache.util.units import bytes_text
from offcache.weights.memory import checkpoint_fs

_originals: dict[str, Any] = {}
# The last plan's CPU share and its reason, for the log line after dispatch.
_last: dict[str, Any] = {}
_folder: list[str] = []  # the default offload folders made (each removed at exit); the last in use


# load_offloaded_model's default extra_cpu_mem: the memory it leaves beside the CPU's share.
EXTRA_CPU_MEM = 5 * 10**9


@dataclass(frozen=True)
class Limits:
    """What the CPU's share is bounded by: offcache's host limit (bytes, and as given), the cgroup's memory
    limit (None outside one) and RAM. ``limits()`` reads this process's; the planner gives a run's."""

    host: int
    spec: str | int
    cgroup: int | None
    ram: int


def limits() -> Limits:
    """This process's: the engine's resolved host limit, its cgroup's limit and RAM."""
    settings = _engine.settings()
    spec = settings.get("limit_specs", {}).get("host_limit", _engine_settings.DEFAULTS["host_limit"])
    host = int(settings.get("host_limit") or 0)
    return Limits(host, spec, _machine.cgroup_memory_limit(), _machine.total_ram_bytes())


def upstream_share(extra_cpu_mem: int = EXTRA_CPU_MEM) -> int:
    """compressed-tensors' own CPU share in one process (its ``_get_cpu_memory``, unpatched): the host's available
    memory less `extra_cpu_mem`, read now."""
    try:
        import compressed_tensors.offload.load as load

        get = _originals.get("_get_cpu_memory", load._get_cpu_memory)
        return int(get(extra_cpu_mem)["cpu"])
    except ImportError:  # no compressed-tensors (nor, then, psutil): the same figure from /proc/meminfo
        return int(_machine.available_ram_bytes() - extra_cpu_mem)


def cpu_share(upstream: int, bounds: Limits | None = None) -> tuple[int, str]:
    """The CPU's share of a model's weights: compressed-tensors' `upstream` bytes, at most the host limit.

    `bounds`: the limits it follows (default: this process's, ``limits()``). Returns (bytes, why): why names
    the bound that binds and the memory limit it comes from."""
    b = limits() if bounds is None else bounds
    host, spec, cgroup, ram = b.host, b.spec, b.cgroup, b.ram
    limited = cgroup is not None and cgroup < ram
    memory = f"the cgroup's limit {bytes_text(cgroup)}" if limited else f"RAM {bytes_text(ram)}"
    given = f"{spec} of {memory}" if str(spec).strip().endswith("%") else f"set to {spec}"
    host_why = f"offcache's host limit {bytes_text(host)} ({given}, OFFCACHE_HOST_LIMIT)"
    upstream_why = (f"compressed-tensors' share {bytes_text(max(upstream, 0))} (the host's available memory "
                    "less extra_cpu_mem)")  # fmt: skip
    # Outside a memory cgroup, and with no host limit given, compressed-tensors' share stands: the host's
    # available memory is the real bound there, and a default quarter of RAM would send to disk what the
    # peer alone keeps in memory.
    bound = limited or str(spec).strip() != str(_engine_settings.DEFAULTS["host_limit"])
    if host and host < upstream and bound:
        return host, f"{host_why}, under {upstream_why}"
    if not bound:
        return max(upstream, 0), f"{upstream_why} (no memory cgroup and no OFFCACHE_HOST_LIMIT given)"
    return max(upstream, 0), f"{upstream_why}, under {host_why}"


def default_offload_dir() -> str | None:
    """The folder for a disk share the caller gave none for: made under the disk tier; None without one."""
    disk = _engine.settings().get("disk_dir") or ""
    folder = os.path.join(disk, f"weights-{os.getpid()}")
    if _folder and _folder[-1] == folder and os.path.isdir(folder):
        return folder  # made for this disk tier, still there (configure() may have named another since)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not disk or (distributed and torch.distributed.get_world_size() > 1):
        return None  # ranks would each make their own: the caller's folder, shared, or DiskCache's error
    os.makedirs(folder, mode=0o700, exist_ok=True)
    _folder.append(folder)
    atexit.register(shutil.rmtree, folder, True)  # links and rewritten weights: this process's alone
    return folder


def placement(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of `model`'s offloaded weights by where they live: "cpu", "disk", or an onload device's name."""
    from compressed_tensors.offload.cache import DiskCache, OffloadCache

    out: dict[str, int] = {"cpu": 0, "disk": 0}
    seen: set[int] = set()
    for module in model.modules():
        for cache in (module._parameters, module._buffers):
            values = cache.offloaded_values.items() if isinstance(cache, OffloadCache) else cache.items()
            for _, tensor in values:
                if tensor is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                if isinstance(cache, DiskCache) and tensor.device.type == "meta":
                    where = "disk"
                else:
                    where = "cpu" if tensor.device.type in ("cpu", "meta") else str(tensor.device)
                out[where] = out.get(where, 0) + tensor.nbytes
    return out


def line(where: dict[str, int], why: str | None) -> str:
    """The placement log line."""
    devices = "".join(f", {bytes_text(n)} on {d}" for d, n in where.items() if d not in ("cpu", "disk") and n)
    reason = f": the CPU's share is {why}" if why else " (the caller's max_memory or device_map)"
    return (f"offcache weights placement: {bytes_text(where['cpu'])} on the CPU, {bytes_text(where['disk'])} "
            f"on disk{devices}{reason}")  # fmt: skip


def _get_cpu_memory(extra_cpu_mem, *args, **kwargs):
    planned = _originals["_get_cpu_memory"](extra_cpu_mem, *args, **kwargs)
    share, why = cpu_share(int(planned["cpu"]))
    _last.update(why=why)
    return {**planned, "cpu": share}


def _from_accelerate(model, *args, **kwargs):
    from loguru import logger  # llm-compressor's logger; only reached while patched, where it is installed

    out = _originals["from_accelerate"](model, *args, **kwargs)
    logger.info(line(placement(model), _last.pop("why", None)))
    said = checkpoint_fs.take_messages()
    for message in said:
        logger.warning(message)
    checkpoint_fs.warn(said)
    return out


def _create_checkpoint_symlink(cls, offloaded, weight_info, offload_dir):
    if offload_dir is None:
        offload_dir = default_offload_dir()
    out = _originals["create_checkpoint_symlink"].__func__(cls, offloaded, weight_info, offload_dir)
    checkpoint_fs.note(weight_info["safetensors_file"], offloaded.nbytes)  # read from there at each onload
    return out


def patch() -> None:
    """Route load_offloaded_model's CPU share through cpu_share() and log the placement. Idempotent."""
    if _originals:
        return
    import compressed_tensors.offload.load as load
    from compressed_tensors.offload.cache import DiskCache

    _originals["_get_cpu_memory"] = load._get_cpu_memory
    _originals["from_accelerate"] = load.from_accelerate
    _originals["create_checkpoint_symlink"] = DiskCache.__dict__["create_checkpoint_symlink"]
    load._get_cpu_memory = _get_cpu_memory
    load.from_accelerate = _from_accelerate
    DiskCache.create_checkpoint_symlink = classmethod(_create_checkpoint_symlink)


def unpatch() -> None:
    if not _originals:
        return
    import compressed_tensors.offload.load as load
    from compressed_tensors.offload.cache import DiskCache

    load._get_cpu_memory = _originals.pop("_get_cpu_memory")
    load.from_accelerate = _originals.pop("from_accelerate")
    DiskCache.create_checkpoint_symlink = _originals.pop("create_checkpoint_symlink")
    _last.clear()
    checkpoint_fs.take_messages()
