"""``kvroute proxy``: an OpenAI-compatible front for a P/D deployment of vLLM engines.

Each request is prefilled on a producer (``max_tokens: 1``, ``do_remote_decode``) and continued on a
consumer with the producer's ``kv_transfer_params``; the pair is chosen among the live engines
kvroute's registry knows and its pairs answer allows (``directory``), the exchange is ``handoff``.
"""

from kvroute.proxy.app import make_app

__all__ = ["make_app"]
