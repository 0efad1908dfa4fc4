"""The registered block steps, and how a caller chooses one.

Every version keeps the contract of `reference.step` and is checked against
version 1, the readable one, by one parametrised test body (tests/test_step.py).
Adding a version adds one line to `STEPS`.

    step = steps.get("v3", workers=2)      # a name, with the version's options
    steps.get("auto", xp=np)               # the fastest validated step for NumPy
    reference.ring_attention(q, k, v, n_devices=4, step="v2")

| name | file | what it changes from the one before |
| --- | --- | --- |
| ``v1`` | reference/step.py | the formulas, whole tiles, any array module (the default of `reference`) |
| ``v2`` | reference/step_v2.py | NumPy: base 2, folded columns, mask after exp2, one head at a time |
| ``v3`` | reference/step_v3.py | NumPy: lazy max, taller products, worker threads |
| ``v4`` | reference/step_v4.py | NumPy: masked tiles in sub-tiles (a diagonal tile costs a full one) |
| ``fused`` | gpu_impl/fused.py | CuPy: the forward as one CUDA kernel (forward only) |
| ``fused_v2`` | gpu_impl/fused_v2.py | CuPy: the forward on the tensor cores, float16 (forward only) |
"""

import importlib

from .step import ReadableStep, Step

# name -> "module:class"; imported when first asked for (the fused kernel needs CuPy)
STEPS = {
    "v1": "reference.step:ReadableStep",
    "v2": "reference.step_v2:ExactBase2Step",
    "v3": "reference.step_v3:LazyThreadedStep",
    "v4": "reference.step_v4:SubTiledStep",
    "fused": "gpu_impl.fused:FusedStep",
    "fused_v2": "gpu_impl.fused_v2:TensorCoreStep",
}
ALIASES = {"readable": "v1"}
AUTO = {"numpy": "v3", "cupy": "v1"}     # the fastest validated step per array module
NAMES = tuple(STEPS) + tuple(ALIASES) + ("auto",)
DEFAULT = "v1"


def get(step=DEFAULT, *, xp=None, workers=None):
    """A Step from a name (or a Step, returned as it is). ``"auto"`` needs the
    array module `xp`; `workers` goes to versions that take it (v3)."""
    if isinstance(step, Step):
        return step
    if not isinstance(step, str) or step not in NAMES:
        raise ValueError(f"step must be one of {NAMES} or a reference.step.Step, got {step!r}")
    if step == "auto":
        step = AUTO.get(module_name(xp), DEFAULT)
    module, cls = STEPS[ALIASES.get(step, step)].split(":")
    cls = getattr(importlib.import_module(module), cls)
    if workers is None or workers == 1:
        return cls()
    if not cls.takes_workers:
        raise ValueError(f"step {cls.name!r} runs on the calling thread; workers={workers!r} applies to "
                         f"{[n for n in STEPS if 'cupy' not in get(n).array_modules and get(n).takes_workers]}")
    return cls(workers=workers)


def module_name(xp):
    """'numpy', 'cupy' (or another top-level name) for an array module."""
    return getattr(xp, "__name__", "numpy").split(".")[0]


def check_step(step, xp, *, backward=False, dropout=False, plain_mask=True):
    """A Step usable with arrays of `xp` (and with a backward, dropout, or a
    mask beyond causal=True/False if asked), or a clear ValueError. With
    dropout, "auto" is the readable step."""
    step = get(DEFAULT if dropout and step == "auto" else step, xp=xp)
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
    return step


__all__ = ["STEPS", "NAMES", "DEFAULT", "get", "check_step", "ReadableStep", "Step"]
