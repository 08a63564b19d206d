"""Shared fixtures. GPU tests are marked `gpu` and skipped here, in one place."""

import os

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


def backend_configs():
    """The engine configurations every model-based test runs under."""
    return [
        pytest.param({}, id="default"),
        pytest.param({"backend": "host"}, id="host"),
        pytest.param(
            {"backend": "host", "pinned_limit": "1MiB", "min_chunk": "256KiB", "host_copy_delay_us": 200},
            id="host-1MiB-slow",
        ),
    ]


CPU = torch.device("cpu")
GPU_DEVICE = torch.device(os.environ.get("OFFCACHE_TEST_DEVICE", "cuda:0"))
