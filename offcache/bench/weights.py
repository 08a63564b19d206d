"""Section weights (``python -m offcache.bench weights``): offloaded model weights, onloaded per subgraph.

A stack of S "subgraphs", each L linear layers of hidden size H, whose weights are offloaded
with compressed-tensors' ``offload_module`` (onload device: the benchmark device, offload:
the CPU) and run the sequential pipeline's way: per subgraph a ``disable_offloading()``
context and two passes over B batches. Rows, measured side by side in one run:

- ``compute_only``: the same forwards with the weights resident on the device (the bound);
- ``compressed_tensors``: compressed-tensors' ``CPUCache`` as shipped (a blocking pageable
  ``Tensor.to`` per weight; on a CPU-only host an onload to the CPU is the tensor itself, so
  this row copies nothing there);
- ``offcache``: ``OffcacheCPUCache`` without prefetch (``OFFCACHE_WEIGHT_PREFETCH=0``);
- ``offcache_prefetch``: with the next subgraph's weights prefetched (k=1).

Columns: wall seconds (median of R), wall over compute_only, ``excess_share`` (the share of
wall time above the compute-only bound: time the pipeline waited for weights), host waits for
weights per subgraph, H2D bytes, and prefetch hits/misses. ``raw_pinned`` times a plain pinned
``Tensor.to(non_blocking=True)`` of one subgraph's weights against the engine's fetch of the
same weights. The ``disk_*`` rows do the same with the weights offloaded to disk (a
safetensors file per weight): compressed-tensors' ``DiskCache`` against offcache's without and
with prefetch (the engine's ``fetch_file``: O_DIRECT pieces into pinned bounce slots, each
piece's copy issued as soon as it is read), and a raw sequential read of the same files.

``bars`` (the last row) holds the GPU bars of the weights work: weight H2D >= 90 % of raw
pinned, <= 1 host wait for weights per subgraph with prefetch, and <= 5 % of wall waiting for
weights with prefetch. On a CPU-only host they are reported, not judged (``judged: false``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from contextlib import contextmanager

import torch

import offcache
from offcache.bench.common import Context, bench_disk_dir, env_switch, median, spread


def _shape(ctx: Context) -> dict:
    if ctx.tiny:
        return dict(S=3, L=2, H=128, B=2, T=16, R=1)
    if ctx.gpu:  # bf16: 32 MiB per layer; --quick is sized for the device check's budget
        return dict(S=6, L=2, H=4096, B=4, T=1024, R=2) if ctx.quick else dict(S=8, L=4, H=4096, B=8, T=2048, R=3)
    return dict(S=6, L=2, H=512 if ctx.quick else 1024, B=3, T=64, R=3)


class PipelineSubgraph:
    """What the sequential pipeline uses of a subgraph: forward(model, **inputs), submodules(model)."""

    def __init__(self, layers):
        self.layers = layers

    def forward(self, model, x):
        for layer in self.layers:
            x = torch.nn.functional.linear(x, layer.weight, layer.bias).relu_()
        return x

    def submodules(self, model, recurse=True):
        return list(self.layers)


def model_layers(shape, dtype, device):
    torch.manual_seed(0)
    with torch.device(device):
        return [
            [torch.nn.Linear(shape["H"], shape["H"], dtype=dtype) for _ in range(shape["L"])] for _ in range(shape["S"])
        ]


def _run(ctx: Context, subgraphs, batches):
    from compressed_tensors.offload import disable_offloading

    ctx.sync()
    t0 = time.perf_counter()
    for subgraph in subgraphs:
        with disable_offloading():
            for _pass in range(2):
                for x in batches:
                    subgraph.forward(None, x)
    ctx.sync()
    return time.perf_counter() - t0


@contextmanager
def _env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _offloaded(shape, dtype, device):
    from compressed_tensors.offload import offload_module

    layers = model_layers(shape, dtype, "cpu")
    for sub in layers:
        for layer in sub:
            offload_module(layer, device, torch.device("cpu"))
    return layers


def run_weights(ctx: Context) -> list[dict]:
    import compressed_tensors  # noqa: F401  (ImportError names what is missing)

    from offcache.weights import ct_patch as oc_ct

    shape = _shape(ctx)
    dtype = torch.bfloat16 if ctx.gpu else torch.float32
    S, R = shape["S"], shape["R"]
    weight_bytes = S * shape["L"] * (shape["H"] * shape["H"] + shape["H"]) * dtype.itemsize
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(shape["T"], shape["H"], generator=g).to(ctx.device, dtype) for _ in range(shape["B"])]
    threads = torch.get_num_threads()
    rows: list[dict] = []
    offcache.unpatch_llmcompressor()
    try:
        resident = [PipelineSubgraph(sub) for sub in model_layers(shape, dtype, ctx.device)]
        compute: list[float] = []
        walls: dict[str, list[float]] = {"compressed_tensors": [], "offcache": [], "offcache_prefetch": []}
        stats: dict[str, dict] = {}
        for repeat in range(R + 1):  # interleaved, the bound too; the first round warms up
            wall = _run(ctx, resident, batches)
            if repeat:
                compute.append(wall)
            for impl in walls:
                if impl == "compressed_tensors":
                    oc_ct.unpatch()
                else:
                    oc_ct.patch()
                try:
                    layers = _offloaded(shape, dtype, ctx.device)
                    with _env("OFFCACHE_WEIGHT_PREFETCH", "1" if impl == "offcache_prefetch" else "0"):
                        subgraphs = [PipelineSubgraph(sub) for sub in layers]
                        if impl != "compressed_tensors":
                            subgraphs = oc_ct._wrap_subgraphs(subgraphs)
                        before = offcache.stats()
                        wall = _run(ctx, subgraphs, batches)
                        after = offcache.stats()
                finally:
                    oc_ct.unpatch()
                if repeat:
                    walls[impl].append(wall)
                    stats[impl] = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
                del layers, subgraphs
        del resident
        rows.append({"impl": "compute_only", "wall_s": median(compute), "spread": spread(compute)})
        bound = rows[0]["wall_s"]
        onload_bytes = weight_bytes  # every weight onloaded once per subgraph context
        for impl, ws in walls.items():
            s = stats[impl]
            row = {
                "impl": impl,
                "wall_s": median(ws),
                "spread": spread(ws),
                "vs_compute_only": median(ws) / bound,
                "excess_share": max(0.0, median(ws) - bound) / median(ws),
                "weight_bytes": weight_bytes,
            }
            if impl == "compressed_tensors":
                # CPUCache's onload is a blocking Tensor.to per weight: the host waits for each copy.
                n = S * shape["L"] * 2
                copies = ctx.gpu
                row |= {
                    "h2d_bytes": onload_bytes if copies else 0,
                    "host_waits_per_subgraph": n / S if copies else 0.0,
                    "note": None if copies else "onload to the CPU is the offloaded tensor itself: no copy",
                }
            else:
                row |= {
                    "h2d_bytes": s["h2d_bytes"],
                    "host_waits_per_subgraph": s["weight_host_waits"] / S,
                    "host_wait_s": s["weight_host_wait_seconds"],
                    "prefetch_hits": s["weight_prefetch_hits"],
                    "prefetch_misses": s["weight_prefetch_misses"],
                    "prefetch_skips": s["weight_prefetch_skips"],
                }
            rows.append(row)
        rows.append(_raw_vs_engine(ctx, shape, dtype))
        ctx.partial(rows)
        if env_switch("OFFCACHE_BENCH_WEIGHTS_DISK"):
            rows.extend(_disk(ctx, shape, dtype, bound))
        else:
            rows.append({"impl": "disk", "skipped": "left out by OFFCACHE_BENCH_WEIGHTS_DISK=0"})
        rows.append(_bars(ctx, rows))
    finally:
        torch.set_num_threads(threads)
        offcache.unpatch_llmcompressor()
    for r in rows:
        r.update(shape=shape, dtype=str(dtype).removeprefix("torch."), device=str(ctx.device))
    return rows


def _raw_vs_engine(ctx: Context, shape, dtype) -> dict:
    """One subgraph's weights, H2D: a raw pinned Tensor.to(non_blocking) against the engine's fetch."""
    from offcache import engine as _engine

    n = shape["L"] * 2
    sources = [torch.randn(shape["H"], shape["H"]).to(dtype) for _ in range(n)]
    pinned = [t.pin_memory() if ctx.gpu else t for t in sources]
    stored = _engine.store(sources, torch.device("cpu"))
    for t in stored:
        _engine.wait_stored(t)
    nbytes = sum(t.nbytes for t in sources)
    raw, ours = [], []
    for _ in range(shape["R"] + 2):
        ctx.sync()
        t0 = time.perf_counter()
        out = [t.to(ctx.device, non_blocking=True) for t in pinned] if ctx.gpu else [t.clone() for t in pinned]
        ctx.sync()
        raw.append(time.perf_counter() - t0)
        del out
        t0 = time.perf_counter()
        out, ticket = _engine.fetch(stored, ctx.device, wait=True)
        ctx.sync()
        ours.append(time.perf_counter() - t0)
        del out, ticket
    raw_s, ours_s = median(raw[2:]), median(ours[2:])
    return {
        "impl": "raw_pinned_vs_engine_fetch",
        "bytes": nbytes,
        "raw_gbps": nbytes / raw_s / 1e9,
        "engine_gbps": nbytes / ours_s / 1e9,
        "engine_over_raw": raw_s / ours_s,
        "raw": "pinned Tensor.to(non_blocking=True)" if ctx.gpu else "Tensor.clone() (no GPU)",
    }


def _bars(ctx: Context, rows: list[dict]) -> dict:
    """The weights work's GPU bars, from this run's rows (judged on a GPU only)."""
    by = {r["impl"]: r for r in rows}
    h2d = by["raw_pinned_vs_engine_fetch"]["engine_over_raw"]
    bars = {
        "weight_h2d_over_raw_pinned": (h2d, ">=", 0.90),
        "host_waits_per_subgraph_prefetch": (by["offcache_prefetch"]["host_waits_per_subgraph"], "<=", 1.0),
        "wait_share_prefetch": (by["offcache_prefetch"]["excess_share"], "<=", 0.05),
    }
    if "disk_offcache_prefetch" in by:
        bars["disk_host_waits_per_subgraph_prefetch"] = (
            by["disk_offcache_prefetch"]["host_waits_per_subgraph"],
            "<=",
            1.0,
        )
    row: dict = {"impl": "bars", "judged": ctx.gpu}
    for name, (value, op, bar) in bars.items():
        ok = value >= bar if op == ">=" else value <= bar
        row[name] = {"value": value, "bar": f"{op} {bar:g}", "pass": ok if ctx.gpu else None}
    return row


def _disk(ctx: Context, shape, dtype, bound: float) -> list[dict]:
    """Weights on disk (a safetensors file per weight, as DiskCache writes them): compressed-tensors'
    DiskCache against offcache's without and with prefetch, and a raw sequential read of the files."""
    from compressed_tensors.offload import offload_module

    from offcache.weights import ct_patch as oc_ct

    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(shape["T"], shape["H"], generator=g).to(ctx.device, dtype) for _ in range(shape["B"])]
    impls = ("disk_compressed_tensors", "disk_offcache", "disk_offcache_prefetch")
    walls: dict[str, list[float]] = {impl: [] for impl in impls}
    stats: dict[str, dict] = {}
    reads: list[float] = []
    nbytes = 0
    for repeat in range(shape["R"] + 1):  # interleaved; the first round warms up (and the page cache)
        for impl in impls:
            folder = tempfile.mkdtemp(prefix="offcache-bench-weights-", dir=bench_disk_dir())
            try:
                if impl != "disk_compressed_tensors":
                    oc_ct.patch()
                layers = model_layers(shape, dtype, "cpu")
                for sub in layers:
                    for layer in sub:
                        offload_module(layer, ctx.device, "disk", offload_dir=folder)
                subgraphs = [PipelineSubgraph(sub) for sub in layers]
                with _env("OFFCACHE_WEIGHT_PREFETCH", "1" if impl.endswith("prefetch") else "0"):
                    if impl != "disk_compressed_tensors":
                        subgraphs = oc_ct._wrap_subgraphs(subgraphs)
                    before = offcache.stats()
                    wall = _run(ctx, subgraphs, batches)
                    after = offcache.stats()
                if repeat:
                    walls[impl].append(wall)
                    stats[impl] = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
                if impl == "disk_compressed_tensors":
                    files = sorted(os.path.join(folder, f) for f in os.listdir(folder))
                    nbytes = sum(os.path.getsize(f) for f in files)
                    t0 = time.perf_counter()
                    for f in files:
                        with open(f, "rb") as fh:
                            while fh.read(1 << 24):
                                pass
                    if repeat:
                        reads.append(time.perf_counter() - t0)
                del layers, subgraphs
            finally:
                oc_ct.unpatch()
                shutil.rmtree(folder, ignore_errors=True)
    rows = []
    for impl in impls:
        wall = median(walls[impl])
        row = {
            "impl": impl,
            "wall_s": wall,
            "spread": spread(walls[impl]),
            "vs_compute_only": wall / bound,
            "excess_share": max(0.0, wall - bound) / wall,
            "file_bytes": nbytes,
        }
        if impl != "disk_compressed_tensors":
            s = stats[impl]
            row |= {
                "h2d_bytes": s["h2d_bytes"],
                "host_waits_per_subgraph": s["weight_host_waits"] / shape["S"],
                "host_wait_s": s["weight_host_wait_seconds"],
                "prefetch_hits": s["weight_prefetch_hits"],
                "prefetch_misses": s["weight_prefetch_misses"],
                "file_fetches": s["file_fetches"],
                "file_read_bytes": s["file_read_bytes"],
                "file_cached_reads": s["file_cached_reads"],
                "file_buffered_reads": s["file_buffered_reads"],
            }
        rows.append(row)
    rows.append(
        {
            "impl": "disk_raw_sequential_read",
            "wall_s": median(reads),
            "gbps": nbytes / median(reads) / 1e9,
            "note": "the same files, read in order right after they were written (the page cache serves them)",
        }
    )
    return rows


def summary_lines(rows: list[dict]) -> list[str]:
    lines = ["weights (offloaded, per-subgraph onload; wall s, x compute-only, host waits/subgraph, H2D MiB):"]
    for r in rows:
        if "vs_compute_only" in r:
            waits = r.get("host_waits_per_subgraph")
            h2d = r.get("h2d_bytes")
            lines.append(
                f"  {r['impl']:24} {r['wall_s']:.3f}  {r['vs_compute_only']:.2f}x  "
                f"{'-' if waits is None else f'{waits:.2f}'}  {'-' if h2d is None else f'{h2d / 2**20:.1f}'}"
            )
        elif r["impl"] == "compute_only":
            lines.append(f"  {'compute_only':24} {r['wall_s']:.3f}")
        elif r["impl"] == "bars":
            judged = "" if r["judged"] else " (reported, not judged: no GPU)"
            cells = []
            for name, b in r.items():
                if isinstance(b, dict) and "bar" in b:
                    verdict = "" if b["pass"] is None else (" ok" if b["pass"] else " MISSED")
                    cells.append(f"{name} {b['value']:.2f} ({b['bar']}){verdict}")
            lines.append(f"  bars{judged}: " + "; ".join(cells))
        elif r["impl"] == "raw_pinned_vs_engine_fetch":
            lines.append(
                f"  weight H2D: engine {r['engine_gbps']:.2f} GB/s vs raw {r['raw_gbps']:.2f} GB/s "
                f"({r['engine_over_raw']:.0%})"
            )
        elif "wall_s" in r:
            lines.append(f"  {r['impl']:24} {r['wall_s']:.3f}")
    return lines
