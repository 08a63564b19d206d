#!/usr/bin/env bash
# A cache of built extensions (offcache/_C*.so) outside the clone, so that a CI run on a machine
# that built the same extension before skips its build (minutes on 2 cores).
# Usage, from a tree's root: ext_cache.sh get PYTHON   (copies a cached build in; fails on a miss)
#                            ext_cache.sh put PYTHON   (stores offcache/_C*.so and _C_build.json)
# The key: the torch version and CUDA variant, Python's version, the CUDA toolkit, whether CUDA is
# forced, and the bytes of everything the extension is built from (csrc/, setup.py).
# OFFCACHE_CI_CACHE (default ~/.cache/offcache-ci) is the cache's folder; OFFCACHE_EXT_CACHE=0 turns it off.
set -euo pipefail
ACTION=$1 PY=$2
[ "${OFFCACHE_EXT_CACHE:-1}" != 0 ] || exit 1
CACHE="${OFFCACHE_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/offcache-ci}"
KEY=$( {
  "$PY" -c "import sys, torch; print(torch.__version__, torch.version.cuda, sys.version)"
  echo "force-cuda=${OFFCACHE_FORCE_CUDA:-}"
  cat "${CUDA_HOME:-/usr/local/cuda}/version.json" 2>/dev/null || true
  find csrc setup.py -type f | LC_ALL=C sort | xargs sha256sum
} | sha256sum | cut -c1-16)
DIR="$CACHE/ext/$KEY"
case "$ACTION" in
  get)
    ls "$DIR"/_C*.so >/dev/null 2>&1 || exit 1
    cp "$DIR"/_C* offcache/  # newer than the sources: setuptools' build_ext then skips it (with _C_build.json)
    echo "ext_cache.sh: offcache/_C from the cache ($DIR)"
    ;;
  put)
    mkdir -p "$DIR.tmp$$" && cp offcache/_C*.so "$DIR.tmp$$/"
    [ ! -e offcache/_C_build.json ] || cp offcache/_C_build.json "$DIR.tmp$$/"  # the torch it was built against
    rm -rf "$DIR" && mv "$DIR.tmp$$" "$DIR"
    echo "ext_cache.sh: offcache/_C stored in $DIR"
    ;;
  *) echo "ext_cache.sh: get or put, not $ACTION" >&2; exit 2 ;;
esac
