"""What the offloaded layers of both caches share: the prefetch each holds and the first update's rollback.

A layer's ``_prefetched`` is ``None`` or a tuple whose last item is the ticket of its H2D copy.
"""

from __future__ import annotations

import contextlib

from offcache import engine as _engine


class OffloadedLayerBase:
    """Mixed into OffloadedLayer, OffloadedSlidingLayer, OffloadedStaticLayer and OffloadedStaticSlidingLayer."""

    def _may_prefetch(self) -> bool:
        """No prefetch in flight, and none while the layer's K/V are handed out (keys/values): an edit
        through them before the next update must be seen, and a prefetch issued before the edit would
        miss it (StaticCache's K/V are persistent; a forward that failed part-way leaves a dynamic
        layer handed out but not updated)."""
        return self.__dict__.get("_prefetched") is None and not self.__dict__.get("_exposed", False)

    def _drop_prefetch(self, on_host: bool = False) -> None:
        """Forget the prefetch, ordered before its device memory is reused (and, with `on_host`, before
        the host writes what it reads)."""
        pre, self._prefetched = self.__dict__.get("_prefetched"), None
        if pre is not None:
            pre[-1].wait()
            if on_host:
                _engine.wait_on_host(pre[-1])

    @contextlib.contextmanager
    def _first_update(self, key_states, value_states):
        """The layer's lazy initialization on its first update, undone if the update raises: a failed
        update (a HostLimitError) leaves the layer exactly as it was, uninitialized included."""
        first = not self.is_initialized
        if first:
            self.lazy_initialization(key_states, value_states)
        try:
            yield
        except BaseException:
            if first:
                self.is_initialized = False
            raise
