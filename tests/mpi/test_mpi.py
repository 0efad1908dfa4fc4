"""mpi_impl on real MPI processes, checked against the dense reference.

Every launch of mpiexec costs about a second of start-up on this machine, so
the property test draws many hypothesis cases first and runs them all in one
launch per rank count (tests/support/mpi/batch_worker.py), then asserts case by case:
out, lse, dq, dk, dv within the conftest tolerance of the dense oracle (the
backward given the dense out and lse, as in tests/steps/test_ring.py), and the
trace equal to the cost model's prediction. Faults (ranks that disagree, one
rank raising) must end the job with its message and a non-zero exit within a
deadline. Skipped, not failed, where mpi4py or mpiexec is missing.

    .venv/bin/python -m pytest tests/mpi/test_mpi.py -q
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from conftest import Case, assert_close, cases
from mpi_impl.launch import find_mpiexec
from reference import attention, attention_backward, cost, positions
from reference.scheme_cost import predict_scheme
from reference.schemes import Scheme

pytest.importorskip("mpi4py")

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parents[1] / "support" / "mpi"
MPIEXEC = find_mpiexec()                                    # the mpich wheel's, in the venv
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")

RANKS = (1, 2, 3, 4)
# hypothesis examples per rank count, all in one launch: 12 with the dev profile, 25 with ci
CASES_PER_LAUNCH = max(12, settings.default.max_examples // 4)
LAUNCH_TIMEOUT_S = 120      # a whole batch, on 2 shared cores
# MPIEXEC_TIMEOUT of a faulty job: far above the second or two one takes, so that only a job
# that hangs reaches it; a job that ends by the launcher's time limit says so in its output
FAULT_DEADLINE_S = 90
TIME_LIMIT_MESSAGES = ("APPLICATION TIMED OUT", "time limit for job execution has been reached")


def ended_by_itself(output):
    """True unless the launcher's time limit ended the job (MPICH's and Open MPI's words)."""
    return not any(m in output for m in TIME_LIMIT_MESSAGES)


def mpirun(n, *args, mpi4py_run=True, timeout=LAUNCH_TIMEOUT_S):
    """Run `python [-m mpi4py] args...` on n ranks; return (CompletedProcess, seconds)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1",
               MPIEXEC_TIMEOUT=str(timeout))
    cmd = [MPIEXEC, "-n", str(n), sys.executable] + (["-m", "mpi4py"] if mpi4py_run else []) + list(args)
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout + 30)
    return proc, time.monotonic() - start


def run_batch(n, batch, tmp_path):
    """Run every Case of `batch` on n ranks in one launch; return {id: results}."""
    spec, data = [], {}
    for i, case in enumerate(batch):
        q, k, v, dout = case.inputs()
        out, lse = attention(q, k, v, causal=case.causal, scale=case.scale)
        for name, x in dict(q=q, k=k, v=v, dout=dout, out=out, lse=lse).items():
            data[f"{i}/{name}"] = x
        tile = list(case.tile_size) if isinstance(case.tile_size, tuple) else case.tile_size
        spec.append(dict(id=str(i), layout=case.layout, causal=case.causal, scale=case.scale, tile_size=tile))
    paths = [tmp_path / f"n{n}_{name}" for name in ("cases.json", "inputs.npz", "results.npz")]
    paths[0].write_text(json.dumps(spec))
    np.savez(paths[1], **data)
    proc, _ = mpirun(n, str(WORKERS / "batch_worker.py"), *map(str, paths))
    assert proc.returncode == 0, f"batch on {n} ranks failed:\n{proc.stdout}\n{proc.stderr}"
    results = np.load(paths[2])
    return {i: {k.split("/")[1]: results[k] for k in results.files if k.startswith(f"{i}/")}
            for i in range(len(batch))}


def assert_case(case, got):
    """One case against the dense reference and the cost model."""
    q, k, v, dout = case.inputs()
    opts = dict(causal=case.causal, scale=case.scale)
    out, lse = attention(q, k, v, **opts)
    grads = attention_backward(q, k, v, out, lse, dout, **opts)
    assert got["inputs_unchanged"], f"{case}: the ring wrote to its inputs"
    for name, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + tuple(grads)):
        assert got[name].dtype == want.dtype, f"{case}: {name} dtype {got[name].dtype} != {want.dtype}"
        factor = case.tolerance_factor if name in ("out", "lse") else case.grad_tolerance_factor
        assert_close(got[name], want, case.dtype, what=f"{name} of {case}", factor=factor)
    p = cost.predict(case.S, case.n_devices, case.layout, case.tile_size, case.causal)
    np.testing.assert_array_equal(got["pairs"], p.pairs, err_msg=f"pairs of {case}")
    np.testing.assert_array_equal(got["tiles_computed"], p.tiles_computed, err_msg=f"tiles of {case}")
    np.testing.assert_array_equal(got["source"], p.source, err_msg=f"sources of {case}")
    # N-1 transfers of the block per rank in the forward, none after the last round
    assert (got["bytes_sent"][:-1] > 0).all() and (got["bytes_sent"][-1] == 0).all(), case


def draw_cases(n, count):
    """`count` hypothesis cases on n ranks (the conftest strategy, N fixed)."""
    drawn = []

    @settings(max_examples=count, database=None, deadline=None,
              suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
    @given(cases(max_devices=4).filter(lambda c: c.n_devices == n))
    def collect(case):
        drawn.append(case)

    collect()
    return list(dict.fromkeys(drawn))      # hypothesis may repeat an example


def _case(layout, S, *, Hq=2, Hkv=2, D=4, tile_size=2, causal=True, dtype=np.float64, B=1, seed=0):
    return Case(layout=layout, n_devices=3, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, tile_size=tile_size,
                causal=causal, scale=None, dtype=dtype, kind="gaussian", seed=seed)


ODD_CASES = [
    # one token per rank (two for zigzag, its smallest)
    _case("contiguous", 3), _case("striped", 3), _case("zigzag", 6),
    # grouped-query and multi-query heads
    _case("striped", 12, Hq=6, Hkv=2), _case("zigzag", 12, Hq=4, Hkv=1),
    # tiles that do not divide the block, rectangular, and larger than the block
    _case("striped", 15, tile_size=(2, 3)), _case("contiguous", 15, tile_size=4),
    _case("zigzag", 18, tile_size=7),
    # not causal, every layout
    _case("contiguous", 9, causal=False), _case("striped", 9, causal=False),
    _case("zigzag", 12, causal=False),
    # float32 and float16 travel as they came
    _case("striped", 24, dtype=np.float32, B=2, D=8), _case("zigzag", 24, dtype=np.float16, tile_size=3),
]


@pytest.mark.parametrize("n", RANKS)
def test_matches_reference(n, tmp_path):
    """Random shapes, layouts, tiles, dtypes, causal or not: forward and backward
    on n real ranks equal the dense reference; on N = 3 (not a power of two)
    the corner cases named in ODD_CASES too, in the same launch."""
    drawn = draw_cases(n, CASES_PER_LAUNCH)
    assert len(drawn) >= CASES_PER_LAUNCH // 2, "hypothesis drew too few distinct cases"
    batch = (ODD_CASES if n == 3 else []) + drawn
    results = run_batch(n, batch, tmp_path)
    for i, case in enumerate(batch):
        assert_case(case, results[i])


# -- faults ------------------------------------------------------------------

@pytest.mark.parametrize("mode, n, message, mpi4py_run", [
    ("shapes", 3, "ranks disagree on q: rank 0 (1, 4, 2, 4), rank 1 (1, 5, 2, 4)", False),
    ("bad-input", 3, "query heads (3) must be a multiple of key/value heads (2)", False),
    ("raise", 3, "injected failure on rank 1 in round 0", True),
    ("raise-all-to-all", 2, "injected failure on rank 1 in the all-to-all", True),
    ("raise-all-gather", 3, "injected failure on rank 1 in the all-gather", True),
])
def test_fault_ends_job(mode, n, message, mpi4py_run):
    """A fault ends the job within the deadline, non-zero, with the message."""
    proc, _ = mpirun(n, str(WORKERS / "fault_worker.py"), mode, mpi4py_run=mpi4py_run, timeout=FAULT_DEADLINE_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert ended_by_itself(output), f"{mode}: the job hung:\n{output}"
    assert message in output, output
    # rank 2 needs a block only rank 1 could pass on: it ends by the abort, not by finishing
    assert f"rank {n - 1}: finished without error" not in output, output
    if not mpi4py_run:
        # the agreement check raises on every rank, not only the one at fault
        assert output.count(message) >= n, output


# -- the communication object ------------------------------------------------

@pytest.mark.parametrize("n", [1, 3])
def test_ring_comm_buffers(n):
    """tests/support/mpi/comm_worker.py: blocks arrive from the right rank, receive
    buffers rotate between two sets and never overlap a send or the held block."""
    proc, _ = mpirun(n, str(WORKERS / "comm_worker.py"), timeout=FAULT_DEADLINE_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("buffers ok") == n, proc.stdout


# -- the command line --------------------------------------------------------

def test_cli_help():
    proc = subprocess.run([sys.executable, "-m", "mpi_impl", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    for option in ("--seq-len", "--kv-heads", "--layout", "--backward", "--check", "--trace-out", "--plot"):
        assert option in proc.stdout


def test_cli_check_all_layouts(tmp_path):
    """--check --layout all --backward on 3 ranks: one row per layout, each
    error below the float64 tolerance, a trace file matching the cost model."""
    trace_path, plot_path = tmp_path / "trace.json", tmp_path / "timeline.png"
    S, n, tile = 48, 3, 4
    args = ["-m", "mpi_impl", "--seq-len", str(S), "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
            "--dtype", "float64", "--tile-size", str(tile), "--layout", "all", "--check", "--backward",
            "--trace-out", str(trace_path)]
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    if has_matplotlib:
        args += ["--plot", str(plot_path)]
    proc, _ = mpirun(n, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()
            if line.split() and line.split()[0] in ("contiguous", "striped", "zigzag")}
    assert list(rows) == ["contiguous", "striped", "zigzag"], proc.stdout
    assert "step v5, 1 worker" in proc.stdout.splitlines()[0]        # auto on NumPy arrays, named
    for layout, cells in rows.items():
        assert float(cells[1]) <= 1e-10, f"{layout}: max error {cells[1]}"
        predicted = brute_force_critical_path(S, n, "contiguous", tile) / brute_force_critical_path(S, n, layout, tile)
        assert float(cells[6]) == pytest.approx(predicted, abs=0.005), f"{layout}: predicted {cells[6]}"
    doc = json.loads(trace_path.read_text())
    assert doc["n_ranks"] == n
    for layout, entry in doc["layouts"].items():
        p = cost.predict(S, n, layout, tile)
        for kind in ("forward", "backward"):
            assert np.array_equal(entry[kind]["pairs"], p.pairs), (layout, kind)
        assert len(entry["peak_rss_kb"]) == n
    if has_matplotlib:
        assert plot_path.stat().st_size > 0



def test_cli_refuses_options_that_cannot_run():
    proc, _ = mpirun(2, "-m", "mpi_impl", "--heads", "4", "--kv-heads", "3", timeout=FAULT_DEADLINE_S)
    assert proc.returncode != 0 and ended_by_itself(proc.stdout + proc.stderr), proc.stdout + proc.stderr
    assert "error: --heads (4) must be a multiple of --kv-heads (3)" in proc.stderr, proc.stderr


def test_cli_runs_another_backend():
    """tests/support/mpi/backend_worker.py: a backend with its own option and ring
    factory gets the same table; (1 warm-up + 3 layouts) x 2 passes = 8 rings."""
    proc, _ = mpirun(3, str(WORKERS / "backend_worker.py"), "--transfer", "direct", "--seq-len", "48",
                     "--tile-size", "4", "--head-dim", "8", "--dtype", "float64", "--check", "--backward")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stand-in (direct): N=3 ranks" in proc.stdout, proc.stdout
    assert proc.stdout.count("built 8 rings") == 3, proc.stdout


def brute_force_critical_path(S, n, layout, tile):
    """Sum over rounds of the busiest rank's tile area, counted from the mask
    (tests/oracle/test_cost.py), not by reference.cost, which the command line uses."""
    from test_cost import brute_force_counts
    pos = positions(S, n, layout)
    return sum(max(brute_force_counts(pos[j], pos[(j - t) % n], tile, True)[2] for j in range(n))
               for t in range(n))


def test_cli_runs_a_scheme():
    """--scheme usp --ulysses-degree 2 --check --backward on 4 ranks: each
    layout right in float64, the table names the scheme, its predicted column
    is the scheme cost model's, and the cost model's choice is printed."""
    S, n, tile = 32, 4, 4
    proc, _ = mpirun(n, "-m", "mpi_impl", "--seq-len", str(S), "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
                     "--dtype", "float64", "--tile-size", str(tile), "--check", "--backward", "--no-warmup",
                     "--scheme", "usp", "--ulysses-degree", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "numpy: usp (u=2), N=4 ranks" in proc.stdout, proc.stdout
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()
            if line.split() and line.split()[0] in ("contiguous", "striped", "zigzag")}
    assert list(rows) == ["contiguous", "striped", "zigzag"], proc.stdout
    scheme = Scheme.checked("usp", 2, n_devices=n, Hq=4, Hkv=2)
    for layout, cells in rows.items():
        assert float(cells[1]) <= 1e-10, f"{layout}: max error {cells[1]}"
        flops = [predict_scheme(scheme, S, lay, B=1, Hq=4, Hkv=2, D=8, tile_size=tile).totals()["critical_flops"]
                 for lay in ("contiguous", layout)]
        assert float(cells[6]) == pytest.approx(flops[0] / flops[1], abs=0.005), f"{layout}: predicted {cells[6]}"
    assert re.search(r"cost model's choice \(striped; this machine: one node of 4 ranks, shared memory between "
                     r"processes at 10 GB/s, a stated figure \(--link-gbs\), not measured; .* GFLOP/s measured\): \w+",
                     proc.stdout), proc.stdout


@pytest.mark.parametrize("options, message", [
    (["--scheme", "usp"], "scheme 'usp' needs --ulysses-degree=u"),
    (["--scheme", "usp", "--ulysses-degree", "3"], "--ulysses-degree (3) must divide the number of devices (4)"),
    (["--scheme", "ulysses", "--heads", "6", "--kv-heads", "3"],
     "query heads (6) must be a multiple of --ulysses-degree (4), and key/value heads (3) a multiple of it or a divisor"),
    (["--scheme", "double_ring", "--ring-inner", "3"], "--ring-inner (3) must divide the number of devices (4)"),
    (["--scheme", "usp", "--ulysses-degree", "2", "--ring-inner", "2"], "--ring-inner=2 applies to --scheme 'double_ring'"),
    (["--scheme", "ring", "--ulysses-degree", "2"], "--ulysses-degree=2 applies to --scheme 'ulysses' or 'usp'"),
])
def test_cli_refuses_a_scheme_that_cannot_run(options, message):
    """Checked before any work, in the scheme's words with the options' names (no launch)."""
    from mpi_impl import cli
    args = cli.build_parser().parse_args(["--heads", "4"] + options)
    assert message in (cli.check_args(args, 4) or ""), cli.check_args(args, 4)
