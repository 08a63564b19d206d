"""Shared fixtures. GPU tests are marked `gpu` and skipped here, in one place."""

import atexit
import os
import shutil
import tempfile

import pytest
import torch

# The disk tier's folder for this test session (its files have no names; the folder is removed at exit).
DISK_DIR = tempfile.mkdtemp(prefix="offcache-tests-disk-")
atexit.register(shutil.rmtree, DISK_DIR, True)
# OFFCACHE_DISK_DIR=auto (the default) uses $XDG_CACHE_HOME/offcache: the tests' own, not the user's.
XDG_CACHE_HOME = tempfile.mkdtemp(prefix="offcache-tests-xdg-")
atexit.register(shutil.rmtree, XDG_CACHE_HOME, True)
os.environ["XDG_CACHE_HOME"] = XDG_CACHE_HOME

import offcache  # noqa: E402  (after XDG_CACHE_HOME: the engine, configured at its first call, reads it)

# The engine configurations the model-based tests run under, by id.
ENGINE_CONFIGS = {
    "default": {},
    "host": {"backend": "host"},
    # A 1 MiB budget and slowed copies: spills, and wide race windows.
    "host-1MiB-slow": {"backend": "host", "pinned_limit": "1MiB", "min_chunk": "256KiB", "host_copy_delay_us": 200},
    # No host memory for values at all: every value crosses the disk tier.
    "host-disk": {
        "backend": "host",
        "pinned_limit": "1MiB",
        "min_chunk": "256KiB",
        "host_limit": 0,
        "disk_dir": DISK_DIR,
    },
}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


_GPU_MEMORY_CAPPED = []


@pytest.fixture(autouse=True)
def _gpu_memory_share(request):
    """Before the first gpu-marked test of a process: its caching allocator capped at its share of the GPU
    (tests.helpers.gpu_memory_fraction), so that no test takes the memory of the workers beside it."""
    if request.node.get_closest_marker("gpu") is not None and not _GPU_MEMORY_CAPPED and torch.cuda.is_available():
        from tests.helpers import cap_gpu_memory

        cap_gpu_memory()
        _GPU_MEMORY_CAPPED.append(True)
    yield


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


@pytest.fixture(params=list(ENGINE_CONFIGS))
def engine(request, engine_config):
    """The engine under each configuration of ENGINE_CONFIGS (narrow with indirect parametrize)."""
    config = ENGINE_CONFIGS[request.param]
    engine_config(**config)
    return config


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Llama checkpoint on disk (3 layers, hidden 128), made once a session."""
    from tests.helpers import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
