"""pytest plugin: compressed-tensors' own distributed cache tests with offcache's classes, the CPU as the
accelerator. Loaded (``-p offcache_ct_plugin``) by tests/weights/test_ct_own_dist_tests.py into a pytest
run under one torchrun launch of 2 ranks, on the tests scripts/setup_ct_tests.sh unpacked from
compressed-tensors' sdist (``.ct-tests/VERSION``; never part of this repository).

Imported before their conftests, it
- makes the CPU the accelerator (``torch.accelerator`` says: CPU, one device per rank), as their
  ``requires_gpu(2)`` and ``onload_device`` fixtures ask for one;
- with ``OFFCACHE_CT_SUBSTITUTE=1``: puts offcache's classes in, as a user does under torchrun:
  ``offcache.patch_llmcompressor(weights=True)`` (compressed-tensors' ``cls_from_device`` gives
  offcache's classes), on the host backend; their test modules' own name ``DistributedCPUCache``
  (the tests that build the class by name) becomes the class the patch gives;
- joins the ranks' gloo group once, at import, with a timeout (a rank left alone in a collective
  fails instead of hanging), and makes compressed-tensors' ``init_dist`` (called by their
  ``torchrun`` decorator in each test) keep it: so the ``offload_cache`` fixture, built before the
  test body, already sees ``torch.distributed`` and gets the distributed class;
- skips, with the reason, the tests written for compressed-tensors' own mechanism (NOT_APPLICABLE,
  named by the launching test);
- writes, per rank, each test's outcome and the cache classes it built to
  ``$OFFCACHE_CT_REPORT_DIR/rank<N>.json``.
"""

from __future__ import annotations

import datetime
import json
import os

import pytest
import torch
import torch.distributed as dist

SUBSTITUTE = os.environ.get("OFFCACHE_CT_SUBSTITUTE") == "1"
REPORT_DIR = os.environ["OFFCACHE_CT_REPORT_DIR"]
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
TIMEOUT_S = float(os.environ.get("OFFCACHE_CT_TIMEOUT_S", "30"))

# Tests written for compressed-tensors' own mechanism, skipped with the reason: name -> why (from the test
# that launches this run, which keeps the list).
NOT_APPLICABLE: dict[str, str] = json.loads(os.environ.get("OFFCACHE_CT_NOT_APPLICABLE", "{}"))

# --- the CPU as the accelerator (before anything reads torch.accelerator) ----------------------------
if SUBSTITUTE:
    import offcache

    offcache.configure(backend="host")
    offcache.patch_llmcompressor(weights=True)  # llm-compressor imported before it sees an accelerator

torch.accelerator.current_accelerator = lambda check_available=False: torch.device("cpu")
torch.accelerator.is_available = lambda: False  # compressed-tensors' is_accelerator_type("cpu"): False
torch.accelerator.device_count = lambda: WORLD
torch.accelerator.current_device_index = lambda: 0
torch.accelerator.set_device_index = lambda index: None

# --- one process group for the whole run ----------------------------------------------------------
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _keep_group() -> None:
    """compressed-tensors' init_dist, for the group this plugin made: a barrier, as it ends with."""
    dist.barrier()


import compressed_tensors  # noqa: E402
import compressed_tensors.distributed as _ct_dist  # noqa: E402
import compressed_tensors.distributed.utils as _ct_dist_utils  # noqa: E402
from compressed_tensors.offload.cache.base import OffloadCache  # noqa: E402
from compressed_tensors.offload.cache.dist_cpu import DistributedCPUCache  # noqa: E402
from compressed_tensors.offload.cache.dist_disk import DistributedDiskCache  # noqa: E402

_ct_dist.init_dist = _ct_dist_utils.init_dist = _keep_group

SUBSTITUTED_CPU = OffloadCache.cls_from_device("cpu")  # collective once: offcache's decision, every rank
SUBSTITUTED_DISK = OffloadCache.cls_from_device("disk")  # no collective: offcache's NodeDiskCache
if SUBSTITUTE:
    assert SUBSTITUTED_CPU is not DistributedCPUCache, f"the patch gave compressed-tensors' class: {SUBSTITUTED_CPU}"
    assert SUBSTITUTED_DISK is not DistributedDiskCache, f"the patch gave compressed-tensors' class: {SUBSTITUTED_DISK}"

# --- which cache classes each test built ------------------------------------------------------------
_built: set[str] = set()
_original_init = OffloadCache.__init__


def _recording_init(self, *args, **kwargs):
    _built.add(type(self).__name__)
    _original_init(self, *args, **kwargs)


OffloadCache.__init__ = _recording_init
_report: dict[str, dict] = {}


def pytest_configure(config):
    config.option.basetemp = os.path.join(REPORT_DIR, f"tmp-rank{RANK}")  # not pytest's shared numbered dirs


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module
        if SUBSTITUTE and getattr(module, "DistributedCPUCache", None) is DistributedCPUCache:
            module.DistributedCPUCache = SUBSTITUTED_CPU
        if SUBSTITUTE and getattr(module, "DistributedDiskCache", None) is DistributedDiskCache:
            module.DistributedDiskCache = SUBSTITUTED_DISK
        reason = NOT_APPLICABLE.get(item.originalname)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"not applicable: {reason}"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _built.clear()


def pytest_runtest_logreport(report):
    entry = _report.setdefault(report.nodeid, {"outcome": "passed", "classes": [], "detail": ""})
    if report.failed:
        entry["outcome"] = "failed"
        entry["detail"] += f"[{report.when}] {str(report.longrepr)[-3000:]}\n"
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
        entry["detail"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if report.when == "teardown":
        entry["classes"] = sorted(_built)


def pytest_sessionfinish(session, exitstatus):
    with open(os.path.join(REPORT_DIR, f"rank{RANK}.json"), "w") as f:
        report = {"rank": RANK, "version": compressed_tensors.__version__, "substituted": SUBSTITUTED_CPU.__name__}
        json.dump({**report, "tests": _report}, f, indent=1)
