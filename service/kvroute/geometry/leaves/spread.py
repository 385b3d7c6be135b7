"""Context parallelism: which prompt tokens a CP rank holds, and where in its own cache.

An interleaved spread of ``size`` CP ranks by ``interleave`` tokens (N) deals the prompt out in
chunks of N tokens, round robin: token ``i`` lives on CP rank ``(i // N) % size``, at local
position ``(i // (N * size)) * N + i % N`` of that rank's cache (vLLM's decode context parallel
with ``dcp_kv_cache_interleave_size = N``; TensorRT-LLM helix, where a rank owns global blocks
``[cp_rank :: cp_size]``, is N = tokens per block). It is periodic, so one plan serves every prompt.

A chunked spread (prefill ring attention) splits one prompt of ``prompt`` tokens into ``k`` chunks,
``k = size`` (contiguous) or ``2 * size`` (zig-zag: rank ``r`` holds chunks ``r`` and
``2 * size - 1 - r``, as Megatron/TransformerEngine and ring-flash-attention balance causal
attention). Chunk ``j`` starts at ``j * (P // k) + min(j, P % k)`` (``numpy.array_split`` and
``torch.tensor_split``: the first ``P % k`` chunks hold one token more; with ``k`` dividing ``P``,
the equal chunks those engines require). A rank lays its chunks back to back in token order from
local position 0, as the engines concatenate a rank's sequence shard. Its placement depends on the
prompt's length, so plans of a chunked sender are built per prompt length, and no token past the
prompt is placed (the decode side places generated tokens by its own layout).

The CP ranks of one TP position share the request's block table: block id ``b`` of the list holds
local positions ``[b * tpb, (b + 1) * tpb)`` on every CP rank, so one list serves all of them.
Without context parallelism the spread is the identity (one rank, every token at its own position).

Everything here is arithmetic on one rank's spread; ``periods`` cuts plans with it and ``ranges``
places block lists with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

INTERLEAVED = "interleaved"
CHUNKED = ("contiguous", "zigzag")
Run = tuple[int, int, int]  # first token, end token, local position of the first token


def chunk_starts(prompt: int, chunks: int) -> list[int]:
    """The first token of each of ``chunks`` chunks of a prompt, and the prompt's end."""
    size, extra = divmod(prompt, chunks)
    return [j * size + min(j, extra) for j in range(chunks + 1)]


@lru_cache(maxsize=4096)
def chunk_runs(layout: str, size: int, prompt: int) -> tuple[tuple[Run, ...], ...]:
    """Per CP rank, the non-empty chunks it holds in token order, each with its local start."""
    zigzag = layout == "zigzag"
    starts = chunk_starts(prompt, 2 * size if zigzag else size)
    ranks = []
    for rank in range(size):
        chunks = (rank, 2 * size - 1 - rank) if zigzag else (rank,)
        runs: list[Run] = []
        local = 0
        for chunk in chunks:
            first, end = starts[chunk], starts[chunk + 1]
            if runs and runs[-1][1] == first:  # zig-zag's middle rank: two adjacent chunks
                runs[-1] = (runs[-1][0], end, runs[-1][2])
            elif first < end:
                runs.append((first, end, local))
            local += end - first
        ranks.append(tuple(runs))
    return tuple(ranks)


@dataclass(frozen=True, slots=True)
class Spread:
    """The tokens CP rank ``rank`` of ``size`` holds: dealt out ``interleave`` at a time, or in
    ``layout`` chunks of a prompt of ``prompt`` tokens."""

    size: int = 1
    rank: int = 0
    interleave: int = 1
    layout: str = INTERLEAVED
    prompt: int = 0  # chunked layouts only: the prompt length the chunks split

    @property
    def trivial(self) -> bool:
        return self.size == 1

    @property
    def chunked(self) -> bool:
        return self.size > 1 and self.layout != INTERLEAVED

    @property
    def cycle(self) -> int:
        """Tokens of one round of the deal: every CP rank gets one chunk."""
        return self.interleave * self.size

    def runs(self, rank: int | None = None) -> tuple[Run, ...]:
        """A chunked rank's chunks (this rank by default)."""
        return chunk_runs(self.layout, self.size, self.prompt)[self.rank if rank is None else rank]

    def held(self, rank: int | None = None) -> int:
        """Prompt tokens a chunked rank holds (this rank by default)."""
        return sum(end - first for first, end, _ in self.runs(rank))

    def period(self, tokens_per_block: int) -> int:
        """Prompt tokens after which the rank's blocks repeat the same placement. A chunked
        placement never repeats: its one period is ``size`` times the most local blocks any rank
        fills, which covers the whole prompt."""
        if self.size == 1:  # one rank holds every token in order, whatever the interleave
            return tokens_per_block
        if self.chunked:
            most = max(self.held(rank) for rank in range(self.size))
            return self.size * tokens_per_block * max(1, -(-most // tokens_per_block))
        return self.size * math.lcm(self.interleave, tokens_per_block)

    def holds(self, token: int) -> bool:
        if self.chunked:
            return any(first <= token < end for first, end, _ in self.runs())
        return (token // self.interleave) % self.size == self.rank

    def local(self, token: int) -> int:
        """The local cache position of a token this rank holds."""
        if self.chunked:
            first, _, local = next(run for run in self.runs() if run[0] <= token < run[1])
            return local + token - first
        n = self.interleave
        return token // self.cycle * n + token % n

    def token(self, local: int, rank: int | None = None) -> int:
        """The prompt token at a local position of ``rank`` (this rank by default). Past a chunked
        rank's last token the positions count on from the prompt's end (no token lives there)."""
        if self.chunked:
            for first, end, start in self.runs(rank):
                if local < start + end - first:
                    return first + local - start
            return self.prompt + local - self.held(rank)
        n, rank = self.interleave, self.rank if rank is None else rank
        return local // n * self.cycle + rank * n + local % n

    def count(self, end: int, rank: int | None = None) -> int:
        """How many of the tokens before ``end`` ``rank`` holds (this rank by default)."""
        if self.chunked:
            return sum(min(max(end - first, 0), last - first) for first, last, _ in self.runs(rank))
        n, rank = self.interleave, self.rank if rank is None else rank
        rounds, rest = divmod(end, self.cycle)
        return rounds * n + min(max(rest - rank * n, 0), n)

    def next_held(self, token: int) -> int | None:
        """The first token at or after ``token`` this rank holds (None: a chunked rank holds none)."""
        if self.chunked:
            return next((max(token, first) for first, end, _ in self.runs() if token < end), None)
        return self.token(self.count(token))

    def run_end(self, token: int) -> int | None:
        """The end of the run of consecutive local positions holding ``token`` (which this rank
        holds): its interleave chunk or its prompt chunk; None without CP (no end)."""
        if self.size == 1:
            return None
        if self.chunked:
            return next(end for first, end, _ in self.runs() if first <= token < end)
        return token + self.interleave - token % self.interleave

    def first_block(self, first_token: int, tokens_per_block: int) -> int:
        """The first local block a shared list starting at prompt token ``first_token`` names: the
        block of the earliest local position any CP rank needs from that token on (a chunked rank
        holding no token from there on needs none)."""
        counts = [self.count(first_token, rank) for rank in range(self.size)]
        if self.chunked:
            needing = [n for rank, n in enumerate(counts) if n < self.held(rank)]
            counts = needing or counts
        return min(counts) // tokens_per_block

    def last_block_end(self, end: int, tokens_per_block: int) -> int:
        """Local blocks a shared list needs for the tokens before ``end`` (the rank holding most)."""
        most = max(self.count(end, rank) for rank in range(self.size))
        return -(-most // tokens_per_block)

    def first_token(self, block: int, tokens_per_block: int) -> int:
        """The first prompt token from which every CP rank's tokens lie in local block ``block`` on."""
        local = block * tokens_per_block
        if not local:
            return 0
        if self.chunked:  # a rank whose tokens all lie before the block holds none from there on
            ends = [min(local, self.held(rank)) for rank in range(self.size)]
            return max(self.token(end - 1, rank) + 1 if end else 0 for rank, end in enumerate(ends))
        return max(self.token(local - 1, rank) for rank in range(self.size)) + 1

    def end_token(self, block_end: int, tokens_per_block: int) -> int:
        """The end of the prompt tokens every CP rank holds before local block ``block_end``."""
        local = block_end * tokens_per_block
        return min(self.token(local, rank) for rank in range(self.size))

    def to_json(self) -> dict[str, Any]:
        if self.chunked:
            return {
                "size": self.size,
                "rank": self.rank,
                "layout": self.layout,
                "prompt_tokens": self.prompt,
            }
        return {"size": self.size, "rank": self.rank, "interleave": self.interleave}

    @classmethod
    def from_json(cls, doc: Any, name: str) -> Spread:
        """Parses a plan's ``src_cp``/``dst_cp`` member; ``ValueError`` names what is wrong."""
        if not isinstance(doc, dict):
            raise ValueError(f"{name} must be an object with size, rank and interleave")
        layout = doc.get("layout", INTERLEAVED)
        if layout != INTERLEAVED:
            return _chunked_from_json(doc, name, layout)
        size, rank, interleave = _integers(doc, name, ("size", "rank", "interleave"))
        if size < 1 or interleave < 1 or not 0 <= rank < size:
            raise ValueError(
                f"{name}: size {size} and interleave {interleave} must be >= 1 and rank {rank} "
                "below size"
            )
        return cls(size, rank, interleave)


def _integers(doc: dict[str, Any], name: str, keys: tuple[str, str, str]) -> list[int]:
    values = [doc.get(key) for key in keys]
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"{name} must hold integers {keys[0]}, {keys[1]} and {keys[2]}")
    return values  # type: ignore[return-value]


def _chunked_from_json(doc: dict[str, Any], name: str, layout: Any) -> Spread:
    if layout not in CHUNKED:
        raise ValueError(f"{name}.layout is {layout!r}; expected interleaved, contiguous or zigzag")
    size, rank, prompt = _integers(doc, name, ("size", "rank", "prompt_tokens"))
    if size < 2 or prompt < 1 or not 0 <= rank < size:
        raise ValueError(
            f"{name}: a {layout} spread needs size {size} >= 2, prompt_tokens {prompt} >= 1 and "
            f"rank {rank} below size"
        )
    return Spread(size, rank, 1, layout, prompt)


IDENTITY = Spread()


Piece = tuple[int, int, int, int, int, int]  # t0, t1, src block, src slot, dst block, dst slot


def shared_runs(src_tokens: int, dst_tokens: int, src: Spread, dst: Spread) -> list[Piece]:
    """The runs of one period's prompt tokens both ranks hold, each inside one interleave chunk
    and one block on both sides: (first, end, block and in-block position of the first token on
    the sender, the same on the receiver)."""
    period = math.lcm(src.period(src_tokens), dst.period(dst_tokens))
    pieces: list[Piece] = []
    token = 0
    while token < period:
        if not (src.holds(token) and dst.holds(token)):
            src_next, dst_next = src.next_held(token), dst.next_held(token)
            if src_next is None or dst_next is None:  # a chunked side holds no token from here on
                break
            token = max(src_next, dst_next)
            continue
        ls, ld = src.local(token), dst.local(token)
        ends = (src.run_end(token), dst.run_end(token))
        end = min(
            token + src_tokens - ls % src_tokens,
            token + dst_tokens - ld % dst_tokens,
            *(end for end in ends if end is not None),
            period,
        )
        pieces.append(
            (
                token,
                end,
                ls // src_tokens,
                ls % src_tokens,
                ld // dst_tokens,
                ld % dst_tokens,
            )
        )
        token = end
    return pieces
