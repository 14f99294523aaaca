export STEP_TIMEOUT=200 SANITIZE_TIMEOUT=90 ATTENTION_FWD_VARIANTS='fwd=p8x128x2;fwd=p8x128x3;fwd=p8x64x3;fwd=p8x128x2'
export PYTEST_ARGS="python/tests/test_torch_hot_path.py python/tests/test_dropin.py python/tests/test_torch_gpu_capture.py python/tests/test_torch.py"
bash scripts/device_check.sh rope-tests rope-bench attention-fwd python
F="llama3-8b prefill,D64,D256,interleaved,bhsd,long context,partial"
for m in WIDE_ITEMS L2_PREFETCH; do
  ROPE_JIT_NVRTC_EXTRA_OPTIONS=-DROPE_JIT_EXPERIMENT_$m timeout 90 build-gpu/tools/rope-jit-bench --filter "$F" --json $OUT/rope_exp_$m.json > /tmp/exp_$m.log 2>&1
  echo "== $m rc=$?"; grep -E "of copy|[0-9]\.[0-9]{3}$" /tmp/exp_$m.log | cut -c1-40,120-
done
timeout 60 python3 bench/decode_floor.py > $OUT/decode_floor.log 2>&1; echo "decode_floor rc=$?"; tail -20 $OUT/decode_floor.log
rm -f $OUT/build.log $OUT/attention_attention_fwd_variants.json $OUT/python_tests.log
bash scripts/device_check.sh sanitize 2>&1 | grep -v "^build\|^NVIDIA"
