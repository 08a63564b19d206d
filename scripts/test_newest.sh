#!/usr/bin/env bash
# The suite on the newest environment (scripts/setup_newest.sh: the newest torch and transformers,
# offcache built against them, no llm-compressor and no compressed-tensors): everything that does
# not need those two runs; what needs them is skipped, with the reason. Run from the copy of the
# clone that setup_newest.sh keeps (the clone's own offcache/_C*.so is torch 2.14's).
# Arguments, if any, replace `tests` (e.g. a file or a node id).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${OFFCACHE_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/offcache-ci}"
VENV="$CACHE/venv-newest"
[ -x "$VENV/bin/python" ] || { echo "test_newest.sh: run scripts/setup_newest.sh first" >&2; exit 1; }
TORCH=$("$VENV/bin/python" -c "import torch; print(torch.__version__)")
TF=$("$VENV/bin/python" -c "import transformers; print(transformers.__version__)")
TREE="$CACHE/tree-torch$TORCH"
cd "$TREE"
# offcache is not installed in this environment: the tree's copy is imported, by pytest and by the
# interpreters the tests start (cwd a temporary folder).
export PYTHONPATH="$TREE${PYTHONPATH:+:$PYTHONPATH}"
if [ -e "${CUDA_HOME:-/usr/local/cuda}/include/cuda_runtime_api.h" ]; then export OFFCACHE_EXPECT_CUDA=1; fi
echo "== pytest (newest: torch $TORCH, transformers $TF, no llm-compressor, no compressed-tensors) in $TREE"
start=$SECONDS
# The slowed and disk engine configurations test the engine's scheduling, which the pinned run
# covers on the same sources; here the point is the newest torch and transformers.
"$VENV/bin/python" -m pytest -p no:cacheprovider -q -rs -k "not host-1MiB-slow and not host-disk" "${@:-tests}" |
  tee "$CACHE/test_newest.log"
echo "== pytest (newest): passed in $((SECONDS - start)) s"
