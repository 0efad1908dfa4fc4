"""One property test body over the project's three backends, on the same drawn cases.

Each hypothesis case runs on
- the virtual ring (`reference.ring_attention`, N threads),
- `mpi_impl` on N real MPI ranks,
- `gpu_impl` on the same ranks: on a GPU where CuPy finds one, otherwise its
  data movement (`RingComm` with gpu_impl's memory object) on a GPU made of
  NumPy whose streams run later (tests/support/gpu/queued_device.py),
and each is held against the float64 oracle by the conformance kit
(`reference.testing.check_ring_attention`: out, lse, dq, dk, dv per rank,
within the error model's per-element tolerance), then against each other:
within that tolerance of the virtual ring, and the GPU stand-in bit for bit
equal to mpi_impl (the same ring and readable step; only the transfer differs).

The MPI ranks are launched once per world size (tests/support/mpi/batch_worker.py
--serve, a `reference.testing.ProcessGroup`) and serve one example at a time,
so hypothesis drives and shrinks as for an in-process function. Skipped, not
failed, where mpi4py or mpiexec is missing.

    .venv/bin/python -m pytest tests/mpi/test_backends.py -q
"""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpi_impl.launch import find_mpiexec
from reference.testing import (DROPOUT, NAMES, PLAIN, Adapter, ProcessGroup, VirtualRingAdapter,
                               assert_attention_close, cases, check_ring_attention, tolerances)

pytest.importorskip("mpi4py")

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "mpi" / "batch_worker.py"
MPIEXEC = find_mpiexec()                                    # the mpich wheel's, in the venv
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")

MAX_DEVICES = 4             # a served group of N ranks per N: 1 + 2 + 3 + 4 processes, asleep between examples
REQUEST_TIMEOUT_S = 60      # one example, forward and backward on every backend, on 2 shared cores
JOB_TIMEOUT_S = 1800        # MPIEXEC_TIMEOUT: a whole session of examples


def gpu_present():
    try:
        import gpu_impl
        gpu_impl.require_cupy()
    except Exception:          # noqa: BLE001 - GpuUnavailable, or CuPy failing to import
        return False
    return True


GPU = "cupy" if gpu_present() else "numpy"


class Groups:
    """One served MPI group per world size, started on first use; and the last
    example's replies, so that the mpi and gpu adapters share one request."""

    def __init__(self):
        self.groups, self.last = {}, (None, None)

    def replies(self, case, shards, like):
        if self.last[0] != (case, like.name):
            group = self.groups.get(case.n_devices)
            if group is None:
                env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1",
                           MPIEXEC_TIMEOUT=str(JOB_TIMEOUT_S))
                group = self.groups[case.n_devices] = ProcessGroup(
                    [MPIEXEC, "-n", case.n_devices, sys.executable, "-m", "mpi4py", WORKER, "--serve", "{socket}",
                     "--device", GPU if GPU == "cupy" else "mpi", "--mpi-step", "v1"],
                    timeout=REQUEST_TIMEOUT_S, env=env, cwd=ROOT)
            case_spec = dict(layout=case.layout, causal=case.causal, scale=case.scale,
                             tile_size=list(case.tile_size) if isinstance(case.tile_size, tuple) else case.tile_size,
                             scheme=like.scheme, ulysses_degree=like.plan(case).u if like.plan(case).u > 1 else None,
                             ring_inner=like.ring_inner,
                             dropout=case.dropout or 0.0, seed=case.seed)
            request = dict(case=case_spec, backends=["mpi", GPU],
                           shards=dict(q=shards.q, k=shards.k, v=shards.v, dout=shards.dout))
            self.last = ((case, like.name), group.request(request))
        return self.last[1]

    def close(self):
        for group in self.groups.values():
            group.close()


class Served(Adapter):
    """A backend of the served MPI group as a kit adapter, running the scheme of
    `like` (a `VirtualRingAdapter`: its positions, heads and world sizes), with
    dropout (the keep mask of global heads and positions, the same on every backend)."""
    masks = PLAIN + DROPOUT

    def __init__(self, groups, backend, name, like):
        self.groups, self.backend, self.like = groups, backend, like
        self.name = name + ("" if like.scheme == "ring" else like.name[len("reference.ring_attention"):])
        self.world_sizes, self.positions, self.head_multiple = like.world_sizes, like.positions, like.head_multiple
        self.replicates_kv_heads = like.replicates_kv_heads

    def supports(self, case):
        return self.like.supports(case) or super().supports(case)

    def run(self, case, shards):
        return [reply[self.backend] for reply in self.groups.replies(case, shards, self.like)]


@pytest.fixture(scope="module")
def groups():
    served = Groups()
    yield served
    served.close()


def on_every_backend(groups, like):
    """The scheme of `like` on the three backends, as kit adapters."""
    return {"virtual": like, "mpi": Served(groups, "mpi", "mpi_impl", like),
            "gpu": Served(groups, GPU, f"gpu_impl ({'GPU' if GPU == 'cupy' else 'NumPy standing in for CuPy'})",
                          like)}


@pytest.fixture(scope="module")
def backends(groups):
    return on_every_backend(groups, VirtualRingAdapter())


# the drawn problems: every layout, N = 1..4, dtypes, GQA/MQA, tiles, hard inputs; some with a NaN injected
CASES = st.one_of(cases(max_devices=MAX_DEVICES), cases(max_devices=MAX_DEVICES, poison=True, poison_values=("nan",)))


@settings(deadline=None)
@given(case=CASES)
def test_three_backends_agree_with_the_oracle_and_each_other(backends, case):
    agree_with_the_oracle_and_each_other(backends, case)


SCHEMES = [VirtualRingAdapter("all_gather"), VirtualRingAdapter("ulysses"), VirtualRingAdapter("usp", ulysses_degree=2),
           VirtualRingAdapter("double_ring", ring_inner=2)]


@pytest.mark.parametrize("like", SCHEMES, ids=lambda a: a.scheme)
def test_every_scheme_on_three_backends_agrees_with_the_oracle_and_each_other(groups, like):
    """Each scheme, with dropout drawn about half the time (the kit's cases), on the three backends;
    Ulysses and USP with fewer K/V heads than their degree too (copied to the ranks reading them)."""
    backends = on_every_backend(groups, like)

    @settings(deadline=None, max_examples=15)
    @given(case=cases(devices=like.world_sizes, head_multiple=like.head_multiple, masks=PLAIN + DROPOUT,
                      replicates_kv_heads=like.replicates_kv_heads, keep=lambda case: not like.supports(case)))
    def body(case):
        agree_with_the_oracle_and_each_other(backends, case)
    body()


def agree_with_the_oracle_and_each_other(backends, case):
    """The one test body: each backend against the oracle, then mpi and gpu
    against the virtual ring, and the GPU stand-in bit for bit against mpi_impl."""
    results = {name: check_ring_attention(adapter, case) for name, adapter in backends.items()}
    tol = tolerances(case)
    pos = backends["virtual"].positions(case)
    for name in ("mpi", "gpu"):
        for r in range(case.n_devices):
            for out in NAMES:
                axis = 2 if out == "lse" else 1
                assert_attention_close(results[name][r][out], results["virtual"][r][out],
                                       np.take(tol[out], pos[r], axis=axis), name=f"{name} vs virtual ring: {out}",
                                       positions=pos[r], rank=r)
    if GPU == "numpy":
        for r in range(case.n_devices):
            for out in NAMES:
                np.testing.assert_array_equal(results["gpu"][r][out], results["mpi"][r][out],
                                              err_msg=f"gpu stand-in vs mpi_impl: {out} on rank {r} of {case}")
