#!/usr/bin/env bash
# Runs on the GPU machine (the device tool), after build-gpu/librope_jit.so exists (for
# instance from scripts/device_gpu_suite.sh in the same session): data-parallel training
# through PyTorch's distributed engine with rope-jit (issue 25). Builds nothing.
#   1. python/tests/test_distributed.py: the ranks against one process with the same global
#      batch, each kernel compiled once across ranks sharing an empty cache, no host
#      synchronization (it picks its runs by the number of GPUs; -s prints what it measured).
#   2. python/examples/train_ddp.py under torchrun with one rank per GPU, DDP and FSDP with
#      rope-jit's RoPE, and DDP with its fused attention, each on a new empty cache, with step
#      times against the same model with PyTorch's RoPE.
#   3. The Python suite's test of tensors on a second GPU (skips with one GPU).
# Writes $OUT/distributed.json (losses, step times, compile counts of every run),
# $OUT/distributed_tests.json (the test's summary) and the logs in $OUT/distributed_logs.tgz.
# Usage: bash scripts/device_distributed.sh   (PYTHON: an interpreter with torch; NPROC: ranks)
# Bounded to fit one 10-minute device command: the test 330 s at most, each run 70 s.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rope_jit_out}
LOG=$OUT/distributed_logs
mkdir -p "$LOG"
py=${PYTHON:-python3}
export ROPE_JIT_LIBRARY=$PWD/build-gpu/librope_jit.so
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
if [ ! -f "$ROPE_JIT_LIBRARY" ]; then
  echo "no $ROPE_JIT_LIBRARY: build it first (scripts/device_gpu_suite.sh)"; exit 1
fi
# pytest from the wheels carried in .whl/ when the interpreter lacks it (no network there).
$py -c "import pytest" 2>/dev/null ||
  PIP_BREAK_SYSTEM_PACKAGES=1 $py -m pip install --quiet --no-index --find-links .whl pytest 2>&1 |
  tail -3
gpus=$(nvidia-smi --list-gpus | wc -l)
nproc=${NPROC:-$gpus}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  echo "commit ${ROPE_JIT_COMMIT:-$(git log -1 --format='%H %s' 2>/dev/null)}"
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', \
torch.cuda.nccl.version())"
  echo "GPUs $gpus, ranks $nproc"
} 2>&1 | tee "$LOG/environment.log"

ROPE_JIT_DDP_OUT=$LOG/test ROPE_JIT_DDP_NPROC=$nproc timeout 330 $py -m pytest \
  python/tests/test_distributed.py -v -s -rs -p no:cacheprovider > "$LOG/test_distributed.log" 2>&1
echo "test_distributed rc=$?" | tee -a "$LOG/test_distributed.log"
grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$LOG/test_distributed.log" | tail -20
cp "$LOG/test/summary.json" "$OUT/distributed_tests.json" 2>/dev/null

runs=()
for run in ddp:rope_jit fsdp:rope_jit ddp:fused; do
  mode=${run%%:*} attention=${run##*:} name=${run/:/_}_$nproc
  cache=$(mktemp -d /tmp/rope_jit_ddp_cache.XXXXXX)
  ROPE_JIT_CACHE_DIR=$cache timeout 70 $py -m torch.distributed.run --standalone \
    --nproc-per-node "$nproc" python/examples/train_ddp.py \
    --mode "$mode" --attention "$attention" --steps 10 --time-steps 10 \
    --json "$LOG/$name.json" > "$LOG/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$LOG/$name.log"
  tail -n 12 "$LOG/$name.log"
  # The kernels in the cache, for the compile-once check of the summary.
  find "$cache" -name '*.cubin' -o -name '*.ptx' | wc -l > "$LOG/$name.kernels"
  runs+=("$name")
done

# The test of the Python suite that needs two GPUs (skipped on one).
second_gpu=test_tensors_on_another_gpu_run_on_that_gpu_and_its_current_stream
$py -m pytest -v -rs -p no:cacheprovider "python/tests/test_torch_gpu.py::$second_gpu" \
  > "$LOG/test_torch_gpu_second_gpu.log" 2>&1
echo "test_torch_gpu second-GPU test rc=$?" | tee -a "$LOG/test_torch_gpu_second_gpu.log"
grep -E "PASSED|FAILED|SKIPPED" "$LOG/test_torch_gpu_second_gpu.log"

$py - "$LOG" "$OUT/distributed.json" "${runs[@]}" <<'EOF'
import json, os, sys
log, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
summary = {}
for name in names:
    try:
        with open(os.path.join(log, name + ".json")) as f:
            run = json.load(f)
        with open(os.path.join(log, name + ".kernels")) as f:
            kernels = int(f.read())
    except (OSError, ValueError) as error:
        summary[name] = {"error": str(error)}
        continue
    compiles = sum(s["compiles"] for s in run["stats"])
    summary[name] = {key: run[key] for key in ("mode", "world_size", "attention", "device_name",
                                                "dtype", "preset", "global_batch", "losses",
                                                "step_ms", "timing", "sync_probe", "stats")}
    summary[name]["cache_kernels"] = kernels
    summary[name]["compiled_once"] = compiles == kernels and all(
        s["compiles"] + s["disk_hits"] == kernels for s in run["stats"])
    print(f"{name}: final loss {run['losses'][-1]:.4f}, median step "
          f"{run['timing']['median_ms'][run['attention']]:.2f} ms vs "
          f"{run['timing']['median_ms']['torch']:.2f} ms with PyTorch RoPE, {kernels} kernels, "
          f"{compiles} compiles, compiled once: {summary[name]['compiled_once']}")
with open(out, "w") as f:
    json.dump(summary, f, indent=1)
EOF
tar czf "$OUT/distributed_logs.tgz" -C "$OUT" distributed_logs
rm -rf "$LOG"
