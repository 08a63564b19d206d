"""The drift guard: patch_llmcompressor() refuses an llm-compressor whose cache API differs from offcache's."""

import re
import sys
import types
from dataclasses import dataclass

import pytest
import torch

import offcache
from offcache import IntermediatesCache
from offcache.patch import LLMCompressorDriftError, api_differences

llmcompressor = pytest.importorskip("llmcompressor")


def test_the_installed_llmcompressor_matches():
    from llmcompressor.pipelines.cache import IntermediatesCache as upstream

    assert api_differences(upstream) == []


def upstream_like(**changes):
    """A copy of llm-compressor 0.14's IntermediatesCache API, with `changes` (None removes a method)."""

    class Drifted:
        def __init__(self, batch_intermediates=None, offload_device="cpu"): ...
        @classmethod
        def empty(cls, num_batches, offload_device): ...
        @classmethod
        def from_dataloader(cls, dataloader, model_device=None, offload_device=None): ...
        def fetch(self, batch_index, input_names=None): ...
        def pin_memory(self, batch_index, input_names=None): ...
        def update(self, batch_index, values): ...
        def delete(self, batch_index, consumed_names=None): ...
        def append(self, values): ...
        def size(self): ...
        def iter(self, input_names=None): ...
        def iter_prefetch(self, input_names=None): ...
        def __iter__(self): ...
        def __len__(self): ...
        @classmethod
        def _onload_value(cls, intermediate): ...
        @classmethod
        def _offload_value(cls, value, offload_device, onload_device=None): ...

    Drifted.__name__ = "IntermediatesCache"
    for name, attr in changes.items():
        if attr is None:
            delattr(Drifted, name)
        else:
            setattr(Drifted, name, attr)
    return Drifted


@dataclass
class Value:
    value: object
    device: object


def test_the_copy_of_the_upstream_api_matches():
    assert api_differences(upstream_like()) == []
    # offcache may add: a method upstream lacks, and parameters with defaults
    assert api_differences(upstream_like(iter_prefetch=None, __len__=None)) == []


def keys_fetch(self, key, input_names=None): ...
def prefetch_keys(self, input_names=None, keys=None): ...
def prefetch_required(self, keys, input_names=None): ...
def keyword_only(self, batch_index, *, input_names=None): ...
def no_default(self, batch_index, input_names): ...
def size(self): ...


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"fetch": keys_fetch}, "fetch: parameter 1 is key .* upstream, batch_index"),
        ({"iter_prefetch": prefetch_keys}, "iter_prefetch: parameter 2 is keys .* upstream, depth"),
        ({"iter_prefetch": prefetch_required}, "iter_prefetch: parameter 1 is keys"),
        ({"fetch": keyword_only}, "fetch: parameter 2 is input_names \\(keyword-only\\) upstream"),
        ({"empty": size}, "empty is a method upstream, a classmethod in offcache"),
        ({"__contains__": lambda self, key: True, "keys": lambda self: []}, "IntermediatesCache.keys is not in"),
        ({"fetch": no_default}, None),  # upstream requires what offcache defaults: still compatible
    ],
)
def test_a_drifted_class_is_found(changes, match):
    diffs = "\n".join(api_differences(upstream_like(**changes)))
    if match is None:
        assert diffs == ""
    else:
        assert re.search(match, diffs), diffs


@pytest.fixture
def fake_source(monkeypatch):
    """llmcompressor.pipelines.cache replaced by a fake module, for patch_llmcompressor() to inspect."""
    # Import every module patch_llmcompressor() imports first: imported while the fake is in
    # place, they would keep its classes.
    import llmcompressor.modifiers.transform.awq.base  # noqa: F401
    import llmcompressor.pipelines
    import llmcompressor.pipelines.cache as real
    import llmcompressor.pipelines.sequential.pipeline  # noqa: F401

    offcache.unpatch_llmcompressor()

    def install(cache_cls, value_cls):
        fake = types.ModuleType("llmcompressor.pipelines.cache")
        if cache_cls is not None:
            fake.IntermediatesCache = cache_cls
        if value_cls is not None:
            fake.IntermediateValue = value_cls
        monkeypatch.setitem(sys.modules, "llmcompressor.pipelines.cache", fake)
        monkeypatch.setattr(llmcompressor.pipelines, "cache", fake)
        return fake

    yield install
    monkeypatch.undo()
    assert sys.modules["llmcompressor.pipelines.cache"] is real
    assert llmcompressor.pipelines.sequential.pipeline.IntermediatesCache is real.IntermediatesCache  # nothing leaked


def test_patch_refuses_a_drifted_module_and_patches_nothing(fake_source):
    from llmcompressor.pipelines.sequential import pipeline as seq

    before = seq.IntermediatesCache
    fake = fake_source(upstream_like(iter_prefetch=prefetch_keys, __contains__=lambda self, key: False), Value)
    with pytest.raises(LLMCompressorDriftError) as info:
        offcache.patch_llmcompressor()
    text = str(info.value)
    assert f"llm-compressor {llmcompressor.__version__}" in text or "llm-compressor 0." in text
    assert "iter_prefetch: parameter 2 is keys" in text and "nothing was patched" in text
    assert seq.IntermediatesCache is before and fake.IntermediatesCache is not IntermediatesCache
    assert offcache.patch._originals == {}


def test_patch_refuses_when_intermediate_value_is_gone_or_changed(fake_source):
    fake_source(upstream_like(), None)
    with pytest.raises(LLMCompressorDriftError, match="IntermediateValue does not exist"):
        offcache.patch_llmcompressor()

    @dataclass
    class Renamed:
        value: object
        onload_device: object

    fake_source(upstream_like(), Renamed)
    with pytest.raises(LLMCompressorDriftError, match="fields are \\['value', 'onload_device'\\]"):
        offcache.patch_llmcompressor()


def test_patch_accepts_a_matching_fake_module(fake_source):
    fake = fake_source(upstream_like(), Value)
    try:
        assert "llmcompressor.pipelines.cache" in offcache.patch_llmcompressor()
        assert fake.IntermediatesCache is IntermediatesCache
        offcache.patch_llmcompressor()  # idempotent: the remembered original is checked again
    finally:
        offcache.unpatch_llmcompressor()


# `in` -------------------------------------------------------------------------------------------


def test_in_asks_about_a_batch_and_a_name_without_fetching(host_engine, monkeypatch):
    cache = IntermediatesCache.empty(3, "cpu")
    cache.update(1, {"hidden": torch.ones(4)})
    monkeypatch.setattr(IntermediatesCache, "fetch", lambda *a, **k: pytest.fail("`in` fetched a batch"))
    monkeypatch.setattr(IntermediatesCache, "__iter__", lambda self: pytest.fail("`in` iterated the cache"))
    assert (1, "hidden") in cache and (0, "hidden") not in cache and (1, "other") not in cache
    assert (5, "hidden") not in cache and (-2, "hidden") in cache
    assert 2 in cache and 3 not in cache and -3 in cache and -4 not in cache
    for bad in ("hidden", (True, "hidden"), ("1", "hidden"), 1.0, None):
        with pytest.raises(TypeError, match="\\(batch_index, name\\) or a batch index"):
            bad in cache  # noqa: B015
