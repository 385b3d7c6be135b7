"""The executable form of a plan: only what the data plane needs, checked once.

A plan document (API.md "Plans") is parsed into frozen dataclasses whose fragments are read-only
``int64`` arrays sorted by destination offset. Parsing refuses anything that can never copy exactly
once: malformed fragments, and destination bytes written by two fragments (of one view, of two views,
or of two sender ranks). Bounds against concrete pools are checked later, per job.

A view pair planned by period (different block sizes, or a plan fetched in the period form) carries
its ``PeriodMap``: spans with their tokens, from which any token range is cut. A plan built in this
process keeps both forms for equal block sizes: block fragments for whole blocks, the period for the
blocks a token range cuts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvroute.geometry import PeriodMap, Plan
from kvroute.transfer.errors import TransferValidationError

SRC, DST, LENGTH = 0, 1, 2  # columns of a fragment array


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
    """One matched view pair of one sender rank: fragments relative to a slot start."""

    src_view: int
    dst_view: int
    src_pool: int
    dst_pool: int
    mapper: str
    fragments: np.ndarray = field(repr=False)  # (n, 3) int64: src_offset, dst_offset, length
    period: PeriodMap | None = field(default=None, repr=False)
    groups: tuple[PeriodGroup, ...] = field(default=(), repr=False)  # of ``period``

    @property
    def periodic(self) -> bool:
        """Moves by period only: the two sides' blocks differ in size (or no block form came)."""
        return not len(self.fragments)

    @property
    def bytes_per_block(self) -> int:
        """Bytes per receiver block."""
        if self.periodic and self.period is not None:
            return self.period.bytes_per_dst_block
        return int(self.fragments[:, LENGTH].sum())

    @property
    def fragments_per_block(self) -> int:
        if self.periodic and self.period is not None:
            return self.period.descriptors_per_dst_block
        return len(self.fragments)

    @property
    def extent(self) -> tuple[int, int]:
        """One past the last byte touched in a slot, on the sender and on the receiver side."""
        if not self.periodic:
            ends = self.fragments[:, (SRC, DST)] + self.fragments[:, (LENGTH,)]
            return int(ends[:, 0].max()), int(ends[:, 1].max())
        assert self.period is not None
        spans = self.period.spans
        return max(s[1] + s[4] for s in spans), max(s[3] + s[4] for s in spans)


@dataclass(frozen=True, slots=True)
class PeerCopy:
    rank: int
    sends: bool
    views: tuple[ViewCopy, ...]


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """The sender ranks and fragments of one plan; ``fingerprint`` keys every cache."""

    fingerprint: str
    peers: tuple[PeerCopy, ...]

    @property
    def senders(self) -> tuple[PeerCopy, ...]:
        return tuple(peer for peer in self.peers if peer.sends and peer.views)

    @property
    def fragments_per_block(self) -> int:
        return sum(view.fragments_per_block for peer in self.senders for view in peer.views)

    @property
    def bytes_per_block(self) -> int:
        return sum(view.bytes_per_block for peer in self.senders for view in peer.views)

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
        return plan

    @classmethod
    def from_plan(cls, plan: Plan) -> CopyPlan:
        """Convert a plan built in this process by ``kvroute.geometry.build_plan``, keeping the
        period form beside block fragments wherever the pair has a per-token layout."""
        return cls.from_json({"fingerprint": plan.fingerprint, **_plan_peers(plan)})


def _plan_peers(plan: Plan) -> dict[str, Any]:
    peers = []
    for peer in plan.peers:
        doc = peer.to_json()
        for view, view_doc in zip(peer.views, doc["views"], strict=True):
            if view.axis is not None and view.axis.token_unit and not view.periodic:
                view_doc |= {k: v for k, v in view.period_map.to_json().items() if "period" in k}
        peers.append(doc)
    return {"peers": peers}


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
    views = tuple(_parse_view(view, f"{path}.views[{i}]") for i, view in enumerate(views_doc))
    return PeerCopy(
        rank=_field_int(doc, "rank", path),
        sends=sends,
        views=tuple(view for view in views if view.bytes_per_block),
    )


def _parse_view(doc: Any, path: str) -> ViewCopy:
    if not isinstance(doc, Mapping):
        raise TransferValidationError(path, "must be an object")
    mapper = doc.get("mapper", "")
    period = None
    if "period_fragments" in doc:
        try:
            period = PeriodMap.from_json(doc)
        except ValueError as error:
            raise TransferValidationError(path, str(error)) from error
    fragments = doc.get("fragments")
    if period is not None and fragments is None:
        fragments = []
    return ViewCopy(
        src_view=_field_int(doc, "src_view", path),
        dst_view=_field_int(doc, "dst_view", path),
        src_pool=_field_int(doc, "src_pool", path),
        dst_pool=_field_int(doc, "dst_pool", path),
        mapper=mapper if isinstance(mapper, str) else "",
        fragments=_parse_fragments(fragments, f"{path}.fragments"),
        period=period,
        groups=period_groups(period) if period is not None else (),
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
    """Refuse a plan in which two fragments write the same destination byte."""
    by_pool: dict[int, list[tuple[np.ndarray, int, int]]] = {}
    for peer in plan.senders:
        for index, view in enumerate(peer.views):
            intervals = _destination_intervals(view, f"rank {peer.rank} view #{index}")
            by_pool.setdefault(view.dst_pool, []).append((intervals, peer.rank, index))
    for pool_id, parts in by_pool.items():
        starts = np.concatenate([p[0][:, 0] for p in parts])
        ends = starts + np.concatenate([p[0][:, 1] for p in parts])
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


def _destination_intervals(view: ViewCopy, name: str) -> np.ndarray:
    """(offset, length) rows a view writes in a receiver slot.

    A period writes the same offsets into each of its receiver blocks (every row, that block's
    tokens), so after checking each block on its own, the offsets of all blocks taken together
    stand for the view beside the others.
    """
    if not view.periodic:
        return view.fragments[:, (DST, LENGTH)]
    assert view.period is not None
    spans = np.array(view.period.spans, dtype=np.int64).reshape(-1, 7)
    order = np.lexsort((spans[:, 3], spans[:, 2]))
    block, start, length = spans[order, 2], spans[order, 3], spans[order, 4]
    overlap = (block[1:] == block[:-1]) & (start[1:] < start[:-1] + length[:-1])
    if overlap.any():
        at = int(np.flatnonzero(overlap)[0]) + 1
        raise TransferValidationError(
            "plan.peers",
            f"{name} writes offset {int(start[at])} of its receiver block {int(block[at])} twice",
        )
    return np.unique(np.stack([start, length], axis=1), axis=0)
