"""offcache: GPU <-> pinned-host tensor cache with asynchronous copies.

import offcache
offcache.patch_llmcompressor()   # llm-compressor now uses offcache's cache
"""

__version__ = "0.2.0"

import torch  # noqa: F401  (loads libtorch before the extension)

from offcache._engine import (
    CapacityWarning,
    HostLimitError,
    SpillWarning,
    build_info,
    configure,
    empty_cache,
    record_stream,
    set_pinned_limit,
    stats,
    synchronize,
)
from offcache._extras import MissingExtraError
from offcache.cache import IntermediatesCache, IntermediateValue
from offcache.ct_drift import CompressedTensorsDriftError
from offcache.kv import kv_bytes, kv_bytes_for_config
from offcache.patch import LLMCompressorDriftError, patch_llmcompressor, unpatch_llmcompressor


def __getattr__(name):
    # OffloadedKVCache needs transformers: imported on first use only.
    if name in ("OffloadedKVCache", "OffloadedStaticKVCache"):
        from offcache._extras import require

        require("transformers", "kv", f"offcache.{name}")
        from offcache import kv_cache

        return getattr(kv_cache, name)
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
