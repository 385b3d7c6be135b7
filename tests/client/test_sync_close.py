"""The blocking client after ``close``: a call that reaches the stopped loop fails instead of
waiting forever (a report thread of the vLLM connector that did kept the engine's process from
exiting)."""

from __future__ import annotations

import threading
import time

import pytest

from kvroute.client import KvrouteClient
from kvroute.client.sync import LOOP_CHECK_S


def test_a_call_that_reaches_the_stopped_loop_fails_within_a_check() -> None:
    client = KvrouteClient("http://127.0.0.1:9")  # nothing listens: the call never gets that far
    # The window inside ``close``: the loop stopped, not closed yet (``_run`` still schedules).
    client._loop.call_soon_threadsafe(client._loop.stop)
    client._thread.join(timeout=5)
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            client.heartbeat("llama", "ctx0", 0)
            outcome.append(None)
        except BaseException as error:
            outcome.append(error)

    started = time.monotonic()
    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(timeout=10 * LOOP_CHECK_S)
    assert not caller.is_alive(), "the call waited on the stopped loop"
    assert time.monotonic() - started < 4 * LOOP_CHECK_S
    [error] = outcome
    assert isinstance(error, RuntimeError)
    assert "closed" in str(error)
    client._loop.close()


def test_a_closed_client_refuses_at_once() -> None:
    client = KvrouteClient("http://127.0.0.1:9")
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.heartbeat("llama", "ctx0", 0)
