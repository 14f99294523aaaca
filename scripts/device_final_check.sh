#!/usr/bin/env bash
# This session's last device run (carry [".deb"]): the attention forward's GPU tests, issue 19's
# comparison, compute-sanitizer on every attention kernel family, the QK-norm and KV cache GPU
# tests and the QK-norm bench cases. Logs under $OUT (at most 8 files come back).
export STEP_TIMEOUT=200 SANITIZE_TIMEOUT=90
export ATTENTION_TESTS='*sm_90 wgmma forward*,*headline shape*,*NaN in a query row*,*tile shape*'
bash scripts/device_check.sh attention-issue attention-tests sanitize
timeout 120 build-gpu/tests/rope_jit_tests --test-suite=gpu --duration=true \
  --test-case='*QK-norm*,*KV cache*' > "$OUT/gpu_rope_norm.log" 2>&1
echo "[qk-norm and KV cache GPU tests] rc=$?"; grep -E "ERROR|FAILED|test cases|assertions" "$OUT/gpu_rope_norm.log"
timeout 60 build-gpu/tools/rope-jit-bench --filter "qk-norm,paged kv" 2>&1 | grep -vE "^\s*$" | cut -c1-170
rm -f "$OUT/build.log"
