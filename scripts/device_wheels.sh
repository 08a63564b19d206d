#!/usr/bin/env bash
# Fills .whl/ (ignored by git) with the wheels that the lent GPU machine lacks, for
# benchmarks/device_check.sh: that machine has Python 3.12, torch 2.11.0+cu130, transformers
# 5.17, accelerate, pyarrow, pandas, fsspec, xxhash, psutil, pytest and matplotlib, but no
# package registry. Run it here, where pip reaches PyPI; the device run carries .whl/.
#
# Only what llm-compressor 0.14.0.1 imports to run `oneshot` (traced with sys.modules after
# a real run) and is missing there, each pinned to the version the tests use here, with
# --no-deps: nothing else is fetched.
#
#   PYVER=3.11 DEST=/tmp/whl311 bash scripts/device_wheels.sh   # the same set for another Python
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-.whl}
PYVER=${PYVER:-3.12}
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

WHEELS=(
  llmcompressor==0.14.0.1     # the baseline IntermediatesCache and oneshot
  compressed-tensors==0.19.0  # llm-compressor's quantization schemes (it pins this version)
  loguru==0.7.3               # llm-compressor's and compressed-tensors' logging
  pydantic==2.14.4            # compressed-tensors' and llm-compressor's configs ...
  pydantic-core==2.50.5       # ... its compiled core (the one binary wheel here) ...
  annotated-types==0.8.0      # ... and its two small dependencies
  typing-inspection==0.4.5
  typing-extensions==4.16.0   # pydantic 2.14 needs >= 4.16; the machine's may be older (additive, safe to shadow)
  datasets==5.2.0             # oneshot's calibration set (pyarrow, pandas, xxhash, fsspec: on the machine)
  dill==0.4.1                 # datasets' hashing and pickling ...
  multiprocess==0.70.19       # ... and its process pool
  hypothesis==6.170.17        # the property tests, at the version CI runs
  pytest-xdist==3.8.0         # the device check's test steps on every core ...
  execnet==2.1.2              # ... and its process pool
)

mkdir -p "$DEST"
rm -f "$DEST"/*.whl # one version of each: two versions of a package stop the whole install there
"$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" "${WHEELS[@]}"

# One wheel per name, and as many as were asked for.
names=$(for f in "$DEST"/*.whl; do basename "$f" | cut -d- -f1 | tr '[:upper:]' '[:lower:]' | tr . _; done)
if [ "$(echo "$names" | sort | uniq -d)" ] || [ "$(echo "$names" | wc -l)" -ne "${#WHEELS[@]}" ]; then
  echo "device_wheels: expected ${#WHEELS[@]} wheels, one per package; found:" >&2
  ls "$DEST" >&2
  exit 1
fi
ls -s --block-size=K "$DEST"/*.whl | sed 's#  *# #'
echo "device_wheels: ${#WHEELS[@]} wheels for CPython $PYVER in $DEST, $(du -ch "$DEST"/*.whl | tail -1 | cut -f1) in all"
