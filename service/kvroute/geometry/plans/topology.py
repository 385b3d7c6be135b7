"""Which sender ranks a receiver rank hears from, and which of them write each byte.

TP overlap is computed on positions, not on integer ratios: sender rank q of a DP group of size s
covers [q/s, (q+1)/s) of the head space, and a receiver rank overlaps every sender whose interval
intersects its own. That is the classic p//s and r//ratio rule when one TP divides the other, and it
stays exact for ratios no peer system supports (context TP3 to generation TP2 with 6 heads).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.geometry.leaves.errors import GeometryError
from kvroute.geometry.registration.model import RankRegistration


def tp_overlaps(sender: RankRegistration, receiver: RankRegistration) -> bool:
    s, q = sender.tp_per_dp, sender.tp_rank_in_group
    r, p = receiver.tp_per_dp, receiver.tp_rank_in_group
    return q * r < (p + 1) * s and (q + 1) * r > p * s


def sender_group(
    senders: Sequence[RankRegistration], sender_dp_rank: int
) -> list[RankRegistration]:
    """The sender ranks of the attention-DP group that prefilled the request."""
    first = senders[0]
    groups = first.dp_size if first.attention_dp else 1
    if not 0 <= sender_dp_rank < groups:
        raise GeometryError(
            "sender_dp_rank_out_of_range",
            f"sender_dp_rank={sender_dp_rank}, but {first.instance} has {groups} attention-DP group(s)",
            field="sender_dp_rank",
            local=sender_dp_rank,
            peer=groups,
            stage="plan",
        )
    return [s for s in senders if s.group == sender_dp_rank]


def candidate_senders(
    senders: Sequence[RankRegistration], receiver: RankRegistration, sender_dp_rank: int
) -> list[RankRegistration]:
    group = sender_group(senders, sender_dp_rank)
    return sorted((s for s in group if tp_overlaps(s, receiver)), key=lambda s: s.rank)


def elect(replicas: Sequence[RankRegistration], receiver: RankRegistration) -> RankRegistration:
    """One writer among ranks holding identical bytes: the first, or rotated by the receiver's DP rank.

    Rotation spreads the sending load of replicated heads across a context instance when many
    attention-DP generation ranks pull the same heads.
    """
    ordered = sorted(replicas, key=lambda s: s.rank)
    index = receiver.dp_rank % len(ordered) if receiver.attention_dp else 0
    return ordered[index]
