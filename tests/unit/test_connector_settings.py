"""The vLLM connector's settings (``kv_connector_extra_config``): NIXL's progress thread."""

from __future__ import annotations

import pytest

from kvroute.engines.vllm.params import Settings

EXTRA = {"url": "http://127.0.0.1:9", "deployment": "llama", "instance": "prefill0"}


def test_nixl_s_progress_thread_is_on_unless_turned_off() -> None:
    assert Settings.from_config("kv_producer", EXTRA).nixl_progress_thread is True
    off = Settings.from_config("kv_consumer", {**EXTRA, "nixl_progress_thread": False})
    assert off.nixl_progress_thread is False


@pytest.mark.parametrize("value", ["false", 0, None])
def test_a_progress_thread_setting_that_is_not_a_boolean_is_refused_naming_the_key(
    value: object,
) -> None:
    with pytest.raises(ValueError, match="nixl_progress_thread must be true or false"):
        Settings.from_config("kv_producer", {**EXTRA, "nixl_progress_thread": value})
