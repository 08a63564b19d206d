"""Timing and device helpers shared by the benchmark sections."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import offcache


def env_switch(name: str, default: bool = True) -> bool:
    """A benchmark's on/off variable, read as the engine reads its own: 0 or 1, blank counts as unset."""
    raw = os.environ.get(name, "").strip() or ("1" if default else "0")
    if raw not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return raw == "1"


def bench_disk_dir() -> str | None:
    """OFFCACHE_BENCH_DISK_DIR as an existing writable folder, or None (blank or unset) for the temp folder."""
    raw = os.environ.get("OFFCACHE_BENCH_DISK_DIR", "")
    if not raw.strip():
        return None
    path = os.path.abspath(raw)
    if not os.path.isdir(path):
        raise ValueError(f"OFFCACHE_BENCH_DISK_DIR: {path!r} is not a folder (make it first, or unset it for the "
                         "system's temp folder)")  # fmt: skip
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"OFFCACHE_BENCH_DISK_DIR: cannot write to {path!r}")
    return path


@dataclass
class Context:
    device: torch.device  # where "GPU" tensors live (the CPU on a GPU-less host)
    quick: bool
    tiny: bool
    backend: str
    # Called with the rows a section has measured so far (python -m offcache.bench writes them to
    # results.json at once), so that a run killed at its deadline keeps every number it measured.
    checkpoint: Callable[[list[dict]], None] | None = None

    def partial(self, rows: list[dict]) -> None:
        """Hands the rows measured so far to the checkpoint, if any (a copy: the section goes on adding)."""
        if self.checkpoint is not None:
            self.checkpoint([dict(r) for r in rows])

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        """Wait for every copy and kernel: offcache's streams and the device's."""
        offcache.synchronize()
        if self.gpu:
            torch.cuda.synchronize(self.device)


def timed(ctx: Context, fn, repeats: int, warmup: int = 2, setup=None) -> list[float]:
    """Wall seconds of `fn()` per repeat, synchronised before and after; `setup` is untimed."""
    out = []
    for i in range(warmup + repeats):
        state = setup() if setup else None
        ctx.sync()
        t0 = time.perf_counter()
        fn(state) if setup else fn()
        ctx.sync()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


# A sample shorter than this is dominated by the clock and by scheduling: a 2-core machine's
# scheduler hands out slices of several ms, and one preemption inside a 20 us copy made it read
# 8 ms. Short calls are repeated within one sample until it lasts at least this long.
MIN_SAMPLE_S = 0.02


def timed_per_call(ctx: Context, fn, repeats: int, warmup: int = 2, min_sample_s: float = MIN_SAMPLE_S):
    """(seconds per call of `fn()` for each of `repeats` samples, calls per sample).

    Each sample runs `fn` enough times back to back to last at least `min_sample_s` (found from
    the warm-up calls), synchronised before and after, and is divided by that count.
    """
    one = min(timed(ctx, fn, max(1, warmup), warmup=0))
    calls = max(1, min(100_000, -(-int(min_sample_s * 1e9) // max(1, int(one * 1e9)))))

    def batch():
        for _ in range(calls):
            fn()

    return [t / calls for t in timed(ctx, batch, repeats, warmup=0)], calls


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float]) -> float:
    """Relative spread (max - min) / median."""
    m = statistics.median(xs)
    return (max(xs) - min(xs)) / m if m else 0.0


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def device_info(device: torch.device) -> dict:
    info: dict = {"name": "cpu", "type": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["name"] = props.name
        info["memory_bytes"] = props.total_memory
        try:
            import pynvml  # from nvidia-ml-py, when present

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
            info["pcie_generation"] = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)
            info["pcie_width"] = pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)
        except Exception as exc:  # noqa: BLE001 - best effort, recorded
            info["pcie"] = f"not readable: {type(exc).__name__}"
    else:
        import platform

        info["name"] = cpu_model() or platform.processor() or platform.machine()
        info["arch"] = platform.machine()
        info["cpus"] = os.cpu_count()
    return info


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name from /proc/cpuinfo ('' where there is none)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return " ".join(value.split())
    except OSError:
        pass
    return ""


def bump_version(t: torch.Tensor) -> None:
    """Make the dedup table treat `t` as new, so a repeat copies it again."""
    torch.autograd.graph.increment_version(t)


def run_info(ctx: Context, command: str) -> dict:
    """What a section's results were measured with: command, date, machine and build."""
    return {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_info(ctx.device),
        "backend": ctx.backend,
        "build_info": offcache.build_info(),
        "torch": torch.__version__,
    }


def load_results(path: Path) -> dict:
    """The results already in `path` (an earlier section's), or an empty dict."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}


def save_results(path: Path, results: dict) -> None:
    """Write `results` as JSON atomically: a section cut short never leaves half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(results, indent=2, default=str))
    tmp.replace(path)


def env_choice(name: str, choices: tuple[str, ...], default: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The comma-separated subset of `choices` that the environment variable `name` names (its order kept),
    else (unset or blank) `default`, all of `choices` by default. A value naming anything else is a ValueError
    that lists the choices."""
    raw = os.environ.get(name, "")
    if not raw.strip():  # blank counts as unset, as in the engine's own variables
        return tuple(choices if default is None else default)
    picked = tuple(v.strip() for v in raw.split(",") if v.strip())
    wrong = [v for v in picked if v not in choices]
    if wrong or not picked:
        raise ValueError(f"{name}={raw!r}: expected a comma-separated list of {', '.join(choices)}")
    return picked
