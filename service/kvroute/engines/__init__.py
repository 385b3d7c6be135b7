"""kvroute.engines: adapters between serving engines and kvroute.

Each engine or model format gets one module or subpackage here (a vLLM KV connector, registration
documents derived from Hugging Face model configs). They depend on ``kvroute.geometry`` and
``kvroute.client``, never the reverse, and import their engine's packages only where used, so
``import kvroute.engines`` needs nothing beyond the base install.

``engines.vllm`` runs inside vLLM's processes only. ``engines.models`` is pure config reading (a
model config and layouts to registration documents and a pre-flight verdict, importing no engine
package) and is shared with the server: ``POST /v1/preflight`` and ``kvroute check`` run it. The
layering test (``tests/unit/test_layering.py``) holds both rules.
"""
