"""The executable form of a plan: only what the data plane needs, checked once.

A plan (``geometry.Plan``, built in this process or read back with ``Plan.from_json``) is compiled
by ``CopyPlan.from_plan`` into frozen dataclasses whose fragments are read-only ``int64`` arrays
sorted by destination offset: block views (copied per block pair or token range, a
windowed one only from its window on) and recurrent-state views (``states``, copied once per request
between the request's state slots). Compiling refuses anything that can never copy exactly once
(``exactly_once``): destination bytes written by two fragments (of one view, of two views, or of
two sender ranks). Bounds against concrete pools are checked later, per job. A plan document (a
server's answer, a file) is read by ``Plan.from_json`` first, the one reader of plan JSON.

A view pair planned by period (different block sizes, or a plan fetched in the period form) carries
its ``PeriodMap``: spans with their tokens, from which any token range is cut. A plan built in this
process keeps both forms for equal block sizes: block fragments for whole blocks, the period for the
blocks a token range cuts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvroute.geometry import PeriodMap, Plan, Spread, StateTransfer, ViewTransfer
from kvroute.geometry.plans.plan_pairs import PairTransfer
from kvroute.geometry.tokens.window import Window
from kvroute.transfer.exactly_once import check_exactly_once, shared_slot_pools
from kvroute.transfer.fragments import DST, LENGTH, SRC, fragment_array


@dataclass(frozen=True, slots=True, eq=False)
class PeriodGroup:
    """A period's fragments between one sender block and one receiver block: tokens [first, end)."""

    src_block: int
    dst_block: int
    first_token: int
    end_token: int
    fragments: np.ndarray = field(repr=False)  # (n, 3) src_offset, dst_offset, length; by dst


def period_groups(period: PeriodMap) -> tuple[PeriodGroup, ...]:
    """Every (sender block, receiver block) pair of a period that moves bytes, with its fragments."""
    spans = np.array(period.spans, dtype=np.int64).reshape(-1, 7)
    spans = spans[np.lexsort((spans[:, 3], spans[:, 2], spans[:, 0]))]
    pairs = spans[:, (0, 2)]
    breaks = np.flatnonzero(np.any(pairs[1:] != pairs[:-1], axis=1)) + 1
    groups = []
    for part in np.split(spans, breaks) if len(spans) else []:
        fragments = np.ascontiguousarray(part[:, (1, 3, 4)])
        fragments.setflags(write=False)
        first, end = int(part[:, 5].min()), int((part[:, 5] + part[:, 6]).max())
        groups.append(PeriodGroup(int(part[0, 0]), int(part[0, 2]), first, end, fragments))
    return tuple(groups)


@dataclass(frozen=True, slots=True, eq=False)
class ViewCopy:
    """One matched view pair of one sender rank: fragments relative to a slot start.

    A block view's slots are the job's block ids (a windowed one's, ``sliding_window``, from the
    window's first token on); a state view's (``state``) are the request's state slots, copied once
    per job.
    """

    src_view: int
    dst_view: int
    src_pool: int
    dst_pool: int
    mapper: str
    fragments: np.ndarray = field(repr=False)  # (n, 3) int64: src_offset, dst_offset, length
    period: PeriodMap | None = field(default=None, repr=False)
    groups: tuple[PeriodGroup, ...] = field(default=(), repr=False)  # of ``period``
    sliding_window: Window | None = None
    state: bool = False
    # False where the pair's bytes are not whole token rows (sub-byte rows): it moves whole blocks.
    token_rows: bool = True

    @property
    def periodic(self) -> bool:
        """Moves by period only: the two sides' blocks differ in size (or no block form came)."""
        return not len(self.fragments)

    @property
    def bytes_per_block(self) -> int:
        """Bytes per receiver block (per request for a state view)."""
        if self.periodic and self.period is not None:
            return self.period.bytes_per_dst_block
        return int(self.fragments[:, LENGTH].sum())

    @property
    def fragments_per_block(self) -> int:
        if self.periodic and self.period is not None:
            return self.period.descriptors_per_dst_block
        return len(self.fragments)

    @property
    def tokens_per_block(self) -> tuple[int, int] | None:
        """Each side's tokens per block, where the plan says (its period or its window)."""
        if self.period is not None:
            return self.period.src_tokens_per_block, self.period.dst_tokens_per_block
        if self.sliding_window is not None:
            window = self.sliding_window
            return window.src_tokens_per_block, window.dst_tokens_per_block
        return None

    @property
    def spreads(self) -> tuple[Spread, Spread]:
        """Each side's CP placement (the identity where the plan states none)."""
        if self.period is None:
            return Spread(), Spread()
        return self.period.src_spread, self.period.dst_spread

    def slot_spans(self, column: int) -> np.ndarray:
        """(offset, length) of every fragment in a slot on one side (``SRC`` or ``DST``)."""
        if not self.periodic:
            return self.fragments[:, (column, LENGTH)]
        assert self.period is not None
        spans = np.array(self.period.spans, dtype=np.int64).reshape(-1, 7)
        return spans[:, (1 if column == SRC else 3, 4)]

    @property
    def extent(self) -> tuple[int, int]:
        """One past the last byte touched in a slot, on the sender and on the receiver side."""
        ends = [spans[:, 0] + spans[:, 1] for spans in (self.slot_spans(SRC), self.slot_spans(DST))]
        return int(ends[0].max()), int(ends[1].max())


@dataclass(frozen=True, slots=True)
class PeerCopy:
    rank: int
    sends: bool
    views: tuple[ViewCopy, ...]
    states: tuple[ViewCopy, ...] = ()

    @property
    def copies(self) -> tuple[ViewCopy, ...]:
        return self.views + self.states


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """The sender ranks and fragments of one plan; ``fingerprint`` keys every cache."""

    fingerprint: str
    peers: tuple[PeerCopy, ...]
    # Receiver pools (and sender ranks' pools) whose block and state regions overlap in a slot:
    # there, one slot id must never be both a block and the state slot of one job.
    shared_slot_pools: frozenset[int] = frozenset()
    shared_src_pools: frozenset[tuple[int, int]] = frozenset()

    @property
    def senders(self) -> tuple[PeerCopy, ...]:
        return tuple(peer for peer in self.peers if peer.sends and peer.copies)

    @property
    def fragments_per_block(self) -> int:
        return sum(view.fragments_per_block for peer in self.senders for view in peer.views)

    @property
    def bytes_per_block(self) -> int:
        return sum(view.bytes_per_block for peer in self.senders for view in peer.views)

    @property
    def state_bytes(self) -> int:
        """Recurrent-state bytes per request (copied once, from state slot to state slot)."""
        return sum(state.bytes_per_block for peer in self.senders for state in peer.states)

    @property
    def state_fragments(self) -> int:
        return sum(len(state.fragments) for peer in self.senders for state in peer.states)

    @property
    def has_state(self) -> bool:
        return any(peer.states for peer in self.senders)

    @property
    def windowed(self) -> bool:
        return any(view.sliding_window for peer in self.senders for view in peer.views)

    @classmethod
    def from_plan(cls, plan: Plan) -> CopyPlan:
        """Compile a plan: block fragments where the pair has them, beside its period form
        wherever it has one (``ViewTransfer.token_form``)."""
        peers = tuple(
            PeerCopy(
                rank=peer.rank,
                sends=peer.sends,
                views=tuple(copy for copy in map(_view_copy, peer.views) if copy.bytes_per_block),
                states=tuple(copy for copy in map(_state_copy, peer.states) if len(copy.fragments)),
            )
            for peer in plan.peers
        )
        return cls.checked(plan.fingerprint, peers)

    @classmethod
    def checked(cls, fingerprint: str, peers: tuple[PeerCopy, ...]) -> CopyPlan:
        """The plan of ``peers`` once every destination byte is written once."""
        plan = cls(fingerprint=fingerprint, peers=peers)
        check_exactly_once(plan)
        dst_shared, src_shared = shared_slot_pools(plan)
        return replace(plan, shared_slot_pools=dst_shared, shared_src_pools=src_shared)


def _view_copy(view: ViewTransfer) -> ViewCopy:
    period = view.token_form
    return _copy(
        view,
        () if view.periodic else view.fragments,
        period=period,
        groups=period_groups(period) if period is not None else (),
        sliding_window=view.window,
        token_rows=view.token_rows,
    )


def _state_copy(state: StateTransfer) -> ViewCopy:
    return _copy(state, state.fragments, state=True)


def _copy(pair: PairTransfer, fragments: Any, **members: Any) -> ViewCopy:
    return ViewCopy(
        src_view=pair.src_view,
        dst_view=pair.dst_view,
        src_pool=pair.src_pool,
        dst_pool=pair.dst_pool,
        mapper=pair.mapper,
        fragments=fragment_array(fragments),
        **members,
    )
