#!/usr/bin/env bash
# Create .venv and install Grove with its pinned dependencies (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v git >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq git
fi
if ! command -v redis-server >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c requirements.lock -e '.[dev]'
