#!/usr/bin/env bash
# The newest transformers as an overlay on .venv (same torch build, beside llm-compressor's pinned
# transformers): `PYTHONPATH=.venv-tf-newest .venv/bin/python -m pytest ...` runs the KV-cache tests on it.
# Its other requirements (huggingface-hub, tokenizers, safetensors, ...) are .venv's: checked below.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${OFFCACHE_TF_NEWEST:-5.23.0}"
PY="${PYTHON:-.venv/bin/python}"
# Again on an unchanged tree it installs nothing.
if ! [ -d ".venv-tf-newest/transformers-$VERSION.dist-info" ]; then
  rm -rf .venv-tf-newest
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --target .venv-tf-newest "transformers==$VERSION"
fi
PYTHONPATH=.venv-tf-newest "$PY" - "$VERSION" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, requires, version

import transformers
from packaging.requirements import Requirement

assert transformers.__version__ == sys.argv[1], transformers.__version__
missing = []
for req in map(Requirement, requires("transformers") or []):
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra's requirement
    try:
        if version(req.name) not in req.specifier:
            missing.append(f"{req} (have {version(req.name)})")
    except PackageNotFoundError:
        missing.append(f"{req} (missing)")
if missing:
    sys.exit("the base environment lacks what transformers needs: " + ", ".join(missing))
print(f"transformers {transformers.__version__} overlay ready in .venv-tf-newest")
PY
