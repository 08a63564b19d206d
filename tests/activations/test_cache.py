"""IntermediatesCache: llm-compressor's API and semantics, nested values, prefetch, copies."""

import copy
import gc
import pickle
import sys
import warnings
import weakref

import pytest
import torch

import offcache
from offcache import IntermediatesCache, IntermediateValue
from offcache import engine as _engine
from offcache.activations.tree import tensor_leaves
from tests.helpers import Frozen, OrderedDict, Outer, Pair, assert_same, snapshot

try:
    from llmcompressor.pipelines.cache import IntermediatesCache as LCCache
except ImportError:  # pragma: no cover - CI installs llm-compressor
    LCCache = None

needs_llmc = pytest.mark.skipif(LCCache is None, reason="llm-compressor is not installed")
# Contracts the engine rewrite (csrc/) brings: a store is a snapshot taken at the call,
# conj/neg bits are resolved, strides are kept, fetched tensors have storages of their own.
BIG = 1 << 18  # float32 elements: 1 MiB, past the engine's packing of small values


def batch_values(seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(1, 16, 32, generator=g).to(torch.bfloat16)
    return {
        "hidden_states": h,
        "attention_mask": torch.ones(1, 1, 16, 16, dtype=torch.bool),
        "position_ids": torch.arange(16).unsqueeze(0),
        "position_embeddings": (torch.randn(1, 16, 8, generator=g), torch.randn(1, 16, 8, generator=g)),
        "use_cache": False,
        "layer_idx": 3,
        "nothing": None,
    }


def test_fetch_returns_stored_values_and_leaves_out_missing_names():
    cache = IntermediatesCache.empty(2, "cpu")
    v = batch_values(0)
    cache.update(0, v)
    assert_same(cache.fetch(0), v)
    got = cache.fetch(0, ["hidden_states", "not_there"])
    assert list(got) == ["hidden_states"]
    assert cache.fetch(1) == {}


def test_offloaded_values_are_cpu_arena_tensors_with_onload_device():
    cache = IntermediatesCache.empty(1, "cpu")
    x = torch.randn(8)
    cache.update(0, {"x": x})
    iv = cache.batch_intermediates[0]["x"]
    assert isinstance(iv, IntermediateValue)
    assert iv.value.device.type == "cpu" and iv.device == x.device
    assert _engine.is_offcache_tensor(iv.value)


def test_update_overwrites_and_delete_semantics():
    cache = IntermediatesCache.empty(1, "cpu")
    cache.update(0, {"a": torch.zeros(3), "b": torch.ones(3)})
    cache.update(0, {"a": torch.full((3,), 5.0)})
    assert torch.equal(cache.fetch(0)["a"], torch.full((3,), 5.0))
    cache.delete(0, ["a"])
    assert list(cache.fetch(0)) == ["b"]
    with pytest.raises(KeyError, match="'a'"):
        cache.delete(0, ["a"])
    cache.delete(0)
    assert cache.fetch(0) == {}


def test_append_len_and_iteration():
    cache = IntermediatesCache(None, "cpu")
    for i in range(3):
        cache.append({"i": torch.tensor([i])})
    assert len(cache) == 3
    assert [b["i"].item() for b in cache] == [0, 1, 2]


def test_bad_batch_index_names_the_number_of_batches():
    cache = IntermediatesCache.empty(3, "cpu")
    with pytest.raises(IndexError, match="3 batches"):
        cache.fetch(7)
    with pytest.raises(IndexError, match="3 batches"):
        cache.update(3, {"x": torch.zeros(1)})
    with pytest.raises(TypeError, match="int"):
        cache.fetch("0")


# ids: a parameter id "gpu" would put the test under conftest's GPU skip.
@pytest.mark.parametrize("bad", ["gpu", "cuda:99", "tpu:0", 3.5, "meta"], ids=lambda b: f"bad={b!r}")
def test_invalid_offload_device_is_rejected_at_construction(bad):
    with pytest.raises(ValueError, match="offload_device"):
        IntermediatesCache.empty(1, bad)


def test_bad_values_name_batch_and_value():
    cache = IntermediatesCache.empty(2, "cpu")
    with pytest.raises(TypeError, match=r"^batch 1, value 'mask': cannot cache a tensor with layout"):
        cache.update(1, {"mask": torch.eye(3).to_sparse()})
    with pytest.raises(ValueError, match=r"^batch 0, value 'm': cannot cache a meta tensor"):
        cache.update(0, {"m": (torch.zeros(1), torch.empty(2, device="meta"))})
    with pytest.raises(TypeError, match=r"^batch 0, value 'q': cannot cache a quantized tensor"):
        cache.update(0, {"q": torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)})
    with pytest.raises(TypeError, match=r"^batch 0, value 'n': cannot cache a nested tensor"):
        cache.update(0, {"n": torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])})
    assert cache.fetch(0) == {} and cache.fetch(1) == {}  # nothing half-stored


def test_nested_values_keep_their_types():
    h = torch.randn(2, 3)
    value = Outer(inner=Frozen(h, extra="tag"), items=[h * 2, (h, None)], scale=0.5)
    out = {
        "outer": value,
        "pair": Pair(torch.randn(4), torch.randn(4)),
        "ordered": OrderedDict(a=torch.randn(2), b=3),
        "dtype": torch.float16,
        "device": torch.device("cpu"),
        "text": "hello",
    }
    cache = IntermediatesCache.empty(1, "cpu")
    cache.update(0, out)
    got = cache.fetch(0)
    assert_same(got, out)
    assert isinstance(got["pair"], Pair) and got["pair"].cos is not None


def test_model_output_keeps_its_type():
    transformers = pytest.importorskip("transformers")
    out = transformers.modeling_outputs.BaseModelOutputWithPast(last_hidden_state=torch.randn(1, 4, 8))
    cache = IntermediatesCache.empty(1, "cpu")
    cache.update(0, {"out": out})
    got = cache.fetch(0)["out"]
    assert type(got) is type(out)
    assert torch.equal(got.last_hidden_state, out.last_hidden_state)
    assert torch.equal(got[0], out[0])


def test_unknown_leaf_types_warn_like_llmcompressor():
    class Thing:
        pass

    thing = Thing()
    cache = IntermediatesCache.empty(1, "cpu")
    with pytest.warns(UserWarning, match="Offloading not implemented"):
        cache.update(0, {"t": thing})
    assert cache.fetch(0)["t"] is thing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.update(0, {"ok": (1, 2.0, "s", None, torch.int8, torch.device("cpu"), True)})


def test_shared_tensor_is_stored_once_across_names_and_batches():
    x = torch.randn(64)
    cache = IntermediatesCache.empty(2, "cpu")
    cache.update(0, {"a": x, "b": (x, x)})
    cache.update(1, {"c": x})
    ptrs = {
        cache.batch_intermediates[0]["a"].value.data_ptr(),
        cache.batch_intermediates[1]["c"].value.data_ptr(),
    }
    assert len(ptrs) == 1
    assert cache.size() == {torch.device("cpu"): x.nbytes}


def test_in_place_edit_after_store_is_not_served_stale():
    x = torch.zeros(8)
    cache = IntermediatesCache.empty(2, "cpu")
    cache.update(0, {"x": x})
    offcache.synchronize()  # sources may be edited once their store completed
    x.fill_(3.0)
    cache.update(1, {"x": x})
    assert torch.equal(cache.fetch(0)["x"], torch.zeros(8))
    assert torch.equal(cache.fetch(1)["x"], torch.full((8,), 3.0))


def test_offload_device_none_keeps_values_in_place():
    x = torch.randn(5)
    cache = IntermediatesCache.empty(1, None)
    cache.update(0, {"x": x, "t": (x,)})
    got = cache.fetch(0)
    assert got["x"] is x and got["t"][0] is x


def test_iter_and_iter_prefetch_yield_identical_values(host_engine):
    host_engine(backend="host", host_copy_delay_us=100)
    cache = IntermediatesCache.empty(6, "cpu")
    for i in range(6):
        cache.update(i, batch_values(i))
    plain = list(cache.iter(["hidden_states", "position_embeddings", "use_cache"]))
    pre = list(cache.iter_prefetch(["hidden_states", "position_embeddings", "use_cache"]))
    assert len(plain) == len(pre) == 6
    for a, b in zip(plain, pre):
        assert_same(b, a)
    assert list(IntermediatesCache.empty(0, "cpu").iter_prefetch()) == []


def test_iter_prefetch_runs_at_most_one_batch_ahead(host_engine):
    cache = IntermediatesCache.empty(5, "cpu")
    for i in range(5):
        cache.update(i, {"x": torch.full((4,), float(i))})
    start = offcache.stats()["fetches"]
    for i, batch in enumerate(cache.iter_prefetch()):
        fetched = offcache.stats()["fetches"] - start
        assert fetched == min(i + 2, 5)  # this batch and the next, never more
        assert torch.equal(batch["x"], torch.full((4,), float(i)))


def test_from_dataloader_records_model_device():
    data = [{"input_ids": torch.arange(4) + i, "mask": torch.ones(4)} for i in range(3)]
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    cache = IntermediatesCache.from_dataloader(loader, torch.device("cpu"), torch.device("cpu"))
    assert len(cache) == 3
    assert cache.batch_intermediates[1]["input_ids"].device == torch.device("cpu")
    assert torch.equal(cache.fetch(2)["input_ids"], torch.arange(4) + 2)


def test_offload_and_onload_value_classmethods():
    v = (torch.randn(3), {"k": torch.randn(2)})
    iv = IntermediatesCache._offload_value(v, torch.device("cpu"))
    assert isinstance(iv, IntermediateValue) and iv.device is None
    assert_same(IntermediatesCache._onload_value(iv), v)


def test_hand_built_batch_intermediates_are_fetched():
    x = torch.randn(4)
    cache = IntermediatesCache([{"x": IntermediateValue(value=x, device=torch.device("cpu"))}], "cpu")
    assert torch.equal(cache.fetch(0)["x"], x)


def test_gc_of_a_cache_returns_pinned_bytes(host_engine):
    cache = IntermediatesCache.empty(8, "cpu")
    for i in range(8):
        cache.update(i, batch_values(i))
    offcache.synchronize()
    assert offcache.stats()["pinned_in_use_bytes"] > 0
    del cache
    offcache.synchronize()
    assert offcache.stats()["pinned_in_use_bytes"] == 0


@needs_llmc
def test_same_results_and_sizes_as_llmcompressor():
    ours, theirs = IntermediatesCache.empty(3, "cpu"), LCCache.empty(3, "cpu")
    for i in range(3):
        v = batch_values(i)
        ours.update(i, v)
        theirs.update(i, v)
    ours.delete(1, ["position_ids"])
    theirs.delete(1, ["position_ids"])
    for names in (None, ["hidden_states", "position_embeddings", "x"]):
        for a, b in zip(ours.iter(names), theirs.iter(names)):
            assert_same(a, b)
        for a, b in zip(ours.iter_prefetch(names), theirs.iter_prefetch(names)):
            assert_same(a, b)
    assert ours.size() == theirs.size()


# size() ---------------------------------------------------------------------------------------


def size_cases():
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    shared = torch.randn(5)
    return {
        "torch.Size": torch.Size([2, 3]),
        "empty torch.Size": torch.Size([]),
        "sizes in a tuple": (torch.Size([4]), torch.Size([1, 1])),
        "ModelOutput with None fields": modeling_outputs.BaseModelOutputWithPast(last_hidden_state=torch.randn(1, 4)),
        "ModelOutput, first field None": modeling_outputs.CausalLMOutputWithPast(
            logits=torch.randn(1, 2), hidden_states=(shared, shared)
        ),
        "dataclasses": Outer(inner=Frozen(shared, extra=None), items=[shared * 2, (shared, None)], scale=0.5),
        "nested tuples": ((torch.randn(2), (1, "s")), [None, 2.5], ()),
        "namedtuple": Pair(torch.randn(3), None),
        "plain leaves": (7, "text", 1.5, True, None, torch.float16, torch.device("cpu")),
        "dict": {"a": shared, "b": {"c": 3}},
        "shared tensor": shared,
    }


@needs_llmc
def test_size_matches_llmcompressor_value_by_value_and_together():
    cases = size_cases()
    for name, value in cases.items():
        ours, theirs = IntermediatesCache.empty(1, "cpu"), LCCache.empty(1, "cpu")
        ours.update(0, {name: value})
        theirs.update(0, {name: value})
        assert ours.size() == theirs.size(), name
    ours, theirs = IntermediatesCache.empty(2, "cpu"), LCCache.empty(2, "cpu")
    for i in range(2):
        ours.update(i, cases)
        theirs.update(i, cases)
    assert ours.size() == theirs.size()


# Tensor subclasses ------------------------------------------------------------------------------


def two_tensor_cls():
    return pytest.importorskip("torch.testing._internal.two_tensor").TwoTensor


def test_wrapper_subclass_is_stored_as_its_inner_tensors():
    TwoTensor = two_tensor_cls()
    a, b = torch.randn(BIG), torch.randn(BIG)
    tt = TwoTensor(a, b)
    cache = IntermediatesCache.empty(1, "cpu")
    cache.update(0, {"tt": tt, "again": (tt, 3)})
    leaves = [leaf.value for leaf in tensor_leaves(cache.batch_intermediates[0]["tt"])]
    assert len(leaves) == 2 and all(type(t) is torch.Tensor and _engine.is_offcache_tensor(t) for t in leaves)
    got = cache.fetch(0)
    for t in (got["tt"], got["again"][0]):
        assert type(t) is TwoTensor and t.shape == tt.shape
        assert torch.equal(t.a, a) and torch.equal(t.b, b)
    assert cache.size() == {torch.device("cpu"): a.nbytes + b.nbytes + sys.getsizeof(3, 0)}  # what it is stored as


def test_small_and_nested_wrapper_subclasses_round_trip():
    # TwoTensor wants its inner tensors at equal storage offsets: small fetched values
    # share one packed buffer today, so this needs fetched tensors with storages of their own.
    TwoTensor = two_tensor_cls()
    a, b, c, d = (torch.randn(4) for _ in range(4))
    nested = TwoTensor(TwoTensor(a, b), TwoTensor(c, d))
    cache = IntermediatesCache.empty(1, "cpu")
    cache.update(0, {"n": nested})
    got = cache.fetch(0)["n"]
    assert type(got) is TwoTensor and type(got.a) is TwoTensor
    assert all(torch.equal(x, y) for x, y in [(got.a.a, a), (got.a.b, b), (got.b.a, c), (got.b.b, d)])


def test_wrapper_subclass_with_offload_device_none_keeps_its_inner_tensors():
    TwoTensor = two_tensor_cls()
    tt = TwoTensor(torch.randn(3), torch.randn(3))
    cache = IntermediatesCache.empty(1, None)
    cache.update(0, {"tt": tt})
    got = cache.fetch(0)["tt"]
    assert type(got) is TwoTensor and got.a is tt.a and got.b is tt.b


class Tagged(torch.Tensor):
    """A plain subclass: its own storage, torch's dispatch."""


def test_parameters_and_plain_subclasses_keep_their_type_flags_and_attributes():
    # llm-compressor gives a Parameter back as itself on the CPU (Tensor.to is a no-op) and
    # as a plain tensor after a device move; offcache always gives a Parameter (a copy).
    p = torch.nn.Parameter(torch.randn(3))
    p.tag = "weight"
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    tagged = torch.randn(4).as_subclass(Tagged)
    cache = IntermediatesCache.empty(1, "cpu")
    cache.update(0, {"p": p, "frozen": frozen, "tagged": [tagged]})
    got = cache.fetch(0)
    assert type(got["p"]) is torch.nn.Parameter and got["p"].requires_grad and got["p"].tag == "weight"
    assert type(got["frozen"]) is torch.nn.Parameter and not got["frozen"].requires_grad
    assert type(got["tagged"][0]) is Tagged
    assert torch.equal(got["p"].detach(), p.detach()) and torch.equal(got["tagged"][0], tagged)
    assert got["p"] is not p and got["p"].data_ptr() != p.data_ptr()
    assert cache.size() == {torch.device("cpu"): p.nbytes + frozen.nbytes + tagged.nbytes}
    kept = IntermediatesCache.empty(1, None)
    kept.update(0, {"p": p})
    assert kept.fetch(0)["p"] is p  # not moved: the object itself, like llm-compressor


class Dispatching(torch.Tensor):
    """Overrides __torch_dispatch__ without __tensor_flatten__: its data cannot be reached safely."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_untraceable_subclasses_and_freed_storages_are_refused_before_anything_is_stored():
    cache = IntermediatesCache.empty(2, "cpu")
    offcache.synchronize()
    stores = offcache.stats()["stores"]
    with pytest.raises(TypeError, match=r"^batch 1, value 'd': cannot cache a tensor of subclass .*Dispatching"):
        cache.update(1, {"ok": torch.randn(3), "d": (torch.randn(2), torch.randn(3).as_subclass(Dispatching))})
    jagged = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)], layout=torch.jagged)
    with pytest.raises(TypeError, match=r"^batch 0, value 'j': cannot cache a tensor with layout torch.jagged"):
        cache.update(0, {"j": jagged})  # a traceable subclass, refused as a nested tensor
    freed = torch.randn(4)
    freed.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match=r"^batch 0, value 'f': cannot cache a tensor whose storage holds 0 bytes"):
        cache.update(0, {"ok": torch.randn(3), "f": freed})
    base = torch.randn(8)
    tail = base[4:]
    base.untyped_storage().resize_(16)  # the view now reaches past its storage
    with pytest.raises(ValueError, match=r"storage holds 16 bytes but the tensor needs 32"):
        cache.update(0, {"t": tail})
    assert cache.fetch(0) == {} and cache.fetch(1) == {}
    assert offcache.stats()["stores"] == stores  # nothing reached the engine
    empty = torch.randn(4)[:0]
    empty.untyped_storage().resize_(0)
    cache.update(0, {"e": empty})  # zero-size: nothing to read
    assert cache.fetch(0)["e"].shape == (0,)


# Copies of a cache -------------------------------------------------------------------------------


def copy_of(cache, how):
    return copy.deepcopy(cache) if how == "deepcopy" else pickle.loads(pickle.dumps(cache))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_hold_the_stored_values_even_while_stores_are_in_flight(host_engine, how):
    host_engine(backend="host", host_copy_delay_us=2000)  # copied while the stores still run
    shared = torch.randn(64)
    values = [{**batch_values(i), "shared": shared, "out": Outer(Frozen(shared), [shared], 2.0)} for i in range(3)]
    cache = IntermediatesCache.empty(3, "cpu")
    for i, v in enumerate(values):
        cache.update(i, v)
    dup = copy_of(cache, how)
    for i, v in enumerate(values):
        assert_same(dup.fetch(i), v)
    ours = dup.batch_intermediates[0]["hidden_states"].value
    assert _engine.is_offcache_tensor(ours)  # stored again, in the arena
    assert ours.data_ptr() != cache.batch_intermediates[0]["hidden_states"].value.data_ptr()
    leaves = [dup.batch_intermediates[i]["shared"]._value for i in range(3)]
    assert all(t is leaves[0] for t in leaves)  # still shared, so still counted once
    assert dup.size() == cache.size()
    dup.delete(0)
    dup.batch_intermediates[1]["hidden_states"].value.zero_()
    assert_same(cache.fetch(0), values[0])
    assert_same(cache.fetch(1), values[1])


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_of_subclasses_model_outputs_and_unmoved_values(how):
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    TwoTensor = two_tensor_cls()
    values = {
        "tt": TwoTensor(torch.randn(BIG), torch.randn(BIG)),
        "p": torch.nn.Parameter(torch.randn(3)),
        "mo": modeling_outputs.BaseModelOutputWithPast(last_hidden_state=torch.randn(1, 4)),
        "size": torch.Size([2]),
    }
    cache = IntermediatesCache.empty(1, "cpu")
    cache.update(0, values)
    got = copy_of(cache, how).fetch(0)
    assert type(got["tt"]) is TwoTensor and torch.equal(got["tt"].b, values["tt"].b)
    assert type(got["p"]) is torch.nn.Parameter and torch.equal(got["p"].detach(), values["p"].detach())
    assert type(got["mo"]) is type(values["mo"]) and list(got["mo"].keys()) == ["last_hidden_state"]
    assert got["size"] == torch.Size([2])
    kept = IntermediatesCache.empty(1, None)
    x = torch.randn(3)
    kept.update(0, {"x": x})
    y = copy_of(kept, how).fetch(0)["x"]
    assert y is not x and torch.equal(y, x) and not _engine.is_offcache_tensor(y)


def test_intermediate_value_copies():
    iv = IntermediatesCache._offload_value((torch.randn(3), 2), torch.device("cpu"))
    shallow = copy.copy(iv)
    assert shallow is not iv and shallow._value is iv._value
    deep = copy.deepcopy(iv)
    assert deep._value is not iv._value and deep._value[0].value is not iv._value[0].value
    assert_same(IntermediatesCache._onload_value(deep), IntermediatesCache._onload_value(iv))


def test_edits_of_fetched_tensors_do_not_reach_the_cache():
    values = batch_values(0)
    cache = IntermediatesCache.empty(1, "cpu")
    cache.update(0, values)
    got = cache.fetch(0)
    got["hidden_states"].add_(1)
    got["position_embeddings"][0].zero_()
    got["attention_mask"].logical_not_()
    assert_same(cache.fetch(0), values)


# The snapshot contract (engine rewrite) -------------------------------------------------------------


def test_edits_right_after_update_do_not_change_what_is_fetched(host_engine):
    host_engine(backend="host", host_copy_delay_us=2000)
    x, y = torch.zeros(4096), torch.zeros(BIG)
    cache = IntermediatesCache.empty(1, "cpu")
    cache.update(0, {"x": x, "t": (y,)})
    x.fill_(1.0)  # no synchronize(): the store is a snapshot taken at the call
    y.fill_(1.0)
    got = cache.fetch(0)
    assert torch.equal(got["x"], torch.zeros(4096)) and torch.equal(got["t"][0], torch.zeros(BIG))
    assert torch.equal(cache.batch_intermediates[0]["x"].value, torch.zeros(4096))


def test_conj_and_neg_views_are_stored_as_the_values_they_show():
    z = torch.randn(5, dtype=torch.complex64)
    values = {"conj": z.conj(), "neg": torch._neg_view(torch.randn(5)), "both": (torch._neg_view(z.conj()),)}
    want = snapshot(values)
    cache = IntermediatesCache.empty(1, "cpu")
    cache.update(0, values)
    assert_same(cache.fetch(0), want)


def test_channels_last_tensors_keep_their_strides():
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    cache = IntermediatesCache.empty(1, "cpu")
    cache.update(0, {"x": x})
    got = cache.fetch(0)["x"]
    assert torch.equal(got, x) and got.stride() == x.stride()


def test_data_swap_is_not_served_from_the_dedup_table():
    # `x.data = other` keeps x's identity and version counter but swaps its storage.
    x = torch.zeros(8)
    cache = IntermediatesCache.empty(2, "cpu")
    cache.update(0, {"x": x})
    offcache.synchronize()
    x.data = torch.ones(3, dtype=torch.float64)
    cache.update(1, {"x": x})
    assert torch.equal(cache.fetch(0)["x"], torch.zeros(8))
    assert_same(cache.fetch(1)["x"], torch.ones(3, dtype=torch.float64))


# Issue 17 item 18: a transformers config travels between subgraphs (sequential_targets=["Linear"]).
CONFIGS = ["Qwen3MoeConfig", "Phi3Config", "LlamaConfig", "MixtralConfig", "Qwen2MoeConfig", "Gemma3Config"]


@pytest.mark.parametrize("name", CONFIGS)
def test_a_model_config_comes_back_as_the_same_object(engine, name):
    import transformers

    config = getattr(transformers, name)()
    cache = IntermediatesCache.empty(2, "cpu")
    x = torch.randn(3, 4)
    cache.update(0, {"config": config, "hidden_states": x})
    cache.update(1, {"kwargs": {"config": config, "mask": x > 0}, "meta": (config.to_dict(), [1, "a"])})
    got, other = cache.fetch(0), cache.fetch(1)
    assert got["config"] is config and torch.equal(got["hidden_states"], x)
    assert other["kwargs"]["config"] is config and torch.equal(other["kwargs"]["mask"], x > 0)
    assert other["meta"] is cache.batch_intermediates[1]["meta"].value  # no tensor inside: kept as given
    text = config.get_text_config()
    for attr in ("num_local_experts", "num_experts", "hidden_size"):  # attribute maps and properties still work
        if hasattr(text, attr):
            assert getattr(got["config"].get_text_config(), attr) == getattr(text, attr)
    assert list(cache.iter_prefetch())[0]["config"] is config


def test_containers_that_hold_tensors_are_rebuilt_and_the_rest_kept(engine):
    shared = {"a": [1, 2], "b": "text"}
    value = {"plain": shared, "mixed": (shared, torch.ones(2)), "empty": []}
    cache = IntermediatesCache.empty(1, "cpu")
    cache.update(0, {"v": value})
    got = cache.fetch(0)["v"]
    assert got is not value and got["mixed"] is not value["mixed"]  # holds a tensor: a new container
    assert got["plain"] is shared and got["mixed"][0] is shared and got["empty"] is value["empty"]
    assert torch.equal(got["mixed"][1], torch.ones(2))


def test_a_dropped_fetch_result_dies_at_once(host_engine):
    # The engine's ledger of copies in flight held every fetch's outputs until its next call.
    cache = IntermediatesCache.empty(1, "cpu")
    cache.update(0, {"x": torch.randn(1000), "y": torch.randn(10)})
    out = cache.fetch(0, ["x"])["x"]
    r = weakref.ref(out)
    del out
    gc.collect()
    assert r() is None
    for batch in cache.iter_prefetch(["x", "y"]):  # fetched ahead, then waited for by ticket
        refs = [weakref.ref(v) for v in batch.values()]
    del batch
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_fetch_ticket_seen_complete_releases_the_outputs(host_engine):
    cpu = torch.device("cpu")
    stored = _engine.store([torch.randn(100), torch.randn(3)], cpu)
    for see in ("wait", "query"):
        outs, ticket = _engine.fetch(stored, cpu, False)
        refs = [weakref.ref(o) for o in outs]
        if see == "wait":
            ticket.wait()
        else:
            while not ticket.query():
                pass
        del outs
        gc.collect()
        assert all(r() is None for r in refs), see


def test_a_host_limit_error_subclass_that_takes_other_arguments_still_names_the_batch(monkeypatch):
    """The message is rebuilt in the engine's HostLimitError when the raised type cannot take it (the
    fallback once named a class that did not exist, an AttributeError instead of the error)."""

    class Picky(offcache.HostLimitError):
        def __init__(self, needed: int, why: str):
            super().__init__(f"{why} ({needed} bytes)")

    def refuse(values, device, allow_spill=True):
        raise Picky(4096, "over the host limit")

    monkeypatch.setattr(_engine, "store", refuse)
    cache = IntermediatesCache.empty(2, torch.device("cpu"))
    with pytest.raises(offcache.HostLimitError) as info:
        cache.update(1, {"hidden": torch.ones(4)})
    assert type(info.value) is offcache.HostLimitError
    assert "batch 1" in str(info.value) and "over the host limit (4096 bytes)" in str(info.value)
