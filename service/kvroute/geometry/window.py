"""Sliding-window attention: which blocks of a request a windowed view pair moves.

The next token of a request with a prompt of ``L`` tokens attends to the last ``W`` positions,
``[L + 1 - W, L]``, so prompt tokens before ``L + 1 - W`` are stale: the blocks wholly before that
token are skipped, i.e. those with an index below ``floor((L + 1 - W) / tokens_per_block)``
(reference section 5). Block lists are suffixes of the prompt's blocks (a cached prefix is implicit
in a shorter list), so a list of ``n`` ids starts at block ``ceil(L / tokens_per_block) - n``.

Decisions where the reference is silent or loose, in the terms users see:

- A pair moves the smaller window's blocks. A receiver with a larger window than its sender gets
  its extra leading blocks trimmed (left as they are: the sender no longer holds those tokens),
  as the reference does; a receiver with a smaller window simply skips more.
- A receiver without a window over layers its sender keeps windowed can never be served (it would
  attend over blocks that never arrive), so the pair is refused at registration:
  ``sliding_window_mismatch`` naming both windows. A windowed receiver of a full-attention sender
  is fine: the sender holds every block and sends only the window.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.geometry.errors import GeometryError
from kvroute.geometry.model import RankRegistration, Role, View


@dataclass(frozen=True, slots=True)
class Window:
    """The window a pair moves (``tokens``) and what each side declared (None: full attention)."""

    tokens: int
    sender: int | None
    receiver: int | None
    tokens_per_block: int

    def to_json(self) -> dict[str, int | None]:
        return {
            "tokens": self.tokens,
            "sender": self.sender,
            "receiver": self.receiver,
            "tokens_per_block": self.tokens_per_block,
        }


def pair_window(
    local: RankRegistration, view: View, peer: RankRegistration, theirs: View
) -> Window | None:
    """The window of a matched block-view pair, or None when neither side is windowed."""
    if view.sliding_window is None and theirs.sliding_window is None:
        return None
    local_is_sender = local.role is Role.CONTEXT
    sender, receiver = (
        (view.sliding_window, theirs.sliding_window)
        if local_is_sender
        else (theirs.sliding_window, view.sliding_window)
    )
    if receiver is None:
        index = next(i for i, candidate in enumerate(local.views) if candidate is view)
        raise GeometryError(
            "sliding_window_mismatch",
            f"{view.label()} of {local.label()} vs {peer.label()}: the context side keeps only the "
            f"last {sender} tokens of these layers (sliding_window={sender}) but the generation "
            "side attends over all of them (no sliding_window); the stale blocks never arrive",
            field=f"views[{index}].sliding_window",
            local=view.sliding_window,
            peer=theirs.sliding_window,
            stage="peer",
            peer_instance=peer.instance,
            peer_rank=peer.rank,
        )
    tokens = receiver if sender is None else min(sender, receiver)
    return Window(tokens, sender, receiver, local.tokens(view))


def first_window_block(window: int, tokens_per_block: int, prompt_tokens: int) -> int:
    """Index (within the request) of the first block holding a token the next token attends to.

    The reference's ``floor((L + 1 - W) / tokens_per_block)``, except that a window of one token
    (the next token attends to itself only) needs no prompt block at all, where the reference
    would still send a partial last block.
    """
    start = prompt_tokens + 1 - window
    if start >= prompt_tokens:
        return -(-prompt_tokens // tokens_per_block)
    return max(0, start) // tokens_per_block


def window_skip(window: int, tokens_per_block: int, prompt_tokens: int, list_length: int) -> int:
    """How many leading entries of a request's block list (a suffix of its prompt blocks) are stale.

    Raises ValueError when the list is longer than the prompt has blocks: it cannot be a suffix.
    """
    blocks = -(-prompt_tokens // tokens_per_block)
    start = blocks - list_length
    if start < 0:
        raise ValueError(
            f"{list_length} block ids for a prompt of {prompt_tokens} tokens, which has only "
            f"{blocks} of {tokens_per_block} tokens"
        )
    first = first_window_block(window, tokens_per_block, prompt_tokens)
    return min(list_length, max(0, first - start))
