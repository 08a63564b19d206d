"""Run under torchrun by tests/weights/node/test_weights_node_torchrun.py; each rank prints ``RESULT <json>`` lines.

``script.py sums`` (default): offload two modules through compressed-tensors' offload_module with the
node-shared class, update from the last rank, and print each rank's view.

``script.py compare``: the same small model and the same run, first with compressed-tensors' own
distributed classes, then with ``offcache.patch_llmcompressor(weights=True)``; prints digests of every
output and weight after each step, per class.

``script.py kill``: offload, print ``READY``, then offload in a loop until a collective fails (the test
SIGKILLs rank 1 meanwhile): the survivor prints the error it got (the group's timeout: 10 s).
"""

import datetime
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from compressed_tensors.distributed import is_source_process
from compressed_tensors.offload import disable_onloading, offload_module, update_offload_parameter
from compressed_tensors.offload.cache import OffloadCache

from offcache.weights import compressed_tensors as oc_ct
from offcache.weights import node as weights_node


def report(**fields) -> None:
    # one write (python -u would write the newline apart: two ranks' lines could run together)
    sys.stdout.write("RESULT " + json.dumps({"rank": dist.get_rank(), **fields}) + "\n")
    sys.stdout.flush()


def report_in_turn(**fields) -> None:
    """report(), one rank after the other (long lines from two processes would interleave)."""
    for rank in range(dist.get_world_size()):
        if rank == dist.get_rank():
            report(**fields)
        dist.barrier()


def sums() -> None:
    oc_ct._originals[(OffloadCache, "cls_from_device")] = OffloadCache.__dict__["cls_from_device"]
    OffloadCache.cls_from_device = classmethod(oc_ct._cls_from_device)  # the switch, without llm-compressor
    torch.manual_seed(0)
    device = "cpu" if is_source_process() else "meta"
    modules = [torch.nn.Linear(32, 16, device=device) for _ in range(2)]
    if is_source_process():
        for m in modules:
            torch.nn.init.normal_(m.weight)
    for m in modules:
        offload_module(m, "cpu", "cpu")
    if dist.get_rank() == dist.get_world_size() - 1:
        modules[1].weight = torch.nn.Parameter(torch.full((16, 32), 7.0), requires_grad=False)
    dist.barrier()
    report(
        **{
            "class": type(modules[0]._parameters).__name__,
            "stats": weights_node.stats(),
            "sums": [float(m.weight.sum()) for m in modules],
            "group_rank": os.environ.get("GROUP_RANK"),
        }
    )


# --- compare: the same run on compressed-tensors' classes and on offcache's ---------------------------


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x):
        return self.norm(torch.relu(self.linear(x))) * self.scale + x


class Tiny(torch.nn.Module):
    """Embedding, blocks and a head tied to the embedding: a decoder's shape, in miniature."""

    def __init__(self, vocab: int = 97, width: int = 48, depth: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def weights_digest(model) -> dict:
    with disable_onloading():  # the offloaded (shared) values themselves
        return {name: digest(p) for name, p in sorted(model.state_dict(keep_vars=True).items())}


def one_run() -> dict:
    """A model made on the source rank (meta elsewhere), offloaded module by module; a forward; each rank
    updating its own blocks (as llm-compressor spreads a layer's work), a barrier, a forward; a new
    parameter on every rank (source's value) updated by one rank; one deleted. Digests of each step."""
    torch.manual_seed(1234)
    with torch.device("cpu" if is_source_process() else "meta"):
        model = Tiny()
    modules = [m for m in model.modules() if m._parameters or m._buffers]
    for m in modules:
        offload_module(m, "cpu", "cpu")
    ids = torch.arange(24).reshape(2, 12) % 97
    steps = {"classes": sorted({type(m._parameters).__name__ for m in modules})}
    with torch.no_grad():
        steps["offloaded"] = weights_digest(model)
        steps["forward"] = digest(model(ids))
        dist.barrier()  # every rank has read before any writes (the bytes are shared)
        rank, world = dist.get_rank(), dist.get_world_size()
        for i, block in enumerate(model.blocks):
            if i % world == rank:
                w = block.linear.weight
                update_offload_parameter(block.linear, "weight", (w * 0.5 + 0.01 * (i + 1)).to(w.dtype))
                update_offload_parameter(block, "scale", block.scale * (1.5 + i))
        dist.barrier()
        steps["updated"] = weights_digest(model)
        steps["forward_after_update"] = digest(model(ids))
        dist.barrier()
        for block in model.blocks:  # a new parameter, on every rank (collective)
            value = torch.full((48,), float(rank + 1))  # the ranks differ: the source's wins
            block.linear.register_parameter("weight_scale", torch.nn.Parameter(value, requires_grad=False))
        if rank == world - 1:
            update_offload_parameter(model.blocks[0].linear, "weight_scale", torch.arange(48.0))
        dist.barrier()
        del model.blocks[1].linear.weight_scale
        steps["registered"] = weights_digest(model)
        steps["forward_last"] = digest(model(ids))
    return steps


def compare() -> None:
    import offcache

    theirs = one_run()
    offcache.patch_llmcompressor(weights=True)
    try:
        ours = one_run()
    finally:
        offcache.unpatch_llmcompressor()
    report_in_turn(theirs=theirs, ours=ours, stats=weights_node.stats())


# --- kill: a rank dies mid-run ------------------------------------------------------------------------


def kill() -> None:
    cls = weights_node.cache_class()
    seed = torch.Generator().manual_seed(0)
    t = torch.randn(256, 256, generator=seed) if is_source_process() else torch.empty(256, 256, device="meta")
    cls.from_mapping({"w": t}, "cpu")
    region = os.fstat(weights_node.GROUP.node.region.fd)
    report_in_turn(pid=os.getpid(), cls=cls.__name__, region=[region.st_dev, region.st_ino])
    for rank in range(dist.get_world_size()):
        if rank == dist.get_rank():
            sys.stdout.write(f"READY {rank} {os.getpid()}\n")
            sys.stdout.flush()
        dist.barrier()
    start = time.monotonic()
    try:
        for i in range(100_000):
            t = torch.randn(64, 64, generator=seed) if is_source_process() else torch.empty(64, 64, device="meta")
            cls.from_mapping({f"w{i}": t}, "cpu")
            time.sleep(0.01)
    except Exception as exc:  # noqa: BLE001
        report(error=f"{type(exc).__name__}: {exc}"[:2000], after_s=round(time.monotonic() - start, 2))
        sys.exit(3)
    report(error=None)


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "sums"
    timeout = datetime.timedelta(seconds=10 if mode == "kill" else 60)
    dist.init_process_group("gloo", timeout=timeout)
    {"sums": sums, "compare": compare, "kill": kill}[mode]()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
