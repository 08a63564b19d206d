"""Section pastram: llm-compressor's oneshot of a checkpoint larger than a memory cgroup allows, seen as it runs.

A random bf16 Llama checkpoint (offcache.bench.pastram_worker make) is loaded with compressed-tensors'
``load_offloaded_model(device_map="auto_offload")``, quantized (FP8 with static activation scales,
calibrated, sequential pipeline) and saved compressed, in a fresh memory cgroup, twice: llm-compressor
alone, then with ``offcache.patch_llmcompressor(weights=True)``, each after the checkpoint's pages are
dropped from the page cache. While each runs, every 0.1 s: the cgroup's memory (page cache included)
against its limit, its anonymous memory, the worker's disk reads (/proc/PID/io read_bytes) and
offcache's host bytes (the worker writes offcache.stats() to a file). Each run is recorded as it ends:
completed, or killed (its exit status, the OOM kills the cgroup counts, the last phase it reached),
never a zero. The planner (``python -m offcache.plan --checkpoint ... --offload-weights
--memory-limit ...``) is run for the same model and limit first; its expected peak and disk reads are
written beside the measured ones.

Sizes: the default is tests/weights/memory/test_past_ram.py's (0.47 GiB of weights in 1100 MiB;
importing torch and llm-compressor takes ~0.8 GiB of it); --tiny checks the harness on a small model in
the same limit. It needs root and a cgroup v2 mount or a v1 memory mount: where no cgroup can be made
the section records why and ``python -m offcache.bench pastram`` exits non-zero. Writes
DIR/pastram.json, DIR/pastram.md and DIR/pastram.png (memory over time) beside results.json.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from offcache.bench.cgroup import Cgroup, NoCgroupError, memory_cgroup
from offcache.bench.common import Context, bench_disk_dir, device_info, save_results
from offcache.bench.pastram_worker import SAMPLES, SEQ_LEN

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
LIMIT = 1100 * MiB
SIZE = (16, 1024, 4096)  # layers, hidden, intermediate: 0.47 GiB of bf16 weights
TINY = (2, 256, 512)
MODES = ("none", "weights")
LABELS = {"none": "llm-compressor alone", "acts": "offcache patch_llmcompressor()",
          "weights": "offcache patch_llmcompressor(weights=True)"}  # fmt: skip
PHASES = ("imported", "loaded", "calibrated", "saved")
SAMPLE_S = 0.1
# The planner's figures checked against a measured run (tests/weights/memory/test_past_ram.py): the
# expected peak of anonymous memory is an upper bound within PEAK_TOLERANCE of the measured one, and the
# checkpoint bytes the plan says a cold calibration pass reads are the measured reads within READ_TOLERANCE.
PEAK_TOLERANCE = 1.5
READ_TOLERANCE = 0.25


def worker_env(xdg: str | None = None) -> dict:
    """The worker's environment: no OFFCACHE_* setting (offcache's defaults, as a user's first run), one thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFCACHE_") and k != "LOCAL_WORLD_SIZE"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if xdg:
        env["XDG_CACHE_HOME"] = xdg  # offcache's disk tier, and the weights' offload folder under it
    return env


def make_model(model: Path, size: tuple[int, int, int], env: dict) -> None:
    cmd = [sys.executable, "-m", "offcache.bench.pastram_worker", "make", str(model), *map(str, size)]
    made = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if made.returncode:
        raise RuntimeError(f"making the checkpoint failed (rc {made.returncode}): {made.stderr[-3000:]}")


def drop_page_cache(folder: Path) -> None:
    """The checkpoint's pages out of the page cache, so that a run in a cgroup reads (and is charged) them."""
    from offcache.bench.checkpoint_read import drop_page_cache as drop_files

    drop_files(sorted(glob.glob(str(Path(folder) / "*.safetensors"))))


def checkpoint_bytes(folder: Path) -> int:
    return sum(os.path.getsize(f) for f in glob.glob(str(Path(folder) / "*.safetensors")))


def saved(folder: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for name in sorted(glob.glob(str(Path(folder) / "*.safetensors"))):
        out.update(load_file(name))
    return out


def differing(a: dict, b: dict) -> list[str]:
    """The names whose tensors differ in dtype or in a byte (every name of either, when the names differ)."""
    import torch

    if a.keys() != b.keys():
        return sorted(set(a) ^ set(b))
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))]


def _read_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _last_json_line(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - 4096, 0))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return {}


def run_one(model: Path, out: Path, mode: str, env: dict, limit: int = LIMIT, scheme: str = "fp8",
            progress: bool = False, timeout: float = 900) -> dict:  # fmt: skip
    """One worker run in a fresh memory cgroup of `limit` bytes, sampled as it runs: its record.

    Raises NoCgroupError where no cgroup can be made."""
    drop_page_cache(model)
    stats = out.with_name(out.name + "-stats.jsonl")
    stats.unlink(missing_ok=True)
    log = out.with_name(out.name + "-stderr.log")
    with memory_cgroup(limit, f"offcache-pastram-{os.getpid()}-{mode}") as group:
        script = f'echo $$ > {group.procs} && exec "{sys.executable}" -m offcache.bench.pastram_worker run "$@"'
        with open(log, "w") as err:
            return _watch(group, ["sh", "-c", script, "sh", str(model), str(out), mode, scheme, str(stats)], env,
                          err, log, stats, mode, progress, timeout)  # fmt: skip


def _watch(group: Cgroup, cmd: list[str], env: dict, err, log: Path, stats: Path, mode: str, progress: bool,
           timeout: float) -> dict:  # fmt: skip
    from tqdm import tqdm

    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    phases: list[dict] = []
    said: list[str] = []  # the placement's log line (llm-compressor's logger writes to stdout)
    samples: list[dict] = []
    bar = tqdm(total=len(PHASES), desc=f"pastram: {LABELS[mode]}", unit="phase", disable=not progress,
               bar_format="{desc}: {n}/{total} phases |{bar}| {elapsed} {postfix}")  # fmt: skip

    def read_phases():
        for line in proc.stdout:
            if line.startswith("phase "):
                name = line.split()[1]
                phases.append({"phase": name, "t": round(time.time() - t0, 2), "said": line.strip()})
                bar.update(1)
            elif "offcache weights placement: " in line:
                said.append(line.split("offcache weights placement: ", 1)[1].strip())

    reader = threading.Thread(target=read_phases, daemon=True)
    reader.start()
    deadline = t0 + timeout
    while proc.poll() is None:
        if time.time() > deadline:
            proc.kill()
            break
        row = {"t": round(time.time() - t0, 2), "cgroup_bytes": group.current(), "anon_bytes": group.anon(),
               "read_bytes": _read_bytes(proc.pid)}  # fmt: skip
        worker = _last_json_line(stats)
        if "host_bytes" in worker:
            row["offcache_host_bytes"] = worker["host_bytes"]
        if row["read_bytes"] is not None or not samples:
            samples.append(row)
            if progress and row["cgroup_bytes"] is not None and len(samples) % 10 == 1:  # once a second
                bar.set_postfix_str(f"cgroup {row['cgroup_bytes'] / MiB:.0f}/{group.limit / MiB:.0f} MiB, "
                                    f"anon {(row['anon_bytes'] or 0) / MiB:.0f} MiB")  # fmt: skip
        time.sleep(SAMPLE_S)
    rc = proc.wait()
    wall = time.time() - t0
    reader.join(timeout=5)
    bar.close()
    kills = group.oom_kills()
    reached = phases[-1]["phase"] if phases else "started"
    completed = rc == 0 and reached == "saved"
    if completed:
        outcome = "completed"
    elif rc in (-9, 137) and kills:
        outcome = f"killed by the OOM killer (rc {rc}) after phase {reached}"
    elif time.time() > deadline:
        outcome = f"timed out after {timeout:.0f} s, after phase {reached}"
    else:
        outcome = f"failed (rc {rc}) after phase {reached}"
    reads = [s["read_bytes"] for s in samples if s.get("read_bytes") is not None]
    anon = [s["anon_bytes"] for s in samples if s.get("anon_bytes") is not None]
    host = [s["offcache_host_bytes"] for s in samples if s.get("offcache_host_bytes") is not None]
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    return {
        "mode": mode,
        "label": LABELS[mode],
        "outcome": outcome,
        "completed": completed,
        "rc": rc,
        "oom_kills": kills,
        "phases": phases,
        "wall_s": round(wall, 2),
        "limit_bytes": group.limit,
        "peak_cgroup_bytes": group.peak(),
        "max_anon_bytes": max(anon) if anon else None,
        "read_bytes": reads[-1] if reads else None,
        "read_bytes_by_phase": _reads_by_phase(phases, samples),
        "max_offcache_host_bytes": max(host) if host else None,
        "placement": said[0] if said else None,
        "stderr_tail": "" if completed else tail[-1500:],
        "samples": samples,
    }  # fmt: skip


def _reads_by_phase(phases: list[dict], samples: list[dict]) -> dict:
    """The worker's disk reads between its phases: the last sample at or before each phase's line."""
    out = {}
    last = 0
    for p in phases:
        before = [s["read_bytes"] for s in samples if s.get("read_bytes") is not None and s["t"] <= p["t"]]
        at = before[-1] if before else last
        out[p["phase"]] = at - last
        last = at
    return out


def plan(model: Path, limit: int, env: dict, disk_gbps: float | None = None) -> dict:
    """`python -m offcache.plan` for the run's model, calibration set and memory limit, weights offloaded: its JSON."""
    cmd = [sys.executable, "-m", "offcache.plan", "--checkpoint", str(model), "--offload-weights",
           "--memory-limit", str(limit), "--onload", "cpu", "--samples", str(SAMPLES), "--seq-len", str(SEQ_LEN),
           "--uniform-lengths", "--json"]  # fmt: skip
    if disk_gbps:
        cmd += ["--disk-gbps", f"{disk_gbps:g}"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        return {"error": f"rc {done.returncode}: {done.stderr[-2000:]}", "command": " ".join(cmd[1:])}
    return {"command": "python " + " ".join(cmd[1:]), **json.loads(done.stdout)}


def compare(p: dict, run: dict) -> dict:
    """The plan's expected peak and disk reads beside a run's measured ones."""
    w = p.get("offload") or {}
    phase = run.get("read_bytes_by_phase") or {}
    cold = phase["loaded"] + phase["calibrated"] if "calibrated" in phase else None
    out = {"predicted_peak_bytes": w.get("expected_peak_bytes"), "measured_max_anon_bytes": run.get("max_anon_bytes"),
           "predicted_cold_pass_read_bytes": w.get("cold_pass_read_bytes"),
           # loading and calibration, the checkpoint's pages dropped before the run: every byte read once
           "measured_cold_pass_read_bytes": cold,
           "predicted_save_read_bytes": w.get("save_read_bytes"), "measured_save_read_bytes": phase.get("saved"),
           "measured_total_read_bytes": run.get("read_bytes")}  # fmt: skip
    if out["predicted_peak_bytes"] and out["measured_max_anon_bytes"]:
        out["peak_ratio"] = round(out["predicted_peak_bytes"] / out["measured_max_anon_bytes"], 3)
    if out["predicted_cold_pass_read_bytes"] and cold is not None:
        out["read_ratio"] = round(cold / out["predicted_cold_pass_read_bytes"], 3)
    if out["predicted_save_read_bytes"] and out["measured_save_read_bytes"] is not None:
        out["save_read_ratio"] = round(out["measured_save_read_bytes"] / out["predicted_save_read_bytes"], 3)
    return out


def within_tolerance(c: dict) -> list[str]:
    """What of a comparison (compare()) is outside the stated tolerances: [] when the prediction holds."""
    wrong = []
    peak, anon = c.get("predicted_peak_bytes"), c.get("measured_max_anon_bytes")
    if not peak or not anon or not anon <= peak <= PEAK_TOLERANCE * anon:
        wrong.append(f"peak: predicted {peak}, measured {anon} (want measured <= predicted <= {PEAK_TOLERANCE}x)")
    read, cold = c.get("predicted_cold_pass_read_bytes"), c.get("measured_cold_pass_read_bytes")
    if not read or cold is None or abs(cold - read) > READ_TOLERANCE * read:
        wrong.append(f"cold pass reads: predicted {read}, measured {cold} (want within {READ_TOLERANCE:.0%})")
    return wrong


def run_pastram(ctx: Context, out: Path, command: str, progress: bool = True) -> dict:
    """The section: the model made, the plan, each mode run in a fresh cgroup; pastram.{json,md,png} in `out`."""
    size = TINY if ctx.tiny else SIZE
    work = Path(tempfile.mkdtemp(prefix="offcache-bench-pastram-", dir=bench_disk_dir()))
    env = worker_env(str(work / "xdg"))
    model = work / "model"
    result: dict = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            **device_info(ctx.device),
            "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "kernel": platform.release(),
            "versions": _versions(),
        },  # fmt: skip
        "limit_bytes": LIMIT,
        "model": {
            "layers": size[0],
            "hidden_size": size[1],
            "intermediate_size": size[2],
            "dtype": "bfloat16",
            "scheme": "FP8 (static activation scales), sequential pipeline",
            "samples": SAMPLES,
            "seq_len": SEQ_LEN,
        },  # fmt: skip
        "runs": [],
    }
    try:
        with memory_cgroup(LIMIT, f"offcache-pastram-{os.getpid()}-probe"):
            pass  # before minutes of work: can one be made here at all
        make_model(model, size, env)
        result["model"]["checkpoint_bytes"] = checkpoint_bytes(model)
        result["plan"] = plan(model, LIMIT, env)
        for mode in MODES:
            result["runs"].append(run_one(model, work / mode, mode, env, LIMIT, progress=progress))
    except NoCgroupError as exc:
        result["no_cgroup"] = str(exc)
    finally:
        done = {r["mode"]: r for r in result["runs"]}
        if all(done.get(m, {}).get("completed") for m in MODES):
            diff = differing(saved(work / "none"), saved(work / "weights"))
            result["identical"] = not diff
            result["differing"] = diff[:20]
        elif done:
            result["identical"] = None  # said in the markdown: a run did not complete
        if "weights" in done and isinstance(result.get("plan"), dict) and "error" not in result["plan"]:
            result["prediction"] = compare(result["plan"], done["weights"])
        subprocess.run(["rm", "-rf", str(work)], check=False)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_results(out / "pastram.json", result)
    (out / "pastram.md").write_text(markdown(result))
    try:
        result["plot"] = plot(result, out / "pastram.png") if result["runs"] else "not drawn: nothing was run"
    except ImportError as exc:
        result["plot"] = f"not drawn: {exc}"
    save_results(out / "pastram.json", result)
    return result


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in ("torch", "transformers", "compressed-tensors", "llmcompressor"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / MiB:.0f} MiB"


def markdown(r: dict) -> str:
    m = r["model"]
    lines = [
        f"# pastram: llm-compressor oneshot + save past a memory cgroup's limit ({r['date'][:10]})",
        "",
        f"Machine: {r['machine']['name']}, {r['machine'].get('cpus')} CPUs, {_mib(r['machine']['ram_bytes'])} RAM, "
        f"kernel {r['machine']['kernel']}, "
        + ("no GPU (the model runs on the CPU)" if r["machine"].get("type") != "cuda" else "GPU onload")
        + ". "
        + ", ".join(f"{k} {v}" for k, v in r["machine"].get("versions", {}).items())
        + ".",
        f"Command: `{r['command']}`",
        "",
        f"Model: random bf16 Llama, {m['layers']} layers, hidden {m['hidden_size']}, intermediate "
        f"{m['intermediate_size']}: {_mib(m.get('checkpoint_bytes'))} of safetensors, loaded with "
        '`load_offloaded_model(device_map="auto_offload")`; oneshot '
        f"{m['scheme']}, {m['samples']} samples of {m['seq_len']} tokens; `save_pretrained(save_compressed=True)`. "
        f"Memory cgroup limit {_mib(r['limit_bytes'])} (no swap), a fresh cgroup per run, the checkpoint's pages "
        "dropped from the page cache before each.",
        "",
    ]
    if r.get("no_cgroup"):
        return "\n".join(lines + [f"**No cgroup**: nothing was run. {r['no_cgroup']}", ""])
    lines += ["| run | outcome | wall | cgroup peak | max anonymous | offcache host bytes (max) | disk reads |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for x in r["runs"]:
        lines.append(
            f"| {x['label']} | {x['outcome']} | {x['wall_s']:.1f} s | {_mib(x['peak_cgroup_bytes'])} | "
            f"{_mib(x['max_anon_bytes'])} | {_mib(x['max_offcache_host_bytes'])} | {_mib(x['read_bytes'])} |"
        )
    lines.append("")
    if r.get("identical") is True:
        lines.append("The saved checkpoints are equal byte for byte (every tensor).")
    elif r.get("identical") is False:
        lines.append(f"The saved checkpoints DIFFER: {', '.join(r['differing'][:5])} ...")
    else:
        lines.append("Saved checkpoints not compared: a run did not complete.")
    for x in r["runs"]:
        said = ", ".join(f"{k} {_mib(v)}" for k, v in x["read_bytes_by_phase"].items())
        lines.append(f"- {x['label']}: disk reads up to each phase: {said or 'n/a'}")
        if x.get("placement"):
            lines.append(f"  - placement: {x['placement']}")
    p, c = r.get("plan") or {}, r.get("prediction")
    if c:
        w = p.get("offload") or {}
        lines += [
            "",
            f"Planner (`{p.get('command')}`): weights {_mib(w.get('cpu_bytes'))} on the CPU, "
            f"{_mib(w.get('disk_bytes'))} on disk; activations {_mib(w.get('activation_host_bytes'))} in memory, "
            f"{_mib(w.get('activation_disk_bytes'))} on the disk tier.",
            "",
            "| | predicted | measured (weights=True) | ratio |",
            "|---|---|---|---|",
            f"| peak (anonymous memory) | {_mib(c['predicted_peak_bytes'])} | {_mib(c['measured_max_anon_bytes'])} | "
            f"{c.get('peak_ratio', 'n/a')} (predicted / measured) |",
            f"| disk reads, loading + calibration (cold) | {_mib(c['predicted_cold_pass_read_bytes'])} | "
            f"{_mib(c['measured_cold_pass_read_bytes'])} | {c.get('read_ratio', 'n/a')} (measured / predicted) |",
            f"| disk reads, save_pretrained | {_mib(c['predicted_save_read_bytes'])} | "
            f"{_mib(c['measured_save_read_bytes'])} | {c.get('save_read_ratio', 'n/a')} (measured / predicted) |",
            "",
            f"The tolerances tests/weights/memory/test_past_ram.py checks: measured peak <= predicted <= "
            f"{PEAK_TOLERANCE}x measured, and loading + calibration reads within {READ_TOLERANCE:.0%} of the "
            "predicted cold pass. This run: "
            + ("within both." if not within_tolerance(c) else "OUTSIDE: " + "; ".join(within_tolerance(c)) + ".")
            + " The save's reads are not checked against a tolerance: pages the kernel reclaimed under the limit "
            "are read again.",
        ]
    elif p.get("error"):
        lines += ["", f"Planner failed: {p['error'][:500]}"]
    lines += ["", "Memory over time: `pastram.png` beside this file.", ""]
    return "\n".join(lines)


def plot(r: dict, path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = r["runs"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 3.6 * len(runs)), squeeze=False, sharex=True)
    for ax, x in zip(axes[:, 0], runs):
        t = [s["t"] for s in x["samples"]]
        ax.plot(t, [(s.get("cgroup_bytes") or 0) / MiB for s in x["samples"]], label="cgroup memory (page cache incl.)")
        ax.plot(t, [(s.get("anon_bytes") or 0) / MiB for s in x["samples"]], label="cgroup anonymous memory")
        host = [(s["t"], s["offcache_host_bytes"] / MiB) for s in x["samples"] if "offcache_host_bytes" in s]
        if host:
            ax.plot(*zip(*host), label="offcache host bytes")
        ax.axhline(x["limit_bytes"] / MiB, color="red", linestyle="--", label="cgroup limit")
        for ph in x["phases"]:
            ax.axvline(ph["t"], color="gray", alpha=0.4)
            ax.text(ph["t"], x["limit_bytes"] / MiB * 0.03, " " + ph["phase"], rotation=90, fontsize=7, color="gray")
        ax.set_ylabel("MiB")
        ax.set_title(f"{x['label']}: {x['outcome']}, {x['wall_s']:.0f} s")
        ax.grid(True, alpha=0.3)
        io = ax.twinx()
        io.plot(t, [(s.get("read_bytes") or 0) / MiB for s in x["samples"]], color="tab:purple", alpha=0.6,
                linestyle=":", label="disk reads (cumulative)")  # fmt: skip
        io.set_ylabel("disk reads, MiB")
        handles = ax.get_legend_handles_labels()
        more = io.get_legend_handles_labels()
        ax.legend(handles[0] + more[0], handles[1] + more[1], fontsize=7, loc="center right")
    axes[-1, 0].set_xlabel("seconds since the worker started")
    m = r["model"]
    fig.suptitle(f"oneshot + save of {_mib(m.get('checkpoint_bytes'))} of bf16 weights in a {_mib(r['limit_bytes'])} "
                 "memory cgroup")  # fmt: skip
    fig.subplots_adjust(left=0.07, right=0.92, top=0.89, bottom=0.1, hspace=0.35)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def summary_lines(r: dict) -> list[str]:
    if r.get("no_cgroup"):
        return [f"pastram: NO CGROUP, nothing run: {r['no_cgroup']}"]
    out = [f"pastram: {_mib(r['model'].get('checkpoint_bytes'))} checkpoint in a {_mib(r['limit_bytes'])} cgroup:"]
    for x in r["runs"]:
        out.append(f"  {x['label']:44} {x['outcome']}, {x['wall_s']:.0f} s, max anonymous {_mib(x['max_anon_bytes'])}")
    if r.get("identical") is not None:
        out.append(f"  saved checkpoints equal byte for byte: {r['identical']}")
    c = r.get("prediction")
    if c:
        peak, anon = _mib(c["predicted_peak_bytes"]), _mib(c["measured_max_anon_bytes"])
        reads, cold = _mib(c["predicted_cold_pass_read_bytes"]), _mib(c["measured_cold_pass_read_bytes"])
        out.append(f"  planner: peak {peak} (measured {anon}), cold pass reads {reads} (measured {cold})")
    return out
