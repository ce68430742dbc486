#!/usr/bin/env bash
# The learning modules' GPU rows, for a machine with an NVIDIA GPU: each module on the GPU against
# its float64 reference (FlexAttention compiled, the MSA layer, the distillation loss; float32 and
# bfloat16), then the learning benchmark's GPU table. Extra arguments go to scripts/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
PY=.venv/bin/python
"$PY" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device: this script needs an NVIDIA GPU and a CUDA build of torch")
PY
"$PY" scripts/gpu_check.py "$@"
echo
"$PY" benchmarks/learning.py --device cuda
