#!/usr/bin/env bash
# The one-call GPU check for a lent machine (H200 image: Python 3.12, torch
# 2.11+cu130, nvcc 13.0, no package registry). Builds the extension in place,
# runs the GPU-marked tests and the rest of the suite on the CUDA backend, runs
# the benchmark and a short soak, copies results to $OUT and prints a summary.
# Budget: <= 8 minutes. BENCH_ARGS defaults to --quick.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "device_check: no CUDA GPU is visible here; run this on the lent GPU machine." >&2
  exit 2
fi
OUT=${OUT:-benchmarks/results/device-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,memory.total \
  --format=csv | tee "$OUT/gpu.txt"

# Wheels carried in .whl/ (llm-compressor for its baseline), installed aside.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -c "import llmcompressor" 2>/dev/null \
  || echo "device_check: llm-compressor is not importable here; its pipeline baseline is skipped" | tee -a "$OUT/notes.txt"

echo "== build"
OFFCACHE_FORCE_CUDA=1 MAX_JOBS=16 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; exit 1; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import offcache; print(offcache.build_info())" | tee "$OUT/build_info.txt"

echo "== tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests -m gpu 2>&1 | tee "$OUT/tests-gpu.log" | tail -5
gpu_tests=${PIPESTATUS[0]}
timeout 240 python3 -m pytest -q -p no:cacheprovider tests -m "not gpu and not slow" -x 2>&1 \
  | tee "$OUT/tests-rest.log" | tail -3
rest_tests=${PIPESTATUS[0]}

echo "== bench"
timeout 300 python3 -m offcache.bench ${BENCH_ARGS:---quick} --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -25
bench=${PIPESTATUS[0]}
timeout 60 python3 benchmarks/soak.py --ops 30000 --json "$OUT/soak.json" | tail -1

echo "== summary ($(( $(date +%s) - start )) s)"
printf '%-12s %s\n' "gpu tests" "exit $gpu_tests" "other tests" "exit $rest_tests" "bench" "exit $bench" \
  "results" "$OUT/results.json"
[ "$gpu_tests" = 0 ] && [ "$rest_tests" = 0 ] && [ "$bench" = 0 ]
