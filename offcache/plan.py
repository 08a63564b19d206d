"""What will a calibration run need? ``python -m offcache.plan``, and ``estimate()`` for code.

The run is llm-compressor's sequential pipeline over a decoder whose sequential targets are
its decoder layers: subgraph 0 (embeddings, rotary, mask) and one subgraph per layer, the last
one with the head. After each subgraph but the last, every batch's outputs are stored and the
inputs that subgraph consumed are deleted, batch by batch. What is stored, per batch of B
samples of S tokens (as llm-compressor 0.14 traces transformers 5 Llama-like models):

- the calibration batch: input_ids and attention_mask, B x S int64 each;
- after subgraph 0: hidden states B x S x hidden, position ids 1 x S int64, the causal mask
  B x 1 x S x S and the rotary (cos, sin), 1 x S x head_dim each, in the model's dtype;
- after each later subgraph: the layer's hidden states, B x S x hidden.

The cache peak is simulated the way offcache's engine holds memory: each update() is one
arena block (every tensor rounded up to 256 bytes) that lives while any of its names does,
and a store snapshots its source first (on a CPU model, in host memory, until the copy lands).

``python -m offcache.plan kv ...`` is the KV-cache question (``python -m offcache.kv size``,
kept as an alias).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import sys
from dataclasses import asdict, dataclass, field

import torch

from offcache import _engine
from offcache._extras import MissingExtraError, require

GiB = 1 << 30
ALIGN = 256  # the arena's alignment (csrc/core/arena.h, ArenaOptions::alignment)

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


@dataclass
class Shape:
    """What the planner needs of a model."""

    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool = False
    weight_bytes_per_layer: list[int] = field(default_factory=list)  # exact, from the model on the meta device
    weight_bytes_total: int = 0


@dataclass
class Boundary:
    """The values stored after one subgraph, for one batch and for all of them."""

    subgraph: int
    names: list[str]
    hidden_bytes: int  # per batch
    position_bytes: int  # position ids and rotary cos/sin, per batch
    mask_bytes: int  # per batch
    batch_bytes: int  # all of the above
    total_bytes: int  # over every batch
    cache_peak_bytes: int  # the most the cache holds while this subgraph's outputs are stored


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
    dtype: str
    onload: str
    shape: Shape
    input_bytes: int  # the calibration set in the cache (input_ids, attention_mask)
    boundaries: list[Boundary]
    cache_peak_bytes: int
    weight_bytes_per_layer: int  # the largest layer
    weight_bytes_total: int
    tiers: Tiers
    d2h_bytes: int  # every stored value, once
    h2d_bytes: int  # every fetch: two passes (calibrate, propagate) over every subgraph's inputs
    pinned_gbps: float
    pinned_source: str
    pageable_gbps: float
    pageable_source: str
    seconds_pinned: float
    seconds_pageable: float

    def to_dict(self) -> dict:
        return asdict(self)


def _itemsize(dtype) -> int:
    if isinstance(dtype, str):
        name = dtype.replace("torch.", "")
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype: {name!r} is not a torch dtype (e.g. bfloat16, float16, float32)")
    return torch.empty((), dtype=dtype).element_size()


def _aligned(nbytes: int) -> int:
    return (max(nbytes, 1) + ALIGN - 1) // ALIGN * ALIGN


def shape_of_config(config, dtype="bfloat16") -> Shape:
    """The planner's Shape of a transformers config, with exact weight bytes from the model built on meta."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    shape = Shape(
        layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        intermediate_size=getattr(text, "intermediate_size", 0) or 0,
        vocab_size=getattr(text, "vocab_size", 0) or 0,
        tied_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
    )
    try:
        import transformers

        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception:  # an architecture transformers cannot build: the Llama-like formula instead
        return _formula_weights(shape, dtype)
    size = _itemsize(dtype)
    layers = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == shape.layers), None)
    if layers is not None:
        shape.weight_bytes_per_layer = [sum(p.numel() for p in layer.parameters()) * size for layer in layers]
    shape.weight_bytes_total = sum(p.numel() for p in model.parameters()) * size  # tied weights once
    return shape


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


def _batch_sizes(samples: int, batch_size: int) -> list[int]:
    full, rest = divmod(samples, batch_size)
    return [batch_size] * full + ([rest] if rest else [])


def _stored(shape: Shape, b: int, seq: int, size: int, first: bool) -> dict[str, int]:
    """Bytes of each tensor stored after a subgraph, for a batch of b samples."""
    hidden = {"hidden_states": b * seq * shape.hidden_size * size}
    if not first:
        return hidden
    return hidden | {
        "position_ids": seq * 8,
        "causal_mask": b * seq * seq * size,
        "rotary_cos": seq * shape.head_dim * size,
        "rotary_sin": seq * shape.head_dim * size,
    }


def _tiers(peak: int) -> Tiers:
    s = _engine.settings()
    pinned_limit, host_limit = s.get("pinned_limit", 0), s.get("host_limit", 0)
    disk_dir = s.get("disk_dir", "")
    free = 0
    if disk_dir:
        try:
            st = os.statvfs(_engine._existing(disk_dir))  # made when first needed
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = 0
    pinned = min(peak, pinned_limit, host_limit)
    pageable = min(peak, host_limit) - pinned
    disk = max(peak - host_limit, 0)
    return Tiers(
        memory_bytes=_engine.usable_memory_bytes(),
        pinned_limit_bytes=pinned_limit,
        host_limit_bytes=host_limit,
        disk_dir=disk_dir,
        disk_free_bytes=free,
        disk_auto_reason=s.get("disk_auto_reason", ""),
        pinned_bytes=pinned,
        pageable_bytes=pageable,
        disk_bytes=disk,
        fits=disk <= free,
    )


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def estimate(
    config=None,
    *,
    samples: int,
    seq_len: int,
    dtype="bfloat16",
    batch_size: int = 1,
    onload: str = "cuda",
    shape: Shape | None = None,
    pinned_gbps: float = H200_PINNED_GBPS,
    pageable_gbps: float = PAGEABLE_GBPS,
) -> Plan:
    """The plan of a sequential-pipeline calibration run (see the module's docstring for the model).

    `config`: a transformers config, or a path/name for AutoConfig; or give `shape` instead.
    `onload`: where the model runs, 'cuda' or 'cpu' (on a CPU the stores' snapshots are host memory).
    """
    _positive("samples", samples)
    _positive("seq_len", seq_len)
    _positive("batch_size", batch_size)
    if onload not in ("cuda", "cpu"):
        raise ValueError(f"onload must be 'cuda' or 'cpu', got {onload!r}")
    for name, gbps in (("pinned_gbps", pinned_gbps), ("pageable_gbps", pageable_gbps)):
        if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not gbps > 0 or math.isinf(gbps):
            raise ValueError(f"{name} must be a positive number of GB/s, got {gbps!r}")
    if shape is None:
        if config is None:
            raise ValueError("estimate() needs a model config (or a path to one), or shape=Shape(...)")
        if isinstance(config, (str, os.PathLike)):
            transformers = require("transformers", "transformers", "offcache.plan with a model config (--config)")
            config = transformers.AutoConfig.from_pretrained(os.fspath(config))
        shape = shape_of_config(config, dtype)
    elif not shape.weight_bytes_per_layer:
        shape = _formula_weights(dataclasses.replace(shape), dtype)
    size = _itemsize(dtype)
    sizes = _batch_sizes(samples, batch_size)
    n = len(sizes)

    # The cache, simulated: block id -> [bytes, live names]; per batch, name -> block.
    blocks: dict[int, list] = {}
    where: list[dict[str, int]] = [{} for _ in range(n)]
    held = peak = 0
    peaks: list[int] = []
    ids = itertools.count()

    def store(b: int, values: dict[str, int]) -> None:
        nonlocal held, peak
        block = sum(_aligned(v) for v in values.values())
        staging = block if onload == "cpu" else 0  # a CPU source is snapshotted into the arena first
        peak = max(peak, held + block + staging)
        ident = next(ids)
        blocks[ident] = [block, set(values)]
        for name in values:
            where[b][name] = ident
        held += block

    def delete(b: int, names) -> None:
        nonlocal held
        for name in names:
            block = where[b].pop(name)
            blocks[block][1].discard(name)
            if not blocks[block][1]:
                held -= blocks.pop(block)[0]

    inputs = [{"input_ids": b * seq_len * 8, "attention_mask": b * seq_len * 8} for b in sizes]
    for b in range(n):
        store(b, inputs[b])
    input_bytes = sum(sum(v.values()) for v in inputs)
    peaks.append(peak)

    boundaries: list[Boundary] = []
    d2h = input_bytes
    h2d = 2 * input_bytes  # subgraph 0 reads the calibration batch in both passes
    shared_total = 0
    consumed = ["input_ids", "attention_mask"]
    for k in range(shape.layers):  # subgraph k's outputs; the last subgraph (layer L-1 and the head) stores none
        peak = held
        outputs = [_stored(shape, sizes[b], seq_len, size, first=k == 0) for b in range(n)]
        name = "hidden_states" if k == 0 else f"layer_{k - 1}_hidden_states"
        renamed = [{(name if key == "hidden_states" else key): v for key, v in o.items()} for o in outputs]
        for b in range(n):
            store(b, renamed[b])
            delete(b, consumed)
        consumed = [name]
        total = sum(sum(o.values()) for o in outputs)
        first = outputs[0]
        boundaries.append(
            Boundary(
                subgraph=k,
                names=list(renamed[0]),
                hidden_bytes=first["hidden_states"],
                position_bytes=first.get("position_ids", 0) + first.get("rotary_cos", 0) + first.get("rotary_sin", 0),
                mask_bytes=first.get("causal_mask", 0),
                batch_bytes=sum(first.values()),
                total_bytes=total,
                cache_peak_bytes=peak,
            )
        )
        peaks.append(peak)
        d2h += total
        hidden_total = sum(o["hidden_states"] for o in outputs)
        if k == 0:
            shared_total = total - hidden_total  # position ids, mask, rotary: read by every later subgraph
        h2d += 2 * (hidden_total + shared_total)  # subgraph k + 1 reads them in both passes
    cache_peak = max(peaks)
    tiers = _tiers(cache_peak)
    per_layer = max(shape.weight_bytes_per_layer) if shape.weight_bytes_per_layer else 0
    return Plan(
        samples=samples,
        batch_size=batch_size,
        batches=n,
        seq_len=seq_len,
        dtype=str(dtype).replace("torch.", ""),
        onload=onload,
        shape=shape,
        input_bytes=input_bytes,
        boundaries=boundaries,
        cache_peak_bytes=cache_peak,
        weight_bytes_per_layer=per_layer,
        weight_bytes_total=shape.weight_bytes_total,
        tiers=tiers,
        d2h_bytes=d2h,
        h2d_bytes=h2d,
        pinned_gbps=float(pinned_gbps),
        pinned_source=H200_PINNED_SOURCE if pinned_gbps == H200_PINNED_GBPS else "given",
        pageable_gbps=float(pageable_gbps),
        pageable_source=PAGEABLE_SOURCE if pageable_gbps == PAGEABLE_GBPS else "given",
        seconds_pinned=(d2h + h2d) / (pinned_gbps * 1e9),
        seconds_pageable=(d2h + h2d) / (pageable_gbps * 1e9),
    )


def _h(n: int) -> str:
    return f"{n} bytes ({_engine._human(n)})" if n >= 1024 else f"{n} bytes"


def _seconds(t: float) -> str:
    return f"{t:.1f} s" if t >= 1 else f"{t * 1e3:.3f} ms"


def render(p: Plan) -> str:
    """The plan as the text ``python -m offcache.plan`` prints."""
    s, t = p.shape, p.tiers
    out = [
        f"Calibration run: {p.samples} samples x {p.seq_len} tokens, batch size {p.batch_size} ({p.batches} batches), "
        f"{p.dtype}, model on {p.onload}",
        f"Model: {s.layers} layers, hidden {s.hidden_size}, {s.heads} heads ({s.kv_heads} KV) x {s.head_dim}",
        f"Weights: {_h(p.weight_bytes_per_layer)} per layer (largest), {_h(p.weight_bytes_total)} in total",
        f"Calibration set in the cache: {_h(p.input_bytes)}",
        "Per subgraph boundary (stored after the subgraph; per batch, then all batches; the cache's peak meanwhile):",
    ]
    runs: list[list[Boundary]] = []  # consecutive boundaries with the same numbers, printed as one line
    for b in p.boundaries:
        key = (b.hidden_bytes, b.position_bytes, b.mask_bytes, b.total_bytes, b.cache_peak_bytes)
        last = runs[-1][-1] if runs else None
        if last and (last.hidden_bytes, last.position_bytes, last.mask_bytes, last.total_bytes,
                     last.cache_peak_bytes) == key:  # fmt: skip
            runs[-1].append(b)
        else:
            runs.append([b])
    for run in runs:
        b = run[0]
        which = f"subgraph {b.subgraph}" if len(run) == 1 else f"subgraphs {b.subgraph}-{run[-1].subgraph}"
        parts = f"hidden {b.hidden_bytes}"
        if b.position_bytes or b.mask_bytes:
            parts += f" + positions {b.position_bytes} + mask {b.mask_bytes}"
        out.append(
            f"  after {which}: {parts} = {b.batch_bytes} bytes/batch, "
            f"{_h(b.total_bytes)} total; cache peak {_h(b.cache_peak_bytes)}"
        )
    out.append(f"Cache peak: {_h(p.cache_peak_bytes)}")
    disk = f"{t.disk_dir} ({_h(t.disk_free_bytes)} free)" if t.disk_dir else f"none ({t.disk_auto_reason or 'off'})"
    out += [
        f"This machine: memory {_h(t.memory_bytes)} (RAM or cgroup limit); pinned budget {_h(t.pinned_limit_bytes)}, "
        f"host limit {_h(t.host_limit_bytes)}, disk tier {disk}",
        f"  the peak would use: pinned {_h(t.pinned_bytes)}, pageable {_h(t.pageable_bytes)}, disk {_h(t.disk_bytes)}"
        + ("" if t.fits else "  -> DOES NOT FIT: set OFFCACHE_DISK_DIR to a disk with room, or OFFCACHE_HOST_LIMIT"),
        f"Transfers: D2H {_h(p.d2h_bytes)}, H2D {_h(p.h2d_bytes)}",
        f"  at {p.pinned_gbps:g} GB/s pinned: {_seconds(p.seconds_pinned)}   [{p.pinned_source}]",
        f"  at {p.pageable_gbps:g} GB/s pageable: {_seconds(p.seconds_pageable)}   [{p.pageable_source}]",
    ]
    return "\n".join(out)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["kv"]:  # the KV-cache question: one way to ask, python -m offcache.kv size is an alias
        from offcache import kv

        return kv.main(["size", *argv[1:]])
    ap = argparse.ArgumentParser(
        prog="python -m offcache.plan",
        description="What a llm-compressor sequential calibration run will need, before any data moves. "
        "`python -m offcache.plan kv ...` sizes a KV cache instead (as `python -m offcache.kv size`).",
    )
    ap.add_argument("--config", help="a transformers config.json, its folder, or a hub name in the local cache")
    for flag in ("layers", "hidden-size", "heads", "kv-heads", "head-dim", "intermediate-size", "vocab-size"):
        ap.add_argument(f"--{flag}", type=int, help="without --config: the model's size")
    ap.add_argument("--samples", type=int, required=True, help="number of calibration samples")
    ap.add_argument("--seq-len", type=int, required=True, help="tokens per sample (max_seq_length)")
    ap.add_argument("--batch-size", type=int, default=1, help="llm-compressor's batch_size (default 1)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--onload", choices=("cuda", "cpu"), default="cuda", help="where the model runs")
    ap.add_argument("--pinned-gbps", type=float, default=H200_PINNED_GBPS)
    ap.add_argument("--pageable-gbps", type=float, default=PAGEABLE_GBPS)
    ap.add_argument("--json", action="store_true", help="print the Plan as JSON")
    a = ap.parse_args(argv)
    shape = None
    if not a.config:
        missing = [f for f in ("layers", "hidden_size", "heads") if getattr(a, f) is None]
        if missing:
            ap.error("without --config, give " + ", ".join("--" + m.replace("_", "-") for m in missing))
        shape = Shape(
            layers=a.layers,
            hidden_size=a.hidden_size,
            heads=a.heads,
            kv_heads=a.kv_heads or a.heads,
            head_dim=a.head_dim or a.hidden_size // a.heads,
            intermediate_size=a.intermediate_size or 4 * a.hidden_size,
            vocab_size=a.vocab_size or 0,
        )
    try:
        p = estimate(
            a.config, samples=a.samples, seq_len=a.seq_len, dtype=a.dtype, batch_size=a.batch_size,
            onload=a.onload, shape=shape, pinned_gbps=a.pinned_gbps, pageable_gbps=a.pageable_gbps,
        )  # fmt: skip
    except MissingExtraError as exc:
        ap.exit(2, f"{ap.prog}: {exc}\n")  # one line: what to install
    except (ValueError, OSError) as exc:
        ap.error(str(exc))
    if a.json:
        import json

        print(json.dumps(p.to_dict(), indent=1))
    else:
        print(render(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
