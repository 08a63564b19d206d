#!/usr/bin/env bash
# Runs every check: lint, the C++ core's GoogleTest suite (plain, ASan/UBSan,
# TSan) with ctest, and the Python suite against the engine that
# scripts/setup.sh built in place. Needs .venv from scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! [ -e /usr/include/gtest/gtest.h ] || ! command -v cmake >/dev/null || ! command -v clang-format >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq libgtest-dev cmake clang-format >/dev/null
  else
    echo "test.sh: needs GoogleTest, cmake and clang-format: apt-get install libgtest-dev cmake clang-format" >&2
    exit 1
  fi
fi

# Each stage prints what it runs and, once it passed, how long it took.
stage() {
  local name=$1 start=$SECONDS
  shift
  echo "== $name: $*"
  "$@"
  echo "== $name: passed in $((SECONDS - start)) s"
}

stage "lint (ruff)" .venv/bin/ruff check setup.py offcache tests benchmarks
stage "lint (ruff format)" .venv/bin/ruff format --check setup.py offcache tests benchmarks
stage "lint (clang-format)" clang-format --dry-run --Werror csrc/*.cpp csrc/*/*.cpp csrc/*/*.h cpp_tests/*.cpp

for san in none address thread; do
  dir=build/core-$san
  flag=$([ "$san" = none ] && echo "" || echo "$san")
  stage "build C++ core ($san)" bash -c "cmake -S . -B '$dir' -DOFFCACHE_SANITIZE='$flag' \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null && cmake --build '$dir' -j '$(nproc)' >/dev/null"
  # TSan needs a non-randomised address space on some kernels.
  if [ "$san" = thread ] && command -v setarch >/dev/null; then
    stage "ctest ($san)" setarch "$(uname -m)" -R ctest --test-dir "$dir" --output-on-failure
  else
    stage "ctest ($san)" ctest --test-dir "$dir" --output-on-failure
  fi
done

if [ -e "${CUDA_HOME:-/usr/local/cuda}/include/cuda_runtime_api.h" ]; then export OFFCACHE_EXPECT_CUDA=1; fi
stage "pytest (pinned: torch 2.14, llm-compressor 0.14.0.1, compressed-tensors 0.19, transformers 5.17)" \
  .venv/bin/python -m pytest -p no:cacheprovider -q tests "$@"
# The KV caches again on the newest transformers (overlay made by scripts/setup_tf_newest.sh).
# The slowed and disk engine configurations test the engine, which the run above covered.
if [ -d .venv-tf-newest ]; then
  stage "pytest KV caches (transformers overlay $(ls -d .venv-tf-newest/transformers-*.dist-info | sed 's/.*transformers-//; s/.dist-info//'))" \
    env PYTHONPATH=.venv-tf-newest .venv/bin/python -m pytest -p no:cacheprovider -q \
    tests/kv \
    -k "not host-1MiB-slow and not host-disk"
fi
# The weights on the newest compressed-tensors (overlay made by scripts/setup_ct_newest.sh), beside
# llm-compressor's pinned 0.19: its staging API and the drift guard's view of it included. The
# one-third cgroup run (minutes) runs once, above: test_past_ram's runs cover the same load,
# calibration and save on this overlay.
if [ -d .venv-ct-newest ]; then
  stage "pytest weights (compressed-tensors overlay $(ls -d .venv-ct-newest/compressed_tensors-*.dist-info | sed 's/.*tensors-//; s/.dist-info//'))" \
    env PYTHONPATH=.venv-ct-newest .venv/bin/python -m pytest -p no:cacheprovider -q \
    tests/weights --deselect tests/weights/memory/test_one_third.py
fi
