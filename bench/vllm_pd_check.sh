#!/usr/bin/env bash
# One prepared check of KvrouteConnector in a real two-engine vLLM P/D on a GPU machine (< 10 min):
# kvroute serves on loopback, a tiny random-weight Llama (written here, no download) runs in a
# producer (kv_producer, TP1) and a consumer (kv_consumer, TP1) vLLM on the same GPU, and a request
# is handed over as a proxy does: the producer prefills (max_tokens 1) and answers
# kv_transfer_params, the consumer continues from the pulled KV. The consumer's tokens must equal a
# plain (non-disaggregated) run of the same prompt on the producer: greedy, same weights.
#   bash bench/vllm_pd_check.sh        (needs a CUDA vLLM 0.34 and nixl in PYTHON's environment)
# Never run in CI (no GPU); the CPU tests in tests/engines cover the connector against vLLM's classes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WORK="$(mktemp -d)"
export PYTHONPATH="$PWD/service${PYTHONPATH:+:$PYTHONPATH}" UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT

"$PY" - "$WORK/model" <<'PYEOF'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                     num_key_value_heads=4, num_hidden_layers=4, vocab_size=2048,
                     max_position_embeddings=2048, torch_dtype="float16")
torch.manual_seed(0)
LlamaForCausalLM(config).to(torch.float16).save_pretrained(sys.argv[1])
print("tiny random Llama written to", sys.argv[1])
PYEOF

KVROUTE_DATABASE_URL="sqlite+aiosqlite:///$WORK/kvroute.db" "$PY" -m kvroute serve --port 8080 \
  >"$WORK/kvroute.log" 2>&1 & pids+=($!)
config() {
  printf '{"kv_connector":"KvrouteConnector","kv_connector_module_path":"kvroute.engines.vllm","kv_role":"%s","kv_connector_extra_config":{"url":"http://127.0.0.1:8080","deployment":"tiny","instance":"%s"}}' "$1" "$2"
}
serve() {  # port role instance
  "$PY" -m vllm.entrypoints.openai.api_server --model "$WORK/model" --port "$1" \
    --skip-tokenizer-init --enforce-eager --gpu-memory-utilization 0.2 --max-model-len 1024 \
    --kv-transfer-config "$(config "$2" "$3")" >"$WORK/$3.log" 2>&1 &
  pids+=($!)
}
serve 8100 kv_producer prefill0
serve 8200 kv_consumer decode0
for port in 8100 8200; do
  for _ in $(seq 1 240); do curl -sf "127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
done

"$PY" - <<'PYEOF'
import json, urllib.request
def complete(port, body):
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=120))
prompt = [(i * 37) % 2000 + 1 for i in range(300)]
base = {"model": "", "prompt": prompt, "temperature": 0, "max_tokens": 16,
        "return_token_ids": True}
plain = complete(8100, base)["choices"][0]["token_ids"]
prefill = complete(8100, {**base, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
params = prefill["kv_transfer_params"]
print("handover:", {k: v for k, v in params.items() if k != "remote_block_ids"})
decoded = complete(8200, {**base, "kv_transfer_params": params})["choices"][0]["token_ids"]
print("plain   ", plain)
print("P/D     ", decoded)
assert decoded == plain, "the consumer's tokens differ from a plain run"
print("OK: the consumer continued from KV pulled through kvroute's plan")
PYEOF
