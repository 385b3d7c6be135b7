"""Digests of a request's KV in logical order, comparable across layouts, block sizes and TP splits.

Each side hashes what it holds of a token range through its own registered layout (``kv_rows``):
per (view roles, layer, global head, K/V), xxh3-64 over the rows of each chunk of ``chunk`` tokens
(chunks start at multiples of ``chunk`` prompt positions, so both sides cut them alike). A windowed
view's series starts at the first token the side holds (``kv_rows.window_firsts``), and the two
sides compare the chunks both cut alike: from the later of their starts when that is a chunk
boundary (or both start there), else from the next boundary. With a ``Grid`` a producer's windowed
series (``gridded``, which a consumer follows) are cut every ``step`` tokens counted back from the
prompt's end (``anchor``) instead, so the two sides share every span but the one straddling the
later start: fewer than ``step`` tokens go uncompared rather than fewer than ``chunk`` (a window
shorter than a chunk was otherwise compared nowhere), for ``chunk / step`` times the digests of a
window. A request's recurrent state (``kv_state``) has one xxh3-64 per logical unit (layer and SSM
head, conv section part, or replicated state). A producer instance's ranks merge their digests; a
consumer rank compares the keys it holds. A mismatch names the row series and the chunk's tokens
(or the state unit), so an operator reads where the bytes went wrong.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvroute.client.kv_rows import RequestKv, RowKey, covered_views, read_rows, roles_of
from kvroute.client.kv_state import StateKey, state_index

DEFAULT_CHUNK = 256  # tokens per digest: a 64-bit digest per chunk and row series on the wire

Span = tuple[int, int]


@dataclass(frozen=True)
class Mismatch:
    """The first series whose digests differ: a row series and the tokens of its first differing
    chunk, or a state unit (``tokens`` None) and, where known (the canary), its first wrong byte."""

    key: RowKey | StateKey
    tokens: Span | None = None
    byte: int | None = None

    def describe(self) -> str:
        if self.tokens is None:
            byte = "" if self.byte is None else f", byte {self.byte}"
            return f"{self.key.label()}{byte}"
        first, stop = self.tokens
        span = f"token {first}" if stop == first + 1 else f"tokens {first}-{stop - 1}"
        return f"{self.key.label()}, {span}"

    def to_json(self) -> dict[str, Any]:
        key = self.key
        if isinstance(key, StateKey):
            state: dict[str, Any] = {"layer": key.layer, "head": key.unit, "state": key.kind}
            if key.kind == "conv":
                state["section"] = key.section
            if self.byte is not None:
                state["byte"] = self.byte
            return {**state, "detail": self.describe()}
        assert self.tokens is not None
        return {
            "layer": key.layer,
            "head": key.head,
            "kv": "K" if key.buffer == 0 else "V",
            "token": self.tokens[0],
            "token_end": self.tokens[1],
            "detail": self.describe(),
        }


@dataclass
class KvDigest:
    """Digests of one token range: row series -> one xxh3-64 per chunk (a windowed series from
    its first held token, ``firsts``), state unit -> one xxh3-64."""

    tokens: Span
    chunk: int
    rows: dict[RowKey, list[int]] = field(default_factory=dict)
    firsts: dict[RowKey, int] = field(default_factory=dict)  # series starting after tokens[0]
    states: dict[StateKey, int] = field(default_factory=dict)
    grid: Grid | None = None  # where the series in ``gridded`` are cut (a windowed view's)
    gridded: set[RowKey] = field(default_factory=set)

    def merge(self, other: KvDigest) -> None:
        """Adds another rank's digests of the same range (replicas of a head agree or mismatch)."""
        if (other.tokens, other.chunk, other.grid) != (self.tokens, self.chunk, self.grid):
            raise ValueError(
                f"digests of {other.tokens} by {other.chunk} ({other.grid}) and {self.tokens} "
                f"by {self.chunk} ({self.grid})"
            )
        self.rows.update(other.rows)
        self.firsts.update(other.firsts)
        self.gridded.update(other.gridded)
        self.states.update(other.states)

    def first(self, key: RowKey) -> int:
        return self.firsts.get(key, self.tokens[0])

    def spans(self, key: RowKey) -> dict[Span, int]:
        """A row series' chunk spans (prompt positions) -> digest."""
        first = self.first(key)
        if first >= self.tokens[1]:
            return {}
        cuts = self._cuts(key, range(first, self.tokens[1]))
        return {(first + a, first + b): d for (a, b), d in zip(cuts, self.rows[key], strict=True)}

    def _cuts(self, key: RowKey, held: range) -> list[tuple[int, int]]:
        if self.grid is None or key not in self.gridded:
            return _cuts(held, self.chunk)
        return self.grid.cuts(held)

    def first_mismatch(self, received: KvDigest) -> Mismatch | None:
        """Compares ``received`` (a consumer's) against these (the producer's) on the series both
        hold, in key order: a row series chunk by chunk over the chunks both cut alike (the same
        tokens), then the state units. A series the producer lacks is not compared. Only a
        series' first span may be the consumer's alone (a window starting later on one side);
        any later one the producer did not cut alike raises, rather than leave received tokens
        unchecked."""
        if received.chunk != self.chunk:
            raise ValueError(f"digests by {received.chunk} compared with {self.chunk}")
        for key in sorted(received.rows.keys() & self.rows.keys()):
            sent = self.spans(key)
            for index, (span, got) in enumerate(received.spans(key).items()):
                if span not in sent:
                    if index:
                        raise ValueError(
                            f"{key.label()}: tokens {span[0]}-{span[1]} are a chunk of the "
                            "consumer's digests the producer did not cut alike"
                        )
                elif sent[span] != got:
                    return Mismatch(key, span)
        for unit in sorted(received.states.keys() & self.states.keys()):
            if received.states[unit] != self.states[unit]:
                return Mismatch(unit)
        return None

    def compared(self, received: KvDigest) -> int:
        """How many digests ``first_mismatch`` compares (zero: nothing was)."""
        chunks = sum(
            len(self.spans(key).keys() & received.spans(key).keys())
            for key in received.rows.keys() & self.rows.keys()
        )
        return chunks + len(received.states.keys() & self.states.keys())

    def window(self, first: int) -> KvDigest:
        """These digests from token ``first`` (a chunk boundary) on: what a consumer that moved
        only a suffix compares with (a series starting later keeps its start; state stays)."""
        if first % self.chunk and first != self.tokens[0]:
            raise ValueError(f"token {first} is not a boundary of {self.chunk}-token chunks")
        cut = KvDigest((first, self.tokens[1]), self.chunk, states=dict(self.states))
        cut.grid, cut.gridded = self.grid, set(self.gridded)
        for key in self.rows:
            kept = [(span, d) for span, d in self.spans(key).items() if span[0] >= first]
            cut.rows[key] = [d for _, d in kept]
            start = kept[0][0][0] if kept else self.tokens[1]
            if start != first:
                cut.firsts[key] = start
        return cut

    def shared(self, received: KvDigest) -> int:
        """How many series (row series and state units) both digests hold."""
        rows = len(received.rows.keys() & self.rows.keys())
        return rows + len(received.states.keys() & self.states.keys())

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "tokens": list(self.tokens),
            "chunk": self.chunk,
            "rows": [[*key, [f"{d:016x}" for d in digests]] for key, digests in self.rows.items()],
        }
        if self.firsts:
            doc["firsts"] = [[*key, first] for key, first in self.firsts.items()]
        if self.states:
            doc["states"] = [[*key, f"{d:016x}"] for key, d in self.states.items()]
        if self.grid is not None:
            series = [list(key) for key in sorted(self.gridded)]
            doc["grid"] = {"step": self.grid.step, "anchor": self.grid.anchor, "series": series}
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> KvDigest:
        first, stop = doc["tokens"]
        rows = {
            _row_key(o, r, layer, h, b): [int(d, 16) for d in digests]
            for o, r, layer, h, b, digests in doc["rows"]
        }
        firsts = {_row_key(o, r, layer, h, b): int(t) for o, r, layer, h, b, t in doc.get(
            "firsts", [])}  # fmt: skip
        states = {
            StateKey(str(o), str(r), str(k), int(layer), int(s), int(u)): int(d, 16)
            for o, r, k, layer, s, u, d in doc.get("states", [])
        }
        digest = cls((int(first), int(stop)), int(doc["chunk"]), rows, firsts, states)
        if (grid := doc.get("grid")) is not None:
            digest.grid = Grid(int(grid["step"]), int(grid["anchor"]))
            digest.gridded = {_row_key(*key) for key in grid["series"]}
        return digest


def _row_key(owner: Any, roles: Any, layer: Any, head: Any, buffer: Any) -> RowKey:
    return RowKey(str(owner), str(roles), int(layer), int(head), int(buffer))


def kv_digest(
    kv: RequestKv,
    chunk: int = DEFAULT_CHUNK,
    *,
    grid: Grid | None = None,
    gridded: Collection[RowKey] | None = None,
) -> KvDigest:
    """A rank's digests of ``kv.tokens`` of one request: a windowed view from its first held token
    on (``kv.firsts``; with a ``grid``, its series cut there: on a producer its own windowed views'
    series, on a consumer those of ``gridded``, the producer's), and the request's state in
    ``kv.state_slot`` when given."""
    tokens = kv.tokens
    digest = KvDigest((tokens.start, tokens.stop), chunk, grid=grid)
    windowed = _windowed_layers(kv) if grid is not None and gridded is None else set()
    for key, rows in read_rows(kv):
        first = tokens.stop - rows.shape[0]
        if first != tokens.start:
            digest.firsts[key] = first
        if grid is not None and (key in gridded if gridded is not None else key[:3] in windowed):
            digest.gridded.add(key)
        flat = rows.reshape(-1)
        width = rows.shape[1]
        digest.rows[key] = [
            xxhash.xxh3_64_intdigest(flat[a * width : b * width].data)
            for a, b in digest._cuts(key, range(first, tokens.stop))
        ]
    if kv.state_slot is not None:
        # Memoryview slices: most units are small, so the cost per unit is the Python around it.
        views = {pool: array.data for pool, array in kv.pools.items()}
        digest.states = {
            unit: xxhash.xxh3_64_intdigest(views[pool][first:end])
            for pool, unit, first, end in state_index(kv.reg, kv.state_slot)
        }
    return digest


def _windowed_layers(kv: RequestKv) -> set[tuple[str, str, int]]:
    """(owner, roles, layer) of the windowed views' series."""
    return {
        (view.owner.value, roles_of(view), slot.layer)
        for view in covered_views(kv.reg)
        if view.view_id in (kv.firsts or {})
        for slot in view.layers
    }


@dataclass(frozen=True, slots=True)
class Grid:
    """Where a windowed series is cut: every ``step`` tokens counted back from ``anchor`` (the
    prompt's length, which both sides know whatever tokens each moved). Two series that start at
    different tokens share every span from the first edge at or after the later start."""

    step: int
    anchor: int

    def cuts(self, held: range) -> list[tuple[int, int]]:
        """Row index ranges of the spans of ``held`` on this grid."""
        below = held.start + (self.anchor - held.start) % self.step  # the first edge >= start
        edges = [held.start, *range(below, held.stop, self.step), held.stop]
        inside = sorted(set(edges))
        return [(a - held.start, b - held.start) for a, b in itertools.pairwise(inside)]


def _cuts(tokens: range, chunk: int) -> list[tuple[int, int]]:
    """Row index ranges of each chunk of ``tokens`` (chunk boundaries at multiples of ``chunk``)."""
    edges = [tokens.start, *range((tokens.start // chunk + 1) * chunk, tokens.stop, chunk)]
    edges.append(tokens.stop)
    return [(a - tokens.start, b - tokens.start) for a, b in itertools.pairwise(edges)]
