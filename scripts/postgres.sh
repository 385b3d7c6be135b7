#!/usr/bin/env bash
# Starts the machine's PostgreSQL cluster if nothing answers on 127.0.0.1:5432 (the suite's server).
set -euo pipefail
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start
  for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi
