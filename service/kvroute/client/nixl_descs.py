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

from kvroute.geometry.window import window_skip

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
    src_state_slot: int | None = None,
    dst_state_slot: int | None = None,
    prompt_tokens: int | None = None,
) -> NixlTransfer:
    """Descriptor lists for the pull of ``src_blocks`` (sender) into ``dst_blocks`` (receiver).

    ``sender_pools`` maps sender rank -> pool id -> address. Ranks with ``sends: false`` get no
    entry. A plan that moves recurrent state (``states``) also pulls the request's state slot
    once; a windowed view only the blocks of the lists (the prompt's last blocks) in its window.
    Raises ``ValueError`` naming a missing pool, a block outside its pool, a fragment outside its
    slot, or a missing state slot or prompt length, because NIXL would only fail later with
    ``NIXL_ERR_NOT_FOUND`` and a silently skipped state would leave the receiver zeroed.
    """
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(
            f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks"
        )
    request = _Request(
        np.asarray(src_blocks, dtype=np.int64),
        np.asarray(dst_blocks, dtype=np.int64),
        src_state_slot,
        dst_state_slot,
        prompt_tokens,
    )
    peers = []
    for peer in plan["peers"]:
        if not peer["sends"]:
            continue
        rank = int(peer["rank"])
        if rank not in sender_pools:
            raise ValueError(f"no pool addresses for sender rank {rank}")
        copies = [(view, *request.blocks(view)) for view in peer["views"]]
        copies += [(state, *request.state()) for state in peer.get("states", [])]
        peers.append(_peer(rank, copies, receiver_pools, sender_pools[rank]))
    return NixlTransfer(tuple(peers), int(plan["expected_writers"]))


@dataclass(frozen=True, slots=True)
class _Request:
    src: np.ndarray
    dst: np.ndarray
    src_state_slot: int | None
    dst_state_slot: int | None
    prompt_tokens: int | None

    def blocks(self, view: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        window = view.get("window")
        if window is None:
            return self.src, self.dst
        if self.prompt_tokens is None:
            raise ValueError("the plan has sliding-window views: give prompt_tokens")
        skip = window_skip(
            window["tokens"], window["tokens_per_block"], self.prompt_tokens, len(self.src)
        )
        return self.src[skip:], self.dst[skip:]

    def state(self) -> tuple[np.ndarray, np.ndarray]:
        if self.src_state_slot is None or self.dst_state_slot is None:
            raise ValueError(
                "the plan moves recurrent state: give src_state_slot and dst_state_slot"
            )
        return np.array([self.src_state_slot]), np.array([self.dst_state_slot])


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
    copies: Sequence[tuple[Mapping[str, Any], np.ndarray, np.ndarray]],
    receiver_pools: Mapping[int, PoolAddress],
    sender_pools: Mapping[int, PoolAddress],
) -> PeerDescriptors:
    """Rows of the views that copy one slot selection are interleaved per slot (the slot order
    coalesces best); selections (all blocks, a window's, the state slot) follow one another."""
    selections: dict[tuple[bytes, bytes], list[np.ndarray]] = {}
    for view, src_blocks, dst_blocks in copies:
        rows = _rows(rank, view, receiver_pools, sender_pools, src_blocks, dst_blocks)
        if rows is not None:
            key = (src_blocks.tobytes(), dst_blocks.tobytes())
            selections.setdefault(key, []).append(rows)
    if not selections:
        return PeerDescriptors(rank, (), (), 0)
    slots = {key: len(key[0]) // 8 for key in selections}  # int64 ids
    rows = np.concatenate(
        [_block_major(columns, slots[key]) for key, columns in selections.items()]
    )
    return _coalesce(rank, rows)


def _rows(
    rank: int,
    view: Mapping[str, Any],
    receiver_pools: Mapping[int, PoolAddress],
    sender_pools: Mapping[int, PoolAddress],
    src_blocks: np.ndarray,
    dst_blocks: np.ndarray,
) -> np.ndarray | None:
    """[slots * fragments, 7] rows of one view, slot-major; None for a view without fragments."""
    fragments = np.asarray(view["fragments"], dtype=np.int64).reshape(-1, 3)
    if not len(fragments) or not len(src_blocks):
        return None
    src_pool = _pool(sender_pools, int(view["src_pool"]), f"sender rank {rank}", src_blocks)
    dst_pool = _pool(receiver_pools, int(view["dst_pool"]), "receiver", dst_blocks)
    for pool, column, side in ((src_pool, 0, "source"), (dst_pool, 1, "destination")):
        if (fragments[:, column] + fragments[:, 2]).max() > pool.slot_stride:
            raise ValueError(
                f"a {side} fragment of view {view['src_view']} exceeds the slot stride"
            )
    src_addr = src_pool.base + src_blocks[:, None] * src_pool.slot_stride + fragments[None, :, 0]
    dst_addr = dst_pool.base + dst_blocks[:, None] * dst_pool.slot_stride + fragments[None, :, 1]
    lengths = np.broadcast_to(fragments[None, :, 2], src_addr.shape)
    # Rows keep the pools' identity so a run never crosses from one registration into another.
    tags = (int(view["src_pool"]), src_pool.device, int(view["dst_pool"]), dst_pool.device)
    rows = np.empty((src_addr.size, 7), dtype=np.int64)
    rows[:, 0], rows[:, 1], rows[:, 2] = src_addr.ravel(), dst_addr.ravel(), lengths.ravel()
    rows[:, 3:] = tags
    return rows


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
