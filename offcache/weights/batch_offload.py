"""The offload entry points of the node classes: one ``_offload_batch`` per module, named.

compressed-tensors calls ``offload(tensor)`` for one tensor (``cache[key] = value`` and the
``from_mapping`` path) and the node classes offload a module's tensors as one batch, one collective
for all of them. ``_BatchOffload`` routes a single offload through the batch and names it by the
key being set, so an error on any rank names the tensor. The class using it defines
``_offload_batch(mapping)`` (name -> tensor or None, returning name -> offloaded tensor or None)
and ``_offload_local(tensor)``: its single-process offload.

Under compressed-tensors' ``as_single_threaded()`` (its ``replace_module_parallel``'s step 3, where
each rank processes its own modules; its decompress hook) ``is_distributed()`` is false while
``torch.distributed`` is up, and compressed-tensors' distributed classes offload as its
single-process ones (it patches their ``offload``): no collective, since the other ranks are not
offloading the same tensors then. The node classes do the same there (``_offload_local``); step 4
offloads the values again, collectively, from the rank that made them.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def single_threaded() -> bool:
    """Whether compressed-tensors' ``as_single_threaded()`` is on: offloads are this rank's alone."""
    from compressed_tensors.distributed import is_distributed

    return dist.is_available() and dist.is_initialized() and not is_distributed()


class _BatchOffload:
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
