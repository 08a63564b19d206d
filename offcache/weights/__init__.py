"""Offloaded model weights: compressed-tensors' offload caches on the engine.

    caches.py              OffcacheCPUCache / OffcacheDiskCache and the onload they share
    compressed_tensors.py  the prefetcher and patch() / unpatch(), which install the classes
    node.py                NodeSharedCPUCache: one shared region per node under torch.distributed
    node_region.py         that region: its memfd, allocator, registered mappings, generation words
    bookkeeping.py         the state they share: prefetched copies, write-backs in flight, records
    files.py               where a checkpoint's tensors lie in their safetensors files
    drift.py               the guard that compressed-tensors is the version these classes mirror

caches.py, compressed_tensors.py and node.py need compressed-tensors (``pip install
'offcache[llmcompressor]'``); import them by name: ``from offcache.weights import compressed_tensors``.
"""
