#!/usr/bin/env bash
# The main job for a newcomer: install dependencies, build, prewarm the kernel cache for a
# default model, and run checked RoPE calls on whatever device this machine has.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)"
if [ -x build/tools/rope-jit-cache ]; then
  build/tools/rope-jit-cache prewarm --preset llama3-8b
fi
# Every golden case recorded from the peers (Unsloth, Liger, flash-attention, HF, ...): RoPE,
# attention with rotary and frequency builders, each
# checked against the peer's output, on the GPU when there is one, else on the CPU.
build/tools/rope-jit-golden tests/golden --backend auto
# The README's C example: one checked call through the C API.
build/tests/readme_example
