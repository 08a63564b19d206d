"""offcache's node-shared weights under real torchrun launchers (tests/weights/node/weights_node_torchrun_script.py).

One launcher with two processes: one node, one region. Two launchers on this host with ``--nnodes 2``:
two nodes (torchrun's GROUP_RANK), two regions, the same layout in both. A small model run first on
compressed-tensors' distributed classes, then on offcache's, bit for bit the same. A rank SIGKILLed (or
stopped) mid-run: the other rank gets an error (or the group's timeout), never a hang, and once the
ranks are gone nothing holds the region and nothing is left in /dev/shm.

Every launch runs under a watchdog: past it, the launcher's whole process group is killed and the
test fails saying it hung.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("compressed_tensors")

from tests.helpers import child_pythonpath  # noqa: E402
from tests.weights.node.weights_node_worker import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(ROOT, "tests", "weights", "node", "weights_node_torchrun_script.py")
WATCHDOG_S = 120


def launch(nnodes: int, node_rank: int, nproc: int, port: int, mode: str = "sums", *flags) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
           f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}",
           *flags, SCRIPT, mode]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=child_pythonpath(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


def finish(p: subprocess.Popen, timeout: float = WATCHDOG_S) -> str:
    """The launcher's output once it exits; past `timeout`, its process group is killed: a hang."""
    try:
        return p.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"torchrun did not finish in {timeout} s (a hang):\n{p.communicate()[0][-6000:]}")


def parse(text: str) -> list[dict]:
    return [json.loads(line.split("RESULT ", 1)[1]) for line in text.splitlines() if "RESULT " in line]


def results(*launchers) -> list[dict]:
    out = []
    for p in launchers:
        text = finish(p)
        assert p.returncode == 0, text
        out += parse(text)
    return sorted(out, key=lambda r: r["rank"])


def test_one_launcher_two_processes_share_one_region():
    ranks = results(launch(1, 0, 2, free_port()))
    assert len(ranks) == 2
    for r in ranks:
        assert r["class"] == "NodeSharedCPUCache"
        assert r["stats"]["decided"] == "node"
        assert r["sums"] == ranks[0]["sums"] and r["sums"][1] == 7.0 * 16 * 32
    assert ranks[0]["stats"]["node"] == ranks[1]["stats"]["node"]


def test_two_launchers_on_one_host_are_two_nodes_with_two_regions():
    port = free_port()
    ranks = results(launch(2, 0, 1, port), launch(2, 1, 1, port))
    assert [r["group_rank"] for r in ranks] == ["0", "1"]
    assert ranks[0]["stats"]["node"] != ranks[1]["stats"]["node"]
    assert ranks[0]["stats"]["used_bytes"] == ranks[1]["stats"]["used_bytes"] > 0
    # the source's bytes reached the other node; an update reaches its own node only
    assert ranks[0]["sums"][0] == ranks[1]["sums"][0]
    assert ranks[1]["sums"][1] == 7.0 * 16 * 32


def test_a_small_model_is_bit_identical_on_compressed_tensors_classes_and_offcache_s():
    """The same run (offload from the source rank, forward, updates by each rank, a barrier, a new parameter
    where the ranks' values differ, a delete) on compressed-tensors' DistributedCPUCache, then under
    patch_llmcompressor(weights=True): every weight and output digest the same, on both ranks."""
    pytest.importorskip("llmcompressor")
    ranks = results(launch(1, 0, 2, free_port(), "compare"))
    assert len(ranks) == 2
    for r in ranks:
        assert r["theirs"].pop("classes") == ["DistributedCPUCache"]
        assert r["ours"].pop("classes") == ["NodeSharedCPUCache"]
        assert r["stats"]["decided"] == "node" and r["stats"]["used_bytes"] > 0
        assert r["ours"] == r["theirs"], r["rank"]
        assert r["ours"] == ranks[0]["ours"]
    steps = ranks[0]["ours"]
    assert steps["offloaded"] != steps["updated"] != steps["registered"]  # each step changed something
    assert steps["forward"] != steps["forward_after_update"]


def holders(inode: int) -> list[str]:
    """Processes that map, or hold a descriptor of, the memfd with this inode (any process on the host)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                if any("/memfd:offcache" in line and line.split()[4] == str(inode) for line in f):
                    found.append(f"{pid} maps it")
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for fd in fds:
            try:  # each descriptor on its own: one closed meanwhile must not hide the others
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:offcache"):
                    if os.stat(f"/proc/{pid}/fd/{fd}").st_ino == inode:
                        found.append(f"{pid} holds fd {fd}")
            except OSError:
                continue
    return found


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"  # exited, not yet reaped by torchrun's agent
    except OSError:
        return True


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_a_rank_killed_or_stopped_mid_run_fails_the_other_and_leaves_nothing_behind(sig):
    """Rank 1 is SIGKILLed (its peer sees the connection reset) or SIGSTOPped (its peer waits out the
    group's 10 s timeout) while both ranks offload in a loop. The survivor must report an error and exit,
    not hang; then no process holds the node's region, and nothing is in /dev/shm.

    torchrun's agent is told to look at its workers only every 600 s, so it never does here: the survivor
    has to find out through its collective, as when the dead rank is on another node. The test ends the
    launcher once both ranks are gone."""
    p = launch(1, 0, 2, free_port(), "kill", "--monitor-interval=600")
    lines: list[str] = []
    ready = threading.Event()
    pids: dict[int, int] = {}

    def read():
        for line in p.stdout:
            lines.append(line)
            if line.startswith("READY "):
                _, rank, pid = line.split()
                pids[int(rank)] = int(pid)
                if len(pids) == 2:
                    ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(WATCHDOG_S), "".join(lines)[-6000:]
        region = next(r["region"] for r in parse("".join(lines)) if "region" in r)
        assert holders(region[1]), "the region is not a memfd the ranks hold"
        time.sleep(0.3)  # both in their offload loop
        os.kill(pids[1], getattr(signal, sig))
        deadline = time.monotonic() + 60  # the watchdog: past it, the survivor hangs
        while time.monotonic() < deadline and not gone(pids[0]):
            time.sleep(0.1)
        survivor_gone = gone(pids[0])
        if sig == "SIGSTOP":
            os.kill(pids[1], signal.SIGKILL)
    finally:
        p.terminate()  # the agent: its workers are gone (or, after a hang, it stops them)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
        reader.join(10)
    text = "".join(lines)
    assert survivor_gone, f"rank 0 still runs 60 s after rank 1 got {sig} (a hang):\n{text[-6000:]}"
    errors = [r for r in parse(text) if "error" in r]
    assert len(errors) == 1 and errors[0]["rank"] == 0, text[-6000:]
    want = "Connection reset|closed|Broken pipe" if sig == "SIGKILL" else "Timed out|timeout"
    assert any(w.lower() in errors[0]["error"].lower() for w in want.split("|")), errors[0]
    assert errors[0]["after_s"] < 30, errors[0]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(map(gone, pids.values())):
        time.sleep(0.1)
    assert all(map(gone, pids.values()))
    assert holders(region[1]) == []
    left = [n for n in os.listdir("/dev/shm") if "offcache" in n or any(f"_{pid}_" in n for pid in pids.values())]
    assert left == []
