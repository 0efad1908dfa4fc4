"""One ring call, checked once at the door: what the ring needs, or a clear error before any work.

Every entry point of the ring (`reference.virtual`, `reference.lockstep`,
`mpi_impl`, `gpu_impl`) hands its arguments to `check_call` before any work or
communication (docs/design.md, bad input), and hands the loops of `reference.ring`
what it returns, resolved: the scale, the `Step`, the `Mask` and every device's
positions. Nothing inside the ring checks or resolves them again (docs/style.md, rule 18).

    call = check_call(q, k, v, n_devices=4, layout="striped", step="auto")      # whole sequences
    call = check_call(q_j, k_j, v_j, n_devices=comm.size, layout="zigzag",      # one rank's shard
                      per_device=True, seq_len=S)
    ring.ring_forward(q_j, k_j, v_j, call.positions[j], call.positions[j], comm,
                      scale=call.scale, tile_size=call.tile_size, step=call.step, mask=call.mask)

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
from .tiles import tile_shape


@dataclass(frozen=True, eq=False)
class RingCall:
    """A checked call: what the ring loops take, and what every rank must agree on."""
    scale: float
    step: Step
    mask: object             # reference.masks.Mask
    positions: np.ndarray    # (N, c) int64: every device's global positions, padding included
    tile_size: object        # as given (None: the default tile)
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
                    tile_size=tile_shape(self.tile_size), step=self.step.name, mask=self.mask.describe(),
                    **self.scheme.describe(), **grads)


def check_call(q, k, v, *, n_devices, layout="striped", causal=True, scale=None, tile_size=None, step="auto",
               grads=None, per_device=False, seq_len=None, scheme="ring", ulysses_degree=None, **mask_options):
    """Check a ring call's arguments (`reference.checks`, `reference.steps.check_step`,
    `reference.masks`) and return its RingCall, or raise the clear error.
    `grads`: (out, lse, dout) for a backward. `per_device`: q, k, v are one
    device's shard of c tokens, and `seq_len` the real length the layout padded
    to N c (None: N c); else they are whole sequences of any length (padded
    inside, `reference.layouts.padded_length`). `scheme`, `ulysses_degree`:
    `reference.schemes`."""
    B, S, Hq, Hkv, D = checks.check_qkv(q, k, v, seq_axis_name="c" if per_device else "S")
    if grads is not None:
        checks.check_grads_inputs(q, *grads)
    check_layout(layout, S, n_devices)
    plan = Scheme.checked(scheme, ulysses_degree, n_devices=n_devices, Hq=Hq, Hkv=Hkv)
    scale = checks.check_options(layout=layout, causal=causal, scale=scale, tile_size=tile_size, head_dim=D)
    if per_device:
        seq_len = _real_length(S, n_devices, layout, seq_len)
    elif seq_len is not None:
        raise TypeError("seq_len is for one device's shard (per_device=True); whole sequences give S themselves")
    else:
        seq_len = S
    mask = layout_mask(seq_len, n_devices, layout, causal=causal, **mask_options)
    step = steps.check_step(step, array_module(q), backward=grads is not None, dropout=mask.dropout,
                            plain_mask=mask.causal_only, call=steps.call_of(q, k, tile_size))
    named = dict(zip(("q", "k", "v", "out", "lse", "dout"), (q, k, v) + tuple(grads or ())))
    return RingCall(scale=scale, step=step, mask=mask, positions=plan.positions(seq_len, layout),
                    tile_size=tile_size, layout=layout, scheme=plan,
                    arrays={name: (tuple(x.shape), str(x.dtype)) for name, x in named.items()})


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
