"""Transfer jobs through the client against a live server: submit, wait, read, refusals."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from kvroute.client import KvrouteClient, KvrouteError  # noqa: E402
from kvroute.client.memory import ShmPool  # noqa: E402
from kvroute.client.pools import KvLayout, SharedKvPool, rank_document  # noqa: E402
from kvroute.geometry import Kind  # noqa: E402
from tests.client.live import WORKER_TOKEN, LiveServer  # noqa: E402

pytestmark = pytest.mark.slow
LAYOUT = KvLayout(Kind.HND, 2, 2, 4, 8, "bfloat16", total_kv_heads=2)
SLOTS = 6


@pytest.fixture
def pools() -> Iterator[dict[str, tuple[ShmPool, SharedKvPool]]]:
    opened = {}
    for role in ("context", "generation"):
        memory = ShmPool(
            f"kvroute-client-{role}-{os.getpid()}-{uuid.uuid4().hex[:6]}", 4096 * SLOTS
        )
        memory.tensor.zero_()
        opened[role] = (memory, SharedKvPool.carve([LAYOUT], SLOTS, buffer=memory.tensor))
    opened["context"][1].tensors[0].copy_(torch.randn(SLOTS, *LAYOUT.block_shape))
    yield opened
    for memory, _ in opened.values():
        memory.close()


def test_submit_wait_and_read_a_transfer(
    live_server: LiveServer, pools: dict[str, tuple[ShmPool, SharedKvPool]]
) -> None:
    with KvrouteClient(live_server.url, token=WORKER_TOKEN) as client:
        for role, instance in (("context", "tctx"), ("generation", "tgen")):
            memory, pool = pools[role]
            document = rank_document(
                role=role, target=LAYOUT, pools=[pool.describe(memory=memory.descriptor())]
            )
            client.register("transfers", instance, 0, document)
        submitted = client.submit_transfer(
            "transfers",
            sender="tctx",
            receiver="tgen",
            receiver_ranks=[0],
            src_blocks=[1, 4],
            dst_blocks=[0, 5],
        )
        assert submitted.state in {"queued", "running", "succeeded"}
        done = client.wait_transfer(submitted.id, limit_s=30)
        again = client.get_transfer(submitted.id)
        with pytest.raises(KvrouteError) as out_of_range:
            client.submit_transfer(
                "transfers",
                sender="tctx",
                receiver="tgen",
                receiver_ranks=[0],
                src_blocks=[SLOTS],
                dst_blocks=[0],
            )
        with pytest.raises(KvrouteError) as unknown:
            client.get_transfer("no-such-job")
    assert done.state == "succeeded"
    assert done.finished
    assert done.bytes == 2 * LAYOUT.block_bytes
    assert (again.id, again.state, again.bytes) == (done.id, "succeeded", done.bytes)
    source, target = pools["context"][1].tensors[0], pools["generation"][1].tensors[0]
    assert torch.equal(target[0], source[1])
    assert torch.equal(target[5], source[4])
    assert not target[1:5].any()
    assert out_of_range.value.status == 422
    assert unknown.value.status == 404
