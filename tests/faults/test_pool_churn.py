"""Pool churn: a live server runs jobs over ranks and pools that come and go, and holds nothing back.

The soak of issue 20 at a size the suite affords (``bench/pool_churn_bench.py`` runs the same rounds
2,000 times and prints the figures, times included). Each round registers ``ctx0`` and ``gen0`` over
new pools of this process (sealed memfds and plain segments in turn), runs one job, then deletes
the ranks or leaves them to be re-registered over new pools next round, and frees the pools. The
server's ``/proc/<pid>/fd`` and ``/proc/<pid>/maps`` are read after every round: before the fix
each round left two mappings and four descriptors to freed pools behind, until every job was a 500.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROUNDS = 120
FD_SLACK = 4  # sockets and database connections come and go between reads
# glibc's malloc makes up to 8 arenas per core as threads come and go, each a heap mapping and
# its guard: bounded, where a leak grows every round. The pools' own mappings are checked exactly.
MAP_SLACK = 2 * 8 * (os.cpu_count() or 1)


def _bench():
    path = Path(__file__).parents[2] / "bench" / "pool_churn_bench.py"
    spec = importlib.util.spec_from_file_location("pool_churn_bench", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_churning_ranks_and_pools_leave_the_servers_descriptors_and_mappings_flat(
    tmp_path: Path,
) -> None:
    bench = _bench()

    churn = bench.run(ROUNDS, tmp_path)

    samples = churn.samples
    assert len(samples) == ROUNDS
    for index, sample in enumerate(samples):
        # deleted ranks' pools are closed at once; re-registered ranks' at the next registration
        kept = (4, 2) if index % 3 == 2 else (0, 0)
        assert (sample.pool_fds, sample.pool_maps) == kept, f"round {index}: {sample}"
    base = samples[bench.BASELINE_ROUND]
    assert max(s.fds for s in samples[bench.BASELINE_ROUND :]) <= base.fds + FD_SLACK, samples
    assert max(s.maps for s in samples[bench.BASELINE_ROUND :]) <= base.maps + MAP_SLACK, samples
