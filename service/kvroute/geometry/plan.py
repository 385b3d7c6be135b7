"""Plans are data: who sends which bytes of which view to one receiver rank.

A plan is immutable and JSON-serialisable in the API.md shape, so it can be cached, compared by
fingerprint, shipped to a worker, rendered as a table or a picture, and executed by any data plane.

A view pair whose sides cut tokens into blocks of the same size carries ``fragments`` relative to
one block on each side. Where the sizes differ it carries a period instead (``periods``): its JSON
names ``period_tokens``, the blocks per period on each side and ``period_fragments`` with their
token spans, and has no ``fragments`` member, so a reader that knows only block fragments fails
loudly rather than copying nothing. ``to_json(period=True)`` writes every pair in the period form,
which any token range (one starting mid-block included) can be cut from. A windowed pair also
names its ``window``: it moves a job's tokens from the window's first token on (``window``).

Recurrent-state pairs (a peer's ``states``) move bytes of a request's one state slot on each side,
once per job, whatever the block sizes or the token range.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvroute.geometry.mappers import Fragment
from kvroute.geometry.periods import PeriodMap, TokenAxis
from kvroute.geometry.window import Window


@dataclass(frozen=True, slots=True)
class ViewTransfer:
    """One matched view pair as sent by one sender rank."""

    src_view: int
    dst_view: int
    src_pool: int
    dst_pool: int
    mapper: str
    duplicate_head_factor: int
    peer_duplicate_head_factor: int
    fragments: tuple[Fragment, ...]
    layers: tuple[int, ...]
    owner: str
    roles: tuple[str, ...]
    total_heads: int
    src_heads: tuple[int, int]  # global head range the sender holds (under total_heads)
    dst_heads: tuple[int, int]  # global head range this pair writes on the receiver
    axis: TokenAxis | None = field(default=None, compare=False, repr=False)
    window: Window | None = None  # sliding window: only the tokens in it move

    @property
    def periodic(self) -> bool:
        """The two sides' blocks differ in size: the pair moves by period, not by block pair."""
        return self.axis is not None and self.axis.periodic

    @property
    def period_map(self) -> PeriodMap:
        """The pair's period form (computed on first use where block sizes are equal)."""
        if self.axis is None:
            raise ValueError(f"view pair {self.src_view}->{self.dst_view} has no token layout")
        return self.axis.period_map

    @property
    def bytes_per_block(self) -> int:
        """Bytes per receiver block."""
        if self.periodic:
            return self.period_map.bytes_per_dst_block
        return sum(length for _, _, length in self.fragments)

    @property
    def descriptors_per_block(self) -> int:
        """Fragments per receiver block (where blocks differ, the most any receiver block needs)."""
        return self.period_map.descriptors_per_dst_block if self.periodic else len(self.fragments)

    def to_json(self, *, period: bool = False) -> dict[str, Any]:
        doc: dict[str, Any] = {
            **_pair_members(self),
            "heads": {
                "total": self.total_heads,
                "src": list(self.src_heads),
                "dst": list(self.dst_heads),
            },
            "bytes_per_block": self.bytes_per_block,
        }
        if self.window is not None:
            doc["window"] = self.window.to_json()
        if self.periodic or (period and self.axis is not None):
            return doc | self.period_map.to_json()
        return doc | {
            "descriptors_per_block": len(self.fragments),
            "fragments": [list(fragment) for fragment in self.fragments],
        }


@dataclass(frozen=True, slots=True)
class StateTransfer:
    """One matched recurrent-state view pair as sent by one sender rank.

    Fragments are relative to a request's state slot on each side (not to a block), and are
    copied once per request, from the sender's state slot to the receiver's.
    """

    src_view: int
    dst_view: int
    src_pool: int
    dst_pool: int
    mapper: str  # "ssm" | "conv" | "replicated"
    duplicate_head_factor: int
    peer_duplicate_head_factor: int
    fragments: tuple[Fragment, ...]
    layers: tuple[int, ...]
    owner: str
    roles: tuple[str, ...]
    mamba_tp: tuple[tuple[int, int], tuple[int, int]]  # (tp, rank) of the sender, the receiver
    shard_unit: str  # "head" (ssm), "part" (conv: lcm of the TPs), "whole" (replicated)
    shard_total: int
    src_shard: tuple[int, int]  # positions of every section the sender holds
    dst_shard: tuple[int, int]  # positions this pair writes on the receiver

    @property
    def nbytes(self) -> int:
        return sum(length for _, _, length in self.fragments)

    def to_json(self) -> dict[str, Any]:
        return {
            **_pair_members(self),
            "mamba_tp": {"src": list(self.mamba_tp[0]), "dst": list(self.mamba_tp[1])},
            "shard": {
                "unit": self.shard_unit,
                "total": self.shard_total,
                "src": list(self.src_shard),
                "dst": list(self.dst_shard),
            },
            "bytes": self.nbytes,
            "descriptors": len(self.fragments),
            "fragments": [list(fragment) for fragment in self.fragments],
        }


def _pair_members(pair: ViewTransfer | StateTransfer) -> dict[str, Any]:
    """The members every matched view pair states, block or state."""
    return {
        "src_view": pair.src_view,
        "dst_view": pair.dst_view,
        "src_pool": pair.src_pool,
        "dst_pool": pair.dst_pool,
        "mapper": pair.mapper,
        "duplicate_head_factor": pair.duplicate_head_factor,
        "peer_duplicate_head_factor": pair.peer_duplicate_head_factor,
        "owner": pair.owner,
        "roles": list(pair.roles),
        "layers": list(pair.layers),
    }


@dataclass(frozen=True, slots=True)
class PeerPlan:
    """A sender rank the receiver hears from; ``sends`` is false for unelected replicas."""

    rank: int
    pp_rank: int
    tp_rank: int
    views: tuple[ViewTransfer, ...]
    states: tuple[StateTransfer, ...] = ()

    @property
    def sends(self) -> bool:
        return any(view.bytes_per_block for view in self.views) or any(
            state.fragments for state in self.states
        )

    @property
    def state_bytes(self) -> int:
        """Recurrent bytes this rank writes per request."""
        return sum(state.nbytes for state in self.states)

    @property
    def bytes_per_block(self) -> int:
        return sum(view.bytes_per_block for view in self.views)

    @property
    def descriptors_per_block(self) -> int:
        return sum(view.descriptors_per_block for view in self.views)

    def to_json(self, *, period: bool = False) -> dict[str, Any]:
        views = [view.to_json(period=period) for view in self.views]
        doc: dict[str, Any] = {
            "rank": self.rank,
            "pp_rank": self.pp_rank,
            "tp_rank": self.tp_rank,
            "sends": self.sends,
            "bytes_per_block": self.bytes_per_block,
            "descriptors_per_block": sum(view["descriptors_per_block"] for view in views),
            "views": views,
        }
        if self.states:
            doc["state_bytes"] = self.state_bytes
            doc["states"] = [state.to_json() for state in self.states]
        return doc


@dataclass(frozen=True, slots=True)
class Plan:
    deployment: str
    sender_instance: str
    sender_ranks: tuple[int, ...]  # every registered sender rank the plan was built from
    sender_dp_rank: int
    receiver_instance: str
    receiver_rank: int
    peers: tuple[PeerPlan, ...]
    fingerprint: str
    fanin_bounce_safe: bool
    sender_parallel: tuple[int, int]  # (tp_size, pp_size) of the sender instance
    receiver_parallel: tuple[int, int]  # (tp_size, pp_size) of the receiver instance
    warnings: tuple[str, ...] = ()

    @property
    def expected_writers(self) -> int:
        return sum(1 for peer in self.peers if peer.sends)

    @property
    def bytes_per_block(self) -> int:
        return sum(peer.bytes_per_block for peer in self.peers)

    @property
    def fragments_per_block(self) -> int:
        return sum(peer.descriptors_per_block for peer in self.peers)

    @property
    def state_bytes(self) -> int:
        """Recurrent bytes the receiver gets per request: what a bounce region adds for state."""
        return sum(peer.state_bytes for peer in self.peers)

    @property
    def state_fragments(self) -> int:
        return sum(len(state.fragments) for peer in self.peers for state in peer.states)

    @property
    def has_state(self) -> bool:
        return any(peer.states for peer in self.peers)

    def to_json(
        self,
        *,
        sender_generations: Mapping[int, int] | None = None,
        receiver_generation: int | None = None,
        period: bool = False,
    ) -> dict[str, Any]:
        """The API.md document; ``period`` writes every view pair in the period form."""
        generations = sender_generations or {}
        peers = [peer.to_json(period=period) for peer in self.peers]
        doc: dict[str, Any] = {
            "deployment": self.deployment,
            "sender": {
                "instance": self.sender_instance,
                "dp_rank": self.sender_dp_rank,
                "tp_size": self.sender_parallel[0],
                "pp_size": self.sender_parallel[1],
                "generations": {str(rank): generations.get(rank) for rank in self.sender_ranks},
            },
            "receiver": {
                "instance": self.receiver_instance,
                "rank": self.receiver_rank,
                "tp_size": self.receiver_parallel[0],
                "pp_size": self.receiver_parallel[1],
                "generation": receiver_generation,
            },
            "fingerprint": self.fingerprint,
            "expected_writers": self.expected_writers,
            "fanin_bounce_safe": self.fanin_bounce_safe,
            "bytes_per_block": self.bytes_per_block,
            "fragments_per_block": sum(peer["descriptors_per_block"] for peer in peers),
            "warnings": list(self.warnings),
            "peers": peers,
        }
        if self.has_state:
            doc["state_bytes"] = self.state_bytes
            doc["state_fragments"] = self.state_fragments
        return doc
