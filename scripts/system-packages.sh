#!/usr/bin/env bash
# Debian packages the test suite drives: chromium and chromium-driver (the web console is clicked
# through in a headless browser) and prometheus (promtool checks and tests the alert rules).
# Installs only what is missing, so a machine that has them needs no package index.
set -euo pipefail
wanted=(chromium chromium-driver prometheus)
missing=()
for package in "${wanted[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if ((${#missing[@]})); then
  if [ "$(id -u)" != 0 ]; then
    echo "missing Debian packages ${missing[*]}: run this script as root (browser and promtool tests will not run)" >&2
    exit 0
  fi
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi
