"""No GPU test takes the whole GPU's memory: each test process is capped at its share of it.

On the H200 (2026-12-04) one gpu test filled the GPU (132.8 of 139.8 GiB, the staging out-of-memory test
of tests/engine/test_gpu_streams.py as it was then) while 8 pytest-xdist workers shared it, and 4 tests of
the other workers failed out of memory. These checks run without a GPU.
"""

import re
from pathlib import Path

import pytest
import torch

from tests import helpers

TESTS = Path(__file__).resolve().parent


def test_the_workers_sharing_a_gpu_split_nine_tenths_of_it(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert helpers.gpu_memory_fraction() == pytest.approx(0.9)
    for workers in (2, 8, 16):
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
        assert helpers.gpu_memory_fraction() == pytest.approx(0.9 / workers)
        assert workers * helpers.gpu_memory_fraction() <= 0.9 + 1e-9


def test_the_cap_is_set_on_every_gpu_and_before_the_first_gpu_test(monkeypatch):
    capped = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: capped.append((f, d)))
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "8")
    helpers.cap_gpu_memory()
    assert capped == [(0.9 / 8, 0), (0.9 / 8, 1)]
    conftest = (TESTS / "conftest.py").read_text()
    fixture = re.search(
        r"@pytest.fixture\(autouse=True\)\ndef _gpu_memory_share\(request\):(.*?)\n    yield", conftest, re.S
    )
    assert fixture and 'get_closest_marker("gpu")' in fixture.group(1) and "cap_gpu_memory()" in fixture.group(1)


def test_no_test_gives_itself_the_whole_gpu():
    """A test that lowers its own cap puts back its share (tests.helpers.cap_gpu_memory), never 1.0."""
    whole = re.compile(r"set_per_process_memory_fraction\(\s*1(\.0*)?\s*[,)]")
    found = [f"{p.relative_to(TESTS)}:{n}" for p in TESTS.rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if whole.search(line)]  # fmt: skip
    assert not found, found
