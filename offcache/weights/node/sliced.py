"""The node region's sliced onload (``OFFCACHE_NODE_ONLOAD=sliced``; offcache/weights/node/ holds the region).

In the default ``full`` mode every rank prefetches a subgraph's weights whole, an engine fetch
from the node's shared region. In the ``sliced`` mode a prefetch of the node region's tensors is
shared out between the node's ranks:

- **Layout**: the prefetch's region tensors, in the order every rank lists them (the subgraph's
  modules, then their parameters), packed into one flat byte buffer, each at a 64-byte aligned
  offset; the buffer is padded to ``n`` equal slices of ``S`` bytes (``n``: the node's ranks).
- **Slice**: rank ``i`` fetches bytes ``[i*S, (i+1)*S)`` of it from the region (the pieces of the
  tensors that fall in it: one engine fetch, from pinned memory) into a slice buffer.
- **Agreement** (collective 1): one ``all_gather_into_tensor`` of six int64 on a CPU (gloo) group:
  each rank's plan fingerprint (the subgraph, the node's ranks, every tensor's region offset,
  dtype and shape), whether it has room for the buffers and its slice was issued, the subgraph,
  the tensor count and bytes, and a fingerprint of the generations it saw before its fetch
  (ranks that saw different ones had a write land between their fetches: every rank skips, as
  the gathered bytes could mix old and new; a write after every fetch was issued changes the
  generation every rank checks at the onload, as in the full mode). Plans that differ raise
  :class:`NodeSlicedPlanError` on every rank (never a gather some ranks do not make); a rank
  without room (or whose fetch failed) makes every rank skip the sliced prefetch
  (``weight_prefetch_skips``), so every rank fetches those tensors at their onload.
- **Gather** (collective 2): ``all_gather_into_tensor`` of the slices into the flat buffer, on
  the node's group (the world's backend: NCCL on GPUs, gloo on the CPU; across nodes a group
  per node, made at set-up); each tensor's prefetched copy is a view of it. (Both are called
  as ``all_gather_single``, torch 2.14's name for it, where torch has it.) So a subgraph costs
  at most 2 collectives; a prefetch with nothing of the region to fetch on every rank costs the
  agreement alone.
- **Plan**: every region tensor of the prefetch's modules, prefetched already or not: what a
  rank holds prefetched differs between ranks (a write drops the writer's copy alone), the plan
  must not. A copy prefetched again replaces the older one. Each region entry (offset, dtype,
  shape) counts once: a tied weight is one object on every rank (cpu.py's ``_adopt``), and a
  second object over the same bytes is fetched by its rank alone.
- **Streams** (CUDA): the gather runs on a stream of its own, after the slice's H2D copy (the
  stream waits on the fetch's event, the engine hands its allocations to that stream), and
  records an event the consumer's stream waits on at the onload; the slice, the fetched pieces
  and the flat buffer stay referenced until then (the flat buffer is recorded on the consumer's
  stream), so nothing is reused before the gather completed. On the CPU (host backend, gloo)
  the fetch is waited for and the gather is synchronous: the same logic, run for real.

Everything else is as in the full mode: an onload takes its tensor's prefetched view while the
tensor's generation is unchanged (a stale one, or a tensor updated or deleted since, is fetched
whole by that rank alone: a miss never needs a collective), and tensors not in the region (a
local tensor assigned under ``disable_onloading()``) are prefetched whole by each rank.

Every rank must prefetch the same subgraphs in the same order (the sequential pipeline's first
forward of each subgraph does): a rank that never prefetches a subgraph the others do leaves
them in the agreement until the process group's timeout raises there. A rank of the node whose
process exits (killed) or is stopped by a signal while the others are in a collective is named:
:class:`NodeRankLostError` (the set-up recorded each rank's process), not a disagreement.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from offcache import engine as _engine
from offcache.weights.bookkeeping import Prefetched, WeightState

MODES = ("full", "sliced")
_ALIGN = 64  # every tensor's offset in the flat buffer (any dtype's view is aligned)


class NodeSlicedPlanError(RuntimeError):
    """The node's ranks disagree on a sliced prefetch (which tensors, or which subgraph)."""


class NodeRankLostError(RuntimeError):
    """A rank of the node stopped (its process exited, or was stopped by a signal) while the others
    were in a sliced prefetch's collective: names the rank(s)."""


def onload_mode() -> str:
    """OFFCACHE_NODE_ONLOAD: ``full`` (default: every rank copies whole subgraphs H2D) or ``sliced``."""
    raw = os.environ.get("OFFCACHE_NODE_ONLOAD", "").strip() or "full"
    if raw not in MODES:
        raise ValueError(f"OFFCACHE_NODE_ONLOAD must be 'full' or 'sliced', got {raw!r}")
    return raw


def check_modes(modes: list[str], depths: list[int | str]) -> None:
    """Every rank's OFFCACHE_NODE_ONLOAD (or its parse error) as group.py's set-up gathered them, and
    its OFFCACHE_WEIGHT_PREFETCH (an int, or its parse error): raises ValueError on every rank where a
    mode is garbage or the ranks disagree on it, and in the sliced mode, where every prefetch is a
    collective, where a depth is garbage or the ranks disagree on it (a rank prefetching less, or
    raising when its pipeline starts, would leave the others in the agreement)."""
    bad = [(rank, m) for rank, m in enumerate(modes) if m not in MODES]
    if bad:
        raise ValueError("; ".join(f"rank {rank}: {m}" for rank, m in bad))
    if len(set(modes)) > 1:
        raise ValueError(
            "the ranks disagree on OFFCACHE_NODE_ONLOAD: "
            + ", ".join(f"rank {rank} {m!r}" for rank, m in enumerate(modes))
            + " (set it alike on every rank)"
        )
    if modes[0] != "sliced":
        return
    bad = [(rank, d) for rank, d in enumerate(depths) if not isinstance(d, int)]
    if bad:
        raise ValueError(
            "; ".join(f"rank {rank}: {d}" for rank, d in bad) + " (OFFCACHE_NODE_ONLOAD=sliced: every rank reads it)"
        )
    if len(set(depths)) > 1:
        raise ValueError(
            "the ranks disagree on OFFCACHE_WEIGHT_PREFETCH: "
            + ", ".join(f"rank {rank} {str(d)!r}" for rank, d in enumerate(depths))
            + " (OFFCACHE_NODE_ONLOAD=sliced makes every prefetch a collective: set it alike on every rank)"
        )


class _Groups:
    """This rank's node: its ranks, its place among them, the gather group and the agreement group."""

    def __init__(self, gather: Any, agree: Any, ranks: list[int], pids: list[int] | None = None):
        self.gather = gather  # None: the world group
        self.agree = agree  # a CPU (gloo) group; None: the world group (gloo itself)
        self.ranks = ranks
        self.size = len(ranks)
        self.index = ranks.index(dist.get_rank())
        self.world = dist.group.WORLD  # the process group it was made in
        # The node's ranks' processes (this host's): (rank, pid, start time), to name one that stops.
        self.procs = [(r, pids[r], _proc(pids[r])[1]) for r in ranks] if pids is not None else []


def _proc(pid: int) -> tuple[str, int]:
    """A process's state letter and start time (/proc/<pid>/stat); ("", -1) where it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return "", -1


def _stopped(g: _Groups) -> list[str]:
    """The node's other ranks whose process exited (gone, a zombie, its pid reused) or is stopped."""
    out = []
    for rank, pid, started in g.procs:
        if rank == dist.get_rank():
            continue
        state, start = _proc(pid)
        if not state or state in "ZX" or start != started:
            out.append(f"rank {rank} (pid {pid}) exited")
        elif state in "tT":
            out.append(f"rank {rank} (pid {pid}) is stopped by a signal")
    return out


def _lost(g: _Groups, target: int, what: str, exc: BaseException) -> NodeRankLostError | None:
    """The error naming the node's ranks that stopped, where `exc` (a collective's) came of one; a
    closed connection may be seen just before the peer's exit shows: looked at for up to 2 s then."""
    connection = any(w in str(exc).lower() for w in ("connection", "closed", "broken pipe", "reset by peer"))
    deadline = time.monotonic() + (2.0 if connection else 0.0)
    while True:
        stopped = _stopped(g)
        if stopped or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if not stopped:
        return None
    return NodeRankLostError(
        f"rank {dist.get_rank()}: offcache's sliced onload (OFFCACHE_NODE_ONLOAD=sliced) of subgraph {target}: "
        f"{', '.join(stopped)} during the {what} ({type(exc).__name__}: {exc})"
    )


_groups: _Groups | None = None
_streams: dict[torch.device, Any] = {}


def setup(keys: list[str], pids: list[int] | None = None) -> None:
    """Make the sliced mode's groups (collective: every rank calls it, with every rank's node key and
    process id: a rank of this node that stops is named by the collective that fails).

    One node: the world group gathers (and agrees, where its backend is gloo). Several nodes: a
    group per node, every rank making each (``new_group``'s rule); gathers stay within a node."""
    global _groups
    gloo = dist.get_backend() == "gloo"
    rank = dist.get_rank()
    nodes = list(dict.fromkeys(keys))
    if len(nodes) == 1:
        agree = None if gloo else dist.new_group(backend="gloo")
        _groups = _Groups(None, agree, list(range(len(keys))), pids)
        return
    mine: tuple = ()
    for key in nodes:
        ranks = [r for r, k in enumerate(keys) if k == key]
        gather = dist.new_group(ranks)
        agree = gather if gloo else dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            mine = (gather, agree, ranks, pids)
    _groups = _Groups(*mine)


def reset() -> None:
    global _groups
    _groups = None


def active() -> bool:
    """Whether prefetches of the node region are sliced (the mode is ``sliced`` and the node set up)."""
    return _groups is not None and dist.is_initialized() and _groups.world is dist.group.WORLD


def _all_gather(out: torch.Tensor, mine: torch.Tensor, group) -> None:
    # torch 2.14 names it all_gather_single (all_gather_into_tensor warns there); older ones not.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, mine, group=group)


def _round(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _fingerprint(plan: tuple) -> int:
    return int.from_bytes(hashlib.blake2b(repr(plan).encode(), digest_size=8).digest(), "little", signed=True)


class _Ticket:
    """A sliced prefetch's ticket: complete once the gather has (on CUDA: the consumer's stream
    waits on the gather's event). Holds the buffers until then."""

    def __init__(self, event, flat: torch.Tensor, held: list):
        self.event, self.flat, self.held = event, flat, held

    def query(self) -> bool:
        return self.event is None or self.event.query()

    @staticmethod
    def issued() -> bool:
        return True

    def wait(self) -> None:
        if self.event is not None:
            stream = torch.cuda.current_stream(self.flat.device)
            stream.wait_event(self.event)
            self.flat.record_stream(stream)  # its views are read there: not reused before
        self.held = []  # the slice and the pieces: the gather (which the consumer now follows) read them


def _gather_stream(device: torch.device):
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


def prefetch(items: list[tuple[Any, torch.Tensor]], device: torch.device, target: int,
             free_bytes: Callable[[torch.device], int | None], state: WeightState) -> tuple[int, list]:  # fmt: skip
    """A sliced prefetch of `items` ((cache, offloaded) of NodeSharedCPUCache instances, onloading
    to `device`) for subgraph `target`, made by every rank of the node together: 1 or 2
    collectives. Returns the bytes prefetched and the items left to the per-rank path (not in
    the node region)."""
    g = _groups
    assert g is not None, "node.sliced.prefetch is used only in the sliced mode"
    region_items, rest = [], []
    entries: set[tuple] = set()
    for cache, offloaded in items:
        region = getattr(cache, "_region", None)
        offset = region.locate(offloaded) if region is not None else None  # None unless plain (region.plain)
        entry = (offset, offloaded.dtype, tuple(offloaded.shape))
        if offset is None or region.word_at(offset) is None:
            rest.append((cache, offloaded))
        elif entry in entries:
            # Another object over the same region bytes (the plan counts each entry once, however
            # many objects a rank holds for it): fetched by this rank alone, not aliased.
            rest.append((cache, offloaded))
        else:
            entries.add(entry)
            region_items.append((cache, offloaded, offset))

    # The layout: every tensor at an aligned offset of the flat buffer, n slices of S bytes.
    at, layout = 0, []
    for _, offloaded, _ in region_items:
        layout.append((at, offloaded.nbytes))
        at = _round(at + offloaded.nbytes)
    total = at
    n = g.size
    slice_bytes = _round(-(-total // n)) if total else 0
    plan = (target, n, tuple((o, str(t.dtype), tuple(t.shape)) for _, t, o in region_items))
    lo, hi = g.index * slice_bytes, (g.index + 1) * slice_bytes

    # This rank's slice: the pieces of the tensors in [lo, hi), fetched from the region (issued now).
    ok = 1
    tags, pieces, fetched, ticket = [], [], [], None
    if total:
        free = free_bytes(device)
        if free is not None and (n + 2) * slice_bytes > free:
            ok = 0
        else:
            tags = [cache.tag(offloaded) for cache, offloaded, _ in region_items]  # before the copies
            for (at, nbytes), (_, offloaded, _) in zip(layout, region_items):
                a, b = max(at, lo), min(at + nbytes, hi)
                if a < b:
                    raw = offloaded.detach().reshape(-1).view(torch.uint8)
                    pieces.append((a - lo, raw[a - at : b - at]))
            try:
                if pieces:
                    fetched, ticket = _engine.fetch([p for _, p in pieces], device, wait=False)
                    if device.type == "cpu":
                        ticket.wait()  # the host backend: the slice is read before the gather
            except Exception:  # noqa: BLE001  (every rank skips: the onloads fetch and say why)
                ok = 0

    # Collective 1: the agreement (plans, room), on a CPU group.
    # The generations each rank saw before its fetch: where they differ, a write landed between two
    # ranks' fetches and the gathered bytes could mix old and new: every rank skips.
    seen = _fingerprint(tuple(tags))
    mine = torch.tensor([_fingerprint(plan), ok, target, len(region_items), total, seen], dtype=torch.int64)
    every = torch.empty(n * 6, dtype=torch.int64)
    try:
        _all_gather(every, mine, g.agree)
    except RuntimeError as exc:
        lost = _lost(g, target, "agreement", exc)
        if lost is not None:
            raise lost from exc
        raise NodeSlicedPlanError(
            f"rank {dist.get_rank()}: offcache's sliced onload (OFFCACHE_NODE_ONLOAD=sliced) of subgraph "
            f"{target}: the node's ranks did not agree on the prefetch ({type(exc).__name__}: {exc}); every "
            "rank must prefetch the same subgraphs in the same order"
        ) from exc
    every = every.view(n, 6).tolist()
    if len({row[0] for row in every}) > 1:
        described = ", ".join(
            f"rank {g.ranks[i]}: subgraph {row[2]}, {row[3]} tensors, {row[4]} bytes" for i, row in enumerate(every)
        )
        raise NodeSlicedPlanError(
            f"rank {dist.get_rank()}: offcache's sliced onload (OFFCACHE_NODE_ONLOAD=sliced): the node's ranks "
            f"disagree on what to prefetch ({described}); every rank must prefetch the same subgraphs in the "
            "same order (OFFCACHE_NODE_ONLOAD=full prefetches on each rank alone)"
        )
    if not total:
        return 0, rest
    if not all(row[1] for row in every) or len({row[5] for row in every}) > 1:
        state.counters["weight_prefetch_skips"] += 1
        return 0, rest  # some rank has no room (or its fetch failed): every rank fetches at its onload

    # Collective 2: the gather, after the slice landed (on CUDA: on the gather stream).
    event = None
    try:
        if device.type == "cuda":
            stream = _gather_stream(device)
            with torch.cuda.stream(stream):
                flat, slice_buf = _gather(g, device, n, slice_bytes, pieces, fetched, ticket)
                event = torch.cuda.Event()
                event.record(stream)
        else:  # the host backend: the pieces were waited for before the agreement
            flat, slice_buf = _gather(g, device, n, slice_bytes, pieces, fetched, None)
    except RuntimeError as exc:
        lost = _lost(g, target, "gather", exc)
        if lost is not None:
            raise lost from exc
        raise
    shared_ticket = _Ticket(event, flat, [slice_buf, fetched, ticket])
    for (cache, offloaded, _), (at, nbytes), tag in zip(region_items, layout, tags):
        view = flat[at : at + nbytes].view(offloaded.dtype).view(offloaded.shape)
        state.prefetched[id(offloaded)] = Prefetched(
            offloaded, cache, view, shared_ticket, device, offloaded._version, target, nbytes, tag
        )
    state.counters["weight_prefetch_bytes"] += sum(nbytes for _, nbytes in layout)
    state.counters["weight_sliced_prefetches"] += 1
    state.counters["weight_sliced_fetch_bytes"] += sum(p.numel() for _, p in pieces)
    return sum(nbytes for _, nbytes in layout), rest


def _gather(g: _Groups, device, n: int, slice_bytes: int, pieces, fetched, ticket):
    """The slice assembled from its fetched pieces and all-gathered into the flat buffer (on the
    current stream of `device`, which first waits for the pieces' copy)."""
    if ticket is not None:
        ticket.wait()  # on CUDA the current (gather) stream waits on the copy; its allocations move here
    slice_buf = torch.empty(slice_bytes, dtype=torch.uint8, device=device)
    for (at, _), piece in zip(pieces, fetched):
        slice_buf[at : at + piece.numel()].copy_(piece)
    flat = torch.empty(n * slice_bytes, dtype=torch.uint8, device=device)
    _all_gather(flat, slice_buf, g.gather)
    return flat, slice_buf
