"""The prompts the real P/D tests compare, and the hand-over they make without the proxy."""

from __future__ import annotations

import http.client
import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tests.realpd.cluster import MODEL_NAME, post

MAX_TOKENS = 24
VOCAB = (2, 300)  # token ids the tiny tokenizer has, less <s> and </s>


def prompts() -> list[list[int]]:
    """40 prompts: 1 token, partial blocks, exact multiples of 32 and 64, several blocks, and two
    families sharing 64- and 96-token prefixes (prefix hits on either engine)."""
    rng = random.Random(29)
    lengths = [1, 2, 5, 17, 31, 32, 33, 47, 63, 64, 65, 95, 96, 97, 127, 128, 129, 160, 191, 192,
               193, 255, 256, 257, 287, 300, 319, 320, 321, 383]  # fmt: skip
    found = [[rng.randrange(*VOCAB) for _ in range(n)] for n in lengths]
    for shared in (64, 96):
        prefix = [rng.randrange(*VOCAB) for _ in range(shared)]
        found += [prefix + [rng.randrange(*VOCAB) for _ in range(n)] for n in (0, 1, 7, 32, 45)]
    return found


def body(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip


def tokens(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def single(url: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    status, answer = post(f"{url}/v1/completions", body(prompt, max_tokens=max_tokens))
    assert status == 200, answer
    return tokens(answer)


def proxied(url: str, prompt: list[int], *, stream: bool = False) -> tuple[str, list[int]]:
    """(the consumer that served it, its token ids) through ``kvroute proxy``; a stream's token
    ids are read from its chunks."""
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body(prompt, stream=stream)).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as answer:
        consumer = answer.headers["X-Kvroute-Consumer"]
        if not stream:
            return consumer, tokens(json.load(answer))
        found: list[int] = []
        for line in answer.read().decode().splitlines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: ") :])
                assert "error" not in chunk, chunk
                found += chunk["choices"][0].get("token_ids") or []
        return consumer, found


def handover(
    producer: str, consumer: str, prompt: list[int], max_tokens: int = MAX_TOKENS
) -> list[int]:
    """What the proxy does, by hand: prefill on ``producer``, decode on ``consumer``."""
    prefill = body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    status, answer = post(f"{producer}/v1/completions", prefill)
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    decode = body(prompt, max_tokens=max_tokens, kv_transfer_params=params)
    status, answer = post(f"{consumer}/v1/completions", decode)
    assert status == 200, answer
    return tokens(answer)


def run_all(fn: Any, items: list[list[int]], concurrency: int = 8) -> list[list[int]]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(fn, items))


def abandoned(producer: str, consumer: str, prompt: list[int], after_s: float) -> list[int] | None:
    """A hand-over whose client hangs up on the consumer after ``after_s`` (vLLM aborts the
    request): None if it did, the token ids if the answer came first."""
    prefill = body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    status, answer = post(f"{producer}/v1/completions", prefill)
    assert status == 200, answer
    decode = body(prompt, kv_transfer_params=answer["kv_transfer_params"])
    host, port = consumer.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("POST", "/v1/completions", json.dumps(decode),
                           {"Content-Type": "application/json"})  # fmt: skip
        assert connection.sock is not None
        connection.sock.settimeout(max(after_s, 0.001))  # then hang up, unanswered
        return tokens(json.load(connection.getresponse()))
    except TimeoutError:
        return None
    finally:
        connection.close()
