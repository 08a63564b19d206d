"""offcache: GPU <-> pinned-host tensor cache with asynchronous copies.

The package, one folder per concern (docs/design.md has the map; imports point down):
util <- engine <- activations, weights, kv <- plan <- patch <- this module <- bench.

import offcache
offcache.patch_llmcompressor()   # llm-compressor now uses offcache's cache
"""

__version__ = "0.2.0"

import torch  # noqa: F401  (loads libtorch before the extension)

from offcache.activations.cache import IntermediatesCache, IntermediateValue
from offcache.engine import (
    CapacityWarning,
    HostLimitError,
    SpillWarning,
    configure,
    empty_cache,
    record_stream,
    set_pinned_limit,
    stats,
    synchronize,
)
from offcache.kv import kv_bytes, kv_bytes_for_config
from offcache.patch import LLMCompressorDriftError, patch_llmcompressor, unpatch_llmcompressor
from offcache.util.extras import MissingExtraError
from offcache.weights.drift import CompressedTensorsDriftError


def build_info() -> dict:
    """Version (with the build variant, e.g. 0.2.0+cu130 or 0.2.0+cpu), torch, CUDA and backend."""
    from offcache import engine

    return engine.build_info(__version__)


def __getattr__(name):
    # OffloadedKVCache needs transformers: imported on first use only.
    if name in ("OffloadedKVCache", "OffloadedStaticKVCache"):
        from offcache.util.extras import require

        require("transformers", "kv", f"offcache.{name}")
        import offcache.kv

        return getattr(offcache.kv, name)
    raise AttributeError(f"module 'offcache' has no attribute {name!r}")


__all__ = [
    "CapacityWarning",
    "CompressedTensorsDriftError",
    "HostLimitError",
    "IntermediateValue",
    "IntermediatesCache",
    "LLMCompressorDriftError",
    "MissingExtraError",
    "OffloadedKVCache",
    "OffloadedStaticKVCache",
    "SpillWarning",
    "build_info",
    "configure",
    "empty_cache",
    "kv_bytes",
    "kv_bytes_for_config",
    "patch_llmcompressor",
    "record_stream",
    "set_pinned_limit",
    "stats",
    "synchronize",
    "unpatch_llmcompressor",
]
