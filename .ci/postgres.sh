#!/usr/bin/env bash
# Start a throwaway PostgreSQL server on loopback for the multi-worker storage tests and print
# its URL on stdout (everything else goes to stderr). Safe to run again: it reuses the server.
#   export LUCE_TUNE_TEST_PG_URL=$(.ci/postgres.sh)
# Installs the Debian/Ubuntu `postgresql` package when missing (needs root and apt).
set -euo pipefail

port=${LUCE_TUNE_PG_PORT:-55432}
data=${LUCE_TUNE_PG_DATA:-/tmp/luce-tune-pg}
db=luce_tune_test
role=luce

if ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "postgres.sh: PostgreSQL is not installed and installing it needs root" >&2
    exit 1
  fi
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; } >&2
fi
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)

# The server refuses to run as root: run it as the package's `postgres` user instead.
if [ "$(id -u)" -eq 0 ]; then
  id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
  as() { runuser -u postgres -- "$@"; }
else
  as() { "$@"; }
fi

if [ ! -s "$data/PG_VERSION" ]; then
  mkdir -p "$data"
  [ "$(id -u)" -eq 0 ] && chown postgres: "$data"
  chmod 700 "$data"
  as "$bin/initdb" -D "$data" -U "$role" --auth=trust -E UTF8 >&2
fi
if ! as "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1; then
  as "$bin/pg_ctl" -D "$data" -l "$data/server.log" -w \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $data -c max_connections=200" start >&2
fi
psql=(as "$bin/psql" -h 127.0.0.1 -p "$port" -U "$role" -d postgres -qtA)
if [ "$("${psql[@]}" -c "SELECT 1 FROM pg_database WHERE datname = '$db'")" != "1" ]; then
  "${psql[@]}" -c "CREATE DATABASE $db" >&2
fi
echo "postgresql+psycopg://$role@127.0.0.1:$port/$db"
