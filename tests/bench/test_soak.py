"""A small soak: repeated store/fetch/delete keeps pinned bytes and RSS flat."""

import torch

import offcache
from offcache.bench.soak import soak


def test_small_soak_is_flat(host_engine):
    result = soak(20000, torch.device("cpu"), samples=12)
    assert result["pinned_in_use_after_gc"] == 0
    assert result["pinned_in_use_growth_bytes"] <= 0
    assert result["pinned_reserved_growth_bytes"] <= 0
    # A leak of one small object per store (~500 B) would add ~3 MiB here.
    assert result["rss_growth_bytes"] < 1536 << 10
    assert offcache.stats()["dedup_entries"] <= 2048
