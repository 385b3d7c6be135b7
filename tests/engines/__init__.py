"""vLLM's own classes drive the KvrouteConnector here. vLLM is an optional extra
(``scripts/vllm.sh``): without it every module of this package skips, saying so."""

from __future__ import annotations

from importlib.util import find_spec

import pytest

VLLM_MISSING = "vLLM is not installed (bash scripts/vllm.sh installs it next to the CPU torch)"


def require_vllm() -> None:
    """Skips the calling test module when vLLM is not installed. Looked up, not imported: vLLM
    takes seconds to import, and every pytest-xdist worker collects every module."""
    if find_spec("vllm") is None:
        pytest.skip(VLLM_MISSING, allow_module_level=True)
