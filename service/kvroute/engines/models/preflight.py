"""Pre-flight: would a context and a generation layout of a model be admitted, and what would move?

The verdict is registration's own: every document is parsed and checked as ``store.admission``
checks it (``check_self``, ``check_instance``, ``check_peers_by_class``: the same answers as
``geometry.check_registration`` at the cost of one check per peer geometry class) in the order a
fresh deployment admits them (the context instance's ranks, then the generation instance's, each
against the ranks admitted before it), so the first refusal is the one a real bring-up would meet:
same code, field and both values. When both are
admitted, every generation rank's plan is built, and the summary gives what a request moves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvroute.client.nixl_descs import PoolAddress, plan_descriptors
from kvroute.engines.models.config import ModelSpec
from kvroute.engines.models.documents import rank_documents
from kvroute.engines.models.layout import Layout
from kvroute.geometry import (
    GeometryError,
    Plan,
    RankRegistration,
    RequestBlocks,
    TokenRange,
    TokenWindow,
    build_plan,
)
from kvroute.geometry.checks.classes import VerdictMemo, check_peers_by_class, representatives
from kvroute.geometry.checks.instance import InstanceMemo, check_instance
from kvroute.geometry.checks.validate import check_self

DEPLOYMENT = "preflight"
CONTEXT, GENERATION = "ctx0", "gen0"
DEFAULT_PROMPT_TOKENS = 8192


@dataclass(frozen=True, slots=True)
class Instance:
    """One side: its name and its ranks' documents in rank order."""

    name: str
    documents: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Verdict:
    """Registration's answer for both instances: None, or the first refusal and the rank it hit."""

    refusal: GeometryError | None = None
    instance: str | None = None
    rank: int | None = None
    plans: tuple[Plan, ...] = field(default=(), repr=False)  # one per generation rank
    senders: tuple[RankRegistration, ...] = field(default=(), repr=False)
    receivers: tuple[RankRegistration, ...] = field(default=(), repr=False)

    @property
    def compatible(self) -> bool:
        return self.refusal is None

    def to_json(self) -> dict[str, Any]:
        if self.refusal is None:
            return {"compatible": True}
        return {
            "compatible": False,
            "instance": self.instance,
            "rank": self.rank,
            "refusal": self.refusal.to_problem(),
        }


def describe(
    model: ModelSpec, layout: Layout, *, draft: ModelSpec | None = None, name: str = CONTEXT
) -> Instance:
    return Instance(name, tuple(rank_documents(model, layout, draft_model=draft)))


def admit(context: Instance, generation: Instance) -> Verdict:
    """Both instances admitted one rank at a time, context first, with the server's checks (the
    document's own, its instance's, then its peers' by geometry class, as ``store.admission``
    runs them); plans for every generation rank when all are admitted."""
    admitted: dict[str, list[RankRegistration]] = {context.name: [], generation.name: []}
    memo: VerdictMemo = {}
    agreed: InstanceMemo = {}
    for instance, peers in ((context, []), (generation, admitted[context.name])):
        firsts = representatives(peers)
        for rank, document in enumerate(instance.documents):
            try:
                reg = RankRegistration.from_json(
                    document, deployment=DEPLOYMENT, instance=instance.name, rank=rank
                )
                check_self(reg)
                check_instance(reg, admitted[instance.name], agreed)
                check_peers_by_class(reg, firsts, memo)
            except GeometryError as refusal:
                return Verdict(refusal, instance.name, rank)
            admitted[instance.name].append(reg)
    senders = admitted[context.name]
    receivers = admitted[generation.name]
    plans = tuple(build_plan(senders, receiver) for receiver in receivers)
    return Verdict(plans=plans, senders=tuple(senders), receivers=tuple(receivers))


def admit_alone(instance: Instance) -> Verdict:
    """One instance's ranks admitted with no peers: their own and their instance's checks."""
    return admit(instance, Instance(GENERATION if instance.name != GENERATION else CONTEXT, ()))


def _blocks(prompt: int, tokens_per_block: int, window: int | None) -> int:
    """Receiver blocks a view pair moves for a prompt: all of them, or those of the window."""
    last = -(-prompt // tokens_per_block)
    if window is None:
        return last
    first = max(0, prompt + 1 - window) // tokens_per_block
    return max(0, last - first)


@dataclass(frozen=True, slots=True)
class SenderLoad:
    rank: int
    bytes_per_request: int
    receivers: int  # generation ranks it writes to


def sender_loads(
    plans: Sequence[Plan], receiver_tpb: int, prompt: int = DEFAULT_PROMPT_TOKENS
) -> list[SenderLoad]:
    """Bytes each sender rank writes for one request of ``prompt`` tokens, over every receiver."""
    totals: dict[int, list[int]] = {}
    for plan in plans:
        for peer in plan.peers:
            moved = peer.state_bytes + sum(
                view.bytes_per_block
                * _blocks(prompt, receiver_tpb, view.window.tokens if view.window else None)
                for view in peer.views
            )
            entry = totals.setdefault(peer.rank, [0, 0])
            entry[0] += moved
            entry[1] += 1 if moved else 0
    return [SenderLoad(rank, load[0], load[1]) for rank, load in sorted(totals.items())]


def nixl_descriptors_per_block(
    plan: Plan, senders: Sequence[RankRegistration], receiver: RankRegistration
) -> int:
    """NIXL descriptors a receiver block costs after ``client.nixl_descs`` merges runs contiguous
    on both sides (across view pairs too): one period of blocks (one block pair where sizes are
    equal) pulled into every other slot, so no block merges with its neighbour as scattered blocks
    of a real request would not; recurrent state is left out (it is per request, not per block).
    Rounded up where a period holds several receiver blocks."""
    src_tpb, dst_tpb = senders[0].tokens_per_block, receiver.tokens_per_block
    period = math.lcm(src_tpb, dst_tpb)
    stateless = replace(plan, peers=tuple(replace(peer, states=()) for peer in plan.peers))
    src_count, dst_count = period // src_tpb, period // dst_tpb
    window = (
        TokenWindow(TokenRange(0, period), 0, 0, period)
        if src_tpb != dst_tpb
        else TokenWindow(prompt_tokens=period)
    )
    transfer = plan_descriptors(
        stateless,
        receiver_pools=_addresses(receiver, 1),
        sender_pools={reg.rank: _addresses(reg, 2 + reg.rank) for reg in senders},
        blocks=RequestBlocks(
            [2 * block for block in range(src_count)],
            [2 * block for block in range(dst_count)],
            window,
        ),
    )
    return -(-transfer.descriptors // dst_count)


def _addresses(reg: RankRegistration, place: int) -> dict[int, PoolAddress]:
    """Pool addresses far apart (one TiB per rank): only the slot layout matters."""
    return {
        pool.pool_id: PoolAddress(
            (place << 40) + index * (1 << 36), pool.slot_stride, max(pool.num_slots, 256)
        )
        for index, pool in enumerate(reg.pools)
    }


def summary(verdict: Verdict, receiver_tpb: int, prompt: int) -> dict[str, Any]:
    """Per generation rank: writers, bytes and fragments per block, state per request; per sender rank:
    bytes per request of ``prompt`` tokens."""
    return {
        "prompt_tokens": prompt,
        "receivers": [
            {
                "rank": plan.receiver_rank,
                "expected_writers": plan.expected_writers,
                "bytes_per_block": plan.bytes_per_block,
                # fragments are coalesced (rule 5): each is one NIXL descriptor
                "fragments_per_block": plan.fragments_per_block,
                "nixl_descriptors_per_block": nixl_descriptors_per_block(
                    plan, verdict.senders, verdict.receivers[index]
                ),
                "state_bytes": plan.state_bytes,
                "state_fragments": plan.state_fragments,
                "fanin_bounce_safe": plan.fanin_bounce_safe,
            }
            for index, plan in enumerate(verdict.plans)
        ],
        "senders": [
            {
                "rank": load.rank,
                "bytes_per_request": load.bytes_per_request,
                "receivers": load.receivers,
            }
            for load in sender_loads(verdict.plans, receiver_tpb, prompt)
        ],
    }
