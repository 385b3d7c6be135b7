"""Model identity and KV quantization: what makes two ranks' bytes mean the same thing.

Geometry checks prove that bytes land in the right place; they cannot tell a rank of revision A
from one of revision B with the same shapes, whose KV means something else (a rolling update that
mixes them passes every geometry check and produces wrong output). A registration may therefore
name its model (name, revision, weights and tokenizer digests) and its KV quantization (the KV
format, how its scales are laid out, the elements per scale and the scale format).

Rules, all optional so documents without them mean what they always meant:

- **Peers.** A model member is compared when both sides declare it (a worker may know a revision
  and not a weights digest); the quantization is compared member by member, absent members
  included, when both sides declare one (no scale layout means "no scales"). The first difference
  is refused with its own code, the field and both values (``model_revision_mismatch`` ...), before
  any geometry check: another model's geometry is not worth comparing.
- **Instance.** Every rank of an instance names the same identity, members absent or not.
- **Scale views.** Scales are views like any other (roles ending in ``_scale``), moved by the plan
  like K and V. Per-head and per-block (microscaling: MXFP8, NVFP4) scales belong to every token of
  every head, so each layer with KV must have a scale view, sharded by heads (``hnd``/``nhd``);
  per-tensor scales are one value per layer on every TP rank (a ``replicated`` view) or model
  constants outside the pool (no view). Nothing of a quantized cache is silently left behind.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from kvroute.geometry.leaves.errors import GeometryError, Ranked

if TYPE_CHECKING:
    from kvroute.geometry.registration.document import _Reader
    from kvroute.geometry.registration.model import RankRegistration

# Printable ASCII without spaces: model ids ("meta-llama/Llama-3.1-8B"), git revisions, digests.
IDENTITY_PATTERN = re.compile(r"[!-~]+", re.ASCII)
FORMAT_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]*", re.ASCII)  # "nvfp4", "fp8_e4m3", "e8m0"
SCALE_ROLE_SUFFIX = "_scale"


class ScaleLayout(StrEnum):
    PER_TENSOR = "per_tensor"  # one scale per layer: identical on every TP rank
    PER_HEAD = "per_head"  # scales per KV head (per token or block): split over TP like heads
    PER_BLOCK = "per_block"  # one scale per ``scale_block`` elements of a head's row (MX, NVFP4)


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    name: str | None = None
    revision: str | None = None
    weights_digest: str | None = None
    tokenizer_digest: str | None = None


@dataclass(frozen=True, slots=True)
class KvQuantization:
    kv_dtype: str
    scale_layout: ScaleLayout | None = None
    scale_block: int | None = None  # elements per scale, per_block only
    scale_dtype: str | None = None


class _Identified(Ranked, Protocol):
    """What the identity checks read: a registration or its face."""

    @property
    def model(self) -> ModelIdentity | None: ...
    @property
    def kv_quantization(self) -> KvQuantization | None: ...

    def label(self) -> str: ...


# (group, member, code of a peer mismatch), in check order.
MEMBERS: tuple[tuple[str, str, str], ...] = (
    ("model", "name", "model_name_mismatch"),
    ("model", "revision", "model_revision_mismatch"),
    ("model", "weights_digest", "model_weights_mismatch"),
    ("model", "tokenizer_digest", "tokenizer_mismatch"),
    ("kv_quantization", "kv_dtype", "kv_dtype_mismatch"),
    ("kv_quantization", "scale_layout", "kv_scale_layout_mismatch"),
    ("kv_quantization", "scale_block", "kv_scale_block_mismatch"),
    ("kv_quantization", "scale_dtype", "kv_scale_dtype_mismatch"),
)


def _value(group: Any, member: str) -> Any:
    value = getattr(group, member) if group is not None else None
    return value.value if isinstance(value, StrEnum) else value


def differences(
    reg: _Identified, other: _Identified, *, strict: bool
) -> list[tuple[str, str, Any, Any]]:
    """(code, field, mine, theirs) of every differing member; ``strict`` compares absent ones too."""
    found = []
    for group_name, member, code in MEMBERS:
        mine, theirs = getattr(reg, group_name), getattr(other, group_name)
        if not strict and (mine is None or theirs is None):
            continue
        a, b = _value(mine, member), _value(theirs, member)
        if not strict and group_name == "model" and (a is None or b is None):
            continue
        if a != b:
            found.append((code, f"{group_name}.{member}", a, b))
    return found


def check_identity(reg: _Identified, peer: _Identified) -> None:
    """The first peer stage: both ranks serve the same model with the same KV format."""
    for code, field, mine, theirs in differences(reg, peer, strict=False)[:1]:
        detail = f"{field} differs from {peer.label()}: local={mine}, peer={theirs}"
        raise GeometryError.against(peer, code, detail, field=field, local=mine, theirs=theirs)


def is_scale_view(roles: frozenset[str]) -> bool:
    return any(role.endswith(SCALE_ROLE_SUFFIX) for role in roles)


def check_scale_views(reg: RankRegistration) -> None:
    """Self check: the declared scale layout has its scale views, of a kind that splits right."""
    quant = reg.kv_quantization
    if quant is None or quant.scale_layout is None:
        return
    layout = quant.scale_layout
    kinds = {"replicated"} if layout is ScaleLayout.PER_TENSOR else {"hnd", "nhd"}
    scaled: set[tuple[str, int]] = set()
    for index, view in enumerate(reg.views):
        if not is_scale_view(view.roles):
            continue
        if view.kind.value not in kinds:
            raise GeometryError(
                "kv_scale_view_kind_mismatch",
                f"views[{index}] holds {layout} scales as a {view.kind} view; "
                f"{layout} scales are {' or '.join(sorted(kinds))}",
                field=f"views[{index}].kind",
                local=view.kind.value,
                peer=sorted(kinds),
                stage="self",
            )
        scaled.update((view.owner.value, layer) for layer in view.layer_ids)
    if layout is ScaleLayout.PER_TENSOR:
        return  # per-tensor scales may be model constants, outside every pool
    for view in reg.views:
        if view.is_state or is_scale_view(view.roles):
            continue
        for layer in sorted(view.layer_ids):
            if (view.owner.value, layer) not in scaled:
                raise GeometryError(
                    "kv_scale_views_missing",
                    f"kv_quantization.scale_layout is {layout} but {view.owner} layer {layer} of "
                    f"{view.label()} has no scale view (roles ending in {SCALE_ROLE_SUFFIX!r}): "
                    "its scales would never move",
                    field="kv_quantization.scale_layout",
                    local=layout.value,
                    peer=None,
                    stage="self",
                )


def parse_identity(r: _Reader) -> dict[str, Any]:
    """The ``model`` and ``kv_quantization`` members of a document, as RankRegistration fields."""
    found: dict[str, Any] = {}
    if r.has("model"):
        m = r.child("model", "ModelIdentity")
        members = {
            key: m.opt_str(key, pattern=IDENTITY_PATTERN)
            for key in ("name", "revision", "weights_digest", "tokenizer_digest")
        }
        if all(value is None for value in members.values()):
            raise GeometryError(
                "invalid_document",
                "model: names none of name, revision, weights_digest, tokenizer_digest",
                field="model",
                stage="schema",
            )
        found["model"] = ModelIdentity(**members)
    if r.has("kv_quantization"):
        found["kv_quantization"] = _parse_quantization(r.child("kv_quantization", "KvQuantization"))
    return found


def _parse_quantization(q: _Reader) -> KvQuantization:
    layout = q.enum("scale_layout", ScaleLayout) if q.has("scale_layout") else None
    block = q.opt_int("scale_block")
    if (layout is ScaleLayout.PER_BLOCK) != (block is not None):
        raise GeometryError(
            "invalid_document",
            "kv_quantization.scale_block: is required with scale_layout per_block and applies "
            f"to it only (scale_layout {layout.value if layout else None})",
            field="kv_quantization.scale_block",
            local=block,
            stage="schema",
        )
    return KvQuantization(
        kv_dtype=q.str("kv_dtype", pattern=FORMAT_PATTERN),
        scale_layout=layout,
        scale_block=block,
        scale_dtype=q.opt_str("scale_dtype", pattern=FORMAT_PATTERN),
    )


def render_identity(reg: RankRegistration) -> dict[str, Any]:
    """The members that are set, and nothing else: older servers refuse unknown members."""
    doc: dict[str, Any] = {}
    if reg.model is not None:
        doc["model"] = {
            key: value
            for key in ("name", "revision", "weights_digest", "tokenizer_digest")
            if (value := getattr(reg.model, key)) is not None
        }
    if (quant := reg.kv_quantization) is not None:
        doc["kv_quantization"] = {
            key: value
            for key in ("kv_dtype", "scale_layout", "scale_block", "scale_dtype")
            if (value := _value(quant, key)) is not None
        }
    return doc
