"""The matched view pairs of a plan, as one sender rank sends them, and their JSON both ways.

Block pairs (``ViewTransfer``) carry fragments relative to one block on each side, or a period where
the block sizes differ (``periods``); recurrent-state pairs (``StateTransfer``) carry fragments
relative to a request's state slot on each side. ``plan`` puts them into peers and plans.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from kvroute.geometry.leaves.parts import Owner, View
from kvroute.geometry.plans.mappers import Fragment
from kvroute.geometry.plans.reading import Members, invalid
from kvroute.geometry.plans.rows import TokenAxis
from kvroute.geometry.tokens.periods import PeriodMap
from kvroute.geometry.tokens.window import Window

OWNERS = tuple(owner.value for owner in Owner)


@dataclass(frozen=True, slots=True)
class PairTransfer:
    """What every matched view pair states, block or state: views, pools, mapper, duplication
    factors, fragments, layers, owner and roles."""

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

    def members_json(self) -> dict[str, Any]:
        return {
            "src_view": self.src_view,
            "dst_view": self.dst_view,
            "src_pool": self.src_pool,
            "dst_pool": self.dst_pool,
            "mapper": self.mapper,
            "duplicate_head_factor": self.duplicate_head_factor,
            "peer_duplicate_head_factor": self.peer_duplicate_head_factor,
            "owner": self.owner,
            "roles": list(self.roles),
            "layers": list(self.layers),
        }

    @staticmethod
    def members_between(
        theirs: View,
        view: View,
        mapper: str,
        duplication: tuple[int, int],
        fragments: Iterable[Fragment],
        layers: Iterable[int],
    ) -> dict[str, Any]:
        """The members of a pair from the sender's view ``theirs`` to the receiver's ``view``,
        which names the owner and roles; ``duplication`` is (duplicate, peer duplicate) factor."""
        return {
            "src_view": theirs.view_id,
            "dst_view": view.view_id,
            "src_pool": theirs.pool_id,
            "dst_pool": view.pool_id,
            "mapper": mapper,
            "duplicate_head_factor": duplication[0],
            "peer_duplicate_head_factor": duplication[1],
            "fragments": tuple(fragments),
            "layers": tuple(layers),
            "owner": view.owner.value,
            "roles": tuple(sorted(view.roles)),
        }

    @staticmethod
    def read_members(m: Members) -> dict[str, Any]:
        """``members_json`` read back."""
        return {
            **{key: m.int(key) for key in ("src_view", "dst_view", "src_pool", "dst_pool")},
            "mapper": m.str("mapper"),
            "duplicate_head_factor": m.int("duplicate_head_factor", 1),
            "peer_duplicate_head_factor": m.int("peer_duplicate_head_factor", 1),
            "owner": m.str("owner", OWNERS),
            "roles": m.strs("roles"),
            "layers": m.ints("layers"),
        }


@dataclass(frozen=True, slots=True)
class ViewTransfer(PairTransfer):
    """One matched view pair as sent by one sender rank."""

    total_heads: int
    src_heads: tuple[int, int]  # global head range the sender holds (under total_heads)
    dst_heads: tuple[int, int]  # global head range this pair writes on the receiver
    axis: TokenAxis | None = field(default=None, compare=False, repr=False)
    window: Window | None = None  # sliding window: only the tokens in it move
    # The period form a plan document stated (a plan read back has no token axis).
    period: PeriodMap | None = field(default=None, compare=False, repr=False)
    # What a plan document stated of its rows (``token_rows``; a plan read back has no axis).
    stated_token_rows: bool = field(default=True, compare=False, repr=False)

    @property
    def token_rows(self) -> bool:
        """The pair's bytes per layer are whole token rows, so a token range can be cut from its
        blocks. Not so for sub-byte rows (4-bit block scales: two tokens per byte) at equal
        block sizes: such a pair has only its block form and moves whole blocks."""
        return self.axis.token_unit != 0 if self.axis is not None else self.stated_token_rows

    @property
    def periodic(self) -> bool:
        """The pair moves by period, not by block pair: the two sides' blocks differ in size (or
        the document it was read from stated only the period form)."""
        if self.axis is None:
            return self.period is not None and not self.fragments
        return self.axis.periodic

    @property
    def period_map(self) -> PeriodMap:
        """The pair's period form (computed on first use where block sizes are equal)."""
        if self.period is not None:
            return self.period
        if self.axis is None:
            raise ValueError(f"view pair {self.src_view}->{self.dst_view} has no token layout")
        return self.axis.period_map

    @property
    def token_form(self) -> PeriodMap | None:
        """The period form wherever the pair has one (every pair with a per-token layout), so
        any token range can be cut from it; None for a plan read back in the block form."""
        if self.period is not None or self.periodic:
            return self.period_map
        return self.axis.period_map if self.axis is not None and self.axis.token_unit else None

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

    def period_form(self) -> ViewTransfer:
        """The pair as ``to_json(period=True)`` writes it and ``from_json`` reads it back: its
        period form alone where it has one (``token_form``), else itself."""
        form = self.token_form
        return self if form is None else replace(self, fragments=(), axis=None, period=form)

    def to_json(self, *, period: bool = False) -> dict[str, Any]:
        doc: dict[str, Any] = {
            **self.members_json(),
            "heads": {
                "total": self.total_heads,
                "src": list(self.src_heads),
                "dst": list(self.dst_heads),
            },
            "bytes_per_block": self.bytes_per_block,
        }
        if self.window is not None:
            doc["window"] = self.window.to_json()
        if not self.token_rows:  # so a reader of fragments=period knows it cannot re-cut it
            doc["token_rows"] = False
        if self.periodic or (period and self.token_form is not None):
            return doc | self.period_map.to_json()
        return doc | {
            "descriptors_per_block": len(self.fragments),
            "fragments": [list(fragment) for fragment in self.fragments],
        }

    @classmethod
    def from_json(cls, doc: Any, path: str) -> ViewTransfer:
        m = Members(doc, path)
        period = None
        if m.has("period_fragments"):
            try:
                period = PeriodMap.from_json(m.doc)
            except ValueError as error:
                raise invalid(path, str(error)) from None
        heads = m.child("heads")
        view = cls(
            **cls.read_members(m),
            fragments=m.fragments("fragments") if period is None or m.has("fragments") else (),
            total_heads=heads.int("total"),
            src_heads=heads.ints("src", 2),  # type: ignore[arg-type]
            dst_heads=heads.ints("dst", 2),  # type: ignore[arg-type]
            window=read_window(m.child("window"), period) if m.has("window") else None,
            period=period,
            stated_token_rows=m.bool("token_rows") if m.has("token_rows") else True,
        )
        if period is not None and not view.token_rows:
            raise invalid(m.at("token_rows"), "is false, but the pair states a period form")
        m.derived("bytes_per_block", view.bytes_per_block)
        m.derived("descriptors_per_block", view.descriptors_per_block)
        return view


@dataclass(frozen=True, slots=True)
class StateTransfer(PairTransfer):
    """One matched recurrent-state view pair as sent by one sender rank (mapper ``ssm``,
    ``conv`` or ``replicated``).

    Fragments are relative to a request's state slot on each side (not to a block), and are
    copied once per request, from the sender's state slot to the receiver's.
    """

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
            **self.members_json(),
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

    @classmethod
    def from_json(cls, doc: Any, path: str) -> StateTransfer:
        m = Members(doc, path)
        tp, shard = m.child("mamba_tp"), m.child("shard")
        state = cls(
            **cls.read_members(m),
            fragments=m.fragments("fragments"),
            mamba_tp=(tp.ints("src", 2), tp.ints("dst", 2)),  # type: ignore[arg-type]
            shard_unit=shard.str("unit", ("head", "part", "whole")),
            shard_total=shard.int("total", 1),
            src_shard=shard.ints("src", 2),  # type: ignore[arg-type]
            dst_shard=shard.ints("dst", 2),  # type: ignore[arg-type]
        )
        m.derived("bytes", state.nbytes)
        m.derived("descriptors", len(state.fragments))
        return state


def read_window(m: Members, period: PeriodMap | None) -> Window:
    """A pair's ``window``; its block sizes must be the period's, where the pair states one."""
    window = Window(
        m.int("tokens", 1),
        m.opt_int("sender"),
        m.opt_int("receiver"),
        m.int("src_tokens_per_block", 1),
        m.int("dst_tokens_per_block", 1),
    )
    sizes = window.src_tokens_per_block, window.dst_tokens_per_block
    if period is not None and sizes != (period.src_tokens_per_block, period.dst_tokens_per_block):
        raise invalid(
            m.path,
            f"cuts {sizes[0]} -> {sizes[1]} tokens per block, the period "
            f"{period.src_tokens_per_block} -> {period.dst_tokens_per_block}",
        )
    return window
