"""Transfer jobs through the client against a live server: submit, wait, read, refusals."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from kvroute.client import (  # noqa: E402
    AsyncKvrouteClient,
    KvrouteClient,
    KvrouteError,
    RequestBlocks,
    TokenRange,
    TokenWindow,
)
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
            blocks=RequestBlocks([1, 4], [0, 5]),
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
                blocks=RequestBlocks([SLOTS], [0]),
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


WIDE = KvLayout(Kind.HND, 2, 2, 8, 8, "bfloat16", total_kv_heads=2)  # blocks of 8 tokens


def _register_wide(client: KvrouteClient, pools: dict[str, tuple[ShmPool, SharedKvPool]]) -> None:
    for role, instance, layout in (("context", "wctx", LAYOUT), ("generation", "wgen", WIDE)):
        memory, pool = pools[role]
        document = rank_document(
            role=role, target=layout, pools=[pool.describe(memory=memory.descriptor())]
        )
        client.register("reblock", instance, 0, document)


@pytest.fixture
def wide_pools(
    pools: dict[str, tuple[ShmPool, SharedKvPool]],
) -> dict[str, tuple[ShmPool, SharedKvPool]]:
    memory, _ = pools["generation"]
    return pools | {
        "generation": (memory, SharedKvPool.carve([WIDE], SLOTS // 2, buffer=memory.tensor))
    }


def test_a_token_range_moves_into_larger_blocks(
    live_server: LiveServer, wide_pools: dict[str, tuple[ShmPool, SharedKvPool]]
) -> None:
    with KvrouteClient(live_server.url, token=WORKER_TOKEN) as client:
        _register_wide(client, wide_pools)
        plan = client.get_plan("reblock", sender="wctx", receiver="wgen", receiver_rank=0)
        period = client.get_plan(
            "reblock", sender="wctx", receiver="wgen", receiver_rank=0, period=True
        )
        # tokens [5, 14): context slot s holds tokens [4s, 4s + 4), so the suffix list is 1, 2,
        # 3; the generation list holds tokens [0, 8) in slot 2 and [8, 16) in slot 0
        submitted = client.submit_transfer(
            "reblock",
            sender="wctx",
            receiver="wgen",
            receiver_ranks=[0],
            blocks=RequestBlocks([1, 2, 3], [2, 0], TokenWindow(TokenRange(5, 14))),
        )
        done = client.wait_transfer(submitted.id, limit_s=30)
    assert plan.periodic
    assert period.periodic
    assert plan.fragments_per_block == period.fragments_per_block > 0
    assert done.state == "succeeded", done.error
    source = wide_pools["context"][1].tensors[0]  # [slot, layer, K/V, head, token, dim]
    target = wide_pools["generation"][1].tensors[0]
    expected = torch.zeros_like(target)
    expected[2, ..., 5:8, :] = source[1, ..., 1:4, :]
    expected[0, ..., 0:4, :] = source[2]
    expected[0, ..., 4:6, :] = source[3, ..., 0:2, :]
    assert torch.equal(target, expected)
    assert done.bytes == 9 * source[0, ..., 0:1, :].numel() * 2


async def test_a_gap_is_refused_by_the_async_client_with_its_token(
    live_server: LiveServer, wide_pools: dict[str, tuple[ShmPool, SharedKvPool]]
) -> None:
    with KvrouteClient(live_server.url, token=WORKER_TOKEN) as client:
        _register_wide(client, wide_pools)
    async with AsyncKvrouteClient(live_server.url, token=WORKER_TOKEN) as client:
        with pytest.raises(KvrouteError) as gap:
            await client.submit_transfer(
                "reblock",
                sender="wctx",
                receiver="wgen",
                receiver_ranks=[0],
                blocks=RequestBlocks(
                    [1, 2],
                    [2, 0],
                    TokenWindow(TokenRange(5, 14), src_first_token=4, dst_first_token=0),
                ),
            )
    assert (gap.value.status, gap.value.code, gap.value.field) == (
        422,
        "token_range_not_covered",
        "src_blocks",
    )
    assert (gap.value.problem["token"], gap.value.problem["covered"]) == (12, [4, 12])
