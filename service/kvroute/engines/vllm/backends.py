"""What each vLLM attention backend's kernels read inside a block, and the probe that proves it.

The contract of a backend is read from its ``forward`` and cache update, not from the tensor's
strides (which every backend allocates alike): FlashAttention, FlashInfer and Triton split each
token row of ``[blocks, heads, tokens, 2 x head_size]`` into K then V (``transpose(1, 2).split``);
the CPU backend views the same tensor as ``[blocks, heads, 2 x tokens, head_size]`` and splits the
token axis, so each head holds all its K rows then all its V rows, K transposed (``vec``/``vec16``
ISAs: element ``d`` of token ``t`` at K-row ``d``, column ``t``). The ``amx`` ISA (bfloat16 on a
CPU with AMX) packs both for its tile instructions: K as ``[tokens / 16][head_size / 2][16][2]``
(pairs of elements across 16 tokens), V as ``[head_size / 16][tokens / 2][16][2]`` (16 elements
across pairs of tokens); an interior states both as token groups cut into pieces (``Tiling``).

At start-up ``check_layer`` writes a scratch block through the layer's own cache update and
compares where the bytes landed with the contract; any difference stops the engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvroute.engines.vllm.latent import check_latent
from kvroute.engines.vllm.layout import attention_layout
from kvroute.engines.vllm.probe import Layout, LayoutProbeError, Probed, probe
from kvroute.geometry import HeadOrder, Interior, Kind, Tiling

# Under vLLM's logger, whose handlers an engine configures: the lines land in its log.
log = logging.getLogger(f"vllm.{__name__}")

ROW_SPLIT = frozenset({"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "ROCM_ATTN", "FLEX_ATTENTION"})
CPU_TRANSPOSED_K = frozenset({"vec", "vec16"})


@dataclass(frozen=True, slots=True)
class Checked:
    """One attention layer's layout, as its contract names it and its probe found it."""

    backend: str
    layout: Layout
    probe_seconds: float


def contract(
    backend: str, isa: str | None, head_size: int, order: Kind = Kind.HND, element_size: int = 2
) -> Layout:
    """The layout a backend's kernels read (``order``: head- or token-major, as the layer's
    strides place them; ``element_size``: bytes per element of the cache); refuses a backend (or
    ISA) kvroute does not know."""
    if backend in ROW_SPLIT:
        return Layout(order, 1)
    if backend == "CPU_ATTN":
        if isa in CPU_TRANSPOSED_K:
            tilings = (Tiling(planes=head_size), Tiling())
            return Layout(Kind.HND, 2, Interior(HeadOrder.HEAD_BUFFER, tilings))
        if isa == "amx":
            # VNNI tiles pack 4 bytes (two bfloat16 elements): K as packs across 16 tokens, V
            # as 16 elements across as many tokens as a pack holds (vLLM picks amx for bfloat16).
            pack = max(1, 4 // element_size)
            key = Tiling(token_group=16, group_planes=head_size // pack)
            value = Tiling(head_size // 16, pack, 16 if pack > 1 else 1)
            return Layout(Kind.HND, 2, Interior(HeadOrder.HEAD_BUFFER, (key, value)))
        raise LayoutProbeError(
            f"attention backend CPU_ATTN with ISA {isa!r}: kvroute knows the vec, vec16 and amx "
            "layouts; nothing is guessed"
        )
    raise LayoutProbeError(
        f"attention backend {backend} is not one whose cache layout kvroute knows "
        f"({', '.join(sorted(ROW_SPLIT | {'CPU_ATTN'}))}); nothing is guessed"
    )


def probe_spec(write: Any, spec: Any, tensor: Any) -> Probed:
    """The probe of one block shaped as an attention spec, in the layer tensor's dtype, device
    and strides."""
    return probe(
        write,
        heads=spec.num_kv_heads,
        tokens=spec.block_size,
        head_size=spec.head_size,
        dtype=tensor.dtype,
        device=tensor.device,
        strides=tuple(tensor.stride()[1:]),
    )


def check_layer(layer: Any, name: str, tensor: Any, spec: Any) -> Checked:
    """Probes one attention layer through its own cache update; raises on any contradiction."""
    backend = layer.attn_backend.get_name()
    order, _ = attention_layout(tensor, name)
    isa = getattr(layer, "isa", None)
    expected = contract(backend, isa, spec.head_size, order, tensor.element_size())

    def write(key: Any, value: Any, cache: Any, slots: Any) -> None:
        layer.impl.do_kv_cache_update(layer, key, value, cache, slots)

    found = probe_spec(write, spec, tensor)
    if not found.layout.same_bytes(expected, spec.num_kv_heads):
        raise LayoutProbeError(
            f"layer {name}: attention backend {backend} (ISA {isa}): "
            f"its contract says "
            f"{expected.describe()}, but its cache update wrote {found.layout.describe()}"
        )
    # Registered as the contract names it: one name for the backend's layout at any TP.
    return Checked(backend, expected, found.seconds)


def attention_layers(vllm_config: Any, names: list[str], latent: bool = False) -> dict[str, Any]:
    """The model's attention (or MLA) layer objects by name (their backend, impl and ISA)."""
    from vllm.config import get_layers_from_vllm_config

    if latent:
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention

        return dict(get_layers_from_vllm_config(vllm_config, MLAAttention, names))
    from vllm.model_executor.layers.attention import Attention

    return dict(get_layers_from_vllm_config(vllm_config, Attention, names))


def checked_layouts(vllm_config: Any, layers: list[Any]) -> dict[str, Layout]:
    """Each attention layer's probed layout, one probe per distinct (backend, ISA, shape)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    found: dict[tuple[object, ...], Checked] = {}
    layouts = {}
    for latent, types in (
        (False, (FullAttentionSpec, SlidingWindowSpec)),
        (True, (MLAAttentionSpec,)),
    ):
        chosen = [layer for layer in layers if type(layer.spec) in types]
        objects = (
            attention_layers(vllm_config, [layer.name for layer in chosen], latent)
            if chosen
            else {}
        )
        for layer in chosen:
            engine_layer = objects.get(layer.name)
            if engine_layer is None:
                raise LayoutProbeError(f"layer {layer.name}: vLLM has no attention layer to probe")
            layouts[layer.name] = _checked(found, engine_layer, layer, latent).layout
    return layouts


def _checked(
    found: dict[tuple[object, ...], Checked], engine_layer: Any, layer: Any, latent: bool
) -> Checked:
    """The layer's check, probed once per distinct (backend, ISA or cache dtype, shape)."""
    spec, tensor = layer.spec, layer.tensor
    key = (latent, engine_layer.attn_backend.get_name(), getattr(engine_layer, "isa", None),
           getattr(engine_layer, "kv_cache_dtype", None), spec.num_kv_heads, spec.block_size,
           spec.head_size, tensor.dtype, tensor.stride()[1:])  # fmt: skip
    if key not in found:
        if latent:
            found[key] = Checked(*check_latent(engine_layer, layer.name, tensor, spec))
        else:
            found[key] = check_layer(engine_layer, layer.name, tensor, spec)
        checked = found[key]
        log.info("kvroute layout probe: %s (%s): %s in %.0f ms", layer.name, checked.backend,
                 checked.layout.describe(), checked.probe_seconds * 1000)  # fmt: skip
    return found[key]
