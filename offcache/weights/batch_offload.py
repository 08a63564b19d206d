"""The offload entry points of the node classes: one ``_offload_batch`` per module, named.

compressed-tensors calls ``offload(tensor)`` for one tensor (``cache[key] = value`` and the
``from_mapping`` path) and the node classes offload a module's tensors as one batch, one collective
for all of them. ``_BatchOffload`` routes a single offload through the batch and names it by the
key being set, so an error on any rank names the tensor. The class using it defines
``_offload_batch(mapping)`` (name -> tensor or None, returning name -> offloaded tensor or None).
"""

from __future__ import annotations

from typing import Any


class _BatchOffload:
    _key: Any = None

    def offload(self, tensor):
        if tensor is None:
            return None
        return self._offload_batch({None: tensor})[None]

    def __setitem__(self, key, value):
        self._key = key
        try:
            super().__setitem__(key, value)
        finally:
            self._key = None

    def _name(self, name) -> str:
        """The tensor's name in errors: the batch's own, or the key being set for a single offload."""
        return str(self._key if name is None else name)
