"""Ranks that wait for another rank's long work sleep instead of spinning
(`mpi_impl.cores.wait_quietly`): a nonblocking barrier tested with short
sleeps, never a blocking MPI call, wherever rank 0 works alone (the
command line's check, its table and plot). The ring's waits for a block do
the same where its ranks outnumber their machine's cores
(`mpi_impl.cores.wait_any`, chosen by `RingComm.on`). And the command line refuses an
output path it could not write before any work.

    .venv/bin/python -m pytest tests/mpi/test_waiting.py -q
"""

import numpy as np
import pytest

from mpi_impl import check, cli, cores
from test_cli_options import OneRankWorld


class Request:
    def __init__(self, tests_before_done):
        self.left = tests_before_done

    def Test(self):
        self.left -= 1
        return self.left < 0


class TwoRanks:
    """Only what a quiet wait may use: a blocking call would fail on a missing method."""
    def __init__(self, tests_before_done):
        self.request = Request(tests_before_done)

    def Get_size(self):
        return 2

    def Ibarrier(self):
        return self.request


def test_a_quiet_wait_sleeps_between_tests_of_a_nonblocking_barrier(monkeypatch):
    slept = []
    monkeypatch.setattr(cores.time, "sleep", slept.append)
    cores.wait_quietly(TwoRanks(tests_before_done=6))
    assert slept == [0.0, 0.0001, 0.0005, 0.002, 0.002, 0.002]        # at once, then longer, up to 2 ms
    slept.clear()
    cores.wait_quietly(TwoRanks(tests_before_done=0))
    assert slept == []


class Requests:
    """Stand-in requests, the second completing at its `tests_before_done`-th
    test; only Testany exists, so a spinning wait (Waitany) would fail."""
    def __init__(self, tests_before_done):
        self.left = tests_before_done

    def Testany(self, requests):
        self.left -= 1
        return (1, True) if self.left < 0 else (-1, False)


def test_a_ring_wait_among_more_ranks_than_cores_sleeps_between_tests(monkeypatch):
    slept = []
    monkeypatch.setattr(cores.time, "sleep", slept.append)
    requests = Requests(tests_before_done=8)
    assert cores.wait_any([requests, requests], quiet=True) == 1
    assert slept == [0.0, 2e-05, 5e-05, 0.0001, 0.0002, 0.0005, 0.0005, 0.0005]     # up to half a millisecond


class Machine:
    """A communicator whose ranks on this machine number `here`."""
    def __init__(self, here):
        self.here = here

    def Split_type(self, kind):
        return self

    def Get_size(self):
        return self.here

    def Free(self):
        pass

    def Dup(self):
        return self


@pytest.mark.parametrize("here, quiet", [(3, True), (2, False)])
def test_the_ring_waits_quietly_where_its_ranks_outnumber_the_cores(monkeypatch, here, quiet):
    """RingComm.on decides: ranks on this machine above the cores it may use (2 here)."""
    from mpi_impl import comm
    monkeypatch.setattr(cores.cores, "available_cores", lambda: 2)
    for name in cores.LOCAL_SIZE_VARS:
        monkeypatch.delenv(name, raising=False)
    made = []
    monkeypatch.setattr(comm.RingComm, "__init__", lambda self, c, memory=None, *, quiet, links=None: made.append(quiet))
    comm.RingComm.on(Machine(here))
    monkeypatch.setenv("MPI_LOCALNRANKS", str(here + 2))       # the launcher counts the whole job's ranks here
    comm.RingComm.on(Machine(here=1))
    assert made == [quiet, True]


def test_the_others_sleep_while_rank_0_checks_and_reports(monkeypatch):
    events = []
    monkeypatch.setattr(cli, "_max", lambda: None)
    monkeypatch.setattr(cli, "wait_quietly", lambda comm: events.append("wait"))
    real = check.Checker.reference

    def reference(self, backward):
        events.append("reference")
        return real(self, backward)
    monkeypatch.setattr(check.Checker, "reference", reference)
    world = OneRankWorld()
    world.gather = lambda x: [x]
    args = cli.build_parser().parse_args(["--seq-len", "16", "--heads", "1", "--head-dim", "4", "--tile-size", "4",
                                          "--layout", "all", "--check", "--no-warmup"])
    args.threads, args.blas_threads = 1, 1
    rows, checker = cli.run(args, cli.make_plans(args, cli.NUMPY, 1), cli.NUMPY, world)
    assert [r.error < 1e-5 for r in rows] == [True] * 3
    assert events.count("reference") == 3 and checker.want is not None
    # a wait at every layout's start, and after each check before anything else
    after = [events[i + 1] for i, e in enumerate(events) if e == "reference"]
    assert after == ["wait"] * 3, events


@pytest.mark.parametrize("option", ["--plot", "--trace-out"])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(option, tmp_path):
    args = cli.build_parser().parse_args([option, str(tmp_path / "missing" / "out.png")])
    assert "does not exist" in cli.check_args(args, 1)
    args = cli.build_parser().parse_args([option, str(tmp_path)])
    assert "is a folder" in cli.check_args(args, 1)
    args = cli.build_parser().parse_args([option, str(tmp_path / "out.png")])
    assert cli.check_args(args, 1) is None


def test_the_reference_is_computed_once_for_every_layout():
    args = cli.build_parser().parse_args(["--seq-len", "16", "--heads", "1", "--head-dim", "4"])
    checker = check.Checker(args, cli.inputs, cli.mask_options)
    first = checker.reference(backward=False)
    assert checker.reference(backward=False) is first
    both = checker.reference(backward=True)
    assert len(both) == 5 and np.array_equal(both[0], first[0])


@pytest.mark.parametrize("waits, crowded, quiet", [("auto", True, True), ("auto", False, False),
                                                   ("quiet", False, True), ("spin", True, False)])
def test_the_table_says_how_the_ranks_waited(monkeypatch, waits, crowded, quiet):
    """--waits quiet or spin is what ran (and what the table's first line says),
    whatever the machine; auto is as RingComm.on decides."""
    monkeypatch.setattr(cli, "crowded", lambda comm: crowded)
    monkeypatch.setattr(cli, "rank_share", lambda comm, **k: cores.cores.share(1, cores=1))
    args = cli.build_parser().parse_args(["--seq-len", "16", "--waits", waits])
    cli.hold_share(args, cli.make_plans(args, cli.NUMPY, 1), OneRankWorld())
    assert args.quiet_waits is quiet
