#!/usr/bin/env bash
# The newest verified transformers (scripts/versions.sh) as an overlay on .venv (same torch build, beside
# llm-compressor's pinned transformers), with the pinned packages it needs beyond .venv's:
# `PYTHONPATH=.venv-tf-newest .venv/bin/python -m pytest ...` runs the KV-cache tests on it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/versions.sh
# shellcheck disable=SC2086  # the pins: one word each
bash scripts/setup_overlay.sh transformers "$OFFCACHE_TF_NEWEST" .venv-tf-newest $OFFCACHE_TF_OVERLAY_PINS
