"""Issue 43: a memory limit too small for even one subgraph's weights plus activations is a clear error at the
start of the sequential pipeline (SubgraphMemoryError naming the subgraph, the bytes and the limit)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("llmcompressor")
transformers = pytest.importorskip("transformers")

from offcache.weights.memory import fit  # noqa: E402
from tests.helpers import calibration_set  # noqa: E402

MiB = 1 << 20


class _Subgraph:
    def __init__(self, *modules):
        self.modules = list(modules)

    def submodules(self, model, recurse=True):
        return [m for top in self.modules for m in top.modules()]


def _model(offloaded: bool = True):
    from compressed_tensors.offload import offload_module

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 1024))  # 257 KiB, 1.0 MiB
    model.config = transformers.PretrainedConfig(hidden_size=256)
    if offloaded:
        for layer in model:
            offload_module(layer, "cpu", "cpu")
    return model


def test_weights_not_offloaded_are_resident_already_and_count_nothing():
    model = _model(offloaded=False)
    sample = {"input_ids": torch.zeros(1, 16, dtype=torch.long)}
    fit.check([_Subgraph(model[1])], model, sample, room=lambda device: (fit.activation_bytes(model, sample), "x"))
    assert fit._weights(model.modules()) == {}
    assert fit._weights(_model().modules()) == {torch.device("cpu"): sum(p.nbytes for p in model.parameters())}


def test_the_first_subgraph_too_large_is_named_with_its_bytes_and_the_limit():
    model = _model()
    subgraphs = [_Subgraph(model[0]), _Subgraph(model[1])]
    sample = {"input_ids": torch.zeros(1, 16, dtype=torch.long)}
    acts = fit.activation_bytes(model, sample)
    assert acts == 2 * 16 * 256 * 4
    weights = sum(p.nbytes for p in model[1].parameters())
    fit.check(subgraphs, model, sample, room=lambda device: (weights + acts, "a test's limit"))  # fits exactly
    with pytest.raises(fit.SubgraphMemoryError) as err:
        fit.check(subgraphs, model, sample, room=lambda device: (weights + acts - 1, "a test's limit"))
    text = str(err.value)
    assert "subgraph 1 of 2 (1)" in text and f"needs {weights + acts} bytes (" in text and "on cpu:" in text
    assert f"{weights} bytes" in text and f"{acts} bytes (32KiB) of activations" in text and "a test's limit" in text


def test_host_room_is_the_limit_less_anonymous_memory(monkeypatch):
    monkeypatch.setattr(fit._machine, "usable_memory_bytes", lambda: 10 * MiB)
    monkeypatch.setattr(fit._machine, "cgroup_memory_limit", lambda proc="/proc/self": 10 * MiB)
    monkeypatch.setattr(fit, "_anon_bytes", lambda: 4 * MiB)
    have, what = fit.host_room()
    assert have == 6 * MiB and what.startswith("the cgroup's limit 10485760 bytes") and "4194304 bytes" in what
    monkeypatch.setattr(fit, "_anon_bytes", lambda: 40 * MiB)
    assert fit.host_room()[0] == 0
    assert fit._anon_bytes.__name__ == "<lambda>" and 0 < _real_anon() < 1 << 40


def _real_anon() -> int:
    import importlib

    return importlib.reload(fit)._anon_bytes()


def test_oneshot_under_a_limit_below_one_subgraph_fails_at_the_start(tiny_model_dir, host_engine, monkeypatch):
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    import offcache
    from offcache.weights import compressed_tensors as oc_ct

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    calibrated = []
    monkeypatch.setattr(fit, "host_room", lambda: (64 << 10, "a 64 KiB test limit"))
    offcache.patch_llmcompressor(weights=True)
    try:
        first_layer = r"subgraph 1 of \d+ \(model\.layers\.0, \.\.\.\) needs .*a 64 KiB test limit"
        with pytest.raises(fit.SubgraphMemoryError, match=first_layer):
            oneshot(
                model=model, tokenizer=transformers.AutoTokenizer.from_pretrained(tiny_model_dir),
                dataset=calibration_set(2, 8), recipe=QuantizationModifier(targets="Linear", scheme="FP8",
                ignore=["lm_head"]), num_calibration_samples=2, max_seq_length=8, pipeline="sequential",
            )  # fmt: skip
        calibrated = [s for s in oc_ct.subgraph_stats() if s["index"] is not None]
    finally:
        offcache.unpatch_llmcompressor()
    assert calibrated == [], "a subgraph ran before the error"
