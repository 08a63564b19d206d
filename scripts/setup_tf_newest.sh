#!/usr/bin/env bash
# The newest transformers as an overlay on .venv (same torch build, beside llm-compressor's pinned
# transformers): `PYTHONPATH=.venv-tf-newest .venv/bin/python -m pytest ...` runs the KV-cache tests on it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_overlay.sh transformers "${OFFCACHE_TF_NEWEST:-5.24.0}" .venv-tf-newest
