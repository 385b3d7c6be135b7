"""Registrations derived from vLLM's own KV cache objects, against hand-derived expectations.

Every ``KVCacheConfig`` comes from vLLM's planner or is built from vLLM's classes, and every tensor
from vLLM's ``allocate_kv_cache``; the expected numbers are written out by hand from the model
dimensions (heads per rank, page bytes, strides), never computed by the code under test.

vLLM (and the connector, which imports it) is imported by the tests and fixtures that use it, not
at module level: importing it takes tens of seconds, and under pytest-xdist every worker collects
every module, while only the worker running these tests needs it.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest

from kvroute.geometry import Kind, RankRegistration
from tests.engines import require_vllm

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

require_vllm()
torch = pytest.importorskip("torch")

# vLLM's planner and allocator on CPU, after importing vLLM (tens of seconds on its own).
pytestmark = pytest.mark.slow
EXTRA = {"url": "http://127.0.0.1:9", "deployment": "llama", "instance": "prefill0"}


def attn(name: int) -> str:
    return f"model.layers.{name}.self_attn.attn"


@pytest.fixture(scope="module")
def world() -> ModuleType:
    """``tests.engines.vllm_world``: vLLM's own objects on CPU (importing it imports vLLM)."""
    from tests.engines import vllm_world

    return vllm_world


@pytest.fixture(scope="module")
def llama(world: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 KV heads, head size 32, 2 layers."""
    root = tmp_path_factory.mktemp("models")
    return world.model_dir(root, "llama", num_key_value_heads=4, num_hidden_layers=2, head_dim=32)


def dense(heads: int, *, block: int = 16, window: int | None = None) -> FullAttentionSpec:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(
        block_size=block,
        num_kv_heads=heads,
        head_size=32,
        dtype=torch.float16,
        sliding_window=window,
    )


def derive(config, specs, blocks: int = 12):
    from kvroute.engines.vllm.worker import rank_cache
    from tests.engines import vllm_world as world

    kv_cache_config = world.cache_config(config, specs, blocks)
    caches = world.allocate(config, kv_cache_config)
    return rank_cache(config, kv_cache_config, caches), caches


@pytest.mark.parametrize(("tp", "per_rank"), [(1, 4), (2, 2), (4, 1), (8, 1)])
def test_dense_gqa_heads_per_rank_at_each_tp(
    world: ModuleType, llama: Path, tp: int, per_rank: int
) -> None:
    """4 KV heads: TP 1, 2, 4 split them; TP 8 > 4 heads holds one (replicated) head per rank."""
    config = world.vllm_config(llama, tp_size=tp, rank=tp - 1, extra=EXTRA)
    cache, caches = derive(config, {attn(i): dense(per_rank) for i in range(2)})
    document = cache.document
    # A page is heads x 16 tokens x (32 K + 32 V) fp16 elements; BLHNC puts both layers in a block.
    page = per_rank * 16 * 64 * 2
    assert document["tp_size"] == tp
    assert document["tp_rank"] == tp - 1
    assert document["tokens_per_block"] == 16
    assert document["attention"] == {
        "num_kv_heads": per_rank, "head_dim": 32, "dtype": "float16", "is_mla": False,
    }  # fmt: skip
    [pool] = document["pools"]
    assert (pool["slot_bytes"], pool["slot_stride"], pool["num_slots"]) == (2 * page, 2 * page, 12)
    [view] = document["views"]
    assert view["kind"] == "hnd"
    assert view["buffers_per_layer"] == 1
    assert (view["num_kv_heads"], view["total_kv_heads"]) == (per_rank, 4)
    assert view["bytes_per_layer"] == page
    assert view["layers"] == [{"layer": 0, "offset": 0}, {"layer": 1, "offset": page}]
    base = caches[attn(0)].data_ptr()
    assert pool["memory"]["nixl"] == {"address": base, "device": 0, "mem_type": "DRAM"}
    assert caches[attn(1)].data_ptr() == base + page


def test_layer_outermost_token_major_layout(world: ModuleType, llama: Path) -> None:
    """LBNHC (vLLM's default): each layer is its own region, token-major: one pool per layer."""
    from kvroute.engines.vllm.layout import attention_layout

    config = world.vllm_config(llama, tp_size=2, layout="LBNHC", extra=EXTRA)
    cache, caches = derive(config, {attn(i): dense(2) for i in range(2)})
    assert caches[attn(0)].stride() == (2048, 64, 128, 1)  # [B, H, N, C]: N over H
    assert attention_layout(caches[attn(0)], "x") == (Kind.NHD, 1)
    pools, views = cache.document["pools"], cache.document["views"]
    assert [(p["slot_stride"], p["num_slots"]) for p in pools] == [(4096, 12), (4096, 12)]
    assert (
        pools[1]["memory"]["nixl"]["address"] - pools[0]["memory"]["nixl"]["address"] == 12 * 4096
    )
    assert [(v["pool_id"], v["kind"], v["layers"]) for v in views] == [
        (0, "nhd", [{"layer": 0, "offset": 0}]),
        (1, "nhd", [{"layer": 1, "offset": 0}]),
    ]


def test_older_layout_with_a_leading_kv_dimension_is_detected() -> None:
    """[blocks, 2, heads, tokens, head]: K then V in each block, two buffers per layer."""
    from kvroute.engines.vllm.layout import attention_layout

    tensor = torch.zeros(4, 2, 2, 16, 32, dtype=torch.float16)
    assert attention_layout(tensor, "x") == (Kind.HND, 2)
    with pytest.raises(ValueError, match="neither"):
        attention_layout(tensor.permute(1, 0, 2, 3, 4), "x")


def test_sliding_window_layers(world: ModuleType, llama: Path) -> None:
    """Hybrid allocator off: vLLM merges the group's spec (window 64) and keeps every token's
    blocks, so all tokens move; a SlidingWindowSpec group (blocks of the window only) keeps it."""
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )

    from kvroute.engines.vllm.worker import rank_cache

    config = world.vllm_config(llama, extra=EXTRA)
    specs = {attn(0): dense(4), attn(1): dense(4, window=64)}
    kv_cache_config = world.cache_config(config, specs, 12)
    [group] = kv_cache_config.kv_cache_groups
    assert group.kv_cache_spec.sliding_window == 64  # merged: layer 0 is not windowed at all
    caches = world.allocate(config, kv_cache_config)
    [view] = rank_cache(config, kv_cache_config, caches).document["views"]
    assert "sliding_window" not in view
    assert len(view["layers"]) == 2
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=4, head_size=32, dtype=torch.float16, sliding_window=64
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[
            KVCacheTensor(8 * 16384, [attn(0)], layer_stride=8192, block_stride=16384),
            KVCacheTensor(8 * 16384, [attn(1)], layer_stride=8192, block_stride=16384, offset=8192),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec([attn(0)], dense(4)),
            KVCacheGroupSpec([attn(1)], window),
        ],
    )
    caches = world.allocate(config, kv_cache_config)
    cache = rank_cache(config, kv_cache_config, caches)
    windows = {v["layers"][0]["layer"]: v.get("sliding_window") for v in cache.document["views"]}
    assert windows == {0: None, 1: 64}
    assert cache.group_views == {0: {0}, 1: {1}}


def test_mla_latent_is_one_replicated_view(world: ModuleType, tmp_path: Path) -> None:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    model = world.model_dir(
        tmp_path, "mla", num_key_value_heads=1, num_hidden_layers=2, head_dim=32
    )
    config = world.vllm_config(model, tp_size=4, rank=2, extra=EXTRA)
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float16)
    cache, caches = derive(config, {attn(i): spec for i in range(2)})
    assert caches[attn(0)].shape[1:] == (1, 16, 576)
    document = cache.document
    assert document["attention"]["is_mla"] is True
    [view] = document["views"]
    assert view["kind"] == "replicated"
    assert view["roles"] == ["latent"]
    assert view["bytes_per_layer"] == 16 * 576 * 2
    assert "num_kv_heads" not in view


@pytest.mark.parametrize(
    ("tp", "tokens", "peer_tp", "peer_tokens"), [(4, 16, 1, 64), (1, 64, 2, 16)]
)
def test_mla_latents_pair_across_tp_and_block_sizes(
    world: ModuleType, tmp_path: Path, tp: int, tokens: int, peer_tp: int, peer_tokens: int
) -> None:
    """vLLM's MLA caches at any TP (every rank the same latent row) and block size pair as one
    replicated view: one row per token, re-cut by tokens, never split by heads."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from kvroute.geometry.checks.compat import matched_geometries

    model = world.model_dir(tmp_path, "mla", num_key_value_heads=1, num_hidden_layers=2)
    regs = []
    for size, block, rank, role in ((tp, tokens, tp - 1, "kv_producer"),
                                    (peer_tp, peer_tokens, 0, "kv_consumer")):  # fmt: skip
        config = world.vllm_config(model, tp_size=size, rank=rank, block_size=block, extra=EXTRA)
        spec = MLAAttentionSpec(
            block_size=block, num_kv_heads=1, head_size=576, dtype=torch.float16
        )
        cache, _ = derive(config, {attn(i): spec for i in range(2)})
        document = {**cache.document, "role": "context" if role == "kv_producer" else "generation"}
        regs.append(
            RankRegistration.from_json(document, deployment="mla", instance=role, rank=rank)
        )
    [pair] = matched_geometries(regs[0], regs[1])
    assert (pair.mapper, pair.total_heads, pair.local_heads, pair.peer_heads) == (
        "replicated",
        1,
        1,
        1,
    )
    assert (pair.tokens, pair.peer_tokens) == (tokens, peer_tokens)
    assert pair.token_unit == 576 * 2  # one float16 latent row per token


def test_a_draft_layer_lives_in_the_draft_namespace(world: ModuleType, llama: Path) -> None:
    """An Eagle draft layer (vLLM numbers it after the target's) registers as draft layer 0."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    from kvroute.engines.vllm.worker import rank_cache

    config = world.vllm_config(llama, tp_size=2, extra=EXTRA)
    specs = {attn(0): dense(2), attn(1): dense(2)}
    specs[attn(2)] = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=32, dtype=torch.float16, is_draft=True
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[
            KVCacheTensor(8 * 10240, [attn(0), attn(1)], layer_stride=4096, block_stride=10240),
            KVCacheTensor(8 * 10240, [attn(2)], layer_stride=2048, block_stride=10240, offset=8192),
        ],
        kv_cache_groups=[KVCacheGroupSpec([attn(0), attn(1), attn(2)], specs[attn(0)])],
    )
    # One group holds target and draft: the draft's own spec is what its layer reports.
    kv_cache_config.kv_cache_groups[0] = KVCacheGroupSpec(
        [attn(0), attn(1), attn(2)], _per_layer(specs)
    )
    caches = world.allocate(config, kv_cache_config)
    document = rank_cache(config, kv_cache_config, caches).document
    assert document["num_draft_layers"] == 1
    target, draft = document["views"]
    assert (target["owner"], target["num_kv_heads"], target["layers"]) == (
        "target", 2, [{"layer": 0, "offset": 0}, {"layer": 1, "offset": 4096}],
    )  # fmt: skip
    assert (draft["owner"], draft["num_kv_heads"], draft["layers"]) == (
        "draft", 1, [{"layer": 0, "offset": 8192}],
    )  # fmt: skip
    # Target pages: 2 heads x 16 tokens x 64 fp16 = 4096 bytes; the draft's: 1 head, 2048 bytes.
    assert (target["bytes_per_layer"], draft["bytes_per_layer"]) == (4096, 2048)
    assert document["pools"][0]["slot_stride"] == 10240


def _per_layer(specs):
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    return UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs)


def test_mamba_hybrid_state_beside_attention(
    world: ModuleType, llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mamba2 at TP2: 8 heads x 16 head_dim, 1 group x d_state 16, d_conv 4. Per rank the conv
    state holds x = 64 channels and B = C = 8, each 3 columns (DS layout), then the SSM state."""
    from vllm.model_executor.layers.mamba import mamba_utils
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, MambaSpec

    from kvroute.engines.vllm.worker import rank_cache

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    mamba_utils.get_conv_state_layout.cache_clear()
    config = world.vllm_config(llama, tp_size=2, extra=EXTRA)
    conv, ssm = (80, 3), (4, 16, 16)
    page = 80 * 3 * 2 + 4 * 16 * 16 * 2  # 480 + 2048
    mamba = MambaSpec(block_size=16, shapes=(conv, ssm), dtypes=(torch.float16, torch.float16))
    assert mamba.page_size_bytes == page
    kv_cache_config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[
            KVCacheTensor(8 * 4096, [attn(0)], layer_stride=4096, block_stride=4096),
            KVCacheTensor(8 * 4096, ["model.layers.1.mixer"], layer_stride=4096, block_stride=4096),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec([attn(0)], dense(2)),
            KVCacheGroupSpec(["model.layers.1.mixer"], mamba),
        ],
    )
    try:
        caches = world.allocate(config, kv_cache_config)
        cache = rank_cache(config, kv_cache_config, caches)
    finally:
        mamba_utils.get_conv_state_layout.cache_clear()
    [pool] = cache.document["pools"]
    assert pool["slot_stride"] == 4096  # a slot is a KV block or one request's state
    kinds = {v["kind"]: v for v in cache.document["views"]}
    assert kinds["hnd"]["layers"] == [{"layer": 0, "offset": 0}]
    assert kinds["conv"]["conv_sections"] == [64 * 3 * 2, 8 * 3 * 2, 8 * 3 * 2]
    assert kinds["conv"]["layers"] == [{"layer": 1, "offset": 0}]
    assert kinds["ssm"]["ssm_bytes_per_head"] == 16 * 16 * 2
    assert kinds["ssm"]["layers"] == [{"layer": 1, "offset": 480}]
    assert cache.state_groups == {1}


def test_mamba_conv_state_token_major_is_refused(world: ModuleType, llama: Path) -> None:
    from vllm.model_executor.layers.mamba import mamba_utils
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, MambaSpec

    from kvroute.engines.vllm.worker import rank_cache

    mamba_utils.get_conv_state_layout.cache_clear()
    config = world.vllm_config(llama, extra=EXTRA)
    mamba = MambaSpec(block_size=16, shapes=((3, 80), (4, 16, 16)), dtypes=(torch.float16,) * 2)
    kv_cache_config = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[
            KVCacheTensor(4 * 4096, [attn(0)], layer_stride=4096, block_stride=4096),
            KVCacheTensor(4 * 4096, ["model.layers.1.mixer"], layer_stride=4096, block_stride=4096),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec([attn(0)], dense(2)),
            KVCacheGroupSpec(["model.layers.1.mixer"], mamba),
        ],
    )
    caches = world.allocate(config, kv_cache_config)
    with pytest.raises(ValueError, match="VLLM_SSM_CONV_STATE_LAYOUT=DS"):
        rank_cache(config, kv_cache_config, caches)


def _state_cache(
    world: ModuleType, llama: Path, tp: int, mamba, name: str = "model.layers.1.linear_attn"
):  # type: ignore[no-untyped-def]
    """A rank of TP ``tp`` holding attention layer 0 and the state page ``mamba`` of layer 1."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    from kvroute.engines.vllm.worker import rank_cache

    config = world.vllm_config(llama, tp_size=tp, extra=EXTRA)
    stride = -(-mamba.page_size_bytes // 4096) * 4096
    kv_cache_config = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[
            KVCacheTensor(4 * stride, [attn(0)], layer_stride=stride, block_stride=stride),
            KVCacheTensor(4 * stride, [name], layer_stride=stride, block_stride=stride),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec([attn(0)], dense(2)),
            KVCacheGroupSpec([name], mamba),
        ],
    )
    caches = world.allocate(config, kv_cache_config)
    return rank_cache(config, kv_cache_config, caches)


@pytest.fixture
def channel_major(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    from vllm.model_executor.layers.mamba import mamba_utils

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    mamba_utils.get_conv_state_layout.cache_clear()
    yield
    mamba_utils.get_conv_state_layout.cache_clear()


@pytest.mark.usefixtures("channel_major")
def test_gated_deltanet_state_of_qwen3_next(world: ModuleType, llama: Path) -> None:
    """Qwen3-Next's GDN page as vLLM's own calculators shape it at TP 4: conv channels q | k | v of
    16 x 128 / 4, 16 x 128 / 4 and 32 x 128 / 4 (3 columns each), then the recurrent state of
    32 / 4 value heads of [128][128]; the same views pre-flight writes from the config."""
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvroute.engines.models import parse_layout, rank_documents
    from tests.models.configs import spec as model_spec

    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(4, 16, 32, 128, 128, 4)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, "auto")
    mamba = MambaSpec(block_size=16, shapes=shapes, dtypes=dtypes,
                      mamba_type=MambaAttentionBackendEnum.GDN_ATTN)  # fmt: skip
    views = {v["kind"]: v for v in _state_cache(world, llama, 4, mamba).document["views"]}
    assert views["conv"]["conv_sections"] == [512 * 3 * 2, 512 * 3 * 2, 1024 * 3 * 2]
    assert views["conv"]["layers"] == [{"layer": 1, "offset": 0}]
    assert (views["ssm"]["ssm_bytes_per_head"], views["ssm"]["bytes_per_layer"]) == (
        128 * 128 * 2,
        8 * 128 * 128 * 2,
    )
    assert views["ssm"]["layers"] == [{"layer": 1, "offset": 2048 * 3 * 2}]
    preflight = rank_documents(model_spec("qwen3-next-80b-a3b"), parse_layout("tp=4", "context"))
    described = {v["kind"]: v for v in preflight[0]["views"]}
    for kind, key in (("conv", "conv_sections"), ("ssm", "ssm_bytes_per_head"), ("ssm", "dtype")):
        assert described[kind][key] == views[kind][key]


@pytest.mark.usefixtures("channel_major")
def test_kimi_delta_attention_state_is_float32(world: ModuleType, llama: Path) -> None:
    """Kimi Linear's KDA page at TP 2: three equal conv sections of 32 x 128 / 2 channels in the
    model dtype, a float32 recurrent state of 16 heads of [128][128]."""
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    shapes = MambaStateShapeCalculator.kda_state_shape(2, 32, 128, conv_kernel_size=4)
    dtypes = MambaStateDtypeCalculator.kda_state_dtype(torch.bfloat16, "auto")
    mamba = MambaSpec(block_size=16, shapes=shapes, dtypes=dtypes,
                      mamba_type=MambaAttentionBackendEnum.GDN_ATTN)  # fmt: skip
    views = {v["kind"]: v for v in _state_cache(world, llama, 2, mamba).document["views"]}
    assert (views["conv"]["conv_sections"], views["conv"]["dtype"]) == (
        [2048 * 3 * 2] * 3,
        "bfloat16",
    )
    assert (views["ssm"]["ssm_bytes_per_head"], views["ssm"]["dtype"]) == (128 * 128 * 4, "float32")
    assert views["ssm"]["bytes_per_layer"] == 16 * 128 * 128 * 4


@pytest.mark.usefixtures("channel_major")
def test_mamba1_state_of_jamba_matches_preflight(world: ModuleType, llama: Path) -> None:
    """Jamba's Mamba-1 page at TP 2 (d_inner 8192, d_state 16, d_conv 4): one conv section of
    4096 channels, an SSM state of 4096 channels of 16; pre-flight writes the same views."""
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvroute.engines.models import parse_layout, rank_documents
    from tests.models.configs import spec as model_spec

    shapes = MambaStateShapeCalculator.mamba1_state_shape(2, 8192, 16, 4)
    dtypes = MambaStateDtypeCalculator.mamba1_state_dtype(torch.bfloat16, "auto", "auto")
    mamba = MambaSpec(block_size=16, shapes=shapes, dtypes=dtypes,
                      mamba_type=MambaAttentionBackendEnum.MAMBA1)  # fmt: skip
    views = {v["kind"]: v for v in _state_cache(world, llama, 2, mamba).document["views"]}
    assert views["conv"]["conv_sections"] == [4096 * 3 * 2]
    assert (views["ssm"]["ssm_bytes_per_head"], views["ssm"]["bytes_per_layer"]) == (32, 4096 * 32)
    preflight = rank_documents(model_spec("jamba-mini-1.5"), parse_layout("tp=2", "context"))
    described = {v["kind"]: v for v in preflight[0]["views"]}
    for kind, key in (("conv", "conv_sections"), ("ssm", "ssm_bytes_per_head"), ("ssm", "dtype")):
        assert described[kind][key] == views[kind][key]


def test_lightning_attention_state_needs_no_conv_layout(world: ModuleType, llama: Path) -> None:
    """MiniMax lightning attention at TP 8: one recurrent state [64 / 8][128][128], no conv (so
    the conv layout does not matter)."""
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    shapes = MambaStateShapeCalculator.linear_attention_state_shape(64, 8, 128)
    dtypes = MambaStateDtypeCalculator.linear_attention_state_dtype(torch.bfloat16, "auto")
    mamba = MambaSpec(block_size=16, shapes=shapes, dtypes=dtypes,
                      mamba_type=MambaAttentionBackendEnum.LINEAR)  # fmt: skip
    cache = _state_cache(world, llama, 8, mamba)
    [ssm] = [v for v in cache.document["views"] if v["kind"] != "hnd"]
    assert (ssm["kind"], ssm["ssm_bytes_per_head"]) == ("ssm", 128 * 128 * 2)
    assert ssm["layers"] == [{"layer": 1, "offset": 0}]
    assert cache.state_groups == {1}


@pytest.mark.usefixtures("channel_major")
def test_a_state_kvroute_does_not_describe_is_refused(world: ModuleType, llama: Path) -> None:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    shapes = MambaStateShapeCalculator.short_conv_state_shape(2, 1024, 3)
    mamba = MambaSpec(block_size=16, shapes=shapes, dtypes=(torch.bfloat16,),
                      mamba_type=MambaAttentionBackendEnum.SHORT_CONV)  # fmt: skip
    with pytest.raises(ValueError, match="SHORT_CONV state of shapes"):
        _state_cache(world, llama, 2, mamba, name="model.layers.1.conv")


@pytest.mark.parametrize(
    ("kv_role", "role_name", "kvroute_role"),
    [
        ("kv_producer", "SCHEDULER", "context"),
        ("kv_producer", "WORKER", "context"),
        ("kv_consumer", "SCHEDULER", "generation"),
        ("kv_consumer", "WORKER", "generation"),
    ],
)
def test_loaded_through_vllms_factory(
    world: ModuleType, llama: Path, kv_role: str, role_name: str, kvroute_role: str
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvroute.engines.vllm import KvrouteConnector

    role = KVConnectorRole[role_name]
    config = world.vllm_config(llama, role=kv_role, extra=EXTRA)
    kv_cache_config = world.cache_config(config, {attn(i): dense(4) for i in range(2)}, 12)
    connector = KVConnectorFactory.create_connector(config, role, kv_cache_config)
    assert type(connector) is KvrouteConnector
    assert connector.settings.role == kvroute_role
    assert (connector.scheduler is None) is (role == KVConnectorRole.WORKER)
    assert KvrouteConnector.get_required_kvcache_layout(config) == "BLHNC"


def test_a_connector_without_kvroute_settings_does_not_start(
    world: ModuleType, llama: Path
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    config = world.vllm_config(llama, extra={"url": "http://127.0.0.1:9"})
    with pytest.raises(ValueError, match="deployment"):
        KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, None)


def test_identity_and_topology_from_the_extra_config_enter_the_registration(
    world: ModuleType, llama: Path
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    members = {
        "model": {"name": "meta-llama/Llama-3.1-8B", "revision": "945c8663"},
        "kv_quantization": {"kv_dtype": "fp16"},
        "topology": {"zone": "a", "rack": "r1"},
    }
    config = world.vllm_config(llama, role="kv_producer", extra={**EXTRA, **members})
    kv_cache_config = world.cache_config(config, {attn(i): dense(4) for i in range(2)}, 12)
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
    assert connector.settings.registration_members() == members
    cache, _ = derive(config, {attn(i): dense(4) for i in range(2)})
    document = {**cache.document, **connector.settings.registration_members()}
    reg = RankRegistration.from_json(document, deployment="llama", instance="prefill0", rank=0)
    assert reg.model is not None
    assert reg.model.revision == "945c8663"
    assert dict(reg.topology) == members["topology"]
    # Without them the document is what it was (older kvroute servers refuse unknown members).
    plain = KVConnectorFactory.create_connector(
        world.vllm_config(llama, role="kv_producer", extra=EXTRA),
        KVConnectorRole.WORKER,
        kv_cache_config,
    )
    assert plain.settings.registration_members() == {}


def test_the_connector_tells_vllm_034_it_registers_the_cache() -> None:
    """vLLM 0.34 allocates a cache that UCX can register only when the connector says so."""
    from vllm.config.kv_transfer import KVCacheAccess

    from kvroute.engines.vllm import KvrouteConnector

    assert KvrouteConnector.kv_cache_access(None) == KVCacheAccess.REGISTERS


@pytest.mark.parametrize("name", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallelism_is_refused_not_registered_as_whole(
    world: ModuleType, llama: Path, name: str
) -> None:
    """A CP rank holds a share of each request's tokens (vLLM deals them out by
    ``cp_kv_cache_interleave_size``); registered as if it held them all, a consumer would read
    rows its peer never held. Start-up stops with the reason instead."""
    from kvroute.engines.vllm.worker import rank_cache

    config = world.vllm_config(llama, extra=EXTRA, tp_size=2)
    setattr(config.parallel_config, name, 2)
    kv_cache_config = world.cache_config(config, {attn(0): dense(2), attn(1): dense(2)}, 16)
    caches = world.allocate(config, kv_cache_config)
    with pytest.raises(ValueError, match=f"context parallelism \\({name}=2\\) is not supported"):
        rank_cache(config, kv_cache_config, caches)


@pytest.mark.parametrize(
    ("setting", "value", "named"),
    [
        ("data_parallel_size", 2, "data_parallel_size=2"),
        ("data_parallel_rank", 1, "data_parallel_rank=1"),
        # vLLM resets a dense model's DP engines to size 1; the first keeps rank and index 0
        ("engine_id", "decode-a_dp0", "engine_id='decode-a_dp0'"),
    ],
)
def test_data_parallelism_is_refused_not_registered_twice(
    world: ModuleType, llama: Path, setting: str, value: object, named: str
) -> None:
    """Data-parallel engines behind one server share the connector's extra config, so each would
    register the same (instance, rank) from its own cache, and kvroute would take the second as a
    new generation of the first: a consumer could pull another engine's blocks. Start-up stops
    with the reason instead."""
    from kvroute.engines.vllm.worker import rank_cache

    config = world.vllm_config(llama, extra=EXTRA, tp_size=2)
    target = config.kv_transfer_config if setting == "engine_id" else config.parallel_config
    setattr(target, setting, value)
    kv_cache_config = world.cache_config(config, {attn(0): dense(2), attn(1): dense(2)}, 16)
    caches = world.allocate(config, kv_cache_config)
    with pytest.raises(ValueError, match=f"data parallelism \\({re.escape(named)}\\)"):
        rank_cache(config, kv_cache_config, caches)
