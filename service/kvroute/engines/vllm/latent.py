"""What vLLM's latent-attention (MLA) backends cache per token, and the probe that proves it.

An MLA layer caches one latent row per token: ``kv_lora_rank`` elements of the compressed KV
(``kv_c_normed``) then ``qk_rope_head_dim`` of the rotary key (``k_pe``), in ``[blocks, tokens,
row]`` (vLLM 0.34 hands it over as ``[blocks, 1, tokens, row]``). There is no K/V split and no
head axis: every TP rank holds the same row, which kvroute registers as one replicated view. Every
backend named in ``LATENT_ROWS`` writes that row through its ``do_kv_cache_update`` (``CPU_MLA``
by indexing, ``AMX_MLA`` by ``amx_mla_concat_and_cache``, the GPU ones by ``concat_and_cache_mla``)
when the cache is unquantized. A quantized cache (``fp8``, ``fp8_ds_mla``: scales beside or
inside the rows) or a padded row (a head size other than ``kv_lora_rank + qk_rope_head_dim``) is
refused: its bytes are not the latent row kvroute's registration states.

At start-up ``check_latent`` writes a scratch block through the layer's own cache update, twice
(values naming the token, then the element), and compares where the bytes landed with the
contract; a difference stops the engine, naming the backend and both placements.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvroute.engines.vllm.probe import (
    _BITS,
    Layout,
    LayoutProbeError,
    Probed,
    _capacity,
    _codes,
    _decode,
)
from kvroute.geometry import Kind

LATENT_ROWS = frozenset(
    {"CPU_MLA", "AMX_MLA", "TRITON_MLA", "FLASHMLA", "FLASHINFER_MLA", "CUTLASS_MLA",
     "FLASH_ATTN_MLA"}
)  # fmt: skip
LATENT = Layout(Kind.REPLICATED, 1)
ROW = "token-major rows of kv_c then k_pe"


def latent_contract(
    backend: str, kv_cache_dtype: str, head_size: int, lora: int, rope: int
) -> Layout:
    """The layout an MLA backend's kernels read; refuses an unknown backend, a quantized cache
    or a padded row."""
    if backend not in LATENT_ROWS:
        raise LayoutProbeError(
            f"MLA backend {backend} is not one whose latent cache kvroute knows "
            f"({', '.join(sorted(LATENT_ROWS))}); expected {ROW} ({lora} + {rope}), "
            "found an unknown placement; nothing is guessed"
        )
    if kv_cache_dtype != "auto":
        raise LayoutProbeError(
            f"MLA backend {backend} with kv_cache_dtype {kv_cache_dtype}: expected {ROW} "
            f"({lora} + {rope} unquantized elements), found a quantized cache whose rows hold "
            "scales or packed values kvroute's registration does not state. Start vLLM with "
            "--kv-cache-dtype auto"
        )
    if head_size != lora + rope:
        raise LayoutProbeError(
            f"MLA backend {backend}: expected {ROW} of {lora} + {rope} = {lora + rope} "
            f"elements, found rows of {head_size} (padded or packed): refused"
        )
    return LATENT


def probe_latent(
    write: Any, *, tokens: int, lora: int, rope: int, dtype: Any, device: Any,
    strides: tuple[int, ...],
) -> tuple[str, Probed]:  # fmt: skip
    """Writes the second of two scratch blocks through ``write(kv_c, k_pe, cache, slots)`` and
    names where each token's elements landed: ``ROW`` when they are the contract's, else what.

    ``strides``: the layer tensor's (``[blocks, (1,) tokens, row]``): a block-outermost cache
    interleaves layers, so block 1 lies a whole stride of layers after block 0, which a backend
    viewing the cache as one run of rows cannot address (it fails or writes elsewhere)."""
    began = time.perf_counter()
    bits = _BITS.get(str(dtype).removeprefix("torch."))
    if bits is None:
        raise LayoutProbeError(f"the latent probe cannot encode elements of {dtype}")
    row = lora + rope
    shape = (2, tokens, row) if len(strides) == 3 else (2, 1, tokens, row)
    where = (shape, strides, device)
    try:
        token = _landed(write, where, lora, dtype, bits, by_element=False)
        element = _landed(write, where, lora, dtype, bits, by_element=True)
    except (RuntimeError, ValueError, AssertionError) as error:
        return f"a cache update that fails on it ({error})", Probed(LATENT, 0.0)
    found = _placement(token[strides[0] :], element[strides[0] :], tokens, lora, rope)
    if (token[: strides[0]] >= 0).any():
        found = "elements outside the block written"
    return found, Probed(LATENT, time.perf_counter() - began)


def _landed(
    write: Any, where: tuple[tuple[int, ...], tuple[int, ...], Any], lora: int, dtype: Any,
    bits: tuple[str, int, int], *, by_element: bool,
) -> np.ndarray:  # fmt: skip
    """For each element of the scratch, the token (or element) id written there (-1: none)."""
    import torch

    shape, strides, device = where
    tokens, row = shape[-2], shape[-1]
    name, exponent, mantissa = bits
    itype = getattr(torch, name)
    width = torch.empty(0, dtype=dtype).element_size()
    t, e = np.meshgrid(np.arange(tokens), np.arange(row), indexing="ij")
    ids = (e if by_element else t).astype(np.int64)
    values = torch.from_numpy(_codes(ids, exponent, mantissa, width).astype(name))
    values = values.view(itype).view(dtype)
    unused = int(_codes(np.array([_capacity(exponent, mantissa) - 1]), exponent, mantissa, width)
                 .astype(name)[0])  # fmt: skip
    memory = torch.full((strides[0] + tokens * row,), unused, dtype=itype, device=device)
    cache = memory.as_strided(shape, strides).view(dtype)
    kv_c = values[:, :lora].contiguous().to(device)
    k_pe = values[:, lora:].contiguous().unsqueeze(1).to(device)
    write(kv_c, k_pe, cache, torch.arange(tokens, 2 * tokens, dtype=torch.int64, device=device))
    raw = memory.cpu().numpy().astype(np.int64)
    decoded = _decode(raw, exponent, mantissa)
    decoded[raw == unused] = -1
    return decoded


def _placement(token: np.ndarray, element: np.ndarray, tokens: int, lora: int, rope: int) -> str:
    """``ROW`` when element e of token t sits at ``t * row + e``, else what was found."""
    row = lora + rope
    written = token >= 0
    if written.sum() != tokens * row:
        return f"{int(written.sum())} of {tokens * row} elements written (quantized or dropped)"
    position = np.flatnonzero(written)
    t, e = token[written], element[written]
    if np.array_equal(position, t * row + e):
        return ROW
    if np.array_equal(position, t * row + (e + rope) % row):
        return "token-major rows of k_pe then kv_c"
    if np.array_equal(
        position, np.where(e < lora, t * lora + e, tokens * lora + t * rope + e - lora)
    ):
        return "all tokens' kv_c, then all tokens' k_pe"
    sample = ", ".join(
        f"(token {a}, element {b}) at {p}" for a, b, p in list(zip(t, e, position, strict=True))[:4]
    )
    return f"an unknown placement (first elements: {sample})"


def check_latent(layer: Any, name: str, tensor: Any, spec: Any) -> tuple[str, Layout, float]:
    """Probes one MLA layer through its own cache update; raises on any contradiction.
    Returns (backend, layout, probe seconds)."""
    backend = layer.attn_backend.get_name()
    lora, rope = int(layer.kv_lora_rank), int(layer.qk_rope_head_dim)
    expected = latent_contract(backend, str(layer.kv_cache_dtype), spec.head_size, lora, rope)
    if tensor.shape[-1] != spec.head_size or tensor.dim() not in (3, 4):
        raise LayoutProbeError(
            f"layer {name}: MLA backend {backend}: expected {ROW} in [blocks, (1,) tokens, "
            f"{spec.head_size}], found a cache of shape {tuple(tensor.shape)}"
        )

    def write(kv_c: Any, k_pe: Any, cache: Any, slots: Any) -> None:
        layer.impl.do_kv_cache_update(kv_c, k_pe, cache, slots, layer.kv_cache_dtype,
                                      layer._k_scale)  # fmt: skip

    found, probed = probe_latent(write, tokens=spec.block_size, lora=lora, rope=rope,
                                 dtype=tensor.dtype, device=tensor.device,
                                 strides=tuple(tensor.stride()))  # fmt: skip
    if found != ROW:
        raise LayoutProbeError(
            f"layer {name}: MLA backend {backend}: its contract says {ROW} ({lora} + {rope} "
            f"per token), but its cache update wrote {found}{_advice(tensor)}"
        )
    return backend, expected, probed.seconds


def _advice(tensor: Any) -> str:
    """What to change when the layers of a block are interleaved (a block-outermost cache)."""
    page = tensor.shape[-2] * tensor.shape[-1]
    if tensor.stride(0) == page:
        return ""
    return (
        "; its cache interleaves the layers of a block (block-outermost), which this backend "
        'cannot address: ask for a layer-outermost cache ({"kv_cache_layout": "LBHNC"} in '
        "kv_connector_extra_config)"
    )
