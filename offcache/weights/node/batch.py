"""What the node classes' offloads share: one ``_offload_batch`` per module, named, and its verdicts.

compressed-tensors calls ``offload(tensor)`` for one tensor (``cache[key] = value`` and the
``from_mapping`` path) and the node classes offload a module's tensors as one batch, one collective
for all of them. ``BatchOffload`` routes a single offload through the batch and names it by the
key being set, so an error on any rank names the tensor. The class using it defines
``_offload_batch(mapping)`` (name -> tensor or None, returning name -> offloaded tensor or None)
and ``_offload_local(tensor)``: its single-process offload.

Under compressed-tensors' ``as_single_threaded()`` (its ``replace_module_parallel``'s step 3, where
each rank processes its own modules; its decompress hook) ``is_distributed()`` is false while
``torch.distributed`` is up, and compressed-tensors' distributed classes offload as its
single-process ones (it patches their ``offload``): no collective, since the other ranks are not
offloading the same tensors then. The node classes do the same there (``_offload_local``); step 4
offloads the values again, collectively, from the rank that made them.

A batch ends with one ``all_gather_object`` of every rank's verdict (``gather_verdicts``: also the
barrier compressed-tensors' classes end with), so an error on one rank (ranks that disagree on the
tensors, ``check_names``, or on a tensor's shape or dtype, ``check_shape``) raises on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from offcache.weights.node.region import NodeShapeMismatchError


def single_threaded() -> bool:
    """Whether compressed-tensors' ``as_single_threaded()`` is on: offloads are this rank's alone."""
    from compressed_tensors.distributed import is_distributed

    return dist.is_available() and dist.is_initialized() and not is_distributed()


class BatchOffload:
    _key: Any = None

    def offload(self, tensor):
        if tensor is None:
            return None
        if single_threaded():
            return self._offload_local(tensor)
        return self._offload_batch({None: tensor})[None]

    def _offload_mapping(self, mapping: dict) -> dict:
        """Every tensor of `mapping` offloaded: one batch, or each alone under as_single_threaded()."""
        if single_threaded():
            return {name: None if t is None else self._offload_local(t) for name, t in mapping.items()}
        return self._offload_batch(mapping)

    def __setitem__(self, key, value):
        self._key = key
        try:
            super().__setitem__(key, value)
        finally:
            self._key = None

    def _name(self, name) -> str:
        """The tensor's name in errors: the batch's own, or the key being set for a single offload."""
        return str(self._key if name is None else name)


def check_names(names: list, entries: list[tuple]) -> None:
    """NodeShapeMismatchError where this rank's tensors (`names`) are not the source's (`entries`,
    each a tuple led by its name)."""
    missing = set(names) ^ {entry[0] for entry in entries}
    if missing:
        raise NodeShapeMismatchError(
            f"rank {dist.get_rank()}: ranks disagree on the tensors offloaded: {sorted(map(str, missing))} "
            f"(this rank has {sorted(map(str, names))})"
        )


def check_shape(name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: torch.Size) -> None:
    """NodeShapeMismatchError where this rank's `tensor` (not meta: a meta one takes the source's, as
    compressed-tensors' classes do) differs from the source's `dtype` and `shape`."""
    from compressed_tensors.distributed import get_source_rank

    if not tensor.is_meta and (tensor.dtype != dtype or tensor.shape != shape):
        raise NodeShapeMismatchError(
            f"rank {dist.get_rank()}: ranks disagree on tensor {name!r}: the source rank "
            f"{get_source_rank()} offloads {tuple(shape)} {dtype}, this rank holds "
            f"{tuple(tensor.shape)} {tensor.dtype}"
        )


def gather_verdicts(error: str, failed: str, extra: Any = None) -> list:
    """Every rank's verdict on a batch (its `error`, '' for none) gathered on every rank, which raises
    together: NodeShapeMismatchError where ranks disagree, else RuntimeError led by `failed`. Returns
    every rank's `extra`, in rank order."""
    verdicts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, (error, extra))  # also the barrier compressed-tensors' classes end with
    errors = [e for e, _ in verdicts if e]
    if errors:
        if any("disagree" in e for e in errors):
            raise NodeShapeMismatchError("; ".join(errors))
        raise RuntimeError(f"{failed}: " + "; ".join(errors))
    return [x for _, x in verdicts]
