"""PNG plots of a results.json (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_all(results: dict, out: Path) -> list[str]:
    files = [_bandwidth(results, out / "bandwidth.png"), _pipeline(results, out / "pipeline.png")]
    if results.get("timeline"):
        files.append(_timeline(results["timeline"], results, out / "timeline.png"))
    return [str(f) for f in files if f]


def _bandwidth(results: dict, path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, direction in zip(axes, ("store", "fetch")):
        impls = sorted({r["impl"] for r in results["transfer"]})
        for impl in impls:
            rows = [r for r in results["transfer"] if r["impl"] == impl and r["direction"] == direction]
            ax.plot([r["bytes"] for r in rows], [r["gbps"] for r in rows], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per copy")
        ax.set_title(f"{direction} ({'D2H' if direction == 'store' else 'H2D'})")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s (median)")
    axes[0].legend()
    fig.suptitle(f"offcache transfer bandwidth — backend: {results['backend']}, {results['device']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pipeline(results: dict, path: Path) -> Path:
    rows = [r for r in results["pipeline"] if "wall_s" in r]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh([r["impl"] for r in rows], [r["wall_s"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        ax.text(r["wall_s"], i, f" {r['wall_s']:.3g}s", va="center")
    ax.set_xlabel("wall time (s)")
    ax.set_title(f"Simulated sequential pipeline — backend: {results['backend']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    ax.set_title(f"iter_prefetch, {tl['steps']} propagation steps — backend: {results['backend']}")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
