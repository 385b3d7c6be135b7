#!/usr/bin/env bash
# Runs the whole test suite (SQLite and PostgreSQL, CPU data plane).
set -euo pipefail
cd "$(dirname "$0")/.."
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
exec .venv/bin/python -m pytest "$@"
