"""The PyTorch harness: a ring written with torch.distributed, held against the oracle one example at a time.

The user writes only what one rank computes from its shard, in torch tensors;
the harness keeps a gloo world of N processes per world size alive between
examples (so that hypothesis can run and shrink hundreds of them), sends each
rank its shard, takes the gradients by autograd where the ring does not
return them, and hands the kit every rank's results (the guide: docs/kit.md,
"A PyTorch ring"):

    from reference.testing.harness.torch import TorchAdapter

    class Mine(TorchAdapter):
        name = "my ring"
        layouts = ("striped",)

        def compute(self, case, shard):        # shard.q (B, c, Hq, D), requires grad; shard.k, shard.v ...
            out, lse = my_ring(shard.q, shard.k, shard.v, causal=case.causal, scale=case.scale_value)
            return dict(out=out, lse=lse)      # dq, dk, dv: autograd of sum(out * dout), unless returned

    python -m reference.testing check my_module:Mine --world-sizes 2,3,4

Inside `compute`, torch.distributed is initialized (gloo, CPU, one thread per
rank). A rank that raises, or does not answer within `timeout` seconds (a
TimeoutError naming the ranks and the line each waits on), fails the example
and ends the world; the next example starts a new one. The processes are
`multiprocessing`'s (a forkserver with torch preloaded), the messages its
pipes; importing this module does not import torch, the ranks do.
"""

import atexit
import faulthandler
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait

import numpy as np

from ..adapter import Adapter
from ..cases import BACKWARD, NAMES
from ..compare import BFLOAT16

START_TIMEOUT_S = 120        # N processes forked, gloo joined: seconds on a loaded machine
GLOO_TIMEOUT_S = 3600        # the driver's timeout ends a hung example long before gloo's would
GRACE_S = 3                  # after one rank raised, how long the others get before they are ended
STACK_LINES = 12             # of each hung rank's stack, at most


@dataclass
class RankShard:
    """One rank's part of a case, as torch tensors in its local token order:
    q (B, c, Hq, D), k, v (B, c, Hkv, D) leaves that require grad, dout like q,
    positions (c,) int64 the global positions it holds; rank, world_size."""
    q: object
    k: object
    v: object
    dout: object
    positions: object
    rank: int
    world_size: int


class TorchAdapter(Adapter):
    """A kit `Adapter` whose ranks are a gloo world. Subclasses set what the
    ring takes (`layouts`, `dtypes`, `masks`, `positions`, ...: see `Adapter`)
    and write `compute(case, shard)`: this rank's {"out", "lse"} (torch tensors:
    out (B, c, Hq, D) in the input dtype, lse (B, Hq, c) natural log), with
    "dq", "dk", "dv" where the ring computes them itself; otherwise, when
    `backward`, the harness takes them by autograd of sum(out * dout).
    `timeout`: seconds one example may take on every rank together;
    `preload`: modules (the ring's library) the ranks import before they are
    forked, once, so that a world started after a failure starts at once
    (taken from the adapter that starts the first world of the process).
    `loss_ignores_padding`: for a ring whose padding queries (positions >= S)
    attend like real ones (it has no query mask): the harness zeroes dout at
    padding positions, as a loss that leaves padding out does, so that they
    carry no gradient to real keys."""
    timeout = 120
    preload = ()
    loss_ignores_padding = False

    def compute(self, case, shard):
        raise NotImplementedError

    def run(self, case, shards):
        mine = [dict(q=shards.q[r], k=shards.k[r], v=shards.v[r], dout=shards.dout[r], positions=shards.positions[r])
                for r in range(case.n_devices)]
        return WORLDS.request(case.n_devices, (self, case), mine, timeout=self.timeout, who=self.name,
                              preload=self.preload)


# -- the driver's side: one world per world size --------------------------------


class World:
    """N rank processes joined in one gloo group, answering one example at a time."""

    def __init__(self, n, preload=()):
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", __name__, *preload])     # (read when the forkserver starts)
        self.n = n
        self._dir = tempfile.TemporaryDirectory(prefix=f"torch-world-{n}-")
        init = "file://" + os.path.join(self._dir.name, "init")
        self.conns, self.procs = [], []
        for rank in range(n):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, n, init, theirs, self._stack_file(rank)), daemon=True,
                               name=f"torch-rank-{rank}-of-{n}")
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)
        self._replies(START_TIMEOUT_S, f"starting a {n}-rank gloo world")

    def _stack_file(self, rank):
        return os.path.join(self._dir.name, f"stack-{rank}.txt")

    def request(self, job, mine, timeout, who):
        """Send rank r `(job, mine[r])`; every rank's reply."""
        for conn, part in zip(self.conns, mine):
            conn.send((job, part))
        return self._replies(timeout, who)

    def _replies(self, timeout, what):
        """Every rank's reply; or, when a rank raised (RuntimeError) or some gave
        none within `timeout` s (TimeoutError), the world ended and an error
        naming those ranks, with their tracebacks or where each was waiting."""
        replies, silent = self._collect(timeout)
        raised = [(r, value) for r, (status, value) in sorted(replies.items()) if status == "error"]
        if not raised and not silent:
            return [replies[r][1] for r in range(self.n)]
        stacks = self._stacks(silent) if silent else ""
        self.close()
        ranks = lambda rs: f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"      # noqa: E731
        if raised:
            rank, text = raised[0]
            also = f" (as did {ranks([r for r, _ in raised[1:]])})" if raised[1:] else ""
            hung = (f"; then {ranks(silent)} gave no answer within {GRACE_S} s, waiting at (most recent call "
                    f"first):\n{stacks}\nrank {rank}'s traceback") if silent else ""
            raise RuntimeError(f"{what}: rank {rank} of {self.n} raised{also}{hung}:\n{text}")
        answered = f" ({ranks(sorted(replies))} answered)" if replies else ""
        raise TimeoutError(f"{what}: {ranks(silent)} of {self.n} gave no answer within {timeout} s{answered}; "
                           f"where each was waiting (most recent call first):\n{stacks}")

    def _collect(self, timeout):
        """({rank: (status, value)}, [ranks with no reply]) after at most
        `timeout` s, or GRACE_S once a rank raised (the others may be waiting for it)."""
        replies, deadline = {}, time.monotonic() + timeout
        waiting = {conn: r for r, conn in enumerate(self.conns)}
        while waiting:
            if any(status == "error" for status, _ in replies.values()):
                deadline = min(deadline, time.monotonic() + GRACE_S)
            ready = wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                r = waiting.pop(conn)
                try:
                    replies[r] = conn.recv()
                except EOFError:             # the process is gone (killed, or it crashed)
                    self.procs[r].join(1)
                    replies[r] = ("error", f"rank {r} exited with code {self.procs[r].exitcode} before it answered")
        return replies, sorted(waiting.values())

    def _stacks(self, ranks):
        """Each rank's Python stack, dumped by faulthandler on SIGUSR1 (it works
        inside a blocked C call: a gloo recv)."""
        for r in ranks:
            if self.procs[r].is_alive():
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(0.5)
        text = []
        for r in ranks:
            try:
                with open(self._stack_file(r)) as f:
                    frames = [line for line in f.read().splitlines() if line.strip().startswith("File")]
            except OSError:
                frames = []
            ours = [i for i, line in enumerate(frames) if line.endswith(" in _answer")]
            lines = frames[:ours[0]] if ours else frames          # the frames below the harness's own
            text.append(f"rank {r}:\n" + ("\n".join(lines[:STACK_LINES]) or "  (no stack: the process had exited)"))
        return "\n".join(text)

    def close(self):
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
        self._dir.cleanup()


class Worlds:
    """One `World` per world size, started on first use, restarted after a failure."""

    def __init__(self):
        self.worlds = {}

    def request(self, n, job, mine, *, timeout, who, preload=()):
        world = self.worlds.get(n) or self.worlds.setdefault(n, World(n, preload))
        try:
            return world.request(job, mine, timeout, who)
        except (RuntimeError, TimeoutError):
            self.worlds.pop(n, None)         # the world was closed: the next example starts another
            raise

    def close(self):
        for world in self.worlds.values():
            world.close()
        self.worlds = {}


WORLDS = Worlds()
atexit.register(WORLDS.close)


def close_worlds():
    """End every world (they end with the process anyway)."""
    WORLDS.close()


# -- a rank's side ------------------------------------------------------------------


def _rank_main(rank, n, init, conn, stack_file):
    """Join the gloo world, then answer examples until the message None."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    stacks = open(stack_file, "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=False)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=n,
                                timeout=timedelta(seconds=GLOO_TIMEOUT_S))
        conn.send(("ok", None))
    except Exception:                       # noqa: BLE001 - reported to the driver, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:                    # the driver has gone
            break
        if message is None:
            break
        (adapter, case), mine = message
        try:
            reply = ("ok", _answer(adapter, case, mine, rank, n))
        except Exception:                   # noqa: BLE001 - reported to the driver, which raises it
            reply = ("error", traceback.format_exc())
        conn.send(reply)
        sys.stdout.flush()
    dist.destroy_process_group()


def _answer(adapter, case, mine, rank, n):
    """This rank's results as NumPy arrays: the adapter's `compute`, and the
    gradients by autograd where it returned none."""
    import torch
    q, k, v = (to_torch(mine[name]).requires_grad_(adapter.backward) for name in ("q", "k", "v"))
    shard = RankShard(q=q, k=k, v=v, dout=to_torch(mine["dout"]), positions=torch.from_numpy(mine["positions"]),
                      rank=rank, world_size=n)
    if adapter.loss_ignores_padding:
        real = (shard.positions < case.S).to(shard.dout.dtype)                  # (c,) 0 at padding positions
        shard.dout = shard.dout * real[None, :, None, None]
    result = adapter.compute(case, shard)
    if not isinstance(result, dict):
        raise TypeError(f"{type(adapter).__name__}.compute must return a dict of out, lse (dq, dk, dv), "
                        f"got {type(result).__name__}")
    result = dict(result)
    if adapter.backward and not all(name in result for name in BACKWARD):
        out = result.get("out")
        if not (isinstance(out, torch.Tensor) and out.requires_grad):
            raise TypeError(f"{type(adapter).__name__}.compute returned no dq, dk, dv and an out with no "
                            "autograd graph: return the gradients, or set backward = False")
        grads = torch.autograd.grad(out, (q, k, v), shard.dout, allow_unused=True)
        for name, g, x in zip(BACKWARD, grads, (q, k, v)):
            result.setdefault(name, g if g is not None else torch.zeros_like(x))
    keep = NAMES if adapter.backward else tuple(n for n in NAMES if n not in BACKWARD)
    return {name: to_numpy(x) for name, x in result.items() if name in keep}


def to_torch(x):
    """A NumPy array (bfloat16 from ml_dtypes too) as a torch tensor sharing its memory."""
    import torch
    x = np.ascontiguousarray(x)
    if BFLOAT16 is not None and x.dtype == BFLOAT16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def to_numpy(t):
    """A torch tensor (bfloat16 too: as ml_dtypes.bfloat16) as a NumPy array; anything else as np.asarray."""
    import torch
    if not isinstance(t, torch.Tensor):
        return np.asarray(t)
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()
