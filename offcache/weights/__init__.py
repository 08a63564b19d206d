"""Offloaded model weights: compressed-tensors' offload caches on the engine.

    compressed_tensors.py  OffcacheCPUCache / OffcacheDiskCache, the prefetcher, patch()/unpatch()
    bookkeeping.py         the state they share: prefetched copies, write-backs in flight, records
    files.py               where a checkpoint's tensors lie in their safetensors files
    drift.py               the guard that compressed-tensors is the version these classes mirror

compressed_tensors.py needs compressed-tensors (``pip install 'offcache[llmcompressor]'``); import it
by name: ``from offcache.weights import compressed_tensors``.
"""
