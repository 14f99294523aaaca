#!/usr/bin/env bash
# The test command: installs dependencies, builds twice (optimized, then with ASan+UBSan) and
# runs every CPU test (doctest suites, golden cases, the README example) in each build.
# GPU tests (doctest suite "gpu") need a GPU and run on the device machine, not here.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
jobs=$(nproc)

cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DROPE_JIT_WERROR=ON >/dev/null
cmake --build build -j"$jobs"
ctest --test-dir build --output-on-failure

cmake -S . -B build-sanitize -DCMAKE_BUILD_TYPE=Debug -DROPE_JIT_SANITIZE=ON -DROPE_JIT_WERROR=ON >/dev/null
cmake --build build-sanitize -j"$jobs"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-sanitize --output-on-failure
