"""Striped Attention, the NumPy reference: dense attention, N virtual devices
in a ring, and a cost model of their work.

    from reference import attention, ring_attention
    out, lse = ring_attention(q, k, v, n_devices=4, layout="striped")
    python -m reference                  # the per-device work of each layout

Modules, in reading order:

    dense         attention straight from the formula, its gradients, and `merge`
    layouts       who holds which token: contiguous, striped, zigzag
    masks         which keys a query sees: causal, windows, documents, padding, dropout
    tiles         a (query shard, key block) pair cut into tiles, and which to skip
    heads         the compute layout: heads first, a query group's heads as rows
    nonfinite     NaN and inf at masked pairs, the hazard every step guards against
    step          one device, one block: the readable version 1, and the contract
    steps/        the workshop: step versions v2 .. v5, and how a caller picks one
    checks        the input checks every entry point shares
    call          a ring call checked once, at the door
    ring          one device's rounds (Algorithm 1), shared by every backend
    virtual       N devices as threads: `ring_attention` and its backward
    lockstep      the same rounds with every device in one loop, for a debugger
    schemes       the all-gather, Ulysses, USP and the double ring around the ring's loop
    double_ring   the ring as inner rings and an outer ring, on the ring's own loop
    cores         how the devices' threads share the machine's cores
    trace         what each device did in each round, and its files
    plot          pictures of traces
    inputs        random shards that each device makes alone
    predict       a pass's tiles and pairs counted for any dealing of positions
    cost          the cost model: each device's work per round, without attention
    topology      machines of nodes, the two links of each rank, where a scheme's ranks run
    scheme_cost   each scheme's tiles, bytes, memory and time per device and round
    moves         the messages of each scheme's pass, one row each, as scheme_cost prices them
    tile_cost     a tile's seconds measured on this machine: the model's compute side
    tms           the paper's Theoretical Maximum Speedup, recomputed
    usage         the command lines' shared checks and help: usage errors before any work
    testing/      the conformance kit: the oracle pointed at anyone's ring
    __main__      `python -m reference`: the work tables
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
