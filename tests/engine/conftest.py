"""Fixtures of the engine's tests."""

import pytest


@pytest.fixture
def cuda_engine(engine_config):
    """The CUDA backend for one test (the GPU files use it for every test)."""
    engine_config(backend="cuda")
