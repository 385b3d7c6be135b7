"""Executable plans (sorted read-only fragments, exactly-once across ranks) and fragment
compilation into strided runs. Plan documents are read by ``Plan.from_json`` (``tests/unit/
test_plan_document.py`` names what it refuses); here plans are written in the data plane's types."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.transfer import PeerCopy, TransferValidationError, compile_fragments
from tests.transfer.copies import copy_plan, pair


def test_fragments_are_sorted_read_only_and_counted() -> None:
    plan = copy_plan((0, [pair([[64, 32, 16], [0, 0, 32]])]))
    (view,) = plan.senders[0].views
    assert view.fragments.tolist() == [[0, 0, 32], [64, 32, 16]]
    assert not view.fragments.flags.writeable
    assert (plan.bytes_per_block, plan.fragments_per_block) == (48, 2)


def test_silent_peers_copy_nothing() -> None:
    plan = copy_plan((0, [pair([[0, 0, 8]])]), PeerCopy(1, False, ()))
    assert [peer.rank for peer in plan.senders] == [0]


def test_destination_written_twice_across_ranks_is_refused() -> None:
    with pytest.raises(TransferValidationError, match=r"written twice: by rank 0 .* and by rank 1"):
        copy_plan((0, [pair([[0, 0, 16]])]), (1, [pair([[0, 8, 16]])]))


def test_hnd_and_nhd_fragments_fold_into_one_run() -> None:
    hnd = np.array([[i * 4096 + 2048, i * 2048, 2048] for i in range(64)])
    nhd = np.array([[r * 9000 + t * 256 + 128, r * 4096 + t * 128, 128]
                    for r in range(64) for t in range(32)])  # fmt: skip
    (hnd_run,) = compile_fragments(hnd).runs
    assert (hnd_run.shape, hnd_run.src_strides, hnd_run.dst_strides) == (
        (64, 2048),
        (4096, 1),
        (2048, 1),
    )
    (nhd_run,) = compile_fragments(nhd).runs
    assert (nhd_run.shape, nhd_run.src_strides) == ((64, 32, 128), (9000, 256, 1))
    assert compile_fragments(nhd).alignment == 8  # gcd of 128 and the 9000-byte region step


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 3)), min_size=1, max_size=30))
def test_compiled_runs_cover_exactly_the_fragments(spec: list[tuple[int, int]]) -> None:
    # disjoint destinations from cumulative gaps; arbitrary (even overlapping) sources
    fragments, cursor = [], 0
    for gap, length in spec:
        cursor += gap % 5
        fragments.append([gap * 3, cursor, length * 4])
        cursor += length * 4
    array = np.array(fragments)
    array = array[np.argsort(array[:, 1], kind="stable")]
    program = compile_fragments(array)
    src, dst = program.element_offsets(1)
    want_src = np.concatenate([np.arange(s, s + n) for s, _, n in fragments])
    want_dst = np.concatenate([np.arange(d, d + n) for _, d, n in fragments])
    assert dict(zip(dst.tolist(), src.tolist(), strict=True)) == dict(
        zip(want_dst.tolist(), want_src.tolist(), strict=True)
    )
    assert len(dst) == len(want_dst) == program.nbytes
