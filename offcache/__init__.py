"""offcache: GPU <-> pinned-host tensor cache with asynchronous copies.

import offcache
offcache.patch_llmcompressor()   # llm-compressor now uses offcache's cache
"""

__version__ = "0.1.0"

import torch  # noqa: F401  (loads libtorch before the extension)

from offcache._engine import (
    SpillWarning,
    build_info,
    configure,
    set_pinned_limit,
    stats,
    synchronize,
)
from offcache.cache import IntermediatesCache, IntermediateValue
from offcache.patch import patch_llmcompressor, unpatch_llmcompressor

__all__ = [
    "IntermediateValue",
    "IntermediatesCache",
    "SpillWarning",
    "build_info",
    "configure",
    "patch_llmcompressor",
    "set_pinned_limit",
    "stats",
    "synchronize",
    "unpatch_llmcompressor",
]
