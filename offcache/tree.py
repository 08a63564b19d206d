"""Nested values: turn a value into an IntermediateValue tree, and back.

Tensors may sit at any depth of dataclasses (frozen too), tuples (namedtuples
stay namedtuples), lists and dicts (dict subclasses such as transformers'
ModelOutput keep their type). Other leaves are kept as they are.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch

from offcache import _engine

Tensor = torch.Tensor
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
    if is_dataclass(value) and not isinstance(value, type):
        return IntermediateValue(
            _rebuild_dataclass(value, [plan(getattr(value, f.name), onload, leaves, where) for f in fields(value)]),
            None,
        )
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        items = [plan(v, onload, leaves, where) for v in value]
        return IntermediateValue(_rebuild_tuple(value, items), None)
    if isinstance(value, list):
        return IntermediateValue([plan(v, onload, leaves, where) for v in value], None)
    if isinstance(value, dict):
        items = {k: plan(v, onload, leaves, where) for k, v in value.items()}
        return IntermediateValue(_rebuild_dict(value, items), None)
    if not isinstance(value, _PLAIN_LEAVES + (torch.Size,)):
        warnings.warn(f"Offloading not implemented for type {type(value)}.", stacklevel=4)
    return IntermediateValue(value, None)


def collect(iv: IntermediateValue, sources: list, devices: list) -> None:
    """Append every tensor leaf of `iv` and its onload device, in rebuild order."""
    value = iv._value
    if isinstance(value, Tensor):
        sources.append(value)
        devices.append(iv.device)
    else:
        for child in _children(value):
            collect(child, sources, devices)


def _children(value: Any) -> list[IntermediateValue]:
    """The IntermediateValues directly inside a container value, in rebuild order."""
    if isinstance(value, (list, tuple)):  # before dataclasses: the common case
        items = value
    elif isinstance(value, IntermediateValue):
        items = (value,)
    elif is_dataclass(value) and not isinstance(value, type):  # before dict: ModelOutput is both
        items = [getattr(value, f.name) for f in fields(value)]
    elif isinstance(value, dict):
        items = value.values()
    else:
        return []
    return [v for v in items if isinstance(v, IntermediateValue)]


def rebuild(iv: IntermediateValue, fetched) -> Any:
    """The value of `iv` with its tensor leaves taken, in order, from the iterator `fetched`."""
    value = iv._value
    if isinstance(value, Tensor):
        return next(fetched)
    if isinstance(value, tuple):  # before dataclasses: the common case
        return _rebuild_tuple(value, [_rebuild_item(v, fetched) for v in value])
    if isinstance(value, list):
        return [_rebuild_item(v, fetched) for v in value]
    if isinstance(value, IntermediateValue):
        return rebuild(value, fetched)
    if is_dataclass(value) and not isinstance(value, type):
        return _rebuild_dataclass(value, [_rebuild_item(getattr(value, f.name), fetched) for f in fields(value)])
    if isinstance(value, dict):
        return _rebuild_dict(value, {k: _rebuild_item(v, fetched) for k, v in value.items()})
    return value


def _rebuild_item(v: Any, fetched) -> Any:
    return rebuild(v, fetched) if isinstance(v, IntermediateValue) else v


def tensor_leaves(iv: IntermediateValue) -> list[IntermediateValue]:
    """Every IntermediateValue of `iv` whose value is a tensor."""
    if isinstance(iv._value, Tensor):
        return [iv]
    return [leaf for child in _children(iv._value) for leaf in tensor_leaves(child)]


def _rebuild_dataclass(like: Any, values: list) -> Any:
    cls = type(like)
    fs = fields(like)
    if all(f.init for f in fs):
        try:
            return cls(**{f.name: v for f, v in zip(fs, values)})
        except Exception:  # a __post_init__ that rejects placeholders: build without __init__
            pass
    obj = object.__new__(cls)
    if isinstance(obj, dict):
        dict.__init__(obj)
    for f, v in zip(fs, values):
        object.__setattr__(obj, f.name, v)
        if isinstance(obj, dict) and v is not None:
            dict.__setitem__(obj, f.name, v)
    return obj


def _rebuild_tuple(like: tuple, items: list) -> tuple:
    cls = type(like)
    if cls is tuple:
        return tuple(items)
    if hasattr(cls, "_fields"):  # namedtuple
        return cls(*items)
    try:
        return cls(items)
    except Exception:
        return tuple(items)


def _rebuild_dict(like: dict, items: dict) -> dict:
    cls = type(like)
    if cls is dict:
        return items
    try:
        return cls(items)
    except Exception:  # e.g. defaultdict needs its factory
        return items
