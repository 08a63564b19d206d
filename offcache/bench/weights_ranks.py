"""``python -m offcache.bench weights --ranks N``: offloaded weights under torch.distributed, N local ranks.

N processes (``torch.multiprocessing`` spawn, one gloo group on localhost, the environment
torchrun gives: RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK=0) each load the same stack of S
"subgraphs" of L linear layers (hidden H) with compressed-tensors' ``offload_module`` (offload:
the CPU; onload: the benchmark device, ``cuda:rank % GPUs`` on a GPU machine), the source rank
holding the weights and the others meta tensors, as llm-compressor's distributed loading does.
Rows, measured one after the other in the same processes:

- ``compressed_tensors``: its ``DistributedCPUCache`` (a ``/dev/shm`` file, a broadcast and a
  barrier per tensor; a pageable onload). Left out, with the reason, where ``/dev/shm`` has no
  room for the weights.
- ``offcache``: ``NodeSharedCPUCache`` (one memfd region per node, registered once; an onload is
  an engine fetch from it; the pipeline prefetches the next subgraph).
- ``per_rank``: every rank its own copy in its own pinned arena (``OffcacheCPUCache``): what a
  user without a node-shared class pays, N copies per node.
- ``offcache_sliced``: ``NodeSharedCPUCache`` with ``OFFCACHE_NODE_ONLOAD=sliced`` (each rank
  fetches 1/N of a prefetch from the region, the ranks all-gather it: offcache/weights/node/sliced.py).
  Measured on the CPU (gloo, host backend); on a GPU machine it is a row saying it needs N GPUs and
  NCCL (this benchmark's ranks share the GPUs over gloo).

Columns:

- node host bytes: PSS (``/proc/<pid>/smaps_rollup``: a page shared by k processes counts 1/k in
  each) of anonymous and shared memory (``Pss_Anon + Pss_Shmem``; offcache.bench.ranks) gained
  by each rank from before the model was built to after it was offloaded, summed over the
  ranks, against the model's weight bytes. The ranks run with ``MALLOC_MMAP_THRESHOLD_=65536``
  so that freed tensors go back to the system at once, and read it after a garbage collection,
  ``offcache.empty_cache()`` and ``malloc_trim``.
- load and pinning in s/GiB of weights: the offload of every module, the slowest rank's wall
  time (``setup_s``: offcache's region set-up, once); pinning: the engine's registration
  (``shared_register_seconds``) or arena chunk (``chunk_seconds``) seconds summed over the ranks.
- onload GB/s per rank: every subgraph's weights onloaded under ``disable_offloading()``, no
  prefetch, synchronised; ``raw_gbps``: the same bytes by a pinned ``Tensor.to(non_blocking)``
  on a GPU (a ``clone()`` on a CPU).
- collectives per loaded module and tensor, per subgraph of the pipeline: every call of
  ``torch.distributed``'s broadcast_object_list, all_gather_object, barrier, broadcast,
  all_gather, all_reduce, ... made in the ranks while loading / while running, counted by
  wrapping those functions (the benchmark's own barriers are not counted); and those of one
  more module holding 16 tensors, which shows what grows with the tensors and what does not.
- pipeline wall: the sequential pipeline's way, per subgraph a ``disable_offloading()`` context
  and two passes over B batches (each rank its own batches, as in data-parallel calibration),
  the second pass's outputs the next subgraph's inputs; offcache's rows prefetch the next
  subgraph (k=1). The slowest rank's median of R; ``checksums``: every rank's final outputs,
  equal across the rows when the weights onloaded are.

``goals`` (the last row): the issue's ratios. Host bytes and collective counts are judged
everywhere; the timing goals only on a GPU (``judged``).
"""

from __future__ import annotations

import gc
import os
import time
from collections import Counter
from contextlib import contextmanager

import torch

import offcache
from offcache.bench.common import Context, env_choice, median, spread
from offcache.bench.ranks import CollectiveCounter, pss_bytes, settle, shm_free_bytes, spawn

IMPLS = ("compressed_tensors", "offcache", "per_rank", "offcache_sliced")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WIDE = 16  # tensors of the one wide module whose load's collectives are counted apart


def _shape(ctx: Context) -> dict:
    if ctx.tiny:  # large enough that the weights, not the interpreter, dominate the PSS
        return dict(S=4, L=2, H=1024, B=2, T=16, R=1)
    if ctx.gpu:  # bf16: 32 MiB per layer
        return dict(S=6, L=2, H=4096, B=4, T=512, R=2) if ctx.quick else dict(S=8, L=4, H=4096, B=8, T=2048, R=3)
    return dict(S=6, L=2, H=1024, B=2, T=32, R=2) if ctx.quick else dict(S=8, L=2, H=2048, B=2, T=64, R=3)


def weight_bytes_of(shape: dict, dtype: torch.dtype) -> int:
    return shape["S"] * shape["L"] * (shape["H"] * shape["H"] + shape["H"]) * dtype.itemsize


# --- the parent: start the ranks, aggregate ------------------------------------------------------


def run_weights_ranks(ctx: Context, ranks: int, timeout_s: float | None = None) -> list[dict]:
    """Start `ranks` local ranks, measure every row in them, and return the rows (see the docstring)."""
    import compressed_tensors  # noqa: F401  (ImportError names what is missing)

    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        raise ValueError(f"--ranks must be an integer >= 2 (the ranks of one node), got {ranks!r}")
    shape = _shape(ctx)
    dtype = torch.bfloat16 if ctx.gpu else torch.float32
    weight_bytes = weight_bytes_of(shape, dtype)
    impls, left_out = list(IMPLS), {}
    wanted = env_choice("OFFCACHE_BENCH_RANKS_IMPLS", IMPLS)  # the device check runs offcache's alone
    for impl in [i for i in impls if i not in wanted]:
        impls.remove(impl)
        left_out[impl] = "left out by OFFCACHE_BENCH_RANKS_IMPLS"
    free = shm_free_bytes()
    if free is not None and free < 1.2 * weight_bytes and "compressed_tensors" in impls:
        impls.remove("compressed_tensors")
        left_out["compressed_tensors"] = (
            f"/dev/shm has {free} bytes free; compressed-tensors' DistributedCPUCache needs the weights' "
            f"{weight_bytes} bytes there (a file per tensor)"
        )
    gpus = torch.cuda.device_count() if ctx.gpu else 0
    if ctx.gpu and "offcache_sliced" in impls:
        impls.remove("offcache_sliced")
        left_out["offcache_sliced"] = (
            f"needs {ranks} GPUs (one per rank) and NCCL for its all-gather; this run: {gpus} GPU(s), the ranks "
            "on gloo: not measured"
        )
    spec = dict(shape=shape, dtype=str(dtype).removeprefix("torch."), quick=ctx.quick, tiny=ctx.tiny,
                impls=impls, timeout_s=timeout_s or (300 if ctx.tiny else 1800))  # fmt: skip
    devices = [f"cuda:{r % gpus}" if gpus else "cpu" for r in range(ranks)]
    results = spawn(ranks, _measure, spec, devices, spec["timeout_s"] + 60)
    rows = _rows(results, impls, shape, weight_bytes)
    for impl, why in left_out.items():
        rows.insert(0, {"impl": impl, "skipped": why})
    rows.append(_goals(ctx, rows))
    note = f"{ranks} ranks on {gpus} GPU(s)" if gpus else f"{ranks} ranks, host backend (no GPU)"
    for r in rows:
        r.update(ranks=ranks, shape=shape, dtype=spec["dtype"], devices=devices, note=note)
    return rows


def _gib(n: int) -> float:
    return n / 2**30


def _rows(results: list[dict], impls: list[str], shape: dict, weight_bytes: int) -> list[dict]:
    S, modules = shape["S"], shape["S"] * shape["L"]
    tensors = modules * 2  # weight and bias
    rows = []
    for impl in impls:
        per = [r["impls"][impl] for r in results]
        load = per[0]["load_collectives"]
        run = per[0]["pipeline_collectives"]
        pss = [p["pss_loaded"] for p in per]
        node_pss = None if None in pss else sum(pss)
        onload = [weight_bytes / p["onload_s"] / 1e9 if p["onload_s"] > 0 else float("inf") for p in per]
        raw = [r["raw_gbps"] for r in results]
        load_s = max(p["load_s"] for p in per)
        setup_s = max(p.get("setup_s", 0.0) for p in per)
        pin_s = sum(p["pin_s"] for p in per)
        wall = max(median(p["walls"]) for p in per)
        row = {
            "impl": impl,
            "cache_class": per[0]["cache_class"],
            "weight_bytes": weight_bytes,
            "node_pss_bytes": node_pss,
            "pss_over_weights": None if node_pss is None else node_pss / weight_bytes,
            "rank_pss_bytes": pss,
            "node_pss_after_pipeline_bytes": None
            if None in [p["pss_after"] for p in per]
            else sum(p["pss_after"] for p in per),  # fmt: skip
            "setup_s": setup_s,
            "load_s": load_s,
            "setup_and_load_s_per_gib": (setup_s + load_s) / _gib(weight_bytes),
            "pin_s": pin_s,
            "pin_s_per_gib": pin_s / _gib(weight_bytes) if impl != "compressed_tensors" else None,
            "onload_gbps_per_rank": onload,
            "raw_gbps_per_rank": raw,
            "onload_over_raw": min(o / r for o, r in zip(onload, raw)),
            "onload_copies": per[0]["onload_copies"],
            "setup_collectives": per[0].get("setup_collectives", {}),
            "load_collectives": load,
            "collectives_per_module": sum(load.values()) / modules,
            "collectives_per_tensor": sum(load.values()) / tensors,
            "barriers_per_module": load.get("barrier", 0) / modules,
            "barriers_per_tensor": load.get("barrier", 0) / tensors,
            f"collectives_{WIDE}_tensor_module": sum(per[0]["wide_collectives"].values()),
            "pipeline_collectives": run,
            "collectives_per_subgraph": sum(run.values()) / (S * per[0]["runs"]),
            "collectives_same_on_every_rank": all(
                p["load_collectives"] == load and p["pipeline_collectives"] == run for p in per
            ),
            "pipeline_wall_s": wall,
            "pipeline_spread": max(spread(p["walls"]) for p in per),
            "checksums": [p["checksum"] for p in per],
            "engine": {k: sum(p["engine"].get(k, 0) for p in per) for k in per[0]["engine"]},
        }
        if "region" in per[0]:
            row["region"] = per[0]["region"]
            row["region_over_weights"] = per[0]["region"].get("used_bytes", 0) / weight_bytes
        rows.append(row)
    base = next((r for r in rows if r["impl"] == "compressed_tensors"), None)
    full = next((r for r in rows if r["impl"] == "offcache"), None)
    for r in rows:
        if r["impl"] == "offcache_sliced" and full is not None:
            r["same_results_as_offcache"] = r["checksums"] == full["checksums"]
        if base is not None:
            r["pipeline_vs_compressed_tensors"] = r["pipeline_wall_s"] / base["pipeline_wall_s"]
            r["load_vs_compressed_tensors"] = (r["setup_s"] + r["load_s"]) / base["load_s"]
    return rows


def _goals(ctx: Context, rows: list[dict]) -> dict:
    """The issue's goals, from this run's rows: bytes and counts judged everywhere, times on a GPU."""
    by = {r["impl"]: r for r in rows if "skipped" not in r}
    ours = by.get("offcache")
    out: dict = {"impl": "goals", "judged_timing": ctx.gpu}
    if ours is None:
        return out
    goals = {
        "node_pss_over_weights": (ours["pss_over_weights"], "<=", 1.05, True),
        "region_over_weights": (ours.get("region_over_weights"), "<=", 1.05, True),
        "setup_and_pinning_s_per_gib": (
            (ours["setup_s"] + ours["pin_s"]) / _gib(ours["weight_bytes"]), "<=", 0.1, ctx.gpu),
        "onload_over_raw_pinned": (ours["onload_over_raw"], ">=", 0.90, ctx.gpu),
        # O(1) per module: a module of WIDE tensors costs what a Linear (weight, bias) does
        f"collectives_{WIDE}_tensor_module_at_load": (
            ours[f"collectives_{WIDE}_tensor_module"], "<=", ours["collectives_per_module"], True),
        "collectives_per_subgraph": (ours["collectives_per_subgraph"], "<=", 2.0, True),
    }  # fmt: skip
    if "offcache_sliced" in by:
        goals["sliced_collectives_per_subgraph"] = (by["offcache_sliced"]["collectives_per_subgraph"], "<=", 2.0, True)
    for name, (value, op, bar, judged) in goals.items():
        ok = None if value is None or not judged else (value >= bar if op == ">=" else value <= bar)
        out[name] = {"value": value, "bar": f"{op} {bar:g}", "pass": ok}
    return out


def summary_lines(rows: list[dict]) -> list[str]:
    """A few lines for python -m offcache.bench's summary."""
    if not rows:
        return []
    head = rows[-1]
    lines = [f"weights --ranks {head.get('ranks')} ({head.get('note', '')}):"]
    lines.append(
        "  impl                node PSS/weights  load+setup s/GiB  pin s/GiB  onload GB/s/rank (min)  "
        f"collectives/module  /tensor  /{WIDE}-tensor module  /subgraph  pipeline s"
    )
    for r in rows:
        if "skipped" in r:
            lines.append(f"  {r['impl']:19} skipped: {r['skipped']}")
        elif r["impl"] != "goals":
            pss = "?" if r["pss_over_weights"] is None else f"{r['pss_over_weights']:.2f}x"
            pin = "-" if r["pin_s_per_gib"] is None else f"{r['pin_s_per_gib']:.3f}"
            gbps = min(r["onload_gbps_per_rank"])
            onload = f"{gbps:.2f}" if r["onload_copies"] else "(no copy)"
            lines.append(
                f"  {r['impl']:19} {pss:>16}  {r['setup_and_load_s_per_gib']:16.3f}  {pin:>9}  {onload:>22}  "
                f"{r['collectives_per_module']:18.2f}  {r['collectives_per_tensor']:7.2f}  "
                f"{r[f'collectives_{WIDE}_tensor_module']:17d}  {r['collectives_per_subgraph']:9.2f}  "
                f"{r['pipeline_wall_s']:.3f}"
            )
        else:
            cells = []
            for name, g in r.items():
                if isinstance(g, dict) and "bar" in g:
                    verdict = "" if g["pass"] is None else (" ok" if g["pass"] else " MISSED")
                    value = "?" if g["value"] is None else f"{g['value']:.3f}"
                    cells.append(f"{name} {value} ({g['bar']}){verdict}")
            lines.append("  goals: " + "; ".join(cells))
    return lines


# --- the ranks ------------------------------------------------------------------------------------


def _measure(rank: int, world: int, port: int, spec: dict, device: str) -> dict:
    """One rank's figures for every row (run in the rank's process)."""
    import datetime

    import torch.distributed as dist

    device = torch.device(device)
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=spec["timeout_s"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timeout)  # fmt: skip
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = Context(device=device, quick=spec["quick"], tiny=spec["tiny"], backend=offcache.build_info()["backend"])
    _warm_up(ctx)
    counter = CollectiveCounter()
    counter.install()
    try:
        out: dict = {"rank": rank, "pid": os.getpid(), "raw_gbps": _raw_gbps(ctx, spec), "impls": {}}
        for impl in spec["impls"]:
            out["impls"][impl] = _one(ctx, impl, spec, counter)
            counter.barrier()
    finally:
        counter.uninstall()
    return out


def _warm_up(ctx: Context) -> None:
    """Import what every row uses (llm-compressor's pipeline alone is hundreds of MB of PSS) and
    start the engine, so that no row's host bytes count them."""
    from compressed_tensors.offload import offload_module  # noqa: F401

    from offcache import engine
    from offcache.weights import ct_patch as oc_ct
    from offcache.weights import node  # noqa: F401

    oc_ct.patch()
    oc_ct.unpatch()
    stored = engine.store([torch.ones(1024)], torch.device("cpu"))
    engine.fetch(stored, ctx.device, wait=True)
    ctx.sync()
    torch.nn.functional.linear(torch.ones(2, 8, device=ctx.device), torch.ones(8, 8, device=ctx.device))


def _raw_gbps(ctx: Context, spec: dict) -> float:
    """One subgraph's weights by a pinned Tensor.to(non_blocking=True) (a clone() without a GPU)."""
    shape, dtype = spec["shape"], DTYPES[spec["dtype"]]
    sources = [torch.randn(shape["H"], shape["H"]).to(dtype) for _ in range(shape["L"])]
    pinned = [t.pin_memory() if ctx.gpu else t for t in sources]
    nbytes = sum(t.nbytes for t in sources)
    times = []
    for _ in range(4):
        ctx.sync()
        t0 = time.perf_counter()
        out = [t.to(ctx.device, non_blocking=True) for t in pinned] if ctx.gpu else [t.clone() for t in pinned]
        ctx.sync()
        times.append(time.perf_counter() - t0)
        del out
    return nbytes / median(times[1:]) / 1e9


@contextmanager
def _impl(impl: str):
    """compressed-tensors' classes as shipped, offcache's switch, or offcache's per-rank class."""
    from compressed_tensors.offload.cache import OffloadCache

    from offcache.weights import ct_patch as oc_ct

    oc_ct.unpatch()
    if impl == "compressed_tensors":
        yield
        return
    oc_ct.patch()
    saved = OffloadCache.__dict__["cls_from_device"]
    if impl == "per_rank":  # every rank its own copy, whatever torch.distributed says
        OffloadCache.cls_from_device = classmethod(lambda cls, device=None: oc_ct.OffcacheCPUCache)
    try:
        yield
    finally:
        OffloadCache.cls_from_device = saved
        oc_ct.unpatch()


@contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _one(ctx: Context, impl: str, spec: dict, counter: CollectiveCounter) -> dict:
    """Load, onload and run the stack with `impl` in this rank; its figures."""
    import torch.distributed as dist
    from compressed_tensors.distributed import is_source_process
    from compressed_tensors.offload import disable_offloading, offload_module

    from offcache.bench.weights import PipelineSubgraph, model_layers
    from offcache.weights import ct_patch as oc_ct

    shape, dtype = spec["shape"], DTYPES[spec["dtype"]]
    g = torch.Generator().manual_seed(1000 + dist.get_rank())  # each rank its own calibration batches
    batches = [torch.randn(shape["T"], shape["H"], generator=g).to(ctx.device, dtype) for _ in range(shape["B"])]
    row: dict = {}
    if impl == "offcache_sliced":
        from offcache.weights import node

        node.reset()  # decided anew in the sliced mode, after the full mode's region is let go
    settle()
    counter.barrier()
    pss0 = pss_bytes()
    before = offcache.stats()
    with _impl(impl):
        if impl in ("offcache", "offcache_sliced"):
            from offcache.weights import node

            counter.take()
            t0 = time.perf_counter()
            with _env("OFFCACHE_NODE_ONLOAD", "sliced" if impl == "offcache_sliced" else "full"):
                node.cache_class()  # the node's region: made once, by every rank together
            row["setup_s"] = time.perf_counter() - t0
            row["setup_collectives"] = counter.take()
        # As llm-compressor loads a model for a distributed run: the source rank holds the weights,
        # the others meta tensors (per_rank: every rank its own copy).
        materialize = impl == "per_rank" or is_source_process()
        layers = model_layers(shape, dtype, "cpu" if materialize else "meta")
        counter.barrier()
        counter.take()
        t0 = time.perf_counter()
        for sub in layers:
            for layer in sub:
                offload_module(layer, ctx.device, torch.device("cpu"))
        ctx.sync()
        row["load_s"] = time.perf_counter() - t0
        row["load_collectives"] = counter.take()
        row["cache_class"] = type(layers[0][0]._parameters).__name__
        settle()
        counter.barrier()
        row["pss_loaded"] = None if pss0 is None else pss_bytes() - pss0
        counter.barrier()
        loaded = offcache.stats()
        if impl in ("offcache", "offcache_sliced"):
            row["region"] = {k: v for k, v in node.stats().items() if not isinstance(v, list)}
        # One module of WIDE tensors: collectives per module, whatever its tensors.
        wide = torch.nn.Module()
        for i in range(WIDE):
            t = torch.randn(64, 64) if materialize else torch.empty(64, 64, device="meta")
            wide.register_parameter(f"p{i}", torch.nn.Parameter(t.to(dtype), requires_grad=False))
        counter.take()
        offload_module(wide, ctx.device, torch.device("cpu"))
        row["wide_collectives"] = counter.take()
        del wide

        # Onload: every subgraph's weights, no prefetch, waited for (R rounds after a warm-up).
        onloads = []
        with _env("OFFCACHE_WEIGHT_PREFETCH", "0"):
            for repeat in range(shape["R"] + 1):
                counter.barrier()
                t0 = time.perf_counter()
                for sub in layers:
                    with disable_offloading():
                        held = [t for layer in sub for t in (layer.weight, layer.bias)]
                        ctx.sync()
                        offloaded = sub[0]._parameters.offloaded_values["weight"]
                        row["onload_copies"] = held[0].data_ptr() != offloaded.data_ptr()
                    del held, offloaded
                if repeat:
                    onloads.append(time.perf_counter() - t0)
        row["onload_s"] = median(onloads)
        onload_collectives = counter.take()

        # The pipeline: R runs after one warm-up, each rank its own batches.
        walls, runs = [], shape["R"] + 1
        checksum = None
        for repeat in range(runs):
            subgraphs = [PipelineSubgraph(sub) for sub in layers]
            with _env("OFFCACHE_WEIGHT_PREFETCH", "1"):
                if impl != "compressed_tensors":
                    subgraphs = oc_ct._wrap_subgraphs(subgraphs)
                counter.barrier()
                wall, checksum = _pipeline(ctx, subgraphs, batches)
            if repeat:
                walls.append(wall)
        run_counts = Counter(counter.take())
        run_counts.update(onload_collectives)
        # passes over every subgraph: the onload rounds and the pipeline runs
        row.update(walls=walls, runs=runs + shape["R"] + 1, checksum=checksum, pipeline_collectives=dict(run_counts))
        del subgraphs
        settle()
        counter.barrier()
        row["pss_after"] = None if pss0 is None else pss_bytes() - pss0
        counter.barrier()
        after = offcache.stats()
        del layers
    if impl == "offcache_sliced":
        node.reset()  # later rows prefetch on each rank alone
    pin = "shared_register_seconds" if impl in ("offcache", "offcache_sliced") else "chunk_seconds"
    row["pin_s"] = loaded[pin] - before[pin] if impl != "compressed_tensors" else 0.0
    keys = ("shared_registrations", "shared_registered_bytes", "shared_fetch_bytes", "shared_pinned_fetch_bytes",
            "chunk_bytes", "h2d_bytes", "weight_prefetch_hits", "weight_prefetch_misses", "weight_prefetch_stale",
            "weight_host_waits", "weight_sliced_prefetches", "weight_sliced_fetch_bytes")  # fmt: skip
    row["engine"] = {k: after[k] - before[k] for k in keys if k in after}
    gc.collect()
    return row


def _pipeline(ctx: Context, subgraphs, batches) -> tuple[float, float]:
    """The sequential pipeline's way: per subgraph two passes over the batches in one
    disable_offloading() context, the second pass's outputs the next subgraph's inputs."""
    from compressed_tensors.offload import disable_offloading

    xs = list(batches)
    ctx.sync()
    t0 = time.perf_counter()
    with torch.no_grad():  # calibration forwards
        for subgraph in subgraphs:
            with disable_offloading():
                for _ in range(2):
                    outs = [subgraph.forward(None, x) for x in xs]
                xs = outs
    ctx.sync()
    wall = time.perf_counter() - t0
    return wall, float(sum(x.double().sum() for x in xs))
