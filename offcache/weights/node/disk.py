"""Offloaded checkpoint weights on disk under ``torch.distributed``: :class:`NodeDiskCache`.

Under ``torch.distributed``, ``patch_llmcompressor(weights=True)`` gives compressed-tensors'
``cls_from_device("disk")`` :class:`NodeDiskCache` in place of its ``DistributedDiskCache``
(``unpatch_llmcompressor()`` gives it back). It is compressed-tensors' class with:

- the same files and index: the source rank writes (or symlinks) each tensor's safetensors
  file as ``DiskCache`` does, and every rank's ``DiskCache.index`` names that file; an
  ``update_offload`` on any rank writes it anew (``DiskCache``'s file, written beside it and
  renamed over it: a rank reading it meanwhile reads the old file whole, where compressed-tensors'
  rewrite in place can hand it a truncated one), so every rank reads the new value after a
  barrier; ``__delitem__`` is ``DistributedDiskCache``'s (the source removes the file).
- its offload a collective that cannot leave a rank hanging: a batch per ``from_mapping`` (a
  module's parameters, or its buffers), one ``broadcast_object_list`` of the source's index
  entries (or of its error: a failed write raises on every rank) and one ``all_gather_object`` of
  every rank's verdict (also the barrier compressed-tensors' class ends with). A rank holding a
  (non-meta) tensor whose shape or dtype differs from the source's raises
  ``NodeShapeMismatchError`` on every rank, naming the tensor; meta tensors take the source's, as
  compressed-tensors' class does. Under compressed-tensors' ``as_single_threaded()`` an offload is
  ``DiskCache``'s, this rank's alone (batch.py).
- its onload ``OffcacheDiskCache``'s: the engine's ``fetch_file`` (8 MiB pieces into pinned
  bounce buffers, each piece's copy issued as soon as it is read), prefetched by the
  sequential pipeline's subgraphs as with one process.
- the disk read once per node (``node_reads()``): the engine reads a piece from the page cache
  where all of it is there, else with O_DIRECT, which every rank of a node would do on its own.
  A prefetch first reads the tensors' byte ranges through the page cache (buffered, on a
  thread of its own: the disk read overlaps compute; ranks reading the same pages concurrently
  share the kernel's one read), and issues the engine's read once they are there, at the next
  call of this class (an onload or a prefetch) or at the onload that needs it. An onload
  nobody prefetched reads the page cache first in the same way, on the calling thread.
  ``OFFCACHE_NODE_PAGE_CACHE=0`` turns this off (each rank reads the disk, O_DIRECT); every
  offload checks it on every rank (a garbage value on one: ValueError on every rank, naming it).
- a prefetched copy is served only while the tensor's file is the one it read (device, inode,
  size, modification and change times, taken before the read was issued): another rank's
  ``update_offload`` (after a barrier) makes it stale, and the onload reads the new file. A
  prefetch whose read failed (a file rewritten under it) is read again at the onload.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist

from offcache.util.extras import as_missing

try:
    from compressed_tensors.distributed import get_source_rank, is_source_process
    from compressed_tensors.offload.cache.disk import DiskCache
    from compressed_tensors.offload.cache.dist_disk import DistributedDiskCache
    from compressed_tensors.offload.utils import send_tensors, to_tensor
    from safetensors.torch import save_file
except ModuleNotFoundError as _missing:  # one line naming the extra
    raise as_missing(
        _missing, ("compressed_tensors", "transformers"), "llmcompressor", "offcache.weights.node.disk"
    ) from None

try:
    from compressed_tensors.offload.cache.disk_utils import _evict
except ImportError:  # compressed-tensors 0.19: no handles held
    _evict = None

from offcache.weights.caches import OffcacheDiskCache  # noqa: E402
from offcache.weights.files import forget as _forget  # noqa: E402
from offcache.weights.files import header  # noqa: E402
from offcache.weights.node.batch import BatchOffload, check_names, check_shape, gather_verdicts  # noqa: E402
from offcache.weights.node.region import NodeShapeMismatchError  # noqa: E402
from offcache.weights.node.warm import Deferred, issue_ready, page_cache_on  # noqa: E402

__all__ = ["NodeDiskCache", "NodeShapeMismatchError"]

Tensor = torch.Tensor


def _identity(path: str) -> tuple | None:
    """What says a file is unchanged: None where it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class NodeDiskCache(BatchOffload, OffcacheDiskCache, DistributedDiskCache):
    """compressed-tensors' ``DistributedDiskCache`` (files, index, deletes, updates), its offload a
    batch per module that fails on every rank together, its onload ``OffcacheDiskCache``'s through
    the engine, prefetched, each checkpoint byte read from the disk once per node."""

    _inline = False  # an onload's own fetch: its page-cache read on the calling thread

    @classmethod
    def from_mapping(cls, mapping, onload_device, offload_device=None, **kwargs):
        instance = cls(onload_device=onload_device, offload_device=offload_device, **kwargs)
        instance.offloaded_values = instance._offload_mapping(dict(mapping))
        return instance

    # -- onload: the engine's fetch_file, after the page cache holds the bytes --
    def onload(self, offloaded: Tensor | None) -> Tensor | None:
        """A copy of `offloaded` on the onload device: the prefetched one while its file is the one it
        read, else a read of the file now (through the page cache, then the engine)."""
        issue_ready()
        if offloaded is None:
            return None
        entry = self.state.prefetched.get(id(offloaded))
        if entry is None or entry.offloaded is not offloaded:
            self._inline = True  # nothing fetched ahead: the page-cache read on this thread
            try:
                return self.state.onload(self, offloaded)
            finally:
                self._inline = False
        try:
            return self.state.onload(self, offloaded)
        except (RuntimeError, OSError):
            # The prefetch's read failed (another rank rewrote or replaced the file under it):
            # read it again, which raises if the file cannot be read now either.
            self.state.counters["weight_prefetch_stale"] += 1
            return self.onload(offloaded)

    def fetch(self, offloaded: list[Tensor], device: torch.device) -> list[tuple[Any, Any]]:
        issue_ready()
        metas = [t for t in offloaded if t.device.type == "meta"]
        if not metas or not page_cache_on():
            return super().fetch(offloaded, device)
        ranges = [self._ranges(t) for t in offloaded]
        return Deferred(super().fetch, offloaded, device, ranges, self.state.counters, inline=self._inline).pairs()

    def _ranges(self, offloaded: Tensor) -> tuple[str, int, int] | None:
        """(file, first byte, bytes) of a meta tensor's data, for the page-cache read; None: none."""
        if offloaded.device.type != "meta":
            return None
        info = self.index[offloaded]
        real = os.path.realpath(info["safetensors_file"])
        try:
            parsed, start = header(real)
            begin, end = parsed[info["weight_name"]]["data_offsets"]
        except (OSError, KeyError, ValueError):
            return None  # the engine's read says why
        return real, start + begin, end - begin

    def finish(self, fetched: Any, offloaded: Tensor) -> Tensor:
        if isinstance(fetched, Deferred.Handle):
            fetched = fetched.tensor()
        return super().finish(fetched, offloaded)

    def tag(self, offloaded: Tensor) -> Any:
        """The file's identity before a prefetch reads it (None: a staged host tensor)."""
        if offloaded.device.type != "meta":
            return None
        return _identity(self.index[offloaded]["safetensors_file"])

    def is_fresh(self, offloaded: Tensor, tag: Any) -> bool:
        """Whether the file a prefetch read is still the tensor's (no rank rewrote it since)."""
        if offloaded.device.type != "meta":
            return True
        info = self.index.get(offloaded)
        return tag is not None and info is not None and _identity(info["safetensors_file"]) == tag

    # -- update: DiskCache's file, replaced whole (never rewritten under another rank's read) --
    @torch.no_grad()
    def update_offload(self, offloaded: Tensor, data: Tensor | None) -> None:
        """``DiskCache.update_offload``'s file (the tensor's name, the index's dtype, at the index's
        path: every rank reads it after a barrier), written beside it and renamed over it: a rank
        reading the file meanwhile reads the old one whole, never a truncated one."""
        if data is None:
            return
        if offloaded.device.type != "meta":  # staged (0.20): a host tensor, updated as CPUCache's
            return super().update_offload(offloaded, data)
        self.state.drop_prefetched(offloaded)
        assert offloaded in self.index, "Cannot find offload to update"
        info = self.index[offloaded]
        path = info["safetensors_file"]
        assert self._is_ct_file_path(path), f"Attempted to write to {path}"
        value = data.reshape_as(offloaded).to(dtype=getattr(torch, info["dtype"])).contiguous()
        partial = f"{path}.{os.getpid()}.partial"  # its own per process: two writers never share one
        try:
            save_file({info["weight_name"]: value}, partial)
            os.replace(partial, path)  # a symlink into the checkpoint is replaced, never followed
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
        _forget(path)
        if _evict is not None:
            _evict(path)  # compressed-tensors 0.20's handles held in disk_load_context

    # -- offload: a batch per module, an error on one rank raised on every rank (_BatchOffload) --
    def _offload_local(self, tensor: Tensor) -> Tensor:
        """Under compressed-tensors' as_single_threaded(): its DiskCache's offload (this rank's file)."""
        return DiskCache.offload(self, tensor)

    def _offload_batch(self, mapping: dict) -> dict:
        """Offload every tensor of `mapping` (name -> tensor or None): one broadcast, one all_gather."""
        source = get_source_rank()
        rank = dist.get_rank()
        names = [name for name, t in mapping.items() if t is not None]
        out = dict.fromkeys(mapping)
        try:  # read by this rank's onloads: a garbage value raises here, on every rank, not there alone
            page_cache_on()
            setting = ""
        except ValueError as exc:
            setting = f"rank {rank}: {exc}"
        if is_source_process():
            entries: list[tuple] = []
            header: tuple = ("ok",)
            try:
                for name in names:
                    offloaded = DiskCache.offload(self, mapping[name])
                    info = self.index[offloaded]
                    entries.append(
                        (name, info["safetensors_file"], info["weight_name"], info["dtype"], tuple(offloaded.shape))
                    )
                    out[name] = offloaded
            except Exception as exc:  # noqa: BLE001  (every rank raises it, none waits alone)
                where = f" (tensor {self._name(names[len(entries)])!r})" if len(entries) < len(names) else ""
                header = ("error", f"rank {rank}: {type(exc).__name__}: {exc}{where}")
            payload: list[Any] = [header, entries]
        else:
            payload = [None, None]
        dist.broadcast_object_list(payload, src=source)
        header, entries = payload
        if header[0] == "error":
            raise RuntimeError(f"offcache's distributed disk offload failed: {header[1]}")

        error = ""
        if not is_source_process():
            try:
                check_names(names, entries)
                adopted: dict[int, Tensor] = {}  # id(this rank's tensor) -> its offload (tied stay one)
                for name, file, weight_name, dtype_name, shape in entries:
                    t = mapping[name]
                    if id(t) not in adopted:
                        adopted[id(t)] = self._adopt(self._name(name), t, file, weight_name, dtype_name, shape)
                    out[name] = adopted[id(t)]
            except NodeShapeMismatchError as exc:
                error = str(exc)
            except Exception as exc:  # noqa: BLE001
                error = f"rank {rank}: {type(exc).__name__}: {exc}"
        settings = [s for s in gather_verdicts(error, "offcache's distributed disk offload failed", setting) if s]
        if settings:
            raise ValueError("; ".join(settings) + " (NodeDiskCache's onloads read it on every rank: set it alike)")
        return out

    def _adopt(self, name: str, tensor: Tensor, file: str, weight_name: str, dtype_name: str, shape) -> Tensor:
        """This rank's meta tensor for the source's file, as compressed-tensors' class rebuilds it."""
        dtype = getattr(torch, dtype_name)
        shape = torch.Size(shape)
        check_shape(name, tensor, dtype, shape)
        offloaded = send_tensors(tensor, device="meta")
        if offloaded.dtype != dtype or offloaded.shape != shape:
            offloaded = to_tensor(torch.empty(shape, dtype=dtype, device="meta"), offloaded)
        self.index[offloaded] = {"safetensors_file": file, "weight_name": weight_name, "dtype": dtype_name}
        return offloaded
