#!/usr/bin/env bash
# Runs on the GPU machine (the device tool): builds there, then runs the whole GPU suite and
# writes logs under $OUT. Usage: bash scripts/device_gpu_suite.sh [extra steps...]
#   steps: unit gpu golden bench bench-cpu sanitize  (default: all but bench-cpu)
set -uo pipefail
OUT=${OUT:-/tmp/rope_jit_out}
mkdir -p "$OUT"
steps=${*:-unit gpu golden bench sanitize}
# dlpack is not installed there: unpack Debian's package carried in .deb/.
mkdir -p /tmp/dlpack && for f in .deb/libdlpack-dev_*.deb; do dpkg -x "$f" /tmp/dlpack; done
export ROPE_JIT_CACHE_DIR=/tmp/rope_jit_cache
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  git log -1 --format='commit %H %s' 2>/dev/null || true
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH=/tmp/dlpack/usr >/dev/null &&
    cmake --build build-gpu -j16 2>&1 | grep -E "warning|error" ; echo "build rc=${PIPESTATUS[0]}"
} 2>&1 | tee "$OUT/build.log"
for step in $steps; do
  case $step in
    unit) build-gpu/tests/rope_jit_tests --test-suite-exclude=gpu 2>&1 | tail -5 | tee "$OUT/unit.log" ;;
    gpu) build-gpu/tests/rope_jit_tests --test-suite=gpu --duration=true 2>&1 | tee "$OUT/gpu.log" | tail -60 ;;
    golden) build-gpu/tools/rope-jit-golden tests/golden --backend cuda --ops rope 2>&1 | tee "$OUT/golden_cuda.log" | tail -30 ;;
    # The driver test that asks for a device past the last one on purpose is left out: the
    # sanitizer reports that deliberate API error as an error.
    sanitize) timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 build-gpu/tests/rope_jit_tests \
                --test-suite=gpu --test-case-exclude="*names the device's target*" > "$OUT/sanitizer_memcheck.log" 2>&1; echo "compute-sanitizer rc=$?" >> "$OUT/sanitizer_memcheck.log"
              tail -15 "$OUT/sanitizer_memcheck.log" ;;
    bench) build-gpu/tools/rope-jit-bench --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" ;;
    bench-cpu) build-gpu/tools/rope-jit-bench --backend cpu --json "$OUT/bench_cpu.json" 2>&1 | tee "$OUT/bench_cpu.log" ;;
  esac
done
