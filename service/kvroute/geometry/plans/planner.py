"""The plan builder: for one sender instance and one receiver rank, who writes which bytes where.

For every receiver view and every layer of it, the sender ranks that overlap the receiver in TP
position and hold that layer in the matching view are grouped by the heads they hold and, under
context parallelism, by their CP rank (the tokens they hold); each group holds identical bytes, and
exactly one of its ranks (elected) writes them (docs/geometry.md rule 3). A CP rank pair moves the tokens
both ranks hold (``periods``); a pair that shares none writes nothing.
Recurrent-state views are planned per request slot by ``state_planner`` under the same rule.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvroute.geometry.checks.compat import check_peers
from kvroute.geometry.checks.matching import match_view
from kvroute.geometry.checks.pairs import PairGeometry, duplication, pair_geometry
from kvroute.geometry.leaves.errors import GeometryError
from kvroute.geometry.plans.bounce import fanin_bounce_safe
from kvroute.geometry.plans.mappers import MatchedPair, coalesce, held_heads, pair_fragments
from kvroute.geometry.plans.plan import PeerPlan, Plan, StateTransfer, ViewTransfer
from kvroute.geometry.plans.rows import token_axis
from kvroute.geometry.plans.state_planner import plan_state_view
from kvroute.geometry.plans.topology import candidate_senders, elect
from kvroute.geometry.registration.model import RankRegistration, Role, View


@dataclass
class _Source:
    """One candidate sender rank's side of one receiver view."""

    sender: RankRegistration
    view: View
    geometry: PairGeometry
    assigned: list[int] = field(default_factory=list)
    heads: tuple[int, int] = (0, 1)  # replicated views hold one pseudo-head

    def __post_init__(self) -> None:
        if self.geometry.mapper != "replicated":
            self.heads = held_heads(self.sender, self.geometry.total_heads)


def build_plan(
    senders: Sequence[RankRegistration],
    receiver: RankRegistration,
    *,
    sender_dp_rank: int = 0,
    prompt_tokens: int | None = None,
) -> Plan:
    """Plans the transfer from the ``senders`` (all ranks of one context instance) to ``receiver``.

    A sender instance whose CP ranks hold prefill chunks (``spread``) is planned for one prompt
    length, ``prompt_tokens``, which it then needs; other plans ignore it (they serve any prompt).
    """
    _check_roles(senders, receiver)
    check_peers(receiver, senders)
    prompt = _prompt_for(senders, prompt_tokens)
    candidates = candidate_senders(senders, receiver, sender_dp_rank)
    planned = _Planned(prompt)
    for view in sorted(receiver.views, key=lambda v: v.view_id):
        if view.is_state:
            planned.add_state(*plan_state_view(view, candidates, receiver))
        else:
            planned.add_view(view, _sources(view, candidates, receiver), receiver)
    by_rank = {s.rank: s for s in senders}
    peers = tuple(
        PeerPlan(
            rank,
            by_rank[rank].pp_rank,
            by_rank[rank].tp_rank,
            tuple(planned.transfers.get(rank, ())),
            tuple(planned.states.get(rank, ())),
        )
        for rank in sorted(planned.heard)
    )
    return Plan(
        deployment=receiver.deployment,
        sender_instance=senders[0].instance,
        sender_ranks=tuple(sorted(by_rank)),
        sender_dp_rank=sender_dp_rank,
        receiver_instance=receiver.instance,
        receiver_rank=receiver.rank,
        peers=peers,
        fingerprint=plan_fingerprint(senders, receiver, sender_dp_rank, prompt),
        sender_parallel=(senders[0].tp_size, senders[0].pp_size),
        receiver_parallel=(receiver.tp_size, receiver.pp_size),
        fanin_bounce_safe=_bounce_safe(peers),
        warnings=tuple(dict.fromkeys(planned.warnings)),
        prompt_tokens=prompt,
    )


def _prompt_for(senders: Sequence[RankRegistration], prompt_tokens: int | None) -> int | None:
    """The prompt length a plan is built for: only chunked senders' placements depend on it."""
    if not senders[0].chunked:
        return None
    senders[0].placement(prompt_tokens)  # refuses a missing prompt length, naming the layout
    if prompt_tokens is not None and prompt_tokens < 1:
        raise GeometryError(
            "prompt_tokens_invalid",
            f"prompt_tokens={prompt_tokens}: a prompt split in {senders[0].cp_layout.value} "
            "chunks has at least one token",
            field="prompt_tokens",
            local=prompt_tokens,
            peer=1,
            stage="request",
        )
    return prompt_tokens


@dataclass
class _Planned:
    """What the receiver's views collect, per sender rank (for one prompt length where the
    sender's CP chunks depend on it)."""

    prompt_tokens: int | None = None
    transfers: dict[int, list[ViewTransfer]] = field(default_factory=lambda: defaultdict(list))
    states: dict[int, list[StateTransfer]] = field(default_factory=lambda: defaultdict(list))
    heard: set[int] = field(default_factory=set)
    warnings: list[str] = field(default_factory=list)

    def add_view(self, view: View, sources: list[_Source], receiver: RankRegistration) -> None:
        _assign_layers(view, sources, receiver)
        for source in sources:
            self.heard.add(source.sender.rank)
            if source.assigned:
                transfer = _transfer(source, view, receiver, self.prompt_tokens)
                self.transfers[source.sender.rank].append(transfer)
                self.warnings.extend(_warnings(source, transfer))

    def add_state(self, heard: list[int], sent: list[tuple[int, StateTransfer]]) -> None:
        self.heard.update(heard)
        for rank, state in sent:
            self.states[rank].append(state)


def _bounce_safe(peers: Sequence[PeerPlan]) -> bool:
    # Staging is split per receiver block; blocks of different sizes are not one unit on both
    # sides, so such a plan is never declared bounce safe (unsafe only costs the direct path).
    if any(view.periodic for peer in peers for view in peer.views):
        return False
    return fanin_bounce_safe(
        pp_stages=len({peer.pp_rank for peer in peers}),
        view_pairs=[
            (v.mapper, v.duplicate_head_factor, v.peer_duplicate_head_factor)
            for peer in peers
            for v in (*peer.views, *peer.states)
        ],
        writer_bytes=[nbytes for peer in peers if (nbytes := peer.bytes_per_block) or peer.sends],
        state=any(peer.states for peer in peers),
    )


def _check_roles(senders: Sequence[RankRegistration], receiver: RankRegistration) -> None:
    if not senders:
        raise GeometryError(
            "no_sender_ranks", "the sender instance has no live ranks", field="sender", stage="plan"
        )
    problems: list[tuple[str, object, object]] = [
        ("sender.role", senders[0].role.value, Role.CONTEXT.value),
        ("receiver.role", receiver.role.value, Role.GENERATION.value),
        ("sender.deployment", senders[0].deployment, receiver.deployment),
    ]
    if len({(s.instance, s.deployment) for s in senders}) != 1:
        problems.append(
            ("sender.instance", sorted({s.instance for s in senders}), senders[0].instance)
        )
    for field_name, got, wanted in problems:
        if got != wanted:
            raise GeometryError(
                "plan_roles_invalid",
                f"{field_name} is {got}; a plan moves one context instance's cache to a generation rank "
                f"({field_name} must be {wanted})",
                field=field_name,
                local=got,
                peer=wanted,
                stage="plan",
            )


def _sources(
    view: View, candidates: Sequence[RankRegistration], receiver: RankRegistration
) -> list[_Source]:
    sources = []
    for sender in candidates:
        theirs = match_view(view, receiver, sender)
        if theirs is not None:
            sources.append(_Source(sender, theirs, pair_geometry(sender, theirs, receiver, view)))
    return sources


def _assign_layers(view: View, sources: Sequence[_Source], receiver: RankRegistration) -> None:
    """Elects exactly one writer per (layer, head group) among the ranks holding identical bytes."""
    r_heads = (0, 1)
    for layer in sorted(view.layer_ids):
        # Ranks hold identical bytes when they hold the same heads of the same tokens: CP ranks
        # of one TP position hold different tokens, so each elects its own writer.
        groups: dict[tuple[tuple[int, int], int], list[_Source]] = defaultdict(list)
        for source in sources:
            if layer in source.view.layer_ids:
                groups[(source.heads, source.sender.cp_rank)].append(source)
        for (heads, _), group in groups.items():
            if group[0].geometry.slices_heads or group[0].geometry.mapper == "intact":
                r_heads = held_heads(receiver, group[0].geometry.total_heads)
                if heads[1] <= r_heads[0] or heads[0] >= r_heads[1]:
                    continue
            winner = elect([source.sender for source in group], receiver)
            next(s for s in group if s.sender is winner).assigned.append(layer)


def _transfer(
    source: _Source, view: View, receiver: RankRegistration, prompt_tokens: int | None
) -> ViewTransfer:
    sender, theirs, geometry = source.sender, source.view, source.geometry
    pair = MatchedPair(sender, theirs, receiver, view, geometry)
    axis = token_axis(pair, source.assigned, prompt_tokens)
    fragments = [] if geometry.reblocks else coalesce(pair_fragments(pair, source.assigned))
    dup = duplication(
        geometry.local_heads, sender.tp_per_dp, geometry.peer_heads, receiver.tp_per_dp
    )
    if geometry.mapper == "replicated":
        src_heads = dst_heads = (0, 1)
    else:
        src_heads, _, dst_heads = pair.heads()
    return ViewTransfer(
        **ViewTransfer.members_between(
            theirs, view, geometry.mapper, dup, fragments, source.assigned
        ),
        total_heads=geometry.total_heads,
        src_heads=src_heads,
        dst_heads=dst_heads,
        axis=axis,
        window=geometry.window,
    )


def _warnings(source: _Source, transfer: ViewTransfer) -> list[str]:
    if transfer.mapper != "nhd":
        return []
    if transfer.periodic:
        period = transfer.period_map
        count, tokens, unit = len(period.spans), period.period_tokens, "period"
    else:
        count, tokens, unit = len(transfer.fragments), source.geometry.tokens, "block"
    return [
        f"NHD head mismatch on view {transfer.dst_view} (local_kv_heads={source.geometry.peer_heads}, "
        f"peer_kv_heads={source.geometry.local_heads}): one descriptor per token, "
        f"{count} per {unit} from rank {source.sender.rank} "
        f"(~{count // max(1, tokens)} per transferred token); prefer HND layouts for heterogeneous TP"
    ]


def plan_fingerprint(
    senders: Sequence[RankRegistration],
    receiver: RankRegistration,
    sender_dp_rank: int,
    prompt_tokens: int | None = None,
) -> str:
    """sha256 over the geometry of every input rank (and the prompt length a chunked sender's
    plan is built for): equal fingerprints mean equal plans."""
    parts = [s.geometry_digest for s in sorted(senders, key=lambda s: s.rank)]
    parts += [receiver.geometry_digest, str(sender_dp_rank)]
    if prompt_tokens is not None:
        parts.append(f"prompt={prompt_tokens}")
    return "sha256:" + hashlib.sha256("|".join(parts).encode()).hexdigest()
