"""Hybrid pools described from torch tensors: Mamba2 state and attention KV sharing one pool's slots.

The documents must be admitted and address every element exactly, and the plan kvroute builds from
them (context TP4 -> generation TP2), executed by the copy engine on the carved buffers, must put
every SSM head, conv channel and KV head of the request where the receiver's typed views expect it.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvroute.client.hybrid import HybridPool, MambaLayout, mamba2  # noqa: E402
from kvroute.client.pools import KvLayout, Parallel, rank_document  # noqa: E402
from kvroute.geometry import Kind, Pool, RankRegistration, build_plan, check_registration  # noqa: E402
from kvroute.transfer import (  # noqa: E402
    CopyEngine,
    CopyPlan,
    LocalBackend,
    PoolMemoryCache,
    TransferJob,
    TransferLeg,
)

MAMBA, ATTENTION, LAYERS = (0, 1, 3, 4), (2, 5), 6
HEADS, HEAD_DIM, D_STATE, GROUPS, D_CONV = 8, 4, 4, 2, 4
KV_HEADS, TOKENS, KV_DIM, SLOTS = 4, 4, 8, 5


def layouts(tp: int) -> tuple[KvLayout, MambaLayout]:
    # float32: every test value below is an exact integer, so a misplaced element cannot hide.
    kv = KvLayout(Kind.HND, len(ATTENTION), KV_HEADS // tp, TOKENS, KV_DIM, "float32",
                  total_kv_heads=KV_HEADS, layer_ids=ATTENTION)  # fmt: skip
    mamba = mamba2(MAMBA, tp_size=tp, heads=HEADS, head_dim=HEAD_DIM, d_state=D_STATE,
                   groups=GROUPS, d_conv=D_CONV, dtype="float32")  # fmt: skip
    return kv, mamba


def rank(role: str, tp: int, tp_rank: int) -> tuple[RankRegistration, HybridPool]:
    kv, mamba = layouts(tp)
    pool = HybridPool.carve(kv, mamba, SLOTS)
    doc = rank_document(role=role, target=kv, pools=[pool.describe()],
                        parallel=Parallel(tp_size=tp, tp_rank=tp_rank, layers_per_stage=(LAYERS,)))  # fmt: skip
    reg = RankRegistration.from_json(doc, deployment="d", instance=role[:3], rank=tp_rank)
    return reg, pool


def test_mamba2_dimensions_split_over_tp() -> None:
    layout = mamba2((0,), tp_size=4, heads=128, head_dim=64, d_state=128, groups=8, d_conv=4)
    assert (layout.num_heads, layout.ssm_head_bytes) == (32, 64 * 128 * 2)
    assert layout.conv_sections == (2048 * 3 * 2, 256 * 3 * 2, 256 * 3 * 2)
    with pytest.raises(ValueError, match="does not split over TP 3"):
        mamba2((0,), tp_size=3, heads=128, head_dim=64, d_state=128, groups=8, d_conv=4)


def test_views_address_every_state_element() -> None:
    reg, pool = rank("context", 2, 1)
    check_registration(reg, [], [])
    pool.ssm.copy_(torch.arange(pool.ssm.numel()).view(pool.ssm.shape).float())
    ssm, conv = (next(v for v in reg.views if v.kind is kind) for kind in (Kind.SSM, Kind.CONV))
    raw, stride, mamba = pool.buffer.reshape(-1), reg.pools[0].slot_stride, pool.mamba
    for slot in (0, 3):
        for index, layer in enumerate(MAMBA):
            for head in range(mamba.num_heads):
                at = slot * stride + ssm.offsets[layer] + head * ssm.ssm_bytes_per_head
                value = raw[at : at + 4].view(torch.float32)
                assert value == pool.ssm[slot, index, head, 0, 0]
    # conv: section s of layer L starts at the layer's offset plus the earlier sections' bytes.
    pool.conv.copy_(torch.randn(pool.conv.shape))
    index, channel = 2, mamba.conv_channels[0] + 1  # the second channel of section B
    at = 2 * stride + conv.offsets[MAMBA[index]] + conv.conv_sections[0] + 1 * mamba.conv_kernel * 4
    assert raw[at : at + 4].view(torch.float32) == pool.conv[2, index, channel, 0]


def _ssm(m: MambaLayout, tp_rank: int) -> torch.Tensor:
    """A request's SSM state on one rank, from global coordinates (layer, head, d, s)."""
    layer, head, d, s = torch.meshgrid(*(torch.arange(n) for n in m.ssm_shape), indexing="ij")
    return (layer * 1000 + (tp_rank * m.num_heads + head) * 37 + d * 5 + s).float()


def _conv(m: MambaLayout, tp_rank: int) -> torch.Tensor:
    """Its conv state: (layer, section, global channel of the section, column)."""
    sections = []
    for index, channels in enumerate(m.conv_channels):
        layer, c, k = torch.meshgrid(torch.arange(m.num_layers), torch.arange(channels),
                                     torch.arange(m.conv_kernel), indexing="ij")  # fmt: skip
        sections.append(layer * 1000 + index * 300 + (tp_rank * channels + c) * 3 + k)
    return torch.cat(sections, dim=1).float()


def _kv(kv: KvLayout, tp_rank: int, block: int) -> torch.Tensor:
    layer, buf, head, token, e = torch.meshgrid(*(torch.arange(n) for n in kv.block_shape),
                                                indexing="ij")  # fmt: skip
    global_head = tp_rank * kv.num_kv_heads + head
    return (block * 900 + layer * 100 + buf * 50 + global_head * 9 + token * 2 + e).float()


def test_a_request_moves_from_tp4_to_tp2_into_the_right_elements() -> None:
    ctx = [rank("context", 4, r) for r in range(4)]
    gen = [rank("generation", 2, r) for r in range(2)]
    for reg, _ in gen:
        check_registration(reg, [g for g, _ in gen if g is not reg], [c for c, _ in ctx])
    backend = LocalBackend()
    cache = PoolMemoryCache([backend])

    def opened(name: str, pool: HybridPool):
        backend.register(name, pool.buffer.reshape(-1))
        memory = Pool(0, pool.slot_bytes, pool.slot_stride, SLOTS)
        return cache.open_pool({"backend": "local", "name": name}, memory)

    src_pools = {(r, 0): opened(f"ctx{r}", pool) for r, (_, pool) in enumerate(ctx)}
    for r, (_, pool) in enumerate(ctx):
        pool.ssm[4], pool.conv[4] = _ssm(pool.mamba, r), _conv(pool.mamba, r)
        for block in (0, 1):
            pool.kv[block] = _kv(pool.kv_layout, r, block)
    for r, (reg, pool) in enumerate(gen):
        plan = CopyPlan.from_plan(build_plan([c for c, _ in ctx], reg))
        leg = TransferLeg(plan, src_pools, {0: opened(f"gen{r}", pool)})
        CopyEngine().copy(TransferJob([leg], [0, 1], [3, 0], src_state_slot=4, dst_state_slot=2))
        assert torch.equal(pool.ssm[2], _ssm(pool.mamba, r))
        assert torch.equal(pool.conv[2], _conv(pool.mamba, r))
        assert torch.equal(pool.kv[3], _kv(pool.kv_layout, r, 0))
        assert torch.equal(pool.kv[0], _kv(pool.kv_layout, r, 1))
        assert not pool.buffer[1].any()  # slot 1 is neither a destination block nor the state slot
    cache.close()


def test_a_float32_recurrent_state_beside_a_bfloat16_conv_state() -> None:
    """Kimi's KDA layout: the recurrent state's own dtype sizes its heads and types its view; the
    conv state keeps the cache dtype and starts after every layer's recurrent region."""
    state = MambaLayout((0, 1), 4, 8, 8, (16, 16, 16), 3, "bfloat16", "float32")
    pool = HybridPool.carve(None, state, 2)
    assert (pool.ssm.dtype, pool.ssm.shape) == (torch.float32, (2, 2, 4, 8, 8))
    assert (pool.conv.dtype, pool.conv.shape) == (torch.bfloat16, (2, 2, 48, 3))
    ssm, conv = pool.describe().specs[:2]
    assert (ssm.dtype, ssm.ssm_bytes_per_head, ssm.bytes_per_layer) == ("float32", 256, 1024)
    assert (conv.dtype, conv.offset, conv.conv_sections) == ("bfloat16", 2048, (96, 96, 96))
    pool.ssm[1, 1, 3, 7, 7] = 1.5
    assert pool.buffer[1, 2048 - 4 : 2048].view(torch.float32).item() == 1.5


def test_lightning_attention_has_no_conv_region() -> None:
    state = MambaLayout((0, 2), 4, 8, 8, (), 0, "bfloat16")
    assert [spec.kind for spec in state.layer_specs(0)] == [Kind.SSM, Kind.SSM]
    assert state.slot_bytes == 2 * 4 * 8 * 8 * 2
