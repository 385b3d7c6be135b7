"""kvroute as vLLM's KV transfer path: ``KvrouteConnector`` for ``--kv-transfer-config``.

``kv_connector_module_path: "kvroute.engines.vllm"`` makes vLLM import this package and look up
``KvrouteConnector``. Reading path: params (configuration and the handover) -> layout (a rank's
cache as a kvroute registration) -> pulls (a consumer's NIXL reads) -> worker (registration,
lease, per-step work) -> scheduler (what moves) -> connector (vLLM's API). vLLM and torch are
imported only here, never by the rest of kvroute.
"""

from kvroute.engines.vllm.connector import KvrouteConnector, KvrouteMetadata
from kvroute.engines.vllm.worker import RegistrationRefused

__all__ = ["KvrouteConnector", "KvrouteMetadata", "RegistrationRefused"]
