"""Torch KV tensors described as pools and views: accepted by kvroute, and the offsets are right.

Every element ``[block, layer, kv, head, token]`` written into the tensor is read back through the
registration alone (slot stride, the view's layer offset, bytes per layer / buffers, the view's head
count and the layout kind), so a wrong stride, offset or head order fails here.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvroute.client.pools import KvLayout, Parallel, SharedKvPool, describe_tensor, rank_document  # noqa: E402
from kvroute.geometry import Kind, Owner, RankRegistration, View, check_registration  # noqa: E402


def registration(doc: dict[str, Any]) -> RankRegistration:
    reg = RankRegistration.from_json(doc, deployment="d", instance="i", rank=doc["tp_rank"])
    check_registration(reg, [], [])
    return reg


def fill(tensor: torch.Tensor, seed: int) -> None:
    """Distinct values per element, so any misaddressed read shows up."""
    generator = torch.Generator().manual_seed(seed)
    tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype))


def element_offset(
    reg: RankRegistration, view: View, layer: int, kv: int, head: int, token: int
) -> int:
    """Byte offset inside a slot, from the registered numbers only (docs/geometry.md byte layout)."""
    buffer = view.bytes_per_layer // view.buffers_per_layer
    heads, tokens = reg.heads(view), reg.tokens(view)
    row_bytes = buffer // (heads * tokens)
    row = head * tokens + token if view.kind is Kind.HND else token * heads + head
    return view.offsets[layer] + kv * buffer + row * row_bytes


def assert_views_address(
    reg: RankRegistration,
    raw: torch.Tensor,
    tensor: torch.Tensor,
    owner: Owner,
    first_layer: int,
    kind: Kind,
) -> None:
    pool = reg.pools[0]
    [view] = [v for v in reg.views if v.owner is owner]
    blocks, layers = tensor.shape[0], tensor.shape[1]
    heads = tensor.shape[3] if kind is Kind.HND else tensor.shape[4]
    tokens = tensor.shape[4] if kind is Kind.HND else tensor.shape[3]
    row_bytes = tensor.shape[5] * tensor.element_size()
    for block in range(blocks):
        for layer in range(layers):
            for kv in range(2):
                for head in range(heads):
                    for token in range(tokens):
                        index = (head, token) if kind is Kind.HND else (token, head)
                        expected = tensor[block, layer, kv, *index].contiguous().view(torch.uint8)
                        start = block * pool.slot_stride + element_offset(
                            reg, view, first_layer + layer, kv, head, token
                        )
                        assert torch.equal(raw[start : start + row_bytes], expected), (
                            block,
                            layer,
                            kv,
                            head,
                            token,
                        )


@pytest.mark.parametrize("kind", [Kind.HND, Kind.NHD])
def test_single_tensor_pool(kind: Kind) -> None:
    heads, tokens = 2, 4
    inner = (heads, tokens) if kind is Kind.HND else (tokens, heads)
    tensor = torch.empty(3, 4, 2, *inner, 8, dtype=torch.bfloat16)
    fill(tensor, 1)
    pool = describe_tensor(tensor, kind=kind, total_kv_heads=4)
    target = KvLayout.from_tensor(tensor, kind=kind, total_kv_heads=4)
    doc = rank_document(
        role="context", target=target, pools=[pool], parallel=Parallel(tp_size=2, tp_rank=1)
    )
    reg = registration(doc)
    [view] = reg.views
    assert (view.kind, view.num_kv_heads, view.total_kv_heads, len(view.layers)) == (kind, 2, 4, 4)
    assert reg.pools[0].slot_stride == reg.pools[0].slot_bytes == 4 * 2 * heads * tokens * 8 * 2
    raw = tensor.reshape(-1).view(torch.uint8)
    assert_views_address(reg, raw, tensor, Owner.TARGET, 0, kind)


def test_strided_tensor_keeps_its_slot_stride() -> None:
    """A KV tensor that is a slice of a larger per-block allocation: stride > block bytes."""
    backing = torch.zeros(3, 5, 2, 2, 4, 8, dtype=torch.float16)
    tensor = backing[:, 1:4]
    fill(tensor, 2)
    pool = describe_tensor(tensor, kind=Kind.HND, first_layer=0)
    assert pool.slot_stride == 5 * 2 * 2 * 4 * 8 * 2
    assert pool.slot_bytes == 3 * 2 * 2 * 4 * 8 * 2
    # Slot 0 starts where the tensor starts, one layer into the backing block.
    raw = backing.reshape(-1).view(torch.uint8)[tensor.storage_offset() * 2 :]
    target = KvLayout.from_tensor(tensor, kind=Kind.HND)
    reg = registration(rank_document(role="generation", target=target, pools=[pool]))
    assert_views_address(reg, raw, tensor, Owner.TARGET, 0, Kind.HND)


@pytest.mark.parametrize("kind", [Kind.HND, Kind.NHD])
def test_shared_pool_target_and_draft(kind: Kind) -> None:
    target = KvLayout(
        kind,
        num_layers=3,
        num_kv_heads=2,
        tokens_per_block=4,
        head_dim=8,
        dtype="bfloat16",
        total_kv_heads=8,
    )
    draft = KvLayout(
        kind,
        num_layers=1,
        num_kv_heads=1,
        tokens_per_block=4,
        head_dim=8,
        dtype="bfloat16",
        owner=Owner.DRAFT,
        total_kv_heads=1,
    )
    shared = SharedKvPool.carve([target, draft], num_blocks=5)
    fill(shared.tensors[0], 3)
    fill(shared.tensors[1], 4)
    assert shared.offsets[1] >= target.block_bytes
    assert shared.offsets[1] % 256 == 0
    description = shared.describe(pool_id=0, memory={"backend": "shm", "name": "x", "offset": 0})
    doc = rank_document(
        role="context",
        target=target,
        pools=[description],
        num_draft_layers=1,
        parallel=Parallel(tp_size=4, tp_rank=2),
    )
    reg = registration(doc)
    by_owner = {view.owner: view for view in reg.views}
    assert by_owner[Owner.TARGET].num_kv_heads == 2
    assert by_owner[Owner.DRAFT].num_kv_heads == 1
    assert doc["pools"][0]["memory"]["name"] == "x"
    raw = shared.buffer.reshape(-1)
    assert_views_address(reg, raw, shared.tensors[0], Owner.TARGET, 0, kind)
    assert_views_address(reg, raw, shared.tensors[1], Owner.DRAFT, 0, kind)


def test_shared_pool_over_a_given_buffer_and_refusals() -> None:
    layout = KvLayout(Kind.HND, 2, 1, 2, 4, "float32")
    buffer = torch.zeros(4096, dtype=torch.uint8)
    shared = SharedKvPool.carve([layout], num_blocks=4, buffer=buffer)
    shared.tensors[0][2, 1, 1, 0, 1] = 7.0
    assert shared.buffer.data_ptr() == buffer.data_ptr()
    start = 2 * shared.slot_stride + layout.byte_offset(1, 1, 0, 1)
    assert buffer[start : start + 16].view(torch.float32)[0] == 7.0
    with pytest.raises(ValueError, match="at least"):
        SharedKvPool.carve([layout], num_blocks=100, buffer=buffer)
    with pytest.raises(ValueError, match="expected"):
        KvLayout.from_tensor(torch.zeros(2, 3, 4), kind=Kind.HND)
    with pytest.raises(ValueError, match="hnd or nhd"):
        KvLayout(Kind.REPLICATED, 1, 1, 1, 1, "bfloat16")


@pytest.mark.parametrize("sealed", [True, False])
def test_shm_pool_is_what_kvroute_maps(sealed: bool) -> None:
    import os

    from kvroute.client.memory import ShmPool
    from kvroute.geometry import Pool
    from kvroute.transfer import MemfdBackend, ShmBackend

    layout = KvLayout(Kind.HND, 2, 2, 4, 8, "bfloat16")
    name = f"kvroute-client-test-{os.getpid()}"
    backend = MemfdBackend() if sealed else ShmBackend()
    with ShmPool(name, 4 * 1024 * 8, sealed=sealed) as memory:
        shared = SharedKvPool.carve([layout], num_blocks=8, buffer=memory.tensor)
        fill(shared.tensors[0], 5)
        described = shared.describe(memory=memory.descriptor())
        assert described.memory is not None
        assert described.memory["backend"] == backend.name
        pool = Pool(0, described.slot_bytes, described.slot_stride, described.num_slots)
        opened = backend.open(described.memory, pool)
        try:
            assert torch.equal(opened.tensor, shared.buffer.reshape(-1))
        finally:
            opened.close()
        del shared
    assert not os.path.exists(f"/dev/shm/{name}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_descriptor_locates_the_tensor() -> None:
    from kvroute.client.memory import cuda_ipc_descriptor

    backing = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    view = backing[4096:]
    descriptor = cuda_ipc_descriptor(view)
    assert descriptor["backend"] == "cuda_ipc"
    assert descriptor["device"] == backing.device.index
    assert descriptor["size"] - descriptor["offset"] >= view.numel()
    assert len(__import__("base64").b64decode(descriptor["handle"])) == 64


def test_identity_and_topology_are_written_only_when_given() -> None:
    tensor = torch.empty(3, 4, 2, 2, 4, 8, dtype=torch.bfloat16)
    pool = describe_tensor(tensor, kind=Kind.HND, total_kv_heads=2)
    target = KvLayout.from_tensor(tensor, kind=Kind.HND, total_kv_heads=2)
    plain = rank_document(role="context", target=target, pools=[pool])
    assert not {"model", "kv_quantization", "topology"} & set(plain)
    named = rank_document(
        role="context",
        target=target,
        pools=[pool],
        model={"name": "llama", "revision": "r1"},
        kv_quantization={"kv_dtype": "bf16"},
        topology={"zone": "a"},
    )
    reg = registration(named)
    assert (reg.model.revision, reg.kv_quantization.kv_dtype) == ("r1", "bf16")  # type: ignore[union-attr]
    assert reg.topology == (("zone", "a"),)
    assert {key: named[key] for key in plain} == plain
