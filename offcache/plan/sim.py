"""The planner's replay of the sequential pipeline's cache calls, and its Llama-formula fallback.

`simulate_groups` replays what llm-compressor 0.14's SequentialPipeline does to the cache:
``IntermediatesCache.from_dataloader`` stores each batch, then for each subgraph but the last,
batch by batch, ``update(outputs)`` then ``delete(consumed_names)``; every subgraph fetches its
``input_names`` once per pass (two passes with ``propagate_error``, llm-compressor's default).
Memory is counted as offcache's engine holds it: each update() is one arena block (every tensor
rounded up to 256 bytes; a tensor given twice in one call, e.g. one mask under several layer
names, is stored once) that lives while any of its names does; a store snapshots its source
first (on a CPU model, in host memory, until the copy lands), unless the engine copies a store
of CPU memory on the calling thread (`copied_inline`, its default): then the block is all. A
block that does not fit under the host limit goes to the disk tier; its bytes are written there
and read back on every fetch.

Snapshots still in flight (`in_flight_bounds`): on a CPU model a store's snapshot is an arena
block (the engine's staging, csrc/engine/engine_store.cpp) that lives until its copy completes and the
engine reaps it. Nothing in the pipeline waits for a store but a fetch of what it stored (a
fetch's copy waits for the block's store, and a CPU consumer waits for the fetch; the copy
stream completes in order, so every earlier store is then complete too), so the snapshots that
may be alive at a store are those of the stores after the newest one a fetch has read: with
``propagate_error`` (two passes) the current subgraph's earlier stores, and every store of the
subgraphs since the newest one whose values it reads (its first pass fetched every batch's);
with one pass, the subgraph it reads completes batch by batch alongside the current stores.
The engine bounds them apart from timing: a store waits (``Engine::throttle``) until the
copies of stores in flight plus its own are at most OFFCACHE_MAX_IN_FLIGHT bytes (one larger
store goes alone), so the snapshots alive are at most max(OFFCACHE_MAX_IN_FLIGHT, the largest
store) bytes, each rounded up to the arena's alignment.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from offcache.plan.trace import SubgraphValues

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
    approximate: bool = False  # the memory/disk split after a long alternating run is approximate (see _fast_forward)
    # What snapshots still in flight may hold beyond `peaks` (a CPU model's; in_flight_bounds), per phase
    # as `peaks`; bound_bytes: the most the cache holds with them, max(peaks[i] + in_flight[i]).
    in_flight: list[int] = field(default_factory=list)
    bound_bytes: int = 0


def inputs_of(batch: int, seq: int) -> dict[str, list]:
    """The calibration batch as the dataloader gives it: input_ids and attention_mask, int64."""
    return {"input_ids": [(("in", 0), batch * seq * 8)], "attention_mask": [(("in", 1), batch * seq * 8)]}


def simulate(per_batch: list[list[SubgraphValues]], inputs: list[dict], *, onload: str, host_limit: int,
             passes: int = 2, max_in_flight: int | None = None, copied_inline: bool = False) -> Replay:  # fmt: skip
    """Replay the pipeline over batches; per_batch[b][k] is subgraph k's values for batch b.

    Consecutive batches given the same subgraph list and inputs are replayed as one group
    (simulate_groups)."""
    groups: list[list] = []
    for subgraphs, given in zip(per_batch, inputs):
        if groups and groups[-1][1] is subgraphs and groups[-1][2] == given:
            groups[-1][0] += 1
        else:
            groups.append([1, subgraphs, given])
    return simulate_groups([tuple(g) for g in groups], onload=onload, host_limit=host_limit, passes=passes,
                           max_in_flight=max_in_flight, copied_inline=copied_inline)  # fmt: skip


@dataclass
class _Store:
    """One batch's update() in a template: the new block, and the blocks it and the deletes after it empty."""

    block: int  # the new block's number in the template
    size: int  # its bytes in the arena (aligned)
    raw: int  # its tensors' bytes (D2H)
    tensors: int  # distinct tensors in it
    over: list[int]  # blocks emptied by storing a name again (before the new block is counted)
    after: list[int]  # blocks emptied by the deletes after it (the new one may be among them)


@dataclass
class _Template:
    """What one batch of one shape does to the cache, in blocks numbered per batch."""

    sizes: list[int]  # block number -> bytes
    stores: list[_Store]  # the calibration set's, then each subgraph's but the last's
    fetches: list[list[tuple[int, int]]]  # per subgraph: (block, bytes) fetched once per pass


def _template(subgraphs: list[SubgraphValues], inputs: dict) -> _Template:
    """Replay one batch alone, as simulate_each does, recording which block each call touches."""
    sizes: list[int] = []
    names_of: list[set] = []
    where: dict[str, int] = {}
    leaves_of: dict[str, list] = {}
    stores: list[_Store] = []
    fetches: list[list[tuple[int, int]]] = []

    def drop(name: str, emptied: list[int]) -> None:
        ident = where.pop(name)
        leaves_of.pop(name, None)
        names_of[ident].discard(name)
        if not names_of[ident]:
            emptied.append(ident)

    def store(values: dict[str, list], consumed) -> None:
        distinct: dict = {}
        for leaves in values.values():
            for key, nbytes in leaves:
                distinct.setdefault(key, nbytes)
        ident = len(sizes)
        sizes.append(sum(aligned(v) for v in distinct.values()))
        names_of.append(set(values))
        over: list[int] = []
        for name in values:
            if name in where:
                drop(name, over)
            where[name] = ident
            leaves_of[name] = values[name]
        after: list[int] = []
        for name in consumed:
            if name in where:
                drop(name, after)
        stores.append(_Store(ident, sizes[ident], sum(distinct.values()), len(distinct), over, after))

    store(inputs, ())
    for k, sg in enumerate(subgraphs):
        seen: set = set()
        fetched: dict[int, int] = {}
        for name in sg.input_names:
            if name not in where:
                continue
            for key, nbytes in leaves_of[name]:
                if key not in seen:
                    seen.add(key)
                    fetched[where[name]] = fetched.get(where[name], 0) + nbytes
        fetches.append(sorted(fetched.items()))
        if k < len(subgraphs) - 1:
            store(sg.outputs, sg.consumed_names)
    return _Template(sizes, stores, fetches)


def simulate_groups(groups: list[tuple[int, list[SubgraphValues], dict]], *, onload: str, host_limit: int,
                    passes: int = 2, max_in_flight: int | None = None,
                    copied_inline: bool = False) -> Replay:  # fmt: skip
    """Replay the pipeline over groups of alike batches, (count, subgraph values, inputs) in batch order.

    The same numbers as simulate_each over every batch, at a cost that does not grow with the counts:
    batches of one shape whose blocks sit in the same tiers form a run, and a run's stores are taken
    in closed form, split only where blocks stop (or start) fitting under the host limit. Runs stay
    few: a batch with a block in host memory holds at least its bytes there, so at most about
    host_limit / (the smallest block) batches differ from their neighbours.
    """
    templates = [_template(subgraphs, given) for count, subgraphs, given in groups]
    subgraphs = min((len(g[1]) for g in groups if g[0]), default=0)
    # a run: [group, count, the numbers of its live blocks on disk]
    runs: list[list] = [[g, count, frozenset()] for g, (count, _, _) in enumerate(groups) if count > 0]
    st = {"host": 0, "disk": 0, "peak": 0, "disk_peak": 0, "d2h": 0, "h2d": 0, "dw": 0, "dr": 0, "approximate": False}
    limit = host_limit

    def stores(runs: list[list], which: int) -> list[list]:
        out: list[list] = []
        for g, count, on_disk in runs:
            s = templates[g].stores[which]
            sizes = templates[g].sizes
            staging = s.size if onload == "cpu" and not copied_inline else 0
            emptied = set(s.over) | set(s.after)
            moves = {}
            for disk in (False, True):
                tier = on_disk | {s.block} if disk else on_disk
                over_d = sum(sizes[i] for i in s.over if i in tier)
                over_h = sum(sizes[i] for i in s.over) - over_d
                after_d = sum(sizes[i] for i in s.after if i in tier)
                after_h = sum(sizes[i] for i in s.after) - after_d
                mid_h = (0 if disk else s.size) - over_h
                mid_d = (s.size if disk else 0) - over_d
                moves[disk] = (mid_h - after_h, mid_d, mid_d - after_d, frozenset(tier - emptied))
            steps = 0
            while count:
                h, d = st["host"], st["disk"]
                steps += 1
                if steps > FAST_FORWARD and _alternates(moves, h, limit - s.size):
                    out.extend(_fast_forward(st, g, count, moves, s, staging, limit))
                    st["approximate"] = True
                    break
                disk = h + s.size > limit
                dh, mid_d, dd, tier = moves[disk]
                if not disk:  # fits while h + j*dh + size <= limit
                    m = count if dh <= 0 else min(count, (limit - s.size - h) // dh + 1)
                else:  # spills while h + j*dh + size > limit
                    m = count if dh >= 0 else min(count, -(-(h + s.size - limit) // -dh))
                st["peak"] = max(st["peak"], h + d + s.size + staging + max(0, (m - 1) * (dh + dd)))
                st["disk_peak"] = max(st["disk_peak"], d + mid_d + max(0, (m - 1) * dd))
                st["host"], st["disk"] = h + m * dh, d + m * dd
                st["d2h"] += m * s.raw
                if disk:
                    st["dw"] += m * s.size
                if out and out[-1][0] == g and out[-1][2] == tier:
                    out[-1][1] += m
                else:
                    out.append([g, m, tier])
                count -= m
        return out

    runs = stores(runs, 0)
    peaks = [st["peak"]]
    for k in range(subgraphs):
        st["peak"] = st["host"] + st["disk"]
        for g, count, on_disk in runs:
            for block, nbytes in templates[g].fetches[k]:
                st["h2d"] += passes * count * nbytes
                if block in on_disk:
                    st["dr"] += passes * count * nbytes
        if k < subgraphs - 1:
            runs = stores(runs, k + 1)
        peaks.append(st["peak"])
    phases = [[(count, templates[g].stores[i]) for g, (count, _, _) in enumerate(groups)
               if count > 0 and i < len(templates[g].stores)] for i in range(len(peaks))]  # fmt: skip
    # The newest phase each subgraph's fetch reads (a template's block k is its phase k's): the fewest of any group.
    reads = [-1] + [min((max((b for b, _ in templates[g].fetches[k]), default=-1) for g, (count, _, _)
                         in enumerate(groups) if count > 0), default=-1) for k in range(subgraphs)]  # fmt: skip
    in_flight = in_flight_bounds(phases, reads, onload=onload, passes=passes, max_in_flight=max_in_flight,
                                 copied_inline=copied_inline)  # fmt: skip
    return Replay(max(peaks), peaks, st["d2h"], st["h2d"], st["dw"], st["dr"], st["disk_peak"], st["approximate"],
                  in_flight, max(p + f for p, f in zip(peaks, in_flight)))  # fmt: skip


def in_flight_bounds(phases: list[list[tuple[int, _Store]]], reads: list[int], *, onload: str, passes: int,
                     max_in_flight: int | None, copied_inline: bool = False) -> list[int]:  # fmt: skip
    """Per phase (the calibration set's stores, then each subgraph's; the last stores none): the most
    that snapshots still in flight may hold beyond the replay's peak, which counts the one being stored.

    `phases[p]`: (count, store) of phase p's stores in batch order, each store's snapshot its block's
    bytes (the engine stages each group of a store's tensors in one arena block, no larger than theirs).
    `reads[p]`: the newest phase whose block the fetch before phase p's stores reads (-1: none). A
    fetch's wait completes that phase's store of its batch and every store before it (one copy stream,
    in order); a snapshot completed by that wait is freed only by the engine's next reap, so it counts
    too. With two passes the first fetches every batch before the second stores: the phases up to the
    newest read are done; with one pass the newest read completes batch by batch alongside the stores.
    At most max(max_in_flight, the largest store) bytes of copies, each group's snapshot rounded up to
    ALIGN (None: no limit). A GPU model's snapshots are device memory: nothing. Nor when the engine
    copies stores of CPU memory on the calling thread (`copied_inline`: its default, see
    ``copied_inline()`` in offcache/plan/core.py): each store has landed when update() returns.
    """
    if onload != "cpu" or copied_inline:
        return [0] * len(phases)

    def before(stores: list[tuple[int, _Store]], b: int) -> int:  # the snapshots of a phase's batches before b
        got = 0
        for n, st in stores:
            got += min(n, max(b, 0)) * st.size
            b -= n
        return got

    totals = [sum(n * s.size for n, s in phase) for phase in phases]
    out = []
    done = -1  # every store of the phases up to this one has completed, and been reaped
    for p, phase in enumerate(phases):
        q = reads[p]
        if passes > 1:
            done = max(done, q)
        partial = passes == 1 and done < q < p  # phase q completes batch by batch with phase p's stores
        full = sum(totals[r] for r in range(done + 1, p) if not (partial and r == q))
        batches = [n for n, _ in (phase or (phases[q] if partial else []))]
        ends = list(itertools.accumulate(batches))
        candidates = [b for n, e in zip(batches, ends) for b in (e - n, e - 1)] or [0]
        held = max(full + before(phase, b) + (totals[q] - before(phases[q], b) if partial else 0) for b in candidates)
        if max_in_flight is not None and held:
            window = [st for r in range(done + 1, p + 1) for st in phases[r]]
            largest = max(st.size for _, st in window)
            held = min(held, max(max_in_flight, largest) + (ALIGN - 1) * sum(n * st.tensors for n, st in window))
        out.append(held)
        done = max(done, q)
    return out


FAST_FORWARD = 256  # sub-runs of one run before a run that alternates between memory and disk is taken at once


def _alternates(moves: dict, h: int, threshold: int) -> bool:
    """Whether a run's stores now alternate for good: a store that fits raises the host bytes, one that
    spills lowers them, the total moves alike either way, and h is inside the window they cycle in."""
    a, b = moves[False][0], -moves[True][0]
    same_total = moves[False][0] + moves[False][2] == moves[True][0] + moves[True][2]
    return a > 0 and b > 0 and same_total and threshold - b < h <= threshold + a


def _fast_forward(st: dict, g: int, count: int, moves: dict, s: _Store, staging: int, limit: int) -> list[list]:
    """The rest of an alternating run at once. Host bytes h go up by a when a store fits (h <= limit - size)
    and down by b when it spills: a rotation by a on a window of a + b, so after `count` stores h is known,
    and with it how many fitted. Memory, disk, transfers and the peak are exact; which batches fitted is
    not kept (those that fitted come first in the runs returned), so later subgraphs' split between
    memory and disk is approximate."""
    (a, mid_fit, dd_h, tier_h), (dh_d, mid_spill, dd_d, tier_d) = moves[False], moves[True]
    b = -dh_d
    low = limit - s.size - b  # the window h cycles in: (low, low + a + b]
    h, d = st["host"], st["disk"]
    end = low + (h - low - 1 + count * a) % (a + b) + 1
    fitted = (end - h + count * b) // (a + b)
    spilled = count - fitted
    step = a + dd_h  # the total's change, alike either way
    st["peak"] = max(st["peak"], h + d + s.size + staging + max(0, (count - 1) * step))
    d_end = d + fitted * dd_h + spilled * dd_d
    st["disk_peak"] = max(st["disk_peak"], max(d, d_end) + max(mid_fit, mid_spill, 0) + max(dd_h, dd_d, 0))
    st["host"], st["disk"] = end, d_end
    st["d2h"] += count * s.raw
    st["dw"] += spilled * s.size
    return [[g, n, tier] for n, tier in ((fitted, tier_h), (spilled, tier_d)) if n]


def simulate_each(per_batch: list[list[SubgraphValues]], inputs: list[dict], *, onload: str, host_limit: int,
             passes: int = 2, max_in_flight: int | None = None, copied_inline: bool = False) -> Replay:  # fmt: skip
    """Replay the pipeline batch by batch; per_batch[b][k] is subgraph k's values for batch b.

    The reference for simulate_groups (its cost grows with the batches).
    """
    n = len(per_batch)
    blocks: dict[int, list] = {}  # id -> [bytes, live names, on disk]
    where: list[dict[str, int]] = [{} for _ in range(n)]
    leaves_of: list[dict[str, list]] = [{} for _ in range(n)]
    state = {"host": 0, "disk": 0, "peak": 0, "disk_peak": 0, "d2h": 0, "h2d": 0, "dw": 0, "dr": 0, "next": 0}
    phases: list[list[tuple[int, _Store]]] = [[]]  # every store, per phase (for in_flight_bounds)
    reads = [-1]  # per phase, the newest phase the fetch before its stores reads (the fewest of any batch)
    phase_of: dict[int, int] = {}

    def store(b: int, values: dict[str, list]) -> None:
        distinct: dict = {}
        for leaves in values.values():
            for key, nbytes in leaves:
                distinct.setdefault(key, nbytes)
        block = sum(aligned(v) for v in distinct.values())
        staging = block if onload == "cpu" and not copied_inline else 0  # snapshotted into the arena first
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
        phases[-1].append((1, _Store(ident, block, sum(distinct.values()), len(distinct), [], [])))
        phase_of[ident] = len(phases) - 1
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

    def fetch(b: int, names) -> int:
        newest = -1
        seen: set = set()
        for name in names:
            if name not in where[b]:
                continue
            on_disk = blocks[where[b][name]][2]
            newest = max(newest, phase_of[where[b][name]])
            for key, nbytes in leaves_of[b][name]:
                if key in seen:
                    continue
                seen.add(key)
                state["h2d"] += nbytes
                if on_disk:
                    state["dr"] += nbytes
        return newest

    for b in range(n):
        store(b, inputs[b])
    peaks = [state["peak"]]
    subgraphs = len(per_batch[0]) if n else 0
    for k in range(subgraphs):
        state["peak"] = state["host"] + state["disk"]
        phases.append([])
        newest = [fetch(b, per_batch[b][k].input_names) for _ in range(passes) for b in range(n)]
        reads.append(min(newest, default=-1))
        if k < subgraphs - 1:
            for b in range(n):
                store(b, per_batch[b][k].outputs)
                for name in per_batch[b][k].consumed_names:
                    if name in where[b]:
                        _drop(b, name)
        peaks.append(state["peak"])
    in_flight = in_flight_bounds(phases, reads, onload=onload, passes=passes, max_in_flight=max_in_flight,
                                 copied_inline=copied_inline)  # fmt: skip
    return Replay(max(peaks), peaks, state["d2h"], state["h2d"], state["dw"], state["dr"], state["disk_peak"],
                  in_flight=in_flight, bound_bytes=max(p + f for p, f in zip(peaks, in_flight)))  # fmt: skip


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
