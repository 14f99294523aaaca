#!/usr/bin/env bash
# Runs on the GPU machine (the device tool, carry [".deb", ".whl"]): builds the library, tests and
# tools there, then the named steps, each under its own time limit (a hung kernel costs one step,
# not the call), with logs and JSON under $OUT.
# Usage: bash scripts/device_check.sh STEP...
#   rope-tests       the GPU tests of the RoPE op (QK-norm, KV cache + FP8, decode, sweeps)
#   rope-bench       rope-jit-bench (ROPE_BENCH_FILTER narrows the cases)
#   rope-variants    rope-jit-bench's ROPE_BENCH_FILTER cases once per variant of ROPE_VARIANTS:
#                    'name|NVRTC options rule|VAR=value ...' separated by ';' (the rule goes to
#                    ROPE_JIT_NVRTC_EXTRA_OPTIONS, the assignments to the environment; BENCH=path
#                    runs that rope-jit-bench, e.g. baseline-build's), then a table of fractions
#                    of copy (scripts/bench_variants_table.py)
#   baseline-build   rope-jit-bench and librope_jit.so of another tree of the project,
#                    BASELINE_DIR (default ab_base; e.g. `git archive main CMakeLists.txt cmake
#                    include src kernels_templates tools python | tar -x -C ab_base`, untracked
#                    so that it travels), into BASELINE_DIR/build-gpu: a variant with
#                    BENCH=ab_base/build-gpu/tools/rope-jit-bench measures that tree's kernels
#   overhead-ab      python/benchmarks/call_overhead.py of BASELINE_DIR (its package, script
#                    and library, after baseline-build) and of this tree in turns, two rounds
#                    (CALL_OVERHEAD_ARGS), then the rows side by side
#                    (scripts/overhead_ab_table.py): host costs before and after on one host
#   golden           every golden case on CUDA
#   attention-tests  the attention GPU tests (ATTENTION_TESTS narrows them)
#   attention-fwd    forward-only times of ATTENTION_FWD_VARIANTS at ATTENTION_SHAPES
#   attention-bwd    forward+backward times of ATTENTION_BWD_VARIANTS at ATTENTION_SHAPES
#   attention-issue  issue 19's comparison (fused vs RoPE + SDPA flash / cuDNN)
#   sanitize         compute-sanitizer memcheck and racecheck (SANITIZE_TESTS)
#   profile          ncu counters of one fused forward and backward at the headline shape
#   cold-start       bench/cold_start.py: first fused forward+backward of fresh processes with an
#                    empty and a warm cache at COLD_START_SHAPES (issue 19's by default)
#   warm-profile     bench/warm_start_profile.py at each of COLD_START_SHAPES: a warm-cache first
#                    call split into library load, runtime, disk lookups, module loads, the rest
#   pool-probe       bench/pool_setup_probe.py: a process's first stream-ordered allocation from
#                    the default pool, from a pool of its own, and cuMemAlloc
#   rope-ncu         ncu counters of one launch of NCU_KERNEL (regex, default rope) in the
#                    rope-jit-bench cases NCU_FILTER (NCU_OPTIONS: extra NVRTC options rule)
#   rope-ncu-source  ncu's warp-state sampling per SASS instruction of one launch of NCU_KERNEL in
#                    NCU_FILTER's first case, caches not flushed (as in a graph's replays): the
#                    report, its source page as CSV, and the instructions with the most samples
#                    (both: NCU_SKIP matching launches skipped first, default 2: rope-jit-bench's
#                    first two launches are its one-token decode probe, cold and warm runtime
#                    (runs CZ and DI profiled them), the third the case's first call, rope_kernel
#                    or, with NCU_KERNEL=rope_bulk, the bulk entry: there NCU_SKIP=0)
#   python           installs the package, pytest (PYTEST_ARGS), call overhead
#   autograd         bench/compare_torch_autograd.py (AUTOGRAD_ARGS)
#   peers            bench/compare_torch.py --in-place: issue 24's comparison against torch.compile
#                    and Liger (installs ./python and Liger's wheel from .whl; PEERS_ARGS, e.g.
#                    --quick or --shapes); h200_vs_torch.{json,log}, and .png with matplotlib
#   out-of-place     bench/compare_torch.py's default mode: RoPE out of place against eager and
#                    torch.compile at DESIGN.md's shapes, other head_dims, partial rotary and
#                    decode; out_of_place_vs_torch.{json,log}, and .png with matplotlib
#   issue24-check    bench/issue24_check.py on this call's peers and rope-bench JSON: issue 24's
#                    points, each with its number (after `peers rope-bench`, the bench's
#                    ROPE_BENCH_FILTER taking issue 24's cases)
# BUILD_TARGETS narrows the build (default: the library, tests and every tool), e.g.
# "rope_jit rope-jit-bench" for a run of only peers and rope-bench when device time is short.
set -uo pipefail
OUT=${OUT:-/tmp/rope_jit_out}
mkdir -p "$OUT" /tmp/dlpack
for f in .deb/libdlpack-dev_*.deb; do dpkg -x "$f" /tmp/dlpack; done
export ROPE_JIT_CACHE_DIR=/tmp/rope_jit_cache
lib=$PWD/build-gpu/librope_jit.so
tests=build-gpu/tests/rope_jit_tests
start=$SECONDS
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH=/tmp/dlpack/usr >/dev/null &&
    cmake --build build-gpu -j16 --target ${BUILD_TARGETS:-rope_jit rope_jit_tests rope-jit-golden rope-jit-bench rope-jit-cache} 2>&1 |
    grep -E "warning|error"
  echo "build rc=${PIPESTATUS[0]} ($((SECONDS - start)) s)"
} 2>&1 | tee "$OUT/build.log"

step_done() { echo "[$1] rc=$2 at $((SECONDS - start)) s"; }
attention_times() {  # $1 tag, $2 variants, $3 backward (none|...)
  PYTHONUNBUFFERED=1 timeout "${STEP_TIMEOUT:-240}" python3 bench/attention_bench.py --library "$lib" \
    --out "$OUT" --tag "$1" --skip-shapes --backward "$3" \
    --variant-shapes "${ATTENTION_SHAPES:-4,4096,32,8,128}" --variants "$2" > "$OUT/$1.log" 2>&1
  step_done "$1" $?
  python3 - "$OUT/$1.log" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line)
        times = {k: round(v, 3) for k, v in r.items() if k.endswith("_ms")}
        print(r["variant"], f"{r['B']},{r['S']},{r['Hq']},{r['Hk']},{r['D']}", r.get("error", times))
EOF
}

compare_torch() {  # $1 step, $2 output name, $3 lines shown, the rest compare_torch.py's arguments
  local step=$1 name=$2 lines=$3
  shift 3
  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --no-index --find-links .whl \
    ./python 2>&1 | tail -2
  ROPE_JIT_LIBRARY=$lib PYTHONUNBUFFERED=1 timeout "${STEP_TIMEOUT:-300}" \
    python3 bench/compare_torch.py --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  step_done "$step" $?; grep -vE "^\s*$" "$OUT/$name.log" | cut -c1-200 | tail -"$lines"
  if python3 -c "import matplotlib" 2>/dev/null; then  # else: plot where matplotlib is
    python3 bench/plot_results.py "$OUT/$name.json" "$OUT/$name.png"
  fi
}

for step in "$@"; do
  case $step in
    rope-tests)
      timeout "${STEP_TIMEOUT:-300}" $tests --test-suite=gpu --duration=true \
        --test-case-exclude="*attention*,*tile shape*,*wgmma*,*headline shape*,*defaults tuned*,*NaN in a query*,*deterministic*,*empty query*,*CUDA-core kernels*,*without a workspace*" \
        > "$OUT/gpu_rope.log" 2>&1
      step_done rope-tests $?; grep -E "ERROR|FAILED|test cases|assertions" "$OUT/gpu_rope.log" | head -20 ;;
    rope-bench)
      timeout "${STEP_TIMEOUT:-240}" build-gpu/tools/rope-jit-bench --json "$OUT/h200_bench.json" \
        ${ROPE_BENCH_FILTER:+--filter "$ROPE_BENCH_FILTER"} > "$OUT/h200_bench.log" 2>&1
      step_done rope-bench $?; grep -vE "^\s*$" "$OUT/h200_bench.log" | cut -c1-160 | tail -40 ;;
    golden)
      timeout "${STEP_TIMEOUT:-240}" build-gpu/tools/rope-jit-golden tests/golden --backend cuda > "$OUT/golden_cuda.log" 2>&1
      step_done golden $?; tail -1 "$OUT/golden_cuda.log" ;;
    attention-tests)
      timeout "${STEP_TIMEOUT:-300}" $tests --test-suite=gpu --duration=true \
        --test-case="${ATTENTION_TESTS:-*CUDA attention*,*CUDA-core kernels match*,*tile shape*,*sm_90 wgmma forward*,*sm_90 wgmma backward*,*headline shape*,*defaults tuned for length*,*NaN in a query row*,*asked to be deterministic*,*without a workspace*}" \
        > "$OUT/attention_gpu.log" 2>&1
      step_done attention-tests $?
      grep -E "ERROR|FAILED|of .* configurations|test cases|assertions|^[0-9.]+ s:" "$OUT/attention_gpu.log" | head -30 ;;
    attention-fwd) attention_times attention_fwd_variants "${ATTENTION_FWD_VARIANTS:-fwd=p8x128x2}" none ;;
    attention-bwd) attention_times attention_bwd_variants "${ATTENTION_BWD_VARIANTS:-fwd=p8x128x2}" all ;;
    attention-issue)
      PYTHONUNBUFFERED=1 timeout "${STEP_TIMEOUT:-400}" python3 bench/attention_bench.py --library "$lib" \
        --out "$OUT" --issue-shapes --tag h200_issue19 > "$OUT/attention_issue19.log" 2>&1
      step_done attention-issue $?; tail -12 "$OUT/attention_issue19.log" | cut -c1-300 ;;
    sanitize)
      for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
        timeout "${SANITIZE_TIMEOUT:-150}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
          $tests --test-suite=gpu --test-case="${SANITIZE_TESTS:-*NaN in a query row*}" > "$OUT/sanitize_$tool.log" 2>&1
        step_done "sanitize $tool" $?; tail -3 "$OUT/sanitize_$tool.log"
      done ;;
    profile)
      timeout 120 ncu --clock-control none --kernel-name attention_kernel --launch-count 4 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats \
        python3 bench/attention_bench.py --library "$lib" --out /tmp/profile --profile-once \
        > "$OUT/attention_ncu.txt" 2>&1
      step_done profile $?
      grep -E "attention_kernel|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Issue Slots Busy|Executed Ipc A|No Eligible|Warp Cycles Per Issued" "$OUT/attention_ncu.txt" | head -40 ;;
    cold-start)
      PYTHONUNBUFFERED=1 timeout "${STEP_TIMEOUT:-300}" python3 bench/cold_start.py --library "$lib" \
        --cache-tool build-gpu/tools/rope-jit-cache --repeats "${COLD_START_REPEATS:-3}" \
        --cases "${COLD_START_CASES:-none}" --json "$OUT/cold_start_h200.json" \
        --attention-shapes "${COLD_START_SHAPES:-4,4096,32,8,128;1,16384,32,8,128;4,4096,16,16,64;2,4096,16,8,256}" \
        > "$OUT/cold_start_h200.log" 2>&1
      step_done cold-start $?; tail -16 "$OUT/cold_start_h200.log" | cut -c1-160 ;;
    warm-profile)
      shapes=${COLD_START_SHAPES:-4,4096,32,8,128;1,16384,32,8,128;4,4096,16,16,64;2,4096,16,8,256}
      n=0
      for shape in ${shapes//;/ }; do
        n=$((n + 1))  # files named by index: names with commas do not come back from the device
        timeout "${STEP_TIMEOUT:-120}" python3 bench/warm_start_profile.py --library "$lib" --shape "$shape" \
          --repeats "${COLD_START_REPEATS:-5}" --json "$OUT/warm_start_profile_$n.json" \
          > "$OUT/warm_start_profile_$n.log" 2>&1
        step_done "warm-profile $shape" $?; head -15 "$OUT/warm_start_profile_$n.log"
      done ;;
    pool-probe)
      timeout "${STEP_TIMEOUT:-120}" python3 bench/pool_setup_probe.py --json "$OUT/pool_setup_probe.json" \
        > "$OUT/pool_setup_probe.log" 2>&1
      step_done pool-probe $?; cat "$OUT/pool_setup_probe.log" ;;
    baseline-build)
      base=${BASELINE_DIR:-ab_base}
      { cmake -S "$base" -B "$base/build-gpu" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DROPE_JIT_BUILD_TESTS=OFF \
          -DCMAKE_PREFIX_PATH=/tmp/dlpack/usr >/dev/null &&
          cmake --build "$base/build-gpu" -j16 --target rope-jit-bench rope_jit 2>&1 |
          grep -E "warning|error"
        test -x "$base/build-gpu/tools/rope-jit-bench" && test -f "$base/build-gpu/librope_jit.so"
      } > "$OUT/baseline_build.log" 2>&1
      step_done baseline-build $? ;;
    overhead-ab)
      base=${BASELINE_DIR:-ab_base}
      logs=()
      for round in 1 2; do
        for tree in base this; do
          root=.
          library=$lib
          if [ "$tree" = base ]; then root=$base; library=$(cd "$base" && pwd)/build-gpu/librope_jit.so; fi
          # shellcheck disable=SC2086  # the options are words
          PYTHONPATH=$root/python ROPE_JIT_LIBRARY=$library timeout "${STEP_TIMEOUT:-120}" \
            python3 "$root/python/benchmarks/call_overhead.py" ${CALL_OVERHEAD_ARGS:-} \
            > "$OUT/overhead_${tree}_$round.log" 2>&1
          step_done "overhead-ab $tree $round" $?
          logs+=("$OUT/overhead_${tree}_$round.log")
        done
      done
      python3 scripts/overhead_ab_table.py "${logs[@]}" | tee "$OUT/overhead_ab_table.txt" ;;
    rope-variants)
      IFS=';' read -ra variants <<< "${ROPE_VARIANTS:-base||}"
      names=()
      for variant in "${variants[@]}"; do
        IFS='|' read -r name options assignments <<< "$variant"
        names+=("$name")
        bench=build-gpu/tools/rope-jit-bench
        for assignment in $assignments; do
          case $assignment in BENCH=*) bench=${assignment#BENCH=} ;; esac
        done
        # shellcheck disable=SC2086  # the assignments are words of VAR=value
        env ROPE_JIT_NVRTC_EXTRA_OPTIONS="$options" $assignments timeout "${STEP_TIMEOUT:-240}" \
          "$bench" --json "$OUT/variant_$name.json" \
          ${ROPE_BENCH_FILTER:+--filter "$ROPE_BENCH_FILTER"} > "$OUT/variant_$name.log" 2>&1
        step_done "rope-variants $name" $?
      done
      python3 scripts/bench_variants_table.py "$OUT" "${names[@]}" | tee "$OUT/variants_table.txt" ;;
    rope-ncu)
      ROPE_JIT_NVRTC_EXTRA_OPTIONS="${NCU_OPTIONS:-}" timeout "${STEP_TIMEOUT:-180}" ncu --clock-control none \
        --kernel-name regex:"${NCU_KERNEL:-rope}" --launch-skip "${NCU_SKIP:-2}" --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_write.sum \
        build-gpu/tools/rope-jit-bench --quick --filter "$NCU_FILTER" > "$OUT/rope_ncu_${NCU_TAG:-1}.txt" 2>&1
      step_done rope-ncu $?
      grep -E "dram__bytes|lts__t_sectors|Duration|Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Warp Cycles Per Issued|No Eligible|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Grid Size|Block Size|Waves Per SM" \
        "$OUT/rope_ncu_${NCU_TAG:-1}.txt" | head -40 ;;
    rope-ncu-source)
      report="$OUT/ncu_source_${NCU_TAG:-1}"
      ROPE_JIT_NVRTC_EXTRA_OPTIONS="${NCU_OPTIONS:-}" timeout "${STEP_TIMEOUT:-180}" ncu --clock-control none \
        --cache-control none --kernel-name regex:"${NCU_KERNEL:-rope}" --launch-skip "${NCU_SKIP:-2}" \
        --launch-count 1 --section WarpStateStats --section SourceCounters --section LaunchStats \
        --warp-sampling-interval 0 -f -o "$report" \
        build-gpu/tools/rope-jit-bench --quick --filter "$NCU_FILTER" > "$report.log" 2>&1
      step_done rope-ncu-source $?
      ncu --import "$report.ncu-rep" --page source --csv --print-source sass > "$report.csv" 2>&1
      ncu --import "$report.ncu-rep" --section WarpStateStats --section LaunchStats > "$report.txt" 2>&1
      grep -E "Duration|Warp Cycles Per|Registers|Block Size|Grid Size|Stall" "$report.txt" | head -20
      python3 scripts/ncu_source_top.py "$report.csv" 30 | tee "$report.top.txt" ;;
    python)
      PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --no-index --find-links .whl numpy pytest ./python 2>&1 | tail -2
      PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --no-index --no-deps .whl/liger_kernel-*.whl 2>&1 | tail -1
      ROPE_JIT_LIBRARY=$lib timeout "${STEP_TIMEOUT:-300}" python3 -m pytest ${PYTEST_ARGS:-python/tests} -q -rs \
        > "$OUT/python_tests.log" 2>&1
      step_done pytest $?; tail -3 "$OUT/python_tests.log"
      ROPE_JIT_LIBRARY=$lib timeout 120 python3 python/benchmarks/call_overhead.py > "$OUT/python_call_overhead.log" 2>&1
      step_done call-overhead $?; tail -14 "$OUT/python_call_overhead.log" ;;
    autograd)
      ROPE_JIT_LIBRARY=$lib PYTHONUNBUFFERED=1 timeout "${STEP_TIMEOUT:-300}" python3 bench/compare_torch_autograd.py \
        --json "$OUT/h200_autograd.json" ${AUTOGRAD_ARGS:-} > "$OUT/h200_autograd.log" 2>&1
      step_done autograd $?; tail -30 "$OUT/h200_autograd.log" | cut -c1-200 ;;
    peers)
      PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --no-index --no-deps \
        .whl/liger_kernel-*.whl 2>&1 | tail -1
      # shellcheck disable=SC2086  # PEERS_ARGS splits into arguments
      compare_torch peers h200_vs_torch 45 --in-place ${PEERS_ARGS:-} ;;
    out-of-place)
      compare_torch out-of-place out_of_place_vs_torch 30 ;;
    issue24-check)
      python3 bench/issue24_check.py "$OUT/h200_vs_torch.json" "$OUT/h200_bench.json" \
        > "$OUT/issue24_check.log" 2>&1
      step_done issue24-check $?; cat "$OUT/issue24_check.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "total $((SECONDS - start)) s"
