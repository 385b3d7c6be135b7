"""Describe a hybrid model's cache: Mamba2 recurrent state beside attention KV, as kvroute views.

A Mamba2 layer keeps, per request, an SSM state ``[heads][head_dim][d_state]`` and a conv state of
channel-major sections ``[channels][d_conv - 1]`` (``x``, ``B`` and ``C``), all split over the TP
ranks by heads and channels. kvroute addresses it by one state slot per request, not by blocks.
``HybridPool`` carves one uint8 buffer whose slots hold either a KV block of the attention layers
or one request's state (both regions start at the slot, as hybrid engines share one page pool),
and describes it as views: ``hnd`` for the attention layers, ``ssm`` and ``conv`` for the state.
torch is imported lazily: the control-plane client installs without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvroute.client.pools import DEFAULT_ALIGNMENT, KvLayout, PoolDescription, align, torch_dtype
from kvroute.geometry import DTYPE_BITS, Kind
from kvroute.geometry.registration.builder import LayerSpec

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class MambaLayout:
    """One rank's Mamba2 state of one request: all layers' SSM regions, then their conv regions."""

    layer_ids: tuple[int, ...]  # global ids of the Mamba layers
    num_heads: int  # SSM heads on this rank
    head_dim: int
    d_state: int
    conv_channels: tuple[int, ...]  # this rank's channels of each conv section (x, B, C)
    conv_kernel: int  # state columns per channel (d_conv - 1)
    dtype: str = "bfloat16"  # the conv state's, and the SSM state's unless ssm_dtype is given
    ssm_dtype: str | None = None  # Kimi's KDA keeps its recurrent state in float32

    def __post_init__(self) -> None:
        for dtype in (self.dtype, self.ssm_dtype or self.dtype):
            if DTYPE_BITS.get(dtype, 0) < 8:
                raise ValueError(f"dtype {dtype!r} is not a whole-byte kvroute dtype")

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def element_bytes(self) -> int:
        return DTYPE_BITS[self.dtype] // 8

    @property
    def state_dtype(self) -> str:
        """The SSM (recurrent) state's dtype."""
        return self.ssm_dtype or self.dtype

    @property
    def ssm_head_bytes(self) -> int:
        return self.head_dim * self.d_state * (DTYPE_BITS[self.state_dtype] // 8)

    @property
    def ssm_layer_bytes(self) -> int:
        return self.num_heads * self.ssm_head_bytes

    @property
    def conv_sections(self) -> tuple[int, ...]:
        """Bytes of each conv section of one layer on this rank."""
        return tuple(c * self.conv_kernel * self.element_bytes for c in self.conv_channels)

    @property
    def conv_layer_bytes(self) -> int:
        return sum(self.conv_sections)

    @property
    def conv_offset(self) -> int:
        """Where the conv regions start, after every layer's SSM region."""
        return self.num_layers * self.ssm_layer_bytes

    @property
    def slot_bytes(self) -> int:
        return self.conv_offset + self.num_layers * self.conv_layer_bytes

    @property
    def ssm_shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_heads, self.head_dim, self.d_state)

    @property
    def conv_shape(self) -> tuple[int, int, int]:
        return (self.num_layers, sum(self.conv_channels), self.conv_kernel)

    def layer_specs(self, pool_id: int, offset: int = 0) -> list[LayerSpec]:
        specs = []
        for index, layer in enumerate(self.layer_ids):
            specs.append(LayerSpec(layer, pool_id, offset + index * self.ssm_layer_bytes,
                                   self.ssm_layer_bytes, Kind.SSM, roles=frozenset({"ssm"}),
                                   buffers_per_layer=1, ssm_bytes_per_head=self.ssm_head_bytes,
                                   dtype=self.state_dtype))  # fmt: skip
            if not self.conv_channels:  # lightning attention keeps no conv state
                continue
            conv = offset + self.conv_offset + index * self.conv_layer_bytes
            specs.append(LayerSpec(layer, pool_id, conv, self.conv_layer_bytes, Kind.CONV,
                                   roles=frozenset({"conv"}), buffers_per_layer=1,
                                   conv_sections=self.conv_sections, dtype=self.dtype))  # fmt: skip
        return specs


@dataclass
class HybridPool:
    """One uint8 buffer ``[num_slots, slot_stride]``: a slot is a KV block or a request's state.

    ``kv``, ``ssm`` and ``conv`` are typed views of every slot: ``kv[block]`` is
    ``[layers, 2, heads, tokens, head_dim]`` (HND), ``ssm[slot]`` ``[layers, heads, head_dim,
    d_state]`` and ``conv[slot]`` ``[layers, channels, d_conv - 1]``.
    """

    kv_layout: KvLayout | None
    mamba: MambaLayout
    num_slots: int
    buffer: torch.Tensor
    slot_bytes: int
    slot_stride: int
    kv: torch.Tensor | None = field(repr=False)
    ssm: torch.Tensor = field(repr=False)
    conv: torch.Tensor = field(repr=False)

    @classmethod
    def carve(
        cls,
        kv: KvLayout | None,
        mamba: MambaLayout,
        num_slots: int,
        *,
        buffer: torch.Tensor | None = None,
        alignment: int = DEFAULT_ALIGNMENT,
    ) -> HybridPool:
        """Views ``buffer`` (or a new one) as slots sized for the larger of a block and a state."""
        import torch

        slot_bytes = max(mamba.slot_bytes, kv.block_bytes if kv is not None else 0)
        stride = align(slot_bytes, alignment)
        if buffer is None:
            buffer = torch.zeros(num_slots * stride, dtype=torch.uint8)
        if buffer.dtype != torch.uint8 or buffer.numel() < num_slots * stride:
            raise ValueError(f"buffer must be uint8 with at least {num_slots * stride} bytes")
        slots = buffer.reshape(-1)[: num_slots * stride].view(num_slots, stride)

        def typed(start: int, size: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
            return slots[:, start : start + size].view(torch_dtype(dtype)).view(num_slots, *shape)

        ssm_bytes = mamba.conv_offset
        conv_bytes = mamba.slot_bytes - ssm_bytes
        return cls(
            kv,
            mamba,
            num_slots,
            slots,
            slot_bytes,
            stride,
            typed(0, kv.block_bytes, kv.dtype, kv.block_shape) if kv is not None else None,
            typed(0, ssm_bytes, mamba.state_dtype, mamba.ssm_shape),
            typed(ssm_bytes, conv_bytes, mamba.dtype, mamba.conv_shape),
        )

    def describe(
        self, pool_id: int = 0, memory: Mapping[str, Any] | None = None
    ) -> PoolDescription:
        specs = self.kv_layout.layer_specs(pool_id, 0) if self.kv_layout is not None else []
        specs += self.mamba.layer_specs(pool_id, 0)
        return PoolDescription(
            pool_id, self.slot_bytes, self.slot_stride, self.num_slots, tuple(specs), memory
        )


def split(total: int, tp_size: int) -> int:
    """Per-rank share of a count split over TP (state is never replicated)."""
    if total % tp_size:
        raise ValueError(f"{total} does not split over TP {tp_size}")
    return total // tp_size


def mamba2(
    layer_ids: tuple[int, ...],
    *,
    tp_size: int,
    heads: int,
    head_dim: int,
    d_state: int,
    groups: int,
    d_conv: int,
    dtype: str = "bfloat16",
) -> MambaLayout:
    """A rank's layout from Mamba2 model dimensions: x has heads x head_dim channels, B and C
    groups x d_state each, all split over TP."""
    inner = heads * head_dim
    channels = (split(inner, tp_size), *(split(groups * d_state, tp_size),) * 2)
    return MambaLayout(
        layer_ids, split(heads, tp_size), head_dim, d_state, channels, d_conv - 1, dtype
    )
