"""Builds a rank's views from per-layer specs, the way a worker describes its KV pools.

Layers are partitioned into views by (pool, kind, owner, roles, head count, byte geometry, window and
state layout), so a view is homogeneous by construction: target and draft layers never share a view
even inside one pool, and layers with different KV-head counts can never land in one view, which is
the defect the per-view head counts exist to fix. Replicated and recurrent-state layers record no head count.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.geometry.leaves.errors import GeometryError
from kvroute.geometry.leaves.parts import Interior
from kvroute.geometry.registration.model import Kind, LayerSlot, Owner, View


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One layer's region of one role class inside a pool slot."""

    layer: int
    pool_id: int
    offset: int
    bytes_per_layer: int
    kind: Kind = Kind.HND
    owner: Owner = Owner.TARGET
    roles: frozenset[str] = frozenset({"key", "value"})
    num_kv_heads: int | None = None
    total_kv_heads: int | None = None
    buffers_per_layer: int = 2
    tokens_per_block: int | None = None
    dtype: str | None = None
    per_request: bool = False  # replicated recurrent side state (implied by ssm and conv)
    ssm_bytes_per_head: int | None = None
    conv_sections: tuple[int, ...] | None = None
    sliding_window: int | None = None
    interior: Interior | None = None  # hnd: the layout the kernels read, where not the classic one
    kv_group: int | None = None  # the engine's KV cache group: a view never spans two

    @classmethod
    def from_buffers(
        cls, layer: int, pool_id: int, buffers: Sequence[tuple[int, int]], **geometry: Any
    ) -> LayerSpec:
        """A layer described by its buffers' (offset, size) in the slot, e.g. K and V.

        The byte layout of docs/geometry.md needs a layer's buffers equal in size and back to back; anything
        else would be sliced wrongly by every mapper, so it is refused here, where it is found.
        """
        ordered = sorted(buffers)
        sizes = {size for _, size in ordered}
        if not ordered or len(sizes) != 1:
            raise GeometryError(
                "buffers_not_uniform",
                f"layer {layer} buffers must be non-empty and of one size, got sizes {sorted(sizes)}",
                field="buffers",
                local=[list(b) for b in ordered],
                stage="self",
            )
        for (offset, size), (next_offset, _) in itertools.pairwise(ordered):
            if offset + size != next_offset:
                raise GeometryError(
                    "buffers_not_contiguous",
                    f"layer {layer} buffers are not contiguous: [{offset}, {offset + size}) is "
                    f"followed by offset {next_offset}",
                    field="buffers",
                    local=[list(b) for b in ordered],
                    stage="self",
                )
        size = sizes.pop()
        return cls(
            layer,
            pool_id,
            ordered[0][0],
            size * len(ordered),
            buffers_per_layer=len(ordered),
            **geometry,
        )

    def view_key(self) -> tuple[object, ...]:
        heads = self.num_kv_heads if self.kind.sharded else None
        total = self.total_kv_heads if self.kind.sharded else None
        return (
            self.pool_id,
            self.kind,
            self.owner,
            self.roles,
            heads,
            total,
            self.buffers_per_layer,
            self.bytes_per_layer,
            self.tokens_per_block,
            self.dtype,
            self.per_request,
            self.ssm_bytes_per_head,
            self.conv_sections,
            self.sliding_window,
            self.interior,
            self.kv_group,
        )


def build_views(specs: Iterable[LayerSpec], *, first_view_id: int = 0) -> tuple[View, ...]:
    """Views in canonical order (pool, then smallest offset), layers ordered by offset."""
    groups: dict[tuple[object, ...], list[LayerSpec]] = defaultdict(list)
    seen: dict[tuple[Owner, frozenset[str], int, bool], LayerSpec] = {}
    for spec in specs:
        # One layer id may have KV blocks and recurrent state (a hybrid layer), under any roles.
        identity = (spec.owner, spec.roles, spec.layer, spec.per_request or spec.kind.recurrent)
        if identity in seen:
            raise GeometryError(
                "duplicate_layer",
                f"{spec.owner} layer {spec.layer} with roles {sorted(spec.roles)} is described twice",
                field="layers",
                local=spec.layer,
                stage="self",
            )
        seen[identity] = spec
        groups[spec.view_key()].append(spec)
    ordered = sorted(
        groups.values(), key=lambda group: (group[0].pool_id, min(s.offset for s in group))
    )
    return tuple(_view(first_view_id + index, group) for index, group in enumerate(ordered))


def _view(view_id: int, group: list[LayerSpec]) -> View:
    first = group[0]
    replicated = not first.kind.sharded
    return View(
        view_id=view_id,
        pool_id=first.pool_id,
        kind=first.kind,
        roles=first.roles,
        owner=first.owner,
        layers=tuple(LayerSlot(s.layer, s.offset) for s in sorted(group, key=lambda s: s.offset)),
        buffers_per_layer=first.buffers_per_layer,
        bytes_per_layer=first.bytes_per_layer,
        num_kv_heads=None if replicated else first.num_kv_heads,
        total_kv_heads=None if replicated else first.total_kv_heads,
        tokens_per_block=first.tokens_per_block,
        dtype=first.dtype,
        per_request=first.per_request,
        ssm_bytes_per_head=first.ssm_bytes_per_head,
        conv_sections=first.conv_sections,
        sliding_window=first.sliding_window,
        interior=first.interior,
        kv_group=first.kv_group,
    )
