"""Threads never multiply (`reference.cores`): under an outer limit of one BLAS
thread (threadpoolctl here, OPENBLAS_NUM_THREADS=1 on a command line), every
entry point computes with one BLAS thread and one worker, however it sizes
its own share.

Each test records, inside every block step it runs, BLAS's thread count and
the threads that ran the step's units, under ``threadpool_limits(1)``.

    .venv/bin/python -m pytest tests/oracle/test_nested_threads.py -q
"""

import threading

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

import reference
from bench import kernel_timing as kernel
from mpi_impl import check
from model import train, transformer
from reference import cores
from reference.step import Step
from reference.steps import parts


@pytest.fixture
def seen(monkeypatch):
    """{"blas": BLAS thread counts seen in the steps, "workers": threads that ran one call's units}."""
    if cores.blas_threads() is None:
        pytest.skip("no BLAS library found by threadpoolctl")
    record = {"blas": set(), "workers": set()}
    forward, backward, run_units = Step.forward, Step.backward, parts.run_units

    def recording(real):
        def step(self, *args, **kwargs):
            record["blas"].add(cores.blas_threads())
            return real(self, *args, **kwargs)
        return step

    def counting(fn, units, workers, *args, **kwargs):
        ran = set()

        def unit(*u):
            ran.add(threading.get_ident())
            return fn(*u)
        run_units(unit, units, workers, *args, **kwargs)
        record["workers"].add(len(ran))
    monkeypatch.setattr(Step, "forward", recording(forward))
    monkeypatch.setattr(Step, "backward", recording(backward))
    monkeypatch.setattr(parts, "run_units", counting)
    return record


def qkv(S=256, H=2, D=16, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, S, H, D)) for _ in range(3)]


@pytest.mark.parametrize("step", ["v1", "v5"])
def test_the_virtual_ring_stays_inside_an_outer_limit(seen, step):
    q, k, v = qkv()
    with threadpool_limits(1, user_api="blas"):
        out, lse, trace = reference.ring_attention(q, k, v, n_devices=1, tile_size=32, step=step, trace=True,
                                                   threads=None)
    assert seen["blas"] == {1}
    assert seen["workers"] <= {1}
    assert "1 BLAS thread per product, 1 worker" in trace.threads


def test_a_limit_asked_inside_an_outer_one_does_not_raise_it(seen):
    q, k, v = qkv()
    with threadpool_limits(1, user_api="blas"):
        assert cores.budget() == 1
        with cores.blas_limit(2):
            assert cores.blas_threads() == 1
        reference.ring_attention(q, k, v, n_devices=2, tile_size=32, step="v5", threads=2, blas_threads=2)
    assert seen["blas"] == {1} and seen["workers"] <= {1}


def test_a_steps_workers_stay_inside_an_outer_limit(seen):
    q, k, v = qkv()
    step = reference.steps.get("v3", workers=2)
    with threadpool_limits(1, user_api="blas"):
        reference.ring_attention(q, k, v, n_devices=1, tile_size=32, step=step, threads=2)
    assert seen["workers"] == {1}


def test_the_command_lines_check_stays_inside_the_ranks_share(seen):
    # --check above 2048 tokens: rank 0's reference is the ring on one virtual device
    q, k, v = (x.astype(np.float64) for x in qkv(S=check.DENSE_MAX_SEQ + 64, H=1, D=8))
    forward, _ = check.reference_functions(q.shape[1])
    with threadpool_limits(1, user_api="blas"):
        forward(q, k, v, causal=True)
    assert seen["blas"] == {1}


def test_the_models_ring_stays_inside_an_outer_limit(seen):
    config = transformer.Config(vocab=8, d_model=16, n_head=2, n_layer=1, d_ff=32)
    replica = train.virtual(config, 1, "striped", tile_size=16)
    params = transformer.init_params(config, 0, np.dtype(np.float32))
    tokens = np.random.default_rng(0).integers(0, 8, size=(2, 65))
    with threadpool_limits(1, user_api="blas"):
        replica.loss_and_grads(params, tokens)
    assert seen["blas"] == {1}


def test_a_step_called_on_its_own_stays_inside_an_outer_limit(seen):
    # as the kernel benchmark and an MPI rank call a step: no ring around it to size its workers
    pb = kernel.problem(256, 16, heads=2)
    with threadpool_limits(1, user_api="blas"):
        out, lse, _ = kernel.forward(reference.steps.get("v3", workers=2), pb, 32)
        kernel.backward(reference.steps.get("v5", workers=2), pb, out, lse, 32)
    assert seen["blas"] == {1} and seen["workers"] == {1}
