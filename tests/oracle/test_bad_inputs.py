"""A catalogue of bad inputs across `reference`, `mpi_impl` and `gpu_impl`
(without a GPU: a stand-in `cupy` module, as in tests/gpu/test_gpu.py, and a
one-rank stand-in communicator): each must raise the named exception type with
a message that names the argument; and the caller's arrays are never modified
(docs/design.md, "How it behaves with bad input").

    .venv/bin/python -m pytest tests/oracle/test_bad_inputs.py -q
"""

import re
import sys

import numpy as np
import pytest

import gpu_impl
import mpi_impl
from reference import (attention, attention_backward, positions, ring_attention, ring_attention_backward,
                       shard, unshard)
from strict_comm import StrictRing, World
from test_gpu import OneRank

B, S, Hq, Hkv, D = 1, 8, 4, 2, 4


class Tensor:
    """Looks like a torch tensor to the checks (its type lives in `torch`), so
    that the message for one is tested without torch installed."""
    __module__ = "torch"
    shape, ndim, dtype = (B, S, Hq, D), 4, "torch.float32"


class JaxArray:
    __module__ = "jaxlib.xla_extension"
    shape, ndim, dtype = (B, S, Hkv, D), 4, "float32"


def arrays(dtype=np.float32):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D)))
    return q, k, v


def grads_inputs():
    q, k, v = arrays()
    return q, k, v, q.copy(), np.zeros((B, Hq, S), np.float32), q.copy()


def qkv(**changes):
    q, k, v = arrays()
    named = {**dict(q=q, k=k, v=v), **changes}
    return named["q"], named["k"], named["v"]


def backward_args(**changes):
    names = ("q", "k", "v", "out", "lse", "dout")
    named = dict(zip(names, grads_inputs()), **changes)
    return tuple(named[n] for n in names)


X = arrays()[0]

# (id, call, exception type, argument named, more text the message must hold)
REFERENCE = [
    ("torch q", lambda: attention(*qkv(q=Tensor())), TypeError, "q", "q.detach().cpu().numpy()"),
    ("torch k, ring", lambda: ring_attention(*qkv(k=Tensor()), n_devices=2), TypeError, "k", "torch.Tensor"),
    ("jax v", lambda: attention(*qkv(v=JaxArray())), TypeError, "v", "np.asarray(v)"),
    ("list q", lambda: attention(*qkv(q=[[1.0]])), TypeError, "q", "got list"),
    ("None q", lambda: ring_attention(*qkv(q=None), n_devices=2), TypeError, "q", "got NoneType"),
    ("int q", lambda: attention(*qkv(q=X.astype(np.int32))), TypeError, "q", "float16, float32 or float64"),
    ("mixed dtypes", lambda: attention(*qkv(v=arrays(np.float64)[2])), TypeError, "v", "share one dtype"),
    ("3-d k", lambda: attention(*qkv(k=arrays()[1][0])), ValueError, "k", "4 dimensions"),
    ("backward out list", lambda: attention_backward(*backward_args(out=[1.0])), TypeError, "out", "got list"),
    ("backward lse None", lambda: attention_backward(*backward_args(lse=None)), TypeError, "lse", "NoneType"),
    ("backward dout list", lambda: attention_backward(*backward_args(dout=[[0.0]])), TypeError, "dout", "list"),
    ("ring backward out None", lambda: ring_attention_backward(*backward_args(out=None), n_devices=2),
     TypeError, "out", "NoneType"),
    ("ring backward dout torch", lambda: ring_attention_backward(*backward_args(dout=Tensor()), n_devices=2),
     TypeError, "dout", "dout.detach().cpu().numpy()"),
    ("backward lse shape", lambda: attention_backward(*backward_args(lse=np.zeros((B, S, Hq), np.float32))),
     ValueError, "lse", "(B, Hq, S)"),
    ("unshard empty", lambda: unshard([], "striped"), ValueError, "shards", "non-empty"),
    ("unshard shapes differ", lambda: unshard([X, X[:, :4]], "striped"), ValueError, "shards", "one shape"),
    ("unshard axis", lambda: unshard([X, X], "striped", axis=5), ValueError, "axis", "out of range"),
    ("unshard not arrays", lambda: unshard([X, [1.0]], "striped"), TypeError, "shards[1]", "must be an array"),
    ("unshard a string", lambda: unshard("ab", "striped"), ValueError, "shards", "non-empty list"),
    ("shard axis 4", lambda: shard(X, 2, "striped", axis=4), ValueError, "axis", "out of range"),
    ("shard axis float", lambda: shard(X, 2, "striped", axis=1.0), TypeError, "axis", "an int"),
    ("shard a list", lambda: shard([[1.0, 2.0]], 2, "striped"), TypeError, "x", "must be an array"),
    ("shard 0 devices", lambda: shard(X, 0, "striped"), ValueError, "n_devices", "positive int"),
    ("positions float", lambda: positions(8.0, 2, "striped"), TypeError, "seq_len", "an int"),
    ("positions layout", lambda: positions(8, 2, "rings"), ValueError, "layout", "one of"),
    ("tile 0", lambda: ring_attention(*arrays(), n_devices=2, tile_size=0), ValueError, "tile_size", "positive"),
    ("scale inf", lambda: ring_attention(*arrays(), n_devices=2, scale=np.inf), ValueError, "scale", "finite"),
    ("causal str", lambda: attention(*arrays(), causal="yes"), TypeError, "causal", "a bool"),
    ("n_devices 0", lambda: ring_attention(*arrays(), n_devices=0), ValueError, "n_devices", "positive int"),
    ("window 0", lambda: ring_attention(*arrays(), n_devices=2, window=0), ValueError, "window", "positive int"),
]


def mpi_forward(**changes):
    q, k, v = qkv(**{n: changes.pop(n) for n in ("q", "k", "v") if n in changes})
    options = {**dict(comm=OneRank(), layout="striped"), **changes}
    return lambda: mpi_impl.ring_attention(q, k, v, **options)


def mpi_backward(**changes):
    return lambda: mpi_impl.ring_attention_backward(*backward_args(**changes), comm=OneRank())


MPI_IMPL = [
    ("mpi comm None", mpi_forward(comm=None), TypeError, "comm", "mpi4py communicator"),
    ("mpi torch q", mpi_forward(q=Tensor()), TypeError, "q", "q.detach().cpu().numpy()"),
    ("mpi trace", mpi_forward(trace="yes"), ValueError, "trace", "one of"),
    ("mpi layout", mpi_forward(layout="ring"), ValueError, "layout", "one of"),
    ("mpi tile", mpi_forward(tile_size=(0, 2)), ValueError, "tile_size", "positive"),
    ("mpi mixed dtypes", mpi_forward(k=arrays(np.float64)[1]), TypeError, "k", "share one dtype"),
    ("mpi backward lse list", mpi_backward(lse=[0.0]), TypeError, "lse", "got list"),
    ("mpi backward dout None", mpi_backward(dout=None), TypeError, "dout", "NoneType"),
    ("mpi backward out shape", mpi_backward(out=np.zeros((B, S, Hq, D + 1), np.float32)), ValueError, "out",
     "q's shape"),
    ("mpi zigzag odd shard", mpi_forward(**dict(zip("qkv", (x[:, :3] for x in arrays()))), layout="zigzag"),
     ValueError, "layout", "even number of tokens per rank (each holds two chunks of S // 2N), got 3 tokens per rank"),
]


@pytest.fixture
def fake_cupy(monkeypatch):
    import contextlib

    from gpu_impl import api
    from queued_device import FAKE_CUPY         # a cupy made of NumPy (tests/gpu, on the path via test_gpu)
    monkeypatch.setitem(sys.modules, "cupy", FAKE_CUPY)
    monkeypatch.setattr(api, "CupyDevice", lambda cupy, index: contextlib.nullcontext())   # no streams needed
    return FAKE_CUPY


def gpu_forward(**changes):
    def call():
        cupy, options = sys.modules["cupy"], dict(changes)
        q, k, v = (cupy.asarray(x) for x in arrays(options.pop("dtype", np.float32)))
        named = dict(q=q, k=k, v=v)
        named.update({n: options.pop(n) for n in ("q", "k", "v") if n in options})
        options = {**dict(comm=OneRank(), layout="striped"), **options}
        return gpu_impl.ring_attention(named["q"], named["k"], named["v"], **options)
    return call


def gpu_backward(**changes):
    def call():
        cupy = sys.modules["cupy"]
        named = dict(zip(("q", "k", "v", "out", "lse", "dout"), (cupy.asarray(x) for x in grads_inputs())))
        named.update(changes)
        return gpu_impl.ring_attention_backward(*named.values(), comm=OneRank())
    return call


GPU_IMPL = [
    ("gpu numpy q", gpu_forward(q=arrays()[0]), TypeError, "q", "must be a CuPy array"),
    ("gpu torch k", gpu_forward(k=Tensor()), TypeError, "k", "must be a CuPy array"),
    ("gpu step", gpu_forward(step="fast"), ValueError, "step", "one of"),
    ("gpu transfer", gpu_forward(transfer="fast"), ValueError, "transfer", "one of"),
    ("gpu fused float64", gpu_forward(step="fused", dtype=np.float64), ValueError, "step", "float64"),
    ("gpu comm None", gpu_forward(comm=None), TypeError, "comm", "mpi4py communicator"),
    ("gpu trace", gpu_forward(trace=2), ValueError, "trace", "one of"),
    ("gpu backward lse numpy", gpu_backward(lse=np.zeros((B, Hq, S), np.float32)), TypeError, "lse",
     "must be a CuPy array"),
    ("gpu zigzag odd shard", lambda: gpu_impl.ring_attention(
        *(sys.modules["cupy"].asarray(x[:, :3]) for x in arrays()), comm=OneRank(), layout="zigzag"),
     ValueError, "layout", "even number of tokens per rank (each holds two chunks of S // 2N), got 3 tokens per rank"),
]


def test_the_catalogue_is_large_enough():
    assert len(REFERENCE) + len(MPI_IMPL) + len(GPU_IMPL) >= 30
    ids = [case[0] for case in REFERENCE + MPI_IMPL + GPU_IMPL]
    assert len(set(ids)) == len(ids)


def assert_refused(call, error, argument, text):
    with pytest.raises(Exception) as caught:
        call()
    e = caught.value
    assert type(e) is error, f"{type(e).__name__}: {e} (expected {error.__name__})"
    message = str(e)
    # the argument's name as a word of the message (so "q" is not found inside "sequence")
    assert re.search(rf"(?<![\w.]){re.escape(argument)}(?![\w])", message), f"{argument!r} not named: {message}"
    assert text in message, f"{text!r} not in: {message}"


@pytest.mark.parametrize("case", REFERENCE, ids=[c[0] for c in REFERENCE])
def test_reference_refuses(case):
    assert_refused(*case[1:])


@pytest.mark.parametrize("case", MPI_IMPL, ids=[c[0] for c in MPI_IMPL])
def test_mpi_impl_refuses(case):
    assert_refused(*case[1:])


@pytest.mark.parametrize("case", GPU_IMPL, ids=[c[0] for c in GPU_IMPL])
def test_gpu_impl_refuses(case, fake_cupy):
    assert_refused(*case[1:])


# -- the caller's arrays are never modified ---------------------------------------

def frozen(*xs):
    """Read-only copies: an entry point writing to one raises instead of passing."""
    out = []
    for x in xs:
        y = np.array(x)
        y.setflags(write=False)
        out.append(y)
    return out


def one_rank_ring(comm):
    return StrictRing(0, World(1))


@pytest.mark.parametrize("dtype, layout, hkv, strided", [
    (np.float32, "striped", 1, False),      # multi-query: the step's head view of q is q itself
    (np.float16, "zigzag", 2, True),
    (np.float64, "contiguous", 2, True),
])
def test_entry_points_never_modify_their_inputs(dtype, layout, hkv, strided):
    """Read-only inputs (a write raises), compared with copies afterwards;
    strided: q, k, v are non-contiguous views, as a caller slicing heads makes."""
    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal(s).astype(dtype)
                     for s in ((B, 12, Hq, D), (B, 12, hkv, D), (B, 12, hkv, D), (B, 12, Hq, D)))
    q[0, 3, 1, 2] = np.nan                                          # NaN reaches rows, never the input
    if strided:
        q, k, v = (np.concatenate([x, x], axis=3) for x in (q, k, v))
    inputs = frozen(q, k, v, dout)
    if strided:             # read-only views of every other column
        inputs[:3] = [x[..., ::2] for x in inputs[:3]]
        assert not any(x.flags.c_contiguous or x.flags.writeable for x in inputs[:3])
    before = [x.copy() for x in inputs]
    q, k, v, dout = inputs
    out, lse = frozen(*attention(q, k, v))
    attention_backward(q, k, v, out, lse, dout)
    ring_attention(q, k, v, n_devices=2, layout=layout, tile_size=3, trace=True)
    ring_attention_backward(q, k, v, out, lse, dout, n_devices=2, layout=layout, tile_size=3)
    unshard(shard(q, 2, layout), layout)
    mpi_impl.ring_attention(q, k, v, comm=OneRank(), layout=layout, make_ring=one_rank_ring)
    mpi_impl.ring_attention_backward(q, k, v, out, lse, dout, comm=OneRank(), layout=layout,
                                     make_ring=one_rank_ring)
    for name, x, y in zip(("q", "k", "v", "dout"), inputs, before):
        np.testing.assert_array_equal(x, y, err_msg=f"{name} was modified")


# -- every mask option on every entry point ------------------------------------------

# (id, options, exception type, argument named, more text); S = 8 tokens
BAD_MASK_OPTIONS = [
    ("window 0", dict(window=0), ValueError, "window", "positive int"),
    ("window -2", dict(window=-2), ValueError, "window", "positive int"),
    ("window 2.5", dict(window=2.5), ValueError, "window", "got 2.5"),
    ("window str", dict(window="3"), ValueError, "window", "got '3'"),
    ("window bool", dict(window=True), ValueError, "window", "got True"),
    ("cu_seqlens falls", dict(cu_seqlens=[0, 5, 4, 8]), ValueError, "cu_seqlens", "rise strictly from 0"),
    ("cu_seqlens short", dict(cu_seqlens=[0, 7]), ValueError, "cu_seqlens", "7"),   # dense: positions 0..7
    ("cu_seqlens from 1", dict(cu_seqlens=[1, 8]), ValueError, "cu_seqlens", "rise strictly from 0"),
    ("cu_seqlens 2-d", dict(cu_seqlens=[[0, 8]]), ValueError, "cu_seqlens", "1-D array of ints"),
    ("cu_seqlens floats", dict(cu_seqlens=[0.0, 8.0]), ValueError, "cu_seqlens", "1-D array of ints"),
    ("segment_ids short", dict(segment_ids=[0, 1]), ValueError, "segment_ids", ""),
    ("segment_ids floats", dict(segment_ids=np.zeros(8)), ValueError, "segment_ids", "1-D array of ints"),
    ("both documents", dict(segment_ids=[0] * 8, cu_seqlens=[0, 8]), ValueError, "segment_ids", "not both"),
    ("dropout 1", dict(dropout=1.0), ValueError, "dropout", "[0, 1)"),
    ("dropout -0.1", dict(dropout=-0.1), ValueError, "dropout", "[0, 1)"),
    ("dropout str", dict(dropout="0.1"), ValueError, "dropout", "got '0.1'"),
    ("dropout bool", dict(dropout=True), ValueError, "dropout", "got True"),
    ("dropout nan", dict(dropout=float("nan")), ValueError, "dropout", "got nan"),
    ("seed -1", dict(dropout=0.1, seed=-1), ValueError, "seed", "[0, 2**63)"),
    ("seed 2**63", dict(dropout=0.1, seed=2 ** 63), ValueError, "seed", "[0, 2**63)"),
    ("seed 1.5", dict(dropout=0.1, seed=1.5), ValueError, "seed", "got 1.5"),
    ("seed str", dict(seed="1"), ValueError, "seed", "got '1'"),
]
# seq_len: the shards' entry points only (mpi_impl, gpu_impl), one rank of 8 tokens
BAD_SEQ_LEN = [
    ("seq_len 0", dict(seq_len=0), ValueError, "seq_len", "got 0"),
    ("seq_len 7.0", dict(seq_len=7.0), ValueError, "seq_len", "got 7.0"),
    ("seq_len bool", dict(seq_len=True), ValueError, "seq_len", "got True"),
    ("seq_len long", dict(seq_len=9), ValueError, "seq_len", "1 x 8 tokens of the shards"),
    ("seq_len short", dict(seq_len=6), ValueError, "seq_len", "1 x 8 tokens of the shards"),
]


def _no_work(*args, **kwargs):
    raise AssertionError("work started before the options were checked")


@pytest.fixture
def no_work(monkeypatch):
    """Any ring work fails the test: the virtual ring's devices and shards, and
    the communication objects mpi_impl and gpu_impl would build."""
    import reference.virtual
    from gpu_impl import api
    monkeypatch.setattr(reference.virtual, "run_devices", _no_work)
    monkeypatch.setattr(reference.virtual, "shard_at", _no_work)
    monkeypatch.setattr(api, "RingComm", type("NoRing", (), dict(on=staticmethod(_no_work))))


def mask_entry_points(options):
    """(name, call) of every public entry point with the mask `options` (S = 8)."""
    q, k, v, out, lse, dout = grads_inputs()
    return [
        ("reference.attention", lambda: attention(q, k, v, **options)),
        ("reference.attention_backward", lambda: attention_backward(q, k, v, out, lse, dout, **options)),
        ("reference.ring_attention", lambda: ring_attention(q, k, v, n_devices=2, **options)),
        ("reference.ring_attention_backward",
         lambda: ring_attention_backward(q, k, v, out, lse, dout, n_devices=2, **options)),
    ] + shard_entry_points(options)


def shard_entry_points(options):
    q, k, v, out, lse, dout = grads_inputs()
    return [
        ("mpi_impl.ring_attention", lambda: mpi_impl.ring_attention(q, k, v, comm=OneRank(), make_ring=_no_work,
                                                                    **options)),
        ("mpi_impl.ring_attention_backward",
         lambda: mpi_impl.ring_attention_backward(q, k, v, out, lse, dout, comm=OneRank(), make_ring=_no_work,
                                                  **options)),
        ("gpu_impl.ring_attention", gpu_forward(**options)),
        ("gpu_impl.ring_attention_backward", lambda: _gpu_backward_with(options)),
    ]


def _gpu_backward_with(options):
    cupy = sys.modules["cupy"]
    args = [cupy.asarray(x) for x in grads_inputs()]
    return gpu_impl.ring_attention_backward(*args, comm=OneRank(), **options)


@pytest.mark.parametrize("case", BAD_MASK_OPTIONS, ids=[c[0] for c in BAD_MASK_OPTIONS])
def test_every_entry_point_refuses_a_bad_mask_option_before_any_work(case, no_work, fake_cupy):
    refused_everywhere(mask_entry_points, *case[1:])


@pytest.mark.parametrize("case", BAD_SEQ_LEN, ids=[c[0] for c in BAD_SEQ_LEN])
def test_shard_entry_points_refuse_a_seq_len_that_does_not_fit(case, no_work, fake_cupy):
    refused_everywhere(shard_entry_points, *case[1:])


def refused_everywhere(entry_points, options, error, argument, text):
    for name, call in entry_points(options):
        try:
            assert_refused(call, error, argument, text)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def test_an_unknown_mask_option_is_named_on_every_entry_point(no_work, fake_cupy):
    # reference's functions name their keywords (Python's own message); the
    # shards' entry points take **mask_options and list the ones there are
    for name, call in mask_entry_points(dict(windw=3)):
        with pytest.raises(TypeError, match="windw") as caught:
            call()
        words = "the options are ['window'," if name.startswith(("mpi_impl", "gpu_impl")) else "unexpected keyword"
        assert words in str(caught.value), (name, str(caught.value))


def test_bfloat16_where_a_backend_has_none_is_refused_before_any_work(no_work, fake_cupy):
    """CuPy has no bfloat16: gpu_impl takes CuPy arrays only, and the CUDA
    steps refuse NumPy arrays; a NumPy step takes bfloat16 (tests/oracle/test_masks.py)."""
    import ml_dtypes
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in arrays())
    assert_refused(gpu_forward(q=q, k=k, v=v), TypeError, "q", "must be a CuPy array")
    for step in ("fused", "fused_v2"):
        assert_refused(lambda: mpi_impl.ring_attention(q, k, v, comm=OneRank(), step=step, make_ring=_no_work),
                       ValueError, "step", "computes with cupy arrays")
        assert_refused(lambda: ring_attention(q, k, v, n_devices=2, step=step), ValueError, "step",
                       "computes with cupy arrays")


@pytest.mark.parametrize("options", [
    dict(window=3, cu_seqlens=[0, 5, 12]),
    dict(causal=False, segment_ids=[0, 1, 2] * 4, dropout=0.3, seed=2 ** 63 - 1),
    dict(window=1, dropout=0.5, seed=4),
], ids=["window, documents", "segments, dropout", "window 1, dropout"])
def test_entry_points_with_mask_options_never_modify_their_inputs(options):
    rng = np.random.default_rng(2)
    inputs = frozen(*(rng.standard_normal(s) for s in ((B, 12, Hq, D), (B, 12, Hkv, D), (B, 12, Hkv, D),
                                                        (B, 12, Hq, D))))
    before = [x.copy() for x in inputs]
    q, k, v, dout = inputs
    out, lse = frozen(*attention(q, k, v, **options))
    attention_backward(q, k, v, out, lse, dout, **options)
    ring_attention(q, k, v, n_devices=3, layout="zigzag", tile_size=3, **options)
    ring_attention_backward(q, k, v, out, lse, dout, n_devices=3, layout="zigzag", tile_size=3, **options)
    mpi_impl.ring_attention(q, k, v, comm=OneRank(), make_ring=one_rank_ring, **options)
    mpi_impl.ring_attention_backward(q, k, v, out, lse, dout, comm=OneRank(), make_ring=one_rank_ring, **options)
    for name, x, y in zip(("q", "k", "v", "dout"), inputs, before):
        np.testing.assert_array_equal(x, y, err_msg=f"{name} was modified")


# -- options at their edges: a correct result, not an error ----------------------------

OWN_TOKEN = "each query sees itself alone"
# options at an edge -> the plainer call they equal (or OWN_TOKEN: out is the query's own v)
EDGE_OPTIONS = [
    (dict(window=1), OWN_TOKEN),
    (dict(window=1, causal=False), OWN_TOKEN),
    (dict(segment_ids=list(range(12))), OWN_TOKEN),
    (dict(cu_seqlens=list(range(13)), causal=False), OWN_TOKEN),
    (dict(window=50), dict()),
    (dict(window=12, causal=False), dict(causal=False)),
    (dict(cu_seqlens=[0, 12]), dict()),
    (dict(segment_ids=[7] * 12, causal=False), dict(causal=False)),
    (dict(dropout=0.0, seed=5), dict()),
    (dict(dropout=0.5, seed=2 ** 63 - 1), dict(dropout=0.5, seed=2 ** 63 - 1)),
]


@pytest.mark.parametrize("options, plainer", EDGE_OPTIONS,
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items())[:30] if isinstance(o, dict) else "")
def test_options_at_their_edges_give_the_plainer_answer_on_every_entry_point(options, plainer):
    """A window of one key or wider than the sequence, one document or one a
    token, dropout 0 or the largest seed: valid, and every entry point gives
    what the plainer call gives (a query alone in its window or document:
    its own value, computed here without any mask code)."""
    from conftest import assert_close
    rng = np.random.default_rng(5)
    q, k, v, dout = (rng.standard_normal(s) for s in ((B, 12, Hq, D), (B, 12, Hkv, D), (B, 12, Hkv, D),
                                                      (B, 12, Hq, D)))
    if plainer is OWN_TOKEN:
        want = np.repeat(v, Hq // Hkv, axis=2)                      # query head h reads kv head h // G
    else:
        want = attention(q, k, v, **plainer)[0]
    out, lse = attention(q, k, v, **options)
    grads = attention_backward(q, k, v, out, lse, dout, **options)
    got = {"dense": out, "virtual ring": ring_attention(q, k, v, n_devices=3, tile_size=2, **options)[0],
           "mpi_impl": mpi_impl.ring_attention(q, k, v, comm=OneRank(), make_ring=one_rank_ring, tile_size=5,
                                               **options)[0]}
    for where, x in got.items():
        assert_close(x, want, np.float64, f"{where} out")
    o, l = ring_attention(q, k, v, n_devices=3, tile_size=2, **options)
    for name, x, w in zip(("dq", "dk", "dv"), ring_attention_backward(q, k, v, o, l, dout, n_devices=3, tile_size=2,
                                                                      **options), grads):
        assert_close(x, w, np.float64, f"virtual ring {name}")
