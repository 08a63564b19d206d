"""Section oneshot (``python -m offcache.bench oneshot``): llm-compressor's real sequential GPTQ.

`oneshot(pipeline="sequential")` with GPTQ W4A16 on a random Llama (saved with
`save_llama`, so it loads like a checkpoint), four kinds of run: with
llm-compressor's own IntermediatesCache and with `offcache.patch_llmcompressor()`,
each with `sequential_prefetch` off and on, each kind 5 times, interleaved, after
one untimed oneshot that warms up. Recorded per kind: the median wall time of
`oneshot` with its spread, whether the weights are bit-identical to the reference
run (the llm-compressor run with the same prefetch setting; llm-compressor with
prefetch against llm-compressor without), for offcache the speedup over
llm-compressor with the same prefetch setting, and with prefetch the speedup over
its own run without.

Then three runs with the model's weights offloaded to the CPU (the model is left on the CPU, so
the pipeline's ``set_onload_device`` wraps every module in compressed-tensors' ``CPUCache``):
llm-compressor as shipped, offcache's activation cache only, and offcache's activations and
weights (``patch_llmcompressor(weights=True)``, next-subgraph prefetch on), each compared bit
for bit with the first and timed with its weight counters (host waits and their seconds).
OFFCACHE_BENCH_ONESHOT_WEIGHTS=0 leaves them out. On a CPU-only host every run's weights are
"offloaded" to the CPU they run on; only offcache's weights copy (CPUCache hands out the
tensor itself).

Sizes: on a GPU hidden 2048, 6 layers, 128 samples x 512 tokens in bf16, the
model on the GPU (the sequential pipeline onloads to llm-compressor's main
device, the GPU, and the activations are offloaded to the CPU by the cache
under test). On a CPU the model is small and fp32, and torch runs on one
thread so that the four runs are deterministic and comparable bit for bit.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import offcache
from offcache.bench.common import Context, env_switch, median, spread
from offcache.bench.models import save_llama

# cuBLAS picks the same kernels run after run only with a fixed workspace; set before
# the first matrix product of the process (benchmarks/device_check.sh also sets it).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@dataclass
class Shape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    samples: int
    tokens: int

    @classmethod
    def for_context(cls, ctx: Context) -> Shape:
        if ctx.tiny:  # tests/test_llmcompressor_oneshot.py's model (GPTQ groups of 128 need hidden >= 128)
            return cls(128, 256, 3, 4, 2, 96, 6, 24)
        if ctx.gpu:
            return cls(2048, 5632, 4 if ctx.quick else 6, 16, 4, 32000, 64 if ctx.quick else 128, 512)
        return cls(256, 512, 3 if ctx.quick else 4, 4, 2, 512, 8 if ctx.quick else 16, 64 if ctx.quick else 128)


RUNS = [  # interleaved, so that drift on the machine touches both caches alike
    ("llmcompressor", False),
    ("offcache", False),
    ("llmcompressor", True),
    ("offcache", True),
]
# With the weights offloaded to the CPU: llm-compressor as shipped, offcache's activations, and both.
WEIGHT_RUNS = [
    ("llmcompressor", False),
    ("offcache", False),
    ("offcache+weights", False),
]


def weight_runs() -> list[tuple[str, bool]]:
    return WEIGHT_RUNS if env_switch("OFFCACHE_BENCH_ONESHOT_WEIGHTS") else []


def calibration_set(shape: Shape):
    import datasets

    g = torch.Generator().manual_seed(1)
    rows = torch.randint(4, shape.vocab_size, (shape.samples, shape.tokens), generator=g).tolist()
    return datasets.Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * shape.tokens] * shape.samples})


def _load(ctx: Context, model_dir: Path, dtype: torch.dtype, offload_weights: bool = False):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if not offload_weights:  # on the device: the pipeline's onload is a no-op
        model = model.to(ctx.device)
    elif ctx.device.type == "cpu":
        # In the process's own memory, every run alike: a checkpoint's mapping onloaded to the CPU
        # stays the mapping, and would not reach the engine (docs/larger-than-ram.md).
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone()
    return model.eval(), transformers.AutoTokenizer.from_pretrained(model_dir)


def _sync(ctx: Context) -> None:
    offcache.synchronize()
    if ctx.gpu:
        torch.cuda.synchronize(ctx.device)


def quantize(
    ctx: Context, model_dir: Path, dtype: torch.dtype, shape: Shape, dataset, prefetch: bool, offload_weights=False
):
    """One oneshot run: (wall seconds of oneshot, the quantized state dict on the CPU, stats after oneshot)."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    torch.manual_seed(0)
    model, tokenizer = _load(ctx, model_dir, dtype, offload_weights)
    _sync(ctx)
    t0 = time.perf_counter()
    with _timed_batches() as waited:
        oneshot(
            model=model,
            tokenizer=tokenizer,
            dataset=dataset,
            recipe=GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
            num_calibration_samples=shape.samples,
            max_seq_length=shape.tokens,
            pipeline="sequential",
            shuffle_calibration_samples=False,
            sequential_prefetch=prefetch,
        )
    _sync(ctx)
    wall = time.perf_counter() - t0
    during = {**offcache.stats(), **waited}  # before the state dict is read back (its onloads are not oneshot's)
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    del model
    gc.collect()
    if ctx.gpu:
        torch.cuda.empty_cache()
    return wall, state, during


@contextlib.contextmanager
def _timed_batches():
    """Times llm-compressor's sequential pipeline getting each batch: ``batch_wait_s``, the host seconds its
    thread spends in the batch iterator (the cache's fetch, iter_prefetch's wait or llm-compressor's prefetch
    thread, and tqdm), and ``batches``, summed over a oneshot. Both None on a version without ``_get_batches``."""
    import llmcompressor.pipelines.sequential.pipeline as pipeline

    original = getattr(pipeline, "_get_batches", None)
    waited: dict = {"batches": 0, "batch_wait_s": 0.0}
    if original is None:
        yield {"batches": None, "batch_wait_s": None}
        return

    def timed(*args, **kwargs):
        batches = original(*args, **kwargs)
        try:
            while True:
                t = time.perf_counter()
                try:
                    item = next(batches)
                finally:
                    waited["batch_wait_s"] += time.perf_counter() - t
                waited["batches"] += 1
                yield item
        except StopIteration:
            return
        finally:
            batches.close()

    pipeline._get_batches = timed
    try:
        yield waited
    finally:
        pipeline._get_batches = original


def _name(run: tuple[str, bool, bool]) -> str:
    return f"{run[0]}, prefetch {run[1]}" + (", weights offloaded" if run[2] else "")


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _warm_up(ctx: Context, model_dir: Path, dtype: torch.dtype, shape: Shape, dataset) -> None:
    """First-use costs kept out of the timed runs: one untimed GPTQ oneshot at full size (kernels, cuBLAS and
    cuSOLVER handles, llm-compressor's own first-call costs: 0.91 s inside the first timed run once)."""
    quantize(ctx, model_dir, dtype, shape, dataset, prefetch=False)
    gc.collect()


def repeats_for(ctx: Context | None) -> int:
    """Timed runs of each kind, interleaved: 5 (their median is the row's wall time); 1 at --tiny sizes;
    OFFCACHE_BENCH_ONESHOT_REPEATS=N sets it (the device check's budget holds 2). None: the setting checked."""
    raw = os.environ.get("OFFCACHE_BENCH_ONESHOT_REPEATS", "").strip()
    if raw and (not raw.isdigit() or int(raw) < 1):
        raise ValueError(f"OFFCACHE_BENCH_ONESHOT_REPEATS must be a whole number >= 1, got {raw!r}")
    if raw:
        return int(raw)
    return 1 if ctx is not None and ctx.tiny else 5


def _reference(run: tuple[str, bool, bool]) -> tuple[str, bool, bool] | None:
    """The run whose weights `run`'s must equal: llm-compressor with the same settings; for llm-compressor
    itself, llm-compressor without prefetch with the weights on the device (None for that one)."""
    impl, prefetch, offloaded = run
    if impl == "llmcompressor":
        return ("llmcompressor", False, False) if prefetch or offloaded else None
    return ("llmcompressor", prefetch, offloaded)


def _one_run(ctx: Context, model_dir: Path, dtype: torch.dtype, shape: Shape, dataset, run) -> tuple:
    """(wall seconds, quantized state, counters) of one oneshot of kind `run` = (impl, prefetch, offloaded)."""
    impl, prefetch, offloaded = run
    offcache.unpatch_llmcompressor()
    before = offcache.stats()
    if impl != "llmcompressor":
        offcache.empty_cache()  # each run pins its arena afresh, as a new process would
        offcache.patch_llmcompressor(weights=impl == "offcache+weights")
    try:
        wall, state, after = quantize(ctx, model_dir, dtype, shape, dataset, prefetch, offloaded)
    finally:
        offcache.unpatch_llmcompressor()
    counted = {
        "offcache_stores": after["stores"] - before["stores"],
        "offcache_d2h_bytes": after["d2h_bytes"] - before["d2h_bytes"],
        "offcache_h2d_bytes": after["h2d_bytes"] - before["h2d_bytes"],
        "wall_s_first": wall,
    }
    counted.update({k: after[k] - before[k] for k in after if k.startswith("weight_")})
    counted.update(batches=after["batches"], batch_wait_s=after["batch_wait_s"])
    if impl == "offcache+weights":  # per disable_offloading() context: hits, misses, waits
        from offcache.weights import ct_patch as oc_ct

        counted["weight_subgraphs"] = oc_ct.subgraph_stats()
    return wall, state, counted


def run_oneshot(ctx: Context) -> list[dict]:
    import llmcompressor  # noqa: F401  (an ImportError names what is missing before any work)

    shape = Shape.for_context(ctx)
    dtype = torch.bfloat16 if ctx.gpu else torch.float32
    threads = torch.get_num_threads()
    if not ctx.gpu:
        torch.set_num_threads(1)
    rows: list[dict] = []
    try:
        with tempfile.TemporaryDirectory(prefix="offcache-oneshot-") as tmp:
            model_dir = save_llama(
                Path(tmp) / "llama", dtype=dtype, vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_hidden_layers,
                num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
                max_position_embeddings=max(256, shape.tokens),
            )  # fmt: skip
            dataset = calibration_set(shape)
            if not ctx.tiny:
                _warm_up(ctx, model_dir, dtype, shape, dataset)
            states: dict[tuple[str, bool, bool], dict] = {}
            walls: dict[tuple[str, bool, bool], list[float]] = {}
            same: dict[tuple[str, bool, bool], bool] = {}
            counters: dict[tuple[str, bool, bool], dict] = {}
            waits: dict[tuple[str, bool, bool], list] = {}
            runs = [(i, p, False) for i, p in RUNS] + [(i, p, True) for i, p in weight_runs()]

            def made_rows() -> list[dict]:  # from the runs so far
                rows = []
                for run in runs:
                    impl, prefetch, offloaded = run
                    reference, wall = _reference(run), median(walls[run])
                    row = {
                        "impl": impl,
                        "prefetch": prefetch,
                        "weights": "offloaded to the CPU" if offloaded else "on the device",
                        "wall_s": wall,
                        "wall_min_s": min(walls[run]),
                        "wall_max_s": max(walls[run]),
                        "spread": spread(walls[run]),
                        "repeats": len(walls[run]),
                        "reference": None if reference is None else _name(reference),
                        "bit_identical": same.get(run),
                        "quantized": any(k.endswith("weight_scale") for k in states[run]),
                        **counters[run],
                    }
                    row["weight_wait_fraction"] = row["weight_host_wait_seconds"] / row["wall_s_first"]
                    row.update(batch_waits(waits[run], row["batches"]))
                    if prefetch:  # per round, this run against the same cache's run without prefetch
                        row.update(paired_ratio(walls[run], walls[(impl, False, offloaded)]))
                    if impl != "llmcompressor":
                        row["speedup_vs_llmcompressor"] = median(walls[("llmcompressor", prefetch, offloaded)]) / wall
                        if prefetch:  # what sequential_prefetch does to this cache: > 1 is faster with it
                            row["prefetch_speedup"] = median(walls[(impl, False, offloaded)]) / wall
                    rows.append(row)
                return rows

            for round_index in range(repeats_for(ctx)):
                # Interleaved, every other round in reverse (ABBA): drift on the machine and a run's place
                # in the round touch every kind alike.
                for run in runs if round_index % 2 == 0 else runs[::-1]:
                    wall, state, counted = _one_run(ctx, model_dir, dtype, shape, dataset, run)
                    waits.setdefault(run, []).append(counted["batch_wait_s"])
                    reference = _reference(run)
                    if run not in states:
                        states[run], counters[run] = state, counted
                    walls.setdefault(run, []).append(wall)
                    if reference is not None:
                        same[run] = same.get(run, True) and _same(state, states[reference])
                ctx.partial([{**r, **asdict(shape)} for r in made_rows()])  # a kill keeps the rounds done
            rows = made_rows()
    finally:
        torch.set_num_threads(threads)
        offcache.unpatch_llmcompressor()
    for r in rows:
        r.update(asdict(shape), dtype=str(dtype).removeprefix("torch."), device=str(ctx.device))
    return rows


def paired_ratio(on: list[float], off: list[float]) -> dict:
    """Prefetch's cost per round: the median, min and max of on[i] / off[i] (> 1: slower with prefetch).

    The two runs of a round ran side by side, so the machine's drift cancels in their ratio; a ratio of
    the two medians keeps it."""
    ratios = [a / b for a, b in zip(on, off)]
    return {
        "prefetch_ratio_paired": median(ratios),
        "prefetch_ratio_min": min(ratios),
        "prefetch_ratio_max": max(ratios),
    }


def batch_waits(waited: list, batches: int | None) -> dict:
    """The median over a kind's runs of the seconds the pipeline waited for its batches, and per batch."""
    if batches is None or any(w is None for w in waited):
        return {"batch_wait_s": None, "batch_wait_us_per_batch": None}
    wait = median(waited)
    return {"batch_wait_s": wait, "batch_wait_us_per_batch": wait / batches * 1e6 if batches else None}


def describe(rows: list[dict]) -> str:
    compared = [r for r in rows if r["bit_identical"] is not None]
    same = sum(bool(r["bit_identical"]) for r in compared)
    parts = [f"oneshot GPTQ W4A16: weights bit-identical {same}/{len(compared)}"]
    for r in rows:
        if r["impl"] != "llmcompressor":
            where = "" if r["weights"] == "on the device" else ", weights offloaded"
            parts.append(
                f"{r['impl']} prefetch {'on' if r['prefetch'] else 'off'}{where}: {r['wall_s']:.2f}s "
                f"(spread {r['spread']:.0%} over {r['repeats']}) vs llm-compressor "
                f"{r['wall_s'] * r['speedup_vs_llmcompressor']:.2f}s ({r['speedup_vs_llmcompressor']:.2f}x)"
                + (
                    f", {r['prefetch_ratio_paired']:.2f}x its own time without prefetch (paired median over "
                    f"{r['repeats']} rounds, {r['prefetch_ratio_min']:.2f}-{r['prefetch_ratio_max']:.2f})"
                    if "prefetch_ratio_paired" in r
                    else ""
                )
            )
        if r["impl"] == "offcache+weights":
            parts.append(
                f"weights: {r['weight_host_waits']} host waits ({r['weight_wait_fraction']:.1%} of wall), "
                f"{r['weight_prefetch_hits']} prefetch hits, {r['weight_prefetch_misses']} misses"
            )
    return "; ".join(parts)
