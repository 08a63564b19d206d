"""Offloaded model weights: compressed-tensors' offload caches on the engine.

    interface.py           WeightCache: what the onload and the prefetcher call on a cache
    bookkeeping.py         WeightState: the prefetch table, write-backs and reads in flight, the counters
    caches.py              OffcacheCPUCache / OffcacheDiskCache (EngineCache: the interface on the engine)
    ct_patch.py            the prefetcher and patch() / unpatch(), which install the classes
    compressed_tensors.py  ct_patch.py under its documented path, offcache.weights.compressed_tensors
    files.py               where a checkpoint's tensors lie in their safetensors files
    drift.py               the guard that compressed-tensors is the version these classes mirror
    node/                  the node-shared caches under torch.distributed (node/__init__.py maps it)
    memory/                under a memory limit: placement, fit (SubgraphMemoryError), file-backed
                           weights, the heap trim

caches.py, ct_patch.py and node/ need compressed-tensors (``pip install
'offcache[llmcompressor]'``); import them by name: ``from offcache.weights import compressed_tensors``.
"""

# The weight_* counters are in offcache.stats() from the import on, as they were when the engine held them.
from offcache.weights.bookkeeping import WEIGHTS  # noqa: F401
