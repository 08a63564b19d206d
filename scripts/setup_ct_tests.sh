#!/usr/bin/env bash
# compressed-tensors' own test suite, from its sdist on the package index, for
# tests/weights/test_ct_own_dist_tests.py (its distributed cache tests run with offcache's classes
# substituted). For .venv's compressed-tensors and the overlay's (scripts/versions.sh), each into
# .ct-tests/VERSION/ (tests/ and pyproject.toml, its pytest settings; git-ignored, never committed).
# Without the index (no network) it warns and writes .ct-tests/VERSION.unavailable with the reason:
# the test is then skipped saying so, and the next scripts/setup.sh tries again.
# Again with the suite in place it downloads nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/versions.sh
PY="${PYTHON:-.venv/bin/python}"
pinned=$("$PY" -c "import importlib.metadata as m; print(m.version('compressed-tensors'))" 2>/dev/null) || pinned=""
mkdir -p .ct-tests
for version in $pinned $OFFCACHE_CT_NEWEST; do
  dest=.ct-tests/$version
  [ -e "$dest/tests/test_offload/cache/test_dist_cpu.py" ] && continue
  tmp=$(mktemp -d)
  if timeout 300 "$PY" -m pip download -q --disable-pip-version-check --no-binary :all: --no-deps \
    "compressed-tensors==$version" -d "$tmp" >"$tmp/log" 2>&1 &&
    tar xzf "$tmp"/compressed_tensors-"$version".tar.gz -C "$tmp" \
      "compressed_tensors-$version/tests" "compressed_tensors-$version/pyproject.toml" 2>>"$tmp/log"; then
    rm -rf "$dest" "$dest.unavailable"
    mv "$tmp/compressed_tensors-$version" "$dest"
    echo "compressed-tensors $version's own tests in $dest"
  else
    why=$(grep -v '^WARNING' "$tmp/log" | tail -1)
    echo "pip download of the compressed-tensors $version sdist failed (no package index?): ${why:-no output}" >"$dest.unavailable"
    echo "setup_ct_tests.sh: warning: $(cat "$dest.unavailable"); tests/weights/test_ct_own_dist_tests.py is skipped" >&2
  fi
  rm -rf "$tmp"
done
exit 0
