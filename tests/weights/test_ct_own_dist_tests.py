"""compressed-tensors' own distributed CPU cache tests, with offcache's class substituted.

Their ``tests/test_offload/cache/test_dist_cpu.py``, from the sdist of the installed compressed-tensors
(0.19 pinned, 0.20.1 in the overlay), unpacked by scripts/setup_ct_tests.sh into ``.ct-tests/VERSION``
(never committed), runs under one torchrun launch of 2 ranks (gloo), the CPU standing in for the
accelerator, with ``offcache.patch_llmcompressor(weights=True)`` applied on the host backend
(tests/weights/ct_plugin/offcache_ct_plugin.py). Every test must pass on both ranks and must have
built offcache's ``NodeSharedCPUCache`` (never compressed-tensors' class), except:

- NOT_APPLICABLE: tests of compressed-tensors' own mechanism (skipped, saying why; offcache's tests
  check the same behaviour of its class);
- CPU_ONLOAD: on the CPU, compressed-tensors' onload (``CPUCache.onload``: ``.to(device)``, no copy)
  hands out the offloaded tensor itself, so an onloaded tensor outlives its references; their own
  class fails these two there as well (the control run). While offcache's class onloads with it, they
  must fail that way; once its onload is the engine's fetch (a copy on the host backend), they must pass.

The control runs the same file with compressed-tensors' own classes under the same harness: it shows
the harness is faithful (their class passes the same tests).

Their ``test_dist_disk.py`` runs the same way with offcache's ``NodeDiskCache`` substituted (and
their ``DistributedDiskCache`` as the control). In both files every test must pass but RACY:
``test_distributed_offload`` has both ranks update the tensor with no barrier after the first read,
so rank 0's update may land before rank 1 reads the first value (it then reads the second): it may
fail on either rank with either class (seen here: their class 4 times in 12 rank-runs, offcache's
once in 28, which writes an update beside the file and renames it over, so a read never sees a
truncated file; in the CPU file the same race: an update lands in the shared memory before the other
rank's read). It must still have built the expected class, and with offcache's class any failure
must be that assertion (their class may also fail it reading a file the other rank is rewriting in
place; one control run in about 15 failed here in a way not reproduced since, which this allows).

Without the suite (scripts/setup_ct_tests.sh could not reach the package index) the tests are skipped
with the reason; with ``OFFCACHE_REQUIRE_CT_TESTS=1`` (CI) they fail instead.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

compressed_tensors = pytest.importorskip("compressed_tensors")

from tests.helpers import child_pythonpath  # noqa: E402
from tests.weights.weights_node_worker import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_DIR = Path(__file__).resolve().parent / "ct_plugin"
SUITE = ROOT / ".ct-tests" / compressed_tensors.__version__
DIST_CPU = "tests/test_offload/cache/test_dist_cpu.py"
TIMEOUT_S = 150  # the whole launch; a rank left alone in a collective fails after 30 s (the plugin's group)

NOT_APPLICABLE = {
    "test_distributed_offload_logs_memory_hint": (
        "rank 0 alone calls offload() and expects compressed-tensors' per-tensor share_memory_ / "
        "_share_filename_cpu_ to fail before its collective; offcache's class uses neither, and its offload is "
        "a collective of every rank, an error reaching every rank (offcache's own test: "
        "tests/weights/test_weights_node.py::test_a_memory_error_logs_compressed_tensors_hint_on_every_rank)"
    ),
    "test_recv_offload_logs_memory_hint": (
        "calls compressed-tensors' DistributedCPUCache.recv_offload (mapping a /dev/shm file) directly, which "
        "offcache's class never calls (offcache's own test: "
        "tests/weights/test_weights_node.py::test_a_memory_error_logs_compressed_tensors_hint_on_every_rank)"
    ),
}
CPU_ONLOAD = {"test_garbage_collect", "test_disable_offloading"}
DIST_DISK = "tests/test_offload/cache/test_dist_disk.py"
RACY = {"test_distributed_offload"}
# 0.20's test of compressed-tensors' disk_load_context handles (per rank): it builds no cache.
BUILDS_NO_CACHE = {"test_disk_load_context_is_per_rank"}


def suite_or_skip() -> Path:
    path = SUITE / DIST_CPU
    if path.exists():
        return path
    marker = SUITE.with_name(SUITE.name + ".unavailable")
    why = "scripts/setup_ct_tests.sh (run by scripts/setup.sh) has not run"
    if marker.exists():
        why = marker.read_text().strip()
    message = f"compressed-tensors {compressed_tensors.__version__}'s own tests are not in {SUITE}: {why}"
    if os.environ.get("OFFCACHE_REQUIRE_CT_TESTS") == "1":
        pytest.fail(message + " (OFFCACHE_REQUIRE_CT_TESTS=1)")
    pytest.skip(message)


def upstream_names(path: Path) -> list[str]:
    return re.findall(r"^def (test_\w+)\(", path.read_text(), re.M)


def run_upstream(substitute: bool, report_dir: Path, test_file: str = DIST_CPU) -> dict[str, list[dict]]:
    """Their file under torchrun (2 ranks): test name -> each rank's entry (outcome, classes built, detail)."""
    suite_or_skip()
    env = dict(os.environ)
    env.update(
        # cwd is their checkout: the overlay's relative PYTHONPATH made absolute, or they test the pinned version.
        PYTHONPATH=child_pythonpath(PLUGIN_DIR, ROOT),
        OFFCACHE_CT_SUBSTITUTE="1" if substitute else "0",
        OFFCACHE_CT_REPORT_DIR=str(report_dir),
        OFFCACHE_CT_NOT_APPLICABLE=json.dumps(NOT_APPLICABLE),
        OMP_NUM_THREADS="1",
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "pytest", "-p", "offcache_ct_plugin", "-p", "no:cacheprovider",
           "-q", test_file]  # fmt: skip
    # cwd: their checkout's root, so `tests` is their package (first on sys.path), not ours.
    proc = subprocess.Popen(cmd, cwd=SUITE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"their tests did not finish in {TIMEOUT_S} s (a hang):\n{log[-6000:]}")
    out: dict[str, list[dict]] = {}
    for rank in (0, 1):
        path = report_dir / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no report (exit {proc.returncode}):\n{log[-6000:]}"
        report = json.loads(path.read_text())
        # Their tests must have run against the compressed-tensors whose suite this is, and been collected.
        assert report["version"] == compressed_tensors.__version__, (report["version"], log[-6000:])
        assert report["tests"], f"rank {rank} ran none of {test_file}:\n{log[-6000:]}"
        for nodeid, entry in report["tests"].items():
            out.setdefault(nodeid.rpartition("::")[2], []).append(entry)
    return out


def check(
    results: dict[str, list[dict]],
    names: list[str],
    cls: str,
    cpu_onload_fails: bool,
    racy: frozenset = frozenset(),
    racy_errors_ok: bool = False,
) -> list[str]:
    """What differs from the expectations in the module docstring, one line per test and rank."""
    problems = []
    assert set(results) == set(names), (sorted(results), names)
    for name in names:
        assert len(results[name]) == 2, (name, results[name])
        for rank, entry in enumerate(results[name]):
            where = f"{name} (rank {rank})"
            if name in NOT_APPLICABLE:
                if entry["outcome"] != "skipped" or "not applicable" not in entry["detail"]:
                    problems.append(f"{where}: {entry['outcome']}, not skipped as not applicable")
                continue
            if entry["classes"] != ([] if name in BUILDS_NO_CACHE else [cls]):
                problems.append(f"{where}: built {entry['classes']}, not [{cls!r}]")
            if name in racy and entry["outcome"] == "failed":
                if not racy_errors_ok and "AssertionError" not in entry["detail"] and "assert " not in entry["detail"]:
                    problems.append(f"{where}: failed, not on the racy assertion\n{entry['detail']}")
                continue
            if name in CPU_ONLOAD and cpu_onload_fails:
                if entry["outcome"] != "failed" or "_ref() is None" not in entry["detail"]:
                    problems.append(f"{where}: {entry['outcome']}, expected to fail as an onload to the CPU is no copy")
            elif entry["outcome"] != "passed":
                problems.append(f"{where}: {entry['outcome']}\n{entry['detail']}")
    return problems


def test_compressed_tensors_own_dist_cpu_tests_pass_with_offcache_s_class(tmp_path):
    from compressed_tensors.offload.cache.cpu import CPUCache

    from offcache.weights.node import NodeSharedCPUCache

    names = upstream_names(suite_or_skip())
    results = run_upstream(True, tmp_path)
    # offcache's class onloads with compressed-tensors' CPUCache.onload until its onload is the engine's
    onload_is_theirs = NodeSharedCPUCache.onload is CPUCache.onload
    problems = check(results, names, "NodeSharedCPUCache", cpu_onload_fails=onload_is_theirs, racy=frozenset(RACY))
    assert not problems, "\n".join(problems)
    assert sum(e["outcome"] == "passed" for entries in results.values() for e in entries) >= 2 * 9


def test_compressed_tensors_own_class_passes_them_under_the_same_harness(tmp_path):
    names = upstream_names(suite_or_skip())
    problems = check(run_upstream(False, tmp_path), names, "DistributedCPUCache", cpu_onload_fails=True,
                     racy=frozenset(RACY))  # fmt: skip
    assert not problems, "\n".join(problems)


def test_compressed_tensors_own_dist_disk_tests_pass_with_offcache_s_class(tmp_path):
    suite_or_skip()
    names = upstream_names(SUITE / DIST_DISK)
    results = run_upstream(True, tmp_path, DIST_DISK)
    problems = check(results, names, "NodeDiskCache", cpu_onload_fails=False, racy=frozenset(RACY))
    assert not problems, "\n".join(problems)
    assert sum(e["outcome"] == "passed" for entries in results.values() for e in entries) >= 2 * (len(names) - 1)


def test_compressed_tensors_own_disk_class_passes_them_under_the_same_harness(tmp_path):
    suite_or_skip()
    names = upstream_names(SUITE / DIST_DISK)
    results = run_upstream(False, tmp_path, DIST_DISK)
    # Their class rewrites the file in place: the racy test may also fail reading a truncated file.
    problems = check(
        results, names, "DistributedDiskCache", cpu_onload_fails=False, racy=frozenset(RACY), racy_errors_ok=True
    )
    assert not problems, "\n".join(problems)
