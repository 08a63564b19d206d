"""Whether every subgraph of the sequential pipeline can run within the memory limit, checked at the start.

A subgraph's weights are onloaded together (compressed-tensors' ``disable_offloading()`` keeps them
for the subgraph's calibration and propagation), beside its activations. Onloaded to the CPU, they
need the host memory the process may still use: its limit (the cgroup's, or RAM, the smaller)
less the anonymous memory it holds now (a file's mapped pages the kernel may reclaim do not
count). Onloaded to a GPU, its free memory (with what torch's allocator caches). Where even one
subgraph's weights plus its activations exceed that, ``check()`` raises ``SubgraphMemoryError``
before calibration starts, naming the subgraph, the bytes and the limit: no placement of the
weights can run it, and the OOM killer would otherwise end the run at that subgraph.

The activations are estimated as the first batch's tokens times the model's hidden size in its
dtype, twice (a subgraph's input and output hidden states): a lower bound.
"""

from __future__ import annotations

from typing import Any

import torch

from offcache.engine import machine as _machine
from offcache.util.units import bytes_text


class SubgraphMemoryError(MemoryError):
    """A subgraph's weights and activations do not fit the memory its onload device has."""


def _anon_bytes() -> int:
    """This process's anonymous resident memory (RssAnon), 0 where /proc cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


def host_room() -> tuple[int, str]:
    """(bytes, description) of the host memory this process may still take for a subgraph."""
    limit = _machine.usable_memory_bytes()
    cgroup = _machine.cgroup_memory_limit()
    what = "the cgroup's limit" if cgroup is not None and cgroup == limit else "RAM"
    used = _anon_bytes()
    return max(limit - used, 0), f"{what} {bytes_text(limit)} less {bytes_text(used)} of anonymous memory in use"


def device_room(device: torch.device) -> tuple[int, str]:
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached, f"{device}'s free memory {bytes_text(free + cached)} of {bytes_text(total)}"


def _weights(modules) -> dict[torch.device, int]:
    """Bytes of the modules' offloaded weights by onload device. A weight not offloaded is resident
    already (in the memory in use, or on its device) and takes nothing more to run."""
    from compressed_tensors.offload.cache import OffloadCache

    out: dict[torch.device, int] = {}
    seen: set[int] = set()
    for module in modules:
        for cache in (module._parameters, module._buffers):
            if not isinstance(cache, OffloadCache):
                continue
            where = torch.device(cache.onload_device)
            if where.type == "cuda" and where.index is None:
                where = torch.device("cuda", torch.cuda.current_device())
            for tensor in cache.offloaded_values.values():
                if tensor is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                out[where] = out.get(where, 0) + tensor.nbytes
    return out


def activation_bytes(model, sample_input: Any) -> int:
    """The estimate of one subgraph's activations for the first batch (a lower bound; 0 where unknown)."""
    ids = sample_input.get("input_ids") if isinstance(sample_input, dict) else None
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    hidden = getattr(get_text() if callable(get_text) else config, "hidden_size", None)
    if not isinstance(ids, torch.Tensor) or not isinstance(hidden, int):
        return 0
    dtype = getattr(model, "dtype", torch.float32)
    return 2 * ids.numel() * hidden * torch.empty((), dtype=dtype).element_size()


def check(subgraphs: list, model, sample_input: Any, room=None) -> None:
    """Raise SubgraphMemoryError where one subgraph's weights plus activations exceed its device's room.

    `room(device)` gives (bytes, description); by default host_room() for the CPU, device_room() else."""
    if room is None:
        room = lambda device: host_room() if device.type == "cpu" else device_room(device)  # noqa: E731
    acts = activation_bytes(model, sample_input)
    known: dict[torch.device, tuple[int, str]] = {}
    for index, subgraph in enumerate(subgraphs):
        modules = subgraph.submodules(model)
        for device, nbytes in _weights(modules).items():
            if device.type not in ("cpu", "cuda"):
                continue
            if device not in known:
                known[device] = room(device)
            have, what = known[device]
            need = nbytes + acts
            if need > have:
                names = [n for n, m in model.named_modules() if m in set(modules[:1])]
                first = f" ({names[0]}{', ...' if len(modules) > 1 else ''})" if names else ""
                raise SubgraphMemoryError(
                    f"offcache: subgraph {index} of {len(subgraphs)}{first} needs {bytes_text(need)} on {device}: "
                    f"{bytes_text(nbytes)} of weights onloaded together and {bytes_text(acts)} of activations "
                    f"(estimated, the first batch); the limit leaves {bytes_text(have)} ({what}). No placement "
                    "of the weights can run it: raise the memory limit, or split the subgraph "
                    "(fewer sequential targets per subgraph)."
                )
