"""Drop-in replacement for llm-compressor's IntermediatesCache, on the offcache engine.

Same API and results as ``llmcompressor.pipelines.cache.IntermediatesCache``
(release 0.14.0.1); stores are asynchronous D2H copies into a pinned arena,
fetches are batched H2D copies, and ``iter_prefetch`` double-buffers on the
engine's H2D stream instead of a Python thread.
"""

from __future__ import annotations

import warnings
from collections import defaultdict, deque
from collections.abc import Iterator
from typing import Any

import torch
from tqdm import tqdm

from offcache import engine as _engine
from offcache.activations.tree import IntermediateValue, collect, count_bytes, plan, rebuild, tensor_leaves
from offcache.util.units import human

__all__ = ["IntermediateValue", "IntermediatesCache"]

IntermediateValues = dict[str, IntermediateValue]
_CPU = torch.device("cpu")
Tensor = torch.Tensor


def _as_device(device: Any, what: str) -> torch.device | None:
    if device is None or isinstance(device, torch.device):
        return device
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be a torch.device, 'cpu', 'cuda:N' or None, got {device!r}") from exc


def _check_offload_device(device: Any) -> torch.device | None:
    dev = _as_device(device, "offload_device")
    if dev is None:
        return None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"offload_device must be 'cpu', 'cuda:N' or None, got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"offload_device {device!r} needs CUDA, which is not available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"offload_device {device!r}: only {torch.cuda.device_count()} CUDA devices are visible")
    return dev


class IntermediatesCache:
    """Per-batch activations, offloaded to `offload_device` on store and onloaded on fetch.

    ``batch_intermediates[i]`` maps names to IntermediateValue trees, exactly as in
    llm-compressor; an offloaded tensor's ``.value`` is a CPU tensor viewing arena
    memory and its ``.device`` is where it is fetched back to. With
    ``offload_device=None`` values stay where they are.
    """

    batch_intermediates: list[IntermediateValues]
    offload_device: torch.device | None

    def __init__(
        self,
        batch_intermediates: list[IntermediateValues] | None = None,
        offload_device: torch.device | str | None = "cpu",
    ):
        self.batch_intermediates = batch_intermediates or []
        self.offload_device = _check_offload_device(offload_device)

    # construction ------------------------------------------------------------------

    @classmethod
    def empty(cls, num_batches: int, offload_device: torch.device | str | None):
        """An empty cache with `num_batches` batches, filled later with update()."""
        return cls([{} for _ in range(num_batches)], offload_device)

    @classmethod
    def from_dataloader(
        cls,
        dataloader: torch.utils.data.DataLoader,
        model_device: torch.device = torch.device("cpu"),
        offload_device: torch.device | None = torch.device("cpu"),
    ):
        """A cache holding every batch of `dataloader`, onloaded to `model_device` on fetch."""
        cache = cls(None, offload_device)
        onload = _as_device(model_device, "model_device")
        try:
            total = len(dataloader)
        except TypeError:  # an iterable dataset: no length, no projection
            total = 0
        for batch in tqdm(dataloader, desc="Preparing cache"):
            cache.batch_intermediates.append(cache._offload_many(batch, onload, len(cache), total))
        return cache

    # the llm-compressor API ----------------------------------------------------------

    def fetch(self, batch_index: int, input_names: list[str] | None = None) -> dict[str, Any]:
        """Onloaded values of batch `batch_index`; names not in the batch are left out."""
        names, ivs = self._select(batch_index, input_names)
        return self._onload(names, ivs, wait=True)[0]

    def update(self, batch_index: int, values: dict[str, Any]) -> None:
        """Store `values` in batch `batch_index`, replacing existing names."""
        batch = self._batch(batch_index)
        batch.update(self._offload_many(values, None, batch_index, len(self.batch_intermediates)))

    def delete(self, batch_index: int, consumed_names: list[str] | None = None) -> None:
        """Delete names from a batch (all by default); a missing name raises KeyError."""
        batch = self._batch(batch_index)
        if consumed_names is None:
            batch.clear()
            return
        for name in consumed_names:
            try:
                del batch[name]
            except KeyError:
                raise KeyError(f"batch {batch_index} holds no value named {name!r}") from None

    def append(self, values: dict[str, Any]) -> None:
        """Store `values` as a new batch at the end (nothing changes if a value is refused)."""
        batch = self._offload_many(values, None, len(self.batch_intermediates))
        self.batch_intermediates.append(batch)

    def size(self) -> dict[torch.device, int]:
        """Bytes held per device, counted as llm-compressor 0.14.0.1 counts them.

        A tensor shared by several values counts once; other leaves count
        ``sys.getsizeof`` on the CPU (see ``offcache.activations.tree.count_bytes``).
        """
        sizes: dict[torch.device, int] = defaultdict(int)
        memo: set[int] = set()
        for batch in self.batch_intermediates:
            for iv in list(batch.values()):
                count_bytes(iv, sizes, memo)
        return dict(sizes)

    def pin_memory(self, batch_index: int, input_names: list[str] | None = None) -> None:
        """Move values that spilled to pageable memory into the pinned arena, if the budget allows.

        Arena values are pinned already; values that do not fit stay where they are.
        """
        batch = self._batch(batch_index)
        leaves = [
            leaf
            for name, iv in list(batch.items())
            if input_names is None or name in input_names
            for leaf in tensor_leaves(iv)
            if leaf._value.device.type == "cpu" and not _engine.is_arena_tensor(leaf._value)
        ]
        if leaves:
            pinned = _engine.store([leaf._value for leaf in leaves], _CPU, allow_spill=False)
            for leaf, value in zip(leaves, pinned):
                if value is not leaf._value:
                    leaf._value, leaf._pending = value, True

    def iter(self, input_names: list[str] | None = None) -> Iterator[dict[str, Any]]:
        for batch_index in range(len(self.batch_intermediates)):
            yield self.fetch(batch_index, input_names)

    def iter_prefetch(self, input_names: list[str] | None = None, depth: int = 1) -> Iterator[dict[str, Any]]:
        """Like iter(), with the next `depth` batches' H2D copies in flight while a batch is used.

        No thread: the copies run on the engine's H2D stream, into buffers that stream
        owns, so they need not wait for the consumer's queued work. The generator holds
        at most depth + 1 fetched batches; each batch is safe to use on the consumer's
        current stream when it is yielded. A batch updated after it was prefetched is
        yielded as it was when prefetched (as llm-compressor's prefetch thread does).
        """
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"iter_prefetch: depth must be an int >= 1, got {depth!r}")
        n = len(self.batch_intermediates)
        ahead: deque = deque()
        issued = 0
        for _ in range(n):
            while issued < n and len(ahead) <= depth:
                ahead.append(self._onload(*self._select(issued, input_names), wait=False))
                issued += 1
            current, tickets = ahead.popleft()
            for ticket in tickets:
                ticket.wait()
            yield current

    def __iter__(self) -> Iterator[dict[str, Any]]:
        yield from self.iter()

    def __len__(self) -> int:
        return len(self.batch_intermediates)

    def __contains__(self, key: Any) -> bool:
        """``(batch_index, name) in cache``: that batch holds that name; ``i in cache``: batch i exists.

        llm-compressor 0.14's class has no ``__contains__``, so ``in`` falls back to ``__iter__``:
        it fetches every batch and compares whole dicts with the key, silently False for the
        keys its open PR #2664 would ask about. Here nothing is fetched.
        """
        if isinstance(key, tuple) and len(key) == 2:
            batch_index, name = key
            if isinstance(batch_index, int) and not isinstance(batch_index, bool):
                n = len(self.batch_intermediates)
                return -n <= batch_index < n and name in self.batch_intermediates[batch_index]
        elif isinstance(key, int) and not isinstance(key, bool):
            return -len(self.batch_intermediates) <= key < len(self.batch_intermediates)
        raise TypeError(f"`in` on an IntermediatesCache takes (batch_index, name) or a batch index, got {key!r}")

    @classmethod
    def _onload_value(cls, intermediate: IntermediateValue) -> Any:
        """The value of one IntermediateValue, with its tensors onloaded."""
        return _onload_ivs([intermediate], wait=True)[0][0]

    @classmethod
    def _offload_value(
        cls,
        value: Any,
        offload_device: torch.device | None,
        onload_device: torch.device | None = None,
    ) -> IntermediateValue:
        """The IntermediateValue of `value`, its tensors stored on `offload_device`."""
        leaves: list[IntermediateValue] = []
        iv = plan(value, _as_device(onload_device, "onload_device"), leaves, "value")
        _store(leaves, _as_device(offload_device, "offload_device"))
        return iv

    # internals -----------------------------------------------------------------------

    def _batch(self, batch_index: int) -> IntermediateValues:
        try:
            return self.batch_intermediates[batch_index]
        except IndexError:
            raise IndexError(
                f"batch index {batch_index} is out of range: the cache holds {len(self.batch_intermediates)} batches"
            ) from None
        except TypeError:
            raise TypeError(f"batch index must be an int, got {batch_index!r}") from None

    def _select(self, batch_index: int, input_names: list[str] | None):
        # One atomic copy of the items (list() of a dict view runs under the GIL): another
        # thread may update or delete names in this batch meanwhile.
        items = list(self._batch(batch_index).items())
        if input_names is not None:
            items = [(k, iv) for k, iv in items if k in input_names]
        return [k for k, _ in items], [iv for _, iv in items]

    def _offload_many(self, values: dict[str, Any], onload: torch.device | None, batch_index: int, batches: int = 0):
        leaves: list[IntermediateValue] = []
        # Stored leaves are checked by the engine's store (all of them, before it stores any); a
        # refusal plans again with the checks, for the error that names the batch and the value.
        check = self.offload_device is None

        def checked() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # plan's own warnings came out the first time
                for name, v in values.items():
                    plan(v, onload, [], f"batch {batch_index}, value {name!r}")

        out = {
            name: plan(v, onload, leaves, f"batch {batch_index}, value {name!r}", check) for name, v in values.items()
        }
        _store(
            leaves,
            self.offload_device,
            lambda: f"batch {batch_index} (values {', '.join(map(repr, values))})",
            checked,
        )
        if batches > 1 and leaves and self.offload_device is not None and self.offload_device.type == "cpu":
            self._project(values, leaves, batch_index, batches)
        return out

    def _project(self, values: dict, leaves: list[IntermediateValue], batch_index: int, batches: int) -> None:
        """The early warning: one batch of a new set of names, times the number of batches.

        In the sequential pipeline each subgraph stores outputs under new names, so the first
        update() of a subgraph projects its total. It warns at once (CapacityWarning) when that
        exceeds the host limit plus the disk tier's free space, instead of failing hours later.
        """
        if self.__dict__.get("_capacity_warned"):
            return
        key = frozenset(values)
        projected = self.__dict__.setdefault("_projected", set())
        if key in projected:
            return
        projected.add(key)
        batch_bytes = sum(leaf._value.nbytes for leaf in leaves)
        total = batch_bytes * batches
        room, where = _engine.capacity()
        if total <= room:
            return
        self._capacity_warned = True
        names = ", ".join(map(repr, values))
        warnings.warn(
            f"offcache: batch {batch_index}'s values ({names}) hold {batch_bytes} bytes; for {batches} batches "
            f"that is {total} bytes ({human(total)}), more than {where} ({room} bytes together): the run "
            f"would fail when the cache fills. Set OFFCACHE_DISK_DIR to a folder on a disk with "
            f"{human(total)} free, raise OFFCACHE_HOST_LIMIT if the memory is there, or calibrate with "
            "fewer samples or shorter sequences (python -m offcache.plan estimates a run before it starts)",
            _engine.CapacityWarning,
            stacklevel=4,
        )

    def _onload(self, names: list[str], ivs: list[IntermediateValue], wait: bool):
        values, tickets = _onload_ivs(ivs, wait)
        return dict(zip(names, values)), tickets


def _store(
    leaves: list[IntermediateValue],
    offload_device: torch.device | None,
    where=lambda: "the value",
    checked=lambda: None,
) -> None:
    """Replace each leaf's source tensor by its stored copy (one engine call); `where()` names them in errors.

    `checked()` raises the named error for a value the engine refuses (leaves planned unchecked).
    """
    if offload_device is None or not leaves:
        return
    try:
        stored = _engine.store([leaf._value for leaf in leaves], offload_device)
    except _engine.HostLimitError as exc:
        raise _host_limit_error(exc, where()) from exc
    except (TypeError, ValueError, RuntimeError):
        checked()  # the engine refused a value: the same check here names it
        raise
    for leaf, value in zip(leaves, stored):
        leaf._value, leaf._pending = value, True
    _engine.warn_if_spilled(stacklevel=4)  # the caller of update() / append() / from_dataloader()


def _host_limit_error(exc: BaseException, where: str) -> BaseException:
    """The engine's HostLimitError, naming what was stored and, for auto, why there is no disk tier."""
    message = f"{where}: {exc}"
    reason = _engine.settings().get("disk_auto_reason")
    if reason:
        message += f". OFFCACHE_DISK_DIR=auto found no folder: {reason}"
    message += ". Nothing stored earlier is lost."
    try:
        return type(exc)(message)
    except Exception:  # an exception type that takes other arguments
        return _engine.HostLimitError(message)


def _onload_ivs(ivs: list[IntermediateValue], wait: bool) -> tuple[list[Any], list]:
    """Onload several IntermediateValues with one engine call per target device.

    The hot path of every fetch: top-level tensors (the common case) skip the
    recursive walk, and a batch bound for one device makes a single engine call.
    """
    sources: list[Tensor] = []
    devices: list = []
    for iv in ivs:
        value = iv._value
        if value.__class__ is Tensor:
            sources.append(value)
            devices.append(iv.device)
        else:
            collect(iv, sources, devices)
    tickets = []
    if not sources:
        out: list = sources
    elif devices.count(devices[0]) == len(devices):
        out = sources if devices[0] is None else _fetch(sources, devices[0], wait, tickets)
    else:
        out = list(sources)
        groups: dict[torch.device, list[int]] = {}
        for i, dev in enumerate(devices):
            if dev is not None:  # None: llm-compressor's .to(None), the value as stored
                groups.setdefault(dev, []).append(i)
        for dev, idx in groups.items():
            for i, t in zip(idx, _fetch([sources[i] for i in idx], dev, wait, tickets)):
                out[i] = t
    fetched = iter(out)
    return [next(fetched) if iv._value.__class__ is Tensor else rebuild(iv, fetched) for iv in ivs], tickets


def _fetch(sources: list[Tensor], device, wait: bool, tickets: list) -> list[Tensor]:
    """The engine's fetch; a tensor already on `device` that offcache does not own comes back as is."""
    if device.__class__ is not torch.device:
        device = torch.device(device)
    out, ticket = _engine.fetch(sources, device, wait)
    tickets.append(ticket)
    return out
