"""Producer and consumer KvrouteConnectors in separate processes, driven by vLLM's Scheduler.

The producer process prefills requests with vLLM's scheduler and fills the blocks it allocated
with the pattern (``engine.pattern``); the handover travels in ``kv_transfer_params`` as a proxy
carries it; the consumer's scheduler asks its connector, the connector's workers pull through
kvroute's plan over NIXL (UCX on loopback, host memory), and every pulled byte is checked against
the pattern: TP2 -> TP1 with 16- and 32-token blocks, TP3 -> TP2 with 6 KV heads, a prefix-cache
hit that moves only the suffix, a pull from a producer whose NIXL agent is gone, and a pull from a
producer restarted under the same name.

vLLM (and the connector and ``tests.engines.engine``, which import it) is imported by the tests and
helpers that use it, not at module level: only the pytest-xdist worker running these tests pays for
it, not every worker collecting them.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("nixl._api", reason="nixl is not installed")

from tests.client.live import WORKER_TOKEN, LiveServer, live_server_in
from tests.engines import require_vllm, vllm_producer
from tests.world import true_heads

require_vllm()
torch = pytest.importorskip("torch")

if TYPE_CHECKING:
    from tests.engines.engine import Engine

pytestmark = pytest.mark.slow
REPLY_S = 240.0  # the producer process imports vLLM first (tens of seconds on a loaded machine)
LLAMA4 = {"num_key_value_heads": 4, "num_hidden_layers": 2, "head_dim": 32}
LLAMA6 = {"num_attention_heads": 12, "hidden_size": 384, "num_key_value_heads": 6,
          "num_hidden_layers": 2, "head_dim": 32}  # fmt: skip
PRODUCERS = [
    {"deployment": "llama4", "instance": "p-tp2", "model": LLAMA4, "tp": 2, "heads": 4, "block_size": 16},
    {"deployment": "llama4", "instance": "p-gone", "model": LLAMA4, "tp": 1, "heads": 4, "block_size": 16},
    {"deployment": "llama6", "instance": "p-tp3", "model": LLAMA6, "tp": 3, "heads": 6, "block_size": 16},
    {"deployment": "llama4", "instance": "p-again", "model": LLAMA4, "tp": 2, "heads": 4, "block_size": 16},
    {"deployment": "llama4", "instance": "p-digest", "model": LLAMA4, "tp": 2, "heads": 4, "block_size": 16,
     "extra": {"kv_digest_rate": 1.0}},
    {"deployment": "llama4", "instance": "p-canary", "model": LLAMA4, "tp": 2, "heads": 4, "block_size": 16},
]  # fmt: skip


class Producers:
    def __init__(self, commands: Any, replies: Any) -> None:
        self.commands, self.replies = commands, replies

    def ask(self, *command: Any) -> tuple[Any, ...]:
        self.commands.put(command)
        reply = self.replies.get(timeout=REPLY_S)
        assert reply[0] != "error", reply[1]
        return reply


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Producers, Path]]:
    root = tmp_path_factory.mktemp("vllm-pd")
    server = live_server_in(tmp_path_factory.mktemp("kvroute")).start()
    context = multiprocessing.get_context("spawn")
    commands, replies = context.Queue(), context.Queue()
    process = context.Process(
        target=vllm_producer.serve,
        args=(server.url, WORKER_TOKEN, str(root), PRODUCERS, commands, replies),
        daemon=True,
    )
    process.start()
    try:
        ready = replies.get(timeout=REPLY_S)
        assert ready == ("ready", ["p-again", "p-canary", "p-digest", "p-gone", "p-tp2", "p-tp3"])
        yield server, Producers(commands, replies), root
    finally:
        commands.put(("stop",))
        process.join(timeout=60)
        server.stop()
    assert process.exitcode == 0


def consumer(world: Any, deployment: str, instance: str, *, tp: int, heads: int, block_size: int,
             model: dict[str, Any]) -> Engine:  # fmt: skip
    from tests.engines.engine import Engine
    from tests.engines.vllm_world import model_dir

    server, _, root = world
    extra = {"url": server.url, "token": WORKER_TOKEN, "deployment": deployment,
             "instance": instance, "pull_timeout_s": 5}  # fmt: skip
    directory = model_dir(root, f"{deployment}-consumer", **model)
    return Engine.start(directory, role="kv_consumer", extra=extra, tp=tp, total_heads=heads,
                        block_size=block_size)  # fmt: skip


@pytest.fixture(scope="module")
def llama4_consumer(world: Any) -> Iterator[Engine]:
    engine = consumer(world, "llama4", "d-tp1", tp=1, heads=4, block_size=32, model=LLAMA4)
    yield engine
    engine.close()


def pull(
    engine: Engine, request_id: str, tokens: list[int], params: dict, pause_s: float = 0.0
) -> tuple[Any, set[int]]:
    """Schedules the handed-over request and polls every worker until its load ended (after
    ``pause_s``: no worker looks at the pull before then)."""
    from vllm.v1.request import RequestStatus

    request = engine.request(request_id, tokens, params)
    output = engine.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    time.sleep(pause_s)
    ended, errors = set(), set()
    deadline = time.monotonic() + 30
    while len(ended) < len(engine.workers) and time.monotonic() < deadline:
        for rank, worker in enumerate(engine.workers):
            _, received = worker.get_finished(set())
            errors |= worker.get_block_ids_with_load_errors()
            if received and request_id in received:
                ended.add(rank)
        time.sleep(0.01)
    assert ended == set(range(len(engine.workers))), "the pull never ended"
    return output, errors


def expect(engine: Engine, request_id: str, positions: range, marker: int = 0) -> None:
    from tests.engines.engine import pattern

    blocks = engine.block_ids(request_id)
    tokens = torch.tensor(list(positions))
    for rank in range(engine.tp):
        heads = true_heads(engine.total_heads, engine.tp, rank)
        for layer, got in enumerate(engine.read(rank, blocks, positions)):
            assert torch.equal(got, pattern(layer, heads, tokens, marker)), (rank, layer)


def test_tp2_producer_to_tp1_consumer_with_larger_blocks(
    world: Any, llama4_consumer: Engine
) -> None:
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    _, producers, _ = world
    tokens = list(range(100, 140))
    tag, _, params = producers.ask("prefill", "p-tp2", "prefill-1", tokens)
    assert tag == "params"
    assert params["remote_instance"] == "p-tp2"
    assert params["prompt_tokens"] == 40
    assert params["remote_first_token"] == 0
    assert 0 < params["kvroute_expires_at"] - time.time() <= vllm_producer.WAIT_S  # its hold
    assert [len(group) for group in params["remote_block_ids"]] == [3]  # 40 tokens, 16 per block
    output, errors = pull(llama4_consumer, "decode-1", tokens, params)
    assert errors == set()
    expect(llama4_consumer, "decode-1", range(40))
    assert producers.ask("await_sent", "p-tp2", "prefill-1") == ("sent", "prefill-1", [0, 1])
    # vLLM takes the load: the request resumes with only its last prompt token to compute.
    llama4_consumer.scheduler.update_from_output(
        output,
        ModelRunnerOutput(
            req_ids=[], kv_connector_output=KVConnectorOutput(finished_recving={"decode-1"})
        ),
    )  # fmt: skip
    resumed = llama4_consumer.scheduler.schedule()
    assert resumed.num_scheduled_tokens == {"decode-1": 1}
    llama4_consumer.finish_prefill(resumed, "decode-1")
    # The first pairing pulled the producer's canary (vLLM's null block) and attested the path.
    path = reported_path(world, "p-tp2", "d-tp1", llama4_consumer)
    assert (path.state, path.source, path.element) == ("attested", "canary", None)
    assert path.cost_ms is not None


def reported_path(
    world: Any,
    producer: str,
    consumer: str,
    engine: Engine,
    state: str | None = None,
    source: str | None = None,
) -> Any:
    """The path's outcome once the consumer has reported it (in ``state``, from ``source``, when
    given). The consumer checks a canary off the step, round by round as its workers are polled
    (an engine's steps; here this loop's), and reports a path after it answered vLLM, on a thread
    of its own, so a report may land after the pull the test waited for."""
    from kvroute.client import KvrouteClient

    server, _, _ = world
    deadline = time.monotonic() + 30
    with KvrouteClient(server.url, token=WORKER_TOKEN) as client:
        while time.monotonic() < deadline:
            for worker in engine.workers:
                worker.get_finished(set())
            paths = client.kv_paths("llama4").paths
            found = [p for p in paths if (p.producer, p.consumer) == (producer, consumer)]
            if found and state in (None, found[0].state) and source in (None, found[0].source):
                return found[0]
            time.sleep(0.05)
    raise AssertionError(f"no {state or ''} outcome of {producer} -> {consumer}")


def canaries_checked(engine: Engine) -> None:
    """Polls the engine's workers until no canary is being pulled or checked."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        runs = [worker.worker.pulls.canaries for worker in engine.workers]
        if all(run is None or run.idle() for run in runs):
            return
        for worker in engine.workers:
            worker.get_finished(set())
        time.sleep(0.05)
    raise AssertionError("a canary was still being checked after 30 s")


def test_a_prefix_cache_hit_on_the_consumer_moves_only_the_suffix(
    world: Any, llama4_consumer: Engine
) -> None:
    from vllm.v1.request import RequestStatus

    _, producers, _ = world
    prefix = list(range(500, 532))  # one consumer block of 32 tokens
    local = llama4_consumer.request("local-2", [*prefix, 999], None)
    output = llama4_consumer.step()
    llama4_consumer.fill(llama4_consumer.block_ids("local-2"), range(33), marker=1)
    llama4_consumer.finish_prefill(output, "local-2")
    assert local.status == RequestStatus.FINISHED_LENGTH_CAPPED  # its full block stays cached
    tokens = [*prefix, *range(600, 616)]
    _, _, params = producers.ask("prefill", "p-tp2", "prefill-2", tokens)
    _, errors = pull(llama4_consumer, "decode-2", tokens, params)
    assert errors == set()
    expect(llama4_consumer, "decode-2", range(32), marker=1)  # the local hit, untouched
    expect(llama4_consumer, "decode-2", range(32, 48))  # the suffix, from the producer
    assert producers.ask("await_sent", "p-tp2", "prefill-2") == ("sent", "prefill-2", [0, 1])


def test_tp3_producer_to_tp2_consumer_with_six_kv_heads(world: Any) -> None:
    _, producers, _ = world
    engine = consumer(world, "llama6", "d-tp2", tp=2, heads=6, block_size=8, model=LLAMA6)
    try:
        tokens = list(range(200, 237))
        _, _, params = producers.ask("prefill", "p-tp3", "prefill-3", tokens)
        _, errors = pull(engine, "decode-3", tokens, params)
        assert errors == set()
        expect(engine, "decode-3", range(37))  # rank 0 holds heads 0-2, rank 1 heads 3-5
        assert producers.ask("await_sent", "p-tp3", "prefill-3") == ("sent", "prefill-3", [0, 1, 2])
    finally:
        engine.close()


def test_a_pull_from_a_producer_that_is_gone_is_a_load_error(
    world: Any, llama4_consumer: Engine
) -> None:
    _, producers, _ = world
    tokens = list(range(300, 340))
    _, _, params = producers.ask("prefill", "p-gone", "prefill-4", tokens)
    assert producers.ask("drop", "p-gone") == ("dropped", "p-gone")
    _, errors = pull(llama4_consumer, "decode-4", tokens, params)
    assert errors == set(llama4_consumer.block_ids("decode-4"))  # 40 tokens: both blocks
    assert len(errors) == 2


def test_a_pull_seen_done_only_after_the_producer_s_hold_ended_is_a_load_error(
    world: Any, llama4_consumer: Engine
) -> None:
    """The hand-over is still held when the consumer schedules it, but its pull is seen done only
    after the producer's stated end of hold: a read may have landed after the producer freed the
    block, so the blocks are recomputed, not trusted (``clock_skew_s`` 1 s by default)."""
    _, producers, _ = world
    tokens = list(range(400, 440))
    _, _, params = producers.ask("prefill", "p-tp2", "prefill-10", tokens)
    brief = {**params, "kvroute_expires_at": time.time() + 1.0 + 0.4}
    # Past the hold before any worker looks at its pull.
    _, errors = pull(llama4_consumer, "decode-10", tokens, brief, pause_s=0.6)
    assert errors == set(llama4_consumer.block_ids("decode-10"))
    assert len(errors) == 2


def test_a_refused_pairing_stops_start_up_with_the_refusal(world: Any) -> None:
    """A consumer whose KV heads are 64 wide (the producers' are 32) never starts."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvroute.engines.vllm import RegistrationRefused
    from tests.engines.engine import layer_name
    from tests.engines.vllm_world import allocate, cache_config, model_dir, vllm_config

    server, _, root = world
    extra = {"url": server.url, "token": WORKER_TOKEN, "deployment": "llama4",
             "instance": "d-wide"}  # fmt: skip
    config = vllm_config(model_dir(root, "llama4-wide", **LLAMA4), role="kv_consumer", extra=extra)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float16)
    kv_cache_config = cache_config(config, {layer_name(i): spec for i in range(2)}, 12)
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
    with pytest.raises(RegistrationRefused) as refused:
        connector.register_kv_caches(allocate(config, kv_cache_config))
    error = refused.value.error
    assert (error.status, error.field) == (409, "attention.head_dim")
    assert (error.local, error.peer) == (64, 32)
    assert error.code in str(refused.value)
    assert "local 64, peer 32" in str(refused.value)


def test_sampled_digests_agree_and_a_byte_flipped_after_the_write_is_recomputed(
    world: Any, llama4_consumer: Engine
) -> None:
    """A producer sampling every request (``kv_digest_rate`` 1): its TP2 ranks digest the blocks
    they hold, the TP1 consumer (32-token blocks) compares what it pulled, head by head. A bit
    flipped in a producer block after its digest makes the request's blocks load errors."""
    from kvroute.client import KvrouteClient

    server, producers, _ = world
    tokens = list(range(700, 740))
    _, _, params = producers.ask("prefill", "p-digest", "prefill-5", tokens)
    assert params["kvroute_digest"] is True
    _, errors = pull(llama4_consumer, "decode-5", tokens, params)
    assert errors == set()
    expect(llama4_consumer, "decode-5", range(40))
    # The canary of the first pairing and this request's digest both attest the path; the
    # canary's rounds end before the fault, so its report cannot follow the digest's failure.
    path = reported_path(world, "p-digest", "d-tp1", llama4_consumer, "attested")
    assert path.source in ("canary", "digest")
    canaries_checked(llama4_consumer)
    _, _, params = producers.ask("prefill", "p-digest", "prefill-6", tokens)
    # Rank 1 holds global heads 2 and 3; token 20, layer 1, its head 0 (global 2), K element 5.
    assert producers.ask("flip", "p-digest", "prefill-6", (1, 1, 0, 20, 5)) == (
        "flipped",
        "prefill-6",
    )
    _, errors = pull(llama4_consumer, "decode-6", tokens, params)
    assert errors == set(llama4_consumer.block_ids("decode-6"))  # recomputed, not decoded from
    path = reported_path(world, "p-digest", "d-tp1", llama4_consumer, "failed")
    assert path.source == "digest"
    assert path.element is not None
    assert (path.element["layer"], path.element["head"], path.element["kv"]) == (1, 2, "K")
    with KvrouteClient(server.url, token=WORKER_TOKEN) as client:
        pairs = client.pairs("llama4", generation="d-tp1").generation[0]
        assert {e.context: e.code for e in pairs.excluded}.get("p-digest") == "kv_path_failed"


def test_a_byte_flipped_in_the_producer_s_canary_fails_the_path_and_its_pairing(
    world: Any, llama4_consumer: Engine
) -> None:
    """A fault in the canary block (vLLM's null block) of a producer no consumer has paired with
    yet: the consumer's first hand-over from it pulls the canary with the real plan and NIXL,
    names the flipped element, and reports the path failed, so the pairs answer (and the proxy)
    leaves the pair out. The request itself moved right bytes (its blocks are not the canary's)."""
    from kvroute.client import KvrouteClient

    server, producers, _ = world
    # Rank 1 holds global heads 2 and 3; canary token 3, layer 1, its head 0 (global 2), K
    # element 5.
    assert producers.ask("flip_canary", "p-canary", (1, 1, 0, 3, 5)) == ("flipped", "canary")
    tokens = list(range(800, 840))
    _, _, params = producers.ask("prefill", "p-canary", "prefill-canary", tokens)
    _, errors = pull(llama4_consumer, "decode-canary", tokens, params)
    assert errors == set()
    expect(llama4_consumer, "decode-canary", range(40))
    path = reported_path(world, "p-canary", "d-tp1", llama4_consumer, "failed")
    assert path.source == "canary"
    assert path.element is not None
    element = (path.element["layer"], path.element["head"], path.element["kv"])
    assert (*element, path.element["token"]) == (1, 2, "K", 3), path.element
    with KvrouteClient(server.url, token=WORKER_TOKEN) as client:
        pairs = client.pairs("llama4", generation="d-tp1").generation[0]
        assert {e.context: e.code for e in pairs.excluded}.get("p-canary") == "kv_path_failed"


def test_a_request_aborted_before_its_load_frees_the_producer_s_blocks_at_once(
    world: Any, llama4_consumer: Engine
) -> None:
    """The consumer's scheduler releases the handover of a request that ended before its load was
    asked; every consumer rank tells every producer rank, which frees the blocks well before its
    send timeout (120 s here; ``await_sent`` waits 60 s at most)."""
    from vllm.v1.request import RequestStatus

    _, producers, _ = world
    tokens = list(range(800, 845))
    _, _, params = producers.ask("prefill", "p-tp2", "prefill-7", tokens)
    request = llama4_consumer.request("decode-7", tokens, params)
    llama4_consumer.scheduler.finish_requests("decode-7", RequestStatus.FINISHED_ABORTED)
    assert request.status == RequestStatus.FINISHED_ABORTED
    started = time.monotonic()
    output = llama4_consumer.step()
    assert output.kv_connector_metadata.step.releases[0].request_id == "prefill-7"
    deadline = time.monotonic() + 30  # a release waits for the producer's plan, if unfetched
    while time.monotonic() < deadline:
        for worker in llama4_consumer.workers:
            worker.get_finished(set())
        if not any(worker.worker.pulls.releasing for worker in llama4_consumer.workers):
            break
        time.sleep(0.01)
    assert producers.ask("await_sent", "p-tp2", "prefill-7") == ("sent", "prefill-7", [0, 1])
    assert time.monotonic() - started < 60


def test_a_producer_restarted_under_its_name_is_pulled_from_as_the_new_engine(
    world: Any, llama4_consumer: Engine
) -> None:
    """p-again (TP2) is pulled from, then killed and started again under the same name: a new
    vLLM engine id, new NIXL agents and memory, a new generation. Its hand-over names the new
    engine, and the consumer pulls the new engine's bytes, never the old agents'."""
    _, producers, _ = world
    tokens = list(range(900, 940))
    _, _, before = producers.ask("prefill", "p-again", "prefill-8", tokens)
    _, errors = pull(llama4_consumer, "decode-8", tokens, before)
    assert errors == set()
    assert producers.ask("await_sent", "p-again", "prefill-8") == ("sent", "prefill-8", [0, 1])
    assert producers.ask("restart", "p-again") == ("restarted", "p-again")
    _, _, after = producers.ask("prefill", "p-again", "prefill-9", tokens)
    assert after["remote_engine_id"] != before["remote_engine_id"]
    _, errors = pull(llama4_consumer, "decode-9", tokens, after)
    assert errors == set()
    expect(llama4_consumer, "decode-9", range(40))
    assert producers.ask("await_sent", "p-again", "prefill-9") == ("sent", "prefill-9", [0, 1])
