"""The MLA contract and its start-up probe, on vLLM 0.34's own cache writes: ``CPU_MLA``'s
``do_kv_cache_update`` (pure torch, runs here) and the GPU backends' ``concat_and_cache_mla``
indexing written out (tests/engines/vllm_world.py). Each backend kvroute knows caches one latent
row per token (kv_c then k_pe); a quantized, padded or unknown one is refused with a message naming
the backend, the expected and the found placement.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.engines import require_vllm

require_vllm()
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # imports vLLM
TOKENS, LORA, ROPE = 16, 512, 64
ROW = LORA + ROPE
BACKENDS = ["CPU_MLA", "AMX_MLA", "TRITON_MLA", "FLASHMLA", "FLASHINFER_MLA", "CUTLASS_MLA",
            "FLASH_ATTN_MLA"]  # fmt: skip


def cpu_mla_write(kv_c: Any, k_pe: Any, cache: Any, slots: Any) -> None:
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    CPUMLAImpl.do_kv_cache_update(None, kv_c, k_pe, cache, slots, "auto", None)  # type: ignore[arg-type]


def strides(layers: int, four_d: bool = True) -> tuple[int, ...]:
    """A cache's strides with ``layers`` layers interleaved in each block (1: layer-outermost)."""
    page = TOKENS * ROW
    return (layers * page, page, ROW, 1) if four_d else (layers * page, ROW, 1)


def found(write: Any, layer_strides: tuple[int, ...], dtype: Any = torch.float32) -> str:
    from kvroute.engines.vllm.latent import probe_latent

    where, _ = probe_latent(write, tokens=TOKENS, lora=LORA, rope=ROPE, dtype=dtype,
                            device="cpu", strides=layer_strides)  # fmt: skip
    return where


def test_every_backend_kvroute_knows_registers_one_replicated_latent_row() -> None:
    from kvroute.engines.vllm.latent import latent_contract
    from kvroute.geometry import Kind

    for backend in BACKENDS:
        layout = latent_contract(backend, "auto", ROW, LORA, ROPE)
        assert (layout.kind, layout.buffers, layout.interior) == (Kind.REPLICATED, 1, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("four_d", [True, False])
def test_cpu_mla_s_own_write_lands_as_the_contract_says(dtype: Any, four_d: bool) -> None:
    from kvroute.engines.vllm.latent import ROW as CONTRACT
    from tests.engines.vllm_world import concat_and_cache_mla

    assert found(cpu_mla_write, strides(1, four_d), dtype) == CONTRACT
    assert found(concat_and_cache_mla, strides(1, four_d), dtype) == CONTRACT
    assert found(concat_and_cache_mla, strides(4, four_d), dtype) == CONTRACT  # block stride kept


def test_cpu_mla_cannot_write_a_block_outermost_cache() -> None:
    """CPU_MLA views a layer's cache as one run of rows: with the layers of a block interleaved
    (BLHNC) the view fails, which the probe reports rather than registering."""
    assert found(cpu_mla_write, strides(4)).startswith("a cache update that fails on it")


def test_other_placements_are_named() -> None:
    def rope_first(kv_c: Any, k_pe: Any, cache: Any, slots: Any) -> None:
        rows = cache.flatten(1, -2)
        rows[slots // TOKENS, slots % TOKENS, :ROPE] = k_pe.squeeze(1)
        rows[slots // TOKENS, slots % TOKENS, ROPE:] = kv_c

    def split(kv_c: Any, k_pe: Any, cache: Any, slots: Any) -> None:
        flat = cache[slots[0] // TOKENS].flatten()
        flat[: TOKENS * LORA] = kv_c.flatten()
        flat[TOKENS * LORA :] = k_pe.flatten()

    def latent_only(kv_c: Any, k_pe: Any, cache: Any, slots: Any) -> None:  # a padded/partial one
        cache.flatten(1, -2)[slots // TOKENS, slots % TOKENS, :LORA] = kv_c

    assert found(rope_first, strides(1)) == "token-major rows of k_pe then kv_c"
    assert found(split, strides(1)) == "all tokens' kv_c, then all tokens' k_pe"
    assert found(latent_only, strides(1)) == f"{TOKENS * LORA} of {TOKENS * ROW} elements written (quantized or dropped)"  # fmt: skip


def layer(backend: str, kv_cache_dtype: str = "auto", write: Any = cpu_mla_write) -> Any:
    """What ``check_latent`` reads of an MLA layer: its backend's name, ranks, cache dtype and
    its impl's ``do_kv_cache_update`` (here CPU_MLA's own, whatever the name)."""
    impl = SimpleNamespace(
        do_kv_cache_update=lambda kv_c, k_pe, cache, slots, dtype, scale: write(
            kv_c, k_pe, cache, slots
        )
    )
    backend_cls = SimpleNamespace(get_name=lambda: backend)
    return SimpleNamespace(attn_backend=backend_cls, kv_lora_rank=LORA, qk_rope_head_dim=ROPE,
                           kv_cache_dtype=kv_cache_dtype, impl=impl, _k_scale=None)  # fmt: skip


def spec(head_size: int = ROW, dtype: Any = torch.float32) -> Any:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(block_size=TOKENS, num_kv_heads=1, head_size=head_size, dtype=dtype)


def cache(layers: int = 1, head_size: int = ROW, dtype: Any = torch.float32) -> Any:
    """Four blocks of a ``[blocks, 1, tokens, row]`` cache, ``layers`` layers interleaved."""
    memory = torch.zeros(4 * layers * TOKENS * head_size, dtype=dtype)
    page = TOKENS * head_size
    return memory.as_strided((4, 1, TOKENS, head_size), (layers * page, page, head_size, 1))


def test_check_latent_accepts_cpu_mla_on_a_layer_outermost_cache() -> None:
    from kvroute.engines.vllm.latent import LATENT, check_latent

    backend, layout, seconds = check_latent(layer("CPU_MLA"), "model.layers.0.self_attn.attn",
                                            cache(), spec())  # fmt: skip
    assert (backend, layout) == ("CPU_MLA", LATENT)
    assert seconds < 5


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("block_outermost", ["CPU_MLA", "token-major rows of kv_c then k_pe",
                             "a cache update that fails on it", '"kv_cache_layout": "LBHNC"']),
        ("fp8", ["FLASHMLA", "kv_cache_dtype fp8", "token-major rows of kv_c then k_pe",
                 "found a quantized cache"]),
        ("fp8_ds_mla", ["FLASHMLA", "fp8_ds_mla", "found a quantized cache"]),
        ("padded", ["TRITON_MLA", "512 + 64 = 576", "found rows of 656"]),
        ("unknown", ["FLASHMLA_SPARSE", "is not one whose latent cache kvroute knows",
                     "token-major rows of kv_c then k_pe", "found an unknown placement"]),
    ],
)  # fmt: skip
def test_refusals_name_backend_expected_and_found(case: str, words: list[str]) -> None:
    from kvroute.engines.vllm.latent import check_latent
    from kvroute.engines.vllm.probe import LayoutProbeError

    arguments = {
        "block_outermost": (layer("CPU_MLA"), cache(layers=4), spec()),
        "fp8": (layer("FLASHMLA", "fp8"), cache(), spec()),
        "fp8_ds_mla": (layer("FLASHMLA", "fp8_ds_mla"), cache(head_size=656), spec(656)),
        "padded": (layer("TRITON_MLA"), cache(head_size=656), spec(656)),
        "unknown": (layer("FLASHMLA_SPARSE"), cache(), spec()),
    }[case]
    with pytest.raises(LayoutProbeError) as refused:
        check_latent(arguments[0], "model.layers.0.self_attn.attn", *arguments[1:])
    for word in words:
        assert word in str(refused.value), (word, str(refused.value))


def test_a_write_elsewhere_than_the_contract_is_refused() -> None:
    from kvroute.engines.vllm.latent import check_latent
    from kvroute.engines.vllm.probe import LayoutProbeError

    def rope_first(kv_c: Any, k_pe: Any, cache: Any, slots: Any) -> None:
        rows = cache.flatten(1, -2)
        rows[slots // TOKENS, slots % TOKENS, :ROPE] = k_pe.squeeze(1)
        rows[slots // TOKENS, slots % TOKENS, ROPE:] = kv_c

    with pytest.raises(LayoutProbeError, match=r"its contract says token-major rows of kv_c then "
                       r"k_pe .* but its cache update wrote token-major rows of k_pe then kv_c"):  # fmt: skip
        check_latent(layer("AMX_MLA", write=rope_first), "l0", cache(), spec())
