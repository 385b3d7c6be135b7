"""Token ranges: the bytes of listed blocks that move for a range that may start or end mid-block.

A transfer names one block list per side. Upstream's rule (reference/trtllm-native-disagg.md section
5): a list is a suffix of the prompt range with the cached prefix implicit in its length, so it starts
at token ``(ceil(end / tpb) - len(list)) x tpb``. A side may instead name its first token outright (a
chunk's list, a receiver that already holds a prefix): ``blocks[0]`` holds that token at in-block
position ``first % tpb``, and each later id holds the next whole block. A range is covered when every
token of it lies in both lists; the first token that does not is the gap reported.

A request names what it moves beside its lists in one ``TokenWindow``: the range, each list's
first token and the prompt's length (``prompt_tokens``), which sliding windows are measured from
(``window``). The prompt defaults to the range's end, and a range ending after it is refused: the
two would contradict each other. Without a range, a prompt length places the lists as the prompt's
last blocks (the suffix rule against it, issue 12's block lists) and the range is the tokens both
hold, up to the prompt's last token and never past it (``TokenWindow.lists``), whatever the block
sizes, windows and CP placements: one rule, the one an explicit range obeys. Only a view pair whose
bytes are not whole token rows cannot stop mid-block; it moves the block holding the prompt's last
token whole (``block_ends``).

A plan of prefill CP chunks (``spread``) is built for one prompt length: a request that names
another (or none) is refused (``prompt_tokens_mismatch``).

With context parallelism a side's CP ranks share one list of *local* blocks (``spread``): block
``b`` of it holds local positions ``[b x tpb, (b + 1) x tpb)`` on every CP rank. The list then starts
at the first local block any CP rank needs from ``first_token`` on, the suffix rule counts the
local blocks CP rank 0 (which holds the most tokens) needs before ``end``, and a range is covered
when every token of it the rank holds lies in the list, from ``first_token`` on.

Pure arithmetic over a ``PeriodMap``: data planes use ``range_copies`` where a range cuts blocks (or
as the reference), and their own fused copies for whole periods (``full_periods``).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvroute.geometry.leaves.spread import IDENTITY, Spread

if TYPE_CHECKING:  # periods imports pairs, which imports window, which imports this module
    from kvroute.geometry.tokens.periods import PeriodMap

Copy = tuple[int, int, int, int, int]  # src block id, src offset, dst block id, dst offset, length


class TokenRangeError(ValueError):
    """A token range or block list that can never be transferred; ``field`` names the input."""

    code = "invalid_token_range"

    def __init__(self, field: str, detail: str, **extras: Any) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail
        self.extras = extras


class TokenGap(TokenRangeError):
    """A token of the range that a side's block list does not hold (the first such token)."""

    code = "token_range_not_covered"

    def __init__(self, field: str, token: int, covered: tuple[int, int], tokens: TokenRange):
        detail = (
            f"holds tokens [{covered[0]}, {covered[1]}), so token {token} of the range "
            f"[{tokens.start}, {tokens.end}) has no block"
        )
        super().__init__(
            field, detail, token=token, covered=list(covered), tokens=[tokens.start, tokens.end]
        )
        self.token = token
        self.covered = covered


class PromptContradiction(TokenRangeError):
    """A prompt length that ends before the token range it belongs to."""

    code = "prompt_tokens_contradicts_tokens"

    def __init__(self, prompt_tokens: int, tokens: TokenRange) -> None:
        super().__init__(
            "prompt_tokens",
            f"a prompt of {prompt_tokens} tokens ends before tokens.end {tokens.end} of the range "
            f"[{tokens.start}, {tokens.end}); a range moves prompt tokens only",
            prompt_tokens=prompt_tokens,
            tokens=[tokens.start, tokens.end],
        )


class ChunkPromptMismatch(TokenRangeError):
    """A request for a plan of prefill CP chunks that names another prompt length (or none)."""

    code = "prompt_tokens_mismatch"

    def __init__(self, side: str, spread: Spread, prompt_tokens: int | None) -> None:
        super().__init__(
            "prompt_tokens",
            f"the plan places {side}' tokens in {spread.layout} chunks of a prompt of "
            f"{spread.prompt} tokens over {spread.size} CP ranks, but the request names "
            f"prompt_tokens={prompt_tokens}; chunks of another prompt length hold other tokens",
            local=prompt_tokens,
            peer=spread.prompt,
        )


@dataclass(frozen=True, slots=True)
class TokenRange:
    """The half-open range of prompt positions to move."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end <= self.start:
            raise TokenRangeError(
                "tokens", f"[{self.start}, {self.end}) is not a non-empty range of positions >= 0"
            )


@dataclass(frozen=True, slots=True)
class BlockList:
    """One side's block ids: ``blocks[0]`` holds ``first_token``, later ids the next whole blocks."""

    blocks: Sequence[int]
    first_token: int
    tokens_per_block: int
    spread: Spread = IDENTITY  # the side's CP placement (the rank's own, for coverage)
    # The local block of ``blocks[0]`` where the suffix rule placed it; else derived from
    # ``first_token`` (the same block for any placement but prefill chunks, whose ranks may hold
    # no token from the list's first token on).
    start_block: int | None = None

    @classmethod
    def suffix(
        cls,
        blocks: Sequence[int],
        end: int,
        tokens_per_block: int,
        field: str,
        spread: Spread = IDENTITY,
    ) -> BlockList:
        """Upstream's rule: the list ends with the block holding token ``end - 1``."""
        first_block = spread.last_block_end(end, tokens_per_block) - len(blocks)
        if first_block < 0:
            where = (
                f"token {first_block * tokens_per_block}"
                if spread.trivial
                else f"local block {first_block}"
            )
            raise TokenRangeError(
                field,
                f"{len(blocks)} blocks of {tokens_per_block} tokens ending at token {end} would "
                f"start at {where}; name the first token or send fewer blocks",
            )
        first = spread.first_token(first_block, tokens_per_block)
        return cls(blocks, first, tokens_per_block, spread, first_block)

    @property
    def first_block(self) -> int:
        """The absolute (local) block number of ``blocks[0]``: token // tokens_per_block without CP."""
        if self.start_block is not None:
            return self.start_block
        return self.spread.first_block(self.first_token, self.tokens_per_block)

    @property
    def end_token(self) -> int:
        """The end of the prompt tokens the list holds on every CP rank."""
        return self.spread.end_token(self.first_block + len(self.blocks), self.tokens_per_block)

    def block_id(self, block: int) -> int:
        """The id listed for absolute block number ``block``."""
        index = block - self.first_block
        if not 0 <= index < len(self.blocks):  # a negative index would silently wrap around
            raise TokenRangeError(
                "blocks", f"block {block} is outside the list's blocks from {self.first_block}"
            )
        return self.blocks[index]

    def gap(self, tokens: TokenRange, field: str) -> TokenGap | None:
        """The lowest token of ``tokens`` this side's rank holds and the list lacks."""
        covered = (self.first_token, self.end_token)
        spread = self.spread
        if spread.trivial:
            if tokens.start < covered[0]:
                return TokenGap(field, tokens.start, covered, tokens)
            if tokens.end > covered[1]:
                return TokenGap(field, max(tokens.start, covered[1]), covered, tokens)
            return None
        low, high = spread.count(tokens.start), spread.count(tokens.end)  # the rank's local run
        if low >= high:
            return None
        if spread.token(low) < self.first_token:
            return TokenGap(field, spread.token(low), covered, tokens)
        local_end = (self.first_block + len(self.blocks)) * self.tokens_per_block
        if high > local_end:
            return TokenGap(field, spread.token(max(low, local_end)), covered, tokens)
        return None


@dataclass(frozen=True, slots=True)
class TokenWindow:
    """Which tokens a transfer moves beside its block lists, the one type the client, its NIXL
    descriptors and the data plane take: ``tokens`` (None: every token either list holds), each
    list's first token (None: 0 without ``tokens`` or ``prompt_tokens``, else upstream's suffix rule
    against ``tokens.end``, else against ``prompt_tokens``) and the prompt's length (None:
    ``tokens.end``), which sliding windows are measured from. Nothing named: the lists pair up one
    to one. Checked here, once: first tokens >= 0, a prompt >= 1 the range does not end after."""

    tokens: TokenRange | None = None
    src_first_token: int | None = None
    dst_first_token: int | None = None
    prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.tokens is not None and not isinstance(self.tokens, TokenRange):
            raise TokenRangeError("tokens", f"must be a TokenRange, got {self.tokens!r}")
        _check_count("src_first_token", self.src_first_token, 0)
        _check_count("dst_first_token", self.dst_first_token, 0)
        _check_count("prompt_tokens", self.prompt_tokens, 1)
        tokens, prompt = self.tokens, self.prompt_tokens
        if tokens is not None and prompt is not None and tokens.end > prompt:
            raise PromptContradiction(prompt, tokens)

    @property
    def names_tokens(self) -> bool:
        """A range or a first token is named: the lists hold runs of the prompt, not pairs."""
        return (self.tokens, self.src_first_token, self.dst_first_token) != (None, None, None)

    @property
    def pairs_blocks(self) -> bool:
        """Nothing named: block pairs, one to one (a prompt length alone makes the request the
        prompt's tokens, not blocks)."""
        return not self.names_tokens and self.prompt_tokens is None

    @property
    def prompt(self) -> int | None:
        """The prompt length windows are measured from: ``prompt_tokens``, else the range's end."""
        if self.prompt_tokens is None:
            return None if self.tokens is None else self.tokens.end
        return self.prompt_tokens

    def lists(
        self,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        src_tokens_per_block: int,
        dst_tokens_per_block: int,
        spreads: tuple[Spread, Spread] = (IDENTITY, IDENTITY),
    ) -> tuple[TokenRange, BlockList, BlockList]:
        """The request's range and lists for one view pair's block sizes (and CP placements).

        The range defaults to every token either list holds, so lists that hold different tokens
        leave a gap (and lists of one block size pair up one to one). With a prompt length, it is
        the tokens both lists hold (a list's cached prefix is implicit in its length, so the later
        first token starts it) up to the prompt's last token, with equal block sizes or not, with
        CP or not: ``[max(src first, dst first), prompt_tokens)``.
        """
        prompt_tokens, tokens = self.prompt_tokens, self.tokens
        for field, spread in zip(("src_blocks", "dst_blocks"), spreads, strict=True):
            if spread.chunked and prompt_tokens != spread.prompt:
                raise ChunkPromptMismatch(field, spread, prompt_tokens)
        end = tokens.end if tokens is not None else prompt_tokens
        sides = []
        for blocks, first, size, field, spread in (
            (src_blocks, self.src_first_token, src_tokens_per_block, "src_blocks", spreads[0]),
            (dst_blocks, self.dst_first_token, dst_tokens_per_block, "dst_blocks", spreads[1]),
        ):
            if first is None and end is not None:
                sides.append(BlockList.suffix(blocks, end, size, field, spread))
            else:
                sides.append(BlockList(blocks, first or 0, size, spread))
        if tokens is not None:
            return tokens, sides[0], sides[1]
        if prompt_tokens is None:
            start = min(side.first_token for side in sides)
            return TokenRange(start, max(side.end_token for side in sides)), sides[0], sides[1]
        return _prompt_range(prompt_tokens, *sides), sides[0], sides[1]


def _check_count(field: str, value: object, low: int) -> None:
    # numbers.Integral admits numpy's integers (block ids arrive as arrays); bool is no count.
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low
    ):
        raise TokenRangeError(field, f"must be an integer >= {low}, got {value!r}")


BLOCK_PAIRS = TokenWindow()  # nothing named: the lists pair up one to one


def _prompt_range(prompt_tokens: int, src: BlockList, dst: BlockList) -> TokenRange:
    """From the later list's first token up to the prompt's last token, never past it (a token
    after the prompt holds nothing the request computed); a list ending early is a gap."""
    start, stop = max(src.first_token, dst.first_token), prompt_tokens
    if start >= stop:
        field = "src_blocks" if src.first_token >= dst.first_token else "dst_blocks"
        raise TokenRangeError(
            field,
            f"starts at token {start}, at or after the prompt's end ({prompt_tokens} tokens): "
            "the lists share no prompt token",
        )
    return TokenRange(start, stop)


def block_ends(tokens: TokenRange, tokens_per_block: int) -> TokenRange:
    """The range stretched to the end of the block holding its last token: what a view pair
    whose bytes are not whole token rows (no token can be cut from its blocks) moves of a
    prompt-only job, the bytes after the prompt's last token in that block included."""
    return TokenRange(tokens.start, -(-tokens.end // tokens_per_block) * tokens_per_block)


def first_gap(tokens: TokenRange, src: BlockList, dst: BlockList) -> TokenGap | None:
    """The lowest token of the range either list lacks (the sender's list first on a tie)."""
    gaps = [
        gap
        for field, side in (("src_blocks", src), ("dst_blocks", dst))
        if (gap := side.gap(tokens, field)) is not None
    ]
    return min(gaps, key=lambda gap: gap.token, default=None)


def check_covered(tokens: TokenRange, src: BlockList, dst: BlockList) -> None:
    gap = first_gap(tokens, src, dst)
    if gap is not None:
        raise gap


def full_periods(tokens: TokenRange, period_tokens: int) -> range:
    """Indices of the periods that lie wholly inside the range."""
    return range(-(-tokens.start // period_tokens), tokens.end // period_tokens)


def whole_pieces(tokens: TokenRange, src_tokens: int, dst_tokens: int) -> TokenRange | None:
    """The range from its first block boundary (of either side) to its last, if they differ.

    Every token between them lies in a piece (the tokens one sender block and one receiver block
    share) wholly inside the range, so data planes move it with the period's fragments as they
    are; only the tokens before and after (fewer than a block of either side) need cutting.
    """
    start = min(-(-tokens.start // size) * size for size in (src_tokens, dst_tokens))
    end = max(tokens.end // size * size for size in (src_tokens, dst_tokens))
    return TokenRange(start, end) if start < end else None


def periods_inside(
    first_token: int, end_token: int, inner: TokenRange, period_tokens: int
) -> range:
    """The periods p whose tokens [p * L + first_token, p * L + end_token) lie inside ``inner``."""
    low = -(-(inner.start - first_token) // period_tokens)
    return range(low, (inner.end - end_token) // period_tokens + 1)


def range_copies(
    period: PeriodMap, tokens: TokenRange, src: BlockList, dst: BlockList
) -> list[Copy]:
    """Every copy the range needs, in period order; raises ``TokenGap`` when a list falls short."""
    if (src.tokens_per_block, dst.tokens_per_block, src.spread, dst.spread) != (
        period.src_tokens_per_block,
        period.dst_tokens_per_block,
        period.src_spread,
        period.dst_spread,
    ):
        raise TokenRangeError(
            "plan",
            f"the plan cuts {period.src_tokens_per_block} -> {period.dst_tokens_per_block} tokens "
            f"per block (CP {period.src_spread} -> {period.dst_spread}), the lists "
            f"{src.tokens_per_block} -> {dst.tokens_per_block} (CP {src.spread} -> {dst.spread})",
        )
    check_covered(tokens, src, dst)
    length_tokens = period.period_tokens
    src_step, dst_step = period.src_blocks_per_period, period.dst_blocks_per_period
    copies: list[Copy] = []
    group = period.token_group  # packed tokens move together: the range widens to whole groups
    for index in range(tokens.start // length_tokens, -(-tokens.end // length_tokens)):
        base = index * length_tokens
        lo, hi = max(tokens.start - base, 0), min(tokens.end - base, length_tokens)
        lo, hi = lo - lo % group, min(-(-hi // group) * group, length_tokens)
        for sb, so, db, do, length, first, count in period.spans:
            start, stop = max(first, lo), min(first + count, hi)
            if start >= stop:
                continue
            per_token, skip = length // count, start - first
            copies.append(
                (
                    src.block_id(index * src_step + sb),
                    so + skip * per_token,
                    dst.block_id(index * dst_step + db),
                    do + skip * per_token,
                    (stop - start) * per_token,
                )
            )
    return copies
