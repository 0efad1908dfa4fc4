"""Padding rows as mpi_impl and gpu_impl return them: a sequence of any
length is padded to the layout's multiple (`reference.shard`), and the shards
the ranks return still hold the padding. A padding query sees no key, so by
the rule for such rows (docs/design.md) its out is 0 and its lse -inf, and a
padding key takes no gradient: dq, dk, dv 0 there. Other tests drop the
padding before comparing; here it is what is compared. Ranks are threads
(tests/gpu/test_gpu.py's ThreadComm), gpu_impl's GPU is NumPy whose streams run
later (tests/support/gpu/queued_device.py).

    .venv/bin/python -m pytest tests/oracle/test_padding_rows.py -q
"""

import threading

import numpy as np
import pytest

import gpu_impl
import mpi_impl
from conftest import assert_close
from reference import attention, attention_backward, positions, shard, unshard
from reference.layouts import padded_length
from reference.virtual import run_devices
from test_gpu import ThreadComm, fake_mpi, fake_world  # noqa: F401 (a fixture)

N = 3
MASKS = [dict(), dict(causal=False), dict(window=3), dict(cu_seqlens=[0, 4, 7]), dict(segment_ids=[0, 1] * 3 + [2]),
         dict(dropout=0.3, seed=5), dict(causal=False, window=2, dropout=0.5, seed=1)]


def ranks(backend, layout, S, options, monkeypatch):
    """out, lse, dq, dk, dv of every rank (padding included), inputs of S real
    tokens padded by `shard`; and the inputs."""
    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal((1, S, 2, 4)) for _ in range(4))
    boxes, gathered, barrier = fake_world(N), [None] * N, threading.Barrier(N)
    gpus = _queued_gpus(monkeypatch) if backend == "gpu_impl" else None
    module = gpu_impl if backend == "gpu_impl" else mpi_impl

    def rank(j, _virtual):
        comm = ThreadComm(j, N, boxes, gathered, barrier)
        xs = [shard(x, N, layout)[j] for x in (q, k, v, dout)]
        if gpus is not None:
            _where.gpu = gpus[j]
            xs = [gpus[j].asarray(x) for x in xs]
        opts = dict(comm=comm, layout=layout, tile_size=2, seq_len=S, **options)
        o, l = module.ring_attention(*xs[:3], **opts)
        grads = module.ring_attention_backward(*xs[:3], o, l, xs[3], **opts)
        return tuple(np.asarray(x.get() if gpus is not None else x) for x in (o, l) + tuple(grads))

    if gpus is None:
        return run_devices(N, rank), (q, k, v, dout)
    with gpus[0].installed():
        return run_devices(N, lambda j, virtual: _installed(gpus[j], rank, j, virtual)), (q, k, v, dout)


_where = threading.local()


def _installed(gpu, fn, *args):
    with gpu.installed():
        return fn(*args)


def _queued_gpus(monkeypatch):
    from gpu_impl import api, transfer
    from queued_device import QueuedDevice
    monkeypatch.setattr(transfer, "mpi_cuda_support", lambda: 0)
    monkeypatch.setattr(api, "CupyDevice", lambda cupy, index: _where.gpu)
    return [QueuedDevice("copies-late") for _ in range(N)]


@pytest.mark.parametrize("options", MASKS, ids=lambda o: ",".join(o) or "causal")
@pytest.mark.parametrize("layout", ["contiguous", "striped", "zigzag"])
@pytest.mark.parametrize("backend", ["mpi_impl", "gpu_impl"])
def test_padding_rows_give_out_0_lse_minus_inf_and_no_gradient(backend, layout, options, monkeypatch, fake_mpi):
    S = 7                                           # 3 ranks: padded to 9, or to 12 for zigzag
    results, (q, k, v, dout) = ranks(backend, layout, S, options, monkeypatch)
    pos = positions(padded_length(S, N, layout), N, layout)
    assert (pos >= S).sum() in (2, 5)
    for j, (out, lse, dq, dk, dv) in enumerate(results):
        pad = pos[j] >= S
        np.testing.assert_array_equal(out[:, pad], 0.0, err_msg=f"out of rank {j}'s padding rows")
        np.testing.assert_array_equal(lse[:, :, pad], -np.inf, err_msg=f"lse of rank {j}'s padding rows")
        for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
            np.testing.assert_array_equal(g[:, pad], 0.0, err_msg=f"{name} of rank {j}'s padding rows")
    # and the real rows are dense's
    want_out, want_lse = attention(q, k, v, **options)
    want = (want_out, want_lse) + attention_backward(q, k, v, want_out, want_lse, dout, **options)
    for i, (name, w) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), want)):
        got = unshard([r[i] for r in results], layout, axis=2 if name == "lse" else 1, seq_len=S)
        if name == "lse":
            np.testing.assert_array_equal(np.isneginf(got), np.isneginf(w))
            got, w = np.where(np.isneginf(w), 0, got), np.where(np.isneginf(w), 0, w)
        assert_close(got, w, np.float64, f"{name}, real rows")
