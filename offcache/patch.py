"""Put offcache's IntermediatesCache in place of llm-compressor's, and take it back."""

from __future__ import annotations

import sys

from offcache.cache import IntermediatesCache, IntermediateValue

# (module, attribute) -> the original object, while patched.
_originals: dict[tuple[str, str], object] = {}
_NAMES = ("IntermediatesCache", "IntermediateValue")


def patch_llmcompressor() -> list[str]:
    """Use offcache's cache in every llm-compressor module that holds the original.

    Covers the sequential pipeline, AWQ and any other module that imported the
    class (modules imported later by llm-compressor itself are covered too,
    since llmcompressor.pipelines.cache is patched at its source). Idempotent.
    Returns the patched module names.
    """
    import llmcompressor.modifiers.transform.awq.base  # noqa: F401
    import llmcompressor.pipelines.cache as source  # noqa: F401  (import the original)
    import llmcompressor.pipelines.sequential.pipeline  # noqa: F401
    from llmcompressor.pipelines import cache as original_module

    originals = {
        "IntermediatesCache": _originals.get(
            ("llmcompressor.pipelines.cache", "IntermediatesCache"), original_module.IntermediatesCache
        ),
        "IntermediateValue": _originals.get(
            ("llmcompressor.pipelines.cache", "IntermediateValue"), original_module.IntermediateValue
        ),
    }
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
    return sorted(set(patched) | {name for name, _ in _originals})


def unpatch_llmcompressor() -> None:
    """Restore llm-compressor's own classes wherever patch_llmcompressor() replaced them."""
    for (name, attr), original in list(_originals.items()):
        module = sys.modules.get(name)
        if module is not None:
            setattr(module, attr, original)
    _originals.clear()
