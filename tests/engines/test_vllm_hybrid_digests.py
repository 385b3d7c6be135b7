"""Sampled digests and the canary of a hybrid model in the vLLM connector, on vLLM's own caches.

A rank holds three KV cache groups: full attention (layer 0), a 32-token sliding window (layer 1)
and Mamba2 state (layer 2: conv x | B | C of 64, 8 and 8 channels x 3 columns, then 4 SSM heads of
16 x 16, float16). Its ``KVCacheConfig`` is what vLLM's planner lays out for those groups (they
alias from byte 0 of every block), its tensors are vLLM's ``allocate_kv_cache``'s and its
registration the connector's (``rank_cache``). A request's bytes reach the consumer as vLLM would
place them: each group's own block list, the window's blocks only (vLLM's null block before it),
the state in the slot its list ends with; they are moved by whole-slot copies, not kvroute's code.
Expected keys, window starts and element names are written out by hand from those dimensions.

"staged" ranks reach their memory as a GPU rank's (``client.pool_access.DevicePools``: the
slots a use reads gathered into host arrays of their own, written back after the canary's
writes), here over CPU tensors of the same bytes, so every gather, remapped block list and
write-back is checked against the same hand-written expectations.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from tests.client.live import WORKER_TOKEN, LiveServer, live_server_in
from tests.engines import require_vllm

require_vllm()
torch = pytest.importorskip("torch")

# The conv state channel-major, as kvroute needs (tests/engines/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("channel_major")]
PROMPT = 80  # five 16-token blocks
WINDOW = 32
# Per group: full attention, the window (blocks 0-2 are vLLM's null block: the next decode step
# attends to tokens 49-79, which block 3 on holds), the state slot. No block id in two groups: a
# block belongs to one group at a time, the groups' pages share its bytes.
SENT = ((1, 2, 3, 4, 5), (0, 0, 0, 6, 7), (8,))
RECEIVED = ((11, 10, 9, 3, 7), (0, 0, 0, 4, 5), (2,))
EXTRA = {"url": "http://127.0.0.1:9", "deployment": "hybrid", "instance": "p"}
ROW = (32 + 32) * 2  # a token's K|V row of one head, bytes
CONV, SSM_AT, SSM_HEAD = (384, 48, 48), 80 * 3 * 2, 16 * 16 * 2  # conv sections, SSM offset, head


def layer(index: int) -> str:
    return "model.layers.2.mixer" if index == 2 else f"model.layers.{index}.self_attn.attn"


@pytest.fixture(scope="module")
def world() -> ModuleType:
    from tests.engines import vllm_world

    return vllm_world


@pytest.fixture(scope="module")
def model(world: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    return world.model_dir(root, "hybrid", num_key_value_heads=4, num_hidden_layers=3, head_dim=32)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = live_server_in(tmp_path_factory.mktemp("kvroute")).start()
    yield live
    live.stop()


class Rank:
    """One rank of the hybrid model: vLLM's tensors, the connector's registration and memory."""

    def __init__(
        self, world: ModuleType, model: Path, instance: str, *, aliased: bool, staged: bool = False
    ) -> None:
        from kvroute.client.pool_access import DevicePools, HostPools
        from kvroute.engines.vllm.memory import RankMemory
        from kvroute.engines.vllm.worker import rank_cache

        config = world.vllm_config(model, extra={**EXTRA, "instance": instance})
        kv_cache_config = _planned(config) if aliased else _separate()
        self.caches = world.allocate(config, kv_cache_config)
        cache = rank_cache(config, kv_cache_config, self.caches)
        self.document = {**cache.document, "role": "context"}
        memory = RankMemory.of(self.document, ("hybrid", instance, 0), cache.addresses,
                               cache.mem_type, cache.group_views, cache.state_groups)  # fmt: skip
        assert memory is not None
        if staged:  # the same bytes, through the staging a GPU rank's memory takes
            host = HostPools(cache.addresses).pools
            tensors = {
                pool: torch.from_numpy(host[pool]).view(at.num_slots, at.slot_stride)
                for pool, at in cache.addresses.items()
            }
            memory = RankMemory.over(
                memory.reg, DevicePools(tensors), cache.group_views, cache.state_groups
            )
        self.memory = memory
        assert cache.state_groups == {2}

    def slot(self, index: int, block: int) -> np.ndarray:
        """The 8 KiB of ``block`` of layer ``index``'s tensor from its page on (the largest page:
        where groups alias, every group's page in that block)."""
        tensor = self.caches[layer(index)]
        storage = tensor.untyped_storage()
        whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        stride = tensor.stride(0) * tensor.element_size()
        first = tensor.data_ptr() - storage.data_ptr() + block * stride
        return whole.numpy()[first : first + 8192]


def _groups() -> list[Any]:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    attention = {"block_size": 16, "num_kv_heads": 4, "head_size": 32, "dtype": torch.float16}
    mamba = MambaSpec(block_size=16, shapes=((80, 3), (4, 16, 16)), dtypes=(torch.float16,) * 2)
    return [
        KVCacheGroupSpec([layer(0)], FullAttentionSpec(**attention)),
        KVCacheGroupSpec([layer(1)], SlidingWindowSpec(**attention, sliding_window=WINDOW)),
        KVCacheGroupSpec([layer(2)], mamba),
    ]


def _planned(config: Any) -> Any:
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups

    return get_kv_cache_config_from_groups(config, _groups(), 8192 * 12)


def _separate() -> Any:
    """The same groups side by side in each 24 KiB block (vLLM 0.34 still backs every tensor with
    one allocation): no page shares another's bytes."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

    tensors = [
        KVCacheTensor(12 * 3 * 8192, [layer(i)], layer_stride=8192, block_stride=3 * 8192,
                      offset=i * 8192)
        for i in range(3)
    ]  # fmt: skip
    return KVCacheConfig(num_blocks=12, kv_cache_tensors=tensors, kv_cache_groups=_groups())


def _fill(rank: Rank, seed: int) -> None:
    """Every byte of every layer's tensor random (garbage wherever nothing is moved)."""
    rng = np.random.default_rng(seed)
    for tensor in rank.caches.values():
        data = tensor.view(torch.uint8)
        data.copy_(torch.from_numpy(rng.integers(0, 256, tuple(data.shape), dtype=np.uint8)))


def _move(producer: Rank, consumer: Rank) -> None:
    """What the pair moves, slot by slot: every full-attention block, the window's, the state."""
    for index, (sent, received) in enumerate(zip(SENT, RECEIVED, strict=True)):
        for src, dst in zip(sent, received, strict=True):
            if src != 0:  # vLLM's null block: the window holds nothing there
                consumer.slot(index, dst)[:] = producer.slot(index, src)


LAYOUTS = [  # (aliased, staged)
    pytest.param(True, False, id="aliased"),
    pytest.param(False, False, id="side-by-side"),
    pytest.param(True, True, id="aliased-staged"),
]


@pytest.fixture(params=[(True, False), (False, False), (True, True)],
                ids=["aliased", "side-by-side", "aliased-staged"])  # fmt: skip
def pair(world: ModuleType, model: Path, request: pytest.FixtureRequest) -> tuple[Rank, Rank]:
    """A producer and a consumer rank, their groups laid out by vLLM's planner (aliased) or side
    by side (the layout kvroute registers today: it refuses overlapping views), their memory
    read in place or staged (a GPU rank's way)."""
    aliased, staged = request.param
    producer = Rank(world, model, "p", aliased=aliased, staged=staged)
    consumer = Rank(world, model, "d", aliased=aliased, staged=staged)
    _fill(producer, 1)
    _fill(consumer, 2)
    producer.memory.write_canary()  # the null block, which the window's list names, differs
    return producer, consumer


def test_digests_of_every_group_agree(pair: tuple[Rank, Rank]) -> None:
    from kvroute.client.kv_digest import KvDigest

    producer, consumer = pair
    _move(producer, consumer)
    sent = producer.memory.digest(SENT, range(PROMPT), 16, PROMPT)
    sent = KvDigest.from_json(sent.to_json())  # as kvroute stores it
    got = consumer.memory.digest(RECEIVED, range(PROMPT), 16, PROMPT, [producer.memory.reg])
    for digest in (sent, got):
        assert sorted({(key.layer, key.head) for key in digest.rows}) == [
            (layer, head) for layer in (0, 1) for head in range(4)
        ]
        assert {key: first for key, first in digest.firsts.items()} == {
            key: 48 for key in digest.rows if key.layer == 1
        }
        units = sorted((key.kind, key.section, key.unit) for key in digest.states)
        conv = [("conv", s, part) for s, parts in enumerate((96, 48, 48)) for part in range(parts)]
        assert units == conv + [("ssm", 0, head) for head in range(4)]
    assert sent.first_mismatch(got) is None
    # 4 heads x 5 chunks of layer 0, 4 heads x 2 chunks of the window, 196 state units.
    assert sent.compared(got) == 20 + 8 + 196


def test_windows_on_a_grid_are_cut_every_step_back_from_the_prompt_s_end(
    pair: tuple[Rank, Rank],
) -> None:
    from kvroute.client.kv_digest import Grid, KvDigest

    producer, consumer = pair
    _move(producer, consumer)
    grid = Grid(8, PROMPT)
    sent = producer.memory.digest(SENT, range(PROMPT), 16, PROMPT, grid=grid)
    sent = KvDigest.from_json(sent.to_json())  # as kvroute stores it
    assert sent.gridded == {key for key in sent.rows if key.layer == 1}
    peers = [producer.memory.reg]
    got = consumer.memory.digest(
        RECEIVED, range(PROMPT), 16, PROMPT, peers, grid=sent.grid, gridded=sent.gridded
    )
    assert got.gridded == sent.gridded
    window = next(iter(sent.gridded))
    assert list(sent.spans(window)) == [(48, 56), (56, 64), (64, 72), (72, 80)]
    assert sent.first_mismatch(got) is None
    # 4 heads x 5 chunks of layer 0, 4 heads x 4 steps of the window, 196 state units.
    assert sent.compared(got) == 20 + 16 + 196


def _stored(server: LiveServer, request_id: str) -> None:
    from kvroute.client import KvrouteClient

    with KvrouteClient(server.url, token=WORKER_TOKEN) as client:
        deadline = time.monotonic() + 30
        while not client.kv_digests("hybrid", "p", request_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.kv_digests("hybrid", "p", request_id), "the producer stored no digest"


def _check(server: LiveServer, producer: Rank, consumer: Rank, request_id: str) -> str | None:
    """The producer rank digests and stores; ``flip`` may follow; the consumer rank compares."""
    from kvroute.client import KvrouteClient
    from kvroute.engines.vllm.digests import Check, ConsumerChecks

    with KvrouteClient(server.url, token=WORKER_TOKEN) as client:
        checks = ConsumerChecks(client, consumer.memory, 16, timeout_s=30)
        try:
            checks.submit(Check(request_id, "p", request_id, frozenset({0}), RECEIVED,
                                (0, PROMPT), PROMPT, {0: producer.document}))  # fmt: skip
            deadline = time.monotonic() + 60
            while not (ended := checks.finished()) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            checks.close()
    [(check, failure)] = ended
    assert check.request_id == request_id
    return failure


def _digested(server: LiveServer, producer: Rank, request_id: str, window_step: int) -> None:
    from kvroute.client import KvrouteClient
    from kvroute.engines.vllm.digests import ProducerDigests

    with KvrouteClient(server.url, token=WORKER_TOKEN) as client:
        digests = ProducerDigests(client, producer.memory, 16, window_step)
        digests.submit(request_id, SENT, PROMPT)
        _stored(server, request_id)
        digests.close()


# (case, layer, block on the producer, byte in the layer's page, the element named); a window's
# series cut by the 16-token chunks, or every 8 tokens back from the prompt's end ("on a grid").
FLIPS = [
    ("agree", None, None, None, None),
    ("agree on a grid", None, None, None, None),
    # SSM head 2 of layer 2: after the conv state, two heads in.
    ("state", 2, 8, SSM_AT + 2 * SSM_HEAD + 7, "target ssm layer 2 SSM head 2"),
    # conv section 1 (B) of 48 bytes in 48 parts of one byte: its byte 5 is part 5.
    ("conv", 2, 8, CONV[0] + 5, "target conv layer 2 conv section 1 part 5"),
    # The window's last block (tokens 64-79) holds head 1's rows after head 0's (hnd): token 70.
    ("window", 1, 7, 16 * ROW + 6 * ROW + 5, "target key,value layer 1 head 1 K, tokens 64-79"),
    (
        "window on a grid",
        *(1, 7, 16 * ROW + 6 * ROW + 5),
        "target key,value layer 1 head 1 K, tokens 64-71",
    ),
]


@pytest.mark.parametrize(("case", "index", "block", "byte", "named"), FLIPS)
def test_a_byte_flipped_after_the_producer_s_digest_is_named(
    pair: tuple[Rank, Rank], server: LiveServer, case: str, index: int | None,
    block: int | None, byte: int | None, named: str | None,
) -> None:  # fmt: skip
    producer, consumer = pair
    request_id = f"hybrid-{case.replace(' ', '-')}-{id(producer)}"
    _digested(server, producer, request_id, 8 if case.endswith("on a grid") else 0)
    if index is not None:
        producer.slot(index, block)[byte] ^= 0x01
    _move(producer, consumer)
    failure = _check(server, producer, consumer, request_id)
    assert failure == (None if named is None else f"KV digest mismatch: {named}")


def _canary_pair(
    world: ModuleType, model: Path, aliased: bool, seed: int, staged: bool = False
) -> tuple[Rank, Rank, Any]:
    """A producer that wrote its canary, a consumer and what it checks of it (memory garbage
    elsewhere)."""
    producer = Rank(world, model, "p", aliased=aliased, staged=staged)
    consumer = Rank(world, model, "d", aliased=aliased, staged=staged)
    _fill(producer, seed)
    _fill(consumer, seed + 1)
    producer.memory.write_canary()
    return producer, consumer, consumer.memory.canary_for({0: producer.document}, "p")


def _pull_round(producer: Rank, consumer: Rank, canary: Any) -> None:
    """A canary round as the pulls make it: the consumer's block 0 zeroed under the round's
    views, then the producer's block 0 copied (whole pages: the round's bytes and more)."""
    consumer.memory.clear(canary)
    for index in range(3):
        consumer.slot(index, 0)[:] = producer.slot(index, 0)


@pytest.mark.parametrize(("aliased", "staged"), LAYOUTS)
def test_the_canary_checks_every_group_in_rounds_of_views_apart_in_block_0(
    world: ModuleType, model: Path, aliased: bool, staged: bool
) -> None:
    """vLLM's planner lays the groups over the same bytes, so block 0 holds one image: the
    producer's pattern of full attention over a filler of every view. The consumer checks each
    view against that image replayed from the producer's registration, one round per set of its
    views that do not overlap: full attention, the window, then conv and SSM state (apart in
    the page). Each layer in its own tensor, one round checks all four."""
    producer, consumer, canary = _canary_pair(world, model, aliased, 3, staged)
    views = {v.view_id: v for v in consumer.memory.reg.views}

    def roles(round_: frozenset[int]) -> list[tuple[str, ...]]:
        return sorted(tuple(sorted(views[v].roles)) for v in round_)

    everything = [("conv",), ("key", "value"), ("key", "value"), ("ssm",)]
    if aliased:
        assert [roles(r) for r in canary.rounds] == [
            [("key", "value")],
            [("key", "value")],
            [("conv",), ("ssm",)],
        ]
        assert [set(views[min(r)].layer_ids) for r in canary.rounds] == [{0}, {1}, {2}]
    else:
        assert [roles(r) for r in canary.rounds] == [everything]
    while True:
        _pull_round(producer, consumer, canary)
        assert consumer.memory.check_canary(canary) is None
        if canary.last:
            break
        canary = canary.following()
    # The last round, state: a flipped SSM byte is named.
    _pull_round(producer, consumer, canary)
    consumer.slot(2, 0)[SSM_AT + 3 * SSM_HEAD + 9] ^= 0x10
    found = consumer.memory.check_canary(canary)
    assert found is not None
    assert found.describe() == "target ssm layer 2 SSM head 3, byte 9"


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
def test_a_round_whose_pull_moved_nothing_fails(
    world: ModuleType, model: Path, staged: bool
) -> None:
    """What the round before left in block 0 (the same bytes, aliased) does not pass for the
    window's canary: the round zeroes its views first, and the window's expected rows are the
    producer's image, not zeros."""
    producer, consumer, canary = _canary_pair(world, model, True, 5, staged)
    _pull_round(producer, consumer, canary)
    assert consumer.memory.check_canary(canary) is None
    window = canary.following()
    consumer.memory.clear(window)  # the pull that moved nothing
    found = consumer.memory.check_canary(window)
    assert found is not None
    assert found.describe() == "target key,value layer 1 head 0 K, token 0"
    # Moved from the wrong place (one token's row off): the first element is wrong.
    consumer.memory.clear(window)
    consumer.slot(1, 0)[: 8192 - ROW] = producer.slot(1, 0)[ROW:]
    found = consumer.memory.check_canary(window)
    assert found is not None
    assert found.describe() == "target key,value layer 1 head 0 K, token 0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a device is reachable here")
def test_device_memory_out_of_reach_is_said_once_and_left_unchecked(
    world: ModuleType, model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank whose cache is device memory where no device can be reached (no CUDA here) moves
    KV without digests or a canary, and the log says why, rather than the engine failing."""
    from kvroute.engines.vllm.memory import RankMemory
    from kvroute.engines.vllm.worker import rank_cache

    config = world.vllm_config(model, extra=EXTRA)
    kv_cache_config = _separate()
    cache = rank_cache(config, kv_cache_config, world.allocate(config, kv_cache_config))
    with caplog.at_level("WARNING"):
        memory = RankMemory.of({**cache.document, "role": "context"}, ("hybrid", "p", 0),
                               cache.addresses, "VRAM", cache.group_views, cache.state_groups)  # fmt: skip
    assert memory is None
    [said] = [r.getMessage() for r in caplog.records if "KV digests" in r.getMessage()]
    assert "cannot read p rank 0's VRAM" in said
    assert "pulls sampled requests unchecked" in said
