"""offcache.activations.tree without the engine: the one container walk, and plan -> rebuild round trips."""

from collections import defaultdict
from dataclasses import dataclass, field

import pytest
import torch

from offcache.activations.tree import IntermediateValue, children, collect, plan, rebuild, tensor_leaves, walk
from tests.helpers import Frozen, OrderedDict, Outer, Pair, assert_same


@dataclass
class Checked:
    """A __post_init__ that rejects the IntermediateValue placeholders plan puts in fields."""

    x: torch.Tensor

    def __post_init__(self):
        if not isinstance(self.x, torch.Tensor):
            raise TypeError("x must be a tensor")


@dataclass
class WithDerived:
    x: torch.Tensor
    n: int = field(init=False, default=0)


class MyList(list):
    pass


def round_trip(value):
    """plan, then rebuild from the collected sources: the engine left out."""
    leaves = []
    iv = plan(value, None, leaves, "value")
    sources, devices = [], []
    collect(iv, sources, devices)
    assert all(leaf._value is s for leaf, s in zip(leaves, sources))  # plan's order is rebuild's order
    assert len(sources) == len(leaves) == len(tensor_leaves(iv))
    return rebuild(iv, iter(sources))


@pytest.mark.parametrize(
    "value",
    [
        torch.randn(3),
        (torch.randn(2), 3, None),
        [torch.randn(2), [torch.randn(1), "s"]],
        {"a": torch.randn(2), "b": {"c": (torch.randn(1),)}},
        Pair(torch.randn(2), torch.randn(2)),
        Frozen(torch.randn(2), extra=("x", 1.5)),
        Outer(inner=Frozen(torch.randn(2)), items=[torch.randn(1), Pair(None, torch.randn(1))], scale=2.0),
        OrderedDict(b=torch.randn(1), a=2),
        Checked(torch.randn(2)),
        torch.Size([2, 3]),
        (torch.Size([4]), torch.float16, torch.device("cpu"), True),
    ],
    ids=lambda v: type(v).__name__,
)
def test_plan_then_rebuild_gives_the_value_back(value):
    assert_same(round_trip(value), value)


def test_derived_dataclass_fields_are_kept_without_init():
    value = WithDerived(torch.randn(2))
    value.n = 7
    got = round_trip(value)
    assert type(got) is WithDerived and got.n == 7 and torch.equal(got.x, value.x)


def test_defaultdict_falls_back_to_dict_and_list_subclass_to_list():
    d = defaultdict(list, a=torch.randn(2))
    got = round_trip(d)
    assert type(got) is dict and torch.equal(got["a"], d["a"])
    assert type(round_trip(MyList([torch.randn(1)]))) is list  # llm-compressor gives a list too


def test_model_output_keeps_its_type_and_stores_only_the_fields_that_are_set():
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    out = modeling_outputs.CausalLMOutputWithPast(logits=torch.randn(1, 2, 4), hidden_states=(torch.randn(1, 2),))
    leaves = []
    iv = plan(out, None, leaves, "value")
    stored = iv._value
    assert type(stored) is type(out) and list(stored.keys()) == ["logits", "hidden_states"]
    assert stored.loss is None and stored.past_key_values is None  # None fields are not wrapped
    got = rebuild(iv, iter([leaf._value for leaf in leaves]))
    assert type(got) is type(out) and list(got.keys()) == list(out.keys())
    assert torch.equal(got.logits, out.logits) and torch.equal(got[1][0], out.hidden_states[0])


def test_walk_is_none_for_leaves_and_children_follow_rebuild_order():
    for leaf in (torch.randn(1), torch.Size([1]), 3, "s", None, torch.float32):
        assert walk(leaf) is None
    a, b = IntermediateValue(1, None), IntermediateValue(2, None)
    assert children((a, 5, b)) == [a, b]
    assert children({"x": b, "y": a}) == [b, a]
    assert children(Frozen(a, extra=b)) == [a, b]
    assert children(a) == [a]


def test_onload_device_goes_to_every_tensor_leaf():
    dev = torch.device("cpu")
    leaves = []
    plan({"a": (torch.randn(1), [torch.randn(1)])}, dev, leaves, "value")
    assert [leaf.device for leaf in leaves] == [dev, dev]


def test_unknown_leaves_warn_once_each():
    class Thing:
        pass

    with pytest.warns(UserWarning, match="Offloading not implemented"):
        iv = plan((Thing(), torch.ones(1)), None, [], "value")
    assert isinstance(iv._value[0]._value, Thing)
    value = (Thing(),)
    with pytest.warns(UserWarning, match="Offloading not implemented"):
        iv = plan(value, None, [], "value")
    assert iv._value is value  # no tensor inside: kept as it is
