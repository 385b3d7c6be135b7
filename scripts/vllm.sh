#!/usr/bin/env bash
# vLLM's real classes on CPU, for tests/engines (the KvrouteConnector is tested against them).
# vLLM pins a CUDA torch (a ~6 GB download): it is installed with --no-deps, next to the pinned CPU
# torch that setup.sh installs, plus the pure-Python packages its connector, config and scheduler
# imports need. llguidance, xgrammar and apache-tvm-ffi are imported by vLLM's request path and
# would pull torch in through their own dependencies, so they get --no-deps too.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=(.venv/bin/pip install -q)
# transformers resolves normally (none of its dependencies is torch); the bound is vLLM 0.34's own
# (its METADATA: transformers<5.23.0,>=5.16.1), narrower than the models extra's (<5.26).
"${PIP[@]}" "transformers>=5.16.1,<5.23"
"${PIP[@]}" --no-deps vllm==0.34.0 llguidance==1.9.1 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
"${PIP[@]}" psutil==7.2.2 pyzmq==27.3.0 regex==2026.11.19 pillow==13.0.0 pybase64==1.5.1 \
    cbor2==6.3.0 msgspec==0.23.0 cloudpickle==3.1.3 uvloop==0.23.0 py-cpuinfo==9.0.0 \
    einops==0.8.2 "pydantic>=2.12" "cachetools>=5.3"
.venv/bin/python -c "import vllm.distributed.kv_transfer.kv_connector.v1.base, vllm.v1.core.sched.scheduler" \
    2>/dev/null || { echo "vLLM does not import: tests/engines would fail" >&2; exit 1; }
