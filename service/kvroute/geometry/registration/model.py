"""Immutable model of what a rank registers: its parallel layout, pools and views.

The model is the registration document (docs/geometry.md) made typed. Geometry that is derived (a view's head count
after the legacy fallback, a stage's layer range, the DP-group TP size) lives here as properties so every
check and the planner agree on one definition. The parts (pools, views, their enums) live in
``parts``; the document codec in ``document`` and the faces the checks read (``faces``) read and
build them without this module, which imports both (and none of the checks).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kvroute.geometry.leaves.errors import GeometryError
from kvroute.geometry.leaves.parts import (
    DTYPE_BITS,
    Attention,
    Axis,
    CpLayout,
    Kind,
    LayerSlot,
    Owner,
    Pool,
    Role,
    View,
)
from kvroute.geometry.leaves.spread import Spread
from kvroute.geometry.registration import digests
from kvroute.geometry.registration.document import parse_registration
from kvroute.geometry.registration.faces import class_digest, instance_digest
from kvroute.geometry.registration.identity import KvQuantization, ModelIdentity
from kvroute.geometry.registration.rendering import render_registration

__all__ = [
    "DTYPE_BITS",
    "Attention",
    "Axis",
    "CpLayout",
    "Kind",
    "LayerSlot",
    "Owner",
    "Pool",
    "RankRegistration",
    "Role",
    "View",
]


@dataclass(frozen=True)
class RankRegistration:
    deployment: str
    instance: str
    rank: int
    role: Role
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    layers_per_stage: tuple[int, ...]
    tokens_per_block: int
    attention: Attention
    pools: tuple[Pool, ...]
    views: tuple[View, ...]
    attention_dp: bool = False
    dp_size: int = 1
    dp_rank: int = 0
    num_draft_layers: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    cp_layout: CpLayout = (
        CpLayout.INTERLEAVED
    )  # how prompt tokens are dealt to CP ranks (see ``spread``)
    cp_interleave: int = 1  # tokens dealt to a CP rank at a time (interleaved layout)
    lease_seconds: int = 30
    endpoint: str | None = None
    nixl_agent_metadata: str | None = None
    model: ModelIdentity | None = None  # what the KV means (``identity``); None: undeclared
    kv_quantization: KvQuantization | None = None
    topology: tuple[tuple[str, str], ...] = ()  # (domain, value) sorted: where the rank runs

    @classmethod
    def from_json(
        cls, doc: Mapping[str, Any], *, deployment: str, instance: str, rank: int
    ) -> RankRegistration:
        return parse_registration(cls, doc, deployment=deployment, instance=instance, rank=rank)

    def to_json(self) -> dict[str, Any]:
        return render_registration(self)

    def canonical(self) -> str:
        """Canonical JSON of the document: equal strings mean an identical registration."""
        return digests.canonical(self)

    @cached_property
    def canonical_digest(self) -> str:
        """sha256 of ``canonical()``: equal digests mean an identical registration."""
        return digests.canonical_digest(self)

    @cached_property
    def geometry_digest(self) -> str:
        """sha256 of what can change a plan: the document less lease, memory and endpoints."""
        return digests.geometry_digest(self)

    @cached_property
    def class_digest(self) -> str:
        """sha256 of the rank's face (``faces``), all peer checks see: ranks of one PP stage of an
        instance share it, whatever their layout inside the slot."""
        return class_digest(self)

    @cached_property
    def instance_digest(self) -> str:
        """sha256 of what the instance checks compare of this rank (``faces.instance_digest``)."""
        return instance_digest(self)

    @property
    def key(self) -> tuple[str, int]:
        return self.instance, self.rank

    @property
    def tp_per_dp(self) -> int:
        """TP size of one attention-DP group: the TP over which KV heads are divided."""
        return self.tp_size // self.dp_size if self.attention_dp else self.tp_size

    @property
    def tp_rank_in_group(self) -> int:
        return self.tp_rank % self.tp_per_dp

    @property
    def chunked(self) -> bool:
        """Prompt tokens are split in prefill chunks, whose placement depends on the prompt."""
        return self.cp_size > 1 and self.cp_layout is not CpLayout.INTERLEAVED

    @property
    def spread(self) -> Spread:
        """Which prompt tokens this rank holds, and where (the identity without CP)."""
        return self.placement()

    def placement(self, prompt_tokens: int | None = None) -> Spread:
        """The rank's spread for a prompt of ``prompt_tokens``, which chunked layouts need."""
        if self.cp_size == 1:
            return Spread()
        if not self.chunked:
            return Spread(self.cp_size, self.cp_rank, self.cp_interleave)
        if prompt_tokens is None:
            raise GeometryError(
                "prompt_tokens_required",
                f"{self.label()} splits prompts in {self.cp_layout.value} chunks over "
                f"cp_size={self.cp_size} ranks, so which rank holds a token depends on the "
                "prompt's length: name prompt_tokens",
                field="prompt_tokens",
                local=None,
                peer=self.cp_layout.value,
                stage="request",
            )
        return Spread(self.cp_size, self.cp_rank, 1, self.cp_layout.value, prompt_tokens)

    @property
    def state_tp(self) -> int:
        """Mamba TP: the ranks one request's recurrent state is split over (reference 2.10).

        The reference takes (1, 0) under attention DP, since a DP rank serves its requests alone;
        kvroute generalises that to the DP group's TP, which is 1 when dp_size == tp_size as the
        reference assumes, and (tp, tp_rank) without attention DP. With context parallelism the
        state is split over TP x CP, CP-minor (helix repurposes CP as TP for non-attention layers):
        CP rank c of TP position q holds share ``q * cp_size + c``.
        """
        return self.tp_per_dp * self.cp_size

    @property
    def state_rank(self) -> int:
        return self.tp_rank_in_group * self.cp_size + self.cp_rank

    @property
    def group(self) -> int:
        """The attention-DP group this rank serves (0 without attention DP)."""
        return self.dp_rank if self.attention_dp else 0

    @property
    def num_layers(self) -> int:
        return sum(self.layers_per_stage)

    @cached_property
    def stage_range(self) -> range:
        """Target layers owned by this rank's PP stage (uneven splits allowed)."""
        start = sum(self.layers_per_stage[: self.pp_rank])
        return range(start, start + self.layers_per_stage[self.pp_rank])

    @cached_property
    def pools_by_id(self) -> dict[int, Pool]:
        return {pool.pool_id: pool for pool in self.pools}

    def heads(self, view: View) -> int:
        """Per-rank KV heads of a view: its own count, or the rank-wide one for a legacy view."""
        return view.num_kv_heads if view.num_kv_heads is not None else self.attention.num_kv_heads

    def tokens(self, view: View) -> int:
        return view.tokens_per_block if view.tokens_per_block is not None else self.tokens_per_block

    def held_layers(self, owner: Owner) -> frozenset[int]:
        """Layers this rank is responsible for in an owner's namespace.

        Target layers are split by PP stage, so a stage holds its whole range whether or not it
        registered a view for each layer; draft layers sit on whichever ranks declare them.
        """
        return self._held_layers[owner]

    @cached_property
    def _held_layers(self) -> dict[Owner, frozenset[int]]:
        draft = frozenset(
            layer for view in self.views if view.owner is Owner.DRAFT for layer in view.layer_ids
        )
        return {Owner.TARGET: frozenset(self.stage_range), Owner.DRAFT: draft}

    def label(self) -> str:
        return f"{self.instance} rank {self.rank}"
