"""Resources held flat over many ring calls in one MPI job (tests/support/mpi/soak_worker.py):
forward and backward, every layout, masks on and off, on 4 ranks.

A ring call that did not free the communicator it duplicated, or kept a
buffer alive, would pass every other test; here, after a warm-up cycle, no
duplicated communicator may stay open and Python's live memory may not grow
over the last cycle: a leak of 512 bytes a call (the smallest shard's size
here) is 18 KiB over its 36 calls; with no leak a rank's grew 0.5 to 3.7 KiB
(9 runs under MPICH and Open MPI). The long run (thousands of calls, where
MPICH itself fails on a communicator leak) is `python -m bench.soak`.

    .venv/bin/python -m pytest tests/mpi/test_soak.py -q
"""

import json

import pytest

from test_mpi import MPIEXEC, WORKERS, mpirun

pytest.importorskip("mpi4py")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")

CALLS = 108                     # ring calls per rank, 3 cycles of 36 (warm-up, to the middle, to the end):
                                # forward and backward count one each
GROWTH_BYTES = 12 * 1024        # live memory may not grow more over the last cycle


def test_many_ring_calls_hold_memory_and_communicators_flat(tmp_path):
    out = tmp_path / "soak.json"
    proc, _ = mpirun(4, str(WORKERS / "soak_worker.py"), str(CALLS), str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in json.loads(out.read_text()):
        start, middle, end = r["start"], r["middle"], r["end"]
        assert r["calls"] >= CALLS
        assert start["open_communicators"] == middle["open_communicators"] == end["open_communicators"] == 0, r
        assert end["traced_bytes"] - middle["traced_bytes"] < GROWTH_BYTES, r
