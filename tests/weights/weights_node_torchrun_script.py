"""Run under torchrun by tests/weights/test_weights_node_torchrun.py: offload two modules through
compressed-tensors' offload_module with the node-shared class, update from the last rank, and
print each rank's view as one JSON line."""

import json
import os

import torch
import torch.distributed as dist
from compressed_tensors.distributed import is_source_process
from compressed_tensors.offload import offload_module
from compressed_tensors.offload.cache import OffloadCache

from offcache.weights import compressed_tensors as oc_ct
from offcache.weights import node as weights_node


def main() -> None:
    dist.init_process_group("gloo")
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
    out = {
        "rank": dist.get_rank(),
        "class": type(modules[0]._parameters).__name__,
        "stats": weights_node.stats(),
        "sums": [float(m.weight.sum()) for m in modules],
        "group_rank": os.environ.get("GROUP_RANK"),
    }
    print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
