#!/usr/bin/env bash
# One package at another version as an overlay on .venv: `pip install --no-deps --target DIR`, then
# `PYTHONPATH=DIR .venv/bin/python ...` imports it in place of .venv's (same torch build, beside
# llm-compressor's pins). PINS (DIST==VERSION each) go into DIR too: what it needs that .venv lacks, at
# fixed versions (scripts/versions.sh), never the index's newest. Every requirement of what DIR holds
# must then be met, by DIR or .venv: checked, with a clear error naming what is missing.
# Usage: setup_overlay.sh DIST VERSION DIR [PINS...] (again with the same arguments it installs nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
DIST=$1 VERSION=$2 DIR=$3
shift 3
PY="${PYTHON:-.venv/bin/python}"
MODULE=${DIST//-/_}
SPEC="$DIST==$VERSION $*"
if ! ls -d "$DIR/$MODULE-$VERSION.dist-info" >/dev/null 2>&1 || [ "$(cat "$DIR/.overlay-spec" 2>/dev/null)" != "$SPEC" ]; then
  rm -rf "$DIR"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$DIR" "$DIST==$VERSION" "$@"
  echo "$SPEC" >"$DIR/.overlay-spec"
fi
PYTHONPATH="$DIR" "$PY" - "$DIST" "$MODULE" "$VERSION" "$DIR" <<'PY'
import importlib
import os
import sys
from importlib.metadata import PackageNotFoundError, distributions, requires, version

from packaging.requirements import Requirement

dist, module, want, folder = sys.argv[1:]
assert version(dist) == want, version(dist)
in_folder = {d.metadata["Name"] for d in distributions(path=[folder])}  # the package and its pins
missing = []
for name in sorted(in_folder):
    for req in map(Requirement, requires(name) or []):
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement, or another platform's
        try:
            if not req.specifier.contains(version(req.name), prereleases=True):
                missing.append(f"{req} for {name} (have {version(req.name)})")
        except PackageNotFoundError:
            missing.append(f"{req} for {name} (missing)")
if missing:
    sys.exit(f"the base environment lacks what {dist} {want} needs (pin it in scripts/versions.sh): " + ", ".join(missing))
mod = importlib.import_module(module)  # after the check: a missing requirement fails its import less clearly
assert mod.__file__.startswith(os.path.abspath(folder)), mod.__file__
print(f"{dist} {want} overlay ready in {folder}" + (f" (with {', '.join(sorted(in_folder - {dist}))})" if len(in_folder) > 1 else ""))
PY
