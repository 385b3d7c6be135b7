"""Sliding-window attention: which tokens of a request a windowed view pair moves.

The next token of a request with a prompt of ``L`` tokens attends to the last ``W`` positions,
``[L + 1 - W, L]``, so prompt tokens before ``L + 1 - W`` are stale (reference section 5). A window
is a restriction of the token range a job moves (``ranges``): the pair moves the job's tokens from
the window's first token on, cut from its period like any other range.

Decisions where the reference is silent or loose, in the terms users see:

- The window's first token is the latest block start, on either side, at or before ``L + 1 - W``.
  With equal block sizes that is the reference's whole blocks from ``floor((L + 1 - W) / tpb)``;
  with different sizes the block holding that token on each side is one the side keeps (a windowed
  sender keeps every block from its own window's first on, and its window is at least the pair's),
  and the stale tokens moved before ``L + 1 - W`` are fewer than a block of either side.
- With context parallelism a side's blocks cut local positions, so its "block start" is the first
  token from which every CP rank's tokens lie in the local block holding the earliest in-window
  token any of them holds (the shared list's first block, ``ranges``); every CP rank keeps that
  block on. The pair moves every token from the later of the two sides' starts, as without CP.
- A window of one token (the next token attends to itself only) needs no prompt token at all,
  where the reference would still send a partial last block.
- A pair moves the smaller window. A receiver with a larger window than its sender gets its extra
  leading tokens trimmed (left as they are: the sender no longer holds them), as the reference does;
  a receiver with a smaller window simply skips more.
- A receiver without a window over layers its sender keeps windowed can never be served (it would
  attend over blocks that never arrive), so the pair is refused at registration
  (``checks.pairs.pair_window``): ``sliding_window_mismatch`` naming both windows. A windowed receiver of a full-attention sender
  is fine: the sender holds every block and sends only the window. Block sizes never make a window
  impossible: it is counted in tokens, and the period form cuts any range.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.geometry.leaves.spread import IDENTITY, Spread
from kvroute.geometry.tokens.ranges import TokenRange


@dataclass(frozen=True, slots=True)
class Window:
    """The window a pair moves (``tokens``), what each side declared (None: full attention) and
    the tokens per block of the sender (``src``) and the receiver (``dst``)."""

    tokens: int
    sender: int | None
    receiver: int | None
    src_tokens_per_block: int
    dst_tokens_per_block: int

    def to_json(self) -> dict[str, int | None]:
        return {
            "tokens": self.tokens,
            "sender": self.sender,
            "receiver": self.receiver,
            "src_tokens_per_block": self.src_tokens_per_block,
            "dst_tokens_per_block": self.dst_tokens_per_block,
        }

    def first_token(
        self, prompt_tokens: int, spreads: tuple[Spread, Spread] = (IDENTITY, IDENTITY)
    ) -> int | None:
        """The first token the pair moves for a prompt of ``prompt_tokens`` (each side's CP
        placement, ``spreads``, sender first); None: no token."""
        return window_start(
            self.tokens,
            prompt_tokens,
            self.src_tokens_per_block,
            self.dst_tokens_per_block,
            spreads,
        )


def window_start(
    window: int,
    prompt_tokens: int,
    src_tokens_per_block: int,
    dst_tokens_per_block: int,
    spreads: tuple[Spread, Spread] = (IDENTITY, IDENTITY),
) -> int | None:
    """The first token a window of ``window`` tokens moves (see the module docstring); None when
    the next token attends to no prompt token. A side's block start is, under context
    parallelism, the first token from which every CP rank's tokens lie in the local block its
    earliest in-window token lies in (``Spread.first_token``): without CP, that block's start."""
    first = prompt_tokens + 1 - window
    if first >= prompt_tokens:
        return None
    first = max(0, first)
    return max(
        spread.first_token(spread.first_block(first, size), size)
        for spread, size in zip(spreads, (src_tokens_per_block, dst_tokens_per_block), strict=True)
    )


def windowed_range(tokens: TokenRange, start: int | None) -> TokenRange | None:
    """The tokens of ``tokens`` from a window's first token on (None: none of them)."""
    if start is None or start >= tokens.end:
        return None
    return TokenRange(max(tokens.start, start), tokens.end)
