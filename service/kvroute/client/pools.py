"""Describe a worker's real KV tensors as kvroute pools and views.

A serving engine holds its KV cache as tensors such as ``[num_blocks, layers, 2, heads, tokens,
head_dim]`` (HND) or ``[num_blocks, layers, 2, tokens, heads, head_dim]`` (NHD); kvroute wants slot
strides and byte offsets. Deriving those by hand is where head-count and offset bugs creep in, so
these helpers read them off the tensors (strides, dtype) and hand the per-layer specs to
``kvroute.geometry.registration.builder``, which splits views by owner and head count. A shared pool carves one
uint8 buffer into target and draft regions per block, as engines do for speculative decoding.
torch is imported lazily: the control-plane client installs without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvroute.geometry import DTYPE_BITS, Kind, Owner, Pool
from kvroute.geometry.registration.builder import LayerSpec, build_views
from kvroute.geometry.registration.rendering import render_pool, render_view

if TYPE_CHECKING:
    import torch

KV_BUFFERS = 2  # K and V, back to back in each layer region
DEFAULT_ALIGNMENT = 256  # region starts aligned for vectorised copies and RDMA registration


@dataclass(frozen=True, slots=True)
class KvLayout:
    """One KV tensor's geometry per block: ``num_layers`` layers of K and V buffers."""

    kind: Kind
    num_layers: int
    num_kv_heads: int  # per rank
    tokens_per_block: int
    head_dim: int
    dtype: str  # a kvroute dtype name (``DTYPE_BITS``), e.g. "bfloat16"
    owner: Owner = Owner.TARGET
    first_layer: int = 0  # global id of the first layer in the owner's namespace
    total_kv_heads: int | None = None
    # Global ids of the layers when they are not consecutive (the attention layers of a hybrid).
    layer_ids: tuple[int, ...] | None = None
    sliding_window: int | None = None  # tokens; None is full attention

    def __post_init__(self) -> None:
        if not self.kind.sharded:
            raise ValueError("KvLayout describes head-sharded K/V tensors (hnd or nhd)")
        if DTYPE_BITS.get(self.dtype, 0) < 8:
            raise ValueError(f"dtype {self.dtype!r} is not a whole-byte kvroute dtype")
        if self.layer_ids is not None and len(self.layer_ids) != self.num_layers:
            raise ValueError(f"{len(self.layer_ids)} layer_ids for {self.num_layers} layers")

    def layer_id(self, index: int) -> int:
        """Global id (owner namespace) of the ``index``-th layer of the tensor."""
        return self.first_layer + index if self.layer_ids is None else self.layer_ids[index]

    @property
    def element_bytes(self) -> int:
        return DTYPE_BITS[self.dtype] // 8

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        heads, tokens = self.num_kv_heads, self.tokens_per_block
        inner = (heads, tokens) if self.kind is Kind.HND else (tokens, heads)
        return (self.num_layers, KV_BUFFERS, *inner, self.head_dim)

    @property
    def buffer_bytes(self) -> int:
        return self.num_kv_heads * self.tokens_per_block * self.head_dim * self.element_bytes

    @property
    def layer_bytes(self) -> int:
        return KV_BUFFERS * self.buffer_bytes

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def byte_offset(self, layer: int, kv: int, head: int, token: int) -> int:
        """Offset of element ``[layer, kv, head, token, 0]`` from the start of this region (local ids)."""
        if self.kind is Kind.HND:
            row = head * self.tokens_per_block + token
        else:
            row = token * self.num_kv_heads + head
        return (
            layer * self.layer_bytes
            + kv * self.buffer_bytes
            + row * self.head_dim * self.element_bytes
        )

    def layer_specs(self, pool_id: int, offset: int) -> list[LayerSpec]:
        """The per-layer specs of this region placed at ``offset`` inside a slot."""
        return [
            LayerSpec(
                layer=self.layer_id(index),
                pool_id=pool_id,
                offset=offset + index * self.layer_bytes,
                bytes_per_layer=self.layer_bytes,
                kind=self.kind,
                owner=self.owner,
                num_kv_heads=self.num_kv_heads,
                total_kv_heads=self.total_kv_heads,
                buffers_per_layer=KV_BUFFERS,
                sliding_window=self.sliding_window,
            )
            for index in range(self.num_layers)
        ]

    @classmethod
    def from_tensor(
        cls,
        tensor: torch.Tensor,
        *,
        kind: Kind,
        owner: Owner = Owner.TARGET,
        first_layer: int = 0,
        total_kv_heads: int | None = None,
    ) -> KvLayout:
        """Reads the layout off a 6-D ``[blocks, layers, 2, ...]`` KV tensor."""
        if tensor.dim() != 6 or tensor.shape[2] != KV_BUFFERS:
            raise ValueError(
                f"expected [num_blocks, layers, 2, heads|tokens, tokens|heads, head_dim], got {tuple(tensor.shape)}"
            )
        _, layers, _, a, b, head_dim = tensor.shape
        heads, tokens = (a, b) if kind is Kind.HND else (b, a)
        return cls(
            kind=kind,
            num_layers=layers,
            num_kv_heads=heads,
            tokens_per_block=tokens,
            head_dim=head_dim,
            dtype=dtype_name(tensor),
            owner=owner,
            first_layer=first_layer,
            total_kv_heads=total_kv_heads,
        )


def dtype_name(tensor: torch.Tensor) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPE_BITS:
        raise ValueError(
            f"torch dtype {tensor.dtype} has no kvroute name; known: {sorted(DTYPE_BITS)}"
        )
    return name


@dataclass(frozen=True, slots=True)
class PoolDescription:
    """A pool as a registration declares it, and the layer specs of the views inside it."""

    pool_id: int
    slot_bytes: int
    slot_stride: int
    num_slots: int
    specs: tuple[LayerSpec, ...]
    memory: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """The pool's entry of a registration document, as the server renders a stored one."""
        pool = Pool(self.pool_id, self.slot_bytes, self.slot_stride, self.num_slots, self.memory)
        return render_pool(pool)


def describe_tensor(
    tensor: torch.Tensor,
    *,
    kind: Kind,
    pool_id: int = 0,
    owner: Owner = Owner.TARGET,
    first_layer: int = 0,
    total_kv_heads: int | None = None,
    memory: Mapping[str, Any] | None = None,
) -> PoolDescription:
    """One KV tensor as one pool: a slot is one block; the stride comes from the tensor itself."""
    layout = KvLayout.from_tensor(
        tensor, kind=kind, owner=owner, first_layer=first_layer, total_kv_heads=total_kv_heads
    )
    if not tensor[0].is_contiguous():
        raise ValueError("each block of the KV tensor must be contiguous (a slot is one block)")
    return PoolDescription(
        pool_id=pool_id,
        slot_bytes=layout.block_bytes,
        slot_stride=tensor.stride(0) * tensor.element_size(),
        num_slots=tensor.shape[0],
        specs=tuple(layout.layer_specs(pool_id, 0)),
        memory=memory,
    )


def align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass
class SharedKvPool:
    """One uint8 buffer ``[num_blocks, slot_stride]`` holding several KV regions per block.

    Typical use: the target layers and an Eagle draft layer with another head count in one pool,
    so one block id addresses both. ``tensors[i]`` is region ``i`` as a typed 6-D view.
    """

    layouts: tuple[KvLayout, ...]
    num_blocks: int
    buffer: torch.Tensor
    offsets: tuple[int, ...]
    slot_bytes: int
    slot_stride: int
    tensors: tuple[torch.Tensor, ...] = field(repr=False)

    @classmethod
    def carve(
        cls,
        layouts: Sequence[KvLayout],
        num_blocks: int,
        *,
        buffer: torch.Tensor | None = None,
        alignment: int = DEFAULT_ALIGNMENT,
    ) -> SharedKvPool:
        """Lays the regions out back to back (aligned) and views ``buffer`` (or a new one) as them."""
        import torch

        offsets, end = [], 0
        for layout in layouts:
            start = align(end, max(alignment, layout.element_bytes))
            offsets.append(start)
            end = start + layout.block_bytes
        stride = align(end, alignment)
        if buffer is None:
            buffer = torch.zeros(num_blocks * stride, dtype=torch.uint8)
        if (
            buffer.dtype != torch.uint8
            or not buffer.is_contiguous()
            or buffer.numel() < num_blocks * stride
        ):
            raise ValueError(
                f"buffer must be contiguous uint8 with at least {num_blocks * stride} bytes"
            )
        slots = buffer.reshape(-1)[: num_blocks * stride].view(num_blocks, stride)
        tensors = tuple(
            slots[:, start : start + layout.block_bytes]
            .view(torch_dtype(layout.dtype))
            .view(num_blocks, *layout.block_shape)
            for layout, start in zip(layouts, offsets, strict=True)
        )
        return cls(tuple(layouts), num_blocks, slots, tuple(offsets), end, stride, tensors)

    def describe(
        self, pool_id: int = 0, memory: Mapping[str, Any] | None = None
    ) -> PoolDescription:
        specs = [
            spec
            for layout, start in zip(self.layouts, self.offsets, strict=True)
            for spec in layout.layer_specs(pool_id, start)
        ]
        return PoolDescription(
            pool_id, self.slot_bytes, self.slot_stride, self.num_blocks, tuple(specs), memory
        )


def torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"torch has no dtype {name!r}")
    return dtype


@dataclass(frozen=True, slots=True)
class Parallel:
    """A rank's place in its instance's parallel layout."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    layers_per_stage: tuple[int, ...] | None = None  # default: the target layout's layers, 1 stage
    attention_dp: bool = False
    dp_size: int = 1
    dp_rank: int = 0

    @property
    def rank(self) -> int:
        """kvroute's rank number (without CP): PP-major, as vLLM numbers its workers."""
        return self.pp_rank * self.tp_size + self.tp_rank

    def members(self, num_layers: int | None = None) -> dict[str, Any]:
        """The registration document's parallel members; ``layers_per_stage`` defaults to one
        stage of ``num_layers``."""
        stages = self.layers_per_stage or (num_layers,)
        if None in stages:
            raise ValueError("layers_per_stage or num_layers must be given")
        return {
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank,
            "pp_size": self.pp_size,
            "pp_rank": self.pp_rank,
            "attention_dp": self.attention_dp,
            "dp_size": self.dp_size,
            "dp_rank": self.dp_rank,
            "layers_per_stage": list(stages),
        }


def rank_document(
    *,
    role: str,
    target: KvLayout,
    pools: Sequence[PoolDescription],
    parallel: Parallel = Parallel(),
    num_draft_layers: int = 0,
    lease_seconds: int = 30,
    endpoint: str | None = None,
    nixl_agent_metadata: str | None = None,
    model: Mapping[str, str] | None = None,
    kv_quantization: Mapping[str, Any] | None = None,
    topology: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The registration document (docs/geometry.md); rank-wide attention defaults come from ``target``.

    ``model`` (name, revision, weights and tokenizer digests), ``kv_quantization`` and
    ``topology`` (domain -> value) are written only when given: servers from before them refuse
    unknown members."""
    views = build_views(spec for pool in pools for spec in pool.specs)
    doc: dict[str, Any] = {
        "role": role,
        **parallel.members(target.num_layers),
        "num_draft_layers": num_draft_layers,
        "tokens_per_block": target.tokens_per_block,
        "attention": {
            "num_kv_heads": target.num_kv_heads,
            "head_dim": target.head_dim,
            "dtype": target.dtype,
            "is_mla": False,
        },
        "pools": [pool.to_json() for pool in pools],
        "views": [render_view(view) for view in views],
        "lease_seconds": lease_seconds,
    }
    if endpoint is not None:
        doc["endpoint"] = endpoint
    if nixl_agent_metadata is not None:
        doc["nixl_agent_metadata"] = nixl_agent_metadata
    for key, value in (
        ("model", model),
        ("kv_quantization", kv_quantization),
        ("topology", topology),
    ):
        if value:
            doc[key] = dict(value)
    return doc
