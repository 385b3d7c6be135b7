"""kvroute: KV-cache transfer routing for disaggregated LLM serving."""

__version__ = "0.1.0"
