"""The drift guard for compressed-tensors: what offcache's cache subclasses rely on, checked
before anything is patched.

``OffcacheCPUCache`` and ``OffcacheDiskCache`` (offcache/weights/caches.py) subclass
compressed-tensors' ``CPUCache`` and ``DiskCache``: compressed-tensors calls their overrides, and
they call compressed-tensors' methods and read its ``DiskCache.index``. A release that changes one
of these would break a run partway through (a ``TypeError`` in an onload, a ``KeyError`` in an
update). ``check()`` refuses such a release up front, naming what differs; the activation cache
(``patch_llmcompressor()`` with weights=False) does not depend on it.
"""

from __future__ import annotations

import inspect
import sys
import tempfile

import torch

__all__ = ["CompressedTensorsDriftError", "check", "differences"]

# The methods offcache overrides or calls, with the parameters (after self) that it was written
# for: compressed-tensors 0.19 and 0.20. `stage` is 0.20's (absent before: nothing to check).
EXPECTED: dict[str, dict[str, tuple[str, ...]]] = {
    "CPUCache": {
        "onload": ("offloaded",),
        "offload": ("tensor",),
        "update_offload": ("offloaded", "data"),
        "stage": ("offloaded", "pin_memory"),
    },
    "DiskCache": {
        "onload": ("offloaded",),
        "offload": ("tensor", "offloaded"),
        "update_offload": ("offloaded", "data"),
        "stage": ("offloaded", "pin_memory"),
    },
}
OPTIONAL = {"stage"}


class CompressedTensorsDriftError(RuntimeError):
    """The installed compressed-tensors' offload caches differ from what offcache's subclasses rely on."""


def version() -> str:
    try:
        from importlib.metadata import version as _version

        return _version("compressed-tensors")
    except Exception:
        return getattr(sys.modules.get("compressed_tensors"), "__version__", "unknown")


def _parameters(func) -> tuple[str, ...] | None:
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    return tuple(p.name for p in params[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def _signature_differences(cls, expected: dict[str, tuple[str, ...]]) -> list[str]:
    diffs = []
    for name, want in expected.items():
        func = getattr(cls, name, None)
        if func is None:
            if name not in OPTIONAL:
                diffs.append(f"{cls.__name__}.{name} does not exist")
            continue
        got = _parameters(func)
        if got is not None and got != want:
            diffs.append(f"{cls.__name__}.{name} takes ({', '.join(got)}), offcache's override ({', '.join(want)})")
    return diffs


def _index_differences(disk_cls) -> list[str]:
    """How DiskCache.index is keyed: by the offloaded (meta) tensor itself, which offcache reads."""
    index = getattr(disk_cls, "index", None)
    if not isinstance(index, dict):
        return ["DiskCache.index is no longer a dict (offcache reads it by offloaded tensor)"]
    with tempfile.TemporaryDirectory(prefix="offcache-ct-probe-") as folder:
        before = set(map(id, index))
        cache = disk_cls("cpu", offload_dir=folder)
        offloaded = cache.offload(torch.zeros(2))
        added = [k for k in list(index) if id(k) not in before]
        for key in added:
            index.pop(key, None)
    if any(key is offloaded for key in added):
        return []
    kinds = sorted({type(k).__name__ for k in added}) or ["nothing"]
    return [
        f"DiskCache.index is keyed by {', '.join(kinds)}, not by the offloaded tensor "
        "(offcache's onloads, prefetches and updates look it up by the tensor)"
    ]


def _setitem_differences(cpu_cls, base_cls) -> list[str]:
    """An assignment to an existing key must call update_offload(offloaded, value)."""
    calls = []

    class Probe(cpu_cls):
        def update_offload(self, offloaded, data):
            calls.append((offloaded, data))
            return super().update_offload(offloaded, data)

    disabled = base_cls.onloading_disabled
    base_cls.onloading_disabled = False  # __setitem__'s own path, not disable_onloading()'s
    try:
        cache = Probe("cpu")
        cache["w"] = torch.zeros(2)
        offloaded, value = cache.offloaded_values["w"], torch.ones(2)
        cache["w"] = value
    finally:
        base_cls.onloading_disabled = disabled
    if len(calls) == 1 and calls[0][0] is offloaded and calls[0][1] is value:
        return []
    return [
        "OffloadCache.__setitem__ on an existing key no longer calls update_offload(offloaded, value) "
        f"({len(calls)} calls): offcache's write-backs go through update_offload"
    ]


def _interface_differences(classes) -> list[str]:
    """The weight-cache interface's names (offcache/weights/interface.py) must be offcache's alone: a
    compressed-tensors class defining one would call offcache's method where it meant its own."""
    from offcache.weights.interface import NAMES

    return [
        f"{cls.__name__}.{name} exists: offcache's weight caches define {name} (offcache/weights/interface.py)"
        for cls in classes
        for name in NAMES
        if any(name in vars(k) for k in cls.__mro__)
    ]


def differences() -> list[str]:
    """What differs between the installed compressed-tensors and what offcache relies on."""
    from compressed_tensors.offload.cache import CPUCache, DiskCache, OffloadCache

    diffs = _signature_differences(CPUCache, EXPECTED["CPUCache"])
    diffs += _signature_differences(DiskCache, EXPECTED["DiskCache"])
    diffs += _interface_differences((CPUCache, DiskCache))
    for probe in (lambda: _index_differences(DiskCache), lambda: _setitem_differences(CPUCache, OffloadCache)):
        try:
            diffs += probe()
        except Exception as exc:  # noqa: BLE001  (a probe that cannot run is a difference too)
            diffs.append(f"probing compressed-tensors failed: {type(exc).__name__}: {exc}")
    return diffs


def check() -> None:
    """Raise CompressedTensorsDriftError unless the installed compressed-tensors matches."""
    diffs = differences()
    if diffs:
        raise CompressedTensorsDriftError(
            f"offcache {sys.modules['offcache'].__version__} puts the weights of compressed-tensors 0.19 and "
            f"0.20 on its engine; the installed compressed-tensors {version()} differs, so nothing was "
            "patched:\n  - " + "\n  - ".join(diffs) + "\nActivation offloading alone still works: "
            "offcache.patch_llmcompressor() (weights=False). For the weights, use compressed-tensors 0.19 "
            "or 0.20, or an offcache release for this one."
        )
