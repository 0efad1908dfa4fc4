"""Random inputs that every device can make alone: its own shard, no communication.

A standard-normal (B, S, H, D) array is defined CHUNK tokens at a time, each
chunk from its own seed ``(seed, which, first token)``, so any set of
positions (a device's shard, in its layout's order, or all of them for a
check on one process) is made without making the rest. `which` tells the
arrays of one run apart (q = 0, k = 1, v = 2, dout = 3, as the command line
numbers them).

    pos = positions(S, N, "striped")[rank]
    q = make_shard(seed, 0, (B, S, H, D), pos, np.float32)      # (B, c, H, D)
    q_all = make_shard(seed, 0, (B, S, H, D), np.arange(S), np.float32)
    assert (q == q_all[:, pos]).all()
"""

import numpy as np

CHUNK = 256          # tokens per independently seeded piece


def make_shard(seed, which, shape, pos, dtype):
    """Tokens `pos` of the standard-normal array `shape` = (B, S, H, D) of
    (seed, which), as `dtype` (B, len(pos), H, D); positions >= S (a layout's
    padding) are zeros."""
    B, S, H, D = shape
    out = np.zeros((B, len(pos), H, D), dtype=dtype)             # (B, c, H, D); padding stays 0
    for start in range(0, S, CHUNK):
        here = np.nonzero((pos >= start) & (pos < min(start + CHUNK, S)))[0]   # not the padding
        if len(here):
            rng = np.random.default_rng([seed, which, start])
            piece = rng.standard_normal((B, min(CHUNK, S - start), H, D))
            out[:, here] = piece[:, pos[here] - start]
    return out
