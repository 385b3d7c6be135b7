"""Registration documents from configs and layouts against hand-derived byte geometry.

Each expectation is worked out from the config's numbers: bytes per layer of an HND K+V view are
2 x heads per rank x tokens per block x head_dim x element size; MLA rows are kv_lora_rank +
qk_rope_head_dim elements; Mamba2 SSM heads are head_dim x d_state elements and the conv
sections x, B, C hold (heads x head_dim, groups x d_state, groups x d_state) / TP channels of
d_conv - 1 elements. Every document is also parsed and self-checked as the server would.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvroute.engines.models import LayoutError, UnsupportedConfig, UnsupportedLayout, parse_layout
from kvroute.engines.models import rank_documents as documents_of
from kvroute.geometry import RankRegistration
from kvroute.geometry.checks.instance import check_instance
from kvroute.geometry.checks.validate import check_self
from tests.models.configs import spec
from tests.models.test_configs import NEMOTRON_ATTENTION


def documents(
    name: str, layout: str, role: str = "context", draft: str | None = None
) -> list[dict[str, Any]]:
    docs = documents_of(spec(name), parse_layout(layout, role), draft_model=draft and spec(draft))
    admitted: list[RankRegistration] = []
    for rank, doc in enumerate(docs):
        reg = RankRegistration.from_json(doc, deployment="d", instance="i", rank=rank)
        check_self(reg)
        check_instance(reg, admitted)
        admitted.append(reg)
    return docs


def layers(view: dict[str, Any]) -> list[tuple[int, int]]:
    return [(slot["layer"], slot["offset"]) for slot in view["layers"]]


def test_llama_70b_tp8_pp2() -> None:
    docs = documents("llama-3.1-70b", "tp=8,pp=2,tpb=32")
    assert len(docs) == 16
    doc = docs[9]  # pp_rank 1, tp_rank 1
    assert (doc["tp_rank"], doc["pp_rank"], doc["layers_per_stage"]) == (1, 1, [40, 40])
    assert doc["attention"] == {
        "num_kv_heads": 1,
        "head_dim": 128,
        "dtype": "bfloat16",
        "is_mla": False,
    }
    (view,) = doc["views"]
    per_layer = 2 * 1 * 32 * 128 * 2
    assert (view["kind"], view["num_kv_heads"], view["total_kv_heads"]) == ("hnd", 1, 8)
    assert view["bytes_per_layer"] == per_layer == 16384
    assert layers(view) == [(layer, (layer - 40) * per_layer) for layer in range(40, 80)]
    assert doc["pools"][0]["slot_bytes"] == 40 * per_layer


def test_llama_70b_fp8_uneven_split_and_more_ranks_than_heads() -> None:
    doc = documents("llama-3.1-70b", "tp=4,pp=2,split=41/39,tpb=64,dtype=fp8")[0]
    assert doc["layers_per_stage"] == [41, 39]
    assert doc["attention"]["dtype"] == "float8_e4m3fn"
    assert doc["views"][0]["bytes_per_layer"] == 2 * 2 * 64 * 128 * 1
    assert len(doc["views"][0]["layers"]) == 41
    replicated = documents("llama-3.1-70b", "tp=16,tpb=16")[15]  # 8 heads: each on 2 ranks
    assert (replicated["views"][0]["num_kv_heads"], replicated["views"][0]["total_kv_heads"]) == (
        1,
        8,
    )


def test_eagle_draft_sits_on_the_last_stage_with_its_own_view() -> None:
    docs = documents("llama-3.1-70b", "tp=8,pp=2,tpb=32", draft="eagle-llama3-70b")
    assert {doc["num_draft_layers"] for doc in docs} == {1}
    assert all(len(doc["views"]) == 1 for doc in docs[:8])
    _, draft = docs[8]["views"]
    assert (draft["owner"], draft["num_kv_heads"], draft["total_kv_heads"]) == ("draft", 1, 8)
    assert layers(draft) == [(0, 40 * 16384)]
    assert draft["bytes_per_layer"] == 16384
    assert docs[8]["pools"][0]["slot_bytes"] == 41 * 16384


def test_qwen3_and_mha() -> None:
    qwen = documents("qwen3-32b", "tp=2,tpb=16")[1]["views"][0]
    assert (qwen["num_kv_heads"], qwen["bytes_per_layer"], len(qwen["layers"])) == (
        4,
        2 * 4 * 16 * 128 * 2,
        64,
    )
    mha = documents("llama-2-7b", "tp=4,tpb=16")[3]
    assert mha["attention"]["dtype"] == "float16"
    assert (mha["views"][0]["num_kv_heads"], mha["views"][0]["total_kv_heads"]) == (8, 32)
    assert mha["views"][0]["bytes_per_layer"] == 2 * 8 * 16 * 128 * 2


def test_deepseek_v3_mla_with_mtp_and_attention_dp() -> None:
    docs = documents("deepseek-v3", "tp=8,pp=2,tpb=64,mtp=1")
    assert docs[0]["layers_per_stage"] == [31, 30]  # vLLM gives the remainder to the first stage
    last = docs[15]
    assert last["attention"] == {
        "num_kv_heads": 1,
        "head_dim": 576,
        "dtype": "bfloat16",
        "is_mla": True,
    }
    latent, mtp = last["views"]
    row = 64 * 576 * 2
    assert (latent["kind"], latent["roles"], latent["buffers_per_layer"]) == (
        "replicated",
        ["latent"],
        1,
    )
    assert latent["bytes_per_layer"] == row
    assert "num_kv_heads" not in latent
    assert layers(latent) == [(layer, (layer - 31) * row) for layer in range(31, 61)]
    assert (mtp["owner"], layers(mtp)) == ("draft", [(0, 30 * row)])
    dp = documents("deepseek-v3", "tp=8,dp=8,tpb=64", role="generation")
    assert [(doc["attention_dp"], doc["dp_size"], doc["dp_rank"]) for doc in dp] == [
        (True, 8, r) for r in range(8)
    ]


def test_deepseek_v32_index_keys_in_fp8() -> None:
    latent, index = documents("deepseek-v3.2-exp", "tp=4,tpb=64,dtype=fp8")[2]["views"]
    assert latent["bytes_per_layer"] == 64 * 576 * 1
    assert (index["roles"], index["kind"]) == (["index_key"], "replicated")
    assert index["bytes_per_layer"] == 64 * (128 + 4)
    assert layers(index)[0] == (0, 61 * 64 * 576)


def test_gpt_oss_windowed_and_full_views() -> None:
    full, sliding = documents("gpt-oss-120b", "tp=4,tpb=16")[0]["views"]
    per_layer = 2 * 2 * 16 * 64 * 2
    assert "sliding_window" not in full
    assert sliding["sliding_window"] == 128
    assert [layer for layer, _ in layers(full)] == list(range(1, 36, 2))
    assert layers(sliding)[0] == (0, 18 * per_layer)
    assert sliding["bytes_per_layer"] == per_layer


def test_gemma3_every_sixth_layer_is_full() -> None:
    full, sliding = documents("gemma-3-27b", "tp=2,tpb=16")[0]["views"]
    assert [layer for layer, _ in layers(full)] == list(range(5, 62, 6))
    assert (sliding["sliding_window"], sliding["num_kv_heads"], len(sliding["layers"])) == (
        1024,
        8,
        52,
    )


def test_nemotron_h_state_and_attention_share_the_slots() -> None:
    doc = documents("nemotron-h-8b", "tp=2,tpb=32")[1]
    kv, ssm, conv = doc["views"]
    assert [layer for layer, _ in layers(kv)] == list(NEMOTRON_ATTENTION)
    assert kv["bytes_per_layer"] == 2 * 4 * 32 * 128 * 2
    assert (ssm["ssm_bytes_per_head"], ssm["bytes_per_layer"]) == (64 * 128 * 2, 64 * 64 * 128 * 2)
    assert conv["conv_sections"] == [8192 // 2 * 3 * 2, 1024 // 2 * 3 * 2, 1024 // 2 * 3 * 2]
    assert layers(ssm)[0] == (0, 0)
    assert layers(kv)[0] == (7, 0)  # a slot is a block or a state
    assert doc["pools"][0]["slot_bytes"] == 24 * (1048576 + 30720)


def test_jamba_mamba1_channels_as_ssm_heads() -> None:
    kv, ssm, conv = documents("jamba-mini-1.5", "tp=2,pp=2,tpb=16")[2]["views"]
    assert [layer for layer, _ in layers(kv)] == [20, 28]
    assert (ssm["ssm_bytes_per_head"], ssm["bytes_per_layer"]) == (16 * 2, 4096 * 16 * 2)
    assert conv["conv_sections"] == [4096 * 3 * 2]
    assert len(ssm["layers"]) == 14


def test_qwen3_next_gated_deltanet_state() -> None:
    """vLLM's gated_delta_net_state_shape at TP 4: recurrent state [32/4 value heads][128][128],
    conv state [(2 x 16 x 128 + 32 x 128) / 4 channels][3], channels q | k | v split by section."""
    doc = documents("qwen3-next-80b-a3b", "tp=4,tpb=32")[3]
    kv, ssm, conv = doc["views"]
    assert [layer for layer, _ in layers(kv)] == list(range(3, 48, 4))
    assert kv["bytes_per_layer"] == 2 * 1 * 32 * 256 * 2  # 2 KV heads over TP 4: one each
    assert (ssm["ssm_bytes_per_head"], ssm["bytes_per_layer"]) == (128 * 128 * 2, 8 * 128 * 128 * 2)
    assert conv["conv_sections"] == [512 * 3 * 2, 512 * 3 * 2, 1024 * 3 * 2]
    assert len(ssm["layers"]) == len(conv["layers"]) == 36
    assert ssm["dtype"] == conv["dtype"] == "bfloat16"


def test_kimi_linear_kda_state_in_float32_beside_mla() -> None:
    """kda_state_shape at TP 2: recurrent [32/2][128][128] float32, conv three sections of
    32 x 128 / 2 channels of 3 bf16 columns; the MLA layers (4, 8, ..., 24, 27 one-based) one
    replicated 576-element row per token."""
    latent, ssm, conv = documents("kimi-linear-48b-a3b", "tp=2,tpb=64")[0]["views"]
    assert [layer for layer, _ in layers(latent)] == [3, 7, 11, 15, 19, 23, 26]
    assert latent["bytes_per_layer"] == 64 * 576 * 2
    assert (ssm["ssm_bytes_per_head"], ssm["dtype"]) == (128 * 128 * 4, "float32")
    assert ssm["bytes_per_layer"] == 16 * 128 * 128 * 4
    assert (conv["conv_sections"], conv["dtype"]) == ([2048 * 3 * 2] * 3, "bfloat16")


def test_minimax_lightning_state_has_no_conv() -> None:
    """linear_attention_state_shape at TP 8: [64/8 heads][128][128], no conv state."""
    kv, ssm = documents("minimax-text-01", "tp=8,tpb=16")[0]["views"]
    assert [layer for layer, _ in layers(kv)] == list(range(7, 80, 8))
    assert (ssm["ssm_bytes_per_head"], ssm["bytes_per_layer"]) == (128 * 128 * 2, 8 * 128 * 128 * 2)
    assert len(ssm["layers"]) == 70


@pytest.mark.parametrize(
    ("name", "layout", "error", "key"),
    [
        ("qwen3-next-80b-a3b", "tp=32", UnsupportedLayout, "linear_num_key_heads"),
        ("qwen3-next-80b-a3b", "tp=3", UnsupportedLayout, "linear_num_key_heads"),
        ("kimi-linear-48b-a3b", "tp=64", UnsupportedLayout, "linear_attn_config.num_heads"),
        ("minimax-text-01", "tp=128", UnsupportedLayout, "num_attention_heads"),
        ("nemotron-h-8b", "tp=3", UnsupportedLayout, "mamba_num_heads"),
        ("nemotron-h-8b", "tp=16", UnsupportedLayout, "n_groups"),
        ("llama-3.1-70b", "tp=8,mtp=1", UnsupportedConfig, "num_nextn_predict_layers"),
    ],
)
def test_layouts_an_engine_cannot_run_are_refused_by_key(
    name: str, layout: str, error: type[Exception], key: str
) -> None:
    with pytest.raises(error) as refused:
        documents(name, layout)
    assert refused.value.key == key  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "text", ["tp=8,pp=2,split=40/41", "tp=8,dp=3", "tp=x", "tpp=2", "tp=8,dtype=nvfp4"]
)
def test_bad_layouts(text: str) -> None:
    with pytest.raises(LayoutError):
        documents("llama-3.1-70b", text)
