"""The connector's scheduler side on vLLM's own ``Request``: what a producer of a model with
recurrent state prefills, and what it hands over.

vLLM recomputes the last prompt token of every loaded request (its logits give the first decoded
token), and a recurrent state cannot be rewound: a producer that prefilled all N tokens would hand
over h(N), and the consumer would apply token N twice. So the producer stops at N - 1.
"""

from __future__ import annotations

import pytest

from tests.engines import require_vllm

require_vllm()
pytestmark = pytest.mark.slow  # imports vLLM
EXTRA = {"url": "http://127.0.0.1:9", "deployment": "qwen3-next", "instance": "prefill0"}


def request(tokens: list[int], params: dict | None):  # type: ignore[no-untyped-def]
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    found = Request(request_id="r1", prompt_token_ids=list(tokens),
                    sampling_params=SamplingParams(max_tokens=24), pooling_params=None)  # fmt: skip
    found.kv_transfer_params = params
    return found


def side(backoff: int):  # type: ignore[no-untyped-def]
    from kvroute.engines.vllm.params import Settings
    from kvroute.engines.vllm.scheduler import SchedulerSide

    return SchedulerSide(Settings.from_config("kv_producer", EXTRA), 32, (0, 1), backoff=backoff)


def test_a_producer_with_state_prefills_all_but_the_last_token_once() -> None:
    from vllm.v1.request import RequestStatus

    producer, prompt = side(backoff=1), list(range(10, 50))
    found = request(prompt, {"do_remote_decode": True})
    assert producer.matched_tokens(found, 0) == (0, False)
    assert found.num_prompt_tokens == 39
    assert found.prompt_token_ids == prompt[:39]
    assert list(found.all_token_ids) == prompt[:39]
    assert found.max_tokens == 1
    producer.matched_tokens(found, 0)  # asked again (a preempted request): not shortened twice
    assert found.num_prompt_tokens == 39
    found.status = RequestStatus.FINISHED_LENGTH_CAPPED
    hold, params = producer.finished(found, ([0, 1], [2]))
    assert hold
    assert params["prompt_tokens"] == 39
    assert "kvroute_held_back" not in params


def test_attention_only_and_local_requests_keep_their_prompt() -> None:
    prompt = list(range(10, 50))
    for backoff, params in ((0, {"do_remote_decode": True}), (1, None), (1, {})):
        found = request(prompt, params)
        side(backoff).matched_tokens(found, 0)
        assert found.num_prompt_tokens == 40
        assert found.max_tokens == 24


def test_a_producer_whose_prefix_cache_holds_the_shortened_prompt_hands_nothing_over() -> None:
    """vLLM must compute one token: with all but the last prompt token cached here, the request
    keeps its prompt and its answer tells the consumer to compute the prompt itself."""
    from vllm.v1.request import RequestStatus

    producer, prompt = side(backoff=1), list(range(10, 43))  # 32 tokens before the last
    found = request(prompt, {"do_remote_decode": True})
    assert producer.matched_tokens(found, 32) == (0, False)
    assert found.num_prompt_tokens == 33
    found.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert producer.finished(found, ([0, 1], [2])) == (False, {"do_remote_prefill": False})


def test_a_consumer_that_holds_back_loads_all_but_the_last_prompt_token() -> None:
    """Also from a producer that did not (full attention on that side): vLLM would otherwise
    count this side's window from the token after the prompt."""
    from kvroute.engines.vllm.params import Settings
    from kvroute.engines.vllm.scheduler import SchedulerSide

    prompt = list(range(10, 50))
    params = {"do_remote_prefill": True, "remote_instance": "p", "remote_request_id": "r",
              "remote_block_ids": [[0, 1]], "prompt_tokens": 40}  # fmt: skip
    for backoff, loaded in ((0, 40), (1, 39)):
        settings = Settings.from_config("kv_consumer", {**EXTRA, "instance": "decode0"})
        consumer = SchedulerSide(settings, 32, (0,), backoff=backoff)
        assert consumer.matched_tokens(request(prompt, dict(params)), 0) == (loaded, True)


def test_the_connector_holds_back_exactly_when_a_group_keeps_state_or_a_window() -> None:
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    from kvroute.engines.vllm.connector import holds_back

    shape = {"block_size": 32, "num_kv_heads": 2, "head_size": 128, "dtype": torch.bfloat16}
    attention = KVCacheGroupSpec(["a"], FullAttentionSpec(**shape))
    state = KVCacheGroupSpec(["m"], MambaSpec(block_size=32, shapes=((8, 3), (2, 4, 4)),
                                              dtypes=(torch.bfloat16, torch.bfloat16)))  # fmt: skip
    window = KVCacheGroupSpec(["w"], SlidingWindowSpec(**shape, sliding_window=64))
    chunks = KVCacheGroupSpec(["c"], ChunkedLocalAttentionSpec(**shape, attention_chunk_size=64))

    def config(*groups: object) -> object:
        return KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=list(groups))

    assert not holds_back(config(attention))
    assert all(holds_back(config(attention, other)) for other in (state, window, chunks))
    assert not holds_back(None)


def consumer_side(**extra: float):  # type: ignore[no-untyped-def]
    from kvroute.engines.vllm.params import Settings
    from kvroute.engines.vllm.scheduler import SchedulerSide

    settings = Settings.from_config("kv_consumer", {**EXTRA, "instance": "decode0", **extra})
    return SchedulerSide(settings, 32, (0,))


def test_a_producer_states_until_when_it_holds_the_blocks() -> None:
    """The hand-over carries the producer's end of hold (its wall clock), never later than the
    worker's own timeout, which starts at its next step."""
    import time

    from vllm.v1.request import RequestStatus

    from kvroute.engines.vllm.params import Handover, Settings
    from kvroute.engines.vllm.scheduler import SchedulerSide

    settings = Settings.from_config("kv_producer", {**EXTRA, "send_timeout_s": 45})
    producer = SchedulerSide(settings, 32, (0,))
    found = request(list(range(10, 50)), {"do_remote_decode": True})
    found.status = RequestStatus.FINISHED_LENGTH_CAPPED
    before = time.time()
    hold, params = producer.finished(found, ([3, 4],))
    assert hold
    assert before + 45 - 0.01 <= params["kvroute_expires_at"] <= time.time() + 45
    assert Handover.from_params(params).expires_at == params["kvroute_expires_at"]


def test_a_consumer_computes_the_prompt_of_an_expired_hand_over_itself() -> None:
    """Past the producer's end of hold (less the clock skew allowed), its blocks may hold another
    request's KV: nothing is loaded, and the request is not offered the hand-over again."""
    import time

    params = {"do_remote_prefill": True, "remote_instance": "prefill0", "remote_request_id": "p1",
              "remote_block_ids": [[3, 4]], "prompt_tokens": 40}  # fmt: skip
    for expires_in, loads in ((30.0, True), (1.5, True), (0.5, False), (-10.0, False)):
        found = request(
            list(range(10, 50)), {**params, "kvroute_expires_at": time.time() + expires_in}
        )
        count, asynchronous = consumer_side(clock_skew_s=1.0).matched_tokens(found, 0)
        assert (count, asynchronous) == ((40, True) if loads else (0, False)), expires_in
        assert found.kv_transfer_params["do_remote_prefill"] is loads
    older = request(list(range(10, 50)), params)  # a producer that states no end: loaded
    assert consumer_side().matched_tokens(older, 0) == (40, True)


def test_block_lists_are_indexed_by_vllm_s_group_id_whichever_groups_transfer() -> None:
    """Group 0 does not transfer, group 1 does: the hand-over and the load name group 1's list at
    index 1, where the pulls and digests look it up (``RankCache.group_views``), never at 0."""
    from vllm.v1.request import RequestStatus

    from kvroute.engines.vllm.params import Handover, Settings
    from kvroute.engines.vllm.scheduler import SchedulerSide

    producer = SchedulerSide(Settings.from_config("kv_producer", EXTRA), 32, (1,))
    found = request(list(range(10, 50)), {"do_remote_decode": True})
    found.status = RequestStatus.FINISHED_LENGTH_CAPPED
    hold, params = producer.finished(found, ([7, 8], [3, 4]))
    assert hold
    assert Handover.from_params(params).block_ids == ((), (3, 4))
    settings = Settings.from_config("kv_consumer", {**EXTRA, "instance": "decode0"})
    consumer = SchedulerSide(settings, 32, (1,))
    taken = request(list(range(10, 50)), params)
    assert consumer.matched_tokens(taken, 0) == (40, True)
    consumer.after_alloc(taken, ([5, 6], [9, 10]), 40)
    (load,) = consumer.take_step().loads
    assert load.block_ids == ((), (9, 10))
    assert load.blocks_to_write() == {9, 10}
