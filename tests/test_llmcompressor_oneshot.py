"""Integration: llm-compressor's real sequential pipeline with offcache patched in.

A tiny random Llama and a tokenizer are built in the test (no hub access).
GPTQ W4A16 through `oneshot(pipeline="sequential")` must give bit-identical
weights with and without the patch, with and without sequential prefetch.
"""

import pytest
import torch

import offcache
from tests.helpers import calibration_set

llmcompressor = pytest.importorskip("llmcompressor")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.slow


def quantize(model_dir, prefetch):
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=calibration_set(6, 24),
        recipe=GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
        num_calibration_samples=6,
        max_seq_length=24,
        pipeline="sequential",
        shuffle_calibration_samples=False,
        sequential_prefetch=prefetch,
    )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("prefetch", [False, True], ids=["iter", "iter_prefetch"])
def test_gptq_weights_bit_identical_with_offcache(tiny_model_dir, prefetch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        offcache.unpatch_llmcompressor()
        reference = quantize(tiny_model_dir, prefetch)
        patched = offcache.patch_llmcompressor()
        assert "llmcompressor.pipelines.sequential.pipeline" in patched
        stores = offcache.stats()["stores"]
        ours = quantize(tiny_model_dir, prefetch)
        assert offcache.stats()["stores"] > stores, "offcache's cache was not used"
    finally:
        offcache.unpatch_llmcompressor()
        torch.set_num_threads(threads)
    assert reference.keys() == ours.keys()
    assert any("weight_scale" in k for k in ours), "the model was not quantized"
    for k in reference:
        assert reference[k].dtype == ours[k].dtype, k
        assert torch.equal(reference[k], ours[k]), f"{k} differs"


def test_patch_is_idempotent_and_reversible():
    from llmcompressor.modifiers.transform.awq import base as awq
    from llmcompressor.pipelines import cache as lc_cache
    from llmcompressor.pipelines.sequential import pipeline as seq

    original = lc_cache.IntermediatesCache
    offcache.patch_llmcompressor()
    offcache.patch_llmcompressor()
    try:
        for module in (lc_cache, seq, awq):
            assert module.IntermediatesCache is offcache.IntermediatesCache
    finally:
        offcache.unpatch_llmcompressor()
    for module in (lc_cache, seq, awq):
        assert module.IntermediatesCache is original


def test_the_planners_cache_peak_matches_the_measured_one(tiny_model_dir, engine_config):
    import offcache.plan as plan

    engine_config(backend="host")  # a fresh engine: its peaks are this run's
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        offcache.patch_llmcompressor()
        quantize(tiny_model_dir, prefetch=False)
    finally:
        offcache.unpatch_llmcompressor()
        torch.set_num_threads(threads)
    s = offcache.stats()
    measured = s["peak_pinned_in_use_bytes"] + s["peak_pageable_bytes"]
    config = transformers.AutoConfig.from_pretrained(tiny_model_dir)
    predicted = plan.estimate(config, samples=6, seq_len=24, dtype="float32", onload="cpu").cache_peak_bytes
    assert abs(predicted - measured) <= 0.1 * measured, (predicted, measured)


def test_the_early_warning_fires_at_the_first_batch_of_the_sequential_pipeline(tiny_model_dir, engine_config):
    import warnings

    # Subgraph 0 stores 20928 bytes per batch: 6 batches cannot fit 64 KiB with no disk tier.
    engine_config(backend="host", pinned_limit="64KiB", min_chunk="64KiB", host_limit="64KiB", disk_dir="none")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            offcache.patch_llmcompressor()
            try:
                quantize(tiny_model_dir, prefetch=False)
            except offcache.HostLimitError:  # an engine that holds the host limit stops the run later
                assert hasattr(offcache._C, "HostLimitError")
    finally:
        offcache.unpatch_llmcompressor()
        torch.set_num_threads(threads)
    capacity = [w for w in record if issubclass(w.category, offcache.CapacityWarning)]
    assert len(capacity) == 1, [str(w.message) for w in record]
    text = str(capacity[0].message)
    assert "batch 0's values" in text and f"for 6 batches that is {6 * 20928} bytes" in text
    assert "OFFCACHE_DISK_DIR" in text and "OFFCACHE_HOST_LIMIT" in text
