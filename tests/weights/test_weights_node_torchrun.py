"""offcache's node-shared weights under real torchrun launchers (tests/weights/weights_node_torchrun_script.py).

One launcher with two processes: one node, one region. Two launchers on this host with
``--nnodes 2``: two nodes (torchrun's GROUP_RANK), two regions, the same layout in both.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("compressed_tensors")

from tests.weights.weights_node_worker import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "weights", "weights_node_torchrun_script.py")


def launch(nnodes: int, node_rank: int, nproc: int, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
           f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}", SCRIPT]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def results(*launchers) -> list[dict]:
    out = []
    for p in launchers:
        text, _ = p.communicate(timeout=120)
        assert p.returncode == 0, text
        out += [json.loads(line.split("RESULT ", 1)[1]) for line in text.splitlines() if "RESULT " in line]
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
