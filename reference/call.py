"""One ring call, checked once at the door: what the ring needs, or a clear error before any work.

Every entry point of the ring (`reference.virtual`, `reference.lockstep`,
`mpi_impl`, `gpu_impl`) hands its arguments to `check_call` before any work or
communication (docs/design.md, bad input), and hands the loops of `reference.ring`
what it returns, resolved: the scale, the `Step` and its tile, the `Mask` and
every device's positions. Nothing inside the ring checks or resolves them again
(docs/style.md, rule 18). A caller that runs one call many times (the command
line) resolves it once from the arrays' shapes (`resolve_call`) and hands it on.

    call = check_call(q, k, v, n_devices=4, layout="striped", step="auto")      # whole sequences
    call = check_call(q_j, k_j, v_j, n_devices=comm.size, layout="zigzag",      # one rank's shard
                      per_device=True, seq_len=S)
    ring.ring_forward(q_j, k_j, v_j, call.positions[j], call.positions[j], comm,
                      scale=call.scale, tile_size=call.tile, step=call.step, mask=call.mask)

Under MPI every rank checks its own call and the ranks agree on `describe()`
(`mpi_impl.agree`), so every rank raises the same error, never a hang.

Shapes: q (B, S, Hq, D), k, v (B, S, Hkv, D) (S: c, this device's tokens, with
``per_device``); out, dout like q, lse (B, Hq, S); positions (N, c).
"""

from dataclasses import dataclass

import numpy as np

from . import checks, steps
from .layouts import array_module, check_layout, padded_length
from .masks import layout_mask
from .schemes import Scheme
from .step import Step

NAMES = ("q", "k", "v", "out", "lse", "dout")


@dataclass(frozen=True, eq=False)
class RingCall:
    """A checked call: what the ring loops take, and what every rank must agree on."""
    scale: float
    step: Step
    mask: object             # reference.masks.Mask
    positions: np.ndarray    # (N, c) int64: every device's global positions, padding included
    tile: object             # the step's (tq, tk), resolved (`reference.tiles.Tile`; None: the step's per call)
    layout: str
    arrays: dict             # name -> (shape, dtype name) of the arrays passed
    scheme: Scheme = None    # how the devices share the work (`reference.schemes`): the ring by default

    @property
    def backward(self):
        return "dout" in self.arrays

    def describe(self):
        """What every rank of one call must agree on, as plain values (`mpi_impl.agree`)."""
        shapes = {name: shape for name, (shape, _) in self.arrays.items() if name in ("q", "k", "v")}
        grads = {name: spec for name, spec in self.arrays.items() if name in ("out", "lse", "dout")}
        return dict(kind="backward" if self.backward else "forward", **shapes, dtype=self.arrays["q"][1],
                    layout=self.layout, causal=bool(self.mask.causal), scale=self.scale,
                    tile_size=self.tile, step=self.step.name, mask=self.mask.describe(),
                    **self.scheme.describe(), **grads)

    def fits(self, q, k, v, grads=None):
        """This call, for arrays of the shapes and dtypes it was resolved for
        (`resolve_call`), in an array module its step computes with; else the
        ValueError that names the first array that differs."""
        named = dict(zip(NAMES, (q, k, v) + tuple(grads or ())))
        for name, x in named.items():
            checks.check_array(name, x)
        got = specs(named)
        if got != self.arrays:
            name = next(name for name in NAMES if got.get(name) != self.arrays.get(name))
            raise ValueError(f"{name} does not fit the call: it was resolved for (shape, dtype) "
                             f"{self.arrays.get(name)}, got {got.get(name)}")
        if steps.module_name(array_module(q)) not in self.step.array_modules:
            raise ValueError(f"the call's step {self.step.name!r} computes with "
                             f"{', '.join(self.step.array_modules)} arrays, got {steps.module_name(array_module(q))}")
        return self


def specs(named):
    """name -> (shape, dtype name) of arrays: what `RingCall.arrays` holds."""
    return {name: (tuple(x.shape), str(x.dtype)) for name, x in named.items()}


def check_call(q, k, v, *, grads=None, per_device=False, **options):
    """Check a ring call's arrays (`reference.checks`) and resolve the rest
    (`resolve_call`): its RingCall, or the clear error. `grads`: (out, lse,
    dout) for a backward. `per_device`: q, k, v are one device's shard of c
    tokens; else they are whole sequences of any length (padded inside,
    `reference.layouts.padded_length`). The options: `resolve_call`'s."""
    checks.check_qkv(q, k, v, seq_axis_name="c" if per_device else "S")
    if grads is not None:
        checks.check_grads_inputs(q, *grads)
    named = dict(zip(NAMES, (q, k, v) + tuple(grads or ())))
    return resolve_call(specs(named), array_module(q), per_device=per_device, **options)


def resolve_call(arrays, xp, *, n_devices, layout="striped", causal=True, scale=None, tile_size=None, step="auto",
                 per_device=False, seq_len=None, scheme="ring", ulysses_degree=None, ring_inner=None, mask=None,
                 **mask_options):
    """The RingCall of arrays with these shapes and dtypes (`arrays`, as
    `specs` gives them: q, k, v, and out, lse, dout for a backward) in array
    module `xp`, or the clear error: the layout (`reference.layouts`), the
    scheme (`reference.schemes`), the scale, the real `seq_len` (with
    `per_device`: the length the layout padded to N c; None: N c), the mask
    (`mask`, built already by `reference.masks.layout_mask`, or built here from
    `causal` and the mask options), the step (`reference.steps.check_step`),
    its tile, every device's positions. Each is resolved here once."""
    (_, S, Hq, D), Hkv = arrays["q"][0], arrays["k"][0][2]
    check_layout(layout, S, n_devices)
    plan = Scheme.checked(scheme, ulysses_degree, n_devices=n_devices, Hq=Hq, Hkv=Hkv, ring_inner=ring_inner)
    scale = checks.check_options(causal=causal, scale=scale, head_dim=D)
    if per_device:
        seq_len = _real_length(S, n_devices, layout, seq_len)
    elif seq_len is not None:
        raise TypeError("seq_len is for one device's shard (per_device=True); whole sequences give S themselves")
    else:
        seq_len = S
    if mask is not None and mask_options:
        raise TypeError(f"give the mask or the mask options, not both: got mask and {sorted(mask_options)}")
    if mask is None:
        mask = layout_mask(seq_len, n_devices, layout, causal=causal, **mask_options)
    step = steps.check_step(step, xp, backward="dout" in arrays, dropout=mask.dropout, plain_mask=mask.causal_only,
                            call=steps.Call(arrays["q"][1], D, Hq // (Hkv * plan.kv_copies(Hkv)), tile_size))
    return RingCall(scale=scale, step=step, mask=mask, positions=plan.positions(seq_len, layout),
                    tile=step.tile(tile_size, D), layout=layout, arrays=arrays, scheme=plan)


def _real_length(c, n, layout, seq_len):
    """The real sequence length of shards of c tokens on n devices: `seq_len`,
    checked to pad to exactly N c (None: N c, no padding)."""
    if layout == "zigzag" and c % 2:
        raise ValueError(f"layout 'zigzag' needs an even number of tokens per rank (each holds two chunks of "
                         f"S // 2N), got {c} tokens per rank on {n} rank{'s' if n != 1 else ''}; pad the sequence to a multiple of "
                         f"2N = {2 * n} (reference.shard pads it)")
    if seq_len is None:
        return c * n
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1 \
            or padded_length(seq_len, n, layout) != c * n:
        raise ValueError(f"seq_len must be the real sequence length, which layout {layout!r} pads to the "
                         f"{n} x {c} tokens of the shards, got {seq_len!r}")
    return int(seq_len)
