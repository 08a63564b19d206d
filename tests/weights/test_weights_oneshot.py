"""Integration: llm-compressor's real oneshot with the model's weights on offcache (weights=True).

The sequential pipeline offloads every module's weights to the CPU (``set_onload_device``);
with ``patch_llmcompressor(weights=True)`` those offloads are offcache's. GPTQ W4A16 and AWQ
must give weights bit-identical to llm-compressor as shipped, with and without sequential
prefetch, on the host backend and with the disk tier forced; and the weights must really
have gone through the engine (counters), with prefetch hits after the first subgraph.
"""

import pytest
import torch

llmcompressor = pytest.importorskip("llmcompressor")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

import offcache  # noqa: E402
from offcache.weights import compressed_tensors as oc_ct  # noqa: E402  (imports compressed-tensors)
from tests.conftest import ENGINE_CONFIGS  # noqa: E402
from tests.helpers import calibration_set  # noqa: E402

pytestmark = pytest.mark.slow


def recipe(kind):
    if kind == "gptq":
        from llmcompressor.modifiers.quantization import GPTQModifier

        return GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])
    from llmcompressor.modifiers.awq import AWQModifier

    return AWQModifier(targets="Linear", scheme="W4A16_ASYM", ignore=["lm_head"], duo_scaling=False, n_grid=3)


def quantize(model_dir, kind, prefetch):
    from llmcompressor import oneshot

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # The weights in the process's own memory: onloaded to the CPU, a checkpoint's mapping stays
    # as is and never reaches the engine (tests/weights/memory/test_past_ram.py).
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=calibration_set(4, 16),
        recipe=recipe(kind),
        num_calibration_samples=4,
        max_seq_length=16,
        pipeline="sequential",
        shuffle_calibration_samples=False,
        sequential_prefetch=prefetch,
    )
    caches = {type(m._parameters).__name__ for m in model.modules()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, caches


@pytest.fixture(scope="module")
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-identical runs
    yield
    torch.set_num_threads(threads)


_references: dict = {}


def reference(model_dir, kind, prefetch):
    """llm-compressor as shipped (its caches, its weight offloading), once per recipe and prefetch.

    AWQ as shipped pins its activations (``IntermediatesCache.pin_memory``), which needs a GPU:
    without one its reference keeps compressed-tensors' weight offloading and takes offcache's
    activation cache (bit-identical to llm-compressor's, tests/test_llmcompressor_oneshot.py),
    so that what differs is the weights' path alone.
    """
    key = (kind, prefetch)
    if key not in _references:
        offcache.unpatch_llmcompressor()
        if kind == "awq" and not torch.cuda.is_available():
            offcache.patch_llmcompressor(weights=False)
        try:
            state, caches = quantize(model_dir, kind, prefetch)
        finally:
            offcache.unpatch_llmcompressor()
        assert caches >= {"CPUCache"} and "OffcacheCPUCache" not in caches
        _references[key] = state
    return _references[key]


def assert_bit_identical(ours, want):
    assert want.keys() == ours.keys()
    assert any("weight_scale" in k for k in ours), "the model was not quantized"
    for k in want:
        assert want[k].dtype == ours[k].dtype, k
        assert torch.equal(want[k], ours[k]), f"{k} differs"


@pytest.mark.parametrize(
    "kind, prefetch, config",
    [
        ("gptq", False, "host"),
        ("gptq", True, "host"),
        ("gptq", False, "host-disk"),
        ("gptq", True, "host-disk"),
        ("awq", False, "host"),
        ("awq", True, "host-disk"),
    ],
)
def test_oneshot_weights_bit_identical(tiny_model_dir, single_thread, engine_config, kind, prefetch, config):
    want = reference(tiny_model_dir, kind, prefetch)
    engine_config(**ENGINE_CONFIGS[config])
    before = offcache.stats()
    offcache.patch_llmcompressor(weights=True)
    try:
        ours, caches = quantize(tiny_model_dir, kind, prefetch)
        history = oc_ct.subgraph_stats()
    finally:
        offcache.unpatch_llmcompressor()
    after = offcache.stats()
    assert "OffcacheCPUCache" in caches and "CPUCache" not in caches
    assert_bit_identical(ours, want)
    assert after["weight_onload_bytes"] > before["weight_onload_bytes"]
    assert after["weight_writeback_bytes"] > before["weight_writeback_bytes"], "no update_offload reached us"
    if config == "host-disk":
        assert after["disk_write_bytes"] > before["disk_write_bytes"], "the disk tier was not used"
    # The pipeline's subgraphs (3 layers + the head): after the first, every onload is a prefetch hit.
    subgraphs = [s for s in history if s["index"] is not None]
    assert [s["index"] for s in subgraphs] == list(range(len(subgraphs))) and len(subgraphs) >= 4
    assert subgraphs[0]["misses"] > 0
    for s in subgraphs[1:]:
        # AWQ's disable_lm_head() reads lm_head.weight (a module of no subgraph) once per subgraph.
        assert s["hits"] > 0 and s["misses"] <= (1 if kind == "awq" else 0), s
        assert s["host_waits"] <= s["misses"], s


def load_to_disk(model_dir, offload_dir):
    """A model offloaded to disk the way a user does it: compressed-tensors' load_offloaded_model."""
    from compressed_tensors.offload import load_offloaded_model

    with load_offloaded_model():
        return transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, device_map="auto_offload", max_memory={"cpu": 0},
            offload_folder=str(offload_dir),
        )  # fmt: skip


def quantize_model(model, model_dir):
    from llmcompressor import oneshot

    torch.manual_seed(0)
    oneshot(
        model=model,
        tokenizer=transformers.AutoTokenizer.from_pretrained(model_dir),
        dataset=calibration_set(4, 16),
        recipe=recipe("gptq"),
        num_calibration_samples=4,
        max_seq_length=16,
        pipeline="sequential",
        shuffle_calibration_samples=False,
    )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_oneshot_disk_offloaded_model_bit_identical_and_saved(tiny_model_dir, single_thread, host_engine, tmp_path):
    import os

    from compressed_tensors.offload.cache import DiskCache
    from safetensors.torch import load_file

    offcache.unpatch_llmcompressor()
    model = load_to_disk(tiny_model_dir, tmp_path / "theirs")
    assert "DiskCache" in {type(m._parameters).__name__ for m in model.modules()}
    want = quantize_model(model, tiny_model_dir)
    del model

    offcache.patch_llmcompressor(weights=True)
    try:
        model = load_to_disk(tiny_model_dir, tmp_path / "ours")
        caches = {type(m._parameters).__name__ for m in model.modules()}
        assert "OffcacheDiskCache" in caches and "DiskCache" not in caches
        links = [f for f in os.listdir(tmp_path / "ours") if os.path.islink(tmp_path / "ours" / f)]
        assert links, "the checkpoint's tensors are symlinked, as from_accelerate makes them"
        before = offcache.stats()
        ours = quantize_model(model, tiny_model_dir)
        after = offcache.stats()
        assert after["weight_onload_bytes"] > before["weight_onload_bytes"]
        # No copy of the checkpoint: every symlink left points at it, nothing went to offcache's disk tier.
        for f in os.listdir(tmp_path / "ours"):
            path = tmp_path / "ours" / f
            if os.path.islink(path):
                assert os.path.realpath(path) == str((tiny_model_dir / "model.safetensors").resolve())
        assert after["disk_write_bytes"] == before["disk_write_bytes"]
        disk_caches = [m._parameters for m in model.modules() if type(m._parameters).__name__ == "OffcacheDiskCache"]
        assert all(p in DiskCache.index for c in disk_caches for p in c.offloaded_values.values() if p is not None)
        model.save_pretrained(tmp_path / "saved", save_compressed=False)
    finally:
        offcache.unpatch_llmcompressor()
    assert_bit_identical(ours, want)
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    for k, v in saved.items():
        assert torch.equal(v, ours[k]), f"saved {k} is not the updated value"


def test_cpu_offloaded_model_saved_with_updated_weights(tiny_model_dir, single_thread, host_engine, tmp_path):
    from safetensors.torch import load_file

    offcache.patch_llmcompressor(weights=True)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        ours = quantize_model(model, tiny_model_dir)
        model.save_pretrained(tmp_path / "saved", save_compressed=False)
    finally:
        offcache.unpatch_llmcompressor()
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert any("weight_scale" in k for k in saved)
    for k, v in saved.items():
        assert torch.equal(v, ours[k]), f"saved {k} is not the updated value"
