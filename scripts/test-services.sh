#!/usr/bin/env bash
# Make sure the services the tests need are installed, and print the PostgreSQL admin URL to use:
# the local server if it takes trusted connections on 127.0.0.1:5432, else a throwaway cluster.
set -euo pipefail
need=()
command -v redis-server >/dev/null || need+=(redis-server)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
# The dashboard's end-to-end test drives Debian's Chromium (Playwright never downloads a browser).
command -v chromium >/dev/null || need+=(chromium)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >&2
fi
if [ -n "${GROVE_TEST_POSTGRES:-}" ]; then echo "$GROVE_TEST_POSTGRES"; exit 0; fi
if command -v pg_ctlcluster >/dev/null && ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
  for v in $(ls /etc/postgresql 2>/dev/null); do pg_ctlcluster --skip-systemctl-redirect "$v" main start >&2 || true; done
fi
if psql "postgresql://postgres@127.0.0.1:5432/postgres" -qAtc "select 1" >/dev/null 2>&1; then
  echo "postgresql://postgres@127.0.0.1:5432/postgres"; exit 0
fi
# A private cluster with trust auth, owned by the postgres user (initdb refuses root).
bin=$(dirname "$(ls /usr/lib/postgresql/*/bin/initdb | sort -V | tail -1)")
dir=/tmp/grove-test-pg
port=55432
if ! "$bin/pg_isready" -q -h 127.0.0.1 -p $port 2>/dev/null; then
  rm -rf "$dir" && mkdir -p "$dir" && chown postgres "$dir"
  su postgres -s /bin/sh -c "$bin/initdb -D $dir/data -U postgres --auth=trust >/dev/null"
  su postgres -s /bin/sh -c "$bin/pg_ctl -D $dir/data -l $dir/log -o '-p $port -k $dir -c listen_addresses=127.0.0.1' -w start >/dev/null"
fi
echo "postgresql://postgres@127.0.0.1:$port/postgres"
