"""mpi_impl's collective agreement check (`mpi_impl.agree`), field by field,
on ranks as threads (no MPI launch): for every field that must agree, one rank
calls the ring differently and every rank raises "ranks disagree on <field>"
before any block moves; the mask's own fields (window, documents, seq_len,
dropout, seed) among them; and `seq_len` checked against the shards.
tests/mpi/test_faults.py does the same for the plain fields on real MPI processes.

    .venv/bin/python -m pytest tests/mpi/test_agreement.py -q
"""

import threading

import numpy as np
import pytest

import mpi_impl
from conftest import assert_close
from reference import attention, shard, unshard
from reference.masks import make_mask
from reference.virtual import run_devices
from test_gpu import OneRank, ThreadComm, fake_world

N, C = 3, 4                  # ranks, tokens per rank
S = N * C


def _no_ring(comm):
    raise ValueError("no ring")


# a rank that passes the checks says so instead of waiting in a ring for the others
ONLY_CHECKS = dict(tile_size=2, make_ring=_no_ring)


def data(c=C, hq=2, hkv=2, dtype=np.float64):
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((1, c, h, 4)).astype(dtype) for h in (hq, hkv, hkv))


def forward(**changes):
    q, k, v = changes.pop("qkv", data())
    return lambda comm: mpi_impl.ring_attention(q, k, v, comm=comm, **dict(ONLY_CHECKS, **changes))


def backward(**changes):
    q, k, v = data()
    out, lse, dout = q.copy(), np.zeros((1, 2, C)), q.copy()
    named = dict(out=out, lse=lse, dout=dout)
    named.update({n: changes.pop(n) for n in ("out", "lse", "dout") if n in changes})
    return lambda comm: mpi_impl.ring_attention_backward(q, k, v, named["out"], named["lse"], named["dout"],
                                                         comm=comm, **dict(ONLY_CHECKS, **changes))


# field that must agree -> (what the other ranks call, what rank 1 calls); v, out
# and dout must have k's and q's shapes and dtype, so they differ only where those do
FIELDS = {
    "kind": (forward(), backward()),
    "q": (forward(), forward(qkv=data(c=C, hq=4))),
    "k": (forward(), forward(qkv=data(hq=2, hkv=1))),
    "dtype": (forward(), forward(qkv=data(dtype=np.float32))),
    "layout": (forward(), forward(layout="contiguous")),
    "causal": (forward(), forward(causal=False)),
    "scale": (forward(), forward(scale=0.3)),
    "tile_size": (forward(), forward(tile_size=3)),
    "step": (forward(step="v1"), forward(step="v2")),
    "trace": (forward(), forward(trace="rank")),
    "lse": (backward(), backward(lse=np.zeros((1, 2, C), np.float32))),
    "scheme": (forward(), forward(scheme="all_gather")),
    "ulysses_degree": (forward(scheme="usp", ulysses_degree=1, qkv=data(hq=3, hkv=3)),
                       forward(scheme="usp", ulysses_degree=3, qkv=data(hq=3, hkv=3))),
}
# mask options that must agree: every one is a field of the "mask" entry
MASK_FIELDS = {
    "window": (forward(window=3), forward(window=4)),
    "window or none": (forward(), forward(window=S)),
    "cu_seqlens": (forward(cu_seqlens=[0, 5, S]), forward(cu_seqlens=[0, 6, S])),
    "segment_ids": (forward(segment_ids=[0] * 6 + [1] * 6), forward(segment_ids=[0] * 5 + [1] * 7)),
    "documents or none": (forward(), forward(cu_seqlens=[0, S])),
    "seq_len": (forward(seq_len=S - 1), forward(seq_len=S - 2)),
    "dropout": (forward(dropout=0.1, seed=1), forward(dropout=0.2, seed=1)),
    "seed": (forward(dropout=0.1, seed=1), forward(dropout=0.1, seed=2)),
    "seed, backward": (backward(dropout=0.1, seed=1), backward(dropout=0.1, seed=2)),
}


def every_rank(usual, odd):
    """Run the calls on N threads (rank 1 the odd one); each rank's ValueError
    message, or what the call returned."""
    boxes, gathered, barrier = fake_world(N), [None] * N, threading.Barrier(N)

    def rank(j, _virtual):
        comm = ThreadComm(j, N, boxes, gathered, barrier)
        try:
            return (odd if j == 1 else usual)(comm)
        except ValueError as e:
            return str(e)
    return run_devices(N, rank)


@pytest.mark.parametrize("field", FIELDS)
def test_ranks_that_differ_in_one_field_all_refuse(field):
    for message in every_rank(*FIELDS[field]):
        assert isinstance(message, str) and message.startswith(f"ranks disagree on {field}: rank 0 "), message


@pytest.mark.parametrize("field", MASK_FIELDS)
def test_ranks_that_differ_in_one_mask_option_all_refuse(field):
    for message in every_rank(*MASK_FIELDS[field]):
        assert isinstance(message, str) and message.startswith("ranks disagree on mask: rank 0 "), message


def test_ranks_that_agree_run():
    # the counterpart: every mask option on, the same on every rank: dense's answer
    opts = dict(window=5, cu_seqlens=[0, 4, 9, 11], seq_len=11, dropout=0.3, seed=4)
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, S, 2, 4)) for _ in range(3))
    shards = [shard(x, N, "striped") for x in (q, k, v)]
    call = lambda comm: mpi_impl.ring_attention(*(s[comm.rank] for s in shards), comm=comm, tile_size=2,  # noqa: E731
                                                **opts)
    results = every_rank(call, call)
    out = unshard([r[0] for r in results], "striped", seq_len=11)
    want, _ = attention(q[:, :11], k[:, :11], v[:, :11], **{n: x for n, x in opts.items() if n != "seq_len"})
    assert_close(out, want, np.float64, "out")


def test_every_mask_option_is_in_what_ranks_compare():
    # Mask.describe: one option changed, another description
    base = dict(causal=True, window=3, cu_seqlens=[0, 5, S], dropout=0.1, seed=1, seq_len=S)
    changed = [dict(causal=False), dict(window=4), dict(window=None), dict(cu_seqlens=[0, 6, S]),
               dict(cu_seqlens=None), dict(dropout=0.2), dict(dropout=0.0), dict(seed=2), dict(seq_len=None)]
    seen = {make_mask(**base).describe()}
    for change in changed:
        d = make_mask(**dict(base, **change)).describe()
        assert d not in seen, change
        seen.add(d)


# -- seq_len against the shards -------------------------------------------------

@pytest.mark.parametrize("layout, seq_len", [("striped", 12), ("zigzag", 11), ("zigzag", 12), ("contiguous", 12)])
def test_seq_len_that_pads_to_the_shards_is_taken(layout, seq_len):
    q, k, v = data(c=12)
    with pytest.raises(ValueError, match="no ring"):          # the checks passed
        mpi_impl.ring_attention(q, k, v, comm=OneRank(), layout=layout, seq_len=seq_len, make_ring=_no_ring)


@pytest.mark.parametrize("seq_len", [8, 13, 24, 0, -12, 12.0, True, "12", 11.5])
def test_seq_len_that_does_not_fit_the_shards_is_refused(seq_len):
    # one rank of 12 tokens: striped pads to a multiple of 1, so only 12 fits
    q, k, v = data(c=12)
    with pytest.raises(ValueError, match=r"seq_len must be the real sequence length.* got "):
        mpi_impl.ring_attention(q, k, v, comm=OneRank(), seq_len=seq_len, make_ring=_no_ring)


def test_seq_len_on_ranks_refuses_what_another_length_would_pad():
    # 3 ranks of 4: 12 tokens; striped pads 10..12 to 12 (9 stays 9), zigzag
    # (6 chunks) pads 7..12 to 12 (6 stays 6)
    for layout, good, bad in (("striped", (10, 11, 12), (9, 13)), ("zigzag", (7, 11, 12), (6, 13))):
        for seq_len in good + bad:
            messages = every_rank(*(forward(layout=layout, seq_len=seq_len),) * 2)
            if seq_len in good:
                assert all(m == "no ring" for m in messages), (layout, seq_len, messages)
            else:
                assert all(isinstance(m, str) and "seq_len must be the real sequence length" in m for m in messages)
