"""Context parallelism: which prompt tokens a CP rank holds, and where in its own cache.

An interleaved spread of ``size`` CP ranks by ``interleave`` tokens (N) deals the prompt out in
chunks of N tokens, round robin: token ``i`` lives on CP rank ``(i // N) % size``, at local
position ``(i // (N * size)) * N + i % N`` of that rank's cache (vLLM's decode context parallel
with ``dcp_kv_cache_interleave_size = N``; TensorRT-LLM helix, where a rank owns global blocks
``[cp_rank :: cp_size]``, is N = tokens per block). The CP ranks of one TP position share the
request's block table: block id ``b`` of the list holds local positions ``[b * tpb, (b + 1) * tpb)``
on every CP rank, so one list serves all of them. Without context parallelism the spread is the
identity (one rank, every token at its own position).

Everything here is arithmetic on one rank's spread; ``periods`` cuts plans with it and ``ranges``
places block lists with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Spread:
    """The tokens CP rank ``rank`` of ``size`` holds, dealt out ``interleave`` at a time."""

    size: int = 1
    rank: int = 0
    interleave: int = 1

    @property
    def trivial(self) -> bool:
        return self.size == 1

    @property
    def cycle(self) -> int:
        """Tokens of one round of the deal: every CP rank gets one chunk."""
        return self.interleave * self.size

    def period(self, tokens_per_block: int) -> int:
        """Prompt tokens after which the rank's blocks repeat the same placement."""
        if self.size == 1:  # one rank holds every token in order, whatever the interleave
            return tokens_per_block
        return self.size * math.lcm(self.interleave, tokens_per_block)

    def holds(self, token: int) -> bool:
        return (token // self.interleave) % self.size == self.rank

    def local(self, token: int) -> int:
        """The local cache position of a token this rank holds."""
        n = self.interleave
        return token // self.cycle * n + token % n

    def token(self, local: int, rank: int | None = None) -> int:
        """The prompt token at a local position of ``rank`` (this rank by default)."""
        n, rank = self.interleave, self.rank if rank is None else rank
        return local // n * self.cycle + rank * n + local % n

    def count(self, end: int, rank: int | None = None) -> int:
        """How many of the tokens before ``end`` ``rank`` holds (this rank by default)."""
        n, rank = self.interleave, self.rank if rank is None else rank
        rounds, rest = divmod(end, self.cycle)
        return rounds * n + min(max(rest - rank * n, 0), n)

    def next_held(self, token: int) -> int:
        """The first token at or after ``token`` this rank holds."""
        return self.token(self.count(token))

    def first_block(self, first_token: int, tokens_per_block: int) -> int:
        """The first local block a shared list starting at prompt token ``first_token`` names: the
        block of the earliest local position any CP rank needs from that token on."""
        return self.count(first_token, self.size - 1) // tokens_per_block

    def last_block_end(self, end: int, tokens_per_block: int) -> int:
        """Local blocks a shared list needs for the tokens before ``end`` (CP rank 0 holds most)."""
        return -(-self.count(end, 0) // tokens_per_block)

    def first_token(self, block: int, tokens_per_block: int) -> int:
        """The first prompt token from which every CP rank's tokens lie in local block ``block`` on."""
        local = block * tokens_per_block
        return self.token(local - 1, self.size - 1) + 1 if local else 0

    def end_token(self, block_end: int, tokens_per_block: int) -> int:
        """The end of the prompt tokens every CP rank holds before local block ``block_end``."""
        return self.token(block_end * tokens_per_block, 0)

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "rank": self.rank, "interleave": self.interleave}

    @classmethod
    def from_json(cls, doc: Any, name: str) -> Spread:
        """Parses a plan's ``src_cp``/``dst_cp`` member; ``ValueError`` names what is wrong."""
        if not isinstance(doc, dict):
            raise ValueError(f"{name} must be an object with size, rank and interleave")
        values = [doc.get(key) for key in ("size", "rank", "interleave")]
        if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
            raise ValueError(f"{name} must hold integers size, rank and interleave")
        size, rank, interleave = values
        if size < 1 or interleave < 1 or not 0 <= rank < size:
            raise ValueError(
                f"{name}: size {size} and interleave {interleave} must be >= 1 and rank {rank} "
                "below size"
            )
        return cls(size, rank, interleave)


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
            token = max(src.next_held(token), dst.next_held(token))
            continue
        ls, ld = src.local(token), dst.local(token)
        end = min(
            token + src_tokens - ls % src_tokens,
            token + dst_tokens - ld % dst_tokens,
            token + src.interleave - token % src.interleave if src.size > 1 else period,
            token + dst.interleave - token % dst.interleave if dst.size > 1 else period,
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
