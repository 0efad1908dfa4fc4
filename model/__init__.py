"""A small decoder-only transformer in NumPy whose attention is the ring.

The paper's recipe (section 3): the tokens are permuted once, at the input;
labels are shifted first and sharded the same way; positions travel with the
tokens (rotary embeddings use each token's global position); every layer but
attention is local to its device, and attention goes through the ring
(the guide: docs/model.md).

    make train                                   # train over MPI, draw the loss curve
    mpiexec -n 2 python -m mpi4py -m model --layout striped --steps 300
    python -m model --n-devices 4 --layout zigzag --steps 50      # virtual ring, one process

Modules, in reading order:

    layers        each layer's forward and hand-written backward
    recipe        shift the labels, then shard, as the tokens are
    attention     the one layer that needs other devices: dense, the virtual ring, MPI
    transformer   the model, forward and backward
    train         a task made on the spot, Adam, and the loop
    __main__      `python -m model`: train and draw the loss curve
    speedup       the paper's Theoretical Maximum Speedup for any model, pair-counted and tile-aware
"""

# `speedup` is not imported here: `python -m model.speedup` would warn that it was
# imported before it ran.
from . import attention, layers, recipe, train, transformer
from .transformer import Config, init_params, loss_and_grads

__all__ = ["attention", "layers", "recipe", "train", "transformer", "Config", "init_params", "loss_and_grads"]
