"""Put offcache's IntermediatesCache in place of llm-compressor's, and take it back.

Before anything is patched, the installed llm-compressor's classes are compared with
offcache's (the drift guard): offcache never patches into an API it does not implement.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys

from offcache.activations.cache import IntermediatesCache, IntermediateValue
from offcache.util.extras import require

# (module, attribute) -> the original object, while patched.
_originals: dict[tuple[str, str], object] = {}
_NAMES = ("IntermediatesCache", "IntermediateValue")
# Methods llm-compressor itself calls although their names are private.
_PRIVATE_API = ("_onload_value", "_offload_value")


class LLMCompressorDriftError(RuntimeError):
    """The installed llm-compressor's cache API differs from the one offcache implements."""


def _methods(cls: type) -> dict[str, object]:
    """Public methods (and the private ones llm-compressor calls), with how they are bound."""
    out = {}
    for klass in reversed(cls.__mro__[:-1]):  # not object's
        for name, attr in vars(klass).items():
            public = not name.startswith("_") or name in _PRIVATE_API or (name.startswith("__") and name.endswith("__"))
            if public and (callable(attr) or isinstance(attr, (classmethod, staticmethod, property))):
                out[name] = attr
    for skip in ("__init_subclass__", "__subclasshook__", "__class_getitem__", "__repr__", "__eq__", "__hash__",
                 "__getstate__", "__setstate__", "__copy__", "__deepcopy__", "__post_init__"):  # fmt: skip
        out.pop(skip, None)
    return out


def _kind(attr) -> str:
    return {classmethod: "classmethod", staticmethod: "staticmethod", property: "property"}.get(type(attr), "method")


def _signature(attr):
    func = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
    if isinstance(attr, property):
        return None
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        return None


def api_differences(upstream: type, ours: type = IntermediatesCache) -> list[str]:
    """How `ours` fails to implement `upstream`'s API; empty when every call upstream allows works on ours.

    Every public method of `upstream` must exist in `ours`, bound the same way (method,
    classmethod, staticmethod), with the same parameters in the same order and of the same
    kinds; a parameter with a default upstream has one here too. `ours` may add methods, and
    parameters after upstream's that have defaults.
    """
    theirs, mine = _methods(upstream), _methods(ours)
    diffs = []
    for name, attr in sorted(theirs.items()):
        if name not in mine:
            diffs.append(f"{upstream.__name__}.{name} is not in offcache's class")
            continue
        if _kind(attr) != _kind(mine[name]):
            diffs.append(f"{name} is a {_kind(attr)} upstream, a {_kind(mine[name])} in offcache")
            continue
        a, b = _signature(attr), _signature(mine[name])
        if a is None or b is None:
            continue
        pa, pb = list(a.parameters.values()), list(b.parameters.values())
        for i, p in enumerate(pa):
            q = pb[i] if i < len(pb) else None
            if q is None or (q.name, q.kind) != (p.name, p.kind):
                got = f"{q.name} ({q.kind.description})" if q else "nothing"
                diffs.append(f"{name}: parameter {i} is {p.name} ({p.kind.description}) upstream, {got} in offcache")
                break
            if p.default is not p.empty and q.default is q.empty:
                diffs.append(f"{name}: {p.name} has a default upstream, none in offcache")
        for q in pb[len(pa) :]:
            if q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD):
                diffs.append(f"{name}: offcache's {q.name} has no default and upstream does not pass it")
    return diffs


def _value_differences(upstream) -> list[str]:
    if upstream is None:
        return ["llmcompressor.pipelines.cache.IntermediateValue does not exist"]
    if not dataclasses.is_dataclass(upstream):
        return ["IntermediateValue is no longer a dataclass"]
    names = [f.name for f in dataclasses.fields(upstream)]
    return [] if names == ["value", "device"] else [f"IntermediateValue's fields are {names}, not ['value', 'device']"]


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("llmcompressor")
    except Exception:
        return getattr(sys.modules.get("llmcompressor"), "__version__", "unknown")


def check_llmcompressor(source) -> None:
    """Raise LLMCompressorDriftError unless `source` (llmcompressor.pipelines.cache) matches offcache's API."""
    cache = _originals.get((source.__name__, "IntermediatesCache"), getattr(source, "IntermediatesCache", None))
    value = _originals.get((source.__name__, "IntermediateValue"), getattr(source, "IntermediateValue", None))
    diffs = _value_differences(value)
    if cache is None:
        diffs.append("llmcompressor.pipelines.cache.IntermediatesCache does not exist")
    elif cache is not IntermediatesCache:
        diffs += api_differences(cache)
    if diffs:
        raise LLMCompressorDriftError(
            f"offcache {sys.modules['offcache'].__version__} implements llm-compressor 0.14's IntermediatesCache; "
            f"the installed llm-compressor {_version()} differs, so nothing was patched:\n  - "
            + "\n  - ".join(diffs)
            + "\nUse the llm-compressor version offcache supports, or an offcache release for this one."
        )


def patch_llmcompressor(weights: bool = False) -> list[str]:
    """Use offcache's cache in every llm-compressor module that holds the original.

    weights=True also puts compressed-tensors' offloaded model weights (CPU, disk) on the engine
    (offcache.weights.ct_patch.patch); weights=False leaves the weights as they are.

    Covers the sequential pipeline, AWQ and any other module that imported the
    class (modules imported later by llm-compressor itself are covered too,
    since llmcompressor.pipelines.cache is patched at its source). Idempotent.
    Returns the patched module names. Refuses (LLMCompressorDriftError, nothing
    patched) when the installed llm-compressor's API differs from offcache's; with
    weights=True also (CompressedTensorsDriftError, nothing patched) when compressed-tensors'
    offload caches differ from what offcache's subclasses rely on.
    """
    require("llmcompressor", "llmcompressor", "offcache.patch_llmcompressor()")
    # Import the modules that hold the class, so that they are patched too.
    import llmcompressor.modifiers.transform.awq.base  # noqa: F401
    import llmcompressor.pipelines.cache as source
    import llmcompressor.pipelines.sequential.pipeline  # noqa: F401

    check_llmcompressor(source)
    if weights:  # compressed-tensors' caches too, before anything is patched (CompressedTensorsDriftError)
        from offcache.weights import drift as ct_drift

        ct_drift.check()
    # Once patched, the source module holds ours: the originals are remembered.
    originals = {attr: _originals.get((source.__name__, attr), getattr(source, attr)) for attr in _NAMES}
    replacements = {"IntermediatesCache": IntermediatesCache, "IntermediateValue": IntermediateValue}
    patched = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("llmcompressor"):
            continue
        for attr in _NAMES:
            if getattr(module, attr, None) is originals[attr]:
                _originals[(name, attr)] = originals[attr]
                setattr(module, attr, replacements[attr])
                patched.append(name)
    if weights:
        from offcache.weights import ct_patch

        ct_patch.patch()
    return sorted(set(patched) | {name for name, _ in _originals})


def unpatch_llmcompressor() -> None:
    """Restore llm-compressor's own classes wherever patch_llmcompressor() replaced them.

    Also restores compressed-tensors' weight offloading if weights=True patched it.
    """
    if "offcache.weights.ct_patch" in sys.modules:
        sys.modules["offcache.weights.ct_patch"].unpatch()
    for (name, attr), original in list(_originals.items()):
        module = sys.modules.get(name)
        if module is not None:
            setattr(module, attr, original)
    _originals.clear()
