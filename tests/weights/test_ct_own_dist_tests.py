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
their ``DistributedDiskCache`` as the control).

Races. Some of their tests race between their own ranks: a rank's read and the other rank's write or
delete with no barrier between them, so which comes first depends on the machine's load. A race is
recorded per file, test and class (PEER_RACES: compressed-tensors' own classes, the control; OUR_RACES:
offcache's), as the ranks it may fail on and a pattern the failure must match; any other failure
fails. Each is below with its evidence (rank-runs: runs x 2 ranks, under a CPU burner beside other
jobs; which rank read what). A race is in OUR_RACES only where the test's construction gives it to
any class, and says why; otherwise offcache's class must pass the test.

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
from dataclasses import dataclass
from pathlib import Path

import pytest

compressed_tensors = pytest.importorskip("compressed_tensors")

from tests.helpers import child_pythonpath  # noqa: E402
from tests.weights.node.weights_node_worker import free_port  # noqa: E402

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
        "tests/weights/node/test_weights_node.py::test_a_memory_error_logs_compressed_tensors_hint_on_every_rank)"
    ),
    "test_recv_offload_logs_memory_hint": (
        "calls compressed-tensors' DistributedCPUCache.recv_offload (mapping a /dev/shm file) directly, which "
        "offcache's class never calls (offcache's own test: "
        "tests/weights/node/test_weights_node.py::test_a_memory_error_logs_compressed_tensors_hint_on_every_rank)"
    ),
}
CPU_ONLOAD = {"test_garbage_collect", "test_disable_offloading"}
DIST_DISK = "tests/test_offload/cache/test_dist_disk.py"


@dataclass(frozen=True)
class Race:
    """An upstream test that races between its own ranks: the ranks it may fail on, and a pattern
    (re.S) the failure's text must match there; why, with the evidence."""

    ranks: tuple[int, ...]
    failure: str
    why: str


# test_distributed_offload's first check (the first value, zeros) failing as the race makes it fail:
# the rank read zeros or ones where the other side of the check held the other one (below, per class).
_FIRST_CHECK = (
    r'torch\.zeros\(\(5, 2\)\)\n\s+cache\["tensor"\] = tensor\n\s*\n\s+# check tensor construction\n'
    r'>\s+assert torch\.equal\(cache\["tensor"\][^\n]*\nE\s+(AssertionError: )?assert False\n'
    r"E\s+\+\s+where False = <built-in method equal[^\n]*?\("
)
_ONES, _ZEROS = r"tensor\(\[\[1\., 1\.\],", r"tensor\(\[\[0\., 0\.\],"
# The disk: the read (first) returned the other rank's update, ones; the test's own tensor is zeros.
_READ_THE_UPDATE = _FIRST_CHECK + _ONES + r"[^\n]*?\), " + _ZEROS
# offcache's CPU class: the test's own tensor is the region's bytes (the offload points it there, as
# compressed-tensors' class does), so the check compares this rank's copy, read before the other rank's
# update landed (zeros), with the region after it (ones).
_UPDATE_AFTER_THE_READ = _FIRST_CHECK + _ZEROS + r"[^\n]*?\), " + _ONES
_UPDATE_RACE = (
    "test_distributed_offload: both ranks update the tensor (cache['tensor'] = ones) with no barrier "
    "after their first read, so one rank's update may land before or during the other rank's first "
    "check of zeros (any class: the test orders nothing between the two)"
)
_DELETE_RACE = (
    "test_delete: after the offload's barrier, rank 0 onloads the tensor and deletes it (the source "
    "rank removes its file: DistributedDiskCache.__delitem__, offcache's class inherits it), while "
    "rank 1 onloads it with no barrier between: rank 1's read of rank 0's ct_disk_cache_0_* file may "
    "come after the file was removed (any class whose delete removes the file the other ranks read)"
)
# Evidence (2026-12-07, 2 cores beside other jobs, load average 8-11, and `yes > /dev/null`; runs of one
# launch each, 2 ranks): 0.19's test_dist_disk.py, 8 runs a class: compressed-tensors' class failed
# test_delete twice (rank 1: FileNotFoundError on tmp-rank0/test_delete0/offload_dir/ct_disk_cache_0_*,
# which rank 0 had removed) and test_distributed_offload 6 times (rank 1 four, rank 0 two: its first check
# read ones); offcache's class test_distributed_offload 4 times (rank 1 three, rank 0 one: the same), never
# test_delete. 0.19's test_dist_cpu.py, 5 runs a class: compressed-tensors' class no race (its
# CPU_ONLOAD failures only); offcache's test_distributed_offload once (rank 1: its copy zeros, the region
# ones). 0.20.1, 1 run a class and file: the control's disk test_delete and test_distributed_offload (rank
# 1), offcache's disk test_distributed_offload (rank 1), no CPU race. No other test failed in any run.
#
# compressed-tensors' own classes (the control): every race seen, and only as it was seen. (Their CPU
# class never fails test_distributed_offload: its onload to the CPU is the shared tensor itself, the
# test's own tensor, so each check compares the region with itself.)
PEER_RACES: dict[tuple[str, str], Race] = {
    (DIST_DISK, "test_distributed_offload"): Race((0, 1), _READ_THE_UPDATE, _UPDATE_RACE),
    (DIST_DISK, "test_delete"): Race(
        (1,),
        r"FileNotFoundError: No such file or directory: \S*/tmp-rank0/test_delete\d*/offload_dir/"
        r"ct_disk_cache_0_\d+\.safetensors",
        _DELETE_RACE,
    ),
}
# offcache's classes: only the races the tests' construction gives any class (each says why). test_delete
# was not seen to fail with offcache's class (its onload read the file before rank 0 removed it in every
# run), but nothing orders the two: test_their_delete_race_lost_fails_both_classes_as_recorded loses the
# race on purpose and offcache's class fails there, reading a file that is gone.
OUR_RACES: dict[tuple[str, str], Race] = {
    (DIST_CPU, "test_distributed_offload"): Race((0, 1), _UPDATE_AFTER_THE_READ, _UPDATE_RACE),
    # (never a truncated file: offcache's update writes beside the file and renames it over)
    (DIST_DISK, "test_distributed_offload"): Race((0, 1), _READ_THE_UPDATE, _UPDATE_RACE),
    (DIST_DISK, "test_delete"): Race(
        (1,),
        r"FileNotFoundError: \[Errno 2\] No such file or directory: '\S*/tmp-rank0/test_delete\d*/"
        r"offload_dir/ct_disk_cache_0_\d+\.safetensors'",
        _DELETE_RACE,
    ),
}


def races(table: dict[tuple[str, str], Race], test_file: str) -> dict[str, Race]:
    return {name: race for (file, name), race in table.items() if file == test_file}


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
    racy: dict[str, Race] | None = None,
) -> list[str]:
    """What differs from the expectations in the module docstring, one line per test and rank."""
    problems = []
    racy = racy or {}
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
            race = racy.get(name)
            if race is not None and entry["outcome"] == "failed":
                if rank not in race.ranks or not re.search(race.failure, entry["detail"], re.S):
                    problems.append(f"{where}: failed, not in its known race ({race.why})\n{entry['detail']}")
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
    problems = check(results, names, "NodeSharedCPUCache", onload_is_theirs, races(OUR_RACES, DIST_CPU))
    assert not problems, "\n".join(problems)
    assert sum(e["outcome"] == "passed" for entries in results.values() for e in entries) >= 2 * 9


def test_compressed_tensors_own_class_passes_them_under_the_same_harness(tmp_path):
    names = upstream_names(suite_or_skip())
    problems = check(run_upstream(False, tmp_path), names, "DistributedCPUCache", True, races(PEER_RACES, DIST_CPU))
    assert not problems, "\n".join(problems)


def test_compressed_tensors_own_dist_disk_tests_pass_with_offcache_s_class(tmp_path):
    suite_or_skip()
    names = upstream_names(SUITE / DIST_DISK)
    results = run_upstream(True, tmp_path, DIST_DISK)
    problems = check(results, names, "NodeDiskCache", False, races(OUR_RACES, DIST_DISK))
    assert not problems, "\n".join(problems)
    assert sum(e["outcome"] == "passed" for entries in results.values() for e in entries) >= 2 * (len(names) - 1)


def test_compressed_tensors_own_disk_class_passes_them_under_the_same_harness(tmp_path):
    suite_or_skip()
    names = upstream_names(SUITE / DIST_DISK)
    results = run_upstream(False, tmp_path, DIST_DISK)
    problems = check(results, names, "DistributedDiskCache", False, races(PEER_RACES, DIST_DISK))
    assert not problems, "\n".join(problems)


def _entry(outcome: str, cls: str, detail: str = "") -> dict:
    return {"outcome": outcome, "classes": [cls], "detail": detail}


_DELETE_LOST = (
    '[call] ...\n>       onloaded = offload_cache["weight"]\n...\nE       FileNotFoundError: No such file or '
    "directory: /tmp/x/tmp-rank0/test_delete0/offload_dir/ct_disk_cache_0_140712510571216.safetensors\n"
)
_FIRST = (
    '    tensor = torch.zeros((5, 2))\n    cache["tensor"] = tensor\n\n    # check tensor construction\n'
    '>       assert torch.equal(cache["tensor"], tensor.to(onload_device))\nE       AssertionError: assert False\n'
    "E        +  where False = <built-in method equal of type object at 0x7f>(tensor([[{}, {}],\\n        [1., 1.]]), "
    "tensor([[{}, {}],\\n        [0., 0.]]))\n"
)
_UPDATE_READ = _FIRST.format("1.", "1.", "0.", "0.")  # the disk: the first read returned the update
_READ_UPDATED = _FIRST.format("0.", "0.", "1.", "1.")  # offcache's CPU class: the region updated after the read


def test_a_peer_race_is_allowed_to_the_peer_only_on_its_rank_and_as_it_was_seen():
    """compressed-tensors' control failed CI on its own race (test_delete: rank 1 read ct_disk_cache_0_…
    after rank 0 had deleted it). Each race is recorded per file, test and class, with the ranks and the
    failure seen; anything else still fails, the peer's and offcache's."""
    names = ["test_delete", "test_distributed_offload", "test_offload"]

    def problems(name, rank, detail, cls="DistributedDiskCache", table=PEER_RACES):
        results = {n: [_entry("passed", cls), _entry("passed", cls)] for n in names}
        results[name][rank] = _entry("failed", cls, detail)
        return check(results, names, cls, False, races(table, DIST_DISK))

    assert problems("test_delete", 1, _DELETE_LOST) == []  # the peer's race, as seen
    assert problems("test_distributed_offload", 0, _UPDATE_READ) == []
    assert problems("test_distributed_offload", 1, _UPDATE_READ) == []
    assert problems("test_delete", 0, _DELETE_LOST)  # rank 0 deletes the file: it never reads it gone
    assert problems("test_delete", 1, "E       AssertionError: assert onloaded_ref() is None\n")  # another failure
    assert problems("test_delete", 1, _DELETE_LOST.replace("ct_disk_cache_0_", "ct_disk_cache_1_"))
    assert problems("test_offload", 1, _DELETE_LOST)  # a test with no race
    assert problems("test_distributed_offload", 1, _DELETE_LOST)  # not that test's race
    assert problems("test_distributed_offload", 1, _READ_UPDATED)  # not as the disk's race reads
    later = _UPDATE_READ.replace("torch.zeros((5, 2))", "torch.ones((5, 2))")  # the second check: no race there
    assert problems("test_distributed_offload", 1, later)
    # offcache's class: only the races of the tests' construction, as its own failure reads
    ours = "E       FileNotFoundError: [Errno 2] No such file or directory: " + (
        "'/tmp/x/tmp-rank0/test_delete0/offload_dir/ct_disk_cache_0_1407.safetensors'\n"
    )
    assert problems("test_delete", 1, ours, "NodeDiskCache", OUR_RACES) == []
    assert problems("test_delete", 1, "E       RuntimeError: offcache: something else\n", "NodeDiskCache", OUR_RACES)
    assert problems("test_offload", 0, _UPDATE_READ, "NodeDiskCache", OUR_RACES)
    # the CPU file: offcache's class as its race reads; compressed-tensors' class never fails it (its onload is
    # the shared tensor itself, so each check compares the region with itself)
    cpu = {"test_distributed_offload": [_entry("passed", "X"), _entry("failed", "X", _READ_UPDATED)]}
    assert check(cpu, ["test_distributed_offload"], "X", False, races(OUR_RACES, DIST_CPU)) == []
    assert check(cpu, ["test_distributed_offload"], "X", False, races(PEER_RACES, DIST_CPU))
    cpu["test_distributed_offload"][1] = _entry("failed", "X", _UPDATE_READ)
    assert check(cpu, ["test_distributed_offload"], "X", False, races(OUR_RACES, DIST_CPU))
    # every race recorded names a test of their files, and its ranks
    for (file, name), race in [*PEER_RACES.items(), *OUR_RACES.items()]:
        assert file in (DIST_CPU, DIST_DISK) and name.startswith("test_") and race.ranks and race.why, (file, name)


def test_their_delete_race_lost_fails_both_classes_as_recorded(tmp_path):
    """test_delete's race, lost on purpose (rank 0 onloads and deletes, then rank 1 onloads): both classes
    fail there, each with the failure its race records: the test's construction, not a class, races."""
    from tests.weights.node.weights_node_worker import Group

    g = Group(2, timeout=120)
    try:
        got = g.call("tests.weights.node.weights_node_disk_worker:delete_race_lost", str(tmp_path))
    finally:
        g.close()
    assert got[0] == {"ours": "", "theirs": ""}, got  # rank 0 read before it deleted
    assert re.search(OUR_RACES[(DIST_DISK, "test_delete")].failure, got[1]["ours"], re.S), got
    assert re.search(PEER_RACES[(DIST_DISK, "test_delete")].failure, got[1]["theirs"], re.S), got
