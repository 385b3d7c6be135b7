"""``KvrouteConnector`` over a faulty transport: a consumer that loads this module (its
``kv_connector_module_path``) finds one byte of every block it pulls corrupted.

The fault sits where a transport's would show: a NIXL read reports DONE and one byte of what it
wrote is wrong, before anyone looks at the bytes (the digest comparison of a sampled request, the
canary check of a path, or the engine's attention for an unchecked request). It XORs the top
exponent bit of the first float32 of the first pool's first written block (head 0, K, that
block's first token, dimension 0): the value becomes ~2^128 times too large or too small, so an
attention that reads it cannot answer the single engine's tokens.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping

from kvroute.client.nixl_descs import PoolAddress
from kvroute.client.nixl_transport import PendingPull
from kvroute.engines.vllm import KvrouteConnector, KvrouteMetadata
from kvroute.engines.vllm.pulls import Load, Pulls, _Producer

__all__ = ["KvrouteConnector", "KvrouteMetadata"]

FLIPPED_BYTE, FLIPPED_BITS = 3, 0x40  # float32, little-endian: the top exponent bit


def corrupt(addresses: Mapping[int, PoolAddress], block: int) -> None:
    at = addresses[min(addresses)]
    byte = ctypes.c_uint8.from_address(at.base + block * at.slot_stride + FLIPPED_BYTE)
    byte.value ^= FLIPPED_BITS


class CorruptedOnArrival:
    """A pull whose reads arrive with one byte wrong: corrupted once, when they report DONE."""

    def __init__(self, pending: PendingPull, damage: Callable[[], None]) -> None:
        self.pending, self.damage = pending, damage
        self.damaged = False

    def state(self) -> str:
        state = self.pending.state()
        if state == "DONE" and not self.damaged:
            self.damage()
            self.damaged = True
        return state

    def release(self) -> None:
        self.pending.release()


def _post(self: Pulls, load: Load, producer: _Producer) -> None:
    _POST(self, load, producer)
    running = self.running.get(load.request_id)
    if running is not None:
        first = load.block_ids[0][load.tokens[0] // load.block_size]
        damage = lambda: corrupt(self.addresses, first)  # noqa: E731
        running.pending = CorruptedOnArrival(running.pending, damage)  # type: ignore[assignment]


_POST = Pulls._post
Pulls._post = _post  # type: ignore[method-assign]
