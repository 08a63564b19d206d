"""python -m offcache.bench [SECTION ...] [--quick] [--tiny] [--out DIR] [--device cuda:N]

Measures offcache side by side with the alternatives and writes
DIR/results.json and PNG plots. On a GPU the figures are absolute; on a
GPU-less host every section runs on the host backend and only the ratios
between implementations measured in the same run mean anything.

Sections: all (transfer, overlap, small, pipeline, kv), transfer, overlap,
small, pipeline (with pinned and timeline), kv, soak, oneshot, disk (the disk
tier; its folder is OFFCACHE_BENCH_DISK_DIR, else the temp folder), weights
(compressed-tensors' offloaded weights: its CPUCache against offcache's; with --ranks N,
under torch.distributed: N local ranks, its DistributedCPUCache against offcache's node-shared
region and per-rank copies, in results.json's "weights_ranks"), hostwork (host instructions per
update() against llm-compressor's, counted by valgrind's callgrind), pastram (llm-compressor's oneshot
of a checkpoint past a memory cgroup's limit, alone and with offcache's weights=True, sampled as it runs:
DIR/pastram.{json,md,png}; needs root and a memory cgroup, and exits non-zero where none can be made). Each section
merges its results into DIR/results.json, keeping what earlier runs wrote there,
and records its command, date, device and build under "runs"; the plots are
redrawn from everything the file holds.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from pathlib import Path

import torch
from tqdm import tqdm

import offcache
from offcache.bench.common import (
    Context,
    bench_disk_dir,
    device_info,
    env_choice,
    env_switch,
    load_results,
    run_info,
    save_results,
)

ALL = ("transfer", "overlap", "small", "pipeline", "kv")
SECTIONS = (*ALL, "soak", "oneshot", "disk", "weights", "hostwork", "pastram")
# The results.json keys each section writes.
KEYS = {"pipeline": ("pipeline", "pinned", "timeline")}
# Sections that measure a peer: (the package, the offcache extra that installs it).
NEEDS = {"kv": ("transformers", "kv"), "oneshot": ("llmcompressor", "llmcompressor"),
         "weights": ("llmcompressor", "llmcompressor"), "pastram": ("llmcompressor", "llmcompressor")}  # fmt: skip


def missing_peer(name: str) -> str:
    """Why section `name` cannot run here ('' when it can): its peer package is not installed."""
    if name not in NEEDS:
        return ""
    package, extra = NEEDS[name]
    if not missing_module(package):
        return ""
    return f"section {name} skipped: it needs {package}, which is not installed: pip install 'offcache[{extra}]'"


def missing_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def prog() -> str:
    """How this command was called: the console script's name, else python -m offcache.bench."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("offcache-bench") else "python -m offcache.bench"


def parse_args(argv=None) -> argparse.Namespace:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog=prog(), description=doc[1], epilog=doc[2])
    p.add_argument("sections", nargs="*", metavar="SECTION", choices=("all", *SECTIONS), default="all",
                   help="all (default), " + ", ".join(SECTIONS))  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help="smaller sizes (about 2 min on an idle 2-core CPU; longer on a busy one)")  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="smallest sizes: checks the harness, not speed")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for results.json and plots")
    p.add_argument("--device", default=None, help="cuda:N (default: cuda:0 if present, else cpu)")
    p.add_argument("--ops", type=int, default=None, help="soak: operations (default 100000; --quick 30000)")
    p.add_argument("--ranks", type=int, default=None, metavar="N",
                   help="weights: run it under torch.distributed with N local ranks (gloo; N >= 2)")  # fmt: skip
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.ranks is not None:
        if args.ranks < 2:
            p.error(f"--ranks must be >= 2 (the ranks of one node), got {args.ranks}")
        if "weights" not in sections_of(args):
            p.error("--ranks applies to the weights section only: python -m offcache.bench weights --ranks N")
    for check in (lambda: env_switch("OFFCACHE_BENCH_ONESHOT_WEIGHTS"), bench_disk_dir, _check_workload_settings):
        try:  # a garbage setting stops the run before it starts, not in the section that reads it
            check()
        except ValueError as e:
            p.error(str(e))
    args.command = " ".join([prog(), shlex.join(sys.argv[1:] if argv is None else argv)]).strip()
    return args


def _check_workload_settings() -> None:
    """The settings that cut a section's workload (the device check's), checked before any section runs."""
    from offcache.bench.oneshot import repeats_for
    from offcache.bench.weights_ranks import IMPLS

    env_switch("OFFCACHE_BENCH_WEIGHTS_DISK")
    if not missing_module("transformers"):  # without it the kv section is skipped, and its module needs it
        from offcache.bench.kv import CASES

        env_choice("OFFCACHE_BENCH_KV_CASES", CASES)
    env_choice("OFFCACHE_BENCH_RANKS_IMPLS", IMPLS)
    repeats_for(None)


def sections_of(args: argparse.Namespace) -> list[str]:
    given = [args.sections] if isinstance(args.sections, str) else args.sections  # the default is "all"
    names = [n for s in given for n in (ALL if s == "all" else (s,))]
    return list(dict.fromkeys(names))  # in order, once each


def run_section(name: str, ctx: Context, args: argparse.Namespace) -> dict:
    """Run one section; returns the results.json keys it measured."""
    if name == "transfer":
        from offcache.bench.transfer import run_store_reuse, run_transfer

        out = {"transfer": run_transfer(ctx)}
        if not ctx.gpu and ctx.backend == "host":
            out["store_reuse"] = run_store_reuse(ctx)
        return out
    if name == "overlap":
        from offcache.bench.transfer import run_overlap

        return {"overlap": run_overlap(ctx)}
    if name == "small":
        from offcache.bench.transfer import run_bookkeeping, run_small

        return {"small": run_small(ctx) + run_bookkeeping(ctx)}
    if name == "pipeline":
        from offcache.bench.pipeline import run_pipeline

        return dict(zip(KEYS["pipeline"], run_pipeline(ctx)))
    if name == "kv":
        from offcache.bench.kv import run_kv

        return {"kv": run_kv(ctx)}
    if name == "soak":
        from offcache.bench.soak import run_soak

        return {"soak": run_soak(ctx, args.ops)}
    if name == "oneshot":
        from offcache.bench.oneshot import run_oneshot

        return {"oneshot": run_oneshot(ctx)}
    if name == "hostwork":
        from offcache.bench.host_work import run_host_work

        return {"hostwork": run_host_work(ctx)}
    if name == "disk":
        from offcache.bench.disk import run_disk

        return {"disk": run_disk(ctx)}
    if name == "pastram":
        from offcache.bench.pastram import run_pastram

        measured = run_pastram(ctx, args.out, args.command)
        runs = [{k: v for k, v in r.items() if k != "samples"} for r in measured["runs"]]
        return {"pastram": {**measured, "runs": runs}}  # the samples are in DIR/pastram.json
    if name == "weights" and getattr(args, "ranks", None):
        from offcache.bench.weights_ranks import run_weights_ranks

        return {"weights_ranks": run_weights_ranks(ctx, args.ranks)}
    if name == "weights":
        from offcache.bench.weights import run_weights

        return {"weights": run_weights(ctx)}
    raise ValueError(f"unknown section {name!r}")


def _run_key(name: str, args: argparse.Namespace) -> str:
    """The name a section's run is recorded under ("weights_ranks" for weights --ranks N)."""
    return "weights_ranks" if name == "weights" and getattr(args, "ranks", None) else name


def _save_partial(path: Path, key: str, rows: list[dict], ctx: Context, command: str) -> None:
    """The rows of section `key` measured so far, into results.json at once, marked partial in its run
    (the section's full rows replace them when it ends): a run killed at a deadline keeps them."""
    results = load_results(path)
    results[key] = rows
    results.setdefault("runs", {})[key] = {**run_info(ctx, command), "partial": True}
    save_results(path, results)


def run(args: argparse.Namespace) -> dict:
    """Run the sections `args` names, merge them into args.out/results.json, draw the plots."""
    device = torch.device(args.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = offcache.build_info()["backend"]
    ctx = Context(device=device, quick=args.quick, tiny=args.tiny, backend=backend)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    names = sections_of(args)
    skipped = {}
    for name in tqdm(names, desc="offcache.bench", unit="section", disable=len(names) < 2):
        why = missing_peer(name)
        if why:
            print(why, file=sys.stderr, flush=True)
            skipped[name] = why
            continue
        key = _run_key(name, args)
        ctx.checkpoint = lambda rows, key=key: _save_partial(path, key, rows, ctx, args.command)
        measured = run_section(name, ctx, args)
        ctx.checkpoint = None
        results = load_results(path)  # re-read: another run may have added sections meanwhile
        results.update(measured)
        results.get("skipped", {}).pop(name, None)
        results.setdefault("runs", {})[key] = run_info(ctx, args.command)
        results.update(
            device=device_info(device),
            backend=backend,
            note=(
                "absolute figures (GPU)"
                if ctx.gpu
                else "host backend on a GPU-less machine: only ratios between rows of this run are meaningful"
            ),
            engine_stats=offcache.stats(),
        )
        save_results(path, results)
    results = load_results(path)
    if skipped:
        results.setdefault("skipped", {}).update(skipped)
    results.setdefault("device", device_info(device))
    results.setdefault("backend", backend)
    if missing_module("matplotlib"):
        why = "plots not drawn: they need matplotlib, which is not installed: pip install 'offcache[bench]'"
        print(why, file=sys.stderr, flush=True)
        results["plots"] = []
    else:
        from offcache.bench.plots import plot_all

        results["plots"] = plot_all(results, args.out)
    save_results(path, results)
    results["sections_run"] = [n for n in names if n not in skipped]
    results["sections_skipped"] = skipped
    return results


def main(argv=None) -> int:
    """The `offcache-bench` console script and `python -m offcache.bench`: 0 on success."""
    results = run(parse_args(argv))
    print(summary(results, results["sections_run"]))
    if "pastram" in results["sections_run"] and (results.get("pastram") or {}).get("no_cgroup"):
        return 1  # nothing was measured: said in the summary
    return 0


def summary(r: dict, names=SECTIONS) -> str:
    """A few lines per section in `names` that `r` holds."""
    lines = [f"offcache.bench — backend: {r['backend']} — {r['device']['name']} — {r.get('note', '')}"]
    lines += list(r.get("sections_skipped", {}).values())
    if "transfer" in names and r.get("transfer"):
        top = max(x["bytes"] for x in r["transfer"])
        lines.append(f"transfer at {top >> 20} MiB (GB/s):")
        for d in ("store", "fetch"):
            cells = [f"{x['impl']} {x['gbps']:.2f}" for x in r["transfer"] if x["bytes"] == top and x["direction"] == d]
            lines.append(f"  {d:5}: " + " | ".join(cells))
        if r.get("store_reuse"):
            u = r["store_reuse"]
            lines.append(
                f"store-and-drop x{u['stores'] + 1} of {u['bytes'] >> 20} MiB, copies slowed: "
                f"{u['chunks_made_after_first']} chunks made after the first, {u['blocks_reused_in_order']} "
                f"blocks reused in stream order, peak pinned {u['peak_pinned_reserved_over_bytes']}x the value"
            )
    if "overlap" in names and r.get("overlap"):
        duplex = next(x for x in r["overlap"] if x["case"] == "duplex")
        cc = next(x for x in r["overlap"] if x["case"] == "copy_compute")
        lines.append(
            f"overlap: duplex {duplex['ratio_to_one_direction']:.2f}x one direction; "
            f"copy hidden behind compute {cc['fraction_of_copy_hidden']:.0%}"
        )
    if "small" in names and r.get("small"):
        small = [x for x in r["small"] if "us_per_tensor" in x]
        lines.append(
            "small (us per tensor): "
            + " | ".join(f"{x['impl']} {x['direction']} {x['us_per_tensor']:.2f}" for x in small)
        )
        batch = [x for x in r["small"] if x.get("direction") == "fetch_batch_of_5"]
        lines.append(
            "fetch of a 5-tensor batch (us): "
            + " | ".join(f"{x['impl']} (offload {x['offload_device']}) {x['us_per_batch']:.1f}" for x in batch)
        )
        update = [x for x in r["small"] if x.get("direction") == "update_batch_of_5"]
        if update:
            lines.append(
                "update of a 5-tensor batch, host CPU (us, all threads): "
                + " | ".join(f"{x['impl']} {x['cpu_us_per_batch']:.1f}" for x in update)
            )
    if "hostwork" in names and r.get("hostwork"):
        work = [f"{x['impl']} {x['update_instructions_per_batch']:.0f}" for x in r["hostwork"]
                if "update_instructions_per_batch" in x]  # fmt: skip
        ratio = [f" ({x['ratio_to_llmcompressor']:.2f}x llm-compressor's)" for x in r["hostwork"]
                 if "ratio_to_llmcompressor" in x]  # fmt: skip
        lines.append("host instructions per update() of a 5-tensor batch, beyond making it: "
                     + " | ".join(work) + "".join(ratio))  # fmt: skip
    if "pipeline" in names and r.get("pipeline"):
        lines.append("pipeline wall time (s):")
        for x in r["pipeline"]:
            extra = f"  ({x['vs_ideal']:.2f}x ideal)" if "vs_ideal" in x else ""
            lines.append(f"  {x['impl']:30} {x['wall_s']:.3f}{extra}")
        lines.append("pinned reserved/live: " + " | ".join(f"{x['impl']} {x['ratio']:.2f}" for x in r["pinned"]))
        pin = [f"{x['impl']} {x['pinning_s_per_gib']:.3f}" for x in r["pinned"] if x.get("pinning_s_per_gib")]
        if pin:
            lines.append("seconds per GiB to make pinned memory: " + " | ".join(pin))
    if "kv" in names and r.get("kv"):
        lines.append("kv decode (tokens/s; tokens equal to DynamicCache, or StaticCache for static rows):")
        for x in r["kv"]:
            if x.get("completed"):
                equal = x.get("equal_to_static", x.get("equal_to_dynamic"))
                lines.append(f"  {x['case']:15} {x['impl']:24} {x['decode_tokens_per_s_median'] or 0:9.1f}  {equal}")
                if x.get("per_layer_step"):
                    c = x["per_layer_step"]
                    lines.append(
                        f"  {'':15} per layer-step: {c['h2d_copies']:.2f} H2D copies, {c['output_allocations']:.2f} "
                        f"output allocations, D2H {c['d2h_bytes_over_new']:.2f}x the new tokens' bytes "
                        f"({c['host_copy_bytes_over_new']:.2f}x of it host to host), "
                        f"{c['pinned_chunks_made']} pinned chunks made"
                    )
            else:
                lines.append(f"  {x['case']:15} {x['impl']:24} {x.get('error') or x.get('note') or 'not run'}")
    if "soak" in names and r.get("soak"):
        from offcache.bench.soak import describe

        lines.append(describe(r["soak"]))
    if "oneshot" in names and r.get("oneshot"):
        from offcache.bench.oneshot import describe

        lines.append(describe(r["oneshot"]))
    if "disk" in names and r.get("disk"):
        from offcache.bench.disk import summary_lines

        lines.extend(summary_lines(r["disk"]))
    if "weights" in names and r.get("weights"):
        from offcache.bench import weights

        lines.extend(weights.summary_lines(r["weights"]))
    if "pastram" in names and r.get("pastram"):
        from offcache.bench import pastram

        lines.extend(pastram.summary_lines(r["pastram"]))
    if "weights" in names and r.get("weights_ranks"):
        from offcache.bench import weights_ranks

        lines.extend(weights_ranks.summary_lines(r["weights_ranks"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
