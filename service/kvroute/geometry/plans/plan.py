"""Plans are data: who sends which bytes of which view to one receiver rank.

A plan is immutable and JSON-serialisable in the shape of docs/api.md "Plans", so it can be cached, compared by
fingerprint, shipped to a worker, rendered as a table or a picture, and executed by any data plane.

A view pair whose sides cut tokens into blocks of the same size carries ``fragments`` relative to
one block on each side. Where the sizes differ it carries a period instead (``periods``): its JSON
names ``period_tokens``, the blocks per period on each side and ``period_fragments`` with their
token spans, and has no ``fragments`` member, so a reader that knows only block fragments fails
loudly rather than copying nothing. ``to_json(period=True)`` writes every pair in the period form,
which any token range (one starting mid-block included) can be cut from, but for a pair whose
bytes are not whole token rows (sub-byte rows at equal block sizes): it has no period form, keeps
its block form and says so in every form (``token_rows: false``), so a reader knows per pair
whether it may re-cut it. A windowed pair also
names its ``window``: it moves a job's tokens from the window's first token on (``window``).

Recurrent-state pairs (a peer's ``states``) move bytes of a request's one state slot on each side,
once per job, whatever the block sizes or the token range.

``Plan.from_json`` reads a plan document back into these types, strictly (``reading``): members of
the wrong type, periods that do not cut both sides' blocks and derived members (bytes, descriptors,
writers) that contradict the fragments are refused as ``invalid_plan`` naming the member. A plan
read back carries its period form (``ViewTransfer.period``) where the planner's carries a token
axis, and the generations it was served with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvroute.geometry.plans.plan_pairs import StateTransfer, ViewTransfer
from kvroute.geometry.plans.reading import Members, invalid, is_int

__all__ = ["PeerPlan", "Plan", "StateTransfer", "ViewTransfer"]


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

    @classmethod
    def from_json(cls, doc: Any, path: str) -> PeerPlan:
        m = Members(doc, path)
        peer = cls(
            rank=m.int("rank"),
            pp_rank=m.int("pp_rank"),
            tp_rank=m.int("tp_rank"),
            views=tuple(ViewTransfer.from_json(v.doc, v.path) for v in m.items("views")),
            states=tuple(
                StateTransfer.from_json(s.doc, s.path) for s in m.items("states", optional=True)
            ),
        )
        for key in ("sends", "bytes_per_block", "descriptors_per_block", "state_bytes"):
            m.derived(key, getattr(peer, key))
        return peer


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
    # The generations it was served with (``to_json``'s defaults); none for a plan built here.
    sender_generations: Mapping[int, int | None] = field(default_factory=dict, compare=False)
    receiver_generation: int | None = field(default=None, compare=False)
    prompt_tokens: int | None = None  # the prompt a chunked (prefill CP) sender's plan is for

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

    def period_form(self) -> Plan:
        """The plan with every view pair in its period form where it has one: what
        ``to_json(period=True)`` writes, without writing it (``ValueError`` where a pair's
        bytes are not whole token rows)."""
        peers = tuple(
            replace(peer, views=tuple(view.period_form() for view in peer.views))
            for peer in self.peers
        )
        return replace(self, peers=peers)

    def to_json(
        self,
        *,
        sender_generations: Mapping[int, int] | None = None,
        receiver_generation: int | None = None,
        period: bool = False,
    ) -> dict[str, Any]:
        """The plan document (docs/api.md "Plans"); ``period`` writes every view pair in the period form."""
        generations = sender_generations or self.sender_generations
        if receiver_generation is None:
            receiver_generation = self.receiver_generation
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
        if self.prompt_tokens is not None:
            doc["prompt_tokens"] = self.prompt_tokens
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> Plan:
        """A plan document read back (a server's answer, a file); ``GeometryError`` with code
        ``invalid_plan`` names the first member that is missing, of the wrong type or
        inconsistent with the rest."""
        m = Members(doc, "plan")
        sender, receiver = m.child("sender"), m.child("receiver")
        generations = sender.child("generations")
        for rank, generation in generations.doc.items():
            if not rank.isdigit() or not (generation is None or is_int(generation)):
                raise invalid(generations.at(rank), "must map a rank to its generation", generation)
        plan = cls(
            deployment=m.str("deployment"),
            sender_instance=sender.str("instance"),
            sender_ranks=tuple(int(rank) for rank in generations.doc),
            sender_dp_rank=sender.int("dp_rank"),
            receiver_instance=receiver.str("instance"),
            receiver_rank=receiver.int("rank"),
            peers=tuple(PeerPlan.from_json(p.doc, p.path) for p in m.items("peers")),
            fingerprint=m.str("fingerprint"),
            fanin_bounce_safe=m.bool("fanin_bounce_safe"),
            sender_parallel=(sender.int("tp_size", 1), sender.int("pp_size", 1)),
            receiver_parallel=(receiver.int("tp_size", 1), receiver.int("pp_size", 1)),
            warnings=m.strs("warnings") if m.has("warnings") else (),
            sender_generations={int(rank): gen for rank, gen in generations.doc.items()},
            receiver_generation=receiver.opt_int("generation"),
            prompt_tokens=m.opt_int("prompt_tokens"),
        )
        derived = ("expected_writers", "bytes_per_block", "fragments_per_block")
        for key in derived + (("state_bytes", "state_fragments") if plan.has_state else ()):
            m.derived(key, getattr(plan, key))
        return plan
