"""KV caches: transformers' DynamicCache and StaticCache with their K/V offloaded on the engine.

    dynamic.py   OffloadedKVCache (a DynamicCache), cache_kwarg()
    static.py    OffloadedStaticKVCache (a StaticCache), compile-safe
    resident.py  operations both caches apply to resident (not offloaded) layers
    size.py      what a KV cache holds and costs to move (``python -m offcache.kv size``)

The caches need transformers (``pip install 'offcache[kv]'``) and are imported on first use.
"""

from offcache.kv.size import kv_bytes, kv_bytes_for_config, measured_h2d_gbps, static_traffic

_LAZY = {"OffloadedKVCache": "dynamic", "cache_kwarg": "dynamic", "OffloadedStaticKVCache": "static"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        from offcache.util.extras import require

        require("transformers", "kv", f"offcache.kv.{name}")
        return getattr(importlib.import_module(f"offcache.kv.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'offcache.kv' has no attribute {name!r}")


__all__ = [
    "OffloadedKVCache",
    "OffloadedStaticKVCache",
    "cache_kwarg",
    "kv_bytes",
    "kv_bytes_for_config",
    "measured_h2d_gbps",
    "static_traffic",
]
