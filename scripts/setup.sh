#!/usr/bin/env bash
# Makes .venv with torch, llm-compressor and the test tools, builds offcache's engine in
# place (offcache/_C*.so beside the sources) and installs this checkout in editable mode,
# so `python -m offcache.bench` works from the checkout's root and after any `cd`.
# Run again on an unchanged tree it compiles nothing: ninja's build tree in build/ is
# incremental, and setuptools skips an extension newer than its sources and headers. When
# nothing it reads changed since its last run (.venv/.setup-state: the requirements, these
# scripts, the extension's sources and build, what .venv holds), it does nothing at all.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
state() {
  {
    cat requirements.txt requirements-dev.txt scripts/setup*.sh scripts/versions.sh scripts/ext_cache.sh
    echo "tf=${OFFCACHE_TF_NEWEST:-} ct=${OFFCACHE_CT_NEWEST:-} python=$PYTHON"
    find csrc setup.py -type f | LC_ALL=C sort | xargs sha256sum
    ls -l --time-style=+%s offcache/_C*.so 2>&1 || true
    ls .venv/lib/python*/site-packages .venv-tf-newest .venv-ct-newest .ct-tests 2>&1 || true  # what is installed
  } | sha256sum
}
# (A compressed-tensors test suite that could not be downloaded, .ct-tests/*.unavailable, is tried again.)
if [ -x .venv/bin/python ] && [ "$(cat .venv/.setup-state 2>/dev/null)" = "$(state)" ] &&
  ! ls .ct-tests/*.unavailable >/dev/null 2>&1; then
  echo "setup.sh: .venv, the engine and the overlays are up to date (nothing changed since the last setup.sh)"
  exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
# With a CUDA toolkit here, failing to compile the CUDA path is an error, not a fallback.
if [ -e "${CUDA_HOME:-/usr/local/cuda}/include/cuda_runtime_api.h" ]; then export OFFCACHE_FORCE_CUDA=1; fi
# A build of the same sources against the same torch, made by an earlier run on this machine, is
# taken from the cache outside the clone (scripts/ext_cache.sh); else built here and stored.
# The compiler's command lines go to a log, shown only if the build fails.
if ls offcache/_C*.so >/dev/null 2>&1 || ! bash scripts/ext_cache.sh get .venv/bin/python; then
  log=$(mktemp)
  if ! MAX_JOBS=${MAX_JOBS:-$(nproc)} .venv/bin/python setup.py -q build_ext --inplace >"$log" 2>&1; then
    cat "$log" >&2; rm -f "$log"; echo "scripts/setup.sh: building offcache's engine failed (log above)" >&2; exit 1
  fi
  grep '^offcache:' "$log" || true  # e.g. "building the host-only engine: <why>"
  rm -f "$log"
  bash scripts/ext_cache.sh put .venv/bin/python || echo "setup.sh: the build was not cached" >&2
fi
# The editable install only registers the checkout (and the offcache-bench script): the
# engine was just built in place, so it is not compiled a second time here.
if ! .venv/bin/python -m pip show -q offcache >/dev/null 2>&1; then
  OFFCACHE_EDITABLE_NO_BUILD=1 .venv/bin/python -m pip install -q --disable-pip-version-check \
    --no-build-isolation --no-deps -e .
fi
# The newest transformers and compressed-tensors as overlays, for the KV-cache and the weights
# tests (scripts/test.sh runs them on both versions).
bash scripts/setup_tf_newest.sh
bash scripts/setup_ct_newest.sh
# compressed-tensors' own tests from its sdists (tests/weights/test_ct_own_dist_tests.py; without the
# package index a warning, and that test is skipped).
bash scripts/setup_ct_tests.sh
.venv/bin/python -c "import offcache, json; print('offcache', json.dumps(offcache.build_info()))"
state >.venv/.setup-state
