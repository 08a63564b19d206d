"""What the KV caches count beside the engine's stats(): the work per layer and decode step.

The engine counts copies and bytes (``h2d_copies``, ``d2h_bytes``, ``chunks_made``, ...); these
are what it cannot see: how many layer updates ran and how many bytes of new tokens they were
given (the denominator of every per-layer-step figure), the device tensors allocated for the K/V
the updates return, and the host-side bytes a layer moves between arena buffers (which the engine
counts in ``d2h_bytes`` with the device-to-host copies). Process-wide, never reset: read deltas
(``python -m offcache.bench kv`` does).
"""

from __future__ import annotations

KV_COUNTERS: dict[str, int] = {
    "kv_layer_updates": 0,  # updates of offloaded layers (one per layer and forward pass)
    "kv_new_token_bytes": 0,  # bytes of the K and V those updates were given (the new tokens)
    "kv_output_allocations": 0,  # device allocations made for the K/V the updates return (prefetches too)
    "kv_host_copy_bytes": 0,  # host to host: arena buffers made (the store's copy) and prefixes moved into them
    "kv_buffer_moves": 0,  # a layer's K/V moved to new arena buffers (grown, or handed out before the update)
}


def count(**deltas: int) -> None:
    for name, delta in deltas.items():
        KV_COUNTERS[name] += delta


def kv_stats() -> dict[str, int]:
    """A copy of KV_COUNTERS."""
    return dict(KV_COUNTERS)
