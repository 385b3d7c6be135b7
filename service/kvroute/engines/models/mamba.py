"""Recurrent layers of hybrid configs: Mamba2 (Nemotron-H) and Mamba (Jamba).

Which blocks are Mamba, attention or MLP comes from ``hybrid_override_pattern`` (Nemotron-H: ``M``
Mamba, ``*`` attention, ``-`` MLP, ``E`` MoE), ``layers_block_type`` (newer Nemotron-H configs) or
Jamba's ``attn_layer_period``/``attn_layer_offset``. A rank's state is laid out by
``kvroute.client.hybrid``: Mamba2's SSM heads and its x, B, C conv sections split over the TP
ranks. Jamba's Mamba-1 layers have no heads: its SSM state is ``[d_inner][d_state]`` and its conv
state one section ``[d_inner][d_conv - 1]``, both split over TP by channel, so a channel is
registered as an SSM "head" of ``d_state`` elements.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvroute.client.hybrid import MambaLayout, mamba2
from kvroute.engines.models.errors import UnsupportedConfig, UnsupportedLayout

PATTERN_KINDS: Mapping[str, str] = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# ``layers_block_type`` spellings: transformers 5 writes Nemotron-H's Mamba2 blocks as
# linear_attention and its attention blocks as full_attention.
BLOCK_TYPES: Mapping[str, str] = {
    **{kind: kind for kind in PATTERN_KINDS.values()},
    "linear_attention": "mamba",
    "full_attention": "attention",
}


@dataclass(frozen=True, slots=True)
class MambaSpec:
    layer_ids: tuple[int, ...]
    attention_layers: tuple[int, ...]
    heads: int  # Mamba2 SSM heads; Mamba-1: d_inner channels
    head_dim: int  # 1 for Mamba-1
    d_state: int
    groups: int  # Mamba2 B/C groups; 0 for Mamba-1 (no B, C conv sections)
    d_conv: int
    heads_key: str  # the config key that names the heads, for refusals

    def layout(self, layer_ids: tuple[int, ...], tp: int, dtype: str) -> MambaLayout:
        """One rank's state layout over ``tp`` ranks; refuses a TP the heads or groups do not split."""
        if self.heads % tp:
            raise UnsupportedLayout(
                self.heads_key, f"{self.heads} do not split over TP {tp}: state is never replicated"
            )
        if self.groups == 0:
            channels = self.heads // tp
            return MambaLayout(layer_ids, channels, 1, self.d_state, (channels,), self.d_conv - 1, dtype)  # fmt: skip
        if self.groups % tp:
            raise UnsupportedLayout(
                "n_groups", f"{self.groups} B/C groups do not split over TP {tp}"
            )
        return mamba2(
            layer_ids,
            tp_size=tp,
            heads=self.heads,
            head_dim=self.head_dim,
            d_state=self.d_state,
            groups=self.groups,
            d_conv=self.d_conv,
            dtype=dtype,
        )


def _positive(lm: Mapping[str, Any], key: str) -> int:
    value = lm.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedConfig(key, "is required" if value is None else f"got {value!r}")
    return value


def block_kinds(lm: Mapping[str, Any], num_layers: int) -> list[str] | None:
    """Each block's kind (mamba, attention, mlp, moe), or None for a model without Mamba."""
    pattern = lm.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        if len(pattern) != num_layers:
            raise UnsupportedConfig(
                "hybrid_override_pattern", f"has {len(pattern)} blocks, not {num_layers}"
            )
        for index, char in enumerate(pattern):
            if char not in PATTERN_KINDS:
                raise UnsupportedConfig(
                    f"hybrid_override_pattern[{index}]",
                    f"{char!r} is not a block kind kvroute knows ({''.join(PATTERN_KINDS)})",
                )
        return [PATTERN_KINDS[char] for char in pattern]
    types = lm.get("layers_block_type")
    if isinstance(types, list):
        if len(types) != num_layers or any(
            not isinstance(kind, str) or kind not in BLOCK_TYPES for kind in types
        ):
            raise UnsupportedConfig(
                "layers_block_type", f"must list {num_layers} of {sorted(BLOCK_TYPES)}"
            )
        return [BLOCK_TYPES[kind] for kind in types]
    if lm.get("attn_layer_period"):
        period = _positive(lm, "attn_layer_period")
        offset = lm.get("attn_layer_offset", 0)
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
            raise UnsupportedConfig(
                "attn_layer_offset", f"must be in [0, {period}), got {offset!r}"
            )
        return ["attention" if i % period == offset else "mamba" for i in range(num_layers)]
    return None


def mamba_spec(lm: Mapping[str, Any], num_layers: int) -> MambaSpec | None:
    kinds = block_kinds(lm, num_layers)
    if kinds is None:
        return None
    mamba = tuple(i for i, kind in enumerate(kinds) if kind == "mamba")
    attention = tuple(i for i, kind in enumerate(kinds) if kind == "attention")
    if "mamba_d_state" in lm:  # Jamba: Mamba-1 channels
        inner = _positive(lm, "mamba_expand") * _positive(lm, "hidden_size")
        return MambaSpec(
            mamba, attention, inner, 1, _positive(lm, "mamba_d_state"), 0,
            _positive(lm, "mamba_d_conv"), "mamba_expand",
        )  # fmt: skip
    return MambaSpec(
        mamba,
        attention,
        _positive(lm, "mamba_num_heads"),
        _positive(lm, "mamba_head_dim"),
        _positive(lm, "ssm_state_size"),
        _positive(lm, "n_groups"),
        _positive(lm, "conv_kernel"),
        "mamba_num_heads",
    )
