#!/usr/bin/env bash
# Set up Grove and run the bundled digits study end to end with the `search` policy.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export GROVE_DATA_DIR=${GROVE_DATA_DIR:-.grove}
. .venv/bin/activate
exec grove run examples/digits --auto-approve --fresh "$@"
