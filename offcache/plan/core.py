"""What will a calibration run need? ``python -m offcache.plan``, and ``estimate()`` for code.

The run is llm-compressor's sequential pipeline. What each subgraph stores comes from the model
itself (offcache.plan.trace): its config is built on the meta device, traced with
llm-compressor's own ``trace_subgraphs`` (with the run's ``sequential_targets`` and
``sequential_targets_per_subgraph``) and its subgraphs run on meta tensors, so every value that
crosses a boundary has its true shape and dtype, for any model the pipeline can trace. The
cache's calls are then replayed as the pipeline makes them, the way offcache's engine holds
memory (offcache.plan.sim), batches of one shape together: 10**9 samples cost what 10 do.
Only when there is no config, or the model cannot be traced here, a Llama formula stands in,
and the output says so and why.

Every batch is taken at ``seq_len`` tokens: with the truncation collator (llm-compressor's
default) a batch is cut to its shortest sample and to max_seq_length; with the padding collator
it is padded to its longest sample (max_seq_length is ignored), so give the longest sample's
length. Samples of different lengths make the plan an upper bound, and it says so.

``python -m offcache.plan kv ...`` is the KV-cache question (``python -m offcache.kv size``,
kept as an alias).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import asdict, dataclass, field

import torch

from offcache import engine as _engine
from offcache.engine import machine as _machine
from offcache.plan import offload as plan_offload
from offcache.plan import positions as plan_positions
from offcache.plan import ranks as plan_ranks
from offcache.plan import sim as plan_sim
from offcache.plan import trace as plan_trace
from offcache.util.model_config import load_config
from offcache.util.units import bytes_text as _h

GiB = 1 << 30
ALIGN = plan_sim.ALIGN

# Bandwidth defaults, GB/s per direction.
H200_PINNED_GBPS = 64.0
H200_PINNED_SOURCE = (
    "published: NVIDIA H200 datasheet, PCIe Gen5 x16 128 GB/s (both directions), so 64 GB/s per direction; "
    "a ceiling, not a measurement"
)
PAGEABLE_GBPS = 16.0
PAGEABLE_SOURCE = (
    "assumed, not published (NVIDIA gives no pageable figure): the driver stages pageable copies through a "
    "pinned buffer with CPU memcpy; measure yours with python -m offcache.bench"
)
DISK_GBPS = 2.0
DISK_SOURCE = (
    "assumed: a datacenter NVMe SSD's sequential rate, each direction; measure yours with "
    "python -m offcache.bench disk and give --disk-gbps or --bench-results"
)
H200_GPU_BYTES = 141 * 10**9
H200_GPU_SOURCE = "published: NVIDIA H200 datasheet, 141 GB HBM3e (no GPU visible here)"
GPU_WEIGHT_SHARE = 0.9  # assumed: the rest of the GPU's memory is left to activations
# What a rank holds besides offcache's host memory and the weights: the interpreter, torch and llm-compressor
# (about 0.8 GiB of RSS at import, measured) and their working buffers. The planner's host-limit advice keeps
# each rank's limit at most half of what is left of memory after these and the weights held there: the engine's
# own rule (engine/config.py, DEFAULTS): the rest of the process needs at least as much again as the host limit.
PROCESS_WORKING_SET = 1 << 30
COLLATORS = ("truncation", "padding")
SPLIT_APPROXIMATE = (
    "The disk tier's writes and reads are approximate: stores alternated between memory and disk over many "
    "batches, and which of them fitted is not tracked batch by batch (the cache peak and the transfers are exact)."
)


@dataclass
class Shape:
    """What the planner needs of a model when it cannot trace one (the fallback formula)."""

    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool = False
    weight_bytes_per_layer: list[int] = field(default_factory=list)
    weight_bytes_total: int = 0


@dataclass
class Boundary:
    """The values stored after one subgraph: per batch (the first) and over every batch."""

    subgraph: int
    targets: str  # the sequential targets the subgraph runs, e.g. "model.layers.3"
    values: dict[str, str]  # name -> shapes and dtypes, e.g. "2x24x128 float32"
    batch_bytes: int  # the first batch's values, each tensor once
    tensors: int  # distinct tensors among them (one mask under several layers' names is one)
    total_bytes: int  # over every batch
    cache_peak_bytes: int  # the most the cache holds while this subgraph's outputs are stored
    weight_bytes: int  # the weights the subgraph runs (onloaded for it when offloaded)
    in_flight_bytes: int = 0  # what snapshots still in flight may hold beyond cache_peak_bytes (a CPU model)


@dataclass
class Weights:
    """The model's weights: per subgraph of the decoder the pipeline walks, and where they would live."""

    per_subgraph: list[int]
    walked_bytes: int  # the modules some subgraph runs, each once
    total_bytes: int  # the whole model (a multimodal model's vision tower too)
    gpu_bytes: int
    gpu_source: str
    placement: str  # "gpu", "cpu" or "cpu+disk"
    ram_bytes: int  # held in host memory
    disk_bytes: int  # offloaded to disk
    onload_bytes: int  # H2D: each subgraph's weights once (llm-compressor keeps them on for both passes)
    onload_disk_bytes: int  # the part of it read from disk


@dataclass
class Tiers:
    """Where the cache peak would live on this machine, with offcache's configuration now."""

    memory_bytes: int  # min(RAM, cgroup limit)
    pinned_limit_bytes: int
    host_limit_bytes: int
    disk_dir: str
    disk_free_bytes: int
    disk_auto_reason: str
    pinned_bytes: int
    pageable_bytes: int
    disk_bytes: int
    fits: bool


@dataclass
class Plan:
    samples: int
    batch_size: int
    batches: int
    seq_len: int
    collator: str
    dtype: str
    onload: str
    sequential_targets: list[str]
    targets_per_subgraph: int
    method: str  # "traced" (from the model) or "formula" (the Llama fallback)
    method_reason: str  # why the formula, when it is used
    notes: list[str]
    shape: Shape
    input_bytes: int  # the calibration set in the cache (input_ids, attention_mask)
    boundaries: list[Boundary]
    cache_peak_bytes: int  # the cache at its peak (a queued CPU store's snapshot included: copied_inline)
    in_flight_bytes: int  # what a CPU model's snapshots still in flight may hold more, at the bound's peak
    peak_bound_bytes: int  # the most the cache may hold, snapshots in flight included: the measured peak's bound
    weights: Weights
    tiers: Tiers
    d2h_bytes: int  # every stored value, once
    h2d_bytes: int  # every fetch: every subgraph's inputs, once per pass
    disk_write_bytes: int  # cache blocks past the host limit
    disk_read_bytes: int  # fetches of them
    pinned_gbps: float
    pinned_source: str
    pageable_gbps: float
    pageable_source: str
    disk_write_gbps: float
    disk_read_gbps: float
    disk_source: str
    seconds_pinned: float  # the cache's copies at pinned bandwidth
    seconds_pageable: float
    seconds_disk: float  # the cache's disk writes and reads
    seconds_weights: float  # the weight onloads: host part at pageable bandwidth, disk part at disk bandwidth
    advice: list[str]
    # A torchrun job's node (offcache.plan.ranks): the lines above are one rank's (its share of the
    # samples, its cache, its limits); the weights are once per node. One process: 1 rank, 1 node.
    node: plan_ranks.Node
    # With offload_weights: the weights=True run under its memory limit (offcache.plan.offload); else None.
    offload: plan_offload.Offload | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def weight_bytes_total(self) -> int:
        return self.weights.total_bytes

    @property
    def weight_bytes_per_layer(self) -> int:
        """The largest subgraph's weights but subgraph 0's and the last's (embeddings, head)."""
        inner = self.weights.per_subgraph[1:-1] or self.weights.per_subgraph
        return max(inner, default=0)


def copied_inline(settings: dict) -> bool:
    """Whether the engine copies a store of CPU memory on the calling thread, so that a CPU model's
    snapshots are never in flight: always, except on the host backend slowed for tests (a copy delay),
    which sends them through its copy stream as a GPU's stores go (csrc/backends/backend.h,
    ``copies_host_stores_inline``)."""
    return not settings.get("host_copy_delay_us")


def torch_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).replace("torch.", "")
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype: {name!r} is not a torch floating dtype (e.g. bfloat16, float16, float32)")
    return value


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=torch_dtype(dtype)).element_size()


def shape_of_config(config) -> Shape:
    """The planner's Shape of a transformers config (its text decoder's)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    return Shape(
        layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        intermediate_size=getattr(text, "intermediate_size", 0) or 0,
        vocab_size=getattr(text, "vocab_size", 0) or 0,
        tied_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
    )


def _formula_weights(shape: Shape, dtype) -> Shape:
    """Weight bytes of a Llama-like decoder (attention, gated MLP, two norms per layer)."""
    size = _itemsize(dtype)
    h, q, kv = shape.hidden_size, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    layer = (h * q + 2 * h * kv + q * h) + 3 * h * shape.intermediate_size + 2 * h
    embed = shape.vocab_size * h
    total = shape.layers * layer + embed * (1 if shape.tied_embeddings else 2) + h
    shape.weight_bytes_per_layer = [layer * size] * shape.layers
    shape.weight_bytes_total = total * size
    return shape


def _batch_groups(samples: int, batch_size: int) -> list[tuple[int, int]]:
    """(batch size, how many batches of it) in the dataloader's order: the full batches, then the rest."""
    full, rest = divmod(samples, batch_size)
    return [(size, n) for size, n in ((batch_size, full), (rest, 1 if rest else 0)) if n]


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _gbps(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ValueError(f"{name} must be a positive number of GB/s, got {value!r}")
    return float(value)


def _gpu_bytes(gpu_bytes: int | None) -> tuple[int, str]:
    if gpu_bytes is not None:
        return _positive("gpu_bytes", gpu_bytes), "given"
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, f"measured: {torch.cuda.get_device_name(0)}"
    return H200_GPU_BYTES, H200_GPU_SOURCE


def _tiers(peak: int, settings: dict, memory: int | None = None) -> Tiers:
    pinned_limit, host_limit = settings.get("pinned_limit", 0), settings.get("host_limit", 0)
    disk_dir = settings.get("disk_dir", "")
    free = 0
    if disk_dir:
        try:
            st = os.statvfs(_machine.existing_folder(disk_dir))  # made when first needed
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = 0
    pinned = min(peak, pinned_limit, host_limit)
    pageable = min(peak, host_limit) - pinned
    disk = max(peak - host_limit, 0)
    return Tiers(
        memory_bytes=_machine.usable_memory_bytes() if memory is None else memory,
        pinned_limit_bytes=pinned_limit,
        host_limit_bytes=host_limit,
        disk_dir=disk_dir,
        disk_free_bytes=free,
        disk_auto_reason=settings.get("disk_auto_reason", ""),
        pinned_bytes=pinned,
        pageable_bytes=pageable,
        disk_bytes=disk,
        fits=disk <= free,
    )


def _subgraphs(config, shape, dtype, sizes, seq_len, sequential_targets, targets_per_subgraph):
    """(subgraph values per batch size, Shape, method, reason, notes, total weight bytes)."""
    reason = ""
    if config is not None:
        try:
            try:
                traced = plan_trace.trace(config, dtype, sizes[0], seq_len, sequential_targets, targets_per_subgraph)
                traced.stand_ins = dtype.itemsize <= 2  # else the exact bf16 run below comes first
                per_size = {b: traced.run(b, seq_len) for b in sorted(set(sizes))}
            except Exception as exc:  # a meta kernel for bf16/fp16 only: run in bf16, report in `dtype`
                if dtype.itemsize <= 2:
                    raise
                traced = plan_trace.trace(config, dtype, sizes[0], seq_len, sequential_targets, targets_per_subgraph,
                                          run_dtype=torch.bfloat16)  # fmt: skip
                per_size = {b: traced.run(b, seq_len) for b in sorted(set(sizes))}
                traced.notes.append(
                    f"run on meta tensors in bfloat16, reported as {str(dtype).replace('torch.', '')} (in "
                    f"{str(dtype).replace('torch.', '')}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
                )
            return per_size, shape_of_config(config), "traced", "", traced.notes, (traced.weight_bytes_total,
                                                                                 traced.walked_bytes)  # fmt: skip
        except ImportError as exc:
            reason = f"llm-compressor is not importable here ({exc})"
        except Exception as exc:  # what llm-compressor cannot trace, the pipeline cannot run either
            reason = (
                "llm-compressor's trace of the model, or a run of its subgraphs, fails here (as it would in the "
                f"pipeline): {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            )
        shape = shape_of_config(config)
    else:
        reason = "no model config was given, only its sizes"
    if sequential_targets is not None or targets_per_subgraph != 1:
        raise ValueError(f"sequential_targets and targets_per_subgraph need a traced model, but {reason}")
    shape = _formula_weights(dataclasses.replace(shape, weight_bytes_per_layer=[]), dtype) \
        if not shape.weight_bytes_per_layer else shape  # fmt: skip
    per_size = {b: plan_sim.formula_subgraphs(shape, b, seq_len, dtype) for b in sorted(set(sizes))}
    return per_size, shape, "formula", reason, [], (shape.weight_bytes_total, shape.weight_bytes_total)


def _weights(per_subgraph: list[int], total: int, walked: int, onload: str, gpu: tuple[int, str], room: int) -> Weights:
    """Where the weights would live: on the GPU if they fit its share, else host memory (up to `room`),
    the rest on disk; offloaded weights are onloaded once per subgraph."""
    onload_bytes = sum(per_subgraph)
    gpu_bytes, gpu_source = gpu
    if onload == "cpu":
        return Weights(per_subgraph, walked, total, gpu_bytes, gpu_source, "cpu", total, 0, 0, 0)
    if total <= GPU_WEIGHT_SHARE * gpu_bytes:
        return Weights(per_subgraph, walked, total, gpu_bytes, gpu_source, "gpu", 0, 0, 0, 0)
    ram = min(total, max(room, 0))
    disk = total - ram
    share = disk / total if total else 0.0
    return Weights(per_subgraph, walked, total, gpu_bytes, gpu_source, "cpu+disk" if disk else "cpu", ram, disk,
                   onload_bytes, int(onload_bytes * share))  # fmt: skip


def safe_host_limit(memory: int, weights_in_memory: int, nproc: int = 1) -> int:
    """The largest host limit per rank that the planner advises: half of the memory left after the weights held
    there and each rank's working set (PROCESS_WORKING_SET), divided among the ranks."""
    return max(memory - weights_in_memory - nproc * PROCESS_WORKING_SET, 0) // (2 * max(nproc, 1))


def _advised_limit_text(need: int, safe: int) -> str:
    """A setting of at least `need` bytes and at most `safe` (need <= safe): rounded up where that stays safe."""
    for text in (_host_limit_text(need), f"{-(-need >> 20)}MiB"):
        if _engine.parse_size(text) <= safe:
            return text
    return str(need)


def _safe_limit_text(n: int) -> str:
    """`n` bytes as a setting, rounded down (advice must stay at or below the safe limit)."""
    return f"{n >> 30}GiB" if n >= 1 << 30 and n >> 30 << 30 >= n - (n >> 4) else f"{n >> 20}MiB"


def _host_limit_text(n: int) -> str:
    gib = -(-n // GiB)
    return f"{gib}GiB" if gib * GiB <= n + GiB // 4 else f"{-(-n // (1 << 20))}MiB"


def _advice(p_peak: int, tiers: Tiers, weights: Weights, method: str, reason: str, bounded: bool,
            in_flight: tuple[int, int, int] | None, nproc: int = 1,
            in_checkpoint: bool = False) -> list[str]:  # fmt: skip
    out = []
    if in_flight is not None:
        more, bound, limit = in_flight
        out.append(
            f"On this machine, with the model on the CPU, each store's snapshot lives in host memory until its copy "
            f"lands: the cache peak counts the one being stored; those still in flight (the stores since the "
            f"pipeline last fetched one, at most OFFCACHE_MAX_IN_FLIGHT={_h(limit)} of copies) can hold up to "
            f"{_h(more)} more: the peak bound is {_h(bound)}."
        )
    if method == "formula":
        out.append(f"Stored values from the Llama formula (fallback), not from the model: {reason}.")
    if bounded:
        out.append(
            "Every batch is taken at --seq-len tokens: with samples of different lengths this is an upper bound."
        )
    # Weights load_offloaded_model leaves on the CPU are the checkpoint's mapping: page cache, not held.
    safe = safe_host_limit(tiers.memory_bytes, 0 if in_checkpoint else weights.ram_bytes, nproc)
    ranks = "each rank's working set" if nproc > 1 else "the process's working set"
    rest = "the rest on the disk tier" if tiers.disk_dir else \
        "the rest on a disk tier (OFFCACHE_DISK_DIR: a folder on a disk with room; there is none now)"  # fmt: skip
    held = f"{' per rank' if nproc > 1 else ''}: half of what is left beside the weights held there and {ranks} of " \
           f"about {_h(PROCESS_WORKING_SET)}"  # fmt: skip
    if tiers.disk_bytes and p_peak <= safe:
        out.append(
            f"On this machine, the cache peak ({_h(p_peak)}) fits under the host limit this machine holds safely "
            f"({_h(safe)}{held}) but not under the one set ({_h(tiers.host_limit_bytes)}): "
            f"OFFCACHE_HOST_LIMIT={_advised_limit_text(p_peak, safe)} keeps it in memory, with no disk tier."
        )
    elif tiers.disk_bytes and _engine.parse_size(_safe_limit_text(safe)) > tiers.host_limit_bytes:
        out.append(
            f"On this machine, the cache peak ({_h(p_peak)}) is more than this machine holds safely ({_h(safe)}{held})"
            f": OFFCACHE_HOST_LIMIT={_safe_limit_text(safe)} keeps that much of it in memory and {rest}; a "
            "higher limit risks the kernel's OOM killer."
        )
    elif min(p_peak, tiers.host_limit_bytes) > safe:
        out.append(
            f"On this machine, the host limit ({_h(tiers.host_limit_bytes)}) lets the cache hold more than this "
            f"machine holds safely ({_h(safe)}{held}): OFFCACHE_HOST_LIMIT={_safe_limit_text(safe)} keeps "
            f"{rest} instead of risking the kernel's OOM killer."
        )
    # Weights offloaded by load_offloaded_model are read from the checkpoint's files: no room on the tier.
    disk_need = nproc * tiers.disk_bytes + (0 if in_checkpoint else weights.disk_bytes)
    if not tiers.fits or disk_need > tiers.disk_free_bytes and (disk_need > tiers.disk_bytes or nproc > 1):
        out.append(
            f"On this machine, it DOES NOT FIT: weights ({_h(weights.total_bytes)}) and cache ({_h(p_peak)}) "
            f"need {_h(disk_need)} on disk "
            f"past this machine's memory ({_h(tiers.memory_bytes)}), and the disk tier has "
            f"{_h(tiers.disk_free_bytes) if tiers.disk_dir else 'none'}: set OFFCACHE_DISK_DIR to a disk with room, "
            "use fewer samples or a shorter --seq-len."
        )
    return out


def estimate(
    config=None,
    *,
    samples: int,
    seq_len: int,
    dtype="bfloat16",
    batch_size: int = 1,
    onload: str = "cuda",
    shape: Shape | None = None,
    sequential_targets: list[str] | None = None,
    targets_per_subgraph: int = 1,
    collator: str = "truncation",
    propagate_error: bool = True,
    uniform_lengths: bool = False,
    gpu_bytes: int | None = None,
    pinned_gbps: float = H200_PINNED_GBPS,
    pageable_gbps: float = PAGEABLE_GBPS,
    disk_write_gbps: float | None = None,
    disk_read_gbps: float | None = None,
    nproc_per_node: int | None = None,
    nnodes: int | None = None,
    memory_limit: int | None = None,
    offload_weights: bool = False,
    checkpoint: str | os.PathLike | None = None,
    working_set: int | None = None,
) -> Plan:
    """The plan of a sequential-pipeline calibration run (see the module's docstring).

    `config`: a transformers config, or a path/Hub id for AutoConfig (local only); or give `shape`
    (the Llama formula then stands in). `onload`: where the model runs, 'cuda' or 'cpu' (on a CPU the
    stores' snapshots are host memory and the weights stay in RAM). `sequential_targets`,
    `targets_per_subgraph`, `collator`, `propagate_error`: llm-compressor's options of those names
    (`collator`: its data_collator, 'truncation' or 'padding'; `seq_len` is then max_seq_length, or
    the longest sample). `uniform_lengths`: every sample is `seq_len` tokens, so the plan is exact,
    not an upper bound. `gpu_bytes`: the GPU's memory (default: the visible GPU's, else an H200's).
    `nproc_per_node`, `nnodes`: a torchrun job's (default: LOCAL_WORLD_SIZE and WORLD_SIZE, else 1):
    each rank caches its share of the samples with its own limits, the weights count once per node
    (offcache.plan.ranks). `memory_limit`: the run's memory in bytes (default: this process's, its
    cgroup's limit or RAM): percentages of memory (the default host limit's 25 %) are of it.
    `offload_weights`: the run is ``patch_llmcompressor(weights=True)`` with the model loaded by
    ``load_offloaded_model(device_map="auto_offload")``: the weights are placed by offcache's run-time rule
    under that limit, and `Plan.offload` says where the weights and activations live, the disk reads per
    pass and their time, and the expected peak (offcache.plan.offload). `checkpoint`: the safetensors
    folder, whose tensors' bytes are placed (its config.json stands in for `config`). `working_set`: the
    bytes of the process beside offcache and the weights (default: measured in this process).
    """
    _positive("samples", samples)
    _positive("seq_len", seq_len)
    _positive("batch_size", batch_size)
    _positive("targets_per_subgraph", targets_per_subgraph)
    if onload not in ("cuda", "cpu"):
        raise ValueError(f"onload must be 'cuda' or 'cpu', got {onload!r}")
    if collator not in COLLATORS:
        raise ValueError(f"collator must be one of {COLLATORS}, got {collator!r}")
    nproc, nnodes = plan_ranks.job(nproc_per_node, nnodes)
    share = plan_ranks.samples_per_rank(samples, nproc * nnodes)  # the samples one rank's cache holds
    pinned_gbps, pageable_gbps = _gbps("pinned_gbps", pinned_gbps), _gbps("pageable_gbps", pageable_gbps)
    disk_given = disk_write_gbps is not None or disk_read_gbps is not None
    disk_write_gbps = _gbps("disk_write_gbps", DISK_GBPS if disk_write_gbps is None else disk_write_gbps)
    disk_read_gbps = _gbps("disk_read_gbps", DISK_GBPS if disk_read_gbps is None else disk_read_gbps)
    dtype = torch_dtype(dtype)
    if sequential_targets is not None:
        if isinstance(sequential_targets, str):
            sequential_targets = [sequential_targets]
        if not sequential_targets or not all(isinstance(t, str) and t for t in sequential_targets):
            raise ValueError(
                f"sequential_targets must be a list of class names or patterns, got {sequential_targets!r}"
            )
        sequential_targets = list(sequential_targets)
    config, checkpoint, memory = plan_offload.check_args(config, shape, checkpoint, memory_limit, working_set,
                                                         offload_weights)  # fmt: skip
    if shape is None:
        if config is None:
            raise ValueError("estimate() needs a model config (or a path to one), or shape=Shape(...)")
        if isinstance(config, (str, os.PathLike)):
            config = load_config(config)
    past_positions = plan_positions.check(config, seq_len) if shape is None else None
    groups = _batch_groups(share, batch_size)
    sizes = [size for size, _ in groups]
    per_size, shape, method, reason, notes, (weight_total, walked) = _subgraphs(
        None if shape is not None else config, shape, dtype, sizes, seq_len, sequential_targets, targets_per_subgraph
    )
    inputs = {b: plan_sim.inputs_of(b, seq_len) for b in sizes}
    settings = plan_ranks.rank_settings(_engine.settings(), nproc, memory=memory[0])
    replay = plan_sim.simulate_groups([(n, per_size[b], inputs[b]) for b, n in groups], onload=onload,
                                      host_limit=settings.get("host_limit", 0), passes=2 if propagate_error else 1,
                                      max_in_flight=settings.get("max_in_flight"),
                                      copied_inline=copied_inline(settings))  # fmt: skip
    tiers = _tiers(replay.peak_bytes, settings, memory[0])
    first = per_size[sizes[0]]
    weights = _weights([sg.weight_bytes for sg in first], weight_total, walked, onload, _gpu_bytes(gpu_bytes),
                       tiers.memory_bytes - nproc * min(replay.peak_bytes, tiers.host_limit_bytes))  # fmt: skip
    offload = None
    if offload_weights:
        per_subgraph = [sg.weight_bytes for sg in first]
        offload = plan_offload.plan_offload(
            config, dtype, checkpoint=checkpoint, memory=memory, settings=settings, onload=onload, tiers=tiers,
            per_subgraph=per_subgraph, cache_reads=replay.disk_read_bytes, cache_writes=replay.disk_write_bytes,
            read_gbps=disk_read_gbps, write_gbps=disk_write_gbps, disk_source="given" if disk_given else DISK_SOURCE,
            working=plan_offload.working_set(working_set),
            acts_first_batch=2 * max((sum(n for _, n in _distinct(sg.outputs)) for sg in first), default=0),
        )  # fmt: skip
        weights = plan_offload.weights_of(weights, offload)
        if nproc > 1:
            notes.append("offload_weights places the weights as one process does; a torchrun job's node shares them")
    node = plan_ranks.node(nproc, nnodes, share, tiers, weights, settings)
    boundaries = []
    for k, sg in enumerate(first[:-1]):
        total = sum(n * sum(nbytes for _, nbytes in _distinct(per_size[b][k].outputs)) for b, n in groups)
        boundaries.append(Boundary(
            subgraph=k, targets=_targets(sg.targets), values=dict(sg.shapes), weight_bytes=sg.weight_bytes,
            batch_bytes=sum(n for _, n in _distinct(sg.outputs)), tensors=len(_distinct(sg.outputs)), total_bytes=total,
            cache_peak_bytes=replay.peaks[k + 1], in_flight_bytes=replay.in_flight[k + 1],
        ))  # fmt: skip
    d2h, h2d = replay.d2h_bytes, replay.h2d_bytes
    disk_seconds = replay.disk_write_bytes / (disk_write_gbps * 1e9) + replay.disk_read_bytes / (disk_read_gbps * 1e9)
    w_host = 0 if onload == "cpu" else weights.onload_bytes - weights.onload_disk_bytes  # a CPU onload copies nothing
    weight_seconds = w_host / (pageable_gbps * 1e9) + weights.onload_disk_bytes / (disk_read_gbps * 1e9)
    bounded = not uniform_lengths
    return Plan(
        samples=samples, batch_size=batch_size, batches=sum(n for _, n in groups), seq_len=seq_len, collator=collator,
        dtype=str(dtype).replace("torch.", ""), onload=onload,
        sequential_targets=list(sequential_targets or []), targets_per_subgraph=targets_per_subgraph,
        method=method, method_reason=reason, notes=list(notes), shape=shape,
        input_bytes=sum(n * sum(nbytes for _, nbytes in _distinct(inputs[b])) for b, n in groups),
        boundaries=boundaries,
        cache_peak_bytes=replay.peak_bytes, in_flight_bytes=replay.bound_bytes - replay.peak_bytes,
        peak_bound_bytes=replay.bound_bytes, weights=weights, tiers=tiers, d2h_bytes=d2h, h2d_bytes=h2d,
        disk_write_bytes=replay.disk_write_bytes, disk_read_bytes=replay.disk_read_bytes,
        pinned_gbps=pinned_gbps, pinned_source=H200_PINNED_SOURCE if pinned_gbps == H200_PINNED_GBPS else "given",
        pageable_gbps=pageable_gbps, pageable_source=PAGEABLE_SOURCE if pageable_gbps == PAGEABLE_GBPS else "given",
        disk_write_gbps=disk_write_gbps, disk_read_gbps=disk_read_gbps,
        disk_source="given" if disk_given else DISK_SOURCE,
        seconds_pinned=(d2h + h2d) / (pinned_gbps * 1e9), seconds_pageable=(d2h + h2d) / (pageable_gbps * 1e9),
        seconds_disk=disk_seconds, seconds_weights=weight_seconds,
        advice=_advice(replay.peak_bytes, tiers, weights, method, reason, bounded,
                       (replay.bound_bytes - replay.peak_bytes, replay.bound_bytes, settings.get("max_in_flight", 0))
                       if onload == "cpu" and not copied_inline(settings) else None, nproc, offload is not None)
        + ([SPLIT_APPROXIMATE] if replay.approximate else []) + ([past_positions] if past_positions else [])
        + plan_ranks.advice(node, _h, safe_host_limit(tiers.memory_bytes, 0, nproc))
        + (plan_offload.advice(offload, _h) if offload else []), node=node, offload=offload,
    )  # fmt: skip


def _distinct(values: dict[str, list]) -> list:
    seen: dict = {}
    for leaves in values.values():
        for key, nbytes in leaves:
            seen.setdefault(key, nbytes)
    return list(seen.items())


def _targets(names: list[str]) -> str:
    if not names:
        return "no target"
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} targets)"
