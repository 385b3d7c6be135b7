#!/usr/bin/env bash
# Sets up .venv if it is missing (scripts/setup.sh), then serves kvroute on 127.0.0.1 with the
# embedded SQLite database ./kvroute.db (migrated on start). Arguments go to `kvroute serve`
# (e.g. --port 9000); KVROUTE_* variables configure the rest (`kvroute serve --help` lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/kvroute ] || bash scripts/setup.sh
exec .venv/bin/kvroute serve "$@"
