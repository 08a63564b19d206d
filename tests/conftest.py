"""Shared fixtures. GPU tests are marked `gpu` and skipped here, in one place."""

import pytest
import torch

import offcache


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def engine_config():
    """Reconfigure the process-wide engine for one test, then restore the default."""

    def apply(**kwargs):
        offcache.configure(**kwargs)

    yield apply
    offcache.synchronize()
    offcache.configure()


@pytest.fixture
def host_engine(engine_config):
    engine_config(backend="host")
    return engine_config
