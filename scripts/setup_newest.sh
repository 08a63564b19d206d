#!/usr/bin/env bash
# The newest environment: the newest verified torch and transformers (scripts/versions.sh: pinned there,
# not whatever the index holds that day), no llm-compressor and no compressed-tensors (their pins exclude
# these releases), offcache built against that torch.
# scripts/test_newest.sh runs the suite on it (what needs llm-compressor or compressed-tensors skips).
#
# Everything lives outside the clone, under $OFFCACHE_CI_CACHE (default ~/.cache/offcache-ci), so
# that later CI runs on the same machine reuse it:
#   venv-newest/                the virtual environment (upgraded in place when a release appears)
#   tree-torch<V>/              a copy of the clone's files (only changed files rewritten, so the
#                               extension's ninja build in its build/ folder stays incremental)
#   ext/<key>/                  built extensions (scripts/ext_cache.sh), keyed by torch version,
#                               Python and a hash of what they are built from: a hit skips the build
# The clone's own offcache/_C*.so (torch 2.14's) is never touched.
# Prints the tree's path on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE="${OFFCACHE_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/offcache-ci}"
VENV="$CACHE/venv-newest"
PYTHON=${PYTHON:-python3}
mkdir -p "$CACHE"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# This machine's pip caps torch at the releases on its disk (/etc/xdg/pip's constraints file): this
# environment asks the index for newer ones, so the constraint is lifted for these installs only.
export PIP_CONSTRAINT=/dev/null
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# Versions: the verified ones (scripts/versions.sh; OFFCACHE_TORCH_NEWEST / OFFCACHE_TF_NEWEST override them).
source "$ROOT/scripts/versions.sh"
TORCH_REQ="torch==$OFFCACHE_TORCH_NEWEST"
TF_REQ="transformers==$OFFCACHE_TF_NEWEST"
# Only torch and transformers are moved to those versions; the tools are taken as installed.
"${PIP[@]}" --upgrade --upgrade-strategy only-if-needed "$TORCH_REQ" "$TF_REQ"
"${PIP[@]}" setuptools wheel pybind11 ninja pytest hypothesis tqdm matplotlib safetensors nvidia-ml-py
for pkg in llmcompressor compressed-tensors; do
  if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1; then
    echo "setup_newest.sh: $pkg is installed in $VENV; this environment must run without it" >&2
    exit 1
  fi
done
TORCH=$("$VENV/bin/python" -c "import torch; print(torch.__version__)")
TF=$("$VENV/bin/python" -c "import transformers; print(transformers.__version__)")
if [ "${TORCH%%+*}" != "$OFFCACHE_TORCH_NEWEST" ] || [ "$TF" != "$OFFCACHE_TF_NEWEST" ]; then  # a local label (+cpu) aside
  echo "setup_newest.sh: $VENV has torch $TORCH and transformers $TF, not the pinned $OFFCACHE_TORCH_NEWEST and $OFFCACHE_TF_NEWEST" >&2
  exit 1
fi

# The clone's files (tracked, and untracked ones git does not ignore), synced by content.
TREE="$CACHE/tree-torch$TORCH"
"$VENV/bin/python" - "$ROOT" "$TREE" <<'PY'
import filecmp, os, shutil, subprocess, sys

root, tree = sys.argv[1:]
files = subprocess.run(["git", "-C", root, "ls-files", "-co", "--exclude-standard", "-z"],
                       check=True, capture_output=True).stdout.decode().split("\0")
files = {f for f in files if f and os.path.isfile(os.path.join(root, f))}
for f in files:
    src, dst = os.path.join(root, f), os.path.join(tree, f)
    if not (os.path.exists(dst) and filecmp.cmp(src, dst, shallow=False)):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst)  # a new mtime: ninja rebuilds what depends on it
for d in ("offcache", "tests", "csrc", "benchmarks", "scripts", "cpp_tests"):  # files removed since
    for dirpath, _, names in os.walk(os.path.join(tree, d)):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), tree)
            if rel not in files and not name.endswith((".so", ".pyc")):
                os.remove(os.path.join(tree, rel))
PY

# The extension: from the cache when torch, Python and its sources are unchanged, else built here.
cd "$TREE"
if [ -e "${CUDA_HOME:-/usr/local/cuda}/include/cuda_runtime_api.h" ]; then export OFFCACHE_FORCE_CUDA=1; fi
if ! bash scripts/ext_cache.sh get "$VENV/bin/python"; then
  rm -f offcache/_C*.so
  start=$SECONDS
  MAX_JOBS=${MAX_JOBS:-$(nproc)} "$VENV/bin/python" setup.py -q build_ext --inplace
  echo "setup_newest.sh: extension for torch $TORCH built in $((SECONDS - start)) s"
  bash scripts/ext_cache.sh put "$VENV/bin/python"
fi
"$VENV/bin/python" -c "import offcache, json; print('offcache (newest)', json.dumps(offcache.build_info()))"
echo "setup_newest.sh: torch $TORCH, transformers $TF, no llm-compressor, no compressed-tensors"
echo "$TREE"
