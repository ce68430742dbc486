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
.venv/bin/python -m pip install -q --disable-pip-version-check -c requirements.lock -e '.[dev]'
