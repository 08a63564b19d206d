"""The plain static-layer operations OffloadedStaticKVCache relies on: transformers' crop rule (negative
"remove n", or the legacy positive "keep n" where the installed transformers still takes it), the refusal
to crop a sliding layer that already dropped tokens, and crop / batch operations on the resident
``StaticLayer`` / ``StaticSlidingWindowLayer`` (StaticCache's have no batch operations, and before
transformers 5.24 no crop)."""

from __future__ import annotations

import torch

from offcache.util.extras import as_missing

try:
    from transformers.cache_utils import DynamicLayer, StaticLayer
except ModuleNotFoundError as _missing:  # one line naming the extra, as offcache.OffloadedKVCache gives
    raise as_missing(_missing, "transformers", "kv", "offcache.kv.static") from None


def crop_count(tokens_to_remove: int, current: int) -> int:
    """transformers' crop argument: negative, tokens to remove; positive (legacy), the length to keep,
    where the installed transformers still takes that form."""
    if tokens_to_remove > 0:
        _refuse_positive_crop(tokens_to_remove)
        return 0 if tokens_to_remove >= current else current - tokens_to_remove
    return -tokens_to_remove


def _refuse_positive_crop(tokens_to_remove: int) -> None:
    """A positive crop, refused with the installed transformers' own error where it refuses one: 5.24's
    StaticLayer.crop takes negative values only; before it, static layers had no crop and the dynamic
    rule applies (5.23 refuses a positive value, 5.17 warns that it is deprecated)."""
    if "crop" in vars(StaticLayer):
        StaticLayer(max_cache_len=1).crop(tokens_to_remove)  # a throwaway layer: raises
    else:
        DynamicLayer().crop(tokens_to_remove)  # an empty layer: raises, warns, or keeps all


def check_croppable(layer, remove: int) -> None:
    """A sliding layer past its window has dropped tokens: cropping cannot bring them back."""
    if remove and getattr(layer, "is_sliding", False) and layer.get_seq_length() > layer.max_cache_len:
        raise RuntimeError(
            "`crop` was called, but the current layer does not track past states, and the sliding window size was "
            "already reached: a static sliding window layer cannot be rolled back"
        )


def resident_op(layer, op: str, arg) -> None:
    """crop / batch_repeat_interleave / batch_select_indices on a resident ``StaticLayer`` or
    ``StaticSlidingWindowLayer`` (exactly those: a subclass's own state, as a hybrid layer's linear-attention
    states, is not touched here). StaticCache's layers have no batch operations."""
    if not layer.is_initialized:
        return
    if op == "crop":
        current = int(layer.get_seq_length())
        remove = crop_count(arg, current)
        check_croppable(layer, remove)
        if hasattr(layer, "cumulative_length_int"):
            layer.cumulative_length_int -= remove
        layer.cumulative_length.sub_(remove)
        return  # positions past the length are masked, and rewritten before they are read
    if op == "batch_repeat_interleave":
        layer.keys, layer.values = (t.repeat_interleave(arg, dim=0) for t in (layer.keys, layer.values))
    else:
        idx = arg.to(layer.keys.device) if isinstance(arg, torch.Tensor) else arg
        layer.keys, layer.values = layer.keys[idx].contiguous(), layer.values[idx].contiguous()
    layer.batch_size = layer.keys.shape[0]
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(layer.keys)
        torch._dynamo.mark_static_address(layer.values)
