#!/usr/bin/env bash
# The GPU proof in one call, sized for one lease of the H200 (Python 3.12, torch 2.11+cu130,
# nvcc 13.0, 16 cores, no package registry): done in <= 336 s (5.6 min), at most 8 files in $OUT,
# so that a 15-minute lease holds the machine's start-up (~3 min), this check and one rerun.
#
#   OUT=DIR bash benchmarks/device_check.sh            # on the GPU machine (wheels from .whl/)
#   OUT=DIR bash benchmarks/device_check.sh --dry-run  # here, without a GPU: GPU-only steps
#                                                      # skipped, the rest at --tiny sizes
#
# Steps, each under its own deadline (`timeout`) and all under one budget (DEVCHECK_BUDGET_S, 336 s;
# each step leaves 10 s for every planned step after it; the deadlines add up to the budget). Each deadline is
# at least 1.5x what the step took on the H200 (benchmarks/device_check_times.json, with the source of
# every figure; tests/bench/test_device_check.py checks the plan against it), the workload cut where it
# did not fit. A step that overruns is recorded as "timeout" with every number it measured (the bench
# sections write their rows to results.json as they go; pytest -v names each test as it ends), and the
# next one still runs. The order is the value of what they measure: the README's claims and the KV and
# store goals first, then the GPU tests, then the rest. pytest runs with pytest-xdist (carried).
#   wheels   install the carried .whl/ (scripts/device_wheels.sh) into a folder on PYTHONPATH
#   build    OFFCACHE_FORCE_CUDA=1 MAX_JOBS=16 setup.py build_ext --inplace
#   kv       KV decode at 512 and 16384 tokens: DynamicCache, transformers' offloading, offcache (tokens
#            compared; goal >= 1.2x transformers' offloading); OFFCACHE_BENCH_KV_CASES=short,long (the
#            static and memory-limited cases left out: over budget)
#   bench    offcache.bench transfer overlap small pipeline --quick (store-and-drop goal >= 90 % of raw
#            pinned; llm-compressor's cache is the pipeline baseline, from the wheels)
#   oneshot  llm-compressor's sequential GPTQ W4A16 (--quick: 4 layers of hidden 2048, 64 samples), its
#            cache vs offcache, prefetch off/on, after a warm-up, 2 interleaved runs of each
#            (OFFCACHE_BENCH_ONESHOT_REPEATS=2; its weights-offloaded rows left out,
#            OFFCACHE_BENCH_ONESHOT_WEIGHTS=0: over budget)
#   gpu      pytest -m gpu on every core (the workers share the GPU, each capped to its share of its
#            memory by tests/conftest.py): the engine's CUDA paths, the allocator backends, captures, the
#            node region on CUDA, the sliced mode on NCCL (skipped, saying why, below 2 GPUs); -v -rfEs:
#            failing tests named even past the deadline; --durations: each test's time, for the next sizing
#   weights  offcache.bench weights --quick: offloaded weights on the CPU, compressed-tensors' cache
#            against offcache's; its headline judges the weights bars (weight H2D >= 90 % of raw pinned,
#            <= 1 host wait per subgraph and <= 5 % of wall waiting, with prefetch); the disk rows left
#            out (OFFCACHE_BENCH_WEIGHTS_DISK=0: over budget)
#   ranks    offcache.bench weights --ranks 2 --quick: two ranks on the one GPU (gloo), offcache's node
#            region alone (OFFCACHE_BENCH_RANKS_IMPLS=offcache; the peers' rows are host figures, measured
#            on the CPU): node PSS, setup and pinning s/GiB, onload per rank against raw pinned, collectives
#   soak     30000 store/fetch/delete operations, in the time the budget has left (no deadline of its own)
#   tests    then, in what is still left: the files that drive the CUDA
#            path's scheduling (engine, snapshot, memory, costs, config) on the CUDA backend; the whole
#            suite runs in CI on the CPU
# $OUT gets: summary.txt (one line per step: pass/fail/timeout/cut/skip, seconds, headline
# figures), results.json (every bench section), bandwidth.png, pipeline.png, timeline.png and
# logs.tar.gz (every step's log, the GPU and package versions).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: OUT=DIR bash benchmarks/device_check.sh [--dry-run]" >&2 && exit 2 ;;
esac

T0=$(date +%s)
BUDGET=${DEVCHECK_BUDGET_S:-336}
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
headline() { "$PY" "$ROOT/benchmarks/device_check_headline.py" "$@" 2>/dev/null | head -c 1200; }

NAMES=(wheels build kv bench oneshot gpu weights ranks soak tests)
declare -A DEADLINE CMD WHY HEAD
# GPU deadlines: they add up to the budget, each >= 1.5x the step's H200 time in
# benchmarks/device_check_times.json (tests/bench/test_device_check.py checks both). soak and tests: 0,
# they run in whatever time is left.
DEADLINE=([wheels]=2 [build]=54 [kv]=46 [bench]=48 [oneshot]=60 [gpu]=62 [weights]=32 [ranks]=32 [soak]=0 [tests]=0)
# pytest-xdist (carried in .whl/) spreads the suite over the machine's cores; without it, one process.
# shellcheck disable=SC2016  # $1 is the helper's own argument
printf '#!/usr/bin/env bash\n"%s" -c "import xdist" 2>/dev/null && echo "-n $1"\n' "$PY" >"$WORK/xdist"
CMD[wheels]="ls .whl/*.whl >/dev/null 2>&1 || { echo 'no .whl/: run bash scripts/device_wheels.sh before the device run, and carry .whl'; exit 3; }
  '$PY' -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target '$SITE' .whl/*.whl"
CMD[build]="OFFCACHE_FORCE_CUDA=1 MAX_JOBS=16 '$PY' setup.py build_ext --inplace &&
  '$PY' -c 'import json, offcache; info = offcache.build_info(); print(json.dumps(info)); assert info[\"backend\"] == \"cuda\", info' >'$LOGS/build_info.json'"
# -v -rfEs: one line per test as it ends and the failures (and skip reasons) again at the end, so that the
# summary names the failing tests even when a step is killed at its deadline (the headline reads both).
PYTEST="-m pytest -v -rfEs --tb=short -p no:cacheprovider"
CMD[gpu]="'$PY' $PYTEST --durations=40 \$(bash '$WORK/xdist' \$(nproc)) -m gpu tests"
# The files that drive the CUDA path's scheduling.
CORE_TESTS="tests/engine/test_engine.py tests/engine/test_snapshot.py tests/engine/test_memory.py tests/engine/test_costs.py tests/engine/test_config.py"
CMD[tests]="'$PY' $PYTEST \$(bash '$WORK/xdist' \$(nproc)) -m 'not gpu and not slow' $CORE_TESTS"
CMD[bench]="'$PY' -m offcache.bench transfer overlap small pipeline $SIZE --out '$BENCH'"
CMD[weights]="OFFCACHE_BENCH_WEIGHTS_DISK=0 '$PY' -m offcache.bench weights $SIZE --out '$BENCH'"
CMD[ranks]="OFFCACHE_BENCH_RANKS_IMPLS=offcache '$PY' -m offcache.bench weights --ranks 2 $SIZE --out '$BENCH'"
CMD[oneshot]="CUBLAS_WORKSPACE_CONFIG=:4096:8 OFFCACHE_BENCH_ONESHOT_WEIGHTS=0 OFFCACHE_BENCH_ONESHOT_REPEATS=2 '$PY' -m offcache.bench oneshot $SIZE --out '$BENCH'"
CMD[kv]="OFFCACHE_BENCH_KV_CASES=short,long '$PY' -m offcache.bench kv $SIZE --out '$BENCH'"
CMD[soak]="'$PY' -m offcache.bench soak $SIZE --out '$BENCH'"
HEAD=([wheels]="" [build]="build $LOGS/build_info.json" [gpu]="tests $LOGS/gpu.log" [tests]="tests $LOGS/tests.log"
  [bench]="bench $BENCH/results.json" [weights]="weights $BENCH/results.json" [ranks]="ranks $BENCH/results.json" [oneshot]="oneshot $BENCH/results.json" [kv]="kv $BENCH/results.json"
  [soak]="soak $BENCH/results.json")
if [ "$DRY" = 1 ]; then
  WHY[wheels]="dry run: this Python has the packages (the wheels are for CPython 3.12)"
  WHY[build]="dry run: the in-place build here is used"
  WHY[gpu]="dry run: no GPU"
  # A busy 2-core machine, no build and no GPU steps: the same budget, the time of the skipped
  # steps given to the CPU-bound ones (tests again takes what is left).
  DEADLINE+=([kv]=40 [bench]=40 [oneshot]=60 [weights]=45 [ranks]=90)
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
  later=0 # the planned steps after this one (those with a deadline): each is kept RESERVE seconds
  for next in "${NAMES[@]:$((i + 1))}"; do [ "${DEADLINE[$next]}" -gt 0 ] && later=$((later + 1)); done
  start=$(date +%s)
  limit=$((BUDGET - (start - T0) - RESERVE * later))
  # A deadline of 0: the step runs in what the budget has left.
  [ "${DEADLINE[$name]}" -gt 0 ] && [ "$limit" -gt "${DEADLINE[$name]}" ] && limit=${DEADLINE[$name]}
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
    # A step that runs in the time left (deadline 0) may be cut: what it did so far is the result.
    if [ "$status" = timeout ] && [ "${DEADLINE[$name]}" = 0 ] && ! grep -qE '(FAILED|ERROR) ' "$LOGS/$name.log"; then
      status="cut"
    fi
    [ "$name" = wheels ] && [ "$rc" = 0 ] && export PYTHONPATH=$PYTHONPATH:$SITE
    # shellcheck disable=SC2086
    line=$([ -n "${HEAD[$name]}" ] && headline ${HEAD[$name]})
    [ "$name" = wheels ] && line="$(find .whl -name '*.whl' 2>/dev/null | wc -l) wheels into $SITE"
    [ "$status" = pass ] || line="exit $rc; ${line:-$(tail -n 1 "$LOGS/$name.log" | head -c 200)}"
    [ "$status" = timeout ] && line="over its ${limit} s deadline; $line"
    [ "$status" = cut ] && line="stopped at the end of the budget (${limit} s were left); $line"
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
