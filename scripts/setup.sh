#!/usr/bin/env bash
# Creates .venv with kvroute, its test tools, the CPU data-plane extras and transformers (configs).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# torch is pinned to the CPU wheel; never let a resolver pick an unpinned (CUDA) build.
.venv/bin/pip install -q -e '.[server,test,transfer,models]'
# nixl from PyPI would pull a CUDA torch through its dependencies; its wheels need none of them here.
.venv/bin/pip install -q --no-deps nixl nixl-cu12 || echo "nixl unavailable: NIXL tests will skip"
# vLLM on CPU for the connector tests (tests/engines): never resolved against its CUDA torch pin.
bash scripts/vllm.sh
