"""Nested values: turn a value into an IntermediateValue tree, and back.

Tensors may sit at any depth of dataclasses (frozen too), tuples (namedtuples
stay namedtuples), lists and dicts (dict subclasses such as transformers'
ModelOutput keep their type). Other leaves are kept as they are.

Containers are taken apart in one place, ``walk``: it gives a container's
children and a function that builds the same kind of container around new
children. ``plan`` (value -> tree), ``children`` (tree -> leaves), ``rebuild``
(tree -> value) and ``count_bytes`` (``IntermediatesCache.size``) all use it.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch

from offcache import _engine

Tensor = torch.Tensor
_CPU = torch.device("cpu")
_PLAIN_LEAVES = (int, str, float, bool, torch.dtype, torch.device, type(None))


@dataclass
class IntermediateValue:
    """An offloaded value and the device to onload it to (None for containers and leaves).

    :param value: an offloaded tensor, a plain leaf, or a container of IntermediateValues
    :param device: for a tensor, the device it is fetched back to; otherwise None

    Stores are asynchronous: reading ``.value`` waits, once, for the copy that
    fills it. The cache itself reads ``_value``, since its fetches are ordered
    after the store by events.
    """

    value: torch.Tensor | IntermediateValue | Any
    device: torch.device | None

    _pending = False  # a store into `_value` may still be in flight


def _get_value(self: IntermediateValue) -> Any:
    if self._pending:
        _engine.wait_stored(self._value)
        self._pending = False
    return self._value


def _set_value(self: IntermediateValue, value: Any) -> None:
    self._value = value
    self._pending = False


IntermediateValue.value = property(_get_value, _set_value)  # type: ignore[assignment]


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
_TUPLE, _LIST, _DICT, _LEAF = "tuple", "list", "dict", "leaf"
_NAMEDTUPLE, _TUPLE_SUBCLASS, _DICT_SUBCLASS, _MODEL_OUTPUT = "namedtuple", "tuple subclass", "dict subclass", "dc+dict"
_KINDS: dict[type, Any] = {tuple: _TUPLE, list: _LIST, dict: _DICT}
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
    """Raise a clear error for tensors the cache cannot hold, naming where they were."""
    if t.layout is not torch.strided:
        raise TypeError(f"{where}: cannot cache a tensor with layout {t.layout}; densify it first")
    if t.is_quantized:
        raise TypeError(f"{where}: cannot cache a quantized tensor (dtype {t.dtype}); dequantize it first")
    if t.is_nested:
        raise TypeError(f"{where}: cannot cache a nested tensor; unbind it into a list first")
    if t.is_meta:
        raise ValueError(f"{where}: cannot cache a meta tensor: it has no data")


def plan(value: Any, onload: torch.device | None, leaves: list, where: str) -> IntermediateValue:
    """IntermediateValue tree for `value`; tensor leaves are appended to `leaves`.

    Each appended leaf still holds the source tensor; the caller replaces
    `_value` with the stored copy.
    """
    if isinstance(value, Tensor):
        check_tensor(value, where)
        leaf = IntermediateValue(value, onload if onload is not None else value.device)
        leaves.append(leaf)
        return leaf
    walked = walk(value)
    if walked is None:
        if not isinstance(value, _PLAIN_LEAVES + (torch.Size,)):
            warnings.warn(f"Offloading not implemented for type {type(value)}.", stacklevel=4)
        return IntermediateValue(value, None)
    items, build = walked
    return IntermediateValue(build([plan(v, onload, leaves, where) for v in items]), None)


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
    fields that are set, and counts them so.
    """
    while isinstance(value, IntermediateValue):
        value = value._value
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
