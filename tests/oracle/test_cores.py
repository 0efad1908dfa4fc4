"""How the ring's threads share the cores (reference/cores.py): BLAS held per call with
threadpoolctl, holds from several threads kept together, the share of each device.

    .venv/bin/python -m pytest tests/oracle/test_cores.py -q
"""

import threading

import numpy as np
import pytest

from reference import cores, ring_attention, steps
from reference.step import ReadableStep, no_progress
from reference.steps.parts import run_units


@pytest.fixture
def blas_count():
    """BLAS's thread count before the test, which every test must leave as it found it."""
    if cores.blas_threads() is None:
        pytest.skip("no BLAS library that threadpoolctl can hold")
    before = cores.blas_threads()
    yield before
    assert cores.blas_threads() == before, "a hold was not released"


def test_a_hold_limits_blas_and_gives_the_count_back(blas_count):
    with cores.blas_limit(2):
        assert cores.blas_threads() == 2
        with cores.blas_limit(1):                     # a step's workers inside the ring's hold
            assert cores.blas_threads() == 1
        assert cores.blas_threads() == 2


def test_one_thread_holds_blas_at_a_time(blas_count):
    # OpenBLAS's pool is the process's: while one thread holds it (the ring,
    # around its devices), another thread's hold (a device's step) changes
    # nothing, and the first hold's end gives the count back
    seen = {}

    def device():
        with cores.blas_limit(2):
            seen["device"] = cores.blas_threads()
        seen["device, after"] = cores.blas_threads()

    with cores.blas_limit(1):
        t = threading.Thread(target=device)
        t.start()
        t.join()
    assert seen == {"device": 1, "device, after": 1}


def test_workers_run_with_one_blas_thread(blas_count):
    counts = []
    run_units(lambda i: counts.append(cores.blas_threads()), [(i,) for i in range(6)], workers=2)
    assert counts == [1] * 6


def test_the_share_of_each_device():
    # threads add up to the cores: devices x workers x BLAS threads <= cores
    # wherever there are fewer devices than cores
    assert cores.share(8, cores=2) == cores.Share(cores=2, devices=8, workers=1, blas=1)
    assert cores.share(1, cores=2) == cores.Share(cores=2, devices=1, workers=2, blas=1)
    assert cores.share(1, cores=2, takes_workers=False) == cores.Share(2, 1, workers=1, blas=2)
    assert cores.share(2, cores=8, takes_workers=False) == cores.Share(8, 2, workers=1, blas=4)
    assert cores.share(2, cores=8) == cores.Share(cores=8, devices=2, workers=4, blas=1)
    assert cores.share(2, cores=3) == cores.Share(cores=3, devices=2, workers=1, blas=1)      # rounded down, never up
    assert cores.share(4, cores=7, takes_workers=False) == cores.Share(7, 4, workers=1, blas=1)
    assert cores.share(8, cores=2, threads=2, blas_threads=3) == cores.Share(2, 8, workers=1, blas=2)   # within 2 cores
    assert "1 BLAS thread per product" in cores.share(8, cores=2).label
    # devices computing at once: as many as the cores hold
    assert [cores.share(n, cores=2).at_once for n in (1, 2, 8)] == [1, 2, 2]
    assert cores.share(8, cores=2, threads=2, blas_threads=3).at_once == 1
    assert cores.share(2, cores=8).at_once == 2
    assert "2 computing at once" in cores.share(8, cores=2).label
    assert "at once" not in cores.share(2, cores=2).label
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threads must be a positive int"):
            cores.share(8, threads=bad)
        with pytest.raises(ValueError, match="blas_threads must be a positive int"):
            cores.share(8, blas_threads=bad)


def test_a_call_inside_nested_holds_has_the_innermost_budget():
    """A share held inside another is the budget of calls made there, never the outer one."""
    outer, inner = cores.share(1, cores=2, takes_workers=False), cores.share(2, cores=2)
    with outer.held():
        assert cores.budget() == 2
        with inner.held():
            assert cores.budget() == 1
        assert cores.budget() == 2


def test_blas_is_described_by_its_kernels():
    info = cores.blas_info()
    if not info:
        pytest.skip("no BLAS library found by threadpoolctl")
    text = cores.blas_description()
    assert info[0]["version"] in text and f"{info[0]['num_threads']} thread" in text
    np.ones((2, 2)) @ np.ones((2, 2))                 # still works after the look-up
    assert steps.get("v3").workers == 1


class Recording(ReadableStep):
    """Version 1, recording the workers it was given and the BLAS threads it ran with."""
    takes_workers = True

    def __init__(self, workers=1):
        self.workers, self.seen = workers, set()

    def forward_tiles(self, acc, queries, block, plan, progress=no_progress):
        self.seen.add((self.workers, cores.blas_threads()))
        super().forward_tiles(acc, queries, block, plan, progress)


@pytest.mark.parametrize("options", [{}, {"threads": 2, "blas_threads": 2}, {"blas_threads": 3}])
def test_the_virtual_ring_runs_its_devices_with_their_share(blas_count, options):
    q = np.random.default_rng(0).standard_normal((1, 64, 2, 8))
    want = cores.share(8, **options)
    step = Recording(workers=want.workers)
    out, lse, trace = ring_attention(q, q, q, n_devices=8, tile_size=4, step=step, trace=True, **options)
    assert step.seen == {(want.workers, want.blas)}            # BLAS held while the devices ran
    assert trace.threads == want.label
    np.testing.assert_allclose(out, ring_attention(q, q, q, n_devices=8, tile_size=4)[0], rtol=1e-12, atol=1e-12)


def test_the_ring_gives_a_step_its_workers_on_a_copy():
    q = np.random.default_rng(0).standard_normal((1, 64, 2, 8))
    step, want = Recording(workers=50), cores.share(8)
    ring_attention(q, q, q, n_devices=8, tile_size=4, step=step)
    assert step.workers == 50                                  # the caller's step is left as it was
    assert step.seen == {(want.workers, want.blas)}            # (a shallow copy records here too)


def test_threads_need_a_step_that_takes_workers():
    q = np.zeros((1, 16, 1, 4))
    with pytest.raises(ValueError, match="threads=2 applies to steps that take workers"):
        ring_attention(q, q, q, n_devices=2, step="v1", threads=2)
    with pytest.raises(ValueError, match="blas_threads must be a positive int"):
        ring_attention(q, q, q, n_devices=2, step="v1", blas_threads=0)


class Crowded(ReadableStep):
    """Version 1, counting the devices inside a step at the same time."""

    def __init__(self):
        self.lock, self.inside, self.most = threading.Lock(), 0, 0

    def forward_tiles(self, acc, queries, block, plan, progress=no_progress):
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        threading.Event().wait(0.005)          # room for others to come in, if they may
        super().forward_tiles(acc, queries, block, plan, progress)
        with self.lock:
            self.inside -= 1


@pytest.mark.parametrize("options", [{}, {"blas_threads": 2}])
def test_the_virtual_devices_take_turns_at_the_cores(options):
    # 8 devices: at most as many compute at once as the cores hold; the answer is the same
    q = np.random.default_rng(0).standard_normal((1, 64, 2, 8))
    step, want = Crowded(), cores.share(8, takes_workers=False, **options)
    if want.at_once >= 8:
        pytest.skip(f"{want.cores} cores hold 8 devices: none waits for a turn")
    out, lse, trace = ring_attention(q, q, q, n_devices=8, tile_size=4, step=step, trace=True, **options)
    assert 1 <= step.most <= want.at_once, (step.most, want)
    assert trace.threads == want.label
    np.testing.assert_allclose(out, ring_attention(q, q, q, n_devices=8, tile_size=4)[0], rtol=1e-12, atol=1e-12)
