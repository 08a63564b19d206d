"""What each subgraph of llm-compressor's sequential pipeline stores, taken from the model itself.

The model is built from its config on the meta device (no memory, no weights), traced with
llm-compressor's own ``trace_subgraphs`` (the same sequential targets, ignore list and targets
per subgraph as the pipeline) and its subgraphs run on meta tensors, in order, under
llm-compressor's ``calibration_forward_context``: what crosses each boundary has its true
names, shapes and dtypes, for any architecture the pipeline can trace, with nothing written
per family. The names each subgraph consumes are the pipeline's own (``consumed_names``).

A sequential target whose forward cannot run on meta tensors (a data-dependent op, e.g. an
MoE router's ``nonzero`` or a kernel meta-registered for some dtypes only) is taken to
return a tensor shaped like its hidden-states input, as transformers' decoder layers do; the
trace says so in its ``notes``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from offcache.activations.tree import walk

Leaf = tuple[tuple[int, int], int]  # ((subgraph, tensor number), bytes): a tensor stored twice has one key


@dataclass
class SubgraphValues:
    """One subgraph of one batch shape: what it reads, what it stores, what is deleted after it."""

    input_names: list[str]
    consumed_names: list[str]
    outputs: dict[str, list[Leaf]]  # name -> its tensors (identity, bytes); empty for the last subgraph
    targets: list[str]  # the sequential targets it runs (module names)
    weight_bytes: int  # parameters and buffers of the modules it runs, in the model's dtype
    shapes: dict[str, str] = field(default_factory=dict)  # name -> its tensors' shapes and dtypes


@dataclass
class Traced:
    """A model traced as the sequential pipeline traces it; `run(batch, seq)` gives the boundaries."""

    model: Any
    subgraphs: list
    dtype: torch.dtype
    sequential_targets: list[str]
    target_names: set[str] = field(default_factory=set)  # the modules the targets match
    notes: list[str] = field(default_factory=list)
    weight_bytes_total: int = 0
    walked_bytes: int = 0  # the weights of every module some subgraph runs, each once
    run_dtype: torch.dtype | None = None  # the meta model's dtype when it is not `dtype` (see trace())
    stand_ins: bool = True  # whether a target that cannot run on meta tensors is stood in for
    _cache: dict = field(default_factory=dict)

    def run(self, batch: int, seq: int) -> list[SubgraphValues]:
        """Every subgraph's values for one batch of `batch` samples of `seq` tokens (on the model's device:
        meta tensors for a model built by trace())."""
        key = (batch, seq)
        if key not in self._cache:
            self._cache[key] = _run(self, batch, seq)
        return self._cache[key]


def leaves(value: Any, out: list | None = None) -> list[torch.Tensor]:
    """The tensors inside `value`, walked as offcache's cache walks it (offcache.activations.tree.walk)."""
    out = [] if out is None else out
    if isinstance(value, torch.Tensor):
        out.append(value)
        return out
    walked = walk(value)
    if walked is not None:
        for item in walked[0]:
            leaves(item, out)
    return out


def _nbytes(traced: Traced, t: torch.Tensor) -> int:
    if traced.run_dtype is not None and t.dtype == traced.run_dtype:
        return t.numel() * _itemsize(traced.dtype)
    return t.nbytes


def describe(tensors: list[torch.Tensor], run_dtype=None, dtype=None) -> str:
    """'2x24x128 float32', or several of them in parentheses (a tuple such as rotary cos, sin)."""
    names = [str(dtype if run_dtype is not None and t.dtype == run_dtype else t.dtype) for t in tensors]
    parts = ["x".join(map(str, t.shape)) + " " + name.replace("torch.", "") for t, name in zip(tensors, names)]
    return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")" if parts else "no tensor"


def sample_input(batch: int, seq: int, device="meta") -> dict[str, torch.Tensor]:
    """What the calibration dataloader yields: input_ids and attention_mask, batch x seq int64 each."""
    return {
        "input_ids": torch.zeros(batch, seq, dtype=torch.long, device=device),
        "attention_mask": torch.ones(batch, seq, dtype=torch.long, device=device),
    }


def build_meta_model(config, dtype: torch.dtype):
    """The model oneshot would load for `config`, on the meta device: AutoModelForCausalLM, else
    AutoModelForImageTextToText (a multimodal config transformers does not map to a causal LM)."""
    import transformers

    errors = []
    for auto in ("AutoModelForCausalLM", "AutoModelForImageTextToText"):
        try:
            with torch.device("meta"):
                model = getattr(transformers, auto).from_config(config, dtype=dtype)
            return model.eval()
        except Exception as exc:  # the next class, then the caller's fallback
            errors.append(f"{auto}: {type(exc).__name__}: {exc}")
    raise ValueError("transformers cannot build this config: " + "; ".join(errors))


def trace(config, dtype: torch.dtype, batch: int, seq: int, sequential_targets=None, targets_per_subgraph: int = 1,
          run_dtype: torch.dtype | None = None) -> Traced:  # fmt: skip
    """Trace `config`'s model (built on meta in `dtype`) as llm-compressor's sequential pipeline does.

    `run_dtype`: build the meta model in this dtype instead (some meta kernels take bf16/fp16
    only) and report its `run_dtype` tensors as `dtype` ones (bytes scaled, names kept): the
    model's dtype is the dtype of every floating tensor that follows it, and tensors a model
    computes in float32 whatever its dtype stay float32 in both.

    `sequential_targets`: the pipeline's option (class names or module-name patterns, e.g.
    ["Linear"]); None is its default, the model's ``_no_split_modules``. Raises on a model
    llm-compressor cannot trace, with its error.
    """
    model = build_meta_model(config, run_dtype or dtype)
    traced = trace_model(model, batch, seq, sequential_targets, targets_per_subgraph)
    if run_dtype is not None and run_dtype != dtype:
        traced.run_dtype, traced.dtype = run_dtype, dtype
        traced.weight_bytes_total = _weight_bytes(_params_and_buffers(model.modules()), dtype)
    return traced


def trace_model(model, batch: int, seq: int, sequential_targets=None, targets_per_subgraph: int = 1) -> Traced:
    """trace() of a model already built (on meta, or with real weights: then run() runs for real)."""
    with _quiet():  # llm-compressor logs (to stdout) when imported and while it traces
        from compressed_tensors.utils.match import match_named_modules
        from llmcompressor.args.dataset_arguments import DatasetArguments
        from llmcompressor.pipelines.sequential.helpers import trace_subgraphs
        from llmcompressor.utils.pytorch.module import infer_sequential_targets

        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        targets = infer_sequential_targets(model, sequential_targets)
        subgraphs = trace_subgraphs(
            model, sample_input(batch, seq, device), targets, DatasetArguments().tracing_ignore, targets_per_subgraph
        )
    total = _weight_bytes(_params_and_buffers(model.modules()), dtype)
    names = {name for name, _ in match_named_modules(model, targets)}
    return Traced(model, subgraphs, dtype, sorted(targets), names, weight_bytes_total=total)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _params_and_buffers(modules) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for module in modules:
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            seen.setdefault(id(t), t)
    return list(seen.values())


def _weight_bytes(tensors, dtype) -> int:
    size = _itemsize(dtype)
    return sum(t.numel() * (size if t.is_floating_point() else t.element_size()) for t in tensors)


@contextlib.contextmanager
def _quiet():
    """llm-compressor's tracer and loguru print per subgraph: silenced while the planner traces."""
    import warnings

    try:
        import llmcompressor  # noqa: F401  (it enables its logger when imported: first, then disabled)
        from loguru import logger
    except ImportError:  # pragma: no cover - loguru comes with llm-compressor
        logger = None
    if logger is not None:
        logger.disable("llmcompressor")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            if logger is not None:
                logger.enable("llmcompressor")


def _target_modules(traced: Traced, subgraph) -> list[tuple[str, torch.nn.Module]]:
    names = [node.target for node in subgraph.graph.find_nodes(op="call_module")]
    return [(n, traced.model.get_submodule(n)) for n in names]


def _stand_in(module: torch.nn.Module):
    """A forward that returns a meta tensor shaped like the hidden states it is given."""

    def forward(*args, **kwargs):
        hidden = kwargs.get("hidden_states")
        if hidden is None:
            hidden = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if hidden is None:
            raise ValueError(f"{type(module).__name__}: no hidden-states tensor among its inputs")
        return torch.empty_like(hidden, device="meta")

    return forward


def _run(traced: Traced, batch: int, seq: int) -> list[SubgraphValues]:
    from llmcompressor.utils.helpers import calibration_forward_context

    model, subgraphs = traced.model, traced.subgraphs
    values: dict[str, Any] = dict(sample_input(batch, seq, next(model.parameters()).device))
    out: list[SubgraphValues] = []
    called: list[torch.nn.Module] = []
    walked: dict[int, torch.nn.Module] = {}

    def record(module, args):  # every module whose forward runs, wrapped code's calls included
        called.append(module)

    hook = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        with calibration_forward_context(model), _quiet():
            for index, sg in enumerate(subgraphs):
                called.clear()
                result = _forward(traced, sg, values)
                modules = {id(m): m for c in called for m in c.modules()}  # a stood-in layer: its children too
                walked.update(modules)
                out.append(_values_of(traced, sg, index, result, list(modules.values())))
                values.update(result)
                for name in sg.consumed_names:
                    values.pop(name, None)
    finally:
        hook.remove()
    traced.walked_bytes = _weight_bytes(_params_and_buffers(walked.values()), traced.dtype)
    return out


def _forward(traced: Traced, sg, values: dict) -> dict:
    """The subgraph's outputs; a target that cannot run here is stood in for (see the module's docstring)."""
    inputs = {n: values[n] for n in sg.input_names}
    try:
        return sg.forward(traced.model, **inputs)
    except Exception as exc:  # a data-dependent target: stand-ins for its layers
        stood = [(n, m) for n, m in _target_modules(traced, sg) if n in traced.target_names]
        if not stood or not traced.stand_ins:
            raise
        note = (
            f"{type(stood[0][1]).__name__}'s output is taken to be shaped like its hidden-states input: "
            f"it cannot run on meta tensors ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
        )
        if note not in traced.notes:
            traced.notes.append(note)
        with contextlib.ExitStack() as stack:
            for _, m in stood:
                stack.enter_context(_patched_forward(m, _stand_in(m)))
            return sg.forward(traced.model, **inputs)


def _values_of(traced: Traced, sg, index: int, result: dict, modules: list) -> SubgraphValues:
    """What subgraph `index` stores (none for the last one) and the weights of the modules it ran."""
    outputs: dict[str, list[Leaf]] = {}
    shapes: dict[str, str] = {}
    if index < len(traced.subgraphs) - 1:
        ids: dict[int, tuple[int, int]] = {}
        for name, value in result.items():
            tensors = leaves(value)
            outputs[name] = [(ids.setdefault(id(t), (index, len(ids))), _nbytes(traced, t)) for t in tensors]
            shapes[name] = describe(tensors, traced.run_dtype, traced.dtype)
    return SubgraphValues(
        input_names=sorted(sg.input_names),
        consumed_names=sorted(sg.consumed_names),
        outputs=outputs,
        targets=[n for n, _ in _target_modules(traced, sg) if n in traced.target_names],
        weight_bytes=_weight_bytes(_params_and_buffers(modules), traced.dtype),
        shapes=shapes,
    )


@contextlib.contextmanager
def _patched_forward(module: torch.nn.Module, forward):
    had = "forward" in module.__dict__
    old = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if had:
            module.forward = old
        else:
            del module.forward
