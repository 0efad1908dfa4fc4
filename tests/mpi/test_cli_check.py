"""The command line's judgement: --check fed wrong results must fail the job,
and --repeat's critical path must take each (round, rank)'s least CPU time.

One launch of tests/support/mpi/check_worker.py on 2 ranks runs every scenario (a NaN
in out, a NaN only in dq, dk halved, gradients missing, lse off, a ring that
ignores --no-causal, and canned CPU times over 3 repeats); the test reads each
rank's exit status per scenario, the CHECK FAILED lines and the trace files.

    .venv/bin/python -m pytest tests/mpi/test_cli_check.py -q
"""

import json
import re

import numpy as np
import pytest

from test_mpi import MPIEXEC, WORKERS, mpirun

pytest.importorskip("mpi4py")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")

N_RANKS = 2
WRONG = {   # scenario -> the results --check must name in its CHECK FAILED line
    "nan-out": ["out nan"],
    "nan-dq": ["dq nan"],
    "wrong-dk": ["dk 5.0e-01"],
    "no-grads": ["dq inf", "dk inf", "dv inf"],
    "wrong-lse": ["lse "],
    "always-causal": ["out ", "dq "],
}
RIGHT = ("correct", "correct-noncausal", "repeat")


def _worker():
    """The worker as a module (it imports mpi4py only when it runs)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("check_worker", WORKERS / "check_worker.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return worker


WORKER = _worker()


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    """(CompletedProcess, {scenario: {rank: status}}, trace dir) of one launch."""
    trace_dir = tmp_path_factory.mktemp("check")
    proc, _ = mpirun(N_RANKS, str(WORKERS / "check_worker.py"), str(trace_dir))
    statuses = {}
    for rank, scenario, status in re.findall(r"rank (\d+): ([\w-]+): status (\d+)", proc.stdout):
        statuses.setdefault(scenario, {})[int(rank)] = int(status)
    return proc, statuses, trace_dir


def test_every_scenario_ran(judged):
    proc, statuses, _ = judged
    assert set(statuses) == set(WORKER.SCENARIOS) == set(WRONG) | set(RIGHT), proc.stdout + proc.stderr


@pytest.mark.parametrize("scenario", sorted(WRONG))
def test_check_fails_a_wrong_result(judged, scenario):
    """Every rank exits 1, and the CHECK FAILED line names what was wrong."""
    proc, statuses, _ = judged
    assert statuses[scenario] == {0: 1, 1: 1}, f"{scenario}: {statuses[scenario]}\n{proc.stderr}"
    # one CHECK FAILED line per wrong scenario, in the order the worker runs them
    failures = [line for line in proc.stderr.splitlines() if line.startswith("CHECK FAILED")]
    line = failures[[name for name in WORKER.SCENARIOS if name in WRONG].index(scenario)]
    for what in WRONG[scenario]:
        assert what in line, f"{scenario}: {line}"


def test_check_passes_a_right_result(judged):
    proc, statuses, _ = judged
    for scenario in RIGHT:
        assert statuses[scenario] == {0: 0, 1: 0}, f"{scenario}: {statuses[scenario]}\n{proc.stderr}"
    assert proc.stderr.count("CHECK FAILED") == len(WRONG), proc.stderr


def test_a_failed_check_fails_the_process(judged):
    proc, _, _ = judged
    assert proc.returncode != 0, proc.stdout + proc.stderr


def test_critical_path_takes_least_cpu_time_per_round_and_rank(judged):
    """Canned CPU times over 3 repeats (tests/support/mpi/check_worker.py): each (round,
    rank) keeps its least, the critical path sums the busiest rank per round.
    The least per (round, rank) is 1 s everywhere: 2 s per pass, 4 s in all;
    the most would give 20 s, the best single repeat 12 s."""
    canned = np.array(WORKER.CANNED_CPU_S)                   # (repeat, rank, round)
    least = canned.min(axis=0).T                              # (round, rank), as the trace's [t, j]
    _, statuses, trace_dir = judged
    entry = json.loads((trace_dir / "repeat.json").read_text())["layouts"]["striped"]
    for kind in ("forward", "backward"):
        np.testing.assert_array_equal(entry[kind]["compute_cpu_s"], least, err_msg=kind)
    assert entry["critical_cpu_s"] == pytest.approx(2 * least.max(axis=1).sum()) == 4.0
