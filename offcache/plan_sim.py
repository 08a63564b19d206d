"""The planner's replay of the sequential pipeline's cache calls, and its Llama-formula fallback.

`simulate` replays what llm-compressor 0.14's SequentialPipeline does to the cache:
``IntermediatesCache.from_dataloader`` stores each batch, then for each subgraph but the last,
batch by batch, ``update(outputs)`` then ``delete(consumed_names)``; every subgraph fetches its
``input_names`` once per pass (two passes with ``propagate_error``, llm-compressor's default).
Memory is counted as offcache's engine holds it: each update() is one arena block (every tensor
rounded up to 256 bytes; a tensor given twice in one call, e.g. one mask under several layer
names, is stored once) that lives while any of its names does; a store snapshots its source
first (on a CPU model, in host memory, until the copy lands). A block that does not fit under
the host limit goes to the disk tier; its bytes are written there and read back on every fetch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offcache.plan_trace import SubgraphValues

ALIGN = 256  # the arena's alignment (csrc/core/arena.h, ArenaOptions::alignment)


def aligned(nbytes: int) -> int:
    return (max(nbytes, 1) + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Replay:
    peak_bytes: int  # the cache's peak (pinned + pageable + disk, with a CPU model's snapshots)
    peaks: list[int]  # after the calibration set, then while each subgraph's outputs are stored
    d2h_bytes: int  # every stored tensor, once
    h2d_bytes: int  # every fetch
    disk_write_bytes: int
    disk_read_bytes: int
    disk_peak_bytes: int


def inputs_of(batch: int, seq: int) -> dict[str, list]:
    """The calibration batch as the dataloader gives it: input_ids and attention_mask, int64."""
    return {"input_ids": [(("in", 0), batch * seq * 8)], "attention_mask": [(("in", 1), batch * seq * 8)]}


def simulate(per_batch: list[list[SubgraphValues]], inputs: list[dict], *, onload: str, host_limit: int,
             passes: int = 2) -> Replay:  # fmt: skip
    """Replay the pipeline over batches; per_batch[b][k] is subgraph k's values for batch b."""
    n = len(per_batch)
    blocks: dict[int, list] = {}  # id -> [bytes, live names, on disk]
    where: list[dict[str, int]] = [{} for _ in range(n)]
    leaves_of: list[dict[str, list]] = [{} for _ in range(n)]
    state = {"host": 0, "disk": 0, "peak": 0, "disk_peak": 0, "d2h": 0, "h2d": 0, "dw": 0, "dr": 0, "next": 0}

    def store(b: int, values: dict[str, list]) -> None:
        distinct: dict = {}
        for leaves in values.values():
            for key, nbytes in leaves:
                distinct.setdefault(key, nbytes)
        block = sum(aligned(v) for v in distinct.values())
        staging = block if onload == "cpu" else 0  # a CPU source is snapshotted into the arena first
        state["peak"] = max(state["peak"], state["host"] + state["disk"] + block + staging)
        on_disk = state["host"] + block > host_limit
        ident = state["next"]
        state["next"] += 1
        blocks[ident] = [block, set(values), on_disk]
        for name in values:
            if name in where[b]:
                _drop(b, name)
            where[b][name] = ident
            leaves_of[b][name] = values[name]
        state["disk" if on_disk else "host"] += block
        state["disk_peak"] = max(state["disk_peak"], state["disk"])
        state["d2h"] += sum(distinct.values())
        if on_disk:
            state["dw"] += block

    def _drop(b: int, name: str) -> None:
        ident = where[b].pop(name)
        leaves_of[b].pop(name, None)
        entry = blocks[ident]
        entry[1].discard(name)
        if not entry[1]:
            blocks.pop(ident)
            state["disk" if entry[2] else "host"] -= entry[0]

    def fetch(b: int, names) -> None:
        seen: set = set()
        for name in names:
            if name not in where[b]:
                continue
            on_disk = blocks[where[b][name]][2]
            for key, nbytes in leaves_of[b][name]:
                if key in seen:
                    continue
                seen.add(key)
                state["h2d"] += nbytes
                if on_disk:
                    state["dr"] += nbytes

    for b in range(n):
        store(b, inputs[b])
    peaks = [state["peak"]]
    subgraphs = len(per_batch[0]) if n else 0
    for k in range(subgraphs):
        state["peak"] = state["host"] + state["disk"]
        for _ in range(passes):
            for b in range(n):
                fetch(b, per_batch[b][k].input_names)
        if k < subgraphs - 1:
            for b in range(n):
                store(b, per_batch[b][k].outputs)
                for name in per_batch[b][k].consumed_names:
                    if name in where[b]:
                        _drop(b, name)
        peaks.append(state["peak"])
    return Replay(max(peaks), peaks, state["d2h"], state["h2d"], state["dw"], state["dr"], state["disk_peak"])


def formula_subgraphs(shape, batch: int, seq: int, dtype) -> list[SubgraphValues]:
    """The fallback: a Llama-like decoder's boundaries (one mask, one rotary pair, per-layer hidden states).

    `shape`: the planner's Shape (layers, hidden_size, head_dim, weight bytes). Subgraph 0 (embeddings,
    rotary, mask) stores hidden states B x S x hidden, position ids 1 x S int64, the causal mask
    B x 1 x S x S and rotary cos, sin 1 x S x head_dim each; each layer's subgraph stores its hidden
    states; the last one (the last layer and the head) stores none.
    """
    size = torch.empty((), dtype=dtype).element_size()
    dtype = str(dtype).replace("torch.", "")
    hidden = batch * seq * shape.hidden_size * size
    rotary = seq * shape.head_dim * size
    first = {
        "hidden_states": [((0, 0), hidden)],
        "position_ids": [((0, 1), seq * 8)],
        "causal_mask": [((0, 2), batch * seq * seq * size)],
        "position_embeddings": [((0, 3), rotary), ((0, 4), rotary)],
    }
    shared = ["position_ids", "causal_mask", "position_embeddings"]
    per_layer = shape.weight_bytes_per_layer or [0] * shape.layers
    rest = max(shape.weight_bytes_total - sum(per_layer), 0)
    shapes = {
        "hidden_states": f"{batch}x{seq}x{shape.hidden_size} {dtype}",
        "position_ids": f"1x{seq} int64",
        "causal_mask": f"{batch}x1x{seq}x{seq} {dtype}",
        "position_embeddings": f"(1x{seq}x{shape.head_dim} {dtype}, 1x{seq}x{shape.head_dim} {dtype})",
    }
    out = [SubgraphValues(["attention_mask", "input_ids"], ["attention_mask", "input_ids"], first, [],
                          rest // (1 if shape.tied_embeddings else 2), shapes)]  # fmt: skip
    for k in range(shape.layers):
        name_in = "hidden_states" if k == 0 else f"layer_{k - 1}"
        last = k == shape.layers - 1
        outputs = {} if last else {f"layer_{k}": [((k + 1, 0), hidden)]}
        weights = per_layer[k] + (rest - out[0].weight_bytes if last else 0)
        consumed = [name_in, *shared] if last else [name_in]
        shapes = {} if last else {f"layer_{k}": f"{batch}x{seq}x{shape.hidden_size} {dtype}"}
        out.append(SubgraphValues(sorted([name_in, *shared]), sorted(consumed), outputs, [f"layers.{k}"], weights,
                                  shapes))  # fmt: skip
    return out
