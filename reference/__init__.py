"""Striped Attention, the NumPy reference: dense attention, N virtual devices
in a ring, and a cost model of their work.

    from reference import attention, ring_attention
    out, lse = ring_attention(q, k, v, n_devices=4, layout="striped")

Modules, in reading order: `dense` (the formula, and `merge`), `layouts` (who
holds which token), `masks` (which keys a query sees: causal, windows, packed
documents, padding, dropout), `tiles` (which tiles to skip), `heads` (the compute
layout), `step` (one device, one block: the readable version 1 and the
contract), `call` (a ring call checked once, at the door), `ring` (one
device's rounds, shared by every backend), `virtual` (N
devices as threads), `lockstep` (the same rounds in one loop), `steps` (the
numbered step versions, the workshop: `steps.v2` .. `steps.v5`), `trace` (and its files), `plot`,
`inputs` (random shards a device makes alone), `cost`, `tms`.
``python -m reference`` prints the per-device work of each layout.
"""

from . import lockstep, masks, schemes, steps
from .dense import attention, attention_backward, merge
from .layouts import LAYOUTS, inverse_positions, positions, shard, unshard
from .schemes import SCHEMES
from .tiles import DEFAULT_TILE_SIZE
from .trace import Trace
from .virtual import ring_attention, ring_attention_backward

__all__ = ["attention", "attention_backward", "merge", "ring_attention", "lockstep", "masks", "steps", "schemes", "SCHEMES",
           "ring_attention_backward",
           "shard", "unshard", "positions", "inverse_positions", "LAYOUTS", "Trace", "cost",
           "DEFAULT_TILE_SIZE"]


def __getattr__(name):
    """`reference.cost` on first use: imported eagerly, ``python -m reference.cost``
    (and ``reference.tms``, which it imports) would run a module already imported."""
    if name == "cost":
        import importlib
        return importlib.import_module(".cost", __name__)
    raise AttributeError(f"module 'reference' has no attribute {name!r}")
