#!/usr/bin/env bash
# The releases that CI and the README's test command call "newest", in this one place (sourced by
# scripts/setup_tf_newest.sh, setup_ct_newest.sh, setup_newest.sh, setup.sh and .ci/run). Each is a
# verified release: the suites it runs passed on it before it was written here. A newer one on the index
# changes nothing until then; .ci/run prints a one-line notice for it (`newest_notice`), never a failure.
# Policy (docs/configuration.md, "Newest releases"): a new upstream release that breaks the newest stage
# is fixed before anything else; a fix bigger than a small change first pins the stage to the last
# verified release, in one commit that says why, and ships next.
# An environment variable of the same name overrides one for a run, e.g. OFFCACHE_TF_NEWEST=5.26.0 to try one.
OFFCACHE_TORCH_NEWEST=${OFFCACHE_TORCH_NEWEST:-2.15.0}  # the newest stage's torch (offcache built against it)
OFFCACHE_TF_NEWEST=${OFFCACHE_TF_NEWEST:-5.25.0}        # the newest stage's transformers, and .venv's overlay
OFFCACHE_CT_NEWEST=${OFFCACHE_CT_NEWEST:-0.20.1}        # compressed-tensors' overlay on .venv
# What the transformers overlay needs beyond .venv's packages (llm-compressor's, with huggingface-hub 1.x):
# transformers 5.25 requires huggingface-hub >= 2.4 and kernels, and those their own. Pinned, so that the
# README's test command never depends on what the index holds that day.
OFFCACHE_TF_OVERLAY_PINS=${OFFCACHE_TF_OVERLAY_PINS:-"huggingface-hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 \
truststore==0.10.5 kernels==0.19.1 tomlkit==0.15.3"}

# newest_notice [PYTHON]: one line per package with a release on the index newer than the verified one
# (nothing when the index cannot be reached: a notice, not a check).
newest_notice() {
  local py=${1:-python3} pkg want have
  for pkg in torch:$OFFCACHE_TORCH_NEWEST transformers:$OFFCACHE_TF_NEWEST compressed-tensors:$OFFCACHE_CT_NEWEST; do
    want=${pkg#*:} pkg=${pkg%%:*}
    # This machine's pip caps torch at the releases on its disk (/etc/xdg/pip): lifted for the query.
    have=$(PIP_CONSTRAINT=/dev/null timeout 60 "$py" -m pip index versions --disable-pip-version-check "$pkg" \
      2>/dev/null | sed -n 's/^[^ ]* (\([^)]*\)).*/\1/p' | head -1) || true
    if [ -n "$have" ] && [ "$have" != "$want" ] && [ "$(printf '%s\n%s\n' "$want" "$have" | sort -V | tail -1)" = "$have" ]; then
      echo "notice: $pkg $have is on the index, newer than the verified $want (scripts/versions.sh): not used until verified"
    fi
  done
}
