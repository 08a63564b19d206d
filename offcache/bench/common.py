"""Timing and device helpers shared by the benchmark sections."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

import offcache


@dataclass
class Context:
    device: torch.device  # where "GPU" tensors live (the CPU on a GPU-less host)
    quick: bool
    tiny: bool
    backend: str

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
        import os
        import platform

        info["name"] = platform.processor() or platform.machine()
        info["cpus"] = os.cpu_count()
    return info


def bump_version(t: torch.Tensor) -> None:
    """Make the dedup table treat `t` as new, so a repeat copies it again."""
    torch.autograd.graph.increment_version(t)
