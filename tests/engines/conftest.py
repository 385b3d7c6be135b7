"""Fixtures shared by the modules that drive vLLM's hybrid (Mamba-state) classes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def channel_major() -> Iterator[None]:
    """The conv state stored channel-major (``VLLM_SSM_CONV_STATE_LAYOUT=DS``), as kvroute needs."""
    from vllm.model_executor.layers.mamba import mamba_utils

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
        mamba_utils.get_conv_state_layout.cache_clear()
        yield
    mamba_utils.get_conv_state_layout.cache_clear()
