#!/usr/bin/env bash
# The newest verified compressed-tensors (scripts/versions.sh) as an overlay on .venv (beside
# llm-compressor 0.14.0.1, which pins 0.19.0, as a user who upgrades gets it):
# `PYTHONPATH=.venv-ct-newest .venv/bin/python -m pytest ...` runs the weights tests on it (scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/versions.sh
bash scripts/setup_overlay.sh compressed-tensors "$OFFCACHE_CT_NEWEST" .venv-ct-newest
