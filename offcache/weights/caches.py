"""OffcacheCPUCache and OffcacheDiskCache: compressed-tensors' CPUCache and DiskCache with their device
moves on the offcache engine (offcache/weights/ct_patch.py explains the whole; this file holds
the two classes and the onload they share)."""

from __future__ import annotations

import errno
import os
import shutil
from typing import Any

import torch

from offcache.util.extras import as_missing

try:
    from compressed_tensors.offload.cache.cpu import CPUCache
    from compressed_tensors.offload.cache.disk import DiskCache
    from compressed_tensors.offload.cache.utils import catch_cpu_mem_error
    from compressed_tensors.offload.utils import to_tensor
except ModuleNotFoundError as _missing:  # one line naming the extra
    raise as_missing(
        _missing, ("compressed_tensors", "transformers"), "llmcompressor", "offcache.weights.compressed_tensors"
    ) from None


from offcache import engine as _engine
from offcache.weights.bookkeeping import WEIGHTS, WeightState, onload_device
from offcache.weights.files import forget as _forget
from offcache.weights.files import locate as _locate
from offcache.weights.interface import WeightCache
from offcache.weights.memory import host_trim
from offcache.weights.memory.file_backed import is_file_backed

_CPU = torch.device("cpu")
# compressed-tensors 0.20's DiskCache.onload casts to the index's dtype, then copies the class (a
# Parameter stays one); 0.19's copies the class, then casts (Tensor.to gives a plain tensor).
try:
    from compressed_tensors.offload.cache.utils import load_disk_tensor_from_offload  # noqa: F401

    _CAST_FIRST = True
except ImportError:
    _CAST_FIRST = False
Tensor = torch.Tensor


# --- the cache classes -------------------------------------------------------------------------


def with_class_of(new: Tensor, like: Tensor, onloaded: bool = False) -> Tensor:
    """`new` with the tensor subclass and attributes of `like`, as compressed-tensors' send_tensors.

    An onloaded copy does not require grad, as ``Tensor.to`` under no_grad gives it.
    """
    if onloaded and new.requires_grad:
        new.requires_grad_(False)
    if new.__class__ is not like.__class__:
        new.__class__ = like.__class__
    new.__dict__ = like.__dict__.copy()
    return new


def fetch_host(offloaded: list[Tensor], device: torch.device) -> list[tuple[Tensor, Any]]:
    """One engine fetch of host tensors to `device`: (copy, ticket) each, not waited for.

    The arena blocks' own fences order later write-backs after these reads.
    """
    fetched, ticket = _engine.fetch(offloaded, device, wait=False)
    if device.type == "cpu":
        host_trim.note(sum(t.nbytes for t in offloaded))
    # A CPU tensor offcache does not own, onloaded to the CPU, comes back as is: copy it (a leaf,
    # as Tensor.to's copy under no_grad, even of a Parameter that requires grad).
    with torch.no_grad():
        return [(f.clone() if f is o else f, ticket) for f, o in zip(fetched, offloaded)]


def _stage_host(tensor: Tensor, pin_memory: bool) -> Tensor:
    """A host tensor staged: into the pinned arena when asked and not there already (where room)."""
    if not pin_memory or _engine.is_arena_tensor(tensor):
        return tensor
    with torch.no_grad():
        (stored,) = _engine.store([tensor], _CPU, allow_spill=False)
    _engine.wait_stored(stored)
    return with_class_of(stored, tensor)


class EngineCache(WeightCache):
    """What every cache onloading through the engine shares (before its compressed-tensors base):
    the weight-cache interface (offcache/weights/interface.py) on the process's ``WeightState``; a
    host read or a delete drops a tensor's prefetched copy.
    """

    state: WeightState = WEIGHTS

    def __getitem__(self, key):
        # Under disable_onloading() the caller reads the offloaded host tensor (a disk offload's
        # staged one; not a meta placeholder), and may edit it through .data or numpy, which no
        # version counter sees: its prefetched copy, if any, is dropped (a host copy is also
        # compared byte for byte when taken).
        if self.onloading_disabled:
            offloaded = self.offloaded_values[key]
            if offloaded is not None and offloaded.device.type != "meta":
                self.state.flush(offloaded)
                self.state.drop_prefetched(offloaded)
        return super().__getitem__(key)

    def __delitem__(self, key):
        offloaded = self.offloaded_values[key]
        if offloaded is not None:
            self.state.drop_prefetched(offloaded)
        super().__delitem__(key)


class OffcacheCPUCache(EngineCache, CPUCache):
    """compressed-tensors' ``CPUCache``, its offload, onload and update on the offcache engine."""

    @catch_cpu_mem_error
    def offload(self, tensor: Tensor | None) -> Tensor | None:
        """A snapshot of `tensor` in the pinned arena (a CPU tensor viewing arena memory).

        The same tensor offloaded twice (tied weights) gives the same offloaded tensor: the
        engine's dedup table serves the second store. A tensor offcache holds (arena, spilled
        or disk tier) is offloaded already and comes back as is, as CPUCache gives back a CPU one.

        A CPU tensor in a mapping of a regular file (a checkpoint's safetensors mmap, as
        transformers loads CPU weights) holds pages the kernel may reclaim under a memory limit;
        an arena copy is memory nothing reclaims. Onloaded to the CPU it comes back as is (the
        caller computes on the mapping, as with CPUCache); onloaded to a device it is copied into
        the arena while that fits the pinned and host limits, and past them stays the mapping
        (never spilled to the disk tier: the checkpoint is its disk copy). See file_backed.py.
        """
        if tensor is None:
            return None
        if _engine.is_offcache_tensor(tensor):
            return tensor
        file_backed = is_file_backed(tensor)
        if file_backed and onload_device(self).type == "cpu":
            return tensor
        with torch.no_grad():
            (stored,) = _engine.store([tensor], _CPU, allow_spill=not file_backed)
        if stored is tensor:  # file-backed, and no room in the arena: the mapping itself
            return tensor
        if tensor.device.type == "cpu":
            host_trim.note(tensor.nbytes)  # the caller frees its copy
        # CPUCache's offload is readable on return (callers read it on the host, and the
        # source may be the last copy of a loaded model's tensor): wait for it. Offloads happen
        # once, when a model is dispatched; the pipeline's traffic is onloads and write-backs.
        _engine.wait_stored(stored)
        _engine.warn_if_spilled(stacklevel=3)
        return with_class_of(stored, tensor)

    def onload(self, offloaded: Tensor | None) -> Tensor | None:
        """A copy of `offloaded` on the onload device: the prefetched one if there is one.

        A file-backed tensor (offload keeps a checkpoint's mapping as is) onloaded to the CPU is
        handed out itself, as CPUCache's onload does: a copy would be anonymous memory, a whole
        module's worth at a time, that the allocator may keep after it is freed.
        """
        if (
            offloaded is not None
            and onload_device(self).type == "cpu"
            and not _engine.is_offcache_tensor(offloaded)
            and is_file_backed(offloaded)
        ):
            return offloaded
        return self.state.onload(self, offloaded)

    def prefetchable(self, offloaded: Tensor, device: torch.device) -> bool:
        # A CPU tensor offcache does not hold, onloaded to the CPU: a fetch hands it back itself.
        return device.type != "cpu" or _engine.is_offcache_tensor(offloaded)

    def fetch(self, offloaded: list[Tensor], device: torch.device) -> list[tuple[Tensor, Any]]:
        return fetch_host(offloaded, device)

    def finish(self, fetched: Tensor, offloaded: Tensor) -> Tensor:
        return with_class_of(fetched, offloaded, onloaded=True)

    def stage(self, offloaded: Tensor | None, pin_memory: bool = False) -> Tensor | None:
        """compressed-tensors 0.20's staging: `offloaded` in host memory for a later onload.

        An arena tensor is staged already (pinned on a GPU engine) and comes back as is, so a
        prefetched copy of it stays valid; any other host tensor is put in the arena when
        `pin_memory` asks for pinned memory, else comes back as is (as CPUCache's stage).
        """
        if offloaded is None:
            return None
        self.state.flush(offloaded)
        return _stage_host(offloaded, pin_memory)

    @torch.no_grad()
    def update_offload(self, offloaded: Tensor, data: Tensor | None) -> None:
        """Copy `data` into `offloaded`'s arena block asynchronously (as ``offloaded.copy_(data)``).

        The engine reads a private copy of `data` (taken now, on `data`'s device and current
        stream) so that the caller may reuse `data` at once.
        """
        if data is None:
            return
        self.state.drop_prefetched(offloaded)
        if not _engine.is_offcache_tensor(offloaded):
            # Not offcache's (assigned under disable_onloading()): no fences order the engine's
            # reads of it, so every copy in flight lands first; then CPUCache's own copy.
            _engine.synchronize()
            offloaded.copy_(data)
            return
        src = torch.empty_like(offloaded, device=data.device)
        if src.device.type == "cpu":
            host_trim.note(src.nbytes)
        src.copy_(data)  # dtype cast and broadcast as Tensor.copy_ does
        try:
            ticket = _engine.copy_into([offloaded], [src], wait=False)
        except (ValueError, RuntimeError):
            # A pair the engine refuses (a layout, or host data where a backend wants a device
            # source): every copy in flight landed first, then a plain copy, as CPUCache's.
            _engine.synchronize()
            offloaded.copy_(src)
            return
        state = self.state
        state.counters["weight_writeback_bytes"] += offloaded.nbytes
        if state.current is not None:
            state.current.written_back_bytes += offloaded.nbytes
        # The engine orders copies into one block (write after write), so the last one wins.
        state.pending[id(offloaded)] = (offloaded, ticket)
        if state.current is None:
            self.state.flush(offloaded)  # outside a patched context nothing marks an end: land it now


class _Ready:
    """The ticket of a tensor read without the engine: complete."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def issued() -> bool:
        return True

    @staticmethod
    def wait() -> None:
        pass


class OffloadFolderFullError(OSError):
    """A weight's write-back would not fit its offload folder: raised before anything is written."""


# A safetensors file's header and the file system's block rounding, beside the tensor's bytes.
WRITE_MARGIN = 1 << 20


def check_room(path: str, nbytes: int, weight: str) -> None:
    """Raise OffloadFolderFullError unless the folder of `path` can take a file of `nbytes` in place of
    `path` (whose own bytes an update frees first, unless it is a link to the checkpoint)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        free = shutil.disk_usage(folder).free
        if os.path.isfile(path) and not os.path.islink(path):
            free += os.path.getsize(path)
    except OSError:
        return  # the write itself will say what is wrong
    need = nbytes + WRITE_MARGIN
    if free < need:
        raise OffloadFolderFullError(
            errno.ENOSPC,
            f"offcache: writing weight {weight!r} back ({nbytes} bytes) needs {need} bytes in the offload folder "
            f"{folder}, which has {free} bytes free; nothing was written and the weight keeps its value. Free "
            "space there, or load with offload_folder= on a larger disk",
        )


class OffcacheDiskCache(EngineCache, DiskCache):
    """compressed-tensors' ``DiskCache``, its onload reading the checkpoint's file through the engine.

    The offloaded meta tensors, ``DiskCache.index``, the checkpoint symlinks and the files an
    update writes are compressed-tensors' own (other code reads them). An onload reads the
    tensor's bytes from its safetensors file with the engine's ``fetch_file`` (never copying the
    file): the engine's I/O thread reads 8 MiB pieces (from the page cache where they are
    there, else O_DIRECT where the file system allows it) into pinned bounce buffers and
    issues each piece's copy to the device as soon as it is read. The caller does not wait for
    the disk, so a prefetch reads the next subgraph's weights while this one computes. Updates
    write files as DiskCache does; a prefetched copy of an updated weight is dropped.
    """

    def __init__(self, onload_device, offload_device=None, offload_dir: str | None = None):
        # No folder given (a disk share offcache's placement planned): offcache's, where it has a
        # disk tier; else DiskCache's error asking for one.
        if offload_dir is None:
            from offcache.weights.memory.placement import default_offload_dir

            offload_dir = default_offload_dir()
        super().__init__(onload_device, offload_device=offload_device, offload_dir=offload_dir)

    def onload(self, offloaded: Tensor | None) -> Tensor | None:
        """A copy of `offloaded` on the onload device: read from its file (a meta tensor), or,
        once staged (compressed-tensors 0.20's ``is_staged``), fetched from the staged host copy."""
        return self.state.onload(self, offloaded)

    def stage(self, offloaded: Tensor | None, pin_memory: bool = False) -> Tensor | None:
        """compressed-tensors 0.20's staging: the weight read from its file into host memory
        through the engine (``fetch_file``), cast to the index's dtype with the offloaded tensor's
        class; with `pin_memory` and a device onload, into the pinned arena. A staged tensor
        (not meta) comes back as is."""
        if offloaded is None:
            return None
        if offloaded.device.type != "meta":
            return _stage_host(offloaded, pin_memory)
        ((fetched, ticket),) = self.fetch([offloaded], _CPU)
        self.state.wait(ticket, _CPU)
        staged = self.finish(fetched, offloaded)
        return _stage_host(staged, pin_memory and torch.device(self.onload_device).type != "cpu")

    def fetch(self, offloaded: list[Tensor], device: torch.device) -> list[tuple[Tensor, Any]]:
        """(copy, ticket) of each offloaded tensor, read from its file: one engine call per file.

        A staged tensor (host memory, not meta) is fetched from the host instead."""
        out: list[tuple[Tensor, Any] | None] = [None] * len(offloaded)
        by_file: dict[str, list[tuple[int, tuple]]] = {}
        staged = [i for i, t in enumerate(offloaded) if t.device.type != "meta"]
        if staged:
            for i, pair in zip(staged, fetch_host([offloaded[i] for i in staged], device)):
                out[i] = pair
        for i, meta in enumerate(offloaded):
            if out[i] is not None:
                continue
            info = self.index[meta]
            real = os.path.realpath(info["safetensors_file"])
            where = _locate(real, info["weight_name"])
            if where is None:  # a dtype offcache does not know: DiskCache reads it (blocking)
                out[i] = (self._read_upstream(meta, device), _Ready)
            else:
                by_file.setdefault(real, []).append((i, where))
        for real, entries in by_file.items():
            tensors, ticket = _engine.fetch_file(real, [where for _, where in entries], device, wait=False)
            if device.type == "cpu":
                host_trim.note(sum(t.nbytes for t in tensors))
            self.state.reads[real] = ticket
            for (i, _), tensor in zip(entries, tensors):
                out[i] = (tensor, ticket)
        reads = self.state.reads
        if len(reads) > 1024:  # a model's worth of files: keep the reads still in flight only
            for path in [p for p, t in reads.items() if t.query()]:
                del reads[path]
        return out

    def _read_upstream(self, meta: Tensor, device: torch.device) -> Tensor:
        """DiskCache's own read of `meta` (a dtype offcache does not parse) onto `device`, unfinished."""
        if device == onload_device(self):
            staged = getattr(self, "is_staged", False)  # 0.20's onload reads the file unless staged
            if staged:
                self.is_staged = False
            try:
                return super().onload(meta)
            finally:
                if staged:
                    self.is_staged = True
        return super().stage(meta).to(device)  # staging (0.20) reads onto the CPU

    def finish(self, fetched: Tensor, offloaded: Tensor) -> Tensor:
        if offloaded.device.type != "meta":  # staged: as DiskCache's onload of a staged tensor
            return with_class_of(fetched, offloaded, onloaded=True)
        # As the installed DiskCache.onload: the index's dtype and the offloaded tensor's class and
        # attributes, in its order (0.20 casts first: a Parameter; 0.19 copies the class first).
        dtype = getattr(torch, self.index[offloaded]["dtype"])
        if _CAST_FIRST:
            return to_tensor(fetched.to(dtype), offloaded)
        return to_tensor(fetched, offloaded).to(dtype)

    def update_offload(self, offloaded: Tensor, data: Tensor | None):
        if offloaded.device.type != "meta":  # staged (0.20): a host tensor, updated as CPUCache's
            return OffcacheCPUCache.update_offload(self, offloaded, data)
        info = self.index[offloaded]
        check_room(info["safetensors_file"], offloaded.numel() * getattr(torch, info["dtype"]).itemsize,
                   info["weight_name"])  # fmt: skip
        self.state.drop_prefetched(offloaded)
        # DiskCache rewrites its own file in place (truncating it): no read of it may still be
        # in flight then (it would fail at the new end, or read the new bytes). A checkpoint
        # symlink is only unlinked (the checkpoint is never written): its reads may go on.
        name = self.index[offloaded]["safetensors_file"]
        path = os.path.realpath(name)
        reading = None if os.path.islink(name) else self.state.reads.pop(path, None)
        if reading is not None and not reading.query():
            _engine.synchronize()
        _forget(path)
        super().update_offload(offloaded, data)
