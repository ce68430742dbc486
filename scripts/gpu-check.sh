#!/usr/bin/env bash
# The learning modules' GPU rows, for a machine with an NVIDIA GPU: each module on the GPU against
# its float64 reference (FlexAttention compiled, the MSA layer, the distillation loss; float32 and
# bfloat16), then the learning benchmark's GPU table. Extra arguments go to scripts/gpu_check.py.
#
# `bash scripts/gpu-check.sh --vllm` instead runs the local-model study on vLLM: it installs vLLM
# (pinned; the machine must reach the package index), turns the packaged Gemma 3 270M GGUF into a
# Hugging Face folder with transformers (no download), serves it on loopback with vLLM's
# OpenAI-compatible server, and runs examples/digits with the `llm` policy on it (guided decoding).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
PY=.venv/bin/python
if [ "${1:-}" = "--vllm" ]; then
  bash scripts/setup.sh --local
  "$PY" -m pip install -q -c requirements.lock -e '.[learning]' "vllm==0.33.0"
  export GROVE_DATA_DIR=${GROVE_DATA_DIR:-.grove-vllm}
  folder="$GROVE_DATA_DIR/models/gemma-3-270m-hf"
  "$PY" - "$GROVE_DATA_DIR/models" "$folder" <<'PY'
import sys
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
from backend.core.localmodel import default_gguf
gguf = default_gguf(Path(sys.argv[1]))
out = Path(sys.argv[2])
if not (out / "config.json").exists():
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
print(out)
PY
  study="$GROVE_DATA_DIR/digits-vllm"  # examples/digits with the llm policy, as its own repository
  rm -rf "$study" && cp -r examples/digits "$study"
  sed -i 's/^kind = "search"/kind = "llm"/' "$study/grove.toml"
  git -C "$study" init -q -b main && git -C "$study" add -A
  git -C "$study" -c user.name=grove -c user.email=grove@localhost commit -q -m digits
  port=${GROVE_VLLM_PORT:-8765}
  "$PY" -m vllm.entrypoints.openai.api_server --model "$folder" --served-model-name local \
    --host 127.0.0.1 --port "$port" --max-model-len 4096 > "$GROVE_DATA_DIR/vllm.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && break
    kill -0 $server 2>/dev/null || { tail -40 "$GROVE_DATA_DIR/vllm.log" >&2; exit 1; }
    sleep 1
  done
  GROVE_MODEL=hosted_vllm/local GROVE_LLM_API_BASE="http://127.0.0.1:$port/v1" GROVE_LLM_API_KEY=local \
    GROVE_LLM_MAX_INPUT_TOKENS=3072 GROVE_LLM_MAX_OUTPUT_TOKENS=1024 GROVE_LLM_TOOL_MODE=text \
    GROVE_LLM_IDEAS=settings \
    "$PY" -m backend.cli.main run "$study" --budget 4 --auto-approve --fresh --quiet
  exit 0
fi
"$PY" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device: this script needs an NVIDIA GPU and a CUDA build of torch")
PY
"$PY" scripts/gpu_check.py "$@"
echo
"$PY" benchmarks/learning.py --device cuda
