"""python -m offcache.bench [--quick] [--out DIR] [--device cuda:0]

Measures offcache side by side with the alternatives and writes
DIR/results.json and PNG plots. On a GPU the figures are absolute; on a
GPU-less host every section runs on the host backend and only the ratios
between implementations measured in the same run mean anything.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

import offcache
from offcache.bench.common import Context, device_info
from offcache.bench.pipeline import run_pipeline
from offcache.bench.plots import plot_all
from offcache.bench.transfer import run_bookkeeping, run_overlap, run_small, run_transfer


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m offcache.bench", description=__doc__.splitlines()[2])
    p.add_argument("section", nargs="?", choices=["all", "kv"], default="all",
                   help="all: transfer, overlap, small, pipeline, pinned; kv: the KV-cache protocol")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="smaller sizes (<2 min on CPU, <1 min on a GPU)")
    p.add_argument("--tiny", action="store_true", help="smallest sizes: checks the harness, not speed")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for results.json and plots")
    p.add_argument("--device", default=None, help="cuda:N (default: cuda:0 if present, else cpu)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = offcache.build_info()["backend"]
    ctx = Context(device=device, quick=args.quick, tiny=args.tiny, backend=backend)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.section == "kv":
        return main_kv(args, ctx)
    results = {
        "device": device_info(device),
        "backend": backend,
        "note": (
            "absolute figures (GPU)"
            if ctx.gpu
            else "host backend on a GPU-less machine: only ratios between rows of this run are meaningful"
        ),
        "command": " ".join(["python -m offcache.bench", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "build_info": offcache.build_info(),
        "torch": torch.__version__,
    }
    sections = [
        ("transfer", run_transfer),
        ("overlap", run_overlap),
        ("small", lambda c: run_small(c) + run_bookkeeping(c)),
        ("pipeline", None),
    ]
    for name, fn in tqdm(sections, desc="offcache.bench", unit="section"):
        if fn is not None:
            results[name] = fn(ctx)
        else:
            results["pipeline"], results["pinned"], results["timeline"] = run_pipeline(ctx)
    results["engine_stats"] = offcache.stats()
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    results["plots"] = plot_all(results, args.out)
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print(summary(results))
    return results


def main_kv(args, ctx: Context) -> dict:
    from offcache.bench.kv import run_kv

    path = args.out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {"device": device_info(ctx.device),
                                                                   "backend": ctx.backend}  # fmt: skip
    results["kv"] = run_kv(ctx)
    results["kv_command"] = " ".join(["python -m offcache.bench", *(sys.argv[1:])])
    path.write_text(json.dumps(results, indent=2, default=str))
    for row in results["kv"]:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    return results


def summary(r: dict) -> str:
    lines = [f"offcache.bench — backend: {r['backend']} — {r['device']['name']} — {r['note']}"]
    top = max(x["bytes"] for x in r["transfer"])
    lines.append(f"transfer at {top >> 20} MiB (GB/s):")
    for d in ("store", "fetch"):
        cells = [f"{x['impl']} {x['gbps']:.2f}" for x in r["transfer"] if x["bytes"] == top and x["direction"] == d]
        lines.append(f"  {d:5}: " + " | ".join(cells))
    duplex = next(x for x in r["overlap"] if x["case"] == "duplex")
    cc = next(x for x in r["overlap"] if x["case"] == "copy_compute")
    lines.append(
        f"overlap: duplex {duplex['ratio_to_one_direction']:.2f}x one direction; "
        f"copy hidden behind compute {cc['fraction_of_copy_hidden']:.0%}"
    )
    lines.append(
        "small (us per tensor): "
        + " | ".join(
            f"{x['impl']} {x['direction']} {x['us_per_tensor']:.2f}" for x in r["small"] if "us_per_tensor" in x
        )
    )
    lines.append(
        "fetch of a 5-tensor batch (us): "
        + " | ".join(
            f"{x['impl']} (offload {x['offload_device']}) {x['us_per_batch']:.1f}"
            for x in r["small"]
            if "us_per_batch" in x
        )
    )
    lines.append("pipeline wall time (s):")
    for x in r["pipeline"]:
        extra = f"  ({x['vs_ideal']:.2f}x ideal)" if "vs_ideal" in x else ""
        lines.append(f"  {x['impl']:30} {x['wall_s']:.3f}{extra}")
    lines.append("pinned reserved/live: " + " | ".join(f"{x['impl']} {x['ratio']:.2f}" for x in r["pinned"]))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
