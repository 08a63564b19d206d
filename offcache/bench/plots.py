"""PNG plots of a results.json (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

from offcache.util.extras import as_missing

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ModuleNotFoundError as _missing:  # one line naming the extra
    raise as_missing(_missing, "matplotlib", "bench", "offcache.bench.plots") from None


def plot_all(results: dict, out: Path) -> list[str]:
    """The plots that `results` has data for: bandwidth.png (transfer), pipeline.png (pipeline,
    oneshot and kv, a panel each) and timeline.png (timeline)."""
    out = Path(out)
    files = []
    if results.get("transfer"):
        files.append(_bandwidth(results, out / "bandwidth.png"))
    if any(results.get(k) for k in ("pipeline", "oneshot", "kv")):
        files.append(_end_to_end(results, out / "pipeline.png"))
    if results.get("timeline"):
        files.append(_timeline(results["timeline"], results, out / "timeline.png"))
    return [str(f) for f in files]


CPU_CAVEAT = (
    "No GPU: the host backend's copies are memcpys on the CPU. Compare rows of this figure "
    "with each other (ratios); they are not GPU or PCIe figures."
)


def _title(results: dict, what: str) -> str:
    dev = results["device"]
    where = dev["name"] + (f", {dev['cpus']} CPUs" if dev.get("cpus") else "")
    return f"{what} — backend: {results['backend']}, {where}"


def _caveat(fig, results: dict) -> None:
    """The CPU caveat on the figure itself, under the axes."""
    if results["device"].get("type") != "cuda":
        fig.text(0.5, 0.005, CPU_CAVEAT, ha="center", va="bottom", fontsize=8, color="dimgray", wrap=True)


def _save(fig, results: dict, path: Path) -> Path:
    cpu = results["device"].get("type") != "cuda"
    fig.tight_layout(rect=(0, 0.05 if cpu else 0, 1, 1))
    _caveat(fig, results)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bandwidth(results: dict, path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, direction in zip(axes, ("store", "fetch")):
        impls = sorted({r["impl"] for r in results["transfer"]})
        for impl in impls:
            rows = [r for r in results["transfer"] if r["impl"] == impl and r["direction"] == direction]
            xs = [r["bytes"] for r in rows]
            (line,) = ax.plot(xs, [r["gbps"] for r in rows], marker="o", label=impl)
            if all("gbps_min" in r for r in rows):  # the spread of the samples, min to max
                lo, hi = [r["gbps_min"] for r in rows], [r["gbps_max"] for r in rows]
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # bandwidths span decades on a loaded CPU: small ones stay readable
        ax.set_xlabel("bytes per copy")
        ax.set_title(f"{direction} ({'D2H' if direction == 'store' else 'H2D'})")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s (median; band: min to max)")
    axes[0].legend()
    fig.suptitle(_title(results, "offcache transfer bandwidth"))
    return _save(fig, results, path)


def _end_to_end(results: dict, path: Path) -> Path:
    panels = [(k, fn) for k, fn in (("pipeline", _pipeline), ("oneshot", _oneshot), ("kv", _kv)) if results.get(k)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.2 * len(panels)), squeeze=False)
    for ax, (key, draw) in zip(axes[:, 0], panels):
        draw(results[key], ax)
    fig.suptitle(_title(results, "Wall time and throughput"))
    return _save(fig, results, path)


def _bars(ax, labels: list[str], values: list[float], fmt: str, color: str, lo=None, hi=None) -> None:
    """Horizontal bars; with lo/hi (each value's min and max), a line from min to max."""
    err = None
    if lo is not None and hi is not None and all(x is not None for x in (*lo, *hi)):
        err = [[v - a for v, a in zip(values, lo)], [b - v for v, b in zip(values, hi)]]
    ax.barh(labels, values, color=color, xerr=err, error_kw={"ecolor": "black", "capsize": 3, "lw": 1})
    for i, v in enumerate(values):
        if v:  # a row that did not run says why instead (the caller's text)
            ax.text(v if err is None else v + err[1][i], i, " " + fmt.format(v), va="center")
    ax.invert_yaxis()
    ax.margins(x=0.15)


def _pipeline(rows: list[dict], ax) -> None:
    rows = [r for r in rows if "wall_s" in r]
    _bars(ax, [r["impl"] for r in rows], [r["wall_s"] for r in rows], "{:.3g}s", "tab:blue",
          [r.get("wall_min_s") for r in rows], [r.get("wall_max_s") for r in rows])  # fmt: skip
    ax.set_xlabel("wall time (s): median, line min to max")
    ax.set_title("Simulated sequential pipeline")


def _oneshot(rows: list[dict], ax) -> None:
    labels = [f"{r['impl']}, prefetch {'on' if r['prefetch'] else 'off'}" for r in rows]
    _bars(ax, labels, [r["wall_s"] for r in rows], "{:.3g}s", "tab:purple")
    for i, r in enumerate(rows):
        if r.get("bit_identical") is False:
            ax.text(0, i, " weights differ", va="center", color="red")
    r0 = rows[0]
    ax.set_xlabel("wall time of oneshot (s)")
    ax.set_title(
        f"llm-compressor oneshot, GPTQ W4A16: {r0['num_hidden_layers']} layers, hidden {r0['hidden_size']}, "
        f"{r0['samples']}x{r0['tokens']} tokens, {r0['dtype']}"
    )


def _kv(rows: list[dict], ax) -> None:
    """Decode tokens/s; a row that could not run here is a labelled gap saying why."""
    rows = [r for r in rows if "prompt_tokens" in r]
    labels = [f"{r['case']} ({r['prompt_tokens']} tokens): {r['impl']}" for r in rows]
    values = [r.get("decode_tokens_per_s_median") or 0.0 for r in rows]
    ok = [bool(r.get("completed") and r.get("decode_tokens_per_s_median")) for r in rows]
    lo = [r.get("decode_tokens_per_s_min") if k else v for r, v, k in zip(rows, values, ok)]
    hi = [r.get("decode_tokens_per_s_max") if k else v for r, v, k in zip(rows, values, ok)]
    _bars(ax, labels, values, "{:.4g}", "tab:green", lo, hi)
    for i, (r, k) in enumerate(zip(rows, ok)):
        if not k:
            why = r.get("note") or ("failed: " + (r.get("error") or "no decode rate"))
            ax.text(0, i, " " + why.split(":")[0] if why.startswith("needs a GPU") else " " + why[:60],
                    va="center", color="gray" if r.get("completed") is None else "red")  # fmt: skip
    ax.set_xlabel("decode tokens/s (median, line min to max)")
    ax.set_title("KV cache decode (greedy)")


def _timeline(tl: dict, results: dict, path: Path) -> Path:
    lanes = {"compute": 2, "h2d": 1, "d2h": 0}
    colors = {"compute": "tab:green", "h2d": "tab:blue", "d2h": "tab:orange"}
    fig, ax = plt.subplots(figsize=(11, 3))
    bars = [("compute", r["start_ms"], r["end_ms"]) for r in tl["compute"]]
    bars += [(r["stream"], r["start_ms"], r["end_ms"]) for r in tl["copies"]]
    for lane, start, end in bars:
        ax.broken_barh([(start, max(end - start, 1e-3))], (lanes[lane] - 0.4, 0.8), color=colors[lane])
    ax.set_yticks([0, 1, 2], ["D2H stream", "H2D stream", "compute"])
    ax.set_xlabel(f"ms ({tl['origin']})")
    ax.set_title(_title(results, f"iter_prefetch, {tl['steps']} propagation steps"))
    ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, results, path)
