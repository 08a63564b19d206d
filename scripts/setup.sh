#!/usr/bin/env bash
# Creates .venv with torch, llm-compressor and the test tools, then builds and
# installs offcache into it (pip install --no-build-isolation .).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
# With a CUDA toolkit here, failing to compile the CUDA path is an error, not a fallback.
if [ -e "${CUDA_HOME:-/usr/local/cuda}/include/cuda_runtime_api.h" ]; then export OFFCACHE_FORCE_CUDA=1; fi
MAX_JOBS=${MAX_JOBS:-$(nproc)} .venv/bin/python -m pip install -q --disable-pip-version-check \
  --no-build-isolation --no-deps .
# -I: not from the source tree (which has no compiled engine), from the installed package.
.venv/bin/python -I -c "import offcache, json; print('offcache', json.dumps(offcache.build_info()))"
