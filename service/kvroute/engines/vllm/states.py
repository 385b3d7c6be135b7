"""A vLLM recurrent-state page (``MambaSpec``) as kvroute state regions: which bytes are what.

vLLM keeps one page per layer and request holding the states of ``MambaSpec.shapes`` back to back
(each ``state_alignment``-aligned in vLLM 0.34, back to back in 0.32), with ``dtypes`` and the family in ``mamba_type``
(``MambaStateShapeCalculator`` in ``vllm/model_executor/layers/mamba/mamba_utils.py``; per TP rank):

- ``MAMBA2``: conv ``[x | B | C][d_conv - 1]`` (x = heads x head_dim channels, B and C the groups'
  d_state channels each), then SSM ``[heads][head_dim][d_state]``.
- ``GDN_ATTN`` (Gated DeltaNet and Kimi Delta Attention): conv ``[q | k | v][d_conv - 1]`` (q and k
  of equal size, v = value heads x value head dim channels), then the recurrent state
  ``[value heads][value head dim][key head dim]``; Kimi's has q, k and v alike.
- ``MAMBA1``: conv ``[d_inner][d_conv - 1]``, then SSM ``[d_inner][d_state]`` (a channel is a "head"
  of d_state elements).
- ``LINEAR`` (MiniMax lightning attention): one recurrent state ``[heads][head_dim][head_dim]``.

Every section is split over TP on its own and each SSM head belongs to one rank, so kvroute
registers the conv state as a ``conv`` region with its sections and the recurrent one as an ``ssm``
region whose head is one ``[head_dim][d_state]`` block. The conv state must be stored channel-major
(``VLLM_SSM_CONV_STATE_LAYOUT=DS``): token-major, a TP section is not one run of bytes. Families
whose page kvroute cannot describe (short conv, ReplaySSM rings, TP-replicated state) are refused
with the spec's own words.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvroute.geometry import DTYPE_BITS, Kind
from kvroute.geometry.registration.builder import LayerSpec

if TYPE_CHECKING:
    from kvroute.engines.vllm.layout import Layer

CONV_ROLES = frozenset({"conv"})
SSM_ROLES = frozenset({"ssm"})
# mamba_type name -> the number of states its page holds (conv + recurrent, or recurrent alone)
STATE_COUNTS = {"MAMBA2": 2, "GDN_ATTN": 2, "MAMBA1": 2, "LINEAR": 1}


def dtype_name(dtype: Any) -> str:
    """kvroute's name of a torch dtype (``torch.bfloat16`` -> ``bfloat16``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BITS:
        raise ValueError(f"KV cache dtype {dtype} has no kvroute name; known: {sorted(DTYPE_BITS)}")
    return name


def state_specs(layer: Layer, conv_dim_first: bool) -> list[tuple[int, LayerSpec]]:
    """(offset inside the layer's page, region) of each state a ``MambaSpec`` page holds."""
    spec = layer.spec
    family = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    shapes = tuple(tuple(shape) for shape in spec.shapes)
    if family not in STATE_COUNTS or len(shapes) != STATE_COUNTS[family] or spec.tp_replicated:
        replicated = " (TP-replicated)" if spec.tp_replicated else ""
        raise ValueError(
            f"layer {layer.name}: {family} state of shapes {shapes}{replicated} is not a state "
            f"kvroute describes (known: {', '.join(f'{k}: {n} states' for k, n in STATE_COUNTS.items())})"
        )
    dtypes = [dtype_name(dtype) for dtype in spec.dtypes]
    recurrent = _recurrent(layer, family, shapes[-1], dtypes[-1])
    if family == "LINEAR":
        return [(0, recurrent)]
    conv = _conv(layer, family, shapes, dtypes[0], conv_dim_first)
    # vLLM 0.34 aligns each state in the page; 0.32's MambaSpec has no alignment: back to back.
    alignment = getattr(spec, "state_alignment", 1)
    aligned = -(-conv.bytes_per_layer // alignment) * alignment
    return [(0, conv), (aligned, recurrent)]


def _recurrent(layer: Layer, family: str, shape: tuple[int, ...], dtype: str) -> LayerSpec:
    """The SSM / recurrent state: a head is everything after the first (per-rank heads) axis."""
    if len(shape) != (2 if family == "MAMBA1" else 3):
        raise ValueError(f"layer {layer.name}: {family} recurrent state of shape {shape}")
    heads, head = shape[0], DTYPE_BITS[dtype] // 8
    for size in shape[1:]:
        head *= size
    return LayerSpec(
        layer.layer_id, 0, 0, heads * head, Kind.SSM, owner=layer.owner, roles=SSM_ROLES,
        buffers_per_layer=1, ssm_bytes_per_head=head, dtype=dtype,
    )  # fmt: skip


def _conv(
    layer: Layer, family: str, shapes: tuple[tuple[int, ...], ...], dtype: str, dim_first: bool
) -> LayerSpec:
    if not dim_first:
        raise ValueError(
            f"layer {layer.name}: the conv state is stored (state_len, dim), which TP cannot "
            "split by channel sections; start vLLM with VLLM_SSM_CONV_STATE_LAYOUT=DS"
        )
    (channels, state_len), recurrent = shapes
    if family == "MAMBA1":
        split: tuple[int, ...] = (channels,)
    else:
        # Mamba2's x and GDN's v are the recurrent state's heads x its second axis.
        wide = recurrent[0] * recurrent[1]
        if channels <= wide or (channels - wide) % 2:
            names = "x|B|C" if family == "MAMBA2" else "q|k|v"
            raise ValueError(
                f"layer {layer.name}: {channels} conv channels do not split as {names}"
            )
        pair = (channels - wide) // 2
        split = (wide, pair, pair) if family == "MAMBA2" else (pair, pair, wide)
    element = DTYPE_BITS[dtype] // 8
    sections = tuple(count * state_len * element for count in split)
    return LayerSpec(
        layer.layer_id, 0, 0, sum(sections), Kind.CONV, owner=layer.owner, roles=CONV_ROLES,
        buffers_per_layer=1, conv_sections=sections, dtype=dtype,
    )  # fmt: skip
