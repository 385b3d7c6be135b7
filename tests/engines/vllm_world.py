"""vLLM's own objects on CPU, built the way an engine builds them: no weights, no GPU.

A model is a hand-written ``config.json`` in a directory; ``VllmConfig`` is built from it with
``DeviceConfig("cpu")``; per-layer ``KVCacheSpec``s are what the model's attention layers would
report; vLLM's planner (``get_kv_cache_configs``) turns them into the ``KVCacheConfig`` and vLLM's
``allocate_kv_cache`` makes the tensors the connector is handed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "rms_norm_eps": 1e-5,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "torch_dtype": "float16",
}


def model_dir(root: Path, name: str, **overrides: Any) -> Path:
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**LLAMA, **overrides}))
    return directory


def vllm_config(
    model: Path,
    *,
    role: str = "kv_producer",
    extra: dict[str, Any] | None = None,
    tp_size: int = 1,
    rank: int = 0,
    block_size: int = 16,
    layout: str = "BLHNC",
    max_model_len: int = 128,
    engine_id: str | None = None,
) -> VllmConfig:
    model_config = ModelConfig(
        model=str(model), dtype="float16", skip_tokenizer_init=True, max_model_len=max_model_len
    )
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cache.kv_cache_layout = layout  # the engine core resolves it before connectors are built
    parallel = ParallelConfig(tensor_parallel_size=tp_size)
    parallel.rank = rank
    config = VllmConfig(
        model_config=model_config,
        cache_config=cache,
        parallel_config=parallel,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=256,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvrouteConnector",
            kv_connector_module_path="kvroute.engines.vllm",
            kv_role=role,
            kv_connector_extra_config=extra or {},
            engine_id=engine_id,  # vLLM's workers share their engine's (None: a new one)
        ),
    )
    return config


def cache_config(
    config: VllmConfig, specs: dict[str, KVCacheSpec], num_blocks: int
) -> KVCacheConfig:
    """vLLM's planner's KVCacheConfig for ``specs``, sized for ``num_blocks`` blocks."""
    groups = get_global_kv_cache_groups(config, [specs])
    page = sum(spec.page_size_bytes for spec in specs.values())
    [kv_cache_config] = get_kv_cache_configs(config, [specs], [page * num_blocks], groups)
    return kv_cache_config


def allocate(config: VllmConfig, kv_cache_config: KVCacheConfig) -> dict[str, torch.Tensor]:
    layout = KVCacheLayout[config.cache_config.kv_cache_layout]
    return allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)


def flash_layouts(vllm_config: Any, layers: list[Any]) -> dict[str, Any]:
    """Attention layouts as the connector's probe finds them on FlashAttention, whose kernels are
    not here: the probe and the contract are kvroute's own, the write is FlashAttention's
    ``reshape_and_cache_flash`` indexing (token ``slot`` of block 0 at ``[0, slot, head, :]``) on
    the backend's own split of the layer tensor (``transpose(1, 2).split(head_size, -1)``)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    from kvroute.engines.vllm.backends import contract, probe_spec
    from kvroute.engines.vllm.layout import attention_layout

    layouts = {}
    for layer in layers:
        spec, tensor = layer.spec, layer.tensor
        if type(spec) is MLAAttentionSpec:
            layouts[layer.name] = latent_layout(spec, tensor)
            continue
        if type(spec) not in (FullAttentionSpec, SlidingWindowSpec):
            continue

        def write(key: Any, value: Any, cache: Any, slots: Any, size: int = spec.head_size) -> None:
            key_cache, value_cache = cache.transpose(1, 2).split(size, dim=-1)
            key_cache[0, slots] = key
            value_cache[0, slots] = value

        found = probe_spec(write, spec, tensor)
        order, _ = attention_layout(tensor, layer.name)
        assert found.layout == contract("FLASH_ATTN", None, spec.head_size, order), found.layout
        layouts[layer.name] = found.layout
    return layouts


def concat_and_cache_mla(kv_c: Any, k_pe: Any, cache: Any, slots: Any) -> None:
    """The GPU MLA backends' ``concat_and_cache_mla`` indexing: token ``slot`` at block
    ``slot // tokens``, row ``slot % tokens``, its kv_c then its k_pe (any block stride)."""
    rows = cache.flatten(1, -2) if cache.dim() == 4 else cache
    tokens, lora = rows.shape[1], kv_c.shape[-1]
    rows[slots // tokens, slots % tokens, :lora] = kv_c
    rows[slots // tokens, slots % tokens, lora:] = k_pe.squeeze(1)


def latent_layout(spec: Any, tensor: Any) -> Any:
    """An MLA layer's layout as the connector's probe finds it through ``concat_and_cache_mla``
    (DeepSeek's 512 + 64 latent row)."""
    from kvroute.engines.vllm.latent import ROW, latent_contract, probe_latent

    found, _ = probe_latent(concat_and_cache_mla, tokens=spec.block_size, lora=512, rope=64,
                                 dtype=tensor.dtype, device=tensor.device,
                                 strides=tuple(tensor.stride()))  # fmt: skip
    assert found == ROW, found
    return latent_contract("FLASHMLA", "auto", spec.head_size, 512, 64)


def _install_flash_probe() -> None:
    import kvroute.engines.vllm.worker as worker

    worker.checked_layouts = flash_layouts


# Every process that builds engines from this module (tests and spawned producers) probes the
# FlashAttention way: there is no model, so no attention layer whose own cache update could run.
_install_flash_probe()
