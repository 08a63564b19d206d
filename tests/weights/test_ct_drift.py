"""The compressed-tensors drift guard (offcache/weights/drift.py): patch_llmcompressor(weights=True)
refuses a compressed-tensors whose offload caches differ from what offcache's subclasses rely on,
names it, its version and what differs, and patches nothing; activation offloading still works.

The drifts are simulated in the shapes of compressed-tensors' open pull requests: #786
(``onload(self, key, offloaded)``), #698 (``DiskCache.index`` keyed by ``id(offloaded)``) and
#703/#768 (``__setitem__`` no longer through ``update_offload``).
"""

import pytest

pytest.importorskip("compressed_tensors", reason="the guard checks compressed-tensors")
llmcompressor = pytest.importorskip("llmcompressor", reason="patch_llmcompressor needs llm-compressor")

import llmcompressor.pipelines.cache as lc_cache  # noqa: E402
from compressed_tensors.offload.cache import CPUCache, DiskCache, OffloadCache  # noqa: E402

import offcache  # noqa: E402
from offcache.weights import compressed_tensors as oc_ct  # noqa: E402
from offcache.weights import drift as ct_drift  # noqa: E402


@pytest.fixture
def clean():
    offcache.unpatch_llmcompressor()
    original = (lc_cache.IntermediatesCache, OffloadCache.__dict__["cls_from_device"])
    yield original
    offcache.unpatch_llmcompressor()


def assert_nothing_patched(original):
    assert lc_cache.IntermediatesCache is original[0]
    assert OffloadCache.__dict__["cls_from_device"] is original[1]
    assert not oc_ct.is_patched()


def refused(clean, *fragments):
    with pytest.raises(offcache.CompressedTensorsDriftError) as info:
        offcache.patch_llmcompressor(weights=True)
    message = str(info.value)
    assert "compressed-tensors" in message and ct_drift.version() in message
    for fragment in fragments:
        assert fragment in message, message
    assert_nothing_patched(clean)
    with pytest.raises(offcache.CompressedTensorsDriftError):
        oc_ct.patch()  # the weights patch alone refuses too
    assert_nothing_patched(clean)
    # Activation offloading alone is still offered.
    assert "llmcompressor.pipelines.cache" in offcache.patch_llmcompressor()
    assert lc_cache.IntermediatesCache is offcache.IntermediatesCache and not oc_ct.is_patched()
    return message


def test_the_installed_compressed_tensors_passes(clean):
    assert ct_drift.differences() == []
    offcache.patch_llmcompressor(weights=True)
    assert oc_ct.is_patched()


def test_offcache_overrides_match_what_the_guard_expects():
    for ours, upstream in ((oc_ct.OffcacheCPUCache, "CPUCache"), (oc_ct.OffcacheDiskCache, "DiskCache")):
        for name, want in ct_drift.EXPECTED[upstream].items():
            if name in vars(ours):
                assert ct_drift._parameters(getattr(ours, name)) == want, (ours.__name__, name)


def test_onload_taking_a_key_is_refused(clean, monkeypatch):
    """#786: onload(self, key, offloaded): offcache's override would get 3 positional arguments."""

    def onload(self, key, offloaded):
        return offloaded

    monkeypatch.setattr(CPUCache, "onload", onload)
    monkeypatch.setattr(DiskCache, "onload", onload)
    message = refused(clean, "CPUCache.onload takes (key, offloaded)", "DiskCache.onload takes (key, offloaded)")
    assert "offloaded" in message


def test_disk_index_keyed_by_id_is_refused(clean, monkeypatch):
    """#698: DiskCache.index keyed by id(offloaded): offcache looks it up by the tensor."""
    original = DiskCache.offload

    def offload(self, tensor, offloaded=None):
        meta = original(self, tensor, offloaded)
        if meta is not None and meta.device.type == "meta":
            DiskCache.index[id(meta)] = DiskCache.index.pop(meta)
        return meta

    monkeypatch.setattr(DiskCache, "offload", offload)
    refused(clean, "DiskCache.index is keyed by int")
    assert not any(isinstance(k, int) for k in DiskCache.index), "the probe leaves nothing behind"


def test_setitem_without_update_offload_is_refused(clean, monkeypatch):
    """#703/#768: __setitem__ no longer updates through update_offload."""

    def setitem(self, key, value):
        self.offloaded_values[key] = self.offload(value)

    monkeypatch.setattr(OffloadCache, "__setitem__", setitem)
    refused(clean, "__setitem__", "update_offload")


def test_a_renamed_update_offload_parameter_is_refused(clean, monkeypatch):
    def update_offload(self, offloaded, value):
        offloaded.copy_(value)

    monkeypatch.setattr(CPUCache, "update_offload", update_offload)
    refused(clean, "CPUCache.update_offload takes (offloaded, value)")


def test_the_probes_leave_no_state():
    before = (dict(DiskCache.index), OffloadCache.onloading_disabled)
    assert ct_drift.differences() == []
    assert (dict(DiskCache.index), OffloadCache.onloading_disabled) == before
