"""Nested values: turn a value into an IntermediateValue tree, and back.

Tensors may sit at any depth of dataclasses (frozen too), tuples (namedtuples
stay namedtuples), lists and dicts (dict subclasses such as transformers'
ModelOutput keep their type). Other leaves, and containers that hold no tensor, are kept
as they are: the same object comes back.

Containers are taken apart in one place, ``walk``: it gives a container's
children and a function that builds the same kind of container around new
children. ``plan`` (value -> tree), ``children`` (tree -> leaves), ``rebuild``
(tree -> value) and ``count_bytes`` (``IntermediatesCache.size``) all use it.

Tensor subclasses: a traceable wrapper subclass (one with ``__tensor_flatten__``,
such as DTensor) is stored as its inner tensors and rebuilt with
``__tensor_unflatten__``; a subclass that keeps its data in its own storage and
does not override ``__torch_dispatch__`` (``torch.nn.Parameter``) is stored as
its data and rebuilt with ``as_subclass``. Other subclasses are refused.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from offcache import engine as _engine

Tensor = torch.Tensor
_CPU = torch.device("cpu")
_PLAIN_LEAVES = (int, str, float, bool, torch.dtype, torch.device, type(None))
_NO_DISPATCH = torch._C._disabled_torch_dispatch_impl  # what a subclass that keeps torch's dispatch has


@dataclass(init=False)  # __init__ below: the hot path of every update() makes one per leaf
class IntermediateValue:
    """An offloaded value and the device to onload it to (None for containers and leaves).

    :param value: an offloaded tensor, a plain leaf, or a container of IntermediateValues
    :param device: for a tensor, the device it is fetched back to; otherwise None

    Stores are asynchronous: reading ``.value`` waits, once, for the copy that
    fills it. The cache itself reads ``_value``, since its fetches are ordered
    after the store by events. Copies (``copy.deepcopy``, ``pickle``) read
    ``.value`` too, so they hold the stored values; a copied offloaded tensor is
    stored again, in the arena of the process's engine.
    """

    value: torch.Tensor | IntermediateValue | Any
    device: torch.device | None

    _pending = False  # a store into `_value` may still be in flight

    def __init__(self, value: Any, device: torch.device | None) -> None:
        self._value = value  # what the `value` property's setter does, without its call
        self.device = device

    def __copy__(self) -> IntermediateValue:
        out = type(self).__new__(type(self))
        out.__dict__.update(self.__dict__)
        return out

    def __deepcopy__(self, memo: dict) -> IntermediateValue:
        value = self.value  # waits for a pending store
        out = type(self).__new__(type(self))
        memo[id(self)] = out
        out.device = copy.deepcopy(self.device, memo)
        if _is_offloaded(value):
            # One engine copy (arena to arena), shared by every leaf that shared the value.
            if id(value) not in memo:
                memo[id(value)] = _engine.store([value], _CPU)[0]
                _engine.warn_if_spilled()
            out._value, out._pending = memo[id(value)], True
        else:
            out._value = copy.deepcopy(value, memo)
        return out

    def __getstate__(self) -> dict:
        value = self.value  # waits for a pending store
        return {"value": value, "device": self.device, "offloaded": _is_offloaded(value)}

    def __setstate__(self, state: dict) -> None:
        self.device = state["device"]
        self._value = state["value"]
        if state.get("offloaded"):  # back into the arena of this process's engine
            self._value = _engine.store([self._value], _CPU)[0]
            self._pending = True
            _engine.warn_if_spilled()


def _get_value(self: IntermediateValue) -> Any:
    if self._pending:
        _engine.wait_stored(self._value)
        self._pending = False
    return self._value


def _set_value(self: IntermediateValue, value: Any) -> None:
    self._value = value
    self._pending = False


IntermediateValue.value = property(_get_value, _set_value)  # type: ignore[assignment]


def _is_offloaded(value: Any) -> bool:
    return isinstance(value, Tensor) and value.device.type == "cpu" and _engine.is_offcache_tensor(value)


# Tensor subclasses ------------------------------------------------------------------------


@dataclass
class WrapperSubclass:
    """A traceable wrapper subclass, stored as its inner tensors (``__tensor_flatten__``)."""

    cls: type
    inner: dict[str, IntermediateValue]
    ctx: Any
    size: torch.Size
    stride: tuple[int, ...]
    nbytes: int = 0  # the wrapper's own nbytes: what llm-compressor's size() counts

    def build(self, items: list) -> Tensor:
        return self.cls.__tensor_unflatten__(dict(zip(self.inner, items)), self.ctx, self.size, self.stride)


@dataclass
class PlainSubclass:
    """A subclass with its own storage and torch's dispatch (e.g. Parameter), stored as its data."""

    cls: type
    inner: dict[str, IntermediateValue]  # {"data": the tensor}
    attrs: dict[str, Any]  # the instance's __dict__, copied shallowly

    def build(self, items: list) -> Tensor:
        (t,) = items
        if type(t) is self.cls:  # not moved (offload_device=None): the original object
            return t
        out = t.as_subclass(self.cls)
        out.__dict__.update(self.attrs)
        return out


# The container walk -------------------------------------------------------------------------


def walk(value: Any) -> tuple[Sequence, Callable[[list], Any]] | None:
    """The children of a container and a function that builds the same container around new ones.

    None for a leaf (tensor, torch.Size, plain value). The order of the checks is
    llm-compressor's: tuples and lists, then dicts (a ModelOutput's children are
    the fields that are set, its dict items), then dataclasses.
    """
    cls = value.__class__
    kind = _KINDS.get(cls)
    if kind is None:
        kind = _classify(cls)
    if kind is _TUPLE:
        return value, tuple
    if kind is _LIST:
        return value, list
    if kind is _DICT:
        keys = list(value)
        return list(value.values()), lambda items: dict(zip(keys, items))
    if kind is _LEAF:
        return None
    if kind is _NODE:
        return list(value.inner.values()), value.build
    if kind is _NAMEDTUPLE:
        return value, lambda items: cls(*items)
    if kind is _TUPLE_SUBCLASS:
        return value, lambda items: _rebuild_tuple(cls, items)
    if kind is _DICT_SUBCLASS:
        keys = list(value)
        return list(value.values()), lambda items: _rebuild_dict(cls, dict(zip(keys, items)))
    if kind is _MODEL_OUTPUT:  # the fields that are set (its dict items), built as keywords
        keys = list(value)
        return list(value.values()), lambda items: _rebuild_dataclass(cls, dict(zip(keys, items)))
    names = kind  # a dataclass: its field names
    return [getattr(value, n) for n in names], lambda items: _rebuild_dataclass(cls, dict(zip(names, items)))


# What walk does with each class, decided once per class.
_TUPLE, _LIST, _DICT, _LEAF, _NODE = "tuple", "list", "dict", "leaf", "node"
_NAMEDTUPLE, _TUPLE_SUBCLASS, _DICT_SUBCLASS, _MODEL_OUTPUT = "namedtuple", "tuple subclass", "dict subclass", "dc+dict"
_KINDS: dict[type, Any] = {tuple: _TUPLE, list: _LIST, dict: _DICT, WrapperSubclass: _NODE, PlainSubclass: _NODE}
_DATACLASS_INIT: dict[type, bool] = {}  # a dataclass class -> every field is an __init__ argument


def _classify(cls: type) -> Any:
    if issubclass(cls, torch.Size) or issubclass(cls, Tensor):
        kind = _LEAF
    elif issubclass(cls, tuple):
        kind = _NAMEDTUPLE if hasattr(cls, "_fields") else _TUPLE_SUBCLASS
    elif issubclass(cls, list):
        kind = _LIST  # rebuilt as a list, as llm-compressor does
    elif issubclass(cls, dict):
        kind = _MODEL_OUTPUT if is_dataclass(cls) else _DICT_SUBCLASS
    elif is_dataclass(cls):
        kind = tuple(f.name for f in fields(cls))
    else:
        kind = _LEAF
    if is_dataclass(cls):
        _DATACLASS_INIT[cls] = all(f.init for f in fields(cls))
    _KINDS[cls] = kind
    return kind


def _rebuild_tuple(cls: type, items: list) -> tuple:
    try:
        return cls(items)
    except Exception:
        return tuple(items)


def _rebuild_dict(cls: type, items: dict) -> dict:
    try:
        return cls(items)
    except Exception:  # e.g. defaultdict needs its factory
        return items


def _rebuild_dataclass(cls: type, values: dict[str, Any]) -> Any:
    """A `cls` holding `values` (by field name; missing fields are None)."""
    if _DATACLASS_INIT[cls]:
        try:
            return cls(**values)
        except Exception:  # a __post_init__ that rejects placeholders: build without __init__
            pass
    obj = object.__new__(cls)
    if isinstance(obj, dict):
        dict.__init__(obj)
    for f in fields(cls):
        v = values.get(f.name)
        object.__setattr__(obj, f.name, v)
        if isinstance(obj, dict) and v is not None:
            dict.__setitem__(obj, f.name, v)
    return obj


# value -> tree -> value ---------------------------------------------------------------------


def check_tensor(t: Tensor, where: str) -> None:
    """Raise a clear error for a tensor the cache cannot hold, naming where it was.

    The engine's ``check_storable`` (csrc/engine/engine_detail.h) holds the same rules,
    worded the same after the ``where`` prefix. On every stored tensor: the
    common case costs a few attribute reads.
    """
    if t.layout is not torch.strided or t.is_quantized or t.is_nested or t.is_meta:
        _check_kind(t, where)
    have = t.untyped_storage().nbytes()
    offset = t.storage_offset()
    if not (t.is_contiguous() and have >= t.nbytes + (offset * t.element_size() if offset else 0)) and t.numel():
        extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        need = (offset + extent) * t.element_size()
        if have < need:
            raise ValueError(
                f"{where}: cannot cache a tensor whose storage holds {have} bytes but the tensor needs {need}: "
                "was its storage freed or resized?"
            )


def _check_kind(t: Tensor, where: str) -> None:
    """The errors for what is not a dense tensor with data."""
    if t.layout is not torch.strided:
        raise TypeError(
            f"{where}: cannot cache a tensor with layout {t.layout}; only strided (dense) tensors can be cached: "
            "densify it first"
        )
    if t.is_quantized:
        raise TypeError(f"{where}: cannot cache a quantized tensor (dtype {t.dtype}); dequantize it first")
    if t.is_nested:
        raise TypeError(f"{where}: cannot cache a nested tensor; unbind it into a list first")
    if t.is_meta:
        raise ValueError(f"{where}: cannot cache a meta tensor: it has no data")


def plan(value: Any, onload: torch.device | None, leaves: list, where: str, check: bool = True) -> IntermediateValue:
    """IntermediateValue tree for `value`; tensor leaves are appended to `leaves`.

    Each appended leaf still holds the source tensor; the caller replaces
    `_value` with the stored copy. Every check runs here, before anything is stored,
    except with ``check=False``: for a caller that hands every leaf to the engine's store,
    which makes the same checks (``check_storable``) on all of them before it stores any, and
    plans again with checks when the store refuses one, for the error that names it.
    """
    if value.__class__ is Tensor:
        if check:
            check_tensor(value, where)
        leaf = IntermediateValue(value, onload if onload is not None else value.device)
        leaves.append(leaf)
        return leaf
    if isinstance(value, Tensor):
        return IntermediateValue(_plan_subclass(value, onload, leaves, where), None)
    walked = walk(value)
    if walked is None:
        if not isinstance(value, _PLAIN_LEAVES + (torch.Size,)):
            warnings.warn(f"Offloading not implemented for type {type(value)}.", stacklevel=4)
        return IntermediateValue(value, None)
    items, build = walked
    before = len(leaves)
    planned = [plan(v, onload, leaves, where, check) for v in items]
    if len(leaves) == before:
        # No tensor inside: kept as the very object, as llm-compressor keeps non-tensor values.
        # Rebuilding it could lose what its fields do not hold (a PretrainedConfig's attribute
        # map and properties) or be refused by its validation.
        return IntermediateValue(value, None)
    return IntermediateValue(build(planned), None)


def _plan_subclass(t: Tensor, onload, leaves: list, where: str) -> WrapperSubclass | PlainSubclass:
    cls = type(t)
    if is_traceable_wrapper_subclass(t):
        _check_kind(t, where)  # its inner tensors get every check
        names, ctx = t.__tensor_flatten__()
        inner = {name: plan(getattr(t, name), onload, leaves, f"{where} ({cls.__name__}.{name})") for name in names}
        return WrapperSubclass(cls, inner, ctx, t.size(), t.stride(), t.nbytes)
    if getattr(cls, "__torch_dispatch__", _NO_DISPATCH) is not _NO_DISPATCH:
        raise TypeError(
            f"{where}: cannot cache a tensor of subclass {cls.__module__}.{cls.__qualname__}: it overrides "
            "__torch_dispatch__ without __tensor_flatten__/__tensor_unflatten__, so its data cannot be reached"
        )
    try:
        t.untyped_storage().data_ptr()
    except RuntimeError:  # a wrapper made with _make_wrapper_subclass: no data of its own
        raise TypeError(
            f"{where}: cannot cache a tensor of subclass {cls.__module__}.{cls.__qualname__}: it has no storage "
            "of its own and is not traceable (__tensor_flatten__/__tensor_unflatten__)"
        ) from None
    check_tensor(t, where)
    leaf = IntermediateValue(t, onload if onload is not None else t.device)
    leaves.append(leaf)
    return PlainSubclass(cls, {"data": leaf}, dict(getattr(t, "__dict__", {})))


def children(value: Any) -> list[IntermediateValue]:
    """The IntermediateValues directly inside a container value, in rebuild order."""
    if isinstance(value, IntermediateValue):
        return [value]
    walked = walk(value)
    if walked is None:
        return []
    return [v for v in walked[0] if isinstance(v, IntermediateValue)]


def collect(iv: IntermediateValue, sources: list, devices: list) -> None:
    """Append every tensor leaf of `iv` and its onload device, in rebuild order."""
    value = iv._value
    if isinstance(value, Tensor):
        sources.append(value)
        devices.append(iv.device)
    else:
        for child in children(value):
            collect(child, sources, devices)


def rebuild(iv: IntermediateValue, fetched) -> Any:
    """The value of `iv` with its tensor leaves taken, in order, from the iterator `fetched`."""
    value = iv._value
    if isinstance(value, Tensor):
        return next(fetched)
    if isinstance(value, IntermediateValue):
        return rebuild(value, fetched)
    walked = walk(value)
    if walked is None:
        return value
    items, build = walked
    if not any(isinstance(v, IntermediateValue) for v in items):
        return value  # a value that held no tensor, kept as it was given (see plan)
    return build([rebuild(v, fetched) if isinstance(v, IntermediateValue) else v for v in items])


def tensor_leaves(iv: IntermediateValue) -> list[IntermediateValue]:
    """Every IntermediateValue of `iv` whose value is a tensor."""
    if isinstance(iv._value, Tensor):
        return [iv]
    return [leaf for child in children(iv._value) for leaf in tensor_leaves(child)]


def count_bytes(value: Any, sizes: dict, memo: set) -> None:
    """Add the bytes of `value` (an IntermediateValue tree) to `sizes`, as llm-compressor's ``size()`` counts.

    Tensors by nbytes on their device, once each (`memo` holds the ids seen);
    other leaves by ``sys.getsizeof(value, 0)`` on the CPU. llm-compressor
    stores a torch.Size as a tuple of ints and a ModelOutput as a dict of the
    fields that are set, and counts them so. A wrapper subclass counts its own
    nbytes, as the tensor llm-compressor keeps would, on its inner tensors' device.
    """
    while isinstance(value, IntermediateValue):
        value = value._value
    if isinstance(value, WrapperSubclass):
        if id(value) not in memo:
            memo.add(id(value))
            inner = value.inner[next(iter(value.inner))]
            while isinstance(inner, IntermediateValue):
                inner = inner._value
            sizes[inner.device if isinstance(inner, Tensor) else _CPU] += value.nbytes
        return
    if isinstance(value, Tensor):
        if id(value) not in memo:
            memo.add(id(value))
            sizes[value.device] += value.nbytes
        return
    walked = walk(value)
    if walked is not None:
        for child in walked[0]:
            count_bytes(child, sizes, memo)
    elif isinstance(value, torch.Size):
        for n in value:
            sizes[_CPU] += sys.getsizeof(n, 0)
    else:
        sizes[_CPU] += sys.getsizeof(value, 0)
