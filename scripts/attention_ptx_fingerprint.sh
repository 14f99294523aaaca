#!/usr/bin/env bash
# Checks that the attention templates still generate the PTX recorded in
# tests/attention_ptx_fingerprints.txt (NVRTC only, no GPU). Run it after every edit of
# kernels_templates/attention*: "0 with other instructions" means the same code.
# --update records the current fingerprints instead (after an intended change of the code).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${BUILD_DIR:-$root/build}"
cmake --build "$build" --target attention-ptx-fingerprint -j2 > /dev/null
tool="$build/tests/attention-ptx-fingerprint"
if [[ "${1:-}" == "--update" ]]; then
  "$tool" > "$root/tests/attention_ptx_fingerprints.txt"
else
  "$tool" --check "$root/tests/attention_ptx_fingerprints.txt"
fi
