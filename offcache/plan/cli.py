"""``python -m offcache.plan``: the plan as text, and its command line (offcache.plan computes it)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

from offcache.plan import core as _plan
from offcache.util.extras import MissingExtraError, require
from offcache.util.units import bytes_text as _h
from offcache.util.units import positive_int as _positive_int
from offcache.util.units import seconds_text as _seconds

# The lines whose numbers depend on the machine (its memory, GPU, disk, offcache's configuration);
# every other line is the planner's arithmetic on the model and the run.
MACHINE_LINES = ("This machine:", "  the peak would use:", "  placed:", "  disk tier (this machine", "  weight onloads",
                 "Advice: On this machine", "  in flight:", "  per node:", "Offloaded weights", "  weights placed:",
                 "  activations placed:", "  disk reads:", "  expected disk time:", "  expected peak:",
                 "Advice: With offloaded weights")  # fmt: skip


def render(p: _plan.Plan) -> str:
    """The plan as the text ``python -m offcache.plan`` prints."""
    s, t, w = p.shape, p.tiers, p.weights
    targets = ", ".join(p.sequential_targets) or "the model's decoder layers (llm-compressor's default)"
    out = [
        f"Calibration run: {p.samples} samples x {p.seq_len} tokens, batch size {p.batch_size} ({p.batches} batches), "
        f"{p.dtype}, model on {p.onload}, {p.collator} collator",
        f"Model: {s.layers} layers, hidden {s.hidden_size}, {s.heads} heads ({s.kv_heads} KV) x {s.head_dim}; "
        f"sequential targets: {targets}, {p.targets_per_subgraph} per subgraph",
        "Stored values: " + ("traced from the model (llm-compressor's trace_subgraphs, run on meta tensors)"
                             if p.method == "traced" else f"Llama formula (FALLBACK: {p.method_reason})"),
    ]  # fmt: skip
    out += [f"  note: {n}" for n in p.notes]
    n = p.node
    if n.world_size > 1:
        out.append(
            f"torchrun job: {n.nproc_per_node} ranks per node x {n.nnodes} node{'s' if n.nnodes > 1 else ''} = "
            f"{n.world_size} ranks; each rank caches its share, up to {n.samples_per_rank} of {p.samples} samples "
            "(llm-compressor splits the calibration set): the cache lines below are one rank's"
        )
    out.append(f"Calibration set in the cache: {_h(p.input_bytes)}")
    out.append("Per subgraph (stored after it: per batch, all batches; the cache's peak meanwhile; its weights):")
    runs: list[list[_plan.Boundary]] = []  # consecutive boundaries alike but for the target, printed as one line
    for b in p.boundaries:
        key = (list(b.values.values()), b.batch_bytes, b.total_bytes, b.cache_peak_bytes, b.weight_bytes,
               b.in_flight_bytes)  # fmt: skip
        last = runs[-1][-1] if runs else None
        same = last is not None and last.subgraph > 0 and b.subgraph > 0
        if same and (list(last.values.values()), last.batch_bytes, last.total_bytes, last.cache_peak_bytes,
                     last.weight_bytes, last.in_flight_bytes) == key:  # fmt: skip
            runs[-1].append(b)
        else:
            runs.append([b])
    for run in runs:
        b = run[0]
        which = f"subgraph {b.subgraph} ({b.targets})"
        if len(run) > 1:  # the values' names are the first subgraph's
            which = f"subgraphs {b.subgraph}-{run[-1].subgraph} ({b.targets} .. {run[-1].targets})"
        values = "; ".join(f"{name} {desc}" for name, desc in b.values.items()) if len(b.values) <= 8 else \
            f"{len(b.values)} values ({b.tensors} distinct tensors)"  # fmt: skip
        out.append(
            f"  {which}: {values} = {b.batch_bytes} bytes/batch, {_h(b.total_bytes)} total; "
            f"cache peak {_h(b.cache_peak_bytes)}"
            + (f" (+{_h(b.in_flight_bytes)} in flight)" if b.in_flight_bytes else "")
            + f"; weights {_h(b.weight_bytes)}"
        )
    if w.per_subgraph:
        out.append(f"  last subgraph {len(w.per_subgraph) - 1}: stores nothing; weights {_h(w.per_subgraph[-1])}")
    out.append(f"Cache peak: {_h(p.cache_peak_bytes)}")
    if p.onload == "cpu":  # a CPU model's snapshots are host memory until their copies land
        out.append(
            f"  in flight: up to {_h(p.in_flight_bytes)} more, snapshots of stores whose copies have not landed "
            f"(the stores since the pipeline last fetched one, at most OFFCACHE_MAX_IN_FLIGHT of copies): "
            f"peak bound {_h(p.peak_bound_bytes)}"
        )
    not_walked = max(w.total_bytes - w.walked_bytes, 0)
    line = f"Weights: {_h(w.total_bytes)} in total"
    if not_walked:
        line += f" ({_h(not_walked)} in modules the pipeline does not walk, e.g. a vision tower)"
    out.append(line + f"; largest subgraph {_h(max(w.per_subgraph, default=0))}")
    if p.offload is not None:
        out.append(f"  placed: offloaded by load_offloaded_model (device_map=\"auto_offload\"), host memory "
                   f"{_h(w.ram_bytes)}, disk {_h(w.disk_bytes)}; onloaded per subgraph to {p.onload}: "
                   f"{_h(w.onload_bytes)} ({_h(w.onload_disk_bytes)} from disk)")  # fmt: skip
    elif p.onload == "cpu":
        out.append("  placed: in host memory (the model runs on the CPU: no onloads)")
    elif w.placement == "gpu":
        out.append(f"  placed: all on the GPU, no onloads [GPU {_h(w.gpu_bytes)}, {w.gpu_source}; "
                   f"weights go on it when <= 90% of it (assumed)]")  # fmt: skip
    else:
        out.append(f"  placed: offloaded, host memory {_h(w.ram_bytes)}, disk {_h(w.disk_bytes)}; onloaded per "
                   f"subgraph: {_h(w.onload_bytes)} ({_h(w.onload_disk_bytes)} from disk) [GPU {_h(w.gpu_bytes)}, "
                   f"{w.gpu_source}: they do not fit 90% of it]")  # fmt: skip
    disk = f"{t.disk_dir} ({_h(t.disk_free_bytes)} free)" if t.disk_dir else f"none ({t.disk_auto_reason or 'off'})"
    if n.world_size > 1:
        out.append(
            f"  per node: {n.nproc_per_node} caches in host memory {_h(n.cache_host_bytes)} (disk "
            f"{_h(n.cache_disk_bytes)}), offloaded weights once {_h(n.weight_host_bytes)} (one region shared by "
            f"the node's ranks, at most {_h(n.weight_region_limit_bytes)}; one copy per rank would be "
            f"{_h(n.per_rank_copies_bytes)}): host memory {_h(n.host_bytes)}"
        )
    out += [
        f"This machine: memory {_h(t.memory_bytes)} (RAM or cgroup limit); pinned budget {_h(t.pinned_limit_bytes)}, "
        f"host limit {_h(t.host_limit_bytes)}, disk tier {disk}",
        f"  the peak would use: pinned {_h(t.pinned_bytes)}, pageable {_h(t.pageable_bytes)}, disk {_h(t.disk_bytes)}",
        f"Transfers: D2H {_h(p.d2h_bytes)}, H2D {_h(p.h2d_bytes)}",
        f"  at {p.pinned_gbps:g} GB/s pinned: {_seconds(p.seconds_pinned)}   [{p.pinned_source}]",
        f"  at {p.pageable_gbps:g} GB/s pageable: {_seconds(p.seconds_pageable)}   [{p.pageable_source}]",
        f"  disk tier (this machine's limits): writes {_h(p.disk_write_bytes)}, reads {_h(p.disk_read_bytes)}, "
        f"at {p.disk_write_gbps:g} GB/s write, {p.disk_read_gbps:g} GB/s read: {_seconds(p.seconds_disk)}   "
        f"[{p.disk_source}]",
        f"  weight onloads (host part at {p.pageable_gbps:g} GB/s pageable, disk part at {p.disk_read_gbps:g} GB/s): "
        f"{_seconds(p.seconds_weights)}",
    ]
    if p.offload is not None:
        out += offload_lines(p.offload)
    out += [f"Advice: {a}" for a in p.advice]
    return "\n".join(out)


def offload_lines(o) -> list[str]:
    """The offloaded weights' run under its memory limit (offcache.plan.offload), as text."""
    source = {"given": "given (--memory-limit)"}.get(o.memory_limit_source, o.memory_limit_source + ", this machine's")
    files = f"the checkpoint {o.checkpoint}" if o.checkpoint else "the model's config (no --checkpoint)"
    return [
        f'Offloaded weights (patch_llmcompressor(weights=True), load_offloaded_model(device_map="auto_offload")), '
        f"memory limit {_h(o.memory_limit_bytes)} ({source}), offcache's host limit {_h(o.host_limit_bytes)}:",
        f"  weights placed: {_h(o.cpu_bytes)} on the CPU (the checkpoint's mapping), {_h(o.disk_bytes)} on disk "
        f"(read from the checkpoint's files), of {_h(o.weight_bytes)} in {files}: the CPU's share is {o.why} "
        f"[{o.method}]",
        f"  activations placed: cache peak {_h(o.activation_host_bytes)} in host memory, "
        f"{_h(o.activation_disk_bytes)} on the disk tier",
        f"  disk reads: {_h(o.pass_read_bytes)} per calibration pass (the weights on disk once, "
        f"{_h(o.activation_read_bytes)} of activations); the first pass with the checkpoint out of the page cache "
        f"{_h(o.cold_pass_read_bytes)} (every checkpoint byte once); save_pretrained {_h(o.save_read_bytes)} more "
        "(at most: pages the page cache holds are not read again)",
        f"  expected disk time: {_seconds(o.seconds_per_pass)} per pass, {_seconds(o.seconds_cold_pass)} the first, "
        f"at {o.disk_read_gbps:g} GB/s read, {o.disk_write_gbps:g} GB/s write   [{o.disk_source}]",
        f"  expected peak: {_h(o.expected_peak_bytes)} of anonymous memory (working set {_h(o.working_set_bytes)} "
        f"[{o.working_set_source}], offcache's host limit {_h(o.host_limit_bytes)}, {o.onloads_at_once} x the "
        f"largest subgraph's weights {_h(o.largest_subgraph_bytes)} onloaded); {_h(o.peak_if_rewritten_bytes)} "
        f"where calibration rewrites the CPU's weights (GPTQ): "
        + ("fits the memory limit" if o.fits else "PAST THE MEMORY LIMIT"),
    ]


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _size(text: str) -> int:
    """argparse type: a size such as 1100MiB, 64GiB or bytes (not a percentage)."""
    from offcache import engine as _engine

    if text.strip().endswith("%"):
        raise argparse.ArgumentTypeError(f"give a size (e.g. 1100MiB), not a percentage: {text!r}")
    try:
        value = _engine.parse_size(text, "a size", low=1)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _disk_gbps(results: str) -> tuple[float, float]:
    """(write, read) GB/s of the disk tier that `python -m offcache.bench disk` measured."""
    data = json.loads(Path(results).read_text())
    rows = (data.get("disk") or {}).get("throughput") or []
    got = {}
    for direction in ("store", "fetch"):
        mine = [r for r in rows if r.get("direction") == direction]
        if not mine:
            raise ValueError(
                f"--bench-results {results!r} holds no disk {direction} row: run python -m offcache.bench disk"
            )
        got[direction] = max(mine, key=lambda r: r["bytes"])["offcache_gbps"]
    return got["store"], got["fetch"]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["kv"]:  # the KV-cache question: one way to ask, python -m offcache.kv size is an alias
        from offcache.kv import size as kv

        return kv.main(["size", *argv[1:]])
    ap = argparse.ArgumentParser(
        prog="python -m offcache.plan",
        description="What a llm-compressor sequential calibration run will need, before any data moves. "
        "`python -m offcache.plan kv ...` sizes a KV cache instead (as `python -m offcache.kv size`).",
    )
    model = ap.add_mutually_exclusive_group()
    model.add_argument("--config", help="a transformers config.json, its folder, or a Hub id in the local cache")
    model.add_argument("--model-type", help="transformers' default config of this model type (e.g. gemma2, qwen3_moe)")
    model.add_argument("--checkpoint", metavar="DIR",
                       help="a model's folder (config.json and safetensors files): its config, and with "
                       "--offload-weights the bytes of its tensors")  # fmt: skip
    for flag in ("layers", "hidden-size", "heads", "kv-heads", "head-dim", "intermediate-size", "vocab-size"):
        ap.add_argument(f"--{flag}", type=_positive_int, help="without a config: the model's size (Llama formula)")
    ap.add_argument("--samples", type=_positive_int, required=True, help="number of calibration samples")
    ap.add_argument("--seq-len", type=_positive_int, required=True,
                    help="max_seq_length (truncation collator) or the longest sample (padding collator)")  # fmt: skip
    ap.add_argument("--uniform-lengths", action="store_true", help="every sample has --seq-len tokens: exact")
    ap.add_argument("--batch-size", type=_positive_int, default=1, help="llm-compressor's batch_size (default 1)")
    ap.add_argument("--collator", choices=_plan.COLLATORS, default="truncation", help="llm-compressor's data_collator")
    ap.add_argument("--sequential-targets", nargs="+", metavar="TARGET",
                    help="llm-compressor's sequential_targets (default: decoder layers), e.g. Linear")  # fmt: skip
    ap.add_argument("--targets-per-subgraph", type=_positive_int, default=1,
                    help="llm-compressor's sequential_targets_per_subgraph")  # fmt: skip
    ap.add_argument("--no-propagate-error", action="store_true", help="llm-compressor's propagate_error=False")
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype")
    ap.add_argument("--onload", choices=("cuda", "cpu"), default="cuda", help="where the model runs")
    ap.add_argument(
        "--gpu-gib", type=_positive_float, help="the GPU's memory (default: the visible GPU's, else an H200's)"
    )
    ap.add_argument("--pinned-gbps", type=_positive_float, default=_plan.H200_PINNED_GBPS)
    ap.add_argument("--pageable-gbps", type=_positive_float, default=_plan.PAGEABLE_GBPS)
    disk = ap.add_mutually_exclusive_group()
    disk.add_argument("--disk-gbps", type=_positive_float, help="the disk tier's bandwidth, each direction")
    disk.add_argument("--bench-results", help="results.json of python -m offcache.bench disk: its measured disk tier")
    ap.add_argument("--nproc-per-node", type=_positive_int, metavar="N",
                    help="a torchrun job's ranks per node (default: LOCAL_WORLD_SIZE, else 1): each caches its "
                    "share of the samples; offloaded weights count once per node")  # fmt: skip
    ap.add_argument("--nnodes", type=_positive_int, metavar="M",
                    help="a torchrun job's nodes (default: WORLD_SIZE / LOCAL_WORLD_SIZE, else 1)")  # fmt: skip
    ap.add_argument("--memory-limit", type=_size, metavar="SIZE",
                    help="the run's memory limit, e.g. 1100MiB or 64GiB (default: this process's cgroup limit, "
                    "else RAM): percentages of memory (the default host limit) are of it")  # fmt: skip
    ap.add_argument("--offload-weights", action="store_true",
                    help="the run is patch_llmcompressor(weights=True) with load_offloaded_model(device_map="
                    "'auto_offload'): where its weights and activations live under the memory limit, disk reads "
                    "per pass, their time, the expected peak")  # fmt: skip
    ap.add_argument("--working-set", type=_size, metavar="SIZE",
                    help="with --offload-weights: the process's memory beside offcache and the weights (default: "
                    "measured here, with torch and llm-compressor imported)")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print the Plan as JSON")
    a = ap.parse_args(argv)
    shape = config = None
    if a.model_type:
        try:
            AutoConfig = require("transformers", "transformers", "offcache.plan --model-type").AutoConfig
        except MissingExtraError as exc:
            ap.exit(2, f"{ap.prog}: {exc}\n")  # one line: what to install
        try:
            config = AutoConfig.for_model(a.model_type)
        except ValueError:
            ap.error(f"--model-type {a.model_type!r} is not a transformers model type (e.g. llama, gemma2, qwen3_moe)")
    elif a.config:
        config = a.config
    elif a.checkpoint:
        config = a.checkpoint
    else:
        missing = [f for f in ("layers", "hidden_size", "heads") if getattr(a, f) is None]
        if missing:
            ap.error("without --config, give " + ", ".join("--" + m.replace("_", "-") for m in missing))
        if a.hidden_size % a.heads and a.head_dim is None:
            ap.error(f"--hidden-size {a.hidden_size} is not a multiple of --heads {a.heads}: give --head-dim")
        shape = _plan.Shape(
            layers=a.layers, hidden_size=a.hidden_size, heads=a.heads, kv_heads=a.kv_heads or a.heads,
            head_dim=a.head_dim or a.hidden_size // a.heads,
            intermediate_size=a.intermediate_size or 4 * a.hidden_size, vocab_size=a.vocab_size or 0,
        )  # fmt: skip
    try:
        write = read = a.disk_gbps
        if a.bench_results:
            write, read = _disk_gbps(a.bench_results)
        with contextlib.redirect_stdout(sys.stderr):  # what llm-compressor logs on import is not the plan
            p = _plan.estimate(
                config, samples=a.samples, seq_len=a.seq_len, dtype=a.dtype, batch_size=a.batch_size,
                onload=a.onload, shape=shape, sequential_targets=a.sequential_targets,
                targets_per_subgraph=a.targets_per_subgraph, collator=a.collator,
                propagate_error=not a.no_propagate_error, uniform_lengths=a.uniform_lengths,
                gpu_bytes=None if a.gpu_gib is None else int(a.gpu_gib * _plan.GiB),
                pinned_gbps=a.pinned_gbps, pageable_gbps=a.pageable_gbps, disk_write_gbps=write,
                disk_read_gbps=read, nproc_per_node=a.nproc_per_node, nnodes=a.nnodes, memory_limit=a.memory_limit,
                offload_weights=a.offload_weights, checkpoint=a.checkpoint, working_set=a.working_set,
            )  # fmt: skip
    except MissingExtraError as exc:
        ap.exit(2, f"{ap.prog}: {exc}\n")  # one line: what to install
    except (ValueError, OSError, KeyError) as exc:
        ap.error(str(exc))
    if a.json:
        print(json.dumps(p.to_dict(), indent=1))
    else:
        print(render(p))
    return 0
