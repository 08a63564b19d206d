"""Put offcache's IntermediatesCache in place of llm-compressor's, and take it back."""

from __future__ import annotations

import sys

from offcache.cache import IntermediatesCache, IntermediateValue

# (module, attribute) -> the original object, while patched.
_originals: dict[tuple[str, str], object] = {}
_NAMES = ("IntermediatesCache", "IntermediateValue")


def patch_llmcompressor(weights: bool = False) -> list[str]:
    """Use offcache's cache in every llm-compressor module that holds the original.

    weights=True also puts compressed-tensors' offloaded model weights (CPU, disk) on the engine
    (offcache.compressed_tensors.patch); weights=False leaves the weights as they are.

    Covers the sequential pipeline, AWQ and any other module that imported the
    class (modules imported later by llm-compressor itself are covered too,
    since llmcompressor.pipelines.cache is patched at its source). Idempotent.
    Returns the patched module names.
    """
    # Import the modules that hold the class, so that they are patched too.
    import llmcompressor.modifiers.transform.awq.base  # noqa: F401
    import llmcompressor.pipelines.cache as source
    import llmcompressor.pipelines.sequential.pipeline  # noqa: F401

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
        from offcache import compressed_tensors

        compressed_tensors.patch()
    return sorted(set(patched) | {name for name, _ in _originals})


def unpatch_llmcompressor() -> None:
    """Restore llm-compressor's own classes wherever patch_llmcompressor() replaced them.

    Also restores compressed-tensors' weight offloading if weights=True patched it.
    """
    if "offcache.compressed_tensors" in sys.modules:
        sys.modules["offcache.compressed_tensors"].unpatch()
    for (name, attr), original in list(_originals.items()):
        module = sys.modules.get(name)
        if module is not None:
            setattr(module, attr, original)
    _originals.clear()
