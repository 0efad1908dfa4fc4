"""Bad input gets a clear ValueError or TypeError naming the argument, raised
before any work (docs/design.md, "How it behaves with bad input"); and the command
line answers --help.

"Before any work" is checked by replacing the functions that start work
(sharding, the virtual devices, the dense scores) with ones that fail the test.

    .venv/bin/python -m pytest tests/oracle/test_errors.py -q
"""

import subprocess
import sys

import numpy as np
import pytest

import reference.dense
import reference.virtual
from reference import (attention, attention_backward, positions, ring_attention,
                       ring_attention_backward, shard, unshard)

B, S, Hq, Hkv, D = 1, 8, 4, 2, 4


def arrays(shape_q=(B, S, Hq, D), shape_kv=(B, S, Hkv, D), dtype=np.float32):
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal(s).astype(dtype) for s in (shape_q, shape_kv, shape_kv))


@pytest.fixture(autouse=True)
def no_work(monkeypatch):
    """Any work started before the check raises fails the test."""
    def started(*args, **kwargs):
        raise AssertionError("work started before the input was checked")
    monkeypatch.setattr(reference.virtual, "run_devices", started)
    monkeypatch.setattr(reference.virtual, "shard_at", started)
    monkeypatch.setattr(reference.dense, "_scores", started)


def forward_calls(q, k, v, **options):
    """Each public forward entry point on the same input."""
    n = options.pop("n_devices", 4)
    layout = options.pop("layout", "striped")
    yield lambda: ring_attention(q, k, v, n_devices=n, layout=layout, **options)
    if "tile_size" not in options:
        yield lambda: attention(q, k, v, **options)


def backward_calls(q, k, v, out, lse, dout, **options):
    yield lambda: ring_attention_backward(q, k, v, out, lse, dout, n_devices=4, **options)
    yield lambda: attention_backward(q, k, v, out, lse, dout, **options)


def raises_everywhere(calls, error, match):
    for call in calls:
        with pytest.raises(error, match=match):
            call()


# -- the sequence and the devices ----------------------------------------------

@pytest.mark.parametrize("seq_len, error, match", [(0, ValueError, "sequence length must be a positive int"),
                                                   (-3, ValueError, "sequence length must be a positive int"),
                                                   (2.5, TypeError, "seq_len must be an int"),
                                                   (True, TypeError, "seq_len must be an int")])
def test_bad_sequence_length(seq_len, error, match):
    # any positive S is dealt (padded to the layout's multiple); nothing else
    with pytest.raises(error, match=match):
        positions(seq_len, 4, "striped")


@pytest.mark.parametrize("n_devices", [0, -2, 2.0, True, "4"])
def test_bad_n_devices(n_devices):
    q, k, v = arrays()
    with pytest.raises(ValueError, match="n_devices must be a positive int"):
        ring_attention(q, k, v, n_devices=n_devices)


@pytest.mark.parametrize("layout", ["Striped", "ring", "", None])
def test_unknown_layout(layout):
    q, k, v = arrays()
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_attention(q, k, v, n_devices=2, layout=layout)
    with pytest.raises(ValueError, match="layout must be one of"):
        positions(8, 2, layout)
    with pytest.raises(ValueError, match="layout must be one of"):
        unshard([q, q], layout)


# -- shapes -----------------------------------------------------------------

@pytest.mark.parametrize("shape_q, shape_kv, match", [
    ((B, S, 3, D), (B, S, 2, D), r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
    ((B, S, 2, D), (B, S, 4, D), r"query heads \(2\) must be a multiple of key/value heads \(4\)"),
])
def test_heads_not_grouped(shape_q, shape_kv, match):
    raises_everywhere(forward_calls(*arrays(shape_q, shape_kv)), ValueError, match)


def test_keys_of_another_length_are_an_error_for_the_ring_only():
    # the dense oracle attends any queries to any keys (tests/oracle/test_dense.py); the ring needs S of each
    q, k, v = arrays((B, S, 2, D), (B, S, 2, D))
    with pytest.raises(ValueError, match=r"k and v must be \(B, S, Hkv, D\) = \(1, 8, Hkv, 4\) to match q"):
        ring_attention(q, k[:, :4], v[:, :4], n_devices=2)
    with pytest.raises(ValueError, match=r"k_pos must be 4 integer positions"):
        attention(q, k[:, :4], v[:, :4], k_pos=np.arange(8))


@pytest.mark.parametrize("change, match", [
    (lambda q, k, v: (q, k[..., :3], v[..., :3]), r"k and v must be .* to match q"),
    (lambda q, k, v: (q, np.concatenate([k, k]), np.concatenate([v, v])), r"k and v must be .* to match q"),
    (lambda q, k, v: (q, k, v[:, :4]), r"k and v must have the same shape"),
    (lambda q, k, v: (q, k, v[..., :2]), r"k and v must have the same shape"),
    (lambda q, k, v: (q[0], k, v), r"q must have 4 dimensions"),
    (lambda q, k, v: (q, k[None], v), r"k must have 4 dimensions"),
    (lambda q, k, v: (q[:, :, :, :0], k[..., :0], v[..., :0]), r"q must have no empty dimension"),
])
def test_shapes_disagree(change, match):
    raises_everywhere(forward_calls(*change(*arrays())), ValueError, match)


# -- dtypes -----------------------------------------------------------------

@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.bool_, np.complex128])
def test_non_float_dtype(which, dtype):
    xs = list(arrays())
    xs[which] = xs[which].astype(dtype)
    name = "qkv"[which]
    raises_everywhere(forward_calls(*xs), TypeError, rf"{name} must be float16, float32 or float64")


@pytest.mark.parametrize("dtypes", [(np.float32, np.float64, np.float32), (np.float16, np.float16, np.float32)])
def test_mixed_dtypes(dtypes):
    xs = [x.astype(t) for x, t in zip(arrays(), dtypes)]
    raises_everywhere(forward_calls(*xs), TypeError, r"q, k and v must share one dtype")


def test_not_an_array():
    _, k, v = arrays()
    raises_everywhere(forward_calls([[1.0]], k, v), TypeError, r"q must be a NumPy array, got list; convert it with np.asarray\(q")


# -- options ------------------------------------------------------------------

@pytest.mark.parametrize("tile_size", [0, -1, (0, 4), (4, 0), (4,), (1, 2, 3), 2.5, True, "4"])
def test_bad_tile_size(tile_size):
    q, k, v = arrays()
    raises_everywhere(forward_calls(q, k, v, tile_size=tile_size), ValueError,
                      r"tile_size must be a positive int or a \(tq, tk\) pair")


@pytest.mark.parametrize("scale", [0, 0.0, float("inf"), float("nan"), "1", True])
def test_bad_scale(scale):
    raises_everywhere(forward_calls(*arrays(), scale=scale), ValueError, r"scale must be a finite non-zero number")


@pytest.mark.parametrize("causal", [1, "yes", None])
def test_bad_causal(causal):
    raises_everywhere(forward_calls(*arrays(), causal=causal), TypeError, r"causal must be a bool")


# -- the backward's extra inputs ------------------------------------------------

def backward_inputs():
    q, k, v = arrays()
    return q, k, v, q.copy(), np.zeros((B, Hq, S), np.float32), q.copy()


@pytest.mark.parametrize("change, error, match", [
    (lambda o, l, d: (o, l[:, :, :4], d), ValueError, r"lse must be \(B, Hq, S\) = \(1, 4, 8\), got \(1, 4, 4\)"),
    (lambda o, l, d: (o, l.transpose(0, 2, 1), d), ValueError, r"lse must be \(B, Hq, S\)"),
    (lambda o, l, d: (o, l[..., None], d), ValueError, r"lse must be \(B, Hq, S\)"),
    (lambda o, l, d: (o, l.astype(np.int64), d), TypeError, r"lse must be a float array"),
    (lambda o, l, d: (o[:, :4], l, d), ValueError, r"out must have q's shape \(1, 8, 4, 4\), got \(1, 4, 4, 4\)"),
    (lambda o, l, d: (o, l, d[..., :2]), ValueError, r"dout must have q's shape"),
    (lambda o, l, d: (o, l, d.transpose(0, 2, 1, 3)), ValueError, r"dout must have q's shape"),
    (lambda o, l, d: (o.astype(np.float64), l, d), TypeError, r"out must have q's dtype float32"),
    (lambda o, l, d: (o, l, d.astype(np.float16)), TypeError, r"dout must have q's dtype float32"),
])
def test_bad_backward_inputs(change, error, match):
    q, k, v, out, lse, dout = backward_inputs()
    raises_everywhere(backward_calls(q, k, v, *change(out, lse, dout)), error, match)


def test_backward_checks_qkv_too():
    q, k, v, out, lse, dout = backward_inputs()
    raises_everywhere(backward_calls(q, k.astype(np.float64), v, out, lse, dout), TypeError,
                      r"q, k and v must share one dtype")
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_attention_backward(q, k, v, out, lse, dout, n_devices=4, layout="stripes")


# -- the command line -------------------------------------------------------------

@pytest.mark.parametrize("module", ["reference", "reference.cost"])
def test_help(module):
    run = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"usage: python -m {module}")
    assert "--seq-len" in run.stdout and "--n-devices" in run.stdout


def test_the_work_guard_works():
    # good input does reach the guarded work, so the checks above are meaningful
    with pytest.raises(AssertionError, match="work started"):
        ring_attention(*arrays(), n_devices=4)
    with pytest.raises(AssertionError, match="work started"):
        attention(*arrays())
