"""Local ranks for the benchmarks: start N processes as torchrun would, count their collectives,
read their host memory (PSS).

``spawn(n, fn, spec, devices)`` runs ``fn(rank, world, port, spec, device)`` (a module-level
function) in n ``torch.multiprocessing`` spawn processes, each started with torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK=0, MASTER_ADDR/PORT) and
``MALLOC_ENV``, and returns their results rank by rank; a rank that raises or dies stops the
others and raises here with its traceback.
"""

from __future__ import annotations

import gc
import os
import shutil
import socket
import time
import traceback
from collections import Counter

# What the ranks' collectives are counted by: the torch.distributed functions a cache may call.
COUNTED = ("broadcast_object_list", "all_gather_object", "barrier", "broadcast", "all_gather", "all_reduce",
           "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "gather_object",
           "scatter_object_list", "send", "recv")  # fmt: skip
# Every rank's environment besides torchrun's: freed tensors go back to the system at once (glibc
# otherwise keeps them in its heap after the first large free, which a PSS reading would count),
# and one OpenMP thread per rank.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}


def pss_bytes(pid: int | str = "self") -> int | None:
    """The proportional set size (bytes) of a process's anonymous and shared memory (Pss_Anon +
    Pss_Shmem: where tensors live; the file-backed rest is mostly shared libraries, whose share
    changes whenever another process on the machine maps or drops them), or its whole Pss on a
    kernel without those fields; None where /proc has no smaps."""
    for name in ("smaps_rollup", "smaps"):
        try:
            with open(f"/proc/{pid}/{name}") as f:
                fields = [line.split() for line in f if line.startswith("Pss")]
        except OSError:
            continue
        kib: dict[str, int] = {}
        for key, value, *_ in fields:
            kib[key] = kib.get(key, 0) + int(value)
        if "Pss_Anon:" in kib and "Pss_Shmem:" in kib:
            return (kib["Pss_Anon:"] + kib["Pss_Shmem:"]) * 1024
        return kib.get("Pss:", 0) * 1024
    return None


def settle() -> None:
    """Give back what is free before a PSS reading: garbage, the engine's spare chunks, the C heap."""
    import ctypes

    import offcache

    gc.collect()
    offcache.empty_cache()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def shm_free_bytes() -> int | None:
    """Free bytes in /dev/shm (None where there is none)."""
    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(ranks: int, fn, spec: dict, devices: list[str], timeout_s: float) -> list:
    """Run fn(rank, ranks, port, spec, device) in `ranks` spawned processes; their results."""
    import torch.multiprocessing as mp

    mp_ctx = mp.get_context("spawn")
    port = free_port()
    conns, procs = [], []
    saved = dict(os.environ)
    try:
        for rank in range(ranks):
            # offcache's engine reads LOCAL_WORLD_SIZE when offcache is imported: the environment
            # is set before each process starts, as torchrun's is.
            os.environ.update(MALLOC_ENV, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                              LOCAL_WORLD_SIZE=str(ranks), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port))  # fmt: skip
            parent, child = mp_ctx.Pipe()
            p = mp_ctx.Process(target=_rank_main, args=(fn, rank, ranks, port, spec, devices[rank], child), daemon=True)
            p.start()
            child.close()
            conns.append(parent)
            procs.append(p)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    results: list = [None] * ranks
    deadline = time.monotonic() + timeout_s
    ok = False
    try:
        while any(r is None for r in results):
            for rank in range(ranks):
                if results[rank] is not None:
                    continue
                if conns[rank].poll(0.05):
                    status, payload = conns[rank].recv()
                    if status != "ok":
                        raise RuntimeError(f"offcache.bench: rank {rank} of {ranks} failed:\n{payload}")
                    results[rank] = payload
                elif not procs[rank].is_alive() and not conns[rank].poll(0):
                    raise RuntimeError(
                        f"offcache.bench: rank {rank} of {ranks} died (exit code {procs[rank].exitcode})"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"offcache.bench: {ranks} ranks gave no result in {timeout_s:.0f} s")
        ok = True
    finally:
        for p in procs:
            p.join(10 if ok else 0.1)
            if p.is_alive():
                p.kill()
                p.join(5)
    return results


def _rank_main(fn, rank: int, world: int, port: int, spec: dict, device: str, conn) -> None:
    import torch.distributed as dist

    try:
        conn.send(("ok", fn(rank, world, port, spec, device)))
    except BaseException:  # noqa: BLE001  (sent to the parent, which names the rank)
        conn.send(("err", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class CollectiveCounter:
    """Counts the calls of torch.distributed's collectives (COUNTED) while installed."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.saved = {name: getattr(dist, name) for name in COUNTED if hasattr(dist, name)}
        self.counts: Counter = Counter()

    def install(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.dist, name, self._counting(name, fn))

    def uninstall(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.dist, name, fn)

    def _counting(self, name, fn):
        def call(*args, **kwargs):
            self.counts[name] += 1
            return fn(*args, **kwargs)

        return call

    def take(self) -> dict:
        """The counts since the last take()."""
        out = dict(self.counts)
        self.counts.clear()
        return out

    def barrier(self) -> None:
        """The benchmark's own barrier: not counted."""
        self.saved["barrier"]()
