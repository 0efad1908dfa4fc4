"""How mpi_impl.comm names ranks in errors, without launching MPI: the rank in
front of an error raised inside the ring (type and traceback kept), a failed
transfer named by rank, round, neighbour and transfer.

    .venv/bin/python -m pytest tests/mpi/test_comm_errors.py -q
"""

import numpy as np
import pytest

from mpi_impl.comm import TAG_STRIDE, RingComm
from mpi_impl.ranks import RingError, named_rank, rank_name
from test_gpu import OneRank


class CustomError(Exception):
    def __init__(self, code):
        super().__init__(code)
        self.code = code

    def __str__(self):
        return f"custom failure {self.code}"


def test_named_rank_puts_the_rank_in_front_keeping_the_type():
    with pytest.raises(KeyError) as caught:
        with named_rank(OneRank()):
            {}["missing"]
    assert "rank 0: missing" in str(caught.value)          # KeyError quotes its message
    with pytest.raises(ValueError, match=r"^rank 0: bad value$") as caught:
        with named_rank(OneRank()):
            raise ValueError("bad value")
    assert caught.traceback[-1].name == "test_named_rank_puts_the_rank_in_front_keeping_the_type"


def test_named_rank_notes_the_rank_where_the_message_is_built_otherwise():
    with pytest.raises(CustomError) as caught:
        with named_rank(OneRank()):
            raise CustomError(7)
    assert caught.value.code == 7
    assert "raised on rank 0" in getattr(caught.value, "__notes__", []), caught.value


def test_named_rank_leaves_a_ring_error_as_it_is():
    with pytest.raises(RingError, match=r"^rank 0: round 1: x$"):
        with named_rank(OneRank()):
            raise RingError("rank 0: round 1: x")


def test_rank_name_of_a_stand_in_communicator():
    assert rank_name(OneRank()) == "rank 0"
    assert rank_name(OneRank(), 0) == "rank 0"


class FailingRequest:
    """Complete at once, or failing when tested or waited for; a notice
    (ring tag 0) never comes."""
    def __init__(self, error=False, never=False):
        self.error, self.never = error, never

    def Test(self):
        if self.error:
            raise RuntimeError("connection lost")
        return not self.never

    def Wait(self):
        assert not self.never, "waiting for a notice that never comes"
        self.Test()

    def Cancel(self):
        self.never = False

    @staticmethod
    def Waitany(requests):
        return next(i for i, r in enumerate(requests) if r.Test())


class FailingComm(OneRank):
    """Three ranks seen from rank 1, whose send of array 1 fails when waited for."""
    def Get_rank(self): return 1
    def Get_size(self): return 3
    def Irecv(self, buf, source, tag): return FailingRequest(never=tag < TAG_STRIDE)
    def Isend(self, buf, dest, tag): return FailingRequest(tag % TAG_STRIDE == 1)


def test_failed_transfer_names_round_neighbour_and_array():
    ring = RingComm(FailingComm())
    block = (np.zeros(3), np.zeros(2))
    with pytest.raises(RingError, match=r"^rank 1: round 0: sending the dK/dV block \(array 1 of 2\) to rank 2 "
                                        r"failed: RuntimeError: connection lost$"):
        ring.finish_shift(ring.start_shift(block, tag=2))   # tested there, or at close
        ring.close()
