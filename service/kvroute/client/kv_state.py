"""A rank's recurrent state in logical order: per (view, layer, global unit) the bytes of one slot.

A request's state (Mamba2 SSM and conv state, replicated per-request state) lives in one slot per
request, split over the mamba TP (``RankRegistration.state_tp``: the DP group's TP times CP) as the
geometry splits it (``checks.state``). Integrity checks compare it by *logical* unit, so that a
producer at TP2 and a consumer at TP1 name the same bytes alike:

- ``ssm``: one unit per global SSM head (``ssm_bytes_per_head`` bytes; a rank holds the heads of
  ``shard``);
- ``conv``: each section (global bytes: per-rank bytes x mamba TP) cut into ``conv_parts`` equal
  parts, from the section's global size alone, so both sides cut alike whatever their TPs: a rank
  holds the parts inside its share of the section. The count is ``gcd(section, STATE_TP_RADIX)``
  (96: at most 96 parts, not one digest per byte: the cost of a unit is mostly the Python around
  its hash), so every mamba TP dividing 96 (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96) cuts shares
  on part boundaries; under another TP a part a share boundary splits is held whole by no rank,
  and left out;
- replicated per-request state: one unit per layer (identical on every rank).

``read_state`` yields each unit's bytes from the rank's flat uint8 pools; ``place_state`` is its
inverse (the canary's write).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import numpy as np

from kvroute.client.kv_rows import REPLICATED_HEAD, roles_of
from kvroute.geometry import Kind, RankRegistration, View
from kvroute.geometry.checks.state import sections, shard

STATE_TP_RADIX = 2**5 * 3  # mamba TPs (TP x CP) dividing it cut conv sections on part boundaries


class StateKey(NamedTuple):
    """One logical unit of a request's state, named the same on both sides of a transfer."""

    owner: str
    roles: str  # the view's roles, sorted and joined by ","
    kind: str  # "ssm" | "conv" | "replicated"
    layer: int
    section: int  # conv: the section; 0 otherwise
    unit: int  # ssm: global SSM head; conv: part of the section; replicated: REPLICATED_HEAD

    def label(self) -> str:
        if self.kind == "ssm":
            unit = f"SSM head {self.unit}"
        elif self.kind == "conv":
            unit = f"conv section {self.section} part {self.unit}"
        else:
            unit = "replicated state"
        return f"{self.owner} {self.roles} layer {self.layer} {unit}"


class Unit(NamedTuple):
    """Where one logical unit lies in a layer region of a rank's state slot."""

    section: int
    unit: int
    offset: int
    size: int


def state_views(reg: RankRegistration) -> list[View]:
    return [view for view in reg.views if view.is_state]


def conv_parts(section_bytes: int) -> int:
    """How many equal parts a conv section of ``section_bytes`` global bytes is compared in."""
    return math.gcd(section_bytes, STATE_TP_RADIX)


def _kind(view: View) -> str:
    if view.kind is Kind.REPLICATED:
        return "replicated"
    return "ssm" if view.kind is Kind.SSM else "conv"


def units(reg: RankRegistration, view: View) -> list[Unit]:
    """The logical units a rank holds of one layer of a state view, in region order."""
    kind = _kind(view)
    if kind == "replicated":
        return [Unit(0, REPLICATED_HEAD, 0, view.bytes_per_layer)]
    if kind == "ssm":
        size = view.ssm_bytes_per_head or view.bytes_per_layer
        low, high = shard(reg, view.bytes_per_layer // size * reg.state_tp)
        return [Unit(0, head, (head - low) * size, size) for head in range(low, high)]
    found, start = [], 0
    for index, share in enumerate(sections(view)):
        total = share * reg.state_tp
        part = total // conv_parts(total)
        low = reg.state_rank * share  # the share's first byte in the section's global bytes
        for piece in range(-(-low // part), (low + share) // part):
            found.append(Unit(index, piece, start + piece * part - low, part))
        start += share
    return found


def _slot_base(reg: RankRegistration, view: View, slot: int) -> int:
    pool = reg.pools_by_id[view.pool_id]
    if not 0 <= slot < pool.num_slots:
        raise ValueError(f"{reg.label()}: state slot {slot} is outside pool {view.pool_id}")
    return slot * pool.slot_stride


def state_index(reg: RankRegistration, slot: int) -> list[tuple[int, StateKey, int, int]]:
    """(pool id, unit, first byte, end byte) in the pool of each logical unit of ``slot``."""
    found = []
    for view in state_views(reg):
        base, kind, roles = _slot_base(reg, view, slot), _kind(view), roles_of(view)
        owner, held = view.owner.value, units(reg, view)
        for layer, offset in view.layers:
            at = base + offset
            found += [
                (
                    view.pool_id,
                    StateKey(owner, roles, kind, layer, section, unit),
                    at + a,
                    at + a + n,
                )
                for section, unit, a, n in held
            ]
    return found


def read_state(
    reg: RankRegistration, pools: Mapping[int, np.ndarray], slot: int
) -> Iterator[tuple[StateKey, np.ndarray]]:
    """Each logical unit of the request state in ``slot`` as a contiguous uint8 array (a view of
    the pool, not a copy)."""
    for pool, key, first, end in state_index(reg, slot):
        yield key, pools[pool][first:end]


def place_state(
    reg: RankRegistration,
    pools: Mapping[int, np.ndarray],
    slot: int,
    content: Mapping[StateKey, np.ndarray],
) -> None:
    """Writes ``content[key]`` into the units of ``slot``: the inverse of ``read_state``."""
    for key, where in read_state(reg, pools, slot):
        where[:] = content[key]
