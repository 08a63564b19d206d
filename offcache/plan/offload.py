"""A run with offloaded weights under a memory limit: where its weights and activations will live, its disk
reads and time, its expected peak (``estimate(..., offload_weights=True)``, ``--offload-weights``).

The run: ``offcache.patch_llmcompressor(weights=True)``, the model loaded with compressed-tensors'
``load_offloaded_model()`` and ``device_map="auto_offload"``, in a memory limit (a cgroup's; by default
this process's, or the one given).

Weights. The CPU's share is offcache's own rule at run time,
``offcache.weights.memory.placement.cpu_share()``, given the run's limits: compressed-tensors' share
(this host's available memory less ``extra_cpu_mem``, read now, as load_offloaded_model reads it), at
most offcache's host limit resolved against the memory limit (by default 25 % of it). The modules are
then placed as transformers places them for that ``max_memory``: its device map of the model built on
the meta device, whole modules on the CPU in order until the share is full, the rest on disk (read
from the checkpoint's own files). With a checkpoint, a module's bytes are its safetensors tensors'; a
module the files do not hold (a computed buffer such as rotary ``inv_freq``) stays on the CPU.

Activations: the plan's cache peak in the tiers that the memory limit's host limit gives.

Disk reads. A pass over the weights reads the disk share once (calibration onloads each subgraph's
weights once for its calibration and propagation; ``save_pretrained`` reads each once more). The first
pass with the checkpoint out of the page cache reads the CPU share too: its weights are the file's
mapping, read when first touched. The activations' disk tier adds its reads. Pages the page cache still
holds are not read again, so these are at most.

Peak: the memory the kernel cannot reclaim (anonymous). The working set (the interpreter, torch,
transformers and llm-compressor: this process's anonymous memory once they are imported, or given),
plus offcache's host limit (what offcache may hold on the host: activations and weight copies
together), plus, with the model on the CPU, the weights of (1 + OFFCACHE_WEIGHT_PREFETCH) of the largest
subgraph onloaded at once. The CPU share stays the checkpoint's mapping, page cache the kernel reclaims
under the limit, and is not counted; where calibration rewrites it (GPTQ's updates) it becomes the
process's own: ``peak_if_rewritten_bytes`` adds it.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import torch

from offcache import engine as _engine
from offcache.engine import machine as _machine
from offcache.weights.memory import placement as _placement

# Where the working set cannot be measured (llm-compressor not importable here): assumed, as the engine's rule.
ASSUMED_WORKING_SET = 1 << 30
ASSUMED_WORKING_SET_SOURCE = (
    "assumed: the interpreter, torch and llm-compressor (about 0.8 GiB of RSS at import) and their buffers; "
    "give --working-set"
)


@dataclass
class Offload:
    """The offloaded weights' run under a memory limit (module docstring)."""

    memory_limit_bytes: int
    memory_limit_source: str  # "given", "the cgroup's limit" or "RAM"
    host_limit_bytes: int  # offcache's host limit under that memory limit
    checkpoint: str  # the safetensors folder read, '' for the model's sizes from its config
    weight_bytes: int  # the checkpoint's tensors (or the model's weights) in all
    upstream_cpu_bytes: int  # compressed-tensors' own share: this host's available memory less extra_cpu_mem
    cpu_share_bytes: int  # placement.cpu_share()'s bound
    cpu_bytes: int  # placed on the CPU: the checkpoint's mapping
    disk_bytes: int  # placed on disk: read from the checkpoint's files
    why: str  # the CPU share's reason, as the run's log line says it
    method: str  # how modules were placed
    activation_host_bytes: int  # the cache peak in host memory (pinned + pageable)
    activation_disk_bytes: int  # the cache peak on the disk tier
    activation_read_bytes: int  # the disk tier's reads over calibration
    activation_write_bytes: int
    pass_read_bytes: int  # a calibration pass: the disk share once, and the activations' disk reads
    cold_pass_read_bytes: int  # the first, the checkpoint out of the page cache: the CPU share too
    save_read_bytes: int  # save_pretrained: the disk share once more
    disk_read_gbps: float
    disk_write_gbps: float
    disk_source: str
    seconds_per_pass: float
    seconds_cold_pass: float
    working_set_bytes: int
    working_set_source: str
    onloads_at_once: int  # subgraphs' weights onloaded at once on the CPU (1 + prefetch depth), 0 on a GPU
    largest_subgraph_bytes: int
    expected_peak_bytes: int
    peak_if_rewritten_bytes: int  # where calibration rewrites the CPU share (GPTQ)
    least_bytes: int  # the working set, one subgraph's weights and its activations: below this no placement runs
    fits: bool  # expected_peak_bytes <= memory_limit_bytes


def check_args(config, shape, checkpoint, memory_limit_given, working_set_given, offload_weights: bool):
    """estimate()'s arguments for this concern checked: (config, checkpoint as a str or None, memory_limit())."""
    if checkpoint is not None:
        checkpoint = os.fspath(checkpoint)
        if not os.path.isdir(checkpoint):
            raise ValueError(f"checkpoint {checkpoint!r} is not a folder (a model's safetensors files and config.json)")
        if config is None and shape is None:
            config = checkpoint
    w = working_set_given
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
        raise ValueError(f"working_set must be a number of bytes >= 0, got {w!r}")
    if offload_weights and shape is not None:
        raise ValueError("offload_weights needs the model's config (or a checkpoint) to place its modules, not a shape")
    return config, checkpoint, memory_limit(memory_limit_given)


def weights_of(weights, o: Offload):
    """The plan's Weights with the offloaded placement: the CPU share in host memory, the rest on disk, every
    subgraph's weights onloaded once (the disk share read from disk)."""
    import dataclasses

    onloads = sum(weights.per_subgraph)
    return dataclasses.replace(
        weights, placement="cpu+disk" if o.disk_bytes else "cpu", ram_bytes=o.cpu_bytes, disk_bytes=o.disk_bytes,
        onload_bytes=onloads, onload_disk_bytes=min(o.disk_bytes, onloads),
    )  # fmt: skip


def memory_limit(given: int | None) -> tuple[int, str]:
    """(bytes, source) of the run's memory limit: as given, else this process's (its cgroup's, else RAM)."""
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, int) or given < 1:
            raise ValueError(f"memory_limit must be a number of bytes >= 1, got {given!r}")
        return given, "given"
    usable, cgroup = _machine.usable_memory_bytes(), _machine.cgroup_memory_limit()
    limited = cgroup is not None and cgroup == usable < _machine.total_ram_bytes()
    return usable, "the cgroup's limit" if limited else "RAM"


def bounds(memory: int, host_limit: int, spec) -> _placement.Limits:
    """The limits cpu_share() follows in a run whose memory limit is `memory` (a cgroup's where below RAM)."""
    ram = _machine.total_ram_bytes()
    if memory < ram:
        return _placement.Limits(host_limit, spec, memory, ram)
    return _placement.Limits(host_limit, spec, None, memory)


def _status_bytes(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


def working_set(given: int | None) -> tuple[int, str]:
    """(bytes, source): as given, else this process's anonymous memory with llm-compressor imported."""
    if given is not None:
        return int(given), "given"
    try:
        import contextlib
        import sys

        with contextlib.redirect_stdout(sys.stderr):  # llm-compressor logs on import
            import llmcompressor  # noqa: F401
    except ImportError:
        return ASSUMED_WORKING_SET, ASSUMED_WORKING_SET_SOURCE
    anon = _status_bytes("RssAnon")
    if not anon:
        return ASSUMED_WORKING_SET, ASSUMED_WORKING_SET_SOURCE
    return anon, ("measured: this process's anonymous memory with torch, transformers and llm-compressor "
                  "imported (a run's own process imports the same); give --working-set")  # fmt: skip


def checkpoint_tensors(folder: str) -> dict[str, int]:
    """Bytes of every tensor of the safetensors files in `folder`, by name (their headers only)."""
    from offcache.weights import files

    found = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not found:
        raise ValueError(f"--checkpoint {folder!r}: the folder holds no .safetensors file")
    out: dict[str, int] = {}
    for path in found:
        header, _ = files.header(os.path.realpath(path))
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                out[name] = end - start
    return out


def _under(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def place(config, dtype: torch.dtype, share: int, tensors: dict[str, int] | None) -> tuple[int, int, str]:
    """(CPU bytes, disk bytes, method) of the model's weights with `share` bytes for the CPU."""
    from offcache.plan import trace as plan_trace

    model = plan_trace.build_meta_model(config, dtype)
    sizes = {n: t.numel() * t.element_size() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    try:
        from transformers.integrations.accelerate import _get_device_map

        device_map = dict(_get_device_map(model, "auto", {"cpu": max(share, 0)}, None))
        method = "transformers' device map for max_memory={'cpu': share}, the model on the meta device"
    except Exception as exc:  # another transformers: bytes in order, no module boundaries
        device_map = {}
        method = f"the share in bytes (transformers' device map unavailable: {type(exc).__name__})"
    if not device_map:
        total = sum(tensors.values()) if tensors else sum(sizes.values())
        return min(total, max(share, 0)), max(total - max(share, 0), 0), method
    params = [n for n, _ in model.named_parameters()]
    if tensors is not None and sum(n in tensors for n in params) * 2 < len(params):
        method += "; the checkpoint's names are not the model's (renamed on load): the config's sizes"
        tensors = None
    out = {"cpu": 0, "disk": 0}
    for prefix, where in device_map.items():
        where = "disk" if where == "disk" else "cpu"
        names = [n for n in sizes if _under(n, prefix)]
        if tensors is None:
            out[where] += sum(sizes[n] for n in names)
            continue
        out[where] += sum(b for n, b in tensors.items() if _under(n, prefix) and n in sizes)
        # Not in the checkpoint: made in memory (a computed buffer), never offloaded to disk.
        out["cpu"] += sum(sizes[n] for n in names if n not in tensors)
    return out["cpu"], out["disk"], method


def plan_offload(config, dtype: torch.dtype, *, checkpoint: str | None, memory: tuple[int, str], settings: dict,
                 onload: str, tiers, per_subgraph: list[int], cache_reads: int, cache_writes: int,
                 read_gbps: float, write_gbps: float, disk_source: str, working: tuple[int, str],
                 acts_first_batch: int) -> Offload:  # fmt: skip
    """The Offload of a run (module docstring); `settings`: the engine's as the run's process would resolve them."""
    limit, source = memory
    host = int(settings.get("host_limit", 0))
    spec = (settings.get("limit_specs") or {}).get("host_limit", _engine.DEFAULTS["host_limit"])
    upstream = _placement.upstream_share()
    share, why = _placement.cpu_share(upstream, bounds(limit, host, spec))
    tensors = checkpoint_tensors(checkpoint) if checkpoint else None
    cpu, disk, method = place(config, dtype, share, tensors)
    from offcache.weights.bookkeeping import prefetch_depth

    at_once = 1 + prefetch_depth() if onload == "cpu" else 0
    largest = max(per_subgraph, default=0)
    ws, ws_source = working
    peak = ws + host + at_once * largest
    least = ws + largest + acts_first_batch
    pass_reads = disk + cache_reads
    cold = cpu + disk + cache_reads
    return Offload(
        memory_limit_bytes=limit, memory_limit_source=source, host_limit_bytes=host, checkpoint=checkpoint or "",
        weight_bytes=cpu + disk, upstream_cpu_bytes=upstream, cpu_share_bytes=share, cpu_bytes=cpu, disk_bytes=disk,
        why=why, method=method, activation_host_bytes=tiers.pinned_bytes + tiers.pageable_bytes,
        activation_disk_bytes=tiers.disk_bytes, activation_read_bytes=cache_reads,
        activation_write_bytes=cache_writes, pass_read_bytes=pass_reads, cold_pass_read_bytes=cold,
        save_read_bytes=disk, disk_read_gbps=read_gbps, disk_write_gbps=write_gbps, disk_source=disk_source,
        seconds_per_pass=pass_reads / (read_gbps * 1e9) + cache_writes / (write_gbps * 1e9),
        seconds_cold_pass=cold / (read_gbps * 1e9) + cache_writes / (write_gbps * 1e9),
        working_set_bytes=ws, working_set_source=ws_source, onloads_at_once=at_once, largest_subgraph_bytes=largest,
        expected_peak_bytes=peak, peak_if_rewritten_bytes=peak + cpu, least_bytes=least, fits=peak <= limit,
    )  # fmt: skip


def advice(o: Offload, text) -> list[str]:
    """What to change when the expected peak is past the memory limit (`text`: bytes as text)."""
    if o.least_bytes > o.memory_limit_bytes:
        return [
            f"With offloaded weights, it DOES NOT FIT: the working set ({text(o.working_set_bytes)}), the largest "
            f"subgraph's weights ({text(o.largest_subgraph_bytes)}) and its activations need "
            f"{text(o.least_bytes)}, more than the memory limit ({text(o.memory_limit_bytes)}): no placement runs "
            "it (the run raises SubgraphMemoryError at the start); raise the limit or split the subgraph."
        ]
    if o.fits:
        return []
    room = o.memory_limit_bytes - o.working_set_bytes - o.onloads_at_once * o.largest_subgraph_bytes
    return [
        f"With offloaded weights, the expected peak ({text(o.expected_peak_bytes)}) is past the memory limit "
        f"({text(o.memory_limit_bytes)}): OFFCACHE_HOST_LIMIT={max(room, 0) >> 20}MiB (what the limit leaves beside "
        "the working set and the onloaded weights) keeps offcache's host memory within it, the rest of the "
        "weights and activations on disk."
    ]
