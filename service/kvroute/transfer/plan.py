"""The executable form of a plan: only what the data plane needs, checked once.

A plan document (API.md "Plans") is parsed into frozen dataclasses whose fragments are read-only
``int64`` arrays sorted by destination offset: block views (copied per block pair, a windowed one
only within its window) and recurrent-state views (``states``, copied once per request between the
request's state slots). Parsing refuses anything that can never copy exactly once: malformed
fragments, and destination bytes written by two fragments (of one view, of two views, or of two
sender ranks). Bounds against concrete pools are checked later, per job.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvroute.geometry import Plan
from kvroute.transfer.errors import TransferValidationError

SRC, DST, LENGTH = 0, 1, 2  # columns of a fragment array


@dataclass(frozen=True, slots=True)
class WindowCopy:
    """A windowed view pair moves only request blocks from the window's first on."""

    tokens: int
    tokens_per_block: int


@dataclass(frozen=True, slots=True, eq=False)
class ViewCopy:
    """One matched view pair of one sender rank: fragments relative to a slot start.

    A block view's slots are the job's block ids; a state view's (``state``) are the request's
    state slots, copied once per job.
    """

    src_view: int
    dst_view: int
    src_pool: int
    dst_pool: int
    mapper: str
    fragments: np.ndarray = field(repr=False)  # (n, 3) int64: src_offset, dst_offset, length
    window: WindowCopy | None = None
    state: bool = False

    @property
    def bytes_per_block(self) -> int:
        return int(self.fragments[:, LENGTH].sum())


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
        return sum(len(view.fragments) for peer in self.senders for view in peer.views)

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
        return any(view.window for peer in self.senders for view in peer.views)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> CopyPlan:
        """Parse an API.md plan document; raises ``TransferValidationError`` naming the field."""
        peers_doc = doc.get("peers")
        if not isinstance(peers_doc, list):
            raise TransferValidationError("plan.peers", "must be a list of sender ranks")
        peers = tuple(_parse_peer(peer, f"plan.peers[{i}]") for i, peer in enumerate(peers_doc))
        fingerprint = doc.get("fingerprint")
        if not isinstance(fingerprint, str) or not fingerprint:
            canonical = json.dumps(peers_doc, sort_keys=True, separators=(",", ":"))
            fingerprint = "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
        plan = cls(fingerprint=fingerprint, peers=peers)
        _check_exactly_once(plan)
        dst_shared, src_shared = _shared_slot_pools(plan)
        return replace(plan, shared_slot_pools=dst_shared, shared_src_pools=src_shared)

    @classmethod
    def from_plan(cls, plan: Plan) -> CopyPlan:
        """Convert a plan built in this process by ``kvroute.geometry.build_plan``."""
        return cls.from_json({"fingerprint": plan.fingerprint, **_plan_peers(plan)})


def _plan_peers(plan: Plan) -> dict[str, Any]:
    return {"peers": [peer.to_json() for peer in plan.peers]}


def _field_int(doc: Mapping[str, Any], name: str, path: str, minimum: int = 0) -> int:
    value = doc.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TransferValidationError(f"{path}.{name}", f"must be an integer >= {minimum}")
    return value


def _parse_peer(doc: Any, path: str) -> PeerCopy:
    if not isinstance(doc, Mapping):
        raise TransferValidationError(path, "must be an object")
    sends = doc.get("sends", True)
    views_doc = doc.get("views", [])
    if not isinstance(sends, bool):
        raise TransferValidationError(f"{path}.sends", "must be a boolean")
    if not isinstance(views_doc, list):
        raise TransferValidationError(f"{path}.views", "must be a list")
    states_doc = doc.get("states", [])
    if not isinstance(states_doc, list):
        raise TransferValidationError(f"{path}.states", "must be a list")
    views = tuple(_parse_view(view, f"{path}.views[{i}]") for i, view in enumerate(views_doc))
    states = tuple(
        _parse_view(state, f"{path}.states[{i}]", state=True) for i, state in enumerate(states_doc)
    )
    return PeerCopy(
        rank=_field_int(doc, "rank", path),
        sends=sends,
        views=tuple(view for view in views if len(view.fragments)),
        states=tuple(state for state in states if len(state.fragments)),
    )


def _parse_view(doc: Any, path: str, *, state: bool = False) -> ViewCopy:
    if not isinstance(doc, Mapping):
        raise TransferValidationError(path, "must be an object")
    mapper = doc.get("mapper", "")
    return ViewCopy(
        src_view=_field_int(doc, "src_view", path),
        dst_view=_field_int(doc, "dst_view", path),
        src_pool=_field_int(doc, "src_pool", path),
        dst_pool=_field_int(doc, "dst_pool", path),
        mapper=mapper if isinstance(mapper, str) else "",
        fragments=_parse_fragments(doc.get("fragments"), f"{path}.fragments"),
        window=None if state else _parse_window(doc.get("window"), f"{path}.window"),
        state=state,
    )


def _parse_window(doc: Any, path: str) -> WindowCopy | None:
    if doc is None:
        return None
    if not isinstance(doc, Mapping):
        raise TransferValidationError(path, "must be an object")
    return WindowCopy(
        _field_int(doc, "tokens", path, 1), _field_int(doc, "tokens_per_block", path, 1)
    )


def _parse_fragments(doc: Any, path: str) -> np.ndarray:
    if not isinstance(doc, Sequence) or isinstance(doc, str):
        raise TransferValidationError(path, "must be a list of [src_offset, dst_offset, length]")
    for i, fragment in enumerate(doc):
        if (
            not isinstance(fragment, Sequence)
            or len(fragment) != 3
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in fragment)
            or fragment[LENGTH] == 0
        ):
            raise TransferValidationError(
                f"{path}[{i}]",
                "must be [src_offset, dst_offset, length] with integers >= 0, length > 0",
            )
    fragments = np.array(doc, dtype=np.int64).reshape(-1, 3)
    fragments = fragments[np.argsort(fragments[:, DST], kind="stable")]
    fragments.setflags(write=False)
    return fragments


def _check_exactly_once(plan: CopyPlan) -> None:
    """Refuse a plan in which two fragments write the same destination byte of a block (or of a
    state slot: block and state regions of one pool may share slot bytes, never a slot)."""
    by_pool: dict[tuple[int, bool], list[tuple[np.ndarray, int, int]]] = {}
    for peer in plan.senders:
        for index, view in enumerate(peer.copies):
            key = (view.dst_pool, view.state)
            by_pool.setdefault(key, []).append((view.fragments, peer.rank, index))
    for (pool_id, _), parts in by_pool.items():
        starts = np.concatenate([p[0][:, DST] for p in parts])
        ends = starts + np.concatenate([p[0][:, LENGTH] for p in parts])
        owners = np.concatenate([np.full(len(p[0]), n) for n, p in enumerate(parts)])
        order = np.argsort(starts, kind="stable")
        clash = np.flatnonzero(starts[order][1:] < ends[order][:-1])
        if len(clash):
            first, second = order[clash[0]], order[clash[0] + 1]
            a, b = parts[owners[first]], parts[owners[second]]
            raise TransferValidationError(
                "plan.peers",
                f"destination bytes of pool {pool_id} at offset {int(starts[second])} are written "
                f"twice: by rank {a[1]} view #{a[2]} and by rank {b[1]} view #{b[2]}",
            )


def _spans(fragments: list[np.ndarray], column: int) -> np.ndarray:
    """[start, end) spans of some fragment arrays on one side (``SRC`` or ``DST``), by start."""
    if not fragments:
        return np.empty((0, 2), dtype=np.int64)
    joined = np.concatenate(fragments)
    spans = np.stack([joined[:, column], joined[:, column] + joined[:, LENGTH]], axis=1)
    return spans[np.argsort(spans[:, 0], kind="stable")]


def _intersect(blocks: np.ndarray, states: np.ndarray) -> bool:
    """Whether two span lists (sorted by start) share a byte: some state span starts before the
    furthest end of the block spans that start before it ends."""
    if not len(blocks) or not len(states):
        return False
    ends = np.maximum.accumulate(blocks[:, 1])
    index = np.searchsorted(blocks[:, 0], states[:, 1], side="left") - 1
    return bool(((index >= 0) & (ends[np.maximum(index, 0)] > states[:, 0])).any())


def _shared_slot_pools(plan: CopyPlan) -> tuple[frozenset[int], frozenset[tuple[int, int]]]:
    """(receiver pools, (sender rank, pool)s) whose block and state regions overlap in a slot."""
    dst = {
        pool
        for pool in {view.dst_pool for peer in plan.senders for view in peer.states}
        if _intersect(
            _spans([v.fragments for p in plan.senders for v in p.views if v.dst_pool == pool], DST),
            _spans(
                [v.fragments for p in plan.senders for v in p.states if v.dst_pool == pool], DST
            ),
        )
    }
    src = {
        (peer.rank, pool)
        for peer in plan.senders
        for pool in {view.src_pool for view in peer.states}
        if _intersect(
            _spans([v.fragments for v in peer.views if v.src_pool == pool], SRC),
            _spans([v.fragments for v in peer.states if v.src_pool == pool], SRC),
        )
    }
    return frozenset(dst), frozenset(src)
