"""Digests of a request's KV in logical order, comparable across layouts, block sizes and TP splits.

Each side hashes what it holds of a token range through its own registered layout (``kv_rows``):
per (view roles, layer, global head, K/V), xxh3-64 over the rows of each chunk of ``chunk`` tokens
(chunks start at multiples of ``chunk`` prompt positions, so both sides cut them alike). A producer
instance's ranks merge their digests; a consumer rank compares the keys it holds. A mismatch names
the row series and the chunk's tokens, so an operator reads where the bytes went wrong.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from kvroute.client.kv_rows import RowKey, read_rows
from kvroute.geometry import RankRegistration

DEFAULT_CHUNK = 256  # tokens per digest: a 64-bit digest per chunk and row series on the wire


@dataclass(frozen=True)
class Mismatch:
    """The first row series whose digests differ, and the tokens of its first differing chunk."""

    key: RowKey
    tokens: tuple[int, int]

    def describe(self) -> str:
        first, stop = self.tokens
        span = f"token {first}" if stop == first + 1 else f"tokens {first}-{stop - 1}"
        return f"{self.key.label()}, {span}"

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.key.layer,
            "head": self.key.head,
            "kv": "K" if self.key.buffer == 0 else "V",
            "token": self.tokens[0],
            "token_end": self.tokens[1],
            "detail": self.describe(),
        }


@dataclass
class KvDigest:
    """Digests of one token range: row series -> one xxh3-64 per chunk."""

    tokens: tuple[int, int]
    chunk: int
    rows: dict[RowKey, list[int]] = field(default_factory=dict)

    def merge(self, other: KvDigest) -> None:
        """Adds another rank's digests of the same range (replicas of a head agree or mismatch)."""
        if (other.tokens, other.chunk) != (self.tokens, self.chunk):
            raise ValueError(f"digests of {other.tokens} by {other.chunk} and {self.tokens}")
        self.rows.update(other.rows)

    def first_mismatch(self, received: KvDigest) -> Mismatch | None:
        """Compares ``received`` (a consumer's) against these (the producer's) on the series both
        hold, in key order; a series the producer lacks is not compared."""
        if (received.tokens, received.chunk) != (self.tokens, self.chunk):
            raise ValueError(f"digests of {received.tokens} compared with {self.tokens}")
        for key in sorted(received.rows.keys() & self.rows.keys()):
            for index, (want, got) in enumerate(
                zip(self.rows[key], received.rows[key], strict=True)
            ):
                if want != got:
                    return Mismatch(key, self._chunk_tokens(index))
        return None

    def window(self, first: int) -> KvDigest:
        """These digests from token ``first`` (a chunk boundary) on: what a consumer that moved
        only a suffix compares with."""
        if first % self.chunk and first != self.tokens[0]:
            raise ValueError(f"token {first} is not a boundary of {self.chunk}-token chunks")
        skip = len(_cuts(range(self.tokens[0], first), self.chunk)) if first > self.tokens[0] else 0
        rows = {key: digests[skip:] for key, digests in self.rows.items()}
        return KvDigest((first, self.tokens[1]), self.chunk, rows)

    def shared(self, received: KvDigest) -> int:
        """How many row series both digests hold (zero: nothing was compared)."""
        return len(received.rows.keys() & self.rows.keys())

    def _chunk_tokens(self, index: int) -> tuple[int, int]:
        first = self.tokens[0] // self.chunk * self.chunk + index * self.chunk
        return max(first, self.tokens[0]), min(first + self.chunk, self.tokens[1])

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens": list(self.tokens),
            "chunk": self.chunk,
            "rows": [[*key, [f"{d:016x}" for d in digests]] for key, digests in self.rows.items()],
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> KvDigest:
        first, stop = doc["tokens"]
        rows = {
            RowKey(str(o), str(r), int(layer), int(h), int(b)): [int(d, 16) for d in digests]
            for o, r, layer, h, b, digests in doc["rows"]
        }
        return cls((int(first), int(stop)), int(doc["chunk"]), rows)


def kv_digest(
    reg: RankRegistration,
    pools: Mapping[int, np.ndarray],
    blocks: Sequence[int],
    tokens: range,
    chunk: int = DEFAULT_CHUNK,
) -> KvDigest:
    """A rank's digests of ``tokens`` of one request (``blocks``: its block list, ``pools``: flat
    uint8 arrays of the rank's pools)."""
    digest = KvDigest((tokens.start, tokens.stop), chunk)
    cuts = _cuts(tokens, chunk)
    for key, rows in read_rows(reg, pools, blocks, tokens):
        flat = rows.reshape(-1)
        width = rows.shape[1]
        digest.rows[key] = [
            xxhash.xxh3_64_intdigest(flat[a * width : b * width].data) for a, b in cuts
        ]
    return digest


def _cuts(tokens: range, chunk: int) -> list[tuple[int, int]]:
    """Row index ranges of each chunk of ``tokens`` (chunk boundaries at multiples of ``chunk``)."""
    edges = [tokens.start, *range((tokens.start // chunk + 1) * chunk, tokens.stop, chunk)]
    edges.append(tokens.stop)
    return [(a - tokens.start, b - tokens.start) for a, b in itertools.pairwise(edges)]
