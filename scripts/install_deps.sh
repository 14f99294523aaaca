#!/usr/bin/env bash
# Installs what building and testing rope-jit needs, from Debian packages. The CUDA toolkit
# (NVRTC) is optional: without it the library runs its CPU backend only, and the NVRTC tests
# are skipped by ctest's label filter in scripts/test.sh.
set -euo pipefail
packages=(cmake g++ make pkg-config libfmt-dev nlohmann-json3-dev doctest-dev libdlpack-dev libcli11-dev python3 python3-venv
  clang libclang-rt-dev)  # clang and libFuzzer: the fuzz targets in scripts/test.sh
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
