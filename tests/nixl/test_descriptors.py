"""Plan -> NIXL descriptor lists: exact addresses, coalescing rules, refusals, and equivalence."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvroute.client.nixl_descs import PoolAddress, plan_descriptors
from kvroute.client.pools import KvLayout, Parallel, SharedKvPool, rank_document
from kvroute.geometry import (
    Kind,
    Owner,
    PeerPlan,
    Plan,
    RankRegistration,
    RequestBlocks,
    ViewTransfer,
    build_plan,
)
from tests.nixl.pulled import base, pulled


def plan(*peers: PeerPlan) -> Plan:
    """A typed plan of ``peers`` for receiver rank 0 (its writers are the peers that send)."""
    return Plan(
        deployment="d",
        sender_instance="ctx",
        sender_ranks=tuple(p.rank for p in peers),
        sender_dp_rank=0,
        receiver_instance="gen",
        receiver_rank=0,
        peers=peers,
        fingerprint="sha256:test",
        fanin_bounce_safe=True,
        sender_parallel=(len(peers), 1),
        receiver_parallel=(1, 1),
    )


def peer(rank: int, *views: ViewTransfer) -> PeerPlan:
    return PeerPlan(rank=rank, pp_rank=0, tp_rank=rank, views=views)


def view(fragments: list[list[int]], src_pool: int = 0, dst_pool: int = 0) -> ViewTransfer:
    """A block view pair between equal block sizes moving ``fragments`` of one slot."""
    return ViewTransfer(
        src_view=0,
        dst_view=0,
        src_pool=src_pool,
        dst_pool=dst_pool,
        mapper="hnd",
        duplicate_head_factor=1,
        peer_duplicate_head_factor=1,
        fragments=tuple((so, do, length) for so, do, length in fragments),
        layers=(0,),
        owner="target",
        roles=("key",),
        total_heads=1,
        src_heads=(0, 1),
        dst_heads=(0, 1),
    )


RECEIVER = {0: PoolAddress(base=100_000, slot_stride=64, num_slots=16)}
SENDER = {0: PoolAddress(base=5_000, slot_stride=64, num_slots=16, device=1)}


def test_fragment_addresses_are_exact() -> None:
    result = plan_descriptors(
        plan(peer(0, view([[0, 0, 16], [16, 32, 16]]))),
        receiver_pools=RECEIVER,
        sender_pools={0: SENDER},
        blocks=RequestBlocks([0, 3], [2, 9]),
    )
    [descs] = result.peers
    assert descs.local == (
        (100_000 + 2 * 64, 16, 0),
        (100_000 + 2 * 64 + 32, 16, 0),
        (100_000 + 9 * 64, 16, 0),
        (100_000 + 9 * 64 + 32, 16, 0),
    )
    assert descs.remote == (
        (5_000, 16, 1),
        (5_016, 16, 1),
        (5_000 + 3 * 64, 16, 1),
        (5_000 + 3 * 64 + 16, 16, 1),
    )
    assert (descs.bytes, descs.fragments, result.expected_notifications) == (64, 4, 1)


def test_runs_contiguous_on_both_sides_merge_across_blocks() -> None:
    whole_slot = plan(peer(0, view([[0, 0, 32], [32, 32, 32]])))
    consecutive = plan_descriptors(
        whole_slot,
        receiver_pools=RECEIVER,
        sender_pools={0: SENDER},
        blocks=RequestBlocks([0, 1, 2], [5, 6, 7]),
    )
    assert consecutive.peers[0].local == ((100_000 + 5 * 64, 192, 0),)
    assert consecutive.peers[0].remote == ((5_000, 192, 1),)
    assert consecutive.descriptors == 1
    assert consecutive.peers[0].fragments == 6
    gap = plan_descriptors(
        whole_slot,
        receiver_pools=RECEIVER,
        sender_pools={0: SENDER},
        blocks=RequestBlocks([0, 1, 2], [5, 7, 8]),
    )
    assert [length for _, length, _ in gap.peers[0].local] == [64, 128]


def test_runs_never_cross_pools_even_when_adjacent() -> None:
    receiver = {0: PoolAddress(0, 64, 1), 1: PoolAddress(64, 64, 1)}
    sender = {0: PoolAddress(1000, 64, 1), 1: PoolAddress(1064, 64, 1)}
    result = plan_descriptors(
        plan(peer(0, view([[0, 0, 64]], 0, 0), view([[0, 0, 64]], 1, 1))),
        receiver_pools=receiver,
        sender_pools={0: sender},
        blocks=RequestBlocks([0], [0]),
    )
    assert result.peers[0].local == ((0, 64, 0), (64, 64, 0))


def test_silent_peers_get_no_list_and_notifications_count_writers() -> None:
    result = plan_descriptors(
        plan(peer(0, view([[0, 0, 8]])), peer(1, view([])), peer(2, view([[8, 8, 8]]))),
        receiver_pools=RECEIVER,
        sender_pools={0: SENDER, 2: SENDER},
        blocks=RequestBlocks([1], [1]),
    )
    assert [p.rank for p in result.peers] == [0, 2]
    assert result.expected_notifications == 2
    assert result.bytes == 16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"blocks": RequestBlocks([0], [0, 1])}, "1 source blocks but 2"),
        ({"blocks": RequestBlocks([16], [0])}, "16 slots"),
        ({"blocks": RequestBlocks([0], [-1])}, "receiver pool 0 has 16 slots"),
        ({"blocks": RequestBlocks([0], [0]), "sender_pools": {}}, "sender rank 0"),
        ({"blocks": RequestBlocks([0], [0]), "receiver_pools": {}}, "receiver pool 0"),
    ],
)
def test_bad_inputs_are_named(kwargs: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {"receiver_pools": RECEIVER, "sender_pools": {0: SENDER}, **kwargs}
    with pytest.raises(ValueError, match=message):
        plan_descriptors(plan(peer(0, view([[0, 0, 8]]))), **arguments)


def test_fragment_beyond_the_slot_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds the slot stride"):
        plan_descriptors(
            plan(peer(0, view([[60, 0, 8]]))),
            receiver_pools=RECEIVER,
            sender_pools={0: SENDER},
            blocks=RequestBlocks([0], [0]),
        )


def _rank(
    role: str, tp: int, rank: int, kind: Kind, blocks: int
) -> tuple[RankRegistration, SharedKvPool]:
    target = KvLayout(kind, 4, 8 // tp, 4, 8, "bfloat16", total_kv_heads=8)
    draft = KvLayout(kind, 1, 1, 4, 8, "bfloat16", owner=Owner.DRAFT, total_kv_heads=1)
    pool = SharedKvPool.carve([target, draft], blocks)
    doc = rank_document(
        role=role,
        target=target,
        pools=[pool.describe()],
        num_draft_layers=1,
        parallel=Parallel(tp_size=tp, tp_rank=rank),
    )
    reg = RankRegistration.from_json(doc, deployment="d", instance=role, rank=rank)
    return reg, pool


@pytest.mark.parametrize("kind", [Kind.HND, Kind.NHD])
def test_descriptors_move_exactly_what_the_fragments_move(kind: Kind) -> None:
    """Coalesced descriptors applied as memcpy == every fragment applied one by one."""
    senders = [_rank("context", 4, r, kind, 6) for r in range(4)]
    receiver, _ = _rank("generation", 2, 1, kind, 6)
    built = build_plan([reg for reg, _ in senders], receiver)
    rng = np.random.default_rng(0)
    sender_bytes = {
        r: rng.integers(0, 256, pool.buffer.numel(), dtype=np.uint8)
        for r, (_, pool) in enumerate(senders)
    }
    stride_s = senders[0][1].slot_stride
    stride_r = receiver.pools[0].slot_stride
    src_blocks, dst_blocks = [4, 0, 1, 2], [0, 1, 2, 5]
    result = plan_descriptors(
        built,
        receiver_pools={0: PoolAddress(0, stride_r, 6)},
        sender_pools={r: {0: PoolAddress(base(r), stride_s, 6)} for r in range(4)},
        blocks=RequestBlocks(src_blocks, dst_blocks),
    )
    pools = {rank: {0: data} for rank, data in sender_bytes.items()}
    by_descriptors = pulled(result, pools, np.zeros(stride_r * 6, dtype=np.uint8))
    by_fragments = np.zeros_like(by_descriptors)
    for p in built.peers:
        for v in p.views:
            for s, d in zip(src_blocks, dst_blocks, strict=True):
                for so, do, length in v.fragments:
                    by_fragments[d * stride_r + do : d * stride_r + do + length] = sender_bytes[
                        p.rank
                    ][s * stride_s + so : s * stride_s + so + length]
    assert np.array_equal(by_descriptors, by_fragments)
    assert result.expected_notifications == built.expected_writers == 2
    assert result.descriptors <= sum(p.fragments for p in result.peers)
    assert result.bytes == built.bytes_per_block * len(src_blocks)
