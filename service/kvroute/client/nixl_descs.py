"""A plan turned into NIXL descriptor lists: pure arithmetic, no NIXL import.

NIXL knows addresses, lengths and device ids, not heads or layers. For one transfer (a plan and
the block pairs to move) each sending peer gets two aligned lists — the receiver's bytes and the
sender's bytes — with descriptor ``i`` of one side the same length as descriptor ``i`` of the
other. Runs that are contiguous on both sides (and inside one pool on each side, since a
descriptor may not straddle two registrations) are merged first: descriptor count dominates
small-transfer latency, so it is reported next to the bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

Descriptor = tuple[int, int, int]  # (address, length, device id), NIXL's xfer-descriptor tuple


@dataclass(frozen=True, slots=True)
class PoolAddress:
    """Where a registered pool lives in its owner's address space (slot ``s`` at base + s*stride)."""

    base: int
    slot_stride: int
    num_slots: int
    device: int = 0


@dataclass(frozen=True, slots=True)
class PeerDescriptors:
    """What the receiver reads from one sending rank: ``local[i]`` <- ``remote[i]``."""

    rank: int
    local: tuple[Descriptor, ...]
    remote: tuple[Descriptor, ...]
    fragments: int  # before coalescing: fragments x blocks

    @property
    def bytes(self) -> int:
        return sum(length for _, length, _ in self.local)


@dataclass(frozen=True, slots=True)
class NixlTransfer:
    """Per sending rank descriptor lists; the receiver expects ``expected_notifications`` completions."""

    peers: tuple[PeerDescriptors, ...]
    expected_notifications: int

    @property
    def bytes(self) -> int:
        return sum(peer.bytes for peer in self.peers)

    @property
    def descriptors(self) -> int:
        return sum(len(peer.local) for peer in self.peers)


def plan_descriptors(
    plan: Mapping[str, Any],
    *,
    receiver_pools: Mapping[int, PoolAddress],
    sender_pools: Mapping[int, Mapping[int, PoolAddress]],
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
) -> NixlTransfer:
    """Descriptor lists for the pull of ``src_blocks`` (sender) into ``dst_blocks`` (receiver).

    ``sender_pools`` maps sender rank -> pool id -> address. Ranks with ``sends: false`` get no
    entry. Raises ``ValueError`` naming a missing pool, a block outside its pool or a fragment
    outside its slot, because NIXL would only fail later with ``NIXL_ERR_NOT_FOUND``.
    """
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(
            f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks"
        )
    src = np.asarray(src_blocks, dtype=np.int64)
    dst = np.asarray(dst_blocks, dtype=np.int64)
    peers = []
    for peer in plan["peers"]:
        if not peer["sends"]:
            continue
        rank = int(peer["rank"])
        if rank not in sender_pools:
            raise ValueError(f"no pool addresses for sender rank {rank}")
        peers.append(_peer(rank, peer["views"], receiver_pools, sender_pools[rank], src, dst))
    return NixlTransfer(tuple(peers), int(plan["expected_writers"]))


def _pool(
    pools: Mapping[int, PoolAddress], pool_id: int, side: str, blocks: np.ndarray
) -> PoolAddress:
    pool = pools.get(pool_id)
    if pool is None:
        raise ValueError(f"no address for {side} pool {pool_id}")
    if blocks.size and (blocks.min() < 0 or blocks.max() >= pool.num_slots):
        raise ValueError(
            f"{side} pool {pool_id} has {pool.num_slots} slots; blocks {blocks.tolist()}"
        )
    return pool


def _peer(
    rank: int,
    views: Sequence[Mapping[str, Any]],
    receiver_pools: Mapping[int, PoolAddress],
    sender_pools: Mapping[int, PoolAddress],
    src_blocks: np.ndarray,
    dst_blocks: np.ndarray,
) -> PeerDescriptors:
    columns: list[np.ndarray] = []  # per view: [blocks * fragments, 7] rows, block-major
    for view in views:
        fragments = np.asarray(view["fragments"], dtype=np.int64).reshape(-1, 3)
        if not len(fragments):
            continue
        src_pool = _pool(sender_pools, int(view["src_pool"]), f"sender rank {rank}", src_blocks)
        dst_pool = _pool(receiver_pools, int(view["dst_pool"]), "receiver", dst_blocks)
        for pool, column, side in ((src_pool, 0, "source"), (dst_pool, 1, "destination")):
            if (fragments[:, column] + fragments[:, 2]).max() > pool.slot_stride:
                raise ValueError(
                    f"a {side} fragment of view {view['src_view']} exceeds the slot stride"
                )
        src_addr = (
            src_pool.base + src_blocks[:, None] * src_pool.slot_stride + fragments[None, :, 0]
        )
        dst_addr = (
            dst_pool.base + dst_blocks[:, None] * dst_pool.slot_stride + fragments[None, :, 1]
        )
        lengths = np.broadcast_to(fragments[None, :, 2], src_addr.shape)
        # Rows keep the pools' identity so a run never crosses from one registration into another.
        tags = (int(view["src_pool"]), src_pool.device, int(view["dst_pool"]), dst_pool.device)
        rows = np.empty((src_addr.size, 7), dtype=np.int64)
        rows[:, 0], rows[:, 1], rows[:, 2] = src_addr.ravel(), dst_addr.ravel(), lengths.ravel()
        rows[:, 3:] = tags
        columns.append(rows)
    if not columns:
        return PeerDescriptors(rank, (), (), 0)
    rows = _block_major(columns, len(src_blocks))
    return _coalesce(rank, rows)


def _block_major(columns: list[np.ndarray], blocks: int) -> np.ndarray:
    """Interleaves views per block (block 0 of every view, then block 1, ...), the slot order."""
    if not blocks:
        return np.empty((0, 7), dtype=np.int64)
    per_block = [rows.reshape(blocks, -1, 7) for rows in columns]
    return np.concatenate(per_block, axis=1).reshape(-1, 7)


def _coalesce(rank: int, rows: np.ndarray) -> PeerDescriptors:
    if not len(rows):
        return PeerDescriptors(rank, (), (), 0)
    src, dst, length = rows[:, 0], rows[:, 1], rows[:, 2]
    starts = np.ones(len(rows), dtype=bool)
    starts[1:] = (
        (src[1:] != src[:-1] + length[:-1])
        | (dst[1:] != dst[:-1] + length[:-1])
        | np.any(rows[1:, 3:] != rows[:-1, 3:], axis=1)
    )
    first = np.flatnonzero(starts)
    merged = np.add.reduceat(length, first)
    local = tuple(
        (int(a), int(n), int(d)) for a, n, d in zip(dst[first], merged, rows[first, 6], strict=True)
    )
    remote = tuple(
        (int(a), int(n), int(d)) for a, n, d in zip(src[first], merged, rows[first, 4], strict=True)
    )
    return PeerDescriptors(rank, local, remote, len(rows))
