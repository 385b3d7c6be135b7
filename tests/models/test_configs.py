"""Model configs to cache facts: each family's numbers as its published config gives them, the
transformers path agreeing with the plain file where the file is complete, and refusals that name
the key."""

from __future__ import annotations

import pytest

from kvroute.engines.models import UnsupportedConfig, load_config, model_spec, normalize
from kvroute.engines.models.linear import LinearSpec
from tests.models.configs import CONFIGS, path, raw, spec

NEMOTRON_ATTENTION = (7, 18, 29, 40)  # the '*' blocks of hybrid_override_pattern


def test_dense_gqa_and_mha() -> None:
    llama = spec("llama-3.1-70b")
    assert (llama.num_layers, llama.num_kv_heads, llama.head_dim, llama.dtype) == (
        80,
        8,
        128,
        "bfloat16",
    )
    assert [(len(g.layer_ids), g.sliding_window) for g in llama.groups] == [(80, None)]
    qwen = spec("qwen3-32b")  # use_sliding_window false: its sliding_window null means nothing
    assert (qwen.num_layers, qwen.num_kv_heads, qwen.head_dim) == (64, 8, 128)
    mha = spec("llama-2-7b")
    assert (mha.num_kv_heads, mha.head_dim, mha.dtype) == (32, 128, "float16")
    no_kv = raw("llama-2-7b")
    no_kv.pop("num_key_value_heads")
    assert model_spec(no_kv).num_kv_heads == 32  # MHA configs may omit it


def test_mla_index_keys_and_mtp() -> None:
    v3 = spec("deepseek-v3")
    assert v3.mla is not None
    assert (v3.mla.row, v3.num_kv_heads, v3.head_dim) == (576, 1, 576)
    assert (v3.index_head_dim, v3.mtp_layers, v3.num_layers) == (None, 1, 61)
    v32 = spec("deepseek-v3.2-exp")
    assert v32.index_head_dim == 128
    assert v32.index_row_bytes == 132  # fp8 keys + fp32 scale


def test_windows_and_mixed_layer_types() -> None:
    oss = spec("gpt-oss-120b")
    full, sliding = oss.groups
    assert full.layer_ids == tuple(range(1, 36, 2))
    assert full.sliding_window is None
    assert sliding.layer_ids == tuple(range(0, 36, 2))
    assert sliding.sliding_window == 128
    gemma = spec("gemma-3-27b")  # transformers fills in layer_types: every sixth layer is full
    full, sliding = gemma.groups
    assert full.layer_ids == tuple(range(5, 62, 6))
    assert len(sliding.layer_ids) == 52
    assert sliding.sliding_window == 1024
    assert (gemma.num_kv_heads, gemma.head_dim, gemma.num_layers) == (16, 128, 62)


def test_mamba_hybrids() -> None:
    nemotron = spec("nemotron-h-8b")
    assert nemotron.attention_layers == NEMOTRON_ATTENTION
    assert nemotron.mamba is not None
    assert len(nemotron.mamba.layer_ids) == 24
    assert (nemotron.mamba.heads, nemotron.mamba.head_dim, nemotron.mamba.d_state) == (128, 64, 128)
    assert (nemotron.mamba.groups, nemotron.mamba.d_conv) == (8, 4)
    jamba = spec("jamba-mini-1.5")
    assert jamba.attention_layers == (4, 12, 20, 28)
    assert jamba.mamba is not None
    assert len(jamba.mamba.layer_ids) == 28
    assert (jamba.mamba.heads, jamba.mamba.head_dim, jamba.mamba.d_state) == (8192, 1, 16)


def test_linear_attention_hybrids() -> None:
    """Which layers are linear and the state's model-wide shape, from each family's keys."""
    qwen = spec("qwen3-next-80b-a3b")  # full attention every 4th layer
    assert qwen.attention_layers == tuple(range(3, 48, 4))
    assert (qwen.num_kv_heads, qwen.head_dim) == (2, 256)
    gdn = qwen.mamba
    assert isinstance(gdn, LinearSpec)
    assert len(gdn.layer_ids) == 36
    assert (gdn.heads, gdn.head_dim, gdn.d_state, gdn.d_conv) == (32, 128, 128, 4)
    assert gdn.sections == (16 * 128, 16 * 128, 32 * 128)
    kimi = spec("kimi-linear-48b-a3b")  # kda_layers are one-based
    assert kimi.attention_layers == (3, 7, 11, 15, 19, 23, 26)
    assert kimi.mla is not None
    assert kimi.mla.row == 576
    assert isinstance(kimi.mamba, LinearSpec)
    assert (kimi.mamba.sections, kimi.mamba.ssm_dtype) == ((4096,) * 3, "float32")
    minimax = spec("minimax-text-01")  # attn_type_list: 0 lightning, 1 softmax
    assert minimax.attention_layers == tuple(range(7, 80, 8))
    assert isinstance(minimax.mamba, LinearSpec)
    assert minimax.mamba.sections == ()
    assert (minimax.num_kv_heads, minimax.head_dim) == (8, 128)
    text = {**raw("qwen3-next-80b-a3b"), "model_type": "qwen3_5_moe_text"}  # Qwen3.5's nesting
    nested = spec({"model_type": "qwen3_5_moe", "text_config": text})
    assert (nested.mamba, nested.groups) == (qwen.mamba, qwen.groups)
    types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 12
    listed = {**raw("qwen3-next-80b-a3b"), "layer_types": types}
    listed.pop("full_attention_interval")
    assert spec(listed) == qwen


@pytest.mark.parametrize(
    "name", sorted(p.stem for p in CONFIGS.glob("*.json") if p.stem != "gemma-3-27b")
)
def test_autoconfig_and_the_plain_file_agree(name: str) -> None:
    """Where the published file names every cache key, transformers' defaults change nothing."""
    assert model_spec(load_config(path(name))) == model_spec(raw(name))


def test_a_window_without_its_layers_is_refused_not_guessed() -> None:
    with pytest.raises(UnsupportedConfig) as refused:
        model_spec(raw("gemma-3-27b"))  # the plain file: no layer_types, the class default unknown
    assert refused.value.key == "sliding_window"
    with pytest.raises(UnsupportedConfig) as refused:  # a model type without a known rule
        model_spec({**raw("mistral-7b-v0.1"), "model_type": "starcoder2"})
    assert refused.value.key == "sliding_window"
    assert "'starcoder2' has no rule" in refused.value.reason


def _windows(mapping: dict[str, object]) -> list[tuple[tuple[int, ...], int | None]]:
    return [(g.layer_ids, g.sliding_window) for g in model_spec(mapping).groups]


@pytest.mark.parametrize("transformers", [False, True])
def test_windows_without_layer_types_follow_the_model_types_rule(transformers: bool) -> None:
    """vLLM's rule (its CacheConfig.sliding_window on every layer built without one of its own),
    read from the plain file and from transformers' class alike."""
    read = normalize if transformers else dict
    mistral = raw("mistral-7b-v0.1")  # MistralConfig has no layer_types: every layer
    assert _windows(read(mistral)) == [(tuple(range(32)), 4096)]
    mixtral = {**mistral, "model_type": "mixtral", "num_local_experts": 8}
    assert _windows(read(mixtral)) == [(tuple(range(32)), 4096)]
    assert _windows(read({**mixtral, "sliding_window": None})) == [(tuple(range(32)), None)]
    qwen = raw("qwen2.5-7b")  # use_sliding_window false: its sliding_window means nothing
    assert _windows(read(qwen)) == [(tuple(range(28)), None)]
    every = {**qwen, "use_sliding_window": True, "max_window_layers": 0}
    assert _windows(read(every)) == [(tuple(range(28)), 131072)]
    none = {**qwen, "use_sliding_window": True, "max_window_layers": 28}
    assert _windows(read(none)) == [(tuple(range(28)), None)]


@pytest.mark.parametrize("transformers", [False, True])
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "qwen2_moe"])
def test_a_qwen_window_on_some_layers_is_refused(transformers: bool, model_type: str) -> None:
    """transformers windows layers from max_window_layers on (Qwen2-MoE: the even ones below it);
    vLLM's Qwen2 refuses to start, its Qwen3 and Qwen2-MoE keep every token: no cache to predict."""
    read = normalize if transformers else dict
    mapping = {**raw("qwen2.5-7b"), "model_type": model_type, "use_sliding_window": True}
    with pytest.raises(UnsupportedConfig) as refused:
        model_spec(read({**mapping, "max_window_layers": 20}))
    assert refused.value.key == "max_window_layers"
    assert "of 28 attention layers" in refused.value.reason


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"layer_types": ["linear_attention"] * 80}, "layer_types[0]"),
        ({"model_type": "qwen3_next", "full_attention_interval": 4}, "linear_num_key_heads"),
        ({"model_type": "qwen3_next", "layer_types": ["mamba"] * 80}, "layer_types[0]"),
        ({"model_type": "kimi_linear", "linear_attn_config": 4}, "linear_attn_config"),
        ({"model_type": "minimax_text_01", "attn_type_list": [0] * 79}, "attn_type_list"),
        ({"attention_chunk_size": 8192}, "attention_chunk_size"),
        ({"is_encoder_decoder": True}, "is_encoder_decoder"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"torch_dtype": "int8"}, "torch_dtype"),
        (
            {"hybrid_override_pattern": "M" * 79 + "X", "mamba_num_heads": 8},
            "hybrid_override_pattern[79]",
        ),
    ],
)
def test_what_kvroute_does_not_model_is_refused_by_key(change: dict[str, object], key: str) -> None:
    with pytest.raises(UnsupportedConfig) as refused:
        model_spec({**raw("llama-3.1-70b"), **change})
    assert refused.value.key == key
