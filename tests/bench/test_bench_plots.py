"""The benchmark's measurements and figures can be trusted at a glance (no run of the benchmark here)."""

import pytest
import torch

pytest.importorskip("matplotlib")

from offcache.bench import common, plots  # noqa: E402
from offcache.bench.common import Context  # noqa: E402

CPU_RESULTS = {
    "backend": "host",
    "device": {"name": "Example CPU @ 2.0GHz", "type": "cpu", "cpus": 2, "arch": "x86_64"},
    "transfer": [
        {"impl": impl, "direction": d, "bytes": b, "gbps": 2.0, "gbps_min": 1.0, "gbps_max": 3.0}
        for impl in ("offcache", "raw_pinned")
        for d in ("store", "fetch")
        for b in (4096, 16384)
    ],
    "pipeline": [
        {"impl": "offcache_iter_prefetch", "wall_s": 1.0, "wall_min_s": 0.9, "wall_max_s": 1.2},
        {"impl": "no_offload", "wall_s": 0.8, "wall_min_s": 0.7, "wall_max_s": 0.9},
    ],
    "kv": [
        {
            "impl": "offcache",
            "case": "short",
            "prompt_tokens": 8,
            "completed": True,
            "decode_tokens_per_s_median": 10.0,
            "decode_tokens_per_s_min": 9.0,
            "decode_tokens_per_s_max": 12.0,
        },
        {
            "impl": "transformers_offloaded",
            "case": "short",
            "prompt_tokens": 8,
            "completed": None,
            "note": "needs a GPU: transformers' DynamicCache(offloading=True) uses CUDA streams",
        },
    ],  # fmt: skip
}


@pytest.fixture
def figures(monkeypatch):
    """The figures plot_all draws, kept open for inspection."""
    kept, close = [], plots.plt.close
    monkeypatch.setattr(plots.plt, "close", kept.append)
    yield kept
    for fig in kept:
        close(fig)


def texts(fig) -> list[str]:
    out = [t.get_text() for t in fig.texts]
    for ax in fig.axes:
        out += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()] + [t.get_text() for t in ax.texts]
        out += [t.get_text() for t in ax.get_yticklabels()]
    return out


def test_cpu_figures_name_the_cpu_carry_the_caveat_and_show_the_spread(tmp_path, figures):
    files = plots.plot_all(CPU_RESULTS, tmp_path)
    assert sorted(p.rsplit("/", 1)[1] for p in files) == ["bandwidth.png", "pipeline.png"]
    bandwidth, pipeline = figures
    for fig in figures:
        words = texts(fig)
        assert plots.CPU_CAVEAT in words
        assert any("Example CPU @ 2.0GHz, 2 CPUs" in w for w in words)
    # the spread: a min-max band per line, error bars on the bars
    assert all(len(ax.collections) == 2 for ax in bandwidth.axes)  # offcache and raw_pinned
    kv_axis = pipeline.axes[1]
    assert any(w.strip() == "needs a GPU" for w in (t.get_text() for t in kv_axis.texts))
    assert not any("Error" in w for w in texts(pipeline))
    from matplotlib.container import ErrorbarContainer

    assert all(any(isinstance(c, ErrorbarContainer) for c in ax.containers) for ax in pipeline.axes)


def test_gpu_figures_carry_no_cpu_caveat(tmp_path, figures):
    results = {**CPU_RESULTS, "device": {"name": "NVIDIA H200", "type": "cuda"}, "backend": "cuda"}
    plots.plot_all(results, tmp_path)
    assert all(plots.CPU_CAVEAT not in texts(fig) for fig in figures)


def test_cpu_model_comes_from_proc_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R)  CPU @ 2.20GHz\n")
    assert common.cpu_model(str(info)) == "Intel(R) Xeon(R) CPU @ 2.20GHz"
    assert common.cpu_model(str(tmp_path / "missing")) == ""
    name = common.device_info(torch.device("cpu"))["name"]
    assert name == (common.cpu_model() or name) and name != "cpu"


def test_short_calls_are_repeated_until_a_sample_spans_the_minimum(monkeypatch):
    """A 10 us call is timed 2000 at a time for a 20 ms sample: a clock tick or one preemption no
    longer reads as the copy's time."""
    clock = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])

    def call():
        clock[0] += 1e-5

    ctx = Context(device=torch.device("cpu"), quick=True, tiny=True, backend="host")
    per_call, calls = common.timed_per_call(ctx, call, repeats=3, min_sample_s=0.02)
    assert calls == 2000 and per_call == pytest.approx([1e-5] * 3)
    _, calls = common.timed_per_call(ctx, lambda: clock.__setitem__(0, clock[0] + 0.05), repeats=2)
    assert calls == 1  # long calls are timed one at a time


def test_cpu_baselines_copy_on_one_thread_like_the_host_backend():
    """torch's intra-op threads turned a 64 KiB copy into a parallel region that waited ms for a
    descheduled thread on a busy 2-core machine (the 8 ms per copy in bandwidth.png)."""
    from offcache.bench import transfer

    ctx = Context(device=torch.device("cpu"), quick=True, tiny=True, backend="host")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with transfer._baseline_threads(ctx, "raw_pinned"):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with transfer._baseline_threads(ctx, "offcache"):
            assert torch.get_num_threads() == 2
        rows = transfer._transfer_at(ctx, 65536)
    finally:
        torch.set_num_threads(before)
    assert {r["impl"]: r["threads"] for r in rows} == {"offcache": None, "raw_pinned": 1, "pageable_to": 1}
