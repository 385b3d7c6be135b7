#!/usr/bin/env bash
# Runs the whole test suite (SQLite and PostgreSQL, CPU data plane, the console in chromium).
# Sets up what is missing first: .venv (scripts/setup.sh), the Debian packages the tests drive
# (scripts/system-packages.sh) and the local PostgreSQL server (scripts/postgres.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
bash scripts/system-packages.sh
bash scripts/postgres.sh
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
exec .venv/bin/python -m pytest "$@"
