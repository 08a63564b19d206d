"""The headline figures of one step of benchmarks/device_check.sh, from its log or results.json.

    python benchmarks/device_check_headline.py STEP PATH

Plain JSON and the standard library: it runs without offcache (a step whose engine failed still gets
its line). A section cut short at its step's deadline is read from the rows it had written
(results.json's runs[SECTION]["partial"]) and marked "partial".
"""

import json
import re
import sys

what, path = sys.argv[1], sys.argv[2]
# results.json's section of each bench step (its run is marked partial while the section is unfinished).
SECTION = {"weights": "weights", "ranks": "weights_ranks", "oneshot": "oneshot", "kv": "kv"}


def load():
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def x(v, fmt=".2f"):
    return "?" if v is None else format(v, fmt)


def row(rows, **match):
    return next((r for r in rows or [] if all(r.get(k) == v for k, v in match.items())), {})


out = []
r = load()
if SECTION.get(what) and (r.get("runs") or {}).get(SECTION[what], {}).get("partial"):
    out.append("partial: cut short, the rows measured before")
if what == "tests":
    # pytest -v prints each test's outcome as it ends ("[gw3] [ 4%] FAILED tests/x.py::t" under
    # xdist, "tests/x.py::t FAILED [ 4%]" without), -rfE lists them again at the end ("FAILED
    # tests/x.py::t - why"): the failures are named even when the step is killed at its deadline.
    with open(path, errors="replace") as f:
        log = f.read().splitlines()
    lines = [
        ln.strip("= ") for ln in log if re.search(r"\d+ (passed|failed|errors?|skipped|deselected).* in [0-9.]+s", ln)
    ]
    outcome = re.compile(r"(?:^|\] )(PASSED|FAILED|ERROR) (\S+::\S+)|^(\S+::\S+) (PASSED|FAILED|ERROR)\b")
    seen = {}
    for ln in log:
        m = outcome.search(ln)
        if m:
            word, name = (m[1], m[2]) if m[1] else (m[4], m[3])
            if word != "PASSED" or name not in seen:  # an error at teardown follows PASSED
                seen[name] = word
    # "test_gpu_disk::test_x[a]" for tests/engine/test_gpu_disk.py::test_x[a]: more of them fit the line.
    fails = [re.sub(r"^(?:tests/)?(\S+?)\.py::", r"\1::", name) for name, word in seen.items() if word != "PASSED"]
    if lines:
        out.append(lines[-1])
    else:
        passed = sum(word == "PASSED" for word in seen.values())
        out.append(f"no pytest summary line ({passed} passed, {len(fails)} failed or errors before it stopped)")
    if fails:
        out.append("failed: " + ", ".join(fails[:10]) + (f" ... ({len(fails)} in all)" if len(fails) > 10 else ""))
elif what == "build":
    if r:
        out.append(f"offcache {r.get('version')}, torch {r.get('torch')}, backend {r.get('backend')}")
elif what == "bench":
    t = r.get("transfer") or []
    if t:
        top = max(v["bytes"] for v in t)
        for d in ("store", "fetch"):
            o = row(t, bytes=top, impl="offcache", direction=d).get("gbps")
            raw = row(t, bytes=top, impl="raw_pinned", direction=d).get("gbps")
            share = f" = {o / raw:.0%} of raw pinned {raw:.1f}" if o and raw else ""
            goal = " (goal >= 90%)" if d == "store" else ""
            out.append(f"{d} {top >> 20} MiB {x(o, '.1f')} GB/s{share}{goal}")
    duplex = row(r.get("overlap"), case="duplex").get("ratio_to_one_direction")
    if duplex is not None:
        out.append(f"duplex {duplex:.2f}x")
    s = r.get("small") or []
    if s:
        st = row(s, impl="offcache", direction="store").get("us_per_tensor")
        fe = row(s, impl="offcache", direction="fetch").get("us_per_tensor")
        out.append(f"small store/fetch {x(st)}/{x(fe)} us per tensor")
    p = r.get("pipeline") or []
    ours = row(p, impl="offcache_iter_prefetch")
    if ours:
        theirs = row(p, impl="llmcompressor_iter_prefetch").get("wall_s")
        vs = (
            f", {theirs / ours['wall_s']:.2f}x faster than llm-compressor prefetch" if theirs else ", no llm-compressor"
        )
        out.append(f"pipeline prefetch {x(ours.get('bound_ratio'))}x its bound{vs}")
    pinned = r.get("pinned") or []
    if pinned:
        out.append("pinned reserved/live " + " vs ".join(f"{v['impl']} {x(v.get('ratio'))}" for v in pinned))
elif what == "weights":
    rows = r.get("weights") or []
    bars = row(rows, impl="bars")
    for name, b in bars.items():
        if isinstance(b, dict) and "bar" in b:
            verdict = "" if b.get("pass") is None else (" ok" if b["pass"] else " MISSED")
            out.append(f"{name} {x(b.get('value'))} ({b['bar']}){verdict}")
    for impl in ("offcache_prefetch", "disk_compressed_tensors", "disk_offcache_prefetch"):
        v = row(rows, impl=impl)
        if v:
            out.append(f"{impl} {x(v.get('vs_compute_only'))}x compute-only")
elif what == "ranks":
    rows = r.get("weights_ranks") or []
    for v in rows:
        if "skipped" in v:
            out.append(f"{v['impl']} skipped: {v['skipped'][:80]}")
        elif v.get("impl") != "goals":
            onload = f"{x(v.get('onload_over_raw'))} of raw" if v.get("onload_copies") else "no copy"
            out.append(
                f"{v['impl']} PSS {x(v.get('pss_over_weights'))}x, onload {onload}, "
                f"{x(v.get('collectives_per_module'), '.0f')} coll/module"
            )
    goals = row(rows, impl="goals")
    for name, g in goals.items():
        if isinstance(g, dict) and "bar" in g:
            verdict = "" if g.get("pass") is None else (" ok" if g["pass"] else " MISSED")
            out.append(f"{name} {x(g.get('value'))} ({g['bar']}){verdict}")
elif what == "oneshot":
    rows = r.get("oneshot") or []
    compared = [v for v in rows if v.get("bit_identical") is not None]
    if rows:
        same = sum(bool(v["bit_identical"]) for v in compared)
        out.append(f"weights bit-identical {same}/{len(compared)}")
        for v in rows:
            if v["impl"] == "offcache":
                out.append(
                    f"prefetch {'on' if v['prefetch'] else 'off'} {v['wall_s']:.1f}s, "
                    f"{x(v.get('speedup_vs_llmcompressor'))}x llm-compressor's speed"
                )
        on, off = row(rows, impl="offcache", prefetch=True), row(rows, impl="offcache", prefetch=False)
        theirs = row(rows, impl="llmcompressor", prefetch=True)
        if on and off and theirs:  # issue 41's goal: prefetch on >= off, and >= 2x llm-compressor's own prefetch
            paired = on.get("prefetch_ratio_paired")  # per round on/off time, drift cancelled
            speed = off["wall_s"] / on["wall_s"] if paired is None else 1 / paired
            out.append(
                f"prefetch on/off speed {speed:.2f}x (goal >= 1), "
                f"{theirs['wall_s'] / on['wall_s']:.2f}x llm-compressor's prefetch (goal >= 2x)"
            )
        v = rows[0]
        out.append(f"{v['num_hidden_layers']} layers, hidden {v['hidden_size']}, {v['samples']}x{v['tokens']}")
elif what == "kv":
    rows = r.get("kv") or []
    for case in ("short", "long", "memory_limited"):
        ours, dyn = row(rows, case=case, impl="offcache"), row(rows, case=case, impl="dynamic")
        trf = row(rows, case=case, impl="transformers_offloaded")
        if not ours:
            continue
        rate = ours.get("decode_tokens_per_s_median")
        ref = trf.get("decode_tokens_per_s_median")
        goal = " (goal >= 1.2x)" if case in ("short", "long") else ""
        vs = (
            f" = {rate / ref:.2f}x transformers offloaded{goal}"
            if rate and ref
            else " (transformers offloaded: failed)"
        )
        ok = (
            ""
            if not ours.get("completed")
            else (", tokens equal" if ours.get("equal_to_dynamic") else ", TOKENS DIFFER")
        )
        done = vs if ours.get("completed") else " failed"
        out.append(f"{case} {ours.get('prompt_tokens')}: {x(rate, '.1f')} tok/s{done}{ok}")
        if dyn and not dyn.get("completed"):
            out.append(f"{case}: DynamicCache failed")
elif what == "soak":
    s = r.get("soak") or {}
    if s:
        out.append(
            f"{s['ops']} ops, rss {s['rss_growth_bytes'] >> 10:+d} KiB, pinned in use growth "
            f"{s['pinned_in_use_growth_bytes']} B, after gc {s['pinned_in_use_after_gc']} B"
        )
print("; ".join(out))
