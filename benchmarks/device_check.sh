#!/usr/bin/env bash
# The GPU proof in one call, sized for one lease of the H200 (Python 3.12, torch 2.11+cu130,
# nvcc 13.0, 16 cores, no package registry): done in <= 6 minutes, at most 8 files in $OUT, so
# that a 15-minute lease (start-up included) has room to run it a second time.
#
#   OUT=DIR bash benchmarks/device_check.sh            # on the GPU machine (wheels from .whl/)
#   OUT=DIR bash benchmarks/device_check.sh --dry-run  # here, without a GPU: GPU-only steps
#                                                      # skipped, the rest at --tiny sizes
#
# Steps, each under its own deadline (`timeout`) and all under one budget (DEVCHECK_BUDGET_S,
# 360 s; each step leaves 10 s for every step after it; the deadlines add up to the budget):
# a step that overruns is recorded as "timeout" and the next one still runs. The steps that only
# a GPU can judge come first. pytest runs on the machine's cores with pytest-xdist (carried).
#   wheels   install the carried .whl/ (scripts/device_wheels.sh) into a folder on PYTHONPATH
#   build    OFFCACHE_FORCE_CUDA=1 MAX_JOBS=16 setup.py build_ext --inplace
#   gpu      pytest -m gpu (4 workers: they share the GPU; -v -rfE: failing tests named in the summary)
#   tests    the rest of the suite (not gpu, not slow) on the CUDA backend, on every core;
#            in a dry run, only the files that drive the CUDA path's logic; test_bench.py and
#            test_soak.py are left to the bench, kv and soak steps, which run the same code larger
#            (test_weights_properties.py, test_bench_weights.py and test_file_adversarial.py, host
#            backend by design, too; fetch_file's GPU tests are in the gpu step)
#   bench    offcache.bench transfer overlap small pipeline --quick (llm-compressor's cache is
#            the pipeline baseline, from the wheels)
#   weights  offcache.bench weights --quick: offloaded weights (CPU and disk), compressed-tensors'
#            caches against offcache's; its headline judges the weights bars (weight H2D >= 90 %
#            of raw pinned, <= 1 host wait per subgraph and <= 5 % of wall waiting, with prefetch)
#   ranks    offcache.bench weights --ranks 2 --quick: two ranks on the one GPU (gloo), offloaded weights
#            under torch.distributed: compressed-tensors' DistributedCPUCache (left out when /dev/shm
#            has no room), offcache's node region, per-rank copies; node PSS, setup and pinning s/GiB,
#            onload per rank against raw pinned, collectives (the sliced mode's row says it needs 2 GPUs and NCCL: not run)
#   oneshot  llm-compressor's sequential GPTQ W4A16 (--quick: 4 layers of hidden 2048, 64
#            samples), its cache vs offcache, prefetch off/on (its weights-offloaded rows left
#            out, OFFCACHE_BENCH_ONESHOT_WEIGHTS=0: over budget)
#   kv       KV decode: DynamicCache, transformers' offloading, offcache (tokens compared)
#   soak     30000 store/fetch/delete operations
# $OUT gets: summary.txt (one line per step: pass/fail/timeout/skip, seconds, headline
# figures), results.json (every bench section), bandwidth.png, pipeline.png, timeline.png and
# logs.tar.gz (every step's log, the GPU and package versions).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: OUT=DIR bash benchmarks/device_check.sh [--dry-run]" >&2 && exit 2 ;;
esac

T0=$(date +%s)
BUDGET=${DEVCHECK_BUDGET_S:-360}
RESERVE=10 # seconds kept for each step still to come, so that one slow step cannot starve them all
OUT=${OUT:-$ROOT/device-check-out}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/devcheck.XXXXXX)
LOGS=$WORK/logs
BENCH=$WORK/bench
mkdir -p "$LOGS" "$BENCH"
SUMMARY=$WORK/summary.txt
# Named site-packages on purpose: dill, with which datasets fingerprints a dataset, treats
# modules outside the interpreter's prefix whose path lacks "site-packages" as user code and
# pickles them by value (seen failing on pyarrow's types when pyarrow sat in such a folder).
SITE=$WORK/site-packages
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg TQDM_DISABLE=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
if [ "$DRY" = 1 ]; then
  PY=${PYTHON:-$([ -x .venv/bin/python ] && echo "$ROOT/.venv/bin/python" || echo python3)}
  SIZE=--tiny
else
  PY=${PYTHON:-python3}
  SIZE=--quick
  export OFFCACHE_EXPECT_CUDA=1 # test_build_info: the CUDA path must be compiled
fi

finish() {
  {
    echo "total $(($(date +%s) - T0)) s of a ${BUDGET} s budget; $(date -u +%FT%TZ)"
    echo "files: summary.txt results.json bandwidth.png pipeline.png timeline.png logs.tar.gz (logs: one per step)"
  } >>"$SUMMARY"
  cp "$SUMMARY" "$OUT/summary.txt"
  [ -f "$BENCH/results.json" ] && cp "$BENCH/results.json" "$OUT/"
  for png in bandwidth pipeline timeline; do
    [ -f "$BENCH/$png.png" ] && cp "$BENCH/$png.png" "$OUT/"
  done
  tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs
  cat "$OUT/summary.txt"
  rm -rf "$WORK"
}
trap finish EXIT

# Headline figures of a step, from its log or results.json (plain JSON: works without offcache).
cat >"$WORK/headline.py" <<'EOF'
import json, re, sys

what, path = sys.argv[1], sys.argv[2]


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
if what == "tests":
    # pytest -v prints each test's outcome as it ends ("[gw3] [ 4%] FAILED tests/x.py::t" under
    # xdist, "tests/x.py::t FAILED [ 4%]" without), -rfE lists them again at the end ("FAILED
    # tests/x.py::t - why"): the failures are named even when the step is killed at its deadline.
    with open(path, errors="replace") as f:
        log = f.read().splitlines()
    lines = [ln.strip("= ") for ln in log if re.search(r"\d+ (passed|failed|errors?|skipped|deselected).* in [0-9.]+s", ln)]
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
            out.append(f"{d} {top >> 20} MiB {x(o, '.1f')} GB/s{share}")
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
        vs = f", {theirs / ours['wall_s']:.2f}x faster than llm-compressor prefetch" if theirs else ", no llm-compressor"
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
        vs = f" = {rate / ref:.2f}x transformers offloaded" if rate and ref else " (transformers offloaded: failed)"
        ok = "" if not ours.get("completed") else (", tokens equal" if ours.get("equal_to_dynamic") else ", TOKENS DIFFER")
        out.append(f"{case} {ours.get('prompt_tokens')}: {x(rate, '.1f')} tok/s{vs if ours.get('completed') else ' failed'}{ok}")
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
EOF

headline() { "$PY" "$WORK/headline.py" "$@" 2>/dev/null | head -c 1200; }

NAMES=(wheels build gpu tests bench weights ranks oneshot kv soak)
declare -A DEADLINE CMD WHY HEAD
# GPU deadlines: they add up to the budget (tests/bench/test_device_check.py checks it). Sized from the
# first H200 runs (2026-12-04): build 36 s, gpu 69 s on 8 workers, bench 21 s + plots, weights
# over 40 s, oneshot 29 s, kv 37 s, soak 5 s. ranks (not run on a GPU yet) took its 25 s from
# build's, bench's and oneshot's margins.
DEADLINE=([wheels]=5 [build]=48 [gpu]=70 [tests]=75 [bench]=30 [weights]=35 [ranks]=25 [oneshot]=32 [kv]=30 [soak]=10)
# pytest-xdist (carried in .whl/) spreads the suite over the machine's cores; without it, one process.
printf '#!/usr/bin/env bash\n"%s" -c "import xdist" 2>/dev/null && echo "-n $1"\n' "$PY" >"$WORK/xdist"
CMD[wheels]="ls .whl/*.whl >/dev/null 2>&1 || { echo 'no .whl/: run bash scripts/device_wheels.sh before the device run, and carry .whl'; exit 3; }
  '$PY' -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target '$SITE' .whl/*.whl"
CMD[build]="OFFCACHE_FORCE_CUDA=1 MAX_JOBS=16 '$PY' setup.py build_ext --inplace &&
  '$PY' -c 'import json, offcache; info = offcache.build_info(); print(json.dumps(info)); assert info[\"backend\"] == \"cuda\", info' >'$LOGS/build_info.json'"
# -v -rfE: one line per test as it ends and the failures again at the end, so that the summary
# names the failing tests even when a step is killed at its deadline (headline.py reads both).
PYTEST="-m pytest -v -rfE --tb=short -p no:cacheprovider"
CMD[gpu]="'$PY' $PYTEST \$(bash '$WORK/xdist' 8) -m gpu tests"
# The files that drive the CUDA path's scheduling (the dry run runs only these).
CORE_TESTS="tests/engine/test_engine.py tests/engine/test_snapshot.py tests/engine/test_memory.py tests/engine/test_costs.py tests/engine/test_config.py"
if [ "$DRY" = 1 ]; then
  CMD[tests]="'$PY' $PYTEST \$(bash '$WORK/xdist' 2) -m 'not gpu and not slow' $CORE_TESTS"
else
  CMD[tests]="'$PY' $PYTEST \$(bash '$WORK/xdist' \$(nproc)) -m 'not gpu and not slow' tests \
    --ignore=tests/bench/test_bench.py --ignore=tests/bench/test_soak.py \
    --ignore=tests/weights/test_weights_properties.py --ignore=tests/bench/test_bench_weights.py \
    --ignore=tests/engine/test_file_adversarial.py"
fi
CMD[bench]="'$PY' -m offcache.bench transfer overlap small pipeline $SIZE --out '$BENCH'"
CMD[weights]="'$PY' -m offcache.bench weights $SIZE --out '$BENCH'"
CMD[ranks]="'$PY' -m offcache.bench weights --ranks 2 $SIZE --out '$BENCH'"
CMD[oneshot]="CUBLAS_WORKSPACE_CONFIG=:4096:8 OFFCACHE_BENCH_ONESHOT_WEIGHTS=0 '$PY' -m offcache.bench oneshot $SIZE --out '$BENCH'"
CMD[kv]="'$PY' -m offcache.bench kv $SIZE --out '$BENCH'"
CMD[soak]="'$PY' -m offcache.bench soak $SIZE --out '$BENCH'"
HEAD=([wheels]="" [build]="build $LOGS/build_info.json" [gpu]="tests $LOGS/gpu.log" [tests]="tests $LOGS/tests.log"
  [bench]="bench $BENCH/results.json" [weights]="weights $BENCH/results.json" [ranks]="ranks $BENCH/results.json" [oneshot]="oneshot $BENCH/results.json" [kv]="kv $BENCH/results.json"
  [soak]="soak $BENCH/results.json")
if [ "$DRY" = 1 ]; then
  WHY[wheels]="dry run: this Python has the packages (the wheels are for CPython 3.12)"
  WHY[build]="dry run: the in-place build here is used"
  WHY[gpu]="dry run: no GPU"
  # A busy 2-core machine, no build and no GPU steps: the same budget, the time of the skipped
  # steps given to the CPU-bound ones.
  DEADLINE+=([tests]=70 [bench]=40 [weights]=35 [ranks]=45 [oneshot]=60 [kv]=40 [soak]=20)
fi

{
  gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
  echo "offcache device check$([ "$DRY" = 1 ] && echo ' (dry run: no GPU steps, --tiny sizes)') —" \
    "$(date -u +%FT%TZ) — ${gpu:-no GPU} — $(nproc) cores, $(uname -m)"
  printf '%-8s %-8s %5s  %s\n' status step secs headline
} >"$SUMMARY"
{
  nvidia-smi 2>&1 || true
  "$PY" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
  git log -1 --format='commit %H %s' 2>/dev/null || true
} >"$LOGS/env.txt" 2>&1

if [ "$DRY" = 0 ] && ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  echo "no CUDA GPU visible: run this on the lent GPU machine, or here with --dry-run" | tee -a "$SUMMARY" >&2
  exit 2
fi

for i in "${!NAMES[@]}"; do
  name=${NAMES[$i]}
  later=$((${#NAMES[@]} - i - 1))
  start=$(date +%s)
  limit=$((BUDGET - (start - T0) - RESERVE * later))
  [ "$limit" -gt "${DEADLINE[$name]}" ] && limit=${DEADLINE[$name]}
  if [ -n "${WHY[$name]:-}" ]; then
    status=skip
    line=${WHY[$name]}
  elif [ "$limit" -lt 5 ]; then
    status=skip
    line="no time left in the ${BUDGET} s budget"
  else
    echo "== $name (deadline ${limit} s)" >&2
    timeout -k 5 "$limit" bash -c "${CMD[$name]}" >"$LOGS/$name.log" 2>&1
    rc=$?
    case $rc in
      0) status=pass ;;
      124 | 137) status=timeout ;;
      *) status=fail ;;
    esac
    [ "$name" = wheels ] && [ "$rc" = 0 ] && export PYTHONPATH=$PYTHONPATH:$SITE
    # shellcheck disable=SC2086
    line=$([ -n "${HEAD[$name]}" ] && headline ${HEAD[$name]})
    [ "$name" = wheels ] && line="$(find .whl -name '*.whl' 2>/dev/null | wc -l) wheels into $SITE"
    [ "$status" = pass ] || line="exit $rc; ${line:-$(tail -n 1 "$LOGS/$name.log" | head -c 200)}"
    [ "$status" = timeout ] && line="over its ${limit} s deadline; $line"
  fi
  printf '%-8s %-8s %5s  %s\n' "$status" "$name" "$(($(date +%s) - start))" "$line" >>"$SUMMARY"
  if [ "$name" = wheels ]; then # the versions every later step imports
    "$PY" -c 'import importlib.metadata as m
for d in ("torch", "transformers", "accelerate", "llmcompressor", "compressed-tensors", "datasets", "pyarrow",
          "fsspec", "pydantic", "typing_extensions", "hypothesis", "pytest", "matplotlib"):
    try:
        print(d, m.version(d))
    except m.PackageNotFoundError:
        print(d, "missing")' >>"$LOGS/env.txt" 2>&1
  fi
done
# Exit status: 0 when no step failed or overran (skipped steps aside).
! grep -qE '^(fail|timeout) ' "$SUMMARY"
