#!/usr/bin/env bash
# Runs on the GPU machine (the device tool): builds there, then runs the whole GPU suite and
# writes logs under $OUT. Usage: bash scripts/device_gpu_suite.sh [extra steps...]
#   steps: unit gpu golden bench bench-cpu sanitize python python-perf hf compare compare-autograd
#          shared-cache prewarmed
#   (default: unit gpu golden bench sanitize)
#   python: installs python/ (offline, from the wheels carried in .whl/, plus transformers and
#   liger-kernel when their wheels are there), runs its pytest suite (torch on the GPU: the
#   hot path, CUDA graphs, reduce-overhead, the autograd thread's CUDA context, the HF models)
#   and the Llama example; needs `carry: [".whl"]`.
#   python-perf (after python): python/benchmarks/call_overhead.py (host us per call: rope(),
#   apply_rope fwd and fwd+bwd, the HF drop-in, at decode).
#   hf (after python): the HF transformers check (python/tests/test_hf_models.py, verbose) and
#   python/benchmarks/hf_models_timing.py (training step and decode, before/after; JSON).
#   compare-autograd: bench/compare_torch_autograd.py (fwd/bwd/fwd+bwd against eager,
#   torch.compile and Liger, back to back and in graphs; JSON).
#   Wheels for .whl/ (on a machine with a network, for the GPU machine's Python):
#     pip download -d .whl numpy pytest transformers && pip download -d .whl --no-deps liger-kernel
#   compare: bench/compare_torch.py (rope-jit against PyTorch eager and torch.compile).
#   shared-cache: one golden run per GPU at the same time on one empty cache directory (a
#   data-parallel job); scripts/check_shared_cache.py checks each kernel was compiled once.
#   prewarmed: Llama-3-8B calls from .prewarmed/ (`rope-jit-cache prewarm --preset llama3-8b
#   --target sm_90 --cache-dir .prewarmed` on a machine without a GPU; carry it) must compile
#   nothing; then `rope-jit-cache info` and a prewarm for the local GPU.
# Logs go to $OUT/logs and, since few files come back from the machine, into $OUT/logs.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/rope_jit_out}
mkdir -p "$OUT/logs"
LOG=$OUT/logs
steps=${*:-unit gpu golden bench sanitize}
# dlpack is not installed there: unpack Debian's package carried in .deb/.
mkdir -p /tmp/dlpack && for f in .deb/libdlpack-dev_*.deb; do dpkg -x "$f" /tmp/dlpack; done
export ROPE_JIT_CACHE_DIR=/tmp/rope_jit_cache
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  # The machine's .git copy can lag the working tree: the caller may name the commit.
  echo "commit ${ROPE_JIT_COMMIT:-$(git log -1 --format='%H %s' 2>/dev/null)}"
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH=/tmp/dlpack/usr >/dev/null &&
    cmake --build build-gpu -j16 2>&1 | grep -E "warning|error" ; echo "build rc=${PIPESTATUS[0]}"
} 2>&1 | tee "$LOG/build.log"
for step in $steps; do
  case $step in
    unit) build-gpu/tests/rope_jit_tests --test-suite-exclude=gpu 2>&1 | tail -5 | tee "$LOG/unit.log" ;;
    # GPU_TEST_EXCLUDE: doctest test-case patterns to leave out (e.g. slow attention sweeps).
    gpu) build-gpu/tests/rope_jit_tests --test-suite=gpu --duration=true \
           --test-case-exclude="${GPU_TEST_EXCLUDE:-}" > "$LOG/gpu.log" 2>&1
         grep -E "^(TEST CASE|.*ERROR|.*FAILED)|test cases|assertions|s: " "$LOG/gpu.log" | tail -60 ;;
    golden) build-gpu/tools/rope-jit-golden tests/golden --backend cuda 2>&1 | tee "$LOG/golden_cuda.log" | grep -v " pass$" ;;
    # The driver test that asks for a device past the last one on purpose is left out: the
    # sanitizer reports that deliberate API error as an error.
    sanitize) timeout ${SANITIZE_TIMEOUT:-300} compute-sanitizer --tool memcheck --error-exitcode 9 build-gpu/tests/rope_jit_tests \
                --test-suite=gpu --test-case-exclude="*names the device's target*${GPU_TEST_EXCLUDE:+,$GPU_TEST_EXCLUDE}" > "$LOG/sanitizer_memcheck.log" 2>&1; echo "compute-sanitizer rc=$?" >> "$LOG/sanitizer_memcheck.log"
              tail -6 "$LOG/sanitizer_memcheck.log" ;;
    bench) build-gpu/tools/rope-jit-bench --json "$LOG/bench.json" 2>&1 | tee "$LOG/bench.log" ;;
    bench-cpu) build-gpu/tools/rope-jit-bench --backend cpu --json "$LOG/bench_cpu.json" 2>&1 | tee "$LOG/bench_cpu.log" ;;
    python) py=${PYTHON:-python3}
            # The package's own build backend needs nothing from an index (no --no-build-isolation).
            PIP_BREAK_SYSTEM_PACKAGES=1 $py -m pip install --quiet --no-index --find-links .whl numpy pytest ./python 2>&1 | tail -3
            if ls .whl/transformers-*.whl >/dev/null 2>&1; then
              PIP_BREAK_SYSTEM_PACKAGES=1 $py -m pip install --quiet --no-index --find-links .whl \
                transformers 2>&1 | tail -3
            fi
            if ls .whl/liger_kernel-*.whl >/dev/null 2>&1; then
              PIP_BREAK_SYSTEM_PACKAGES=1 $py -m pip install --quiet --no-index --no-deps \
                .whl/liger_kernel-*.whl 2>&1 | tail -3
            fi
            ROPE_JIT_LIBRARY=$PWD/build-gpu/librope_jit.so $py -m pytest python/tests -q -rs 2>&1 | tee "$LOG/python_tests.log" | tail -8
            ROPE_JIT_LIBRARY=$PWD/build-gpu/librope_jit.so $py python/examples/llama_attention.py --compile 2>&1 | tee "$LOG/llama_attention_example.log" | tail -20 ;;
    python-perf) ROPE_JIT_LIBRARY=$PWD/build-gpu/librope_jit.so ${PYTHON:-python3} \
                   python/benchmarks/call_overhead.py 2>&1 | tee "$LOG/python_call_overhead.log" ;;
    hf) ROPE_JIT_LIBRARY=$PWD/build-gpu/librope_jit.so ${PYTHON:-python3} -m pytest -v -rs \
          python/tests/test_hf_models.py python/tests/test_torch_gpu_context.py 2>&1 |
          tee "$LOG/hf_models_tests.log" | tail -15
        ROPE_JIT_LIBRARY=$PWD/build-gpu/librope_jit.so ${PYTHON:-python3} \
          python/benchmarks/hf_models_timing.py --json "$LOG/hf_models_timing.json" 2>&1 |
          tee "$LOG/hf_models_timing.log" ;;
    compare-autograd) ROPE_JIT_LIBRARY=$PWD/build-gpu/librope_jit.so PYTHONPATH=$PWD/python \
                        ${PYTHON:-python3} bench/compare_torch_autograd.py \
                        --json "$LOG/h200_autograd.json" 2>&1 | tee "$LOG/compare_torch_autograd.log" ;;
    compare) ROPE_JIT_LIBRARY=$PWD/build-gpu/librope_jit.so PYTHONPATH=$PWD/python ${PYTHON:-python3} \
               bench/compare_torch.py --json "$LOG/h200_vs_torch.json" 2>&1 | tee "$LOG/compare_torch.log" ;;
    shared-cache)
      dir=$(mktemp -d /tmp/rope_jit_shared_cache.XXXXXX)
      gpus=$(nvidia-smi --list-gpus | wc -l)
      for ((gpu = 0; gpu < gpus; gpu++)); do
        ROPE_JIT_CACHE_DIR=$dir build-gpu/tools/rope-jit-golden tests/golden --backend cuda --device $gpu --json \
          > "$LOG/shared_cache_gpu$gpu.json" 2> "$LOG/shared_cache_gpu$gpu.err" &
      done
      wait
      build-gpu/tools/rope-jit-cache verify --cache-dir "$dir" --json > "$LOG/shared_cache_verify.json"
      build-gpu/tools/rope-jit-cache verify --cache-dir "$dir" > "$LOG/shared_cache.log" 2>&1
      python3 scripts/check_shared_cache.py "$LOG/shared_cache_verify.json" "$LOG"/shared_cache_gpu*.json 2>&1 |
        tee -a "$LOG/shared_cache.log" ;;
    prewarmed)
      # A shipped cache directory: the copy is ours, and not writable by others (else unsafe).
      rm -rf /tmp/prewarmed && cp -r .prewarmed /tmp/prewarmed && chmod -R go-w /tmp/prewarmed
      rm -rf /tmp/prewarmed_preset && cp -r .prewarmed /tmp/prewarmed_preset && chmod -R go-w /tmp/prewarmed_preset
      # The preset's whole set (RoPE as apply_rope and the HF drop-in call it, fused attention
      # forward and backward) from a directory prewarmed without a GPU: 0 compiles.
      ROPE_JIT_LIBRARY=$PWD/build-gpu/librope_jit.so PYTHONPATH=$PWD/python ${PYTHON:-python3} \
        scripts/check_prewarmed_preset.py /tmp/prewarmed_preset 2>&1 | tee "$LOG/prewarmed_preset.log"
      ROPE_JIT_LIBRARY=$PWD/build-gpu/librope_jit.so PYTHONPATH=$PWD/python ${PYTHON:-python3} \
        scripts/check_prewarmed_cache.py /tmp/prewarmed 2>&1 | tee "$LOG/prewarmed_cache.log"
      { build-gpu/tools/rope-jit-cache info
        for run in 1 2 3; do
          root=$(mktemp -d)
          start=$(date +%s.%N)
          build-gpu/tools/rope-jit-cache prewarm --preset llama3-8b --cache-dir "$root"
          echo "preset prewarm wall time: $(echo "$(date +%s.%N) - $start" | bc) s ($(nproc) cores)"
        done; } 2>&1 | tee "$LOG/cache_info.log" ;;
  esac
done
tar czf "$OUT/logs.tgz" -C "$OUT" logs
rm -rf "$OUT/logs"
