"""A plan turned into NIXL descriptor lists: pure arithmetic, no NIXL import.

NIXL knows addresses, lengths and device ids, not heads or layers. For one transfer (a plan and
the block pairs to move) each sending peer gets two aligned lists — the receiver's bytes and the
sender's bytes — with descriptor ``i`` of one side the same length as descriptor ``i`` of the
other. Runs that are contiguous on both sides (and inside one pool on each side, since a
descriptor may not straddle two registrations) are merged first: descriptor count dominates
small-transfer latency, so it is reported next to the bytes.

A transfer may instead name a token range (``tokens``, and each list's first token): then every
view pair must come in its period form (a plan between blocks of different sizes, or one fetched
with ``period=True``), and the range is cut from it as ``geometry.ranges`` states: whole pieces by
the period's fragments, the few tokens at each end by ``range_copies``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvroute.geometry import (
    PeriodMap,
    TokenRange,
    check_covered,
    periods_inside,
    range_copies,
    resolve_lists,
    whole_pieces,
)

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
    tokens: tuple[int, int] | None = None,
    src_first_token: int | None = None,
    dst_first_token: int | None = None,
) -> NixlTransfer:
    """Descriptor lists for the pull of ``src_blocks`` (sender) into ``dst_blocks`` (receiver).

    ``sender_pools`` maps sender rank -> pool id -> address. Ranks with ``sends: false`` get no
    entry. Raises ``ValueError`` naming a missing pool, a block outside its pool, a fragment
    outside its slot (because NIXL would only fail later with ``NIXL_ERR_NOT_FOUND``) or, for a
    token range, the first token a list lacks (``geometry.TokenGap``).
    """
    window = _Window(tokens, src_first_token, dst_first_token)
    periodic = any("period_tokens" in v for peer in plan["peers"] for v in peer["views"])
    if not window.named and not periodic and len(src_blocks) != len(dst_blocks):
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
        pools = (receiver_pools, sender_pools[rank])
        if window.named or periodic:
            peers.append(_peer_range(rank, peer["views"], pools, src, dst, window))
        else:
            peers.append(_peer(rank, peer["views"], *pools, src, dst))
    return NixlTransfer(tuple(peers), int(plan["expected_writers"]))


@dataclass(frozen=True, slots=True)
class _Window:
    tokens: tuple[int, int] | None
    src_first_token: int | None
    dst_first_token: int | None

    @property
    def named(self) -> bool:
        return (self.tokens, self.src_first_token, self.dst_first_token) != (None, None, None)


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


def _peer_range(
    rank: int,
    views: Sequence[Mapping[str, Any]],
    pools: tuple[Mapping[int, PoolAddress], Mapping[int, PoolAddress]],
    src_blocks: np.ndarray,
    dst_blocks: np.ndarray,
    window: _Window,
) -> PeerDescriptors:
    """One sending rank's descriptors for a token range, cut from each view pair's period."""
    columns = []
    for view in views:
        if "period_fragments" not in view:
            raise ValueError(
                f"view pair {view['src_view']}->{view['dst_view']} has block fragments only; "
                "fetch the plan with period=True to cut a token range"
            )
        period = PeriodMap.from_json(view)
        span = TokenRange(*window.tokens) if window.tokens is not None else None
        tokens, src, dst = resolve_lists(
            src_blocks.tolist(),
            dst_blocks.tolist(),
            period.src_tokens_per_block,
            period.dst_tokens_per_block,
            tokens=span,
            src_first_token=window.src_first_token,
            dst_first_token=window.dst_first_token,
        )
        check_covered(tokens, src, dst)
        copies = _range_rows(period, tokens, src, dst, src_blocks, dst_blocks)
        if len(copies):
            columns.append(_addressed(rank, view, pools, copies))
    if not columns:
        return PeerDescriptors(rank, (), (), 0)
    rows = np.concatenate(columns)
    rows = rows[np.lexsort((rows[:, 1], rows[:, 6], rows[:, 5]))]
    return _coalesce(rank, rows)


def _addressed(
    rank: int,
    view: Mapping[str, Any],
    pools: tuple[Mapping[int, PoolAddress], Mapping[int, PoolAddress]],
    copies: np.ndarray,
) -> np.ndarray:
    """Copies (block, offset pairs) as descriptor rows: addresses, length and the pools' tags."""
    src_pool = _pool(pools[1], int(view["src_pool"]), f"sender rank {rank}", copies[:, 0])
    dst_pool = _pool(pools[0], int(view["dst_pool"]), "receiver", copies[:, 2])
    for pool, column, side in ((src_pool, 1, "source"), (dst_pool, 3, "destination")):
        if (copies[:, column] + copies[:, 4]).max() > pool.slot_stride:
            raise ValueError(
                f"a {side} fragment of view {view['src_view']} exceeds the slot stride"
            )
    rows = np.empty((len(copies), 7), dtype=np.int64)
    rows[:, 0] = src_pool.base + copies[:, 0] * src_pool.slot_stride + copies[:, 1]
    rows[:, 1] = dst_pool.base + copies[:, 2] * dst_pool.slot_stride + copies[:, 3]
    rows[:, 2] = copies[:, 4]
    rows[:, 3:] = (int(view["src_pool"]), src_pool.device, int(view["dst_pool"]), dst_pool.device)
    return rows


def _range_rows(
    period: PeriodMap,
    tokens: TokenRange,
    src: Any,
    dst: Any,
    src_blocks: np.ndarray,
    dst_blocks: np.ndarray,
) -> np.ndarray:
    """(src block, src offset, dst block, dst offset, length) of every copy of the range."""
    parts = []
    inner = whole_pieces(tokens, period.src_tokens_per_block, period.dst_tokens_per_block)
    cuts = [tokens]
    if inner is not None:
        spans = np.array(period.spans, dtype=np.int64).reshape(-1, 7)
        for (sb, db), group in _span_groups(spans):
            first, end = int(group[:, 5].min()), int((group[:, 5] + group[:, 6]).max())
            inside = periods_inside(first, end, inner, period.period_tokens)
            periods = np.arange(inside.start, inside.stop, dtype=np.int64)[:, None]
            ids_src = src_blocks[periods * period.src_blocks_per_period + sb - src.first_block]
            ids_dst = dst_blocks[periods * period.dst_blocks_per_period + db - dst.first_block]
            block = np.empty((len(periods), len(group), 5), dtype=np.int64)
            block[..., 0], block[..., 2] = ids_src, ids_dst
            block[..., 1], block[..., 3], block[..., 4] = group[:, 1], group[:, 3], group[:, 4]
            parts.append(block.reshape(-1, 5))
        ends = ((tokens.start, inner.start), (inner.end, tokens.end))
        cuts = [TokenRange(a, b) for a, b in ends if a < b]
    for cut in cuts:
        parts.append(np.array(range_copies(period, cut, src, dst), dtype=np.int64).reshape(-1, 5))
    return np.concatenate(parts) if parts else np.empty((0, 5), dtype=np.int64)


def _span_groups(spans: np.ndarray) -> list[tuple[tuple[int, int], np.ndarray]]:
    spans = spans[np.lexsort((spans[:, 3], spans[:, 2], spans[:, 0]))]
    breaks = np.flatnonzero(np.any(spans[1:, (0, 2)] != spans[:-1, (0, 2)], axis=1)) + 1
    return [((int(g[0, 0]), int(g[0, 2])), g) for g in np.split(spans, breaks) if len(g)]


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
