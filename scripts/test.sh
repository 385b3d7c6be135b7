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
# pytest-xdist: three workers on a 2-core machine, because much of the suite waits on live servers,
# child processes and PostgreSQL rather than computing. loadfile keeps a module on one worker (its
# module-scoped fixtures are set up once; loadgroup cannot group under pytest 9.2, where xdist's
# group suffix no longer reaches the node id); --no-loadscope-reorder keeps the collection order,
# in which modules with slow tests come first (tests/conftest.py). KVROUTE_TEST_WORKERS overrides
# the count (0 runs in this process); arguments in "$@" override any of it. --durations lists the
# slowest tests, so a CI log shows where the suite's time goes.
exec .venv/bin/python -m pytest -n "${KVROUTE_TEST_WORKERS:-3}" --dist loadfile \
    --no-loadscope-reorder --durations=25 "$@"
