"""NodeSharedCPUCache: compressed-tensors' DistributedCPUCache with its tensors in the node's shared
region (offcache/weights/node/__init__.py explains the whole; region.py holds the region)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from offcache.util.extras import as_missing

try:
    from compressed_tensors.distributed import get_source_rank, is_source_process
    from compressed_tensors.offload.cache.cpu import CPUCache
    from compressed_tensors.offload.cache.dist_cpu import DistributedCPUCache
    from compressed_tensors.offload.cache.utils import catch_cpu_mem_error
    from compressed_tensors.offload.utils import to_tensor
except ModuleNotFoundError as _missing:  # one line naming the extra
    raise as_missing(
        _missing, ("compressed_tensors", "transformers"), "llmcompressor", "offcache.weights.node"
    ) from None

from offcache import engine as _engine  # noqa: E402
from offcache.weights.caches import EngineCache, fetch_host, with_class_of  # noqa: E402
from offcache.weights.node.batch import BatchOffload, check_names, check_shape, gather_verdicts  # noqa: E402
from offcache.weights.node.group import GROUP  # noqa: E402
from offcache.weights.node.region import (  # noqa: E402
    ALIGN,
    WORD,
    NodeRegion,
    NodeRegionFullError,
    NodeShapeMismatchError,
    nbytes_of,
    plain,
    round_up,
)


def _shape_of(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _shape_of(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


class NodeSharedCPUCache(BatchOffload, EngineCache, DistributedCPUCache):
    """compressed-tensors' ``DistributedCPUCache`` with its offloads in the node's region, a batch at
    a time, and its onloads engine fetches from the region (prefetched as with one process, or
    sliced between the node's ranks: sliced.py)."""

    _sliced_onload = True  # compressed_tensors.prefetch gives its prefetches to node/sliced.py in the sliced mode

    def __init__(self, onload_device, offload_device=None):
        super().__init__(onload_device, offload_device=offload_device)
        self._region = GROUP.node.region if GROUP.node is not None else None  # the region its tensors live in

    @classmethod
    def from_mapping(cls, mapping, onload_device, offload_device=None, **kwargs):
        instance = cls(onload_device=onload_device, offload_device=offload_device, **kwargs)
        instance.offloaded_values = instance._offload_mapping(dict(mapping))
        return instance

    # -- onload: an engine fetch from the region (WeightState.onload) --
    def onload(self, offloaded: torch.Tensor | None) -> torch.Tensor | None:
        """A copy of `offloaded` on the onload device: the prefetched one while its generation is
        unchanged, else an engine fetch from the region (pinned where registered)."""
        return self.state.onload(self, offloaded)

    def fetch(self, offloaded: list[torch.Tensor], device: torch.device) -> list[tuple[torch.Tensor, Any]]:
        return fetch_host(offloaded, device)

    def finish(self, fetched: torch.Tensor, offloaded: torch.Tensor) -> torch.Tensor:
        out = with_class_of(fetched, offloaded, onloaded=True)
        if _onload_is_cpu(self) and offloaded.requires_grad:
            out.requires_grad_(True)  # compressed-tensors hands out the offloaded tensor itself there
        return out

    def prefetchable(self, offloaded: torch.Tensor, device: torch.device) -> bool:
        # A local tensor (assigned under disable_onloading) onloaded to the CPU: a fetch is a clone.
        return device.type != "cpu" or _engine.is_shared_tensor(offloaded)

    def _word(self, offloaded: torch.Tensor) -> torch.Tensor | None:
        return self._region.word(offloaded) if self._region is not None else None

    def tag(self, offloaded: torch.Tensor) -> int | None:
        """The generation before a prefetch is issued (-1: a rank is writing it: never fresh)."""
        word = self._word(offloaded)
        if word is None:
            return None
        generation = _engine.shared_word_add(word, 0)
        return generation if generation % 2 == 0 else -1

    def is_fresh(self, offloaded: torch.Tensor, tag: int | None) -> bool:
        """Whether no rank wrote `offloaded` since the prefetch was issued (its copy has landed)."""
        if tag is None:
            return True
        word = self._word(offloaded)
        return tag >= 0 and word is not None and _engine.shared_word_add(word, 0) == tag

    def __getitem__(self, key):
        # Handed out under disable_onloading(): the caller may write it directly, which no
        # generation sees: the other ranks' prefetched copies of it are made stale now.
        if self.onloading_disabled:
            offloaded = self.offloaded_values.get(key)
            word = self._word(offloaded) if offloaded is not None else None
            if word is not None:
                _engine.shared_word_add(word, 2)
        return super().__getitem__(key)

    @torch.no_grad()
    def update_offload(self, offloaded: torch.Tensor, data: torch.Tensor | None) -> None:
        """compressed-tensors' ``offloaded.copy_(data)`` into the shared bytes (landed on return:
        visible to every rank of the node after a barrier), after this rank's copies still reading
        them, between two steps of the tensor's generation (odd while writing)."""
        if data is None:
            return
        self.state.drop_prefetched(offloaded)
        word = self._word(offloaded)
        if word is None:  # not in the region (a local tensor): compressed-tensors' update
            return super().update_offload(offloaded, data)
        _engine.wait_shared_reads(offloaded)  # an onload's copy still in flight reads the old bytes
        _engine.shared_word_add(word, 1)
        try:
            super().update_offload(offloaded, data)
        finally:
            _engine.shared_word_add(word, 1)

    # -- offload: a batch per module (offload, __setitem__, _name: _BatchOffload) --
    def _offload_local(self, tensor: torch.Tensor) -> torch.Tensor:
        """Under compressed-tensors' as_single_threaded(): its CPUCache's offload (a local tensor)."""
        return CPUCache.offload(self, tensor)

    @catch_cpu_mem_error  # compressed-tensors' remediation hint, as its from_mapping logs it (per offload)
    def _offload_batch(self, mapping: dict) -> dict:
        """Offload every tensor of `mapping` (name -> tensor or None): one broadcast, one all_gather."""
        node = GROUP.node
        assert node is not None, "NodeSharedCPUCache is used only after cache_class() set up the node region"
        region = node.region
        self._region = region
        source = get_source_rank()
        names = [name for name, t in mapping.items() if t is not None]
        out = dict.fromkeys(mapping)

        if is_source_process():
            header: Any
            entries: list[tuple] = []
            new: list[tuple[int, torch.Tensor]] = []  # (entry index, cpu tensor)
            try:
                seen: dict[int, int] = {}  # id(tensor) -> entry index (tied within the batch)
                for name in names:
                    t = mapping[name]
                    if id(t) in seen:
                        entries.append((name,) + tuple(entries[seen[id(t)]][1:]))
                        continue
                    seen[id(t)] = len(entries)
                    offset = region.locate(t)
                    if offset is not None and region.word_at(offset) is not None:
                        # already a tensor of the region (tied, or offloaded before): its generation too
                        entries.append((name, "at", offset, t.dtype, _shape_of(t), -1))
                        continue
                    new.append((len(entries), t))
                    entries.append((name, "new", 0, t.dtype, _shape_of(t), len(new) - 1))
                # The batch: its generation words, then its tensors.
                total = round_up(WORD * len(new), ALIGN) if new else 0
                rels = []  # new tensor k's offset in the batch
                for _, t in new:
                    rels.append(total)
                    total = round_up(total + max(t.nbytes, 1), ALIGN)
                # (a tie within the batch is an entry of its own with the first's index)
                entries = [e[:2] + (rels[e[5]],) + e[3:] if e[1] == "new" else e for e in entries]
                start = region.allocate(total) if total else -1
                header = ("ok", source, node.keys[source], start, total)
            except (OSError, MemoryError) as exc:
                header = ("error", f"{type(exc).__name__}: {exc}")
            payload = [header, entries]
        else:
            payload = [None, None]
        dist.broadcast_object_list(payload, src=source)
        header, entries = payload
        if header[0] == "error":
            raise NodeRegionFullError(header[1]) if "NodeRegionFullError" in header[1] else OSError(header[1])
        _, source, source_key, start, total = header
        mine = node.keys[node.rank]

        error = ""
        try:
            if total:
                if mine != source_key:
                    region.reserve(start, total)
                data = region.span(start, total)
            if is_source_process():
                with torch.no_grad():
                    for (_, t), rel in zip(new, rels):
                        if t.nbytes:
                            data[rel : rel + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
            if node.multi and total:
                # Other nodes' regions get the batch's bytes; ranks beside the source, or beside
                # their node's leader, receive into scratch memory.
                leader_here = node.leader(mine) == node.rank
                into = data if (mine != source_key and leader_here) or node.rank == source else torch.empty_like(data)
                dist.broadcast(into[:total], src=source)
            check_names(names, entries)
            noted: set[int] = set()
            for _, kind, rel, dtype, shape, index in entries:
                if kind == "new" and index not in noted:
                    noted.add(index)
                    region.note(start + rel, nbytes_of(dtype, shape), start + WORD * index)
            adopted: dict[int, torch.Tensor] = {}  # id(this rank's tensor) -> its offload (tied stay one)
            for name, kind, offset, dtype, shape, _ in entries:
                if kind == "new":
                    offset = start + offset
                t = mapping[name]
                if id(t) not in adopted:
                    adopted[id(t)] = self._adopt(self._name(name), t, region, offset, dtype, shape)
                out[name] = adopted[id(t)]
        except NodeShapeMismatchError as exc:
            error = str(exc)
        except (OSError, MemoryError, RuntimeError) as exc:
            error = f"rank {node.rank}: {type(exc).__name__}: {exc}"
        gather_verdicts(error, "offcache's node-shared offload failed")
        return out

    def _adopt(self, name, tensor: torch.Tensor, region: NodeRegion, offset: int, dtype, shape) -> torch.Tensor:
        """`tensor` (this rank's) pointed at the region's bytes at `offset`, as compressed-tensors'
        class points it at the shared file: same object where it can be (a CPU tensor of the right
        shape and dtype), else the tensor this rank made for that entry already (a weight tied
        across modules: one object, as on the source rank, whose tied modules hold one tensor),
        else a new one with its class and attributes."""
        shape = torch.Size(shape)
        check_shape(name, tensor, dtype, shape)
        storage, byte = region.storage(offset)
        if region.locate(tensor) == offset:
            region.remember(tensor, offset)
            return tensor  # already this rank's view of these bytes
        # A tie the source rank holds as one tensor, this rank as two (e.g. meta parameters of
        # modules whose first offload replaced the tie): two objects here would make a sliced
        # prefetch's plan differ between ranks, and the full mode fetch the weight twice.
        existing = region.adopted(offset, dtype, shape)
        if existing is not None and type(existing) is type(tensor):
            return existing
        if tensor.is_meta or tensor.device.type != "cpu" or not plain(tensor):
            target = to_tensor(torch.empty(0, dtype=dtype), tensor)
        else:
            target = tensor
        stride = torch.empty(shape, device="meta").stride()
        with torch.no_grad():
            target.set_(storage, storage_offset=byte // dtype.itemsize, size=shape, stride=stride)
        region.remember(target, offset)
        return target


def _onload_is_cpu(cache) -> bool:
    return torch.device(cache.onload_device).type == "cpu"
