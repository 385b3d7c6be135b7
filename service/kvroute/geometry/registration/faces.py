"""A rank's *face*: everything a peer check may read of it, and nothing else.

Peer verdicts (``compat.PEER_STAGES``: model identity, rank fields, view matching, pair geometry, windows, state)
depend on which layers a rank holds and on each view's kind, roles, owner, heads, bytes, block
size, window, dtype and state shape; never on where a layer's region sits in the slot (offsets,
gaps, slot size and stride, pools), on view or pool ids, nor on the rank's TP position. A
``RankFace`` carries the former only, as slotted frozen dataclasses: a check run on a face that
reads anything else fails with ``AttributeError`` instead of reading it.

Admission and the compatibility matrix compute their memoized verdicts by running the peer checks
on faces (``classes.peer_verdict``), and the class digest is the digest of the face, taken over
every field the face declares (``face_digest``). So the digest cannot miss what a verdict reads: a
new check needing another field of a rank must first add it here, and the digest then covers it.

Names (instance, rank, view id) ride along for the checks' messages only and stay out of the
digest; the errors a caller sees are re-raised from the real registrations (``classes``).

The instance checks (``checks.instance``) read another face: the layout every rank of an instance
shares and each view's geometry, whose digest (``instance_digest``) keys the agreements admission
memoizes.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from kvroute.geometry.leaves.parts import Axis, Interior, Kind, Owner, Role, View, view_label
from kvroute.geometry.registration.identity import KvQuantization, ModelIdentity

if TYPE_CHECKING:
    from kvroute.geometry.registration.model import RankRegistration

# Field metadata: ``NAME`` fields label messages and are not geometry; ``UNORDERED`` sequences are
# digested as multisets (a stage fails when any view fails, whatever the order of the views).
NAME = {"name": True}
UNORDERED = {"unordered": True}
# ``OPTIONAL`` fields are left out of the digest while None or at their declared default (a count's
# 1), so ranks that do not declare them keep the class digest they had before the field existed
# (stored classes stay valid).
OPTIONAL = {"optional": True}


@dataclass(frozen=True, slots=True)
class AttentionFace:
    """The rank-wide attention fields the rank check compares (the head count is per view)."""

    head_dim: int
    dtype: str
    is_mla: bool


@dataclass(frozen=True, slots=True)
class ViewFace:
    """A view less its placement: its layers as a set, its heads and tokens resolved."""

    kind: Kind
    roles: frozenset[str]
    owner: Owner
    axis: Axis
    layer_ids: frozenset[int]
    buffers_per_layer: int
    bytes_per_layer: int
    heads: int  # RankRegistration.heads: the view's own count or the rank-wide fallback
    total_kv_heads: int | None
    tokens: int  # RankRegistration.tokens: the view's own block size or the rank's
    dtype: str | None
    ssm_bytes_per_head: int | None
    conv_sections: tuple[int, ...] | None
    sliding_window: int | None
    interior: Interior | None = field(metadata=OPTIONAL)  # absent from digests when classic
    # Read by no peer check, but two ranks differing only here lay out memory differently.
    kv_group: int | None = field(metadata=OPTIONAL)
    view_id: int = field(metadata=NAME)

    @property
    def is_state(self) -> bool:
        return self.axis is Axis.STATE

    def label(self) -> str:
        return view_label(self)


@dataclass(frozen=True, slots=True)
class RankFace:
    """A rank as its peers' checks see it (the duck type of ``RankRegistration`` they use)."""

    role: Role
    num_layers: int
    num_draft_layers: int
    attention: AttentionFace
    tp_per_dp: int  # heads and recurrent state are divided over the DP group's TP
    cp_size: int  # context parallelism: pairs re-cut tokens, state splits over TP x CP
    target_layers: frozenset[int]  # RankRegistration.held_layers(TARGET): its PP stage
    draft_layers: frozenset[int]
    views: tuple[ViewFace, ...] = field(metadata=UNORDERED)
    model: ModelIdentity | None = field(metadata=OPTIONAL)  # identity checks (``identity``)
    kv_quantization: KvQuantization | None = field(metadata=OPTIONAL)
    instance: str = field(metadata=NAME)
    rank: int = field(metadata=NAME)

    @property
    def state_tp(self) -> int:
        return self.tp_per_dp * self.cp_size  # RankRegistration.state_tp

    def heads(self, view: ViewFace) -> int:
        return view.heads

    def tokens(self, view: ViewFace) -> int:
        return view.tokens

    def held_layers(self, owner: Owner) -> frozenset[int]:
        return self.target_layers if owner is Owner.TARGET else self.draft_layers

    def label(self) -> str:
        return f"{self.instance} rank {self.rank}"


def rank_face(reg: RankRegistration) -> RankFace:
    """The face of ``reg``; derived values come from the registration's own definitions."""
    attention = reg.attention
    return RankFace(
        role=reg.role,
        num_layers=reg.num_layers,
        num_draft_layers=reg.num_draft_layers,
        attention=AttentionFace(attention.head_dim, attention.dtype, attention.is_mla),
        tp_per_dp=reg.tp_per_dp,
        cp_size=reg.cp_size,
        target_layers=reg.held_layers(Owner.TARGET),
        draft_layers=reg.held_layers(Owner.DRAFT),
        views=tuple(_view_face(reg, view) for view in reg.views),
        model=reg.model,
        kv_quantization=reg.kv_quantization,
        instance=reg.instance,
        rank=reg.rank,
    )


def _view_face(reg: RankRegistration, view: View) -> ViewFace:
    return ViewFace(
        kind=view.kind,
        roles=view.roles,
        owner=view.owner,
        axis=view.axis,
        layer_ids=view.layer_ids,
        buffers_per_layer=view.buffers_per_layer,
        bytes_per_layer=view.bytes_per_layer,
        heads=reg.heads(view),
        total_kv_heads=view.total_kv_heads,
        tokens=reg.tokens(view),
        dtype=view.dtype,
        ssm_bytes_per_head=view.ssm_bytes_per_head,
        conv_sections=view.conv_sections,
        sliding_window=view.sliding_window,
        interior=view.interior,
        kv_group=view.kv_group,
        view_id=view.view_id,
    )


def class_digest(reg: RankRegistration) -> str:
    """sha256 of the rank's face: every field a peer check can read, names left out."""
    return face_digest(rank_face(reg))


def face_digest(face: RankFace) -> str:
    """sha256 of every geometry field of the face, names left out, views as a multiset."""
    return _memoized(_face_key(face), face)


def _face_key(face: RankFace) -> tuple[Any, ...]:
    """The values of the face's digested fields, its views' as tuples in their order (a view
    order not seen before only misses the memo): equal keys, equal digests."""
    ranks = tuple(getattr(face, name) for name, *_ in _digested_fields(RankFace))
    views = tuple(
        tuple(getattr(view, name) for name, *_ in _digested_fields(ViewFace)) for view in face.views
    )
    return (RankFace, ranks, views)


# Digests already taken, by the values they were taken of. A fleet's ranks fall in a few classes
# (every rank of a PP stage of its instances shares one) however their slots are laid out, so a
# registration's class and instance digests are nearly always found here. Values equal as Python
# values are equal as JSON here: every field has one type (the document's parser sees to it).
DIGEST_MEMO_SIZE = 4096


@dataclass(frozen=True)
class _Keyed:
    """A face keyed by its digested values (``lru_cache`` hashes and compares the key only)."""

    key: Any
    face: Any = field(compare=False, hash=False)


@functools.lru_cache(maxsize=DIGEST_MEMO_SIZE)
def _digest_of(keyed: _Keyed) -> str:
    return _digest(keyed.face)


def _memoized(key: Any, face: Any) -> str:
    try:
        return _digest_of(_Keyed(key, face))
    except TypeError:  # an unhashable member: digested every time
        return _digest(face)


# ``json.dumps`` with these arguments, without building an encoder per call (same output).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
_SORT_KEY = json.JSONEncoder(sort_keys=True)
# Types ``_plain`` returns as they are (exact types: an Enum member, even an int or str one, is
# digested as its value, so it must not take the shortcuts below).
_AS_IS = frozenset({int, str, bool, type(None)})


def _digest(face: Any) -> str:
    canonical = _CANONICAL.encode(_plain(face))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _plain(value: Any) -> Any:
    """JSON of a face, generic over its fields so that a field added to a face is digested.

    Every registration is digested on admission, and a face has a node per layer of every view:
    the common nodes (scalars, and tuples and sets of scalars, such as a view's layers, whose
    members' types are tested in one pass in C) are tested first, and each dataclass's fields
    are listed once per type (``_digested_fields``)."""
    kind = type(value)
    if kind in _AS_IS:
        return value
    if isinstance(value, Enum):
        return value.value
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, tuple):
        if kind is tuple and _AS_IS.issuperset(map(type, value)):
            return list(value)
        return [_plain(member) for member in value]
    if isinstance(value, frozenset):
        if _AS_IS.issuperset(map(type, value)):
            return sorted(value)
        return sorted(_plain(member) for member in value)
    if is_dataclass(value) and not isinstance(value, type):
        plain = {}
        for name, metadata, optional, default in _digested_fields(type(value)):
            member = getattr(value, name)
            if not (optional and (member is None or member == default)):
                plain[name] = _member(metadata, member)
        return plain
    # A type with no canonical form here would make equal faces digest apart, or worse, alike.
    raise TypeError(f"a rank face holds a {type(value).__name__}, which face_digest cannot digest")


@functools.cache
def _digested_fields(cls: type) -> tuple[tuple[str, Any, bool, Any], ...]:
    """(name, metadata, optional, default) of each field of a face dataclass that is digested."""
    return tuple(
        (item.name, item.metadata, bool(item.metadata.get("optional")), item.default)
        for item in fields(cls)
        if not item.metadata.get("name")
    )


def _member(metadata: Any, value: Any) -> Any:
    plain = _plain(value)
    if metadata.get("unordered"):
        return sorted(plain, key=_SORT_KEY.encode)
    return plain


# Fields every rank of an instance must agree on, in the order ``checks.instance`` compares them.
INSTANCE_FIELDS: tuple[str, ...] = (
    "role",
    "tp_size",
    "pp_size",
    "cp_size",
    "cp_layout",
    "cp_interleave",
    "attention_dp",
    "dp_size",
    "layers_per_stage",
    "tokens_per_block",
    "num_draft_layers",
)
ATTENTION_FIELDS: tuple[str, ...] = ("num_kv_heads", "head_dim", "dtype", "is_mla")


def instance_digest(reg: RankRegistration) -> str:
    """sha256 of everything the instance checks read of a rank but its name (which only their
    refusals quote): two ranks with the digests of two that agreed agree too."""
    views = tuple(
        (
            view.owner,
            view.roles,
            view.axis,
            view.layer_ids,
            *(mine for _, mine, _ in view_signature(reg, view, reg, view)),
        )
        for view in reg.views
    )
    face = (
        tuple(getattr(reg, f) for f in INSTANCE_FIELDS),
        tuple(getattr(reg.attention, f) for f in ATTENTION_FIELDS),
        reg.model,
        reg.kv_quantization,
        views,
    )
    return _memoized(face, face)


def view_signature(
    reg: RankRegistration, view: View, other: RankRegistration, theirs: View
) -> Sequence[tuple[str, object, object]]:
    """What the instance checks compare of two views of one role class sharing layers."""
    return (
        ("kind", view.kind.value, theirs.kind.value),
        ("num_kv_heads", reg.heads(view), other.heads(theirs)),
        ("buffers_per_layer", view.buffers_per_layer, theirs.buffers_per_layer),
        ("bytes_per_layer", view.bytes_per_layer, theirs.bytes_per_layer),
        (
            "total_kv_heads",
            view.total_kv_heads or theirs.total_kv_heads,
            theirs.total_kv_heads or view.total_kv_heads,
        ),
        ("ssm_bytes_per_head", view.ssm_bytes_per_head, theirs.ssm_bytes_per_head),
        ("conv_sections", view.conv_sections, theirs.conv_sections),
        ("sliding_window", view.sliding_window, theirs.sliding_window),
        ("interior", view.interior, theirs.interior),
    )
