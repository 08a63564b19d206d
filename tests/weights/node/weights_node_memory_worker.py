"""Worker functions for tests/weights/node/test_weights_node.py's memory tests (an allocation failing on one
rank; node host memory as PSS), run through weights_node_worker's ``Group`` as
``group.call(M + "<function>", ...)``."""

from __future__ import annotations

import torch

from tests.weights.node.weights_node_worker import _S, make


def memory_error(failing: int, how: str) -> dict:
    """An offload on every rank while rank `failing` runs out of memory (the source's allocation in the
    region, or another rank's mapping of the batch), through `how` ("setitem": one tensor, "from_mapping":
    a module). Returns this rank's error and whether compressed-tensors' remediation hint was logged."""
    import errno

    import torch.distributed as dist
    from loguru import logger

    from offcache.weights import node as weights_node

    def no_memory(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    region = weights_node.GROUP.node.region
    name = "allocate" if failing == 0 else "span"  # rank 0 is the source
    messages: list[str] = []
    handler = logger.add(lambda m: messages.append(m.record["message"]), level="WARNING")
    if dist.get_rank() == failing:
        setattr(region, name, no_memory)
    try:
        if how == "setitem":
            weights_node.NodeSharedCPUCache("cpu")["w"] = make((64, 64), "float32", 1)
        else:
            weights_node.NodeSharedCPUCache.from_mapping({"w": make((64, 64), "float32", 1)}, "cpu")
        error = ""
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
    finally:
        vars(region).pop(name, None)
        logger.remove(handler)
    return {"error": error, "hint": any("ran out of host RAM" in m for m in messages)}


def pss_bytes(pid: int) -> int:
    """A process's proportional set size (its private pages, and its share of each shared page)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("Pss:"))


def hold_weights(mod: str, how: str, n: int, mib: int) -> None:
    """`n` weights of `mib` MiB each: in offcache's node region ("node"; the other ranks hold meta tensors,
    as a model loaded on the source rank), or a copy per rank in compressed-tensors' CPUCache ("per_rank",
    what each rank holds without a shared region). Then every rank reads every byte (its pages mapped)
    through the offloaded tensors themselves: an onload to the CPU would be a copy, whose freed pages
    the allocator may keep."""
    import gc

    from compressed_tensors.distributed import is_source_process
    from compressed_tensors.offload import disable_onloading
    from compressed_tensors.offload.cache import CPUCache

    from offcache.weights.node import NodeSharedCPUCache

    real = how == "per_rank" or is_source_process()
    shape = (mib << 18,)  # float32
    mapping = {  # one allocation each (no temporaries left in the heap)
        f"w{i}": torch.empty(shape).normal_(generator=torch.Generator().manual_seed(i)) if real else
        torch.empty(shape, device="meta") for i in range(n)
    }  # fmt: skip
    cls = NodeSharedCPUCache if how == "node" else CPUCache
    cache = cls.from_mapping(mapping, "cpu")
    del mapping
    gc.collect()
    _S[mod] = (cache,)
    with disable_onloading():
        for name in cache:
            float(cache[name].sum())
