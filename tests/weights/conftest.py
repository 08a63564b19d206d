"""Fixtures of the weights' tests (compressed-tensors is imported by the tests that need it, not here:
the newest CI stage has none)."""

import pytest


@pytest.fixture
def patched(engine_config, request):
    """compressed-tensors' caches are offcache's for one test, on the host backend with slowed copies
    (asynchronous bugs show): a module's WEIGHTS_COPY_DELAY_US, else 2 ms a copy."""
    from compressed_tensors.offload.cache.base import OffloadCache

    from offcache.weights import compressed_tensors as oc_ct

    engine_config(backend="host", host_copy_delay_us=getattr(request.module, "WEIGHTS_COPY_DELAY_US", 2000))
    oc_ct.patch()
    yield
    oc_ct.unpatch()
    OffloadCache.keep_onloaded_values.clear()
