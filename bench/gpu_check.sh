#!/usr/bin/env bash
# One prepared check of the transfer data plane on a GPU machine (< 5 minutes):
# installs what is missing WITHOUT touching torch (the preinstalled torch is used as is), then runs
# the cuda-marked transfer tests (the data plane, and digests' staging of device memory), the
# transfer benchmark on CPU and CUDA, and the digest benchmark's gather from the device.
#   bash bench/gpu_check.sh            (PYTHON=/path/to/python to choose the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD/service:$PWD${PYTHONPATH:+:$PYTHONPATH}"

torch_version() { "$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none; }
BEFORE="$(torch_version)"
if [ "$BEFORE" = none ]; then
  echo "no torch on this machine; this check never installs one" >&2
  exit 2
fi
"$PY" - <<'PYEOF'
import torch
print("torch", torch.__version__, "cuda build", torch.version.cuda)
print("torch.cuda.is_available():", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device 0:", torch.cuda.get_device_name(0), "count", torch.cuda.device_count())
PYEOF

# The package's own dependencies (torch is only in the 'transfer' extra, so never pulled) and the
# test runner; CuPy only for the CUDA IPC test. Failures here (no network) are reported, not fatal.
timeout 150 "$PY" -m pip install -q --disable-pip-version-check -e . \
  pytest pytest-asyncio pytest-aiohttp pytest-timeout hypothesis \
  || echo "warning: pip install failed; using what is installed"
if ! "$PY" -c 'import cupy' 2>/dev/null; then
  CUDA_MAJOR="$("$PY" -c 'import torch; print((torch.version.cuda or "0").split(".")[0])')"
  if [ "$CUDA_MAJOR" != 0 ]; then
    timeout 90 "$PY" -m pip install -q --disable-pip-version-check "cupy-cuda${CUDA_MAJOR}x" \
      || echo "warning: CuPy not installed; the CUDA IPC test will be skipped"
  fi
fi
AFTER="$(torch_version)"
if [ "$AFTER" != "$BEFORE" ]; then
  echo "error: torch changed from $BEFORE to $AFTER during installation" >&2
  exit 3
fi

status=0
echo "== cuda-marked transfer tests"
timeout 150 "$PY" -m pytest tests/transfer -m cuda -q -rs -p no:cacheprovider || status=1
echo "== transfer benchmark"
timeout 120 "$PY" bench/transfer_bench.py --device all || status=1
echo "== a GPU rank's digest: its blocks staged from the device"
(cd bench && timeout 90 "$PY" digest_bench.py --tokens 2048 --state-tp "" --device cuda) || status=1
exit $status
