"""A deadlock of the virtual devices ends in seconds with an error that names
each device still running, the message it waits for and its round
(`reference.virtual.Watchdog`), instead of hanging until the test's timeout;
a device that computes while the others wait for it is no deadlock.

The deadlock is planted in the all-gather: device 0 waits for one block more
than the ring sends.

    .venv/bin/python -m pytest tests/oracle/test_deadlock.py -q
"""

import time

import numpy as np
import pytest

from reference import ring_attention, schemes, virtual
from reference.ring import KV
from reference.virtual import Deadlock, run_devices

PATIENCE_S = 0.3


@pytest.fixture(autouse=True)
def quick_watchdog(monkeypatch):
    monkeypatch.setattr(virtual, "DEADLOCK_S", PATIENCE_S)


def test_an_all_gather_waiting_for_a_block_never_sent_fails_naming_the_device(monkeypatch):
    gather = schemes.gather_blocks

    def one_block_too_many(block, comm, log):
        blocks = gather(block, comm, log)
        if comm.rank == 0:                          # a shift no other device makes
            comm.finish_shift(comm.start_shift(blocks[-1], KV))
        return blocks

    monkeypatch.setattr(schemes, "gather_blocks", one_block_too_many)
    q = np.random.default_rng(0).standard_normal((1, 32, 2, 8))
    with pytest.raises(Deadlock, match=r"^virtual devices deadlocked: device 0 waits for the K/V block from device 3, "
                                       r"round 3; nothing is on its way to any of them \(devices 1, 2, 3 ended\)$"):
        ring_attention(q, q, q, n_devices=4, scheme="all_gather")


def test_devices_that_wait_for_each_other_are_all_named():
    """Both devices receive before they send: each waits for the other, round 0."""
    def device(rank, comm):
        comm.finish_shift(KV)
        comm.start_shift((np.zeros(2),), KV)

    with pytest.raises(Deadlock, match=r"device 0 waits for the K/V block from device 1, round 0; "
                                       r"device 1 waits for the K/V block from device 0, round 0; "):
        run_devices(2, device)


def test_a_device_that_computes_while_the_others_wait_is_no_deadlock():
    """Device 0 computes for several times the watchdog's patience before it
    sends: the others wait, and the ring ends as usual."""
    def device(rank, comm):
        if rank == 0:
            time.sleep(4 * PATIENCE_S)
        comm.start_shift((np.full(2, rank),), KV)
        (got,) = comm.finish_shift(KV)
        return int(got[0])

    assert run_devices(3, device) == [2, 0, 1]
