"""Linear-attention layers of hybrid configs: their per-request recurrent state, as vLLM 0.34 keeps it.

Each family's state, from vLLM's ``MambaStateShapeCalculator`` and the layers that use it (one
``MambaSpec`` page per layer and request; per TP rank):

- Gated DeltaNet (Qwen3-Next and Qwen3.5's text model, ``gated_delta_net_state_shape``): a conv state over the q, k and v
  channels, ``[2 * key_dim + value_dim) / tp][d_conv - 1]`` (key_dim = key heads x key head dim,
  value_dim = value heads x value head dim), each of the three sections split over TP on its own
  (``mamba_v2_sharded_weight_loader`` of the conv weight), and a recurrent state
  ``[value_heads / tp][value_head_dim][key_head_dim]``; both in the Mamba cache dtype.
- Kimi Delta Attention (Kimi Linear, ``kda_state_shape``): the same with ``num_heads`` heads of
  ``head_dim`` for q, k and v alike (three equal conv sections) and a recurrent state
  ``[heads / tp][head_dim][head_dim]`` kept in float32 (``kda_state_dtype``'s default).
- MiniMax lightning attention (``linear_attention_state_shape``): no conv state, a recurrent state
  ``[heads / tp][head_dim][head_dim]`` in the Mamba cache dtype. vLLM dropped MiniMax-Text-01 in
  0.23; the spec it would register is still this one.

As kvroute views: the recurrent state is an ``ssm`` view with a "head" of ``[head_dim][d_state]``
elements, the conv state a ``conv`` view of its sections, laid out by ``client.hybrid.MambaLayout``.
Every section and head count must split over TP (vLLM never replicates this state); a TP that does
not is refused here, naming the key, because the engine cannot run it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvroute.client.hybrid import MambaLayout
from kvroute.engines.models.errors import UnsupportedConfig, UnsupportedLayout

# Qwen3.5's text models use vLLM's same QwenGatedDeltaNetAttention (same conv loader and state).
GDN_TYPES = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"})
KDA_TYPES = frozenset({"kimi_linear"})
LIGHTNING_TYPES = frozenset({"minimax", "minimax_text_01", "minimax_m1"})
KDA_STATE_DTYPE = "float32"


@dataclass(frozen=True, slots=True)
class LinearSpec:
    """One family's linear-attention layers and the model-wide shape of their state."""

    family: str  # "gdn" | "kda" | "lightning"
    layer_ids: tuple[int, ...]
    attention_layers: tuple[int, ...]
    heads: int  # recurrent state heads (GDN: value heads)
    head_dim: int  # the state's second dimension (GDN: value head dim)
    d_state: int  # its third (GDN: key head dim)
    sections: tuple[int, ...]  # conv channels of each section, model total; () without conv
    d_conv: int  # conv kernel; 0 without conv
    splits: tuple[tuple[str, int], ...]  # (config key, count) that every TP must divide
    ssm_dtype: str | None = None  # a dtype the recurrent state always has (KDA: float32)

    def layout(self, layer_ids: tuple[int, ...], tp: int, dtype: str) -> MambaLayout:
        """One rank's state layout over ``tp`` ranks; refuses a TP the engine cannot split."""
        for key, count in self.splits:
            if count % tp:
                raise UnsupportedLayout(
                    key,
                    f"{count} do not split over TP {tp}: linear-attention state is never replicated",
                )
        channels = tuple(section // tp for section in self.sections)
        kernel = self.d_conv - 1 if self.sections else 0
        return MambaLayout(
            layer_ids, self.heads // tp, self.head_dim, self.d_state, channels, kernel, dtype,
            self.ssm_dtype,
        )  # fmt: skip


def linear_spec(lm: Mapping[str, Any], num_layers: int) -> LinearSpec | None:
    """The linear-attention state of a GDN, KDA or lightning hybrid, or None for other models."""
    model_type = lm.get("model_type")
    if model_type in GDN_TYPES:
        return _gated_delta_net(lm, num_layers)
    if model_type in KDA_TYPES:
        return _kimi_delta_attention(lm, num_layers)
    if model_type in LIGHTNING_TYPES:
        return _lightning(lm, num_layers)
    return None


def _positive(lm: Mapping[str, Any], key: str) -> int:
    value = lm.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedConfig(key, "is required" if value is None else f"got {value!r}")
    return value


def _split(kinds: list[bool]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(linear layers, full-attention layers) of per-layer flags (True: linear)."""
    linear = tuple(i for i, flag in enumerate(kinds) if flag)
    return linear, tuple(i for i, flag in enumerate(kinds) if not flag)


def _layer_types(lm: Mapping[str, Any], num_layers: int) -> list[bool] | None:
    types = lm.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != num_layers:
        raise UnsupportedConfig("layer_types", f"must list {num_layers} layer types")
    for index, kind in enumerate(types):
        if kind not in ("linear_attention", "full_attention"):
            raise UnsupportedConfig(
                f"layer_types[{index}]", f"{kind!r}: a linear hybrid's layers are "
                "'linear_attention' or 'full_attention'",
            )  # fmt: skip
    return [kind == "linear_attention" for kind in types]


def _gated_delta_net(lm: Mapping[str, Any], num_layers: int) -> LinearSpec:
    kinds = _layer_types(lm, num_layers)
    if kinds is None:  # the published file; Qwen3NextConfig turns it into layer_types
        interval = _positive(lm, "full_attention_interval")
        kinds = [bool((i + 1) % interval) for i in range(num_layers)]
    linear, attention = _split(kinds)
    key_heads = _positive(lm, "linear_num_key_heads")
    value_heads = _positive(lm, "linear_num_value_heads")
    key_dim, value_dim = (
        _positive(lm, "linear_key_head_dim"),
        _positive(lm, "linear_value_head_dim"),
    )
    return LinearSpec(
        "gdn", linear, attention, value_heads, value_dim, key_dim,
        (key_heads * key_dim, key_heads * key_dim, value_heads * value_dim),
        _positive(lm, "linear_conv_kernel_dim"),
        (("linear_num_key_heads", key_heads), ("linear_num_value_heads", value_heads)),
    )  # fmt: skip


def _kimi_delta_attention(lm: Mapping[str, Any], num_layers: int) -> LinearSpec:
    """Kimi Linear: ``linear_attn_config`` (1-based ``kda_layers``, as vLLM's ``is_kda_layer``
    reads it), or the flat keys transformers' KimiLinearConfig writes."""
    nested = lm.get("linear_attn_config")
    if nested is not None and not isinstance(nested, Mapping):
        raise UnsupportedConfig("linear_attn_config", "must be a mapping")
    if nested and "kda_layers" in nested:
        kda = nested["kda_layers"]
        if not isinstance(kda, list) or any(
            isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= num_layers for n in kda
        ):
            raise UnsupportedConfig(
                "linear_attn_config.kda_layers", f"must list layer numbers in [1, {num_layers}]"
            )
        kinds = [i + 1 in kda for i in range(num_layers)]
    else:
        kinds = _layer_types(lm, num_layers) or []
        if not kinds:
            raise UnsupportedConfig("linear_attn_config.kda_layers", "is required")
    linear, attention = _split(kinds)
    if nested:
        heads, head_dim = _positive(nested, "num_heads"), _positive(nested, "head_dim")
        kernel = _positive(nested, "short_conv_kernel_size")
    else:
        heads, head_dim = _positive(lm, "linear_num_heads"), _positive(lm, "linear_head_dim")
        kernel = _positive(lm, "linear_conv_kernel_dim")
    projection = heads * head_dim
    return LinearSpec(
        "kda", linear, attention, heads, head_dim, head_dim, (projection,) * 3, kernel,
        (("linear_attn_config.num_heads", heads),), KDA_STATE_DTYPE,
    )  # fmt: skip


def _lightning(lm: Mapping[str, Any], num_layers: int) -> LinearSpec:
    """MiniMax: ``attn_type_list`` (0 lightning, 1 softmax) of the published checkpoint, else the
    ``layer_types`` of transformers' MiniMaxConfig (the ``-hf`` conversions)."""
    listed = lm.get("attn_type_list")
    if listed is not None:
        if (
            not isinstance(listed, list)
            or len(listed) != num_layers
            or any(kind not in (0, 1) or isinstance(kind, bool) for kind in listed)
        ):
            raise UnsupportedConfig("attn_type_list", f"must list {num_layers} of 0 and 1")
        kinds = [kind == 0 for kind in listed]
    else:
        kinds = _layer_types(lm, num_layers) or []
        if not kinds:
            raise UnsupportedConfig("attn_type_list", "is required")
    linear, attention = _split(kinds)
    heads = _positive(lm, "num_attention_heads")
    head_dim = (
        _positive(lm, "head_dim") if lm.get("head_dim") else _positive(lm, "hidden_size") // heads
    )
    return LinearSpec(
        "lightning", linear, attention, heads, head_dim, head_dim, (), 0,
        (("num_attention_heads", heads),),
    )  # fmt: skip
