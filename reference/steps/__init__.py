"""The registered block steps, and how a caller chooses one.

Every version keeps the contract of `reference.step` and is checked against
version 1, the readable one, by one parametrised test body (tests/steps/test_step.py).
What each adds and its measured share of the matmul rate: README.md, "Step versions".

    step = steps.get("v3", workers=2)      # a name, with the version's options
    steps.get("auto", xp=np)               # the fastest validated step for NumPy
    steps.check_step("auto", cupy, call=steps.call_of(q, k, None))   # float16 on CuPy: fused_v2
    reference.ring_attention(q, k, v, n_devices=4, step="v2")

Writing one (the contract in full: docs/steps.md): subclass
`reference.step.Step`, implement ``forward_tiles`` (and ``backward_tiles``)
from the modules of functions below, and add one line to `STEPS`. A backend
adds its own versions with `register` when it is imported (the GPU package
its CUDA kernels), and "auto" takes them first for its arrays.

Modules, in reading order:

    parts         the pieces the tuned NumPy steps are built from
    units         a step's work cut into units, run on worker threads
    tile_masks    a block's mask made once for all heads, on its masked rows only
    v2            version 1's arithmetic arranged for a CPU: base 2, folded columns
    v3            v2 with a lazy max, taller products and worker threads
    v4            v3 with masked tiles computed in sub-tiles
    v5            v3 with all heads of a key tile in one batched product
"""

from typing import NamedTuple

import numpy as np

from ..step import ReadableStep, Step
from .v2 import ExactBase2Step
from .v3 import LazyThreadedStep
from .v4 import SubTiledStep
from .v5 import HeadBatchedStep

# name -> Step class; `register` adds a backend's
STEPS = {"v1": ReadableStep, "v2": ExactBase2Step, "v3": LazyThreadedStep, "v4": SubTiledStep,
         "v5": HeadBatchedStep}
ALIASES = {"readable": "v1"}
# per array module, the fastest validated steps first: "auto" takes the first
# that takes the call (`check_step`), else the readable one
AUTO = {"numpy": ["v5"]}
DEFAULT = "v1"


def register(cls, *, auto_for=None):
    """Add a Step class under its `name`; with `auto_for` (an array module's
    name, "cupy"), "auto" tries it first for those arrays. Registering a name
    again replaces it (a module imported twice)."""
    if not (isinstance(cls, type) and issubclass(cls, Step)):
        raise TypeError(f"register takes a subclass of reference.step.Step, got {cls!r}")
    STEPS[cls.name] = cls
    if auto_for is not None:
        order = AUTO.setdefault(auto_for, [])
        if cls.name in order:
            order.remove(cls.name)
        order.insert(0, cls.name)
    return cls


def names():
    """Every name `get` takes: the registered versions, their aliases and "auto"."""
    return tuple(STEPS) + tuple(ALIASES) + ("auto",)


def get(step=DEFAULT, *, xp=None, workers=None):
    """A Step from a name (or a Step, returned as it is). ``"auto"`` needs the
    array module `xp`; `workers` goes to versions that take it (v3)."""
    if isinstance(step, Step):
        return step
    if not isinstance(step, str) or step not in names():
        raise ValueError(f"step must be one of {names()} or a reference.step.Step, got {step!r}")
    if step == "auto":
        step = check_step("auto", xp).name
    cls = STEPS[ALIASES.get(step, step)]
    if workers is None or workers == 1:
        return cls()
    if not cls.takes_workers:
        raise ValueError(f"step {cls.name!r} runs on the calling thread; workers={workers!r} applies to "
                         f"{[n for n, c in STEPS.items() if c.takes_workers]}")
    return cls(workers=workers)


def module_name(xp):
    """'numpy', 'cupy' (or another top-level name) for an array module."""
    return getattr(xp, "__name__", "numpy").split(".")[0]


class Call(NamedTuple):
    """What is known of a call when its step is chosen (None: not known)."""
    dtype: object = None        # the inputs' dtype name: "float16", ...
    head_dim: object = None
    group: object = None        # query heads per key/value head
    tile_size: object = None


def call_of(q, k, tile_size):
    """The Call of q (B, S, Hq, D) and k (B, S, Hkv, D), any array module."""
    return Call(np.dtype(q.dtype).name, q.shape[-1], q.shape[-2] // max(1, k.shape[-2]), tile_size)


def check_step(step, xp, *, backward=False, dropout=False, plain_mask=True, call=None):
    """A Step usable with arrays of `xp` (and with a backward, dropout, or a
    mask beyond causal=True/False if asked, and the `call`, a Call), or a
    clear ValueError. "auto" is the first step of AUTO for `xp` that passes
    these checks (one with `dtypes` only for a dtype it lists), else the
    readable step: with dropout, a backward, float32 on CuPy, the readable step."""
    if step == "auto":
        for name in tuple(AUTO.get(module_name(xp), ())):
            candidate = get(name)
            if candidate.dtypes and (call is None or call.dtype not in candidate.dtypes):
                continue
            try:
                return check_step(candidate, xp, backward=backward, dropout=dropout, plain_mask=plain_mask,
                                  call=call)
            except ValueError:
                continue
        step = DEFAULT
    step = get(step, xp=xp)
    if module_name(xp) not in step.array_modules:
        raise ValueError(f"step {step.name!r} computes with {', '.join(step.array_modules)} arrays, "
                         f"got {module_name(xp)} arrays")
    if backward and not step.has_backward:
        raise ValueError(f"step {step.name!r} has no backward; use step='v1' or 'auto' for gradients")
    if dropout and not step.has_dropout:
        raise ValueError(f"step {step.name!r} has no dropout; use step='v1' or 'auto' with dropout")
    if not plain_mask and not step.takes_masks:
        raise ValueError(f"step {step.name!r} knows only causal=True/False; use step='v1' or 'auto' "
                         "with windows, documents or padding")
    reason = step.refuses(call) if call is not None else None
    if reason:
        raise ValueError(reason)
    return step


__all__ = ["STEPS", "DEFAULT", "register", "names", "Call", "call_of", "get", "check_step", "ReadableStep", "Step"]
