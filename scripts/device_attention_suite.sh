#!/usr/bin/env bash
# Runs on the GPU machine (the device tool): builds the library, the tests and the golden runner
# there, then the attention GPU tests, the golden attention cases on CUDA and the attention
# benchmark, with logs under $OUT. Usage: bash scripts/device_attention_suite.sh [steps...]
#   steps: test golden sanitize rope cold bench bench-all bench-quick bench-headline bench-issue bench-variants bench-tuned bench-d64-d256 profile
#   (default: test golden bench-quick; ATTENTION_TESTS narrows the test step's test cases)
set -uo pipefail
OUT=${OUT:-/tmp/rope_jit_out}
mkdir -p "$OUT"
steps=${*:-test golden bench-quick}
# dlpack is not installed there: unpack Debian's package carried in .deb/.
mkdir -p /tmp/dlpack && for f in .deb/libdlpack-dev_*.deb; do dpkg -x "$f" /tmp/dlpack; done
export ROPE_JIT_CACHE_DIR=/tmp/rope_jit_cache
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH=/tmp/dlpack/usr >/dev/null &&
    cmake --build build-gpu -j16 --target rope_jit rope_jit_tests rope-jit-golden 2>&1 | grep -E "warning|error"
  echo "build rc=${PIPESTATUS[0]}"
} 2>&1 | tee "$OUT/attention_build.log"
for step in $steps; do
  case $step in
    test) build-gpu/tests/rope_jit_tests --test-suite=gpu --duration=true \
            --test-case="${ATTENTION_TESTS:-*CUDA attention*,*CUDA-core kernels match*,*tile shape*,*sm_90 wgmma forward*,*sm_90 wgmma backward*,*headline shape*,*defaults tuned for length*,*NaN in a query row*,*asked to be deterministic*}" \
            > "$OUT/attention_gpu.log" 2>&1
          echo "gpu attention tests rc=$?"; grep -E "FAIL|ERROR|of .* configurations|test cases|assertions" "$OUT/attention_gpu.log" | head -40 ;;
    golden) build-gpu/tools/rope-jit-golden tests/golden --backend cuda --ops attention 2>&1 | tee "$OUT/attention_golden_cuda.log" ;;
    # The sweep with the backward timed at every shape too.
    bench-all) PYTHONUNBUFFERED=1 python3 bench/attention_bench.py --library build-gpu/librope_jit.so --out "$OUT" --backward all 2>&1 |
             tee "$OUT/attention_bench.log" | cut -c1-400 ;;
    # Forward tile variants at head_dim 64 (short and long sequences) and 256.
    bench-d64-d256)
      for d in 64 256; do
        if [ $d = 64 ]; then shapes="4,4096,32,8,64;16,1024,32,8,64"; variants="fwd=p8x64x3;fwd=p8x64x2;fwd=p8x128x2;fwd=p8x128x3;fwd=w12x64x3;fwd=w8x64x2"
        else shapes="4,4096,16,4,256;16,1024,16,4,256"; variants="fwd=8x32;fwd=4x32;fwd=8x16;fwd=8x64;fwd=4x64"; fi
        PYTHONUNBUFFERED=1 python3 bench/attention_bench.py --library build-gpu/librope_jit.so --out "$OUT" --skip-shapes \
          --backward none --tag h200_tile_variants_d$d --variant-shapes "$shapes" --variants "$variants" 2>&1 | cut -c1-200
      done ;;
    bench) PYTHONUNBUFFERED=1 python3 bench/attention_bench.py --library build-gpu/librope_jit.so --out "$OUT" 2>&1 |
             tee "$OUT/attention_bench.log" | cut -c1-400 ;;
    # Times tile variants at the headline shape, then the whole sweep with the fastest.
    bench-tuned) PYTHONUNBUFFERED=1 python3 bench/attention_bench.py --library build-gpu/librope_jit.so --out "$OUT" \
                   --adopt-best --variants "${ATTENTION_VARIANTS:-fwd=4x64x2;fwd=4x32x2;fwd=8x64x2;fwd=8x64;fwd=4x64;dq=8x64,dkdv=8x64;dq=4x64,dkdv=4x32;dq=8x32,dkdv=8x16;dq=4x16,dkdv=8x64;dq=8x64,dkdv=8x32}" \
                   2>&1 | tee "$OUT/attention_bench.log" | cut -c1-300 ;;
    bench-variants) PYTHONUNBUFFERED=1 python3 bench/attention_bench.py --library build-gpu/librope_jit.so --out "$OUT" \
                   --tag h200_variants --skip-shapes --variants "${ATTENTION_VARIANTS:-fwd=4x64x2;fwd=4x32x2;fwd=8x64x2;fwd=8x64;fwd=4x64;dq=4x64,dkdv=8x32;dq=8x32,dkdv=8x64;dq=4x32,dkdv=4x32}" \
                   2>&1 | tee "$OUT/attention_variants.log" | cut -c1-300 ;;
    # Hardware counters of one fused forward and backward at the headline shape.
    profile) timeout 60 ncu --clock-control none --kernel-name attention_kernel --launch-count 3 \
               --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
               --section MemoryWorkloadAnalysis \
               python3 bench/attention_bench.py --library build-gpu/librope_jit.so --out /tmp/profile --profile-once \
               > "$OUT/attention_ncu.txt" 2>&1
             echo "ncu rc=$?"; grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued" "$OUT/attention_ncu.txt" | head -40 ;;
    bench-headline) PYTHONUNBUFFERED=1 python3 bench/attention_bench.py --library build-gpu/librope_jit.so --out "$OUT" --headline \
                   --tag h200_headline 2>&1 | tee "$OUT/attention_bench.log" | cut -c1-600 ;;
    # The new sm_90 kernels under compute-sanitizer (memcheck, racecheck) on a small problem of
    # every kernel family (the NaN test: 100 tokens, forward and backward).
    sanitize) for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
                timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 9 \
                  build-gpu/tests/rope_jit_tests --test-suite=gpu --test-case="${SANITIZE_TESTS:-*NaN in a query row*}" \
                  > "$OUT/attention_$tool.log" 2>&1
                echo "compute-sanitizer $tool rc=$?" | tee -a "$OUT/attention_$tool.log"; tail -4 "$OUT/attention_$tool.log"
              done ;;
    # The RoPE op's GPU tests (proportional rotary, QK-norm, M-RoPE, frequency gradients).
    rope) build-gpu/tests/rope_jit_tests --test-suite=gpu --duration=true \
            --test-case="${ROPE_TESTS:-*roportional*,*QK-norm*,*multi-section*,*frequency gradient on the GPU*,*CUDA backend matches the CPU backend*}" \
            > "$OUT/rope_gpu.log" 2>&1
          echo "gpu rope tests rc=$?"; grep -E "ERROR|FAIL|test cases|assertions" "$OUT/rope_gpu.log" | head -20 ;;
    # Cold start of the fused attention (needs the Python package: installs it from .whl/).
    cold) PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --no-index --find-links .whl numpy ./python 2>&1 | tail -2
          PYTHONUNBUFFERED=1 python3 bench/cold_start.py --library build-gpu/librope_jit.so --repeats ${COLD_REPEATS:-2} \
            --cases attention_first,attention_warm,attention_gap --json "$OUT/cold_start_attention.json" 2>&1 | tail -8 ;;
    # The Python package's attention tests on the GPU (after cold, which installs it).
    python) ROPE_JIT_LIBRARY="$PWD/build-gpu/librope_jit.so" python3 -m pytest -q -x python/tests/test_dropin.py \
              -k "flash_attn or deterministic" > "$OUT/python_attention.log" 2>&1
            echo "pytest rc=$?"; tail -3 "$OUT/python_attention.log" ;;
    # Issue 19's comparison: fused vs RoPE + SDPA flash / cuDNN, fwd, bwd, fwd+bwd (graph replay).
    bench-issue) PYTHONUNBUFFERED=1 python3 bench/attention_bench.py --library build-gpu/librope_jit.so --out "$OUT" \
                   --issue-shapes --tag h200_issue19 ${ATTENTION_VARIANTS:+--variants "$ATTENTION_VARIANTS"} \
                   2>&1 | tee "$OUT/attention_issue19.log" | cut -c1-700 ;;
    bench-quick) PYTHONUNBUFFERED=1 python3 bench/attention_bench.py --library build-gpu/librope_jit.so --out "$OUT" --quick \
                   --tag h200_quick 2>&1 | tee "$OUT/attention_bench.log" | cut -c1-400 ;;
  esac
done
