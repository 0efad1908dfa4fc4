"""The command line's plan: each layout's run resolved once, before anything is timed.

`make_plans` turns the parsed options into one `Plan` per layout of --layout:
each layout's mask (`reference.masks.layout_mask`), the steps every layout
runs (`make_steps`: one forward and one backward step for all of them, so that
the layouts compare), and per pass a `reference.call.RingCall` resolved from
the shapes of a rank's shard (`reference.call.resolve_call`): the scheme,
every rank's positions, the mask, the step and its tile. Every timed run
hands the calls to the ring functions as they are (``call=``).

    plans = make_plans(args, backend, n_ranks)           # ValueError: what cannot run
    out, lse, log = backend.ring_attention(q, k, v, comm=comm, call=plans[0].forward, trace="rank")
"""

from dataclasses import dataclass

import numpy as np

from reference import LAYOUTS, steps
from reference.call import RingCall, resolve_call
from reference.heads import accumulate_dtype
from reference.layouts import padded_length
from reference.masks import cu_seqlens_from_lengths, layout_mask


@dataclass(frozen=True)
class Plan:
    """One layout's run: a resolved call per pass (the backward's with --backward)."""
    layout: str
    forward: RingCall
    backward: RingCall = None

    @property
    def positions(self):
        """(N, c): every rank's global positions."""
        return self.forward.positions

    @property
    def scheme(self):
        return self.forward.scheme


def make_plans(args, backend, n_ranks):
    """One Plan per layout of --layout for `backend` (a `mpi_impl.cli.Backend`)
    on n_ranks, or the ValueError that says which option cannot run."""
    masks = {layout: layout_mask(args.seq_len, n_ranks, layout, causal=args.causal, **mask_options(args))
             for layout in layouts(args)}
    forward, backward = make_steps(args, backend, masks.values())

    def call(layout, step, tile_size, grads=False):
        c = padded_length(args.seq_len, n_ranks, layout) // n_ranks          # tokens per rank
        return resolve_call(shard_specs(args, c, grads), backend.array_module, n_devices=n_ranks, layout=layout,
                            tile_size=tile_size, step=step, per_device=True, seq_len=args.seq_len,
                            scheme=args.scheme, ulysses_degree=args.ulysses_degree, ring_inner=args.ring_inner,
                            mask=masks[layout])
    return [Plan(layout, call(layout, forward, args.tile_size),
                 call(layout, backward, backward_tile(args), grads=True) if args.backward else None)
            for layout in masks]


def make_steps(args, backend, masks):
    """(forward Step, backward Step) for --step, as `reference.steps.check_step`
    finds them for every layout's mask (`masks`), or a ValueError naming --step:
    "auto" from what the call is (float16 on CuPy: the tensor-core kernel where
    it takes the call); the backward is the forward's step where it takes the
    backward's call (its tile: --backward-tile-size), else "auto"'s (a step
    without a backward, version 1 of the fused kernel, or "auto" whose first
    choice does not fit the backward's tile). Their workers are the rank's
    share (`mpi_impl.cli.hold_share`)."""
    xp = backend.array_module
    call = steps.Call(args.dtype, args.head_dim, args.heads // (args.kv_heads or args.heads), args.tile_size)
    rules = dict(dropout=bool(args.dropout), plain_mask=all(m.causal_only for m in masks), call=call)
    try:
        forward = steps.check_step(args.step, xp, **rules)
        rules["call"] = call._replace(tile_size=backward_tile(args))
        try:
            backward = steps.check_step(forward, xp, backward=True, **rules) if forward.has_backward else None
        except ValueError:
            if args.step != "auto":
                raise                               # the step asked for cannot take the backward's tile
            backward = None
        return forward, backward or steps.check_step("auto", xp, backward=True, **rules)
    except ValueError as e:
        raise ValueError(f"--step {args.step}: {e}") from None


def shard_specs(args, c, grads=False):
    """What a rank's arrays are, name -> (shape, dtype name), as
    `reference.call.RingCall.arrays` holds them: q, k, v of c tokens, and for
    the backward out, dout like q and lse (B, Hq, c) in the accumulation dtype."""
    hkv = args.kv_heads or args.heads
    q, kv = ((args.batch, c, args.heads, args.head_dim), args.dtype), ((args.batch, c, hkv, args.head_dim), args.dtype)
    arrays = dict(q=q, k=kv, v=kv)
    if grads:
        arrays.update(out=q, lse=((args.batch, args.heads, c), np.dtype(accumulate_dtype(args.dtype)).name), dout=q)
    return arrays


def mask_options(args):
    """The mask keyword arguments of the ring functions, from the parsed options."""
    cu = args.cu_seqlens
    if args.doc_lengths is not None:
        cu = cu_seqlens_from_lengths(args.doc_lengths).tolist()
    return dict(window=args.window, cu_seqlens=cu, dropout=args.dropout, seed=args.seed)


def backward_tile(args):
    return args.tile_size if args.backward_tile_size is None else args.backward_tile_size


def layouts(args):
    return LAYOUTS if args.layout == "all" else (args.layout,)
