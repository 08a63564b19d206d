#!/usr/bin/env bash
# Makes .venv with torch, llm-compressor and the test tools, builds offcache's engine in
# place (offcache/_C*.so beside the sources) and installs this checkout in editable mode,
# so `python -m offcache.bench` works from the checkout's root and after any `cd`.
# Run again on an unchanged tree it compiles nothing: ninja's build tree in build/ is
# incremental, and setuptools skips an extension newer than its sources and headers.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
# With a CUDA toolkit here, failing to compile the CUDA path is an error, not a fallback.
if [ -e "${CUDA_HOME:-/usr/local/cuda}/include/cuda_runtime_api.h" ]; then export OFFCACHE_FORCE_CUDA=1; fi
# The compiler's command lines go to a log, shown only if the build fails.
log=$(mktemp)
if ! MAX_JOBS=${MAX_JOBS:-$(nproc)} .venv/bin/python setup.py -q build_ext --inplace >"$log" 2>&1; then
  cat "$log" >&2; rm -f "$log"; echo "scripts/setup.sh: building offcache's engine failed (log above)" >&2; exit 1
fi
grep '^offcache:' "$log" || true  # e.g. "building the host-only engine: <why>"
rm -f "$log"
# The editable install only registers the checkout (and the offcache-bench script): the
# engine was just built in place, so it is not compiled a second time here.
if ! .venv/bin/python -m pip show -q offcache >/dev/null 2>&1; then
  OFFCACHE_EDITABLE_NO_BUILD=1 .venv/bin/python -m pip install -q --disable-pip-version-check \
    --no-build-isolation --no-deps -e .
fi
# The newest transformers as an overlay, for the KV-cache tests (scripts/test.sh runs them on both).
bash scripts/setup_tf_newest.sh
.venv/bin/python -c "import offcache, json; print('offcache', json.dumps(offcache.build_info()))"
