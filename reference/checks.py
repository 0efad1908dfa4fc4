"""Input checks shared by every entry point: bad input gets a clear error that
names the argument, before any work or communication (docs/design.md)."""

import math

import numpy as np

FLOAT_DTYPES = (np.float16, np.float32, np.float64)


def _library(x):
    """The top-level package of x's type: 'numpy', 'cupy', 'torch', 'builtins', ..."""
    return type(x).__module__.split(".")[0]


def _conversion(name, x):
    """How to turn `x` into a NumPy array, for an error message."""
    library = _library(x)
    if library == "torch":
        return f"{name}.detach().cpu().numpy()"
    if library in ("jax", "jaxlib", "tensorflow"):
        return f"np.asarray({name})"
    return f"np.asarray({name}, dtype=np.float32)"


def check_array(name, x):
    """A NumPy array, or a CuPy array (the GPU backend runs the same code on
    them); anything else, a torch tensor or a list, gets a TypeError naming
    the argument and the conversion to make."""
    if isinstance(x, np.ndarray) or _library(x) == "cupy" and hasattr(x, "shape") and hasattr(x, "dtype"):
        return
    what = f"{type(x).__module__}.{type(x).__name__}" if _library(x) != "builtins" else type(x).__name__
    raise TypeError(f"{name} must be a NumPy array, got {what}; convert it with {_conversion(name, x)}")


def check_qkv(q, k, v, *, seq_axis_name="S", same_length=True):
    """Check shapes and dtypes of q (B, S, Hq, D), k and v (B, S, Hkv, D)
    (k and v of any length when not `same_length`). Returns (B, S, Hq, Hkv, D)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(name, x)
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions (B, {seq_axis_name}, H, D), got shape {tuple(x.shape)}")
        if np.dtype(x.dtype) not in [np.dtype(t) for t in FLOAT_DTYPES]:
            raise TypeError(f"{name} must be float16, float32 or float64, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    B, S, Hq, D = q.shape
    if (k.shape[0], k.shape[1] if same_length else S, k.shape[3]) != (B, S, D):
        raise ValueError(f"k and v must be (B, {seq_axis_name}, Hkv, D) = ({B}, {S if same_length else 'Sk'}, Hkv, {D}) to match q, "
                         f"got {tuple(k.shape)}")
    Hkv = k.shape[2]
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if min(B, S, Hq, D, k.shape[1]) < 1:
        raise ValueError(f"q must have no empty dimension, got shape {tuple(q.shape)}")
    return B, S, Hq, Hkv, D


def check_grads_inputs(q, out, lse, dout):
    """out and dout like q; lse (B, Hq, S) in float."""
    B, S, Hq, D = q.shape
    for name, x in (("out", out), ("lse", lse), ("dout", dout)):
        check_array(name, x)
    for name, x in (("out", out), ("dout", dout)):
        if tuple(x.shape) != tuple(q.shape):
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(x.shape)}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    if tuple(lse.shape) != (B, Hq, S):
        raise ValueError(f"lse must be (B, Hq, S) = {(B, Hq, S)}, got {tuple(lse.shape)}")
    if np.dtype(lse.dtype).kind != "f":
        raise TypeError(f"lse must be a float array, got {lse.dtype}")


def check_partial(name, out, lse, like=None):
    """A partial result (out (B, S, Hq, D), lse (B, Hq, S)) for `merge`, shaped like `like`'s."""
    for what, x, ndim in (("out", out, 4), ("lse", lse, 3)):
        if not isinstance(x, np.ndarray) or x.dtype.kind != "f" or x.ndim != ndim:
            raise TypeError(f"{what}_{name} must be a {ndim}-dimensional float NumPy array, "
                            f"got {getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}")
    B, S, Hq, D = out.shape
    if lse.shape != (B, Hq, S):
        raise ValueError(f"lse_{name} must be (B, Hq, S) = {(B, Hq, S)} to match out_{name}, got {lse.shape}")
    if like is not None and (out.shape, out.dtype) != (like[0].shape, like[0].dtype):
        raise ValueError(f"out_{name} must match out_a's shape and dtype {like[0].shape} {like[0].dtype}, "
                         f"got {out.shape} {out.dtype}")


def check_options(*, causal, scale, head_dim):
    """Check `causal` and `scale`; returns the scale to use (default D ** -0.5).
    The layout's rule is `reference.layouts.check_layout`'s, the tile's the
    step's (`reference.step.Step.tile`)."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) \
            or not math.isfinite(scale) or scale == 0:
        raise ValueError(f"scale must be a finite non-zero number, got {scale!r}")
    return float(scale)


# -- bfloat16 ------------------------------------------------------------
#
# bfloat16 is NumPy's through `ml_dtypes` (the type JAX uses): stored and sent
# as it is, accumulated in float32 like float16. Without ml_dtypes installed
# there is no bfloat16 array to pass.
try:
    import ml_dtypes as _ml_dtypes
    BFLOAT16 = np.dtype(_ml_dtypes.bfloat16)
    FLOAT_DTYPES = FLOAT_DTYPES + (_ml_dtypes.bfloat16,)
except ImportError:         # pragma: no cover - ml_dtypes is a dependency
    BFLOAT16 = None

