"""kvroute.engines: adapters between serving engines and kvroute.

Each engine or model format gets one module or subpackage here (a vLLM KV connector, registration
documents derived from Hugging Face model configs). They depend on ``kvroute.geometry`` and
``kvroute.client``, never the reverse, and import their engine's packages only where used, so
``import kvroute.engines`` needs nothing beyond the base install.
"""
