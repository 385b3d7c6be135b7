"""A producer rank's done messages, over real NIXL notifications (UCX on loopback): a consumer's
message frees a held request's blocks, even one that came before the hold started, and a message
for a request this rank never holds is dropped after one ``send_timeout_s`` instead of kept."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest

from tests.engines import require_vllm

require_vllm()
pytest.importorskip("nixl._api", reason="nixl is not installed")
pytest.importorskip("torch")

from kvroute.client.nixl_transport import NixlEndpoint  # noqa: E402
from kvroute.engines.vllm.params import Settings, done_message  # noqa: E402
from kvroute.engines.vllm.worker import Worker  # noqa: E402

SEND_TIMEOUT_S = 1.0


def until(condition: Callable[[], bool], limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "not within the limit"
        time.sleep(0.01)


def test_done_messages_free_held_requests_and_strays_are_dropped_after_a_send_timeout() -> None:
    suffix = uuid.uuid4().hex[:8]
    producer, consumer = NixlEndpoint(f"p-{suffix}"), NixlEndpoint(f"c-{suffix}")
    agent = consumer.add_peer(producer.metadata)
    settings = Settings("http://127.0.0.1:9", "d", "p", "context", send_timeout_s=SEND_TIMEOUT_S)
    worker = Worker(settings, vllm_config=None, kv_cache_config=None)
    worker.endpoint = producer
    worker.holding["held"] = time.monotonic() + 60
    for request_id in ("held", "early", "stray"):
        consumer.notify(agent, done_message(request_id, 1))
    sent: set[str] = set()

    def all_heard() -> bool:
        sent.update(worker._sent())
        return {"early", "stray"} <= set(worker.heard)

    until(all_heard)
    assert sent == {"held"}
    # "early" came before its hold started (the hold starts at the producer's next step): counted.
    worker.holding["early"] = time.monotonic() + 60
    assert worker._sent() == {"early"}
    assert set(worker.heard) == {"stray"}  # not held (yet): kept for one send timeout
    time.sleep(SEND_TIMEOUT_S + 0.1)
    assert worker._sent() == set()
    assert worker.heard == worker.expected == worker.heard_at == {}
