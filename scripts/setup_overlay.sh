#!/usr/bin/env bash
# One package at another version as an overlay on .venv: `pip install --no-deps --target DIR`, then
# `PYTHONPATH=DIR .venv/bin/python ...` imports it in place of .venv's (same torch build, beside
# llm-compressor's pins). Its other requirements must be .venv's: checked, with a clear error.
# Usage: setup_overlay.sh DIST VERSION DIR (again with the same version it installs nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
DIST=$1 VERSION=$2 DIR=$3
PY="${PYTHON:-.venv/bin/python}"
MODULE=${DIST//-/_}
if ! ls -d "$DIR/$MODULE-$VERSION.dist-info" >/dev/null 2>&1; then
  rm -rf "$DIR"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$DIR" "$DIST==$VERSION"
fi
PYTHONPATH="$DIR" "$PY" - "$DIST" "$MODULE" "$VERSION" "$DIR" <<'PY'
import importlib
import sys
from importlib.metadata import PackageNotFoundError, requires, version

from packaging.requirements import Requirement

dist, module, want, folder = sys.argv[1:]
mod = importlib.import_module(module)
assert mod.__file__.startswith(__import__("os").path.abspath(folder)), mod.__file__
assert version(dist) == want, version(dist)
missing = []
for req in map(Requirement, requires(dist) or []):
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra's requirement
    try:
        if version(req.name) not in req.specifier:
            missing.append(f"{req} (have {version(req.name)})")
    except PackageNotFoundError:
        missing.append(f"{req} (missing)")
if missing:
    sys.exit(f"the base environment lacks what {dist} {want} needs: " + ", ".join(missing))
print(f"{dist} {want} overlay ready in {folder}")
PY
