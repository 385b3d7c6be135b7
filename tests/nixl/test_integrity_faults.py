"""KV integrity over a real NIXL pull (UCX on loopback), with faults injected in transit.

Two context ranks (TP2, ``tests.nixl.integrity_sender``) write the canary into their reserved block
and digest a request's blocks as they produced them; the test process is the generation rank
(TP1): it pulls the canary with the real plan and transport, checks it through its kernels' view of
its layout, digests what a request brought, and reports each outcome to a live kvroute. Faults:
the sender's pool read 2 bytes off (a read into the wrong offset), a bit flipped in a producer block
after the write (and after its digest), and a consumer whose registration lies about its layout.
Each is caught, names its first wrong element, fails the path (the pairs answer leaves the pair out)
and, for a digest, marks the request's blocks for recompute.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("nixl._api", reason="nixl is not installed")
torch = pytest.importorskip("torch")

from kvroute.client.kv_rows import RowKey  # noqa: E402
from tests.client.live import LiveServer  # noqa: E402
from tests.nixl import world  # noqa: E402
from tests.nixl.integrity_pair import (  # noqa: E402
    Receiver,
    Senders,
    metrics,
    says_head_buffer,
    started_senders,
)

pytestmark = pytest.mark.slow
SRC_BLOCKS, DST_BLOCKS = [1, 2, 3, 4], [0, 3, 4, 5]  # the request: prompt tokens 0-15
REQUEST = range(0, 4 * world.TOKENS)


@pytest.fixture
def senders(live_server: LiveServer) -> Iterator[Senders]:
    with started_senders(live_server.url) as running:
        yield running


@pytest.fixture
def receiver(live_server: LiveServer, senders: Senders, request: Any) -> Iterator[Receiver]:
    lies = getattr(request, "param", False)
    # The lie: each head's K then V, while its kernels keep every K, then every V.
    made = Receiver(live_server.url, "gen1" if lies else "gen0",
                    lie=says_head_buffer(0) if lies else None)  # fmt: skip
    try:
        yield made
    finally:
        made.close()


def test_a_clean_path_is_attested_and_its_digests_agree(
    receiver: Receiver, senders: Senders
) -> None:
    failure, cost_ms = receiver.canary(senders)
    assert failure is None
    path = receiver.report("canary", None, cost_ms)
    assert (path.state, path.source) == ("attested", "canary")
    sent = senders.digest(SRC_BLOCKS, REQUEST, chunk=256)
    receiver.pull(SRC_BLOCKS, DST_BLOCKS)
    got = receiver.digest(DST_BLOCKS, REQUEST, 256)
    assert sent.shared(got) == len(got.rows) > 0
    assert sent.first_mismatch(got) is None
    assert receiver.excluded() == {}


def test_a_bit_flipped_after_the_write_is_caught_by_the_digest(
    receiver: Receiver, senders: Senders
) -> None:
    sent = senders.digest(
        SRC_BLOCKS, REQUEST, chunk=1
    )  # as the producer computed it, before the fault
    # Sender rank 1 (global heads 2, 3): src block 2 holds tokens 4-7; layer 1, V, its head 0.
    assert senders.ask(1, "flip", "target", (2, 1, 1, 0, 3), 5) == ("flipped",)
    receiver.pull(SRC_BLOCKS, DST_BLOCKS)
    found = sent.first_mismatch(receiver.digest(DST_BLOCKS, REQUEST, 1))
    assert found is not None
    assert (found.key, found.tokens) == (RowKey("target", "key,value", 1, 2, 1), (7, 8))
    path = receiver.report("digest", found)
    assert (path.state, path.element["detail"]) == (
        "failed",
        "target key,value layer 1 head 2 V, token 7",
    )
    assert receiver.excluded() == {"ctx0": "kv_path_failed"}
    assert 'kvroute_kv_digest_mismatch_total{consumer="gen0",producer="ctx0"} 1.0' in metrics(
        receiver.url
    )
    # The flip is in a request's block, not in the canary's: the path's transport is sound.
    failure, _ = receiver.canary(senders)
    assert failure is None


def test_a_read_at_the_wrong_offset_fails_the_canary(receiver: Receiver, senders: Senders) -> None:
    failure, _ = receiver.canary(senders, read_shift=-2)
    assert failure is not None
    assert (failure.key.layer, failure.key.buffer, failure.tokens) == (0, 0, (0, 1))
    path = receiver.report("canary", failure)
    assert path.state == "failed"
    assert receiver.excluded() == {"ctx0": "kv_path_failed"}
    # With digests off, nothing checks a request's bytes: the next canary catches the fault again.
    again, _ = receiver.canary(senders, read_shift=-2)
    assert again == failure


@pytest.mark.parametrize("receiver", [True], indirect=True, ids=["lying"])
def test_a_registration_that_lies_about_its_layout_fails_the_canary_and_the_digest(
    receiver: Receiver, senders: Senders
) -> None:
    """The consumer registers a per-head K-then-V interior while its kernels read every K, then
    every V: kvroute plans writes to where the registration says, which its kernels do not read."""
    failure, _ = receiver.canary(senders)
    assert failure is not None
    receiver.report("canary", failure)
    assert receiver.excluded() == {"ctx0": "kv_path_failed"}
    sent = senders.digest(SRC_BLOCKS, REQUEST, chunk=256)
    receiver.pull(SRC_BLOCKS, DST_BLOCKS)
    assert sent.first_mismatch(receiver.digest(DST_BLOCKS, REQUEST, 256)) is not None
