"""What a Hugging Face ``config.json`` says about a model's KV cache, or why kvroute cannot say.

The core reads the config's plain mapping, never a transformers object: the same code then serves a
file read on a workstation and a config pasted into the console, where the server may not have
transformers installed. ``load_config`` (``kvroute.engines.models.source``) hands it
``AutoConfig(...).to_dict()`` when transformers knows the model type, which fills in the class
defaults a published config leaves out (Gemma 3's ``layer_types``, Llama's ``head_dim``); the plain
file otherwise. Where the mapping leaves the cache geometry open (a window without the layers it
applies to, a layer type kvroute does not model), ``UnsupportedConfig`` names the key and the reason:
a guessed geometry would be a wrong registration, which is the failure pre-flight exists to prevent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.engines.models.errors import UnsupportedConfig
from kvroute.engines.models.linear import LinearSpec, linear_spec
from kvroute.engines.models.mamba import MambaSpec, mamba_spec
from kvroute.engines.models.windows import check_engine_runs, rule_windowed
from kvroute.geometry.leaves.limits import MAX_LAYERS

# Keys naming features whose cache kvroute does not model, and why.
UNMODELLED_KEYS: Mapping[str, str] = {
    "attention_chunk_size": "chunked local attention: a receiver needs the tokens from the current "
    "chunk's start, a window kvroute does not model (docs/preflight.md: chunked local attention)",
    "cross_attention_layers": "cross-attention caches encoder states, not per-token KV blocks",
    "kv_lora_rank_per_layer": "per-layer latent ranks give layers of different geometry",
}
# indexed_attention: full attention with sparse-attention indexer keys (DeepSeek-V3.2).
KNOWN_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "indexed_attention"})
DTYPE_NAMES: Mapping[str, str] = {
    "bfloat16": "bfloat16",
    "float16": "float16",
    "float32": "float32",
}
INDEX_SCALE_BLOCK = 128  # the indexer stores one float32 scale per 128 fp8 values of a key


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Attention layers of one cache geometry: their global ids and window (None: full)."""

    layer_ids: tuple[int, ...]
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class Mla:
    """Multi-head latent attention: one replicated latent + rope row per token."""

    kv_lora_rank: int
    qk_rope_head_dim: int

    @property
    def row(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The cache-relevant facts of one model."""

    model_type: str
    num_layers: int  # every decoder block; what layers_per_stage splits
    groups: tuple[AttentionGroup, ...]  # attention layers by window
    num_kv_heads: int  # model total (1 for MLA: the latent)
    head_dim: int  # per KV head; the latent row for MLA
    dtype: str
    mla: Mla | None = None
    index_head_dim: int | None = None  # sparse attention's indexer keys (DeepSeek-V3.2)
    mamba: MambaSpec | LinearSpec | None = None  # recurrent state: Mamba, or linear attention
    mtp_layers: int = 0  # multi-token-prediction layers the config declares

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(sorted(layer for group in self.groups for layer in group.layer_ids))

    @property
    def index_row_bytes(self) -> int:
        """Bytes of one token's indexer key: fp8 values and a float32 scale per 128 of them."""
        assert self.index_head_dim is not None
        return self.index_head_dim + self.index_head_dim // INDEX_SCALE_BLOCK * 4


def language_model(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The decoder's mapping: a multimodal config (Gemma 3) nests it under ``text_config``."""
    text = config.get("text_config")
    if isinstance(text, Mapping):
        inherited = {key: config[key] for key in ("dtype", "torch_dtype") if key in config}
        return {**inherited, **text}
    return config


def model_spec(config: Mapping[str, Any]) -> ModelSpec:
    """The cache facts of ``config`` (a config.json mapping); raises ``UnsupportedConfig``."""
    lm = language_model(config)
    if lm.get("is_encoder_decoder"):
        raise UnsupportedConfig(
            "is_encoder_decoder", "encoder-decoder models have no disaggregated prefill"
        )
    for key, reason in UNMODELLED_KEYS.items():
        if lm.get(key):
            raise UnsupportedConfig(key, reason)
    num_layers = _layer_count(lm)
    mamba = mamba_spec(lm, num_layers) or linear_spec(lm, num_layers)
    attention = _attention_ids(lm, num_layers, mamba)
    mla = _mla(lm)
    heads, head_dim = (1, mla.row) if mla else _gqa_heads(lm)
    return ModelSpec(
        model_type=str(lm.get("model_type") or config.get("model_type") or "unknown"),
        num_layers=num_layers,
        groups=_groups(lm, attention, num_layers),
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=model_dtype(lm),
        mla=mla,
        index_head_dim=_int(lm, "index_head_dim") if lm.get("index_head_dim") else None,
        mamba=mamba,
        mtp_layers=_count(lm, "num_nextn_predict_layers"),
    )


def _layer_count(lm: Mapping[str, Any]) -> int:
    """``num_hidden_layers``; transformers 5 derives Nemotron-H's from ``layers_block_type``."""
    blocks = lm.get("layers_block_type")
    if lm.get("num_hidden_layers") is None and isinstance(blocks, list) and blocks:
        return len(blocks)
    count = _int(lm, "num_hidden_layers")
    if count > MAX_LAYERS:
        raise UnsupportedConfig(
            "num_hidden_layers", f"{count} layers; kvroute registers at most {MAX_LAYERS}"
        )
    return count


def _count(lm: Mapping[str, Any], key: str) -> int:
    """An optional count (absent or null is 0)."""
    value = lm.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LAYERS:
        raise UnsupportedConfig(key, f"must be a count in [0, {MAX_LAYERS}], got {value!r}")
    return value


def _int(lm: Mapping[str, Any], key: str) -> int:
    value = lm.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        reason = "is required" if value is None else f"must be a positive integer, got {value!r}"
        raise UnsupportedConfig(key, reason)
    return value


def model_dtype(lm: Mapping[str, Any]) -> str:
    raw = lm.get("dtype") or lm.get("torch_dtype") or "bfloat16"
    name = str(raw).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise UnsupportedConfig("torch_dtype", f"{name!r} is not one of {sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[name]


def _gqa_heads(lm: Mapping[str, Any]) -> tuple[int, int]:
    """(KV heads, head_dim): MHA configs omit ``num_key_value_heads``; ``head_dim`` defaults to
    hidden_size / num_attention_heads, as the transformers classes of these families define it."""
    query_heads = _int(lm, "num_attention_heads")
    kv_heads = _int(lm, "num_key_value_heads") if lm.get("num_key_value_heads") else query_heads
    if lm.get("head_dim"):
        return kv_heads, _int(lm, "head_dim")
    hidden = _int(lm, "hidden_size")
    if hidden % query_heads:
        raise UnsupportedConfig(
            "head_dim", f"absent, and hidden_size {hidden} is not a multiple of {query_heads} heads"
        )
    return kv_heads, hidden // query_heads


def _mla(lm: Mapping[str, Any]) -> Mla | None:
    if not lm.get("kv_lora_rank"):
        return None
    return Mla(_int(lm, "kv_lora_rank"), _int(lm, "qk_rope_head_dim"))


def _attention_ids(
    lm: Mapping[str, Any], num_layers: int, mamba: MambaSpec | LinearSpec | None
) -> tuple[int, ...]:
    if mamba is None:
        return tuple(range(num_layers))
    return mamba.attention_layers


def _groups(
    lm: Mapping[str, Any], attention: Sequence[int], num_layers: int
) -> tuple[AttentionGroup, ...]:
    """Attention layers split into full and windowed ones: by ``layer_types``, else by the model
    type's rule (``windows``)."""
    window = lm.get("sliding_window")
    types = lm.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise UnsupportedConfig("layer_types", f"must list {num_layers} layer types")
        for index, kind in enumerate(types):
            if index in attention and (not isinstance(kind, str) or kind not in KNOWN_LAYER_TYPES):
                raise UnsupportedConfig(
                    f"layer_types[{index}]",
                    f"{kind!r}: kvroute models {sorted(KNOWN_LAYER_TYPES)} attention layers",
                )
        if "indexed_attention" in types and not lm.get("index_head_dim"):
            raise UnsupportedConfig("index_head_dim", "indexed_attention layers need indexer keys")
        sliding = tuple(i for i in attention if types[i] == "sliding_attention")
        check_engine_runs(lm, sliding, attention, "layer_types")
        if sliding and not window:
            raise UnsupportedConfig("sliding_window", "sliding_attention layers need a window")
    else:
        windowed = rule_windowed(lm, num_layers)
        check_engine_runs(lm, windowed, attention, "sliding_window")
        sliding = tuple(i for i in attention if i in windowed)
    full = tuple(i for i in attention if i not in sliding)
    groups = [AttentionGroup(full)] if full else []
    if sliding:
        groups.append(AttentionGroup(sliding, _int(lm, "sliding_window")))
    return tuple(groups)
