"""A plan turned into NIXL descriptor lists: pure arithmetic, no NIXL import.

NIXL knows addresses, lengths and device ids, not heads or layers. For one transfer (a plan and
the block pairs to move) each sending peer gets two aligned lists — the receiver's bytes and the
sender's bytes — with descriptor ``i`` of one side the same length as descriptor ``i`` of the
other. Runs that are contiguous on both sides (and inside one pool on each side, since a
descriptor may not straddle two registrations) are merged first: descriptor count dominates
small-transfer latency, so it is reported next to the bytes.

The plan is the typed ``geometry.Plan``: the planner's own, or a served document read once with
``Plan.from_json`` (``client.PlanDocument.plan``). A transfer may instead name a token range
(a ``geometry.TokenWindow``: the range, and each list's first token): then every view pair needs
its period form (``ViewTransfer.token_form``: a pair between blocks of different sizes, one read
from a plan fetched with ``period=True``, or a pair the planner built here, which moves whole
blocks of equal sizes by its block fragments), and the range is cut from it as ``geometry.ranges`` states: whole
pieces by the period's fragments, the few tokens at each end by ``range_copies``. A windowed view
pair moves the range from its window's first token on (``geometry.window``), and a
recurrent-state pair the request's state slot once.

A transfer naming only ``prompt_tokens`` moves each pair's tokens up to the prompt's last token, as
the data plane does: its last block is cut like a range's end, so it needs the period form too. A
pair whose bytes are not whole token rows (``ViewTransfer.token_rows``, stated ``token_rows: false``
even in the period form) cannot be cut: it moves the lists' common suffix of whole blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvroute.client.nixl_ranges import range_rows
from kvroute.geometry import (
    BlockList,
    PeerPlan,
    Plan,
    RequestBlocks,
    Spread,
    TokenRange,
    TokenWindow,
    ViewTransfer,
    block_ends,
    check_covered,
    whole_pieces,
    window_start,
    windowed_range,
)
from kvroute.geometry.plans.plan_pairs import PairTransfer

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
    plan: Plan,
    *,
    receiver_pools: Mapping[int, PoolAddress],
    sender_pools: Mapping[int, Mapping[int, PoolAddress]],
    blocks: RequestBlocks,
) -> NixlTransfer:
    """Descriptor lists for the pull of ``blocks.src`` (sender) into ``blocks.dst`` (receiver),
    or of the tokens ``blocks.window`` names.

    ``sender_pools`` maps sender rank -> pool id -> address. Ranks that send nothing
    (``PeerPlan.sends``) get no entry. A plan that moves recurrent state (``states``) also pulls the
    request's state slot once; a windowed view only the tokens from its window on (measured from
    the window's prompt length). Raises ``ValueError`` naming a missing pool, a block outside its
    pool, a fragment outside its slot, a missing state slot or prompt length (because NIXL would
    only fail later with ``NIXL_ERR_NOT_FOUND``, and a skipped state would leave the receiver
    zeroed) or, for a token range, the first token a list lacks (``geometry.TokenGap``).
    """
    request = _Request(
        np.asarray(blocks.src, dtype=np.int64),
        np.asarray(blocks.dst, dtype=np.int64),
        blocks.window,
        blocks.src_state_slot,
        blocks.dst_state_slot,
    )
    peers = []
    for peer in plan.peers:
        if not peer.sends:
            continue
        if peer.rank not in sender_pools:
            raise ValueError(f"no pool addresses for sender rank {peer.rank}")
        peers.append(_peer(peer, (receiver_pools, sender_pools[peer.rank]), request))
    return NixlTransfer(tuple(peers), plan.expected_writers)


@dataclass(frozen=True, slots=True)
class _Request:
    """One request's lists, token window and state slots (``geometry.ranges``)."""

    src: np.ndarray
    dst: np.ndarray
    window: TokenWindow
    src_state_slot: int | None
    dst_state_slot: int | None

    def pairs(self, view: ViewTransfer) -> bool:
        """The view moves block pairs: no range and no prompt length named (or a prompt length
        alone and a pair that only moves whole blocks), block fragments, no window."""
        if self.window.names_tokens or view.periodic or view.window is not None:
            return False
        if self.window.prompt_tokens is not None:
            return not view.token_rows
        if len(self.src) != len(self.dst):
            raise ValueError(
                f"{len(self.src)} source blocks but {len(self.dst)} destination blocks"
            )
        return True

    def block_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """The lists paired one to one, or for a prompt-only job their common suffix: with equal
        block sizes both suffix lists end with the block holding the prompt's last token."""
        if self.window.prompt_tokens is None:
            return self.src, self.dst
        count = min(len(self.src), len(self.dst))
        return self.src[len(self.src) - count :], self.dst[len(self.dst) - count :]

    def state(self) -> tuple[np.ndarray, np.ndarray]:
        if self.src_state_slot is None or self.dst_state_slot is None:
            raise ValueError(
                "the plan moves recurrent state: give src_state_slot and dst_state_slot"
            )
        return np.array([self.src_state_slot]), np.array([self.dst_state_slot])

    def lists(
        self, sizes: tuple[int, int], spreads: tuple[Spread, Spread] = (Spread(), Spread())
    ) -> tuple[TokenRange, BlockList, BlockList]:
        return self.window.lists(self.src.tolist(), self.dst.tolist(), *sizes, spreads)

    def windowed(
        self,
        view: ViewTransfer,
        tokens: TokenRange,
        spreads: tuple[Spread, Spread] = (Spread(), Spread()),
    ) -> TokenRange | None:
        """The view's part of the range: from its window's first token on, if it has one."""
        window = view.window
        if window is None:
            return tokens
        prompt = self.window.prompt
        if prompt is None:
            raise ValueError(
                "the plan has sliding-window views: give prompt_tokens (or a token range)"
            )
        sizes = (window.src_tokens_per_block, window.dst_tokens_per_block)
        start = window_start(window.tokens, prompt, *sizes, spreads)
        return windowed_range(tokens, start)


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
    peer: PeerPlan,
    pools: tuple[Mapping[int, PoolAddress], Mapping[int, PoolAddress]],
    request: _Request,
) -> PeerDescriptors:
    """One sending rank's rows: block pairs interleaved per block (the slot order coalesces
    best), then token ranges sorted by destination, then the state slot."""
    rank, pairs, ranges, states = peer.rank, [], [], []
    blocks = 0
    for view in peer.views:
        if request.pairs(view):
            src, dst = request.block_pairs()
            rows = _pair_rows(rank, view, pools, src, dst)
            if rows is not None:
                pairs.append(rows)
                blocks = len(src)
        else:
            copies = _range_copies(view, request)
            if len(copies):
                ranges.append(_addressed(rank, view, pools, copies))
    for state in peer.states:
        src_slot, dst_slot = request.state()
        rows = _pair_rows(rank, state, pools, src_slot, dst_slot)
        if rows is not None:
            states.append(rows)
    parts = [_block_major(pairs, blocks)] if pairs else []
    if ranges:
        rows = np.concatenate(ranges)
        parts.append(rows[np.lexsort((rows[:, 1], rows[:, 6], rows[:, 5]))])
    parts += states
    return _coalesce(rank, np.concatenate(parts) if parts else np.empty((0, 7), np.int64))


def _pair_rows(
    rank: int,
    view: PairTransfer,
    pools: tuple[Mapping[int, PoolAddress], Mapping[int, PoolAddress]],
    src_blocks: np.ndarray,
    dst_blocks: np.ndarray,
) -> np.ndarray | None:
    """[blocks * fragments, 7] rows of one view's block pairs, block-major; None: no fragments."""
    fragments = np.asarray(view.fragments, dtype=np.int64).reshape(-1, 3)
    if not len(fragments):
        return None
    copies = np.empty((len(src_blocks), len(fragments), 5), dtype=np.int64)
    copies[..., 0], copies[..., 2] = src_blocks[:, None], dst_blocks[:, None]
    copies[..., 1], copies[..., 3], copies[..., 4] = fragments.T[:, None, :]
    return _addressed(rank, view, pools, copies.reshape(-1, 5))


def _range_copies(view: ViewTransfer, request: _Request) -> np.ndarray:
    """(src block, src offset, dst block, dst offset, length) of the view's part of the range."""
    period, window = view.token_form, view.window
    if period is not None:
        sizes = (period.src_tokens_per_block, period.dst_tokens_per_block)
    elif window is not None:
        sizes = (window.src_tokens_per_block, window.dst_tokens_per_block)
    else:
        raise _needs_period(view)
    spreads = (Spread(), Spread()) if period is None else (period.src_spread, period.dst_spread)
    tokens, src, dst = request.lists(sizes, spreads)
    part = request.windowed(view, tokens, spreads)
    if part is None:
        return np.empty((0, 5), dtype=np.int64)
    if not view.token_rows and not request.window.names_tokens:  # prompt-only: whole blocks
        part = block_ends(part, sizes[0])
    check_covered(part, src, dst)
    # A pair the planner built here with equal block sizes has both forms: whole blocks move by
    # its block fragments (as a plan in the block form moves them), any other range by its period.
    stated = view.periodic or view.period is not None  # the period is the form the plan gives
    if not stated and whole_pieces(part, *sizes) == part:
        blocks = np.arange(part.start // sizes[0], part.end // sizes[0], dtype=np.int64)
        fragments = np.asarray(view.fragments, dtype=np.int64).reshape(-1, 3)
        copies = np.empty((len(blocks), len(fragments), 5), dtype=np.int64)
        copies[..., 0] = request.src[blocks - src.first_block][:, None]
        copies[..., 2] = request.dst[blocks - dst.first_block][:, None]
        copies[..., 1], copies[..., 3], copies[..., 4] = fragments.T[:, None, :]
        return copies.reshape(-1, 5)
    if period is None:  # equal block sizes in the block form: only whole blocks can move
        raise _needs_period(view)
    return range_rows(period, part, src, dst, request.src, request.dst)


def _needs_period(view: ViewTransfer) -> ValueError:
    if not view.token_rows:
        return ValueError(
            f"view pair {view.src_view}->{view.dst_view} has bytes per layer that are not whole "
            "token rows (token_rows: false), so no token range can be cut from its blocks: "
            "block pairs or a prompt length alone move it, in whole blocks"
        )
    return ValueError(
        f"view pair {view.src_view}->{view.dst_view} has block fragments only; "
        "fetch the plan with period=True to cut a token range (a prompt-only transfer cuts the "
        "prompt's last block too)"
    )


def _addressed(
    rank: int,
    view: PairTransfer,
    pools: tuple[Mapping[int, PoolAddress], Mapping[int, PoolAddress]],
    copies: np.ndarray,
) -> np.ndarray:
    """Copies (block, offset pairs) as descriptor rows: addresses, length and the pools' tags."""
    src_pool = _pool(pools[1], view.src_pool, f"sender rank {rank}", copies[:, 0])
    dst_pool = _pool(pools[0], view.dst_pool, "receiver", copies[:, 2])
    for pool, column, side in ((src_pool, 1, "source"), (dst_pool, 3, "destination")):
        if (copies[:, column] + copies[:, 4]).max() > pool.slot_stride:
            raise ValueError(f"a {side} fragment of view {view.src_view} exceeds the slot stride")
    rows = np.empty((len(copies), 7), dtype=np.int64)
    rows[:, 0] = src_pool.base + copies[:, 0] * src_pool.slot_stride + copies[:, 1]
    rows[:, 1] = dst_pool.base + copies[:, 2] * dst_pool.slot_stride + copies[:, 3]
    rows[:, 2] = copies[:, 4]
    rows[:, 3:] = (view.src_pool, src_pool.device, view.dst_pool, dst_pool.device)
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


def merged_transfer(parts: Sequence[NixlTransfer], writers: int) -> NixlTransfer:
    """One transfer of several (a request's KV cache groups, each with its own block lists): each
    sender rank's descriptors together, ``writers`` the whole plan's (every writer notifies)."""
    by_rank: dict[int, list[PeerDescriptors]] = {}
    for part in parts:
        for peer in part.peers:
            by_rank.setdefault(peer.rank, []).append(peer)
    peers = tuple(
        PeerDescriptors(
            rank,
            tuple(d for p in group for d in p.local),
            tuple(d for p in group for d in p.remote),
            sum(p.fragments for p in group),
        )
        for rank, group in sorted(by_rank.items())
    )
    return NixlTransfer(tuple(p for p in peers if p.local), writers)
