"""Test-side KV layouts, plan fragments and an independent numpy ground truth.

Fragments are written here by straightforward loops over layers, buffers and tokens (not by
``kvroute.geometry``), and the expected receiver bytes are computed by numpy reshapes of whole
blocks into ``[layer, buffer, head, token, byte]`` arrays: two unrelated derivations, so a wrong
offset in either shows up as a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ViewLayout:
    """One view inside a slot: ``layers`` consecutive layer regions starting at ``offset``."""

    kind: str  # "hnd" | "nhd" (a replicated view is laid out like hnd with its own heads)
    layers: int
    heads: int
    offset: int = 0
    buffers: int = 2
    tokens: int = 8
    head_bytes: int = 16  # bytes of one head of one token

    @property
    def buffer_bytes(self) -> int:
        return self.heads * self.tokens * self.head_bytes

    @property
    def layer_bytes(self) -> int:
        return self.buffers * self.buffer_bytes

    @property
    def end(self) -> int:
        return self.offset + self.layers * self.layer_bytes

    def canonical(self, slot: np.ndarray) -> np.ndarray:
        """The view's bytes of one slot as a writable [layer, buffer, head, token, byte] array."""
        region = slot[self.offset : self.end]
        if self.kind == "nhd":
            shape = (self.layers, self.buffers, self.tokens, self.heads, self.head_bytes)
            return region.reshape(shape).transpose(0, 1, 3, 2, 4)
        shape = (self.layers, self.buffers, self.heads, self.tokens, self.head_bytes)
        return region.reshape(shape)


@dataclass(frozen=True)
class HeadCopy:
    """Heads [src_head, src_head + count) of layers [src_layer, +layers) land at dst_head/dst_layer."""

    src: ViewLayout
    dst: ViewLayout
    src_head: int
    dst_head: int
    count: int
    src_layer: int = 0
    dst_layer: int = 0
    layers: int | None = None

    @property
    def num_layers(self) -> int:
        return self.layers if self.layers is not None else self.src.layers


def fragments(copy: HeadCopy) -> list[list[int]]:
    src, dst, width = copy.src, copy.dst, copy.dst.head_bytes
    out = []
    for layer in range(copy.num_layers):
        for buffer in range(src.buffers):
            s = src.offset + (copy.src_layer + layer) * src.layer_bytes + buffer * src.buffer_bytes
            d = dst.offset + (copy.dst_layer + layer) * dst.layer_bytes + buffer * dst.buffer_bytes
            if src.kind == "nhd":
                for token in range(src.tokens):
                    out.append(
                        [
                            s + (token * src.heads + copy.src_head) * width,
                            d + (token * dst.heads + copy.dst_head) * width,
                            copy.count * width,
                        ]
                    )
            else:
                span = src.tokens * width
                out.append([s + copy.src_head * span, d + copy.dst_head * span, copy.count * span])
    return out


def plan_document(
    case: str, peers: dict[int, list[tuple[int, int, HeadCopy]]], silent: tuple[int, ...] = ()
) -> dict[str, Any]:
    """API.md plan JSON: ``peers[rank]`` lists (src_pool, dst_pool, copy); ``silent`` ranks send nothing."""
    docs: list[dict[str, Any]] = [
        {
            "rank": rank,
            "sends": True,
            "views": [
                {
                    "src_view": index,
                    "dst_view": index,
                    "src_pool": src_pool,
                    "dst_pool": dst_pool,
                    "mapper": copy.src.kind,
                    "fragments": fragments(copy),
                }
                for index, (src_pool, dst_pool, copy) in enumerate(copies)
            ],
        }
        for rank, copies in peers.items()
    ]
    docs += [{"rank": rank, "sends": False, "views": []} for rank in silent]
    return {"fingerprint": f"test:{case}", "peers": docs}


def expected_receiver(
    receiver: np.ndarray,
    senders: dict[int, np.ndarray],
    copies: dict[int, list[HeadCopy]],
    slot_stride: dict[str, int],
    blocks: tuple[np.ndarray, np.ndarray],
) -> np.ndarray:
    """Ground truth: the receiver pool after every block pair, computed on whole-slot reshapes."""
    out = receiver.copy()
    for src_block, dst_block in zip(*blocks, strict=True):
        dst_slot = out[dst_block * slot_stride["dst"] :][: slot_stride["dst"]]
        for rank, rank_copies in copies.items():
            src_slot = senders[rank][src_block * slot_stride["src"] :][: slot_stride["src"]]
            for copy in rank_copies:
                src_layers = slice(copy.src_layer, copy.src_layer + copy.num_layers)
                dst_layers = slice(copy.dst_layer, copy.dst_layer + copy.num_layers)
                src_heads = slice(copy.src_head, copy.src_head + copy.count)
                dst_heads = slice(copy.dst_head, copy.dst_head + copy.count)
                copy.dst.canonical(dst_slot)[dst_layers, :, dst_heads] = copy.src.canonical(
                    src_slot
                )[src_layers, :, src_heads]
    return out


def seeded_bytes(seed: int, size: int) -> np.ndarray:
    """The bytes an owner process writes into a segment; the test regenerates them to compare."""
    return np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)
