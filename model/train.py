"""Training the model over the ring: a task made on the spot, Adam, and the loop.

The task is copying: each sequence is a random block of `period` tokens repeated,
so a token can be predicted only by attending `period` positions back (the first
block's labels are ignored: nothing can predict them). With a long sequence and a
short block the answer is in every earlier block; the loss falls from log(V) to
near 0 once attention has learned the offset.

Every device draws the same batch from the same seed, takes its shard (the
recipe: shift, then shard), computes its share of the loss and gradients, and the
shares are summed (an allreduce on MPI ranks), so every device applies the same
Adam update and the parameters stay identical everywhere. The loss curve is then
the same for every N and layout, up to rounding.

    mpiexec -n 2 python -m mpi4py -m model --steps 300        # see python -m model --help
"""

import sys
import time

import numpy as np

from . import attention, recipe, transformer
from .layers import IGNORE


def copy_task(rng, batch, seq_len, vocab, period):
    """(B, S + 1) tokens: a random block of `period` tokens, repeated."""
    block = rng.integers(0, vocab, size=(batch, period))
    return np.tile(block, (1, seq_len // period + 1))[:, :seq_len + 1]


class Adam:
    """Adam (Kingma & Ba 2015) with a linear warm-up of the learning rate."""

    def __init__(self, params, lr=3e-3, betas=(0.9, 0.99), eps=1e-8, warmup=20):
        self.lr, self.betas, self.eps, self.warmup, self.t = lr, betas, eps, warmup, 0
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}

    def step(self, params, grads):
        """Update `params` in place."""
        self.t += 1
        b1, b2 = self.betas
        lr = self.lr * min(1.0, self.t / self.warmup)
        for k, g in grads.items():
            self.m[k] = b1 * self.m[k] + (1 - b1) * g
            self.v[k] = b2 * self.v[k] + (1 - b2) * g * g
            m_hat, v_hat = self.m[k] / (1 - b1 ** self.t), self.v[k] / (1 - b2 ** self.t)
            params[k] -= (lr * m_hat / (np.sqrt(v_hat) + self.eps)).astype(params[k].dtype)


class Replica:
    """One device's part of every step: its shard of the batch, its share of the loss and
    gradients, and their sum over devices. Make one with `dense`, `virtual` or `mpi`."""

    def __init__(self, config, attn, *, n_devices, layout, take, reduce=None, ignore_first=0):
        self.config, self.attn, self.n_devices, self.layout = config, attn, n_devices, layout
        self.take, self.reduce, self.ignore_first = take, reduce, ignore_first

    def loss_and_grads(self, params, tokens):
        """tokens (B, S + 1), the whole batch -> (loss, grads) of the whole batch."""
        shards = recipe.shift_then_shard(tokens, self.n_devices, self.layout, ignore_first=self.ignore_first)
        n_labels = sum(int((s.y != IGNORE).sum()) for s in shards)
        mine = self.take(shards)
        loss, grads = transformer.loss_and_grads(params, self.config, mine.x, mine.y, mine.pos,
                                                 self.attn, n_labels)
        return self.reduce(loss, grads) if self.reduce else (loss, grads)


def dense(config, **kw):
    """One process, the whole sequence in natural order, `reference.attention`: the oracle."""
    return Replica(config, attention.Dense(), n_devices=1, layout="contiguous",
                   take=lambda shards: shards[0], **kw)


def virtual(config, n_devices, layout, *, tile_size=None, **kw):
    """N virtual devices in this process: their shards side by side, the virtual ring."""
    return Replica(config, attention.VirtualRing(n_devices, layout, tile_size=tile_size),
                   n_devices=n_devices, layout=layout, take=recipe.side_by_side, **kw)


def mpi(config, comm, layout, *, tile_size=None, **kw):
    """This MPI rank: its shard, `mpi_impl`'s ring, and an allreduce of the shares."""
    return Replica(config, attention.MPIRing(comm, layout, tile_size=tile_size),
                   n_devices=comm.Get_size(), layout=layout,
                   take=lambda shards: shards[comm.Get_rank()], reduce=lambda l, g: allreduce(comm, l, g), **kw)


def allreduce(comm, loss, grads):
    """Sum the loss and every gradient over the ranks, in one message."""
    from mpi4py import MPI
    names = sorted(grads)
    flat = np.concatenate([np.atleast_1d(np.asarray(loss, dtype=np.float64))]
                          + [grads[k].ravel().astype(np.float64) for k in names])
    comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
    out, at = {}, 1
    for k in names:
        out[k] = flat[at:at + grads[k].size].reshape(grads[k].shape).astype(grads[k].dtype)
        at += grads[k].size
    return float(flat[0]), out


def train(replica, params, *, steps, batch, seq_len, period, lr=3e-3, seed=0, progress=None):
    """`steps` Adam steps on the copy task; returns (losses, seconds per step)."""
    rng = np.random.default_rng(seed + 1)            # the same batches on every device
    opt = Adam(params, lr=lr)
    losses, seconds = [], []
    for t in range(steps):
        tokens = copy_task(rng, batch, seq_len, replica.config.vocab, period)
        start = time.perf_counter()
        loss, grads = replica.loss_and_grads(params, tokens)
        opt.step(params, grads)
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss))
        if progress:
            progress(t + 1, steps, losses[-1], seconds[-1])
    return np.array(losses), np.array(seconds)


class Progress:
    """A progress line: redrawn in place on a terminal, a line every `every` steps otherwise."""

    def __init__(self, label="", every=25, stream=sys.stdout, width=30):
        self.label, self.every, self.stream, self.width = label, every, stream, width
        self.tty = stream.isatty()

    def __call__(self, step, steps, loss, seconds):
        if not self.tty and step % self.every and step != steps:
            return
        done = int(self.width * step / steps)
        line = (f"{self.label}[{'#' * done}{'.' * (self.width - done)}] step {step:>4}/{steps} "
                f"loss {loss:7.4f}  {seconds * 1e3:6.1f} ms/step")
        end = "\n" if not self.tty or step == steps else ""
        print(("\r" if self.tty else "") + line, end=end, file=self.stream, flush=True)


def plot_losses(curves, path, title="Training loss"):
    """curves {label: losses}; one line each (identical curves lie on top of each other)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for (label, losses), style in zip(curves.items(), ("-", "--", ":", "-.")):
        ax.plot(np.arange(1, len(losses) + 1), losses, style, lw=1.5, label=label)
    ax.set(xlabel="Adam step", ylabel="cross-entropy (nats)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
