"""The layout probe: where an attention backend's own cache-write path puts K and V, read back.

Strides do not say what the kernels read: vLLM's CPU backend allocates ``[blocks, heads, tokens,
2 x head_size]`` but keeps, per head, all K rows then all V rows, K transposed or VNNI-packed by
ISA. So before a rank registers, the probe writes every token of a scratch block through the
backend's own write (the call its forward makes), twice: once with values naming (head, K|V,
token), once naming the element. Reading the bytes back gives each element's position, which must
match exactly one layout kvroute can describe (``Layout``); that layout is then compared with what
the backend's contract says (``backends``). Values are bit patterns of normal floats, so no
denormal flushing or NaN canonicalisation can move them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvroute.geometry import HeadOrder, Interior, Kind, Tiling

# write(key, value, cache, slot_mapping): the backend's cache update for tokens [N, H, D].
Write = Callable[[Any, Any, Any, Any], None]
GROUPS = (1, 2, 4, 8, 16)


class LayoutProbeError(RuntimeError):
    """The probe found a layout kvroute cannot describe, or one the contract does not name."""


@dataclass(frozen=True, slots=True)
class Layout:
    """How one block of a layer holds K and V, as kvroute registers it."""

    kind: Kind  # hnd (head-major) or nhd (token-major)
    buffers: int  # 1: K and V side by side in one token row; 2: K tiles, then V tiles
    interior: Interior | None = None

    def describe(self) -> str:
        inside = f", interior {self.interior.to_json()}" if self.interior else ""
        return f"{self.kind.value} with {self.buffers} buffer(s){inside}"

    def same_bytes(self, other: Layout, heads: int) -> bool:
        """Whether both place every element alike in a block of ``heads`` heads. With one head
        (TP equal to the KV heads) head- and token-major rows, and heads outside or inside the
        buffers, are the same bytes: the probe cannot tell them apart, nor need it."""
        return self._canonical(heads) == other._canonical(heads)

    def _canonical(self, heads: int) -> Layout:
        if heads != 1:
            return self
        interior = self.interior
        if interior is not None:
            interior = Interior(HeadOrder.BUFFER_HEAD, interior.tilings)
            interior = None if interior.trivial else interior
        return Layout(Kind.HND, self.buffers, interior)


@dataclass(frozen=True, slots=True)
class Probed:
    layout: Layout
    seconds: float


def probe(
    write: Write,
    *,
    heads: int,
    tokens: int,
    head_size: int,
    dtype: Any,
    device: Any,
    strides: tuple[int, ...] | None = None,
) -> Probed:
    """Writes a scratch block through ``write`` and names the layout the bytes landed in.

    ``strides``: the layer tensor's strides of ``[heads, tokens, K|V]`` (contiguous when None), so
    the scratch block is laid out as a block of the real cache."""
    began = time.perf_counter()
    bits = _BITS.get(str(dtype).removeprefix("torch."))
    if bits is None:
        raise LayoutProbeError(f"the probe cannot encode elements of {dtype}")
    shape = (heads, tokens, 2 * head_size)
    block = (heads * tokens * 2 * head_size, *(strides or (tokens * shape[2], shape[2], 1)))
    where = (shape, block, device)
    who = _positions(write, where, dtype, bits, by_element=False)
    which = _positions(write, where, dtype, bits, by_element=True)
    layout = _fit(who, which, heads, tokens, head_size)
    return Probed(layout, time.perf_counter() - began)


# dtype -> (integer dtype of its width, exponent bits, mantissa bits)
_BITS = {"bfloat16": ("int16", 8, 7), "float16": ("int16", 5, 10), "float32": ("int32", 8, 23)}


def _codes(ids: np.ndarray, exponent: int, mantissa: int, width: int) -> np.ndarray:
    """Distinct normal-float bit patterns for ``ids`` (sign, then mantissa, then exponent)."""
    if ids.max(initial=0) >= _capacity(exponent, mantissa):
        raise LayoutProbeError(f"{ids.max() + 1} probe values do not fit {width}-byte elements")
    sign, rest = ids & 1, ids >> 1
    value = ((rest // (1 << mantissa) + 1) << mantissa) | (rest % (1 << mantissa))
    return (sign << (exponent + mantissa)) | value


def _capacity(exponent: int, mantissa: int) -> int:
    """Distinct normal floats: exponents 1 .. 2^e - 2, every mantissa, both signs."""
    return ((1 << exponent) - 2) * (2 << mantissa)


def _positions(
    write: Write,
    where: tuple[tuple[int, int, int], tuple[int, ...], Any],
    dtype: Any,
    bits: tuple[str, int, int],
    *,
    by_element: bool,
) -> np.ndarray:
    """For each element position of the block page, the id written there (-1: untouched).

    Ids name (head, K|V, token) as ``(head x tokens + token) x 2 + kv``, or the element index."""
    import torch

    (heads, tokens, row), block, device = where
    head_size = row // 2
    name, exponent, mantissa = bits
    itype = getattr(torch, name)
    t, h, d = np.meshgrid(np.arange(tokens), np.arange(heads), np.arange(head_size), indexing="ij")
    key_ids = d if by_element else (h * tokens + t) * 2
    value_ids = d if by_element else (h * tokens + t) * 2 + 1
    if max(heads * tokens * 2, head_size) >= _capacity(exponent, mantissa) - 1:
        raise LayoutProbeError(f"a block of {heads} heads x {tokens} tokens is too large to probe")
    width = torch.empty(0, dtype=dtype).element_size()
    key, value = (
        torch.from_numpy(_codes(ids.astype(np.int64), exponent, mantissa, width).astype(name))
        .view(itype)
        .view(dtype)
        .to(device)
        for ids in (key_ids, value_ids)
    )
    unused = _codes(np.array([_capacity(exponent, mantissa) - 1]), exponent, mantissa, width)
    unused = unused.astype(name)[0]
    memory = torch.full((block[0],), int(unused), dtype=itype, device=device)
    cache = memory.as_strided((1, heads, tokens, row), block).view(dtype)
    write(key, value, cache, torch.arange(tokens, dtype=torch.int64, device=device))
    raw = memory.cpu().numpy().astype(np.int64)
    decoded = _decode(raw, exponent, mantissa)
    decoded[raw == int(unused)] = -1
    return decoded


def _decode(raw: np.ndarray, exponent: int, mantissa: int) -> np.ndarray:
    sign = (raw >> (exponent + mantissa)) & 1
    value = raw & ((1 << (exponent + mantissa)) - 1)
    rest = ((value >> mantissa) - 1) * (1 << mantissa) + (value & ((1 << mantissa) - 1))
    return (rest << 1) | sign


def _fit(who: np.ndarray, which: np.ndarray, heads: int, tokens: int, head_size: int) -> Layout:
    """The one describable layout every element's position agrees with."""
    written = who >= 0
    expected = heads * tokens * 2 * head_size
    if written.sum() != expected:
        raise LayoutProbeError(
            f"the backend wrote {int(written.sum())} elements of a block for {expected} K and V "
            "elements: some were written twice, dropped or transformed (a quantized cache?)"
        )
    position = np.flatnonzero(written)
    kv, rest = who[written] % 2, who[written] // 2
    head, token, element = rest // tokens, rest % tokens, which[written]
    found = (head, kv, token, element, position)
    layout = _match(found, heads, tokens, head_size)
    if layout is not None:
        return layout
    sample = ", ".join(
        f"(head {h}, {'KV'[k]}, token {t}, element {e}) at {p}"
        for h, k, t, e, p in list(zip(*found, strict=True))[:4]
    )
    raise LayoutProbeError(
        f"K and V landed in a layout kvroute cannot describe (first elements: {sample})"
    )


def _match(found: tuple[np.ndarray, ...], heads: int, tokens: int, head_size: int) -> Layout | None:
    """K|V side by side per token row (head- or token-major), else two buffers in either order,
    each buffer's tiling found on its own."""
    head, kv, token, element, position = found
    for kind in (Kind.HND, Kind.NHD):
        major = head * tokens + token if kind is Kind.HND else token * heads + head
        if np.array_equal(position, (major * 2 + kv) * head_size + element):
            return Layout(kind, 1)
    # Simplest first (ungrouped, then fewer pieces), so a layout two tilings describe alike is
    # registered in one spelling, the one the contract names.
    tilings = [
        Tiling(p, g, pieces)
        for g in GROUPS
        if tokens % g == 0
        for p in _divisors(head_size)
        for pieces in (_divisors(head_size // p) if g > 1 else (1,))
    ]
    tile = tokens * head_size
    for order in HeadOrder:
        outer = order is HeadOrder.HEAD_BUFFER
        start = (head * 2 + kv) * tile if outer else (kv * heads + head) * tile
        chosen = []
        for buffer in (0, 1):
            mine = kv == buffer
            at = (start[mine], token[mine], element[mine], position[mine])
            chosen.append(next((t for t in tilings if _tiled(t, at, tokens, head_size)), None))
        if None not in chosen:
            interior = Interior(order, tuple(chosen))  # type: ignore[arg-type]
            return Layout(Kind.HND, 2, None if interior.trivial else interior)
    return None


def _tiled(tiling: Tiling, at: tuple[np.ndarray, ...], tokens: int, head_size: int) -> bool:
    start, token, element, position = at
    chunk = head_size // tiling.planes
    group, piece = tiling.token_group, chunk // tiling.group_planes
    inside = element % chunk
    run = start + (element // chunk) * tokens * chunk + (token // group) * group * chunk
    placed = run + (inside // piece) * group * piece + (token % group) * piece + inside % piece
    return bool(np.array_equal(position, placed))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
