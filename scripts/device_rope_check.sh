#!/usr/bin/env bash
# Runs on the GPU machine (the device tool, carry [".deb", ".whl"]): builds there, then the
# GPU tests of everything but the attention kernels (RoPE, QK-norm, KV cache + FP8, decode
# launches, background builds) plus the attention's no-workspace fallback, the golden cases
# on CUDA, rope-jit-bench (JSON), the Python suite with torch on the GPU and the Python call
# overhead. Logs and JSON under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/rope_jit_out}
mkdir -p "$OUT" /tmp/dlpack
for f in .deb/libdlpack-dev_*.deb; do dpkg -x "$f" /tmp/dlpack; done
export ROPE_JIT_CACHE_DIR=/tmp/rope_jit_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH=/tmp/dlpack/usr >/dev/null &&
  cmake --build build-gpu -j16 2>&1 | grep -E "warning|error"
echo "build rc=${PIPESTATUS[0]}"
tests=build-gpu/tests/rope_jit_tests
$tests --test-suite=gpu --duration=true \
  --test-case-exclude="*attention*,*tile shape*,*wgmma*,*headline shape*,*defaults tuned*,*NaN in a query*,*deterministic*,*empty query*,*CUDA-core kernels*" \
  > "$OUT/gpu_rope.log" 2>&1
echo "gpu tests (all but attention) rc=$?"; grep -E "ERROR|test cases|assertions" "$OUT/gpu_rope.log" | head -20
$tests --test-suite=gpu --test-case="*without a workspace*" > "$OUT/gpu_attention_fallback.log" 2>&1
echo "attention fallback test rc=$?"; tail -2 "$OUT/gpu_attention_fallback.log"
build-gpu/tools/rope-jit-golden tests/golden --backend cuda > "$OUT/golden_cuda.log" 2>&1
echo "golden rc=$?"; tail -1 "$OUT/golden_cuda.log"
build-gpu/tools/rope-jit-bench --json "$OUT/h200_bench.json" > "$OUT/h200_bench.log" 2>&1
echo "rope-jit-bench rc=$?"
PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --no-index --find-links .whl numpy pytest ./python 2>&1 | tail -2
PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --no-index --no-deps .whl/liger_kernel-*.whl 2>&1 | tail -1
export ROPE_JIT_LIBRARY=$PWD/build-gpu/librope_jit.so
python3 -m pytest python/tests -q -rs > "$OUT/python_tests.log" 2>&1
echo "pytest rc=$?"; tail -3 "$OUT/python_tests.log"
python3 python/benchmarks/call_overhead.py > "$OUT/python_call_overhead.log" 2>&1
tail -14 "$OUT/python_call_overhead.log"
