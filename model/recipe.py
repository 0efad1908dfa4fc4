"""The recipe of the paper (section 3): permute the tokens once, at the input.

A causal language model's batch is a sequence of S + 1 tokens. The inputs are
tokens 0..S-1 and the labels tokens 1..S: the labels are shifted FIRST, in
natural order, and only then are inputs and labels cut into the layout's shards,
both the same way, so that a token and its label stay on the same device. Each
device also gets the global positions of its tokens (they travel with them: the
rotary embeddings read them, the ring's masks are made from them). After that,
every layer but attention is local: nothing else is ever permuted back.

    S=8, N=4, striped: device 1 holds inputs at positions [1 5], labels = tokens [2 6]

Legend: B sequences, S tokens, N devices, c = S // N.
"""

from dataclasses import dataclass

import numpy as np

import reference

from .layers import IGNORE


@dataclass
class Shard:
    """One device's part of a batch: inputs x (B, c), labels y (B, c), positions pos (c,)."""
    x: np.ndarray
    y: np.ndarray
    pos: np.ndarray


def shift_then_shard(tokens, n_devices, layout, *, ignore_first=0):
    """tokens (B, S + 1) -> N Shards of the layout, labels shifted before sharding.
    The first `ignore_first` labels count for nothing (`layers.IGNORE`): a task may
    have tokens nothing can predict."""
    x, y = tokens[:, :-1], tokens[:, 1:].copy()                # (B, S) each, natural order
    y[:, :ignore_first] = IGNORE
    pos = reference.positions(x.shape[1], n_devices, layout)   # (N, c)
    xs, ys = reference.shard(x, n_devices, layout), reference.shard(y, n_devices, layout)
    return [Shard(xj, yj, pj) for xj, yj, pj in zip(xs, ys, pos)]


def side_by_side(shards):
    """The N shards concatenated along the tokens, in device order: what the virtual
    ring's model holds (`model.attention.VirtualRing`)."""
    return Shard(np.concatenate([s.x for s in shards], axis=1),
                 np.concatenate([s.y for s in shards], axis=1),
                 np.concatenate([s.pos for s in shards]))
