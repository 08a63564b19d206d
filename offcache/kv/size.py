"""KV-cache size and cost arithmetic, and ``python -m offcache.plan kv`` (alias: ``python -m offcache.kv size``).

kv_bytes = 2 (K and V) x layers x batch x tokens x kv_heads x head_dim x bytes per value

Static caches, per decoded token with `tokens` filled, over the offloaded (full-attention) layers:
offcache's OffloadedStaticKVCache moves D2H the new token's K/V and H2D the filled prefix;
transformers' StaticCache(offloading=True) moves each layer's whole max_cache_len buffer both ways.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from offcache.util.units import positive_int as _positive_int

GiB = 1024**3


def _itemsize(dtype: torch.dtype | str | int) -> int:
    if isinstance(dtype, int):
        return dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""))
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes(layers: int, batch: int, tokens: int, kv_heads: int, head_dim: int, dtype=torch.bfloat16) -> int:
    """Bytes of K and V for `layers` full-attention layers (dtype: torch dtype, name, or bytes per value)."""
    for name, v in (("layers", layers), ("batch", batch), ("tokens", tokens), ("kv_heads", kv_heads),
                    ("head_dim", head_dim)):  # fmt: skip
        if int(v) != v or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    return 2 * layers * batch * tokens * kv_heads * head_dim * _itemsize(dtype)


def _shape_of(config, dtype=None) -> dict:
    """kv_heads, head_dim, dtype, layer kinds and window of a transformers config."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    window = getattr(text, "sliding_window", None) or getattr(text, "attention_chunk_size", None)
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None:
        layer_types = ["sliding_attention" if window else "full_attention"] * text.num_hidden_layers
    return {
        "kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "dtype": dtype or getattr(text, "dtype", None) or getattr(text, "torch_dtype", None) or torch.bfloat16,
        "full_layers": sum(kind in ("full_attention", "attention") for kind in layer_types),
        "sliding_layers": sum(kind in ("sliding_attention", "chunked_attention") for kind in layer_types),
        "window": window,
    }


def kv_bytes_for_config(config, batch: int, tokens: int, dtype=None) -> int:
    """Bytes of K and V for a transformers config; sliding layers hold at most their window."""
    c = _shape_of(config, dtype)
    total = kv_bytes(c["full_layers"], batch, tokens, c["kv_heads"], c["head_dim"], c["dtype"])
    if c["window"]:
        total += kv_bytes(c["sliding_layers"], batch, min(tokens, c["window"]), c["kv_heads"], c["head_dim"],
                          c["dtype"])  # fmt: skip
    return total  # linear-attention and other state layers hold no per-token K/V


def static_traffic(layers: int, batch: int, tokens: int, max_cache_len: int, kv_heads: int, head_dim: int,
                   dtype=torch.bfloat16) -> dict:  # fmt: skip
    """Bytes per decoded token with `tokens` filled, over `layers` offloaded full-attention layers.

    offcache: D2H the new token's K/V, H2D the filled prefix. transformers' static offloading:
    the whole max_cache_len buffer of each layer, both ways.
    """
    if tokens > max_cache_len:
        raise ValueError(f"tokens ({tokens}) must not exceed max_cache_len ({max_cache_len})")
    return {
        "offcache_d2h": kv_bytes(layers, batch, 1, kv_heads, head_dim, dtype),
        "offcache_h2d": kv_bytes(layers, batch, tokens, kv_heads, head_dim, dtype),
        "transformers_d2h": kv_bytes(layers, batch, max_cache_len, kv_heads, head_dim, dtype),
        "transformers_h2d": kv_bytes(layers, batch, max_cache_len, kv_heads, head_dim, dtype),
    }


def measured_h2d_gbps(results_json: str | Path) -> float:
    """The largest-size offcache fetch bandwidth recorded by offcache.bench."""
    rows = json.loads(Path(results_json).read_text())["transfer"]
    fetch = [r for r in rows if r["impl"] == "offcache" and r["direction"] == "fetch"]
    return max(fetch, key=lambda r: r["bytes"])["gbps"]


def _size_text(n: int) -> str:
    """GiB to 4 decimals from 0.01 GiB up; below, the unit that shows the size (1024 bytes = 1 KiB, not 0.0000 GiB)."""
    if n >= GiB // 100:
        return f"{n / GiB:.4f} GiB"
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} bytes"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m offcache.kv", description="KV-cache size and H2D cost")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("size", help="size of a KV cache and the H2D time it costs per decoded token")
    s.add_argument("--config", help="a transformers config.json (or its folder)")
    s.add_argument("--layers", type=_positive_int)
    s.add_argument("--kv-heads", type=_positive_int)
    s.add_argument("--head-dim", type=_positive_int)
    s.add_argument("--batch", type=_positive_int, default=1)
    s.add_argument("--tokens", type=_positive_int, required=True)
    s.add_argument("--dtype", default="bfloat16")
    s.add_argument(
        "--max-cache-len", type=_positive_int, help="static cache size for the static traffic (default: --tokens)"
    )
    bw = s.add_mutually_exclusive_group()
    bw.add_argument("--bandwidth-gbps", type=float, help="H2D bandwidth in GB/s")
    bw.add_argument("--bench-results", help="results.json from offcache.bench: use its measured fetch bandwidth")
    a = p.parse_args(argv)

    if a.config:
        from offcache.util.extras import MissingExtraError
        from offcache.util.model_config import load_config

        try:
            config = load_config(a.config)
        except MissingExtraError as exc:
            p.exit(2, f"{p.prog}: {exc}\n")  # one line: what to install
        except (ValueError, OSError) as exc:
            p.error(str(exc))
        size = kv_bytes_for_config(config, a.batch, a.tokens, a.dtype)
        c = _shape_of(config, a.dtype)
        full, kv_heads, head_dim = c["full_layers"], c["kv_heads"], c["head_dim"]
    else:
        missing = [f for f in ("layers", "kv_heads", "head_dim") if getattr(a, f) is None]
        if missing:
            p.error("without --config, give " + ", ".join("--" + m.replace("_", "-") for m in missing))
        size = kv_bytes(a.layers, a.batch, a.tokens, a.kv_heads, a.head_dim, a.dtype)
        full, kv_heads, head_dim = a.layers, a.kv_heads, a.head_dim
    max_len = a.max_cache_len or a.tokens
    if max_len < a.tokens:
        p.error(f"--max-cache-len ({max_len}) must be at least --tokens ({a.tokens})")
    print(f"KV cache: {size} bytes = {_size_text(size)}")
    gbps = a.bandwidth_gbps or (measured_h2d_gbps(a.bench_results) if a.bench_results else None)
    if gbps:
        per_token = size / (gbps * 1e9)
        print(f"H2D per decoded token (whole cache at {gbps:.2f} GB/s): {per_token * 1e3:.3f} ms")
    t = static_traffic(full, a.batch, a.tokens, max_len, kv_heads, head_dim, a.dtype)
    print(f"Static cache, max_cache_len {max_len}, {full} offloaded full-attention layers, per decoded token:")
    labels = {"offcache": "offcache.OffloadedStaticKVCache", "transformers": "StaticCache(offloading=True)"}
    for who, label in labels.items():
        line = f"  {label:<31}: D2H {t[who + '_d2h']} bytes, H2D {t[who + '_h2d']} bytes"
        if gbps:
            line += f" ({t[who + '_h2d'] / (gbps * 1e9) * 1e3:.3f} ms H2D at {gbps:.2f} GB/s)"
        print(line)
    if t["offcache_h2d"]:
        print(f"  H2D ratio transformers / offcache: {t['transformers_h2d'] / t['offcache_h2d']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
