"""KV integrity of a hybrid path over a real NIXL pull (UCX on loopback), with faults injected.

The hybrid of ``tests.nixl.world``: full attention (layer 2) and a 6-token sliding window (layer 5)
side by side in each block, Mamba2 state (layers 0, 1, 3, 4) in a state pool of its own, so the
canary covers every view. Two context ranks (TP2, ``tests.nixl.integrity_sender``) write the canary
into their reserved block and state slot and digest a 16-token request (its window from token 8,
its state slot) as they produced it; the test process is the generation rank (TP1): it pulls with
the real plan (``period`` form, the prompt's length, the state slot pair) and NIXL, checks and
digests through its kernels' view, and reports to a live kvroute. Faults: a read 2 bytes off in
the state pool, a bit flipped after the write (window tokens; SSM and conv state), a registration
that lies about the window's interior or the order of its state layers.

Expected elements are written out by hand from the dimensions, or found by ``_first_wrong``: the
consumer's kernels' bytes against the producers' (the pattern they wrote, read back through their
typed tensors and reassembled by TP), in the documented order; never by kvroute's readers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api", reason="nixl is not installed")
torch = pytest.importorskip("torch")

from kvroute.client.kv_digest import Mismatch  # noqa: E402
from kvroute.client.kv_rows import RowKey  # noqa: E402
from kvroute.client.kv_state import StateKey  # noqa: E402
from tests.client.live import LiveServer  # noqa: E402
from tests.nixl import integrity_pair, world  # noqa: E402
from tests.nixl.integrity_pair import Receiver, Senders  # noqa: E402

pytestmark = pytest.mark.slow
SRC_BLOCKS, DST_BLOCKS = [1, 2, 3, 4], [0, 3, 4, 5]  # the request: prompt tokens 0-15
REQUEST = range(16)
SRC_SLOT, DST_SLOT = 1, 2  # its state slot on each side
WINDOW_PAIRS = [(3, 4), (4, 5)]  # the window's 6 tokens (10-15) lie in blocks of tokens 8-15
CANARY_BLOCK, CANARY_SLOT = 7, 6  # kept back on both sides: the last block, the slot before
CANARY = (("full", CANARY_BLOCK), ("window", CANARY_BLOCK), ("ssm", CANARY_SLOT),
          ("conv", CANARY_SLOT))  # fmt: skip
KV = ("key", "value")
X, BC = world.SSM_HEADS * world.SSM_HEAD_DIM, world.GROUPS * world.D_STATE  # conv channels
SECTIONS = ((0, X), (X, X + BC), (X + BC, X + 2 * BC))  # x, B, C channels at TP1
NAMES = itertools.count()


@pytest.fixture(scope="module")
def senders(module_live_server: LiveServer) -> Iterator[Senders]:
    with integrity_pair.started_senders(module_live_server.url, hybrid=True) as running:
        yield running


def _window_says_head_buffer(document: dict[str, Any]) -> None:
    views = document["views"]
    integrity_pair.says_head_buffer(
        next(i for i, v in enumerate(views) if v.get("sliding_window"))
    )(document)


def _state_layers_reversed(document: dict[str, Any]) -> None:
    """Says its Mamba layers' regions lie in the reverse order of what its kernels read."""
    for view in document["views"]:
        if view["kind"] in ("ssm", "conv"):
            offsets = [layer["offset"] for layer in view["layers"]][::-1]
            for layer, offset in zip(view["layers"], offsets, strict=True):
                layer["offset"] = offset


LIES = {"window": _window_says_head_buffer, "state": _state_layers_reversed}


@pytest.fixture
def receiver(module_live_server: LiveServer, senders: Senders, request: Any) -> Iterator[Receiver]:
    lie = LIES.get(getattr(request, "param", ""))
    made = Receiver(module_live_server.url, f"gen{next(NAMES)}", hybrid=True, lie=lie)
    # Its own garbage everywhere, so that what was not moved differs from what was.
    noise = torch.Generator().manual_seed(99)
    made.carved.buffer.copy_(torch.randint(0, 256, made.carved.buffer.shape, generator=noise,
                                           dtype=torch.uint8))  # fmt: skip
    try:
        yield made
    finally:
        made.close()


def _held(receiver: Receiver, name: str, index: int) -> np.ndarray:
    """The bytes of ``name[index]`` as the consumer's kernels read them."""
    return receiver.carved.tensors[name][index].contiguous().view(torch.uint8).numpy()


def _expected(senders: Senders, name: str, index: int) -> np.ndarray:
    """What a TP1 consumer must hold of ``name[index]``: the producers' bytes, their heads (or
    each conv section's channels) in rank order."""
    parts = [senders.ask(rank, "bytes", name, index)[1] for rank in range(2)]
    if name != "conv":  # [layers, K/V, heads, tokens, row] or [layers, SSM heads, dim, state]
        return np.concatenate(parts, axis=-3)
    cuts = [X // 2, X // 2 + BC // 2]  # [layers, channels, columns]: x | B | C split by rank
    shares = [np.split(part, cuts, axis=1) for part in parts]
    return np.concatenate(
        [np.concatenate(pair, axis=1) for pair in zip(*shares, strict=True)], axis=1
    )


def _written(senders: Senders) -> dict[str, np.ndarray]:
    """The canary as the producers wrote it, as a TP1 consumer must hold it (``_expected``)."""
    return {name: _expected(senders, name, index) for name, index in CANARY}


def _first_wrong(receiver: Receiver, written: dict[str, np.ndarray]) -> Mismatch | None:
    """The canary's first wrong element by ground truth (``written``): the row series in (layer,
    head, token, K/V) order (the canary's 4 tokens are all inside the window), then the state
    units in (view roles, layer, section, unit, byte) order, a conv section of S bytes cut in
    gcd(S, 96) parts."""
    held = {name: _held(receiver, name, index) for name, index in CANARY}
    rows = []
    for name, layer in (("full", world.FULL), ("window", world.SLIDING)):
        wrong = held[name] != written[name]
        rows += [(layer, h, t, kv) for _, kv, h, t in np.argwhere(wrong.any(axis=-1))]
    if rows:
        layer, head, token, kv = (int(n) for n in min(rows))
        return Mismatch(RowKey("target", ",".join(KV), layer, head, kv), (token, token + 1))
    units = []
    conv, ssm = ((held[name], written[name]) for name in ("conv", "ssm"))
    for i, layer in enumerate(world.MAMBA):
        for section, (low, high) in enumerate(SECTIONS):
            got, want = (side[i, low:high].reshape(-1) for side in conv)
            if len(wrong := np.flatnonzero(got != want)):
                part = len(got) // math.gcd(len(got), 96)
                units.append(("conv", layer, section, *divmod(int(wrong[0]), part)))
        for head in range(world.SSM_HEADS):
            got, want = (side[i, head].reshape(-1) for side in ssm)
            if len(wrong := np.flatnonzero(got != want)):
                units.append(("ssm", layer, 0, head, int(wrong[0])))
    if not units:
        return None
    kind, layer, section, unit, byte = min(units)
    return Mismatch(StateKey("target", kind, kind, layer, section, unit), byte=byte)


def _request_digests(
    receiver: Receiver, senders: Senders, chunk: int, fault: Any = None, **pull: Any
) -> Mismatch | None:
    """The producers digest the request (then ``fault`` runs), the consumer pulls and compares."""
    sent = senders.digest(SRC_BLOCKS, REQUEST, chunk, SRC_SLOT)
    if fault is not None:
        fault()
    receiver.pull(SRC_BLOCKS, DST_BLOCKS, prompt=len(REQUEST), states=(SRC_SLOT, DST_SLOT), **pull)
    return sent.first_mismatch(receiver.digest(DST_BLOCKS, REQUEST, chunk, DST_SLOT))


def test_a_clean_hybrid_path_is_attested_and_its_digests_agree(
    receiver: Receiver, senders: Senders
) -> None:
    tokens, src, dst, slots = receiver.canary_places()
    assert (tokens, src, dst, slots) == (range(4), [7], [7], (CANARY_SLOT, CANARY_SLOT))
    failure, cost_ms = receiver.canary(senders)
    assert failure is None
    written = _written(senders)
    for name, index in CANARY:
        assert np.array_equal(_held(receiver, name, index), written[name]), name
    path = receiver.report("canary", None, cost_ms)
    assert (path.state, path.source) == ("attested", "canary")
    before = {block: _held(receiver, "window", block).copy() for block in (0, 3)}
    sent = senders.digest(SRC_BLOCKS, REQUEST, 4, SRC_SLOT)
    receiver.pull(SRC_BLOCKS, DST_BLOCKS, prompt=len(REQUEST), states=(SRC_SLOT, DST_SLOT))
    got = receiver.digest(DST_BLOCKS, REQUEST, 4, DST_SLOT)
    assert sent.first_mismatch(got) is None
    # Full attention: 4 heads x K, V x 4 chunks; the window from token 8: 4 x 2 x 2; state: 16
    # SSM heads (4 layers) and 4 layers x 288 conv parts (x: 192 bytes, B, C: 96, 96 parts each).
    assert sent.compared(got) == 32 + 16 + 16 + 4 * 288
    # What moved, against the producers' bytes: every full-attention block, the window's blocks
    # only (the consumer's own bytes stay before it), the state slot.
    for s, d in zip(SRC_BLOCKS, DST_BLOCKS, strict=True):
        assert np.array_equal(_held(receiver, "full", d), _expected(senders, "full", s))
    for s, d in WINDOW_PAIRS:
        assert np.array_equal(_held(receiver, "window", d), _expected(senders, "window", s))
    for block, garbage in before.items():
        assert np.array_equal(_held(receiver, "window", block), garbage)
    for name in ("ssm", "conv"):
        assert np.array_equal(_held(receiver, name, DST_SLOT), _expected(senders, name, SRC_SLOT))
    assert receiver.excluded() == {}


def test_a_state_read_at_the_wrong_offset_fails_the_canary_and_the_digest(
    receiver: Receiver, senders: Senders
) -> None:
    """Every read of the producers' state pool lands 2 bytes early; the blocks are sound."""
    shifted: dict[str, Any] = {"read_shift": -2, "shift_pool": 1}
    failure, _ = receiver.canary(senders, **shifted)
    # The first unit in order (conv sorts before ssm) is wrong from its first bytes on.
    assert failure is not None
    assert failure == _first_wrong(receiver, _written(senders))
    assert failure == Mismatch(StateKey("target", "conv", "conv", 0, 0, 0), byte=0)
    path = receiver.report("canary", failure)
    assert path.state == "failed"
    assert path.element == {"layer": 0, "head": 0, "state": "conv", "section": 0, "byte": 0,
                            "detail": "target conv layer 0 conv section 0 part 0, byte 0"}  # fmt: skip
    assert receiver.excluded() == {"ctx0": "kv_path_failed"}
    found = _request_digests(receiver, senders, 4, **shifted)
    assert found == Mismatch(StateKey("target", "conv", "conv", 0, 0, 0))
    # With digests off, nothing checks a request's bytes: the next canary catches the fault again.
    again, _ = receiver.canary(senders, **shifted)
    assert again == failure


# (sender rank, typed view, row index, element) of the canary's and the request's flipped bit,
# and what names it. Rank 1 holds global KV heads 2-3, SSM heads 2-3, and the second half of each
# conv section's channels (x: 16-31 of 32, B: 8-15 of 16, C likewise).
FLIPS = {
    # Window layer 5, V, local head 0 (global 2): the canary's token 1, the request's token 15
    # (block 4 holds tokens 12-15).
    "window": (
        (1, "window", (CANARY_BLOCK, 0, 1, 0, 1), 5),
        Mismatch(RowKey("target", ",".join(KV), world.SLIDING, 2, 1), (1, 2)),
        (1, "window", (4, 0, 1, 0, 3), 5),
        Mismatch(RowKey("target", ",".join(KV), world.SLIDING, 2, 1), (15, 16)),
        "target key,value layer 5 head 2 V, token 15",
    ),
    # The canary: SSM layer 3 (index 2), local head 1 (global 3), dim 3, state 5: byte
    # (3 x 8 + 5) x 2 = 58 of the head. The request: conv layer 1, local channel 19 = B channel 3
    # (global 11), column 2: byte 11 x 3 x 2 + 2 x 2 = 70 of B's 96, so part 70 of 96.
    "state": (
        (1, "ssm", (CANARY_SLOT, 2, 1, 3), 5),
        Mismatch(StateKey("target", "ssm", "ssm", 3, 0, 3), byte=58),
        (1, "conv", (SRC_SLOT, 1, X // 2 + 3), 2),
        Mismatch(StateKey("target", "conv", "conv", 1, 1, 70)),
        "target conv layer 1 conv section 1 part 70",
    ),
}


@pytest.mark.parametrize("where", sorted(FLIPS))
def test_a_bit_flipped_after_the_write_is_named_by_the_canary_and_the_digest(
    receiver: Receiver, senders: Senders, where: str
) -> None:
    in_canary, named, in_request, found_as, detail = FLIPS[where]

    def flip(rank: int, name: str, index: tuple[int, ...], element: int) -> None:
        assert senders.ask(rank, "flip", name, index, element) == ("flipped",)

    written: dict[str, np.ndarray] = {}

    def fault() -> None:  # the pattern as written, then the flip
        written.update(_written(senders))
        flip(*in_canary)

    failure, _ = receiver.canary(senders, fault=fault)
    assert failure == named == _first_wrong(receiver, written)
    found = _request_digests(receiver, senders, 1, lambda: flip(*in_request))
    assert found == found_as
    path = receiver.report("digest", found)
    assert (path.state, path.element["detail"]) == ("failed", detail)
    assert receiver.excluded() == {"ctx0": "kv_path_failed"}
    counter = f'kvroute_kv_digest_mismatch_total{{consumer="{receiver.instance}",producer="ctx0"}}'
    assert f"{counter} 1.0" in integrity_pair.metrics(receiver.url)
    # Both flips were one-off: the next canary, written anew, attests the transport.
    again, _ = receiver.canary(senders)
    assert again is None


@pytest.mark.parametrize("receiver", sorted(LIES), indirect=True, ids=sorted(LIES))
def test_a_registration_that_lies_about_its_layout_fails_the_canary_and_the_digest(
    receiver: Receiver, senders: Senders, request: Any
) -> None:
    """kvroute plans writes to where the registration says, which the kernels do not read.
    Window: each head's K then V said, every K then every V read: the kernels' V of head 0 holds
    head 2's K (and K of head 0 is right). State: layer 0's regions said where layer 4's are."""
    failure, _ = receiver.canary(senders)
    assert failure is not None
    assert failure == _first_wrong(receiver, _written(senders))
    receiver.report("canary", failure)
    assert receiver.excluded() == {"ctx0": "kv_path_failed"}
    found = _request_digests(receiver, senders, 4)
    if request.node.callspec.id == "window":
        assert failure == Mismatch(RowKey("target", ",".join(KV), world.SLIDING, 0, 1), (0, 1))
        assert found == Mismatch(RowKey("target", ",".join(KV), world.SLIDING, 0, 1), (8, 12))
    else:
        assert failure == Mismatch(StateKey("target", "conv", "conv", 0, 0, 0), byte=0)
        assert found == Mismatch(StateKey("target", "conv", "conv", 0, 0, 0))
    # With digests off, the next canary catches the same fault.
    again, _ = receiver.canary(senders)
    assert again == failure
