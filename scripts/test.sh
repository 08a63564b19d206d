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

.venv/bin/ruff check setup.py offcache tests benchmarks
.venv/bin/ruff format --check setup.py offcache tests benchmarks
clang-format --dry-run --Werror csrc/*.cpp csrc/*.h csrc/core/*.cpp csrc/core/*.h cpp_tests/*.cpp

for san in none address thread; do
  dir=build/core-$san
  flag=$([ "$san" = none ] && echo "" || echo "$san")
  cmake -S . -B "$dir" -DOFFCACHE_SANITIZE="$flag" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$dir" -j "$(nproc)" >/dev/null
  echo "ctest ($san):"
  # TSan needs a non-randomised address space on some kernels.
  if [ "$san" = thread ] && command -v setarch >/dev/null; then
    setarch "$(uname -m)" -R ctest --test-dir "$dir" --output-on-failure
  else
    ctest --test-dir "$dir" --output-on-failure
  fi
done

if [ -e "${CUDA_HOME:-/usr/local/cuda}/include/cuda_runtime_api.h" ]; then export OFFCACHE_EXPECT_CUDA=1; fi
.venv/bin/python -m pytest -p no:cacheprovider -q tests "$@"
# The KV caches again on the newest transformers (overlay made by scripts/setup_tf_newest.sh).
# The slowed and disk engine configurations test the engine, which the run above covered.
if [ -d .venv-tf-newest ]; then
  PYTHONPATH=.venv-tf-newest .venv/bin/python -m pytest -p no:cacheprovider -q \
    tests/test_kv_cache.py tests/test_static_kv_cache.py tests/test_kv_layer_kinds.py \
    -k "not host-1MiB-slow and not host-disk"
fi
