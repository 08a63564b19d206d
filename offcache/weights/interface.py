"""The weight-cache interface: what the shared onload and the prefetcher call on a cache.

Every offcache weight cache (``OffcacheCPUCache``, ``OffcacheDiskCache``, the node classes in
offcache/weights/node/) is a :class:`WeightCache` before its compressed-tensors base class. The
onload (``WeightState.onload``) and the prefetcher (``offcache.weights.ct_patch.prefetch``)
call only these names; the state they share is the cache's ``state`` (a ``WeightState``,
offcache/weights/bookkeeping.py), never a module global.

An onload, for a tensor nobody prefetched: ``fetch([offloaded], device)``, wait for the ticket,
``finish(copy, offloaded)``. A prefetch: ``prefetchable`` says whether a fetch ahead is worth
issuing, ``tag`` what to remember of the source before the copy is issued, then ``fetch``; at the
onload, after the copy landed, ``is_fresh(offloaded, tag)`` says whether it still holds the
source's value (another process may write the source), then ``finish``.

The names are public and none of compressed-tensors' caches defines them (the drift guard,
offcache/weights/drift.py, checks it): its base classes never call them by mistake. It imports
nothing of compressed-tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

Tensor = torch.Tensor

# The names below, checked against compressed-tensors' caches by the drift guard.
NAMES = ("fetch", "finish", "prefetchable", "tag", "is_fresh", "state")


class WeightCache(ABC):
    """A weight cache whose onloads are engine copies that can be issued ahead (prefetched)."""

    # A bookkeeping.WeightState (which imports this module, not the reverse): the prefetch table, the
    # write-backs and reads in flight, the counters.
    state: Any

    @abstractmethod
    def fetch(self, offloaded: list[Tensor], device: torch.device) -> list[tuple[Any, Any]]:
        """(copy, ticket) of each offloaded tensor on `device`, issued now, not waited for.

        A ticket has ``query()`` (landed?), ``issued()`` (every copy issued?) and ``wait()`` (the
        consumer's stream, or on the CPU the host, waits for it)."""

    @abstractmethod
    def finish(self, fetched: Any, offloaded: Tensor) -> Tensor:
        """The onloaded value of `offloaded` made of its landed copy (its class, attributes, dtype)."""

    def prefetchable(self, offloaded: Tensor, device: torch.device) -> bool:
        """Whether a fetch ahead is worth issuing (not where a fetch hands the tensor back itself)."""
        return True

    def tag(self, offloaded: Tensor) -> Any:
        """What to remember of the source before a prefetch is issued (None: nothing)."""
        return None

    def is_fresh(self, offloaded: Tensor, tag: Any) -> bool:
        """Whether a landed prefetched copy still holds the source's value, judged by its `tag`."""
        return True
