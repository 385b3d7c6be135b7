"""The layout probe against cache writes written out here: vLLM's CPU ``vec`` layout (per head,
K transposed, then V), at one and at two KV heads per rank, and its ``amx`` tiles (bfloat16).

With one head per rank (TP equal to the KV heads) "heads outside the buffers" and "heads inside"
are the same bytes; the probe finds the first and must accept the contract's second, as the real
TP2 engines of tests/realpd showed when it did not.
"""

from __future__ import annotations

import pytest

from tests.engines import require_vllm

require_vllm()
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # imports vLLM (the connector package)
TOKENS, HEAD_SIZE = 32, 16


def cpu_vec_write(key, value, cache, slots) -> None:  # type: ignore[no-untyped-def]
    """K element d of token t at row d, column t of its head's K tile; then the head's V rows."""
    _, heads, tokens, row = cache.shape
    flat = cache.as_strided((heads * tokens * row,), (1,))
    tile = tokens * row // 2
    for h in range(heads):
        for t, slot in enumerate(slots.tolist()):
            for d in range(row // 2):
                flat[h * 2 * tile + d * tokens + slot] = key[t, h, d]
                flat[h * 2 * tile + tile + slot * (row // 2) + d] = value[t, h, d]


def cpu_amx_write(key, value, cache, slots) -> None:  # type: ignore[no-untyped-def]
    """Per head, K as [tokens / 16][head_size / 2][16][2] (element pairs across 16 tokens), then V
    as [head_size / 16][tokens / 2][16][2] (16 elements across pairs of tokens)."""
    _, heads, tokens, row = cache.shape
    size = row // 2
    flat = cache.as_strided((heads * tokens * row,), (1,))
    tile = tokens * size
    for h in range(heads):
        k_at, v_at = h * 2 * tile, h * 2 * tile + tile
        for t, slot in enumerate(slots.tolist()):
            for d in range(size):
                k = (slot // 16) * 16 * size + (d // 2) * 32 + (slot % 16) * 2 + d % 2
                v = (d // 16) * tokens * 16 + (slot // 2) * 32 + (d % 16) * 2 + slot % 2
                flat[k_at + k] = key[t, h, d]
                flat[v_at + v] = value[t, h, d]


def test_the_amx_tiles_match_the_cpu_contract_exactly() -> None:
    from kvroute.engines.vllm.backends import contract
    from kvroute.engines.vllm.probe import probe
    from kvroute.geometry import Tiling

    found = probe(cpu_amx_write, heads=2, tokens=TOKENS, head_size=HEAD_SIZE,
                  dtype=torch.bfloat16, device="cpu").layout  # fmt: skip
    assert found == contract("CPU_ATTN", "amx", HEAD_SIZE, element_size=2)
    assert found.interior is not None
    assert found.interior.tilings == (Tiling(1, 16, HEAD_SIZE // 2), Tiling(1, 2, 16))


def found_for(heads: int):  # type: ignore[no-untyped-def]
    from kvroute.engines.vllm.probe import probe

    return probe(cpu_vec_write, heads=heads, tokens=TOKENS, head_size=HEAD_SIZE,
                 dtype=torch.float32, device="cpu").layout  # fmt: skip


def test_two_heads_match_the_cpu_contract_exactly() -> None:
    from kvroute.engines.vllm.backends import contract

    assert found_for(2) == contract("CPU_ATTN", "vec", HEAD_SIZE)


def test_one_head_is_the_contract_s_bytes_though_named_otherwise() -> None:
    from kvroute.engines.vllm.backends import contract
    from kvroute.engines.vllm.probe import Layout
    from kvroute.geometry import HeadOrder, Kind

    found, expected = found_for(1), contract("CPU_ATTN", "vec", HEAD_SIZE)
    assert found != expected
    assert found.interior is not None
    assert found.interior.order is HeadOrder.BUFFER_HEAD
    assert found.same_bytes(expected, heads=1)
    assert not found.same_bytes(expected, heads=2)  # two heads: the orders differ in bytes
    assert not found.same_bytes(Layout(Kind.NHD, 1), heads=1)  # K and V side by side: other bytes
