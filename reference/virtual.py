"""The oracle: N virtual devices in one process, running the ring of `reference.ring`.

Each virtual device is a thread running exactly the per-device code that MPI
ranks and GPUs run; `VirtualRing` is their communication object. Devices share
no memory: a message is a copy, delivered to the next device's mailbox. The
public functions take and return arrays in natural token order, and shard and
unshard them with the chosen layout. Any S: the layout pads it to its multiple
(`layouts.padded_length`) and the mask hides the padding (`masks`, seq_len).

    out, lse, trace = ring_attention(q, k, v, n_devices=4, layout="striped", trace=True)
    print(trace.table())

Shapes: q (B, S, Hq, D), k and v (B, S, Hkv, D), lse (B, Hq, S).
"""

import queue
import threading
from contextlib import nullcontext

from . import cores, ring, steps
from .call import check_call
from .layouts import shard, unshard
from .trace import Trace

POLL_S = 0.05


class VirtualRing:
    """One device's end of a ring of N threads: `start_shift` posts a copy of
    the arrays to the next device's mailbox, `finish_shift` takes what the
    previous device posted with the same tag; `turn` holds one of the cores
    while the device computes."""

    def __init__(self, rank, size, mailboxes, failed, turns=None):
        self.rank, self.size = rank, size
        self._mailboxes, self._failed = mailboxes, failed
        self._turns = turns

    def turn(self):
        """A `with` block that computes on one of the cores: with more devices
        than the cores hold, it waits until one is free (`reference.cores`)."""
        return nullcontext() if self._turns is None else self._turns

    def start_shift(self, arrays, tag):
        self._mailboxes[(self.rank + 1) % self.size][tag].put(tuple(a.copy() for a in arrays))
        return tag

    def progress(self):
        """Nothing to move: `start_shift` posted a copy of the block at once."""

    def finish_shift(self, tag):
        box = self._mailboxes[self.rank][tag]
        while True:     # poll, so that a failure on another device ends the wait
            try:
                return box.get(timeout=POLL_S)
            except queue.Empty:
                if self._failed.is_set():
                    raise RuntimeError("another virtual device failed") from None


def run_devices(n_devices, device_fn, at_once=None):
    """Run ``device_fn(rank, comm)`` on N threads; return their results in rank
    order, or raise the first device's exception. `at_once`: how many devices
    compute at a time (their `turn`s; None: all)."""
    mailboxes = [{ring.KV: queue.Queue(), ring.DKV: queue.Queue()} for _ in range(n_devices)]
    failed = threading.Event()
    turns = None if at_once is None or at_once >= n_devices else threading.BoundedSemaphore(at_once)
    results, errors = [None] * n_devices, [None] * n_devices

    def run(rank):
        try:
            results[rank] = device_fn(rank, VirtualRing(rank, n_devices, mailboxes, failed, turns))
        except BaseException as e:      # noqa: BLE001 - re-raised below
            errors[rank] = e
            failed.set()

    threads = [threading.Thread(target=run, args=(r,), name=f"device{r}") for r in range(n_devices)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    first = next((e for e in errors if e is not None and not _secondary(e)), None) \
        or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


def _secondary(e):
    return isinstance(e, RuntimeError) and str(e) == "another virtual device failed"


def ring_attention(q, k, v, *, n_devices, layout="striped", causal=True, scale=None,
                   tile_size=None, step=steps.DEFAULT, trace=False, window=None, cu_seqlens=None,
                   segment_ids=None, dropout=0.0, seed=0, threads=None, blas_threads=None):
    """Exact attention over N virtual devices. Returns (out, lse) or (out, lse, Trace).
    `step`: a name of `reference.steps` ("v1", the readable step, by default;
    "auto": the fastest for the arrays) or a `reference.step.Step`.
    Mask options (`reference.masks`): a sliding `window`, packed documents
    (`cu_seqlens` or `segment_ids`), `dropout` with its `seed`; any S.
    `threads` (workers per device, for steps that take them) and
    `blas_threads` (per product): the devices' share of the cores by default
    (`reference.cores`); the trace says what ran (``Trace.threads``)."""
    call = check_call(q, k, v, n_devices=n_devices, layout=layout, causal=causal, scale=scale, tile_size=tile_size,
                      step=step, window=window, cu_seqlens=cu_seqlens, segment_ids=segment_ids, dropout=dropout,
                      seed=seed)
    (outs, lses), ran = run_shards(call, [shard(x, n_devices, layout) for x in (q, k, v)],
                                   threads=threads, blas_threads=blas_threads)
    S = q.shape[1]
    out, lse = unshard(outs, layout, axis=1, seq_len=S), unshard(lses, layout, axis=2, seq_len=S)
    return (out, lse, ran) if trace else (out, lse)


def ring_attention_backward(q, k, v, out, lse, dout, *, n_devices, layout="striped", causal=True,
                            scale=None, tile_size=None, step=steps.DEFAULT, trace=False, window=None,
                            cu_seqlens=None, segment_ids=None, dropout=0.0, seed=0, threads=None,
                            blas_threads=None):
    """Gradients (dq, dk, dv) over N virtual devices, or (dq, dk, dv, Trace);
    mask and thread options as `ring_attention` (dropout drops the forward's pairs again)."""
    call = check_call(q, k, v, n_devices=n_devices, layout=layout, causal=causal, scale=scale, tile_size=tile_size,
                      step=step, grads=(out, lse, dout), window=window, cu_seqlens=cu_seqlens,
                      segment_ids=segment_ids, dropout=dropout, seed=seed)
    shards = [shard(x, n_devices, layout) for x in (q, k, v, out)] + [shard(lse, n_devices, layout, axis=2),
                                                                       shard(dout, n_devices, layout)]
    grads, ran = run_shards(call, shards, threads=threads, blas_threads=blas_threads)
    grads = tuple(unshard(g, layout, axis=1, seq_len=q.shape[1]) for g in grads)
    return grads + (ran,) if trace else grads


def run_shards(call, shards, *, threads=None, blas_threads=None):
    """The ring of a checked `call` (`reference.call.check_call`) on shards
    already dealt in the layout's local order: `shards` is [qs, ks, vs], or
    [qs, ks, vs, outs, lses, douts] for the backward, each a list of N arrays
    (`reference.shard`; lse's (B, Hq, c)). Returns the per-device results,
    (outs, lses) or (dqs, dks, dvs), each a tuple of N arrays, and the Trace.
    Device j runs `ring.ring_forward` (or `ring_backward`) on its shards."""
    n, pos = len(call.positions), call.positions                      # (N, c)
    step, share = cores.for_devices(call.step, n, threads=threads, blas_threads=blas_threads)
    loop = ring.ring_backward if call.backward else ring.ring_forward

    def device(j, comm):
        return loop(*(s[j] for s in shards), pos[j], pos[j], comm, scale=call.scale, tile_size=call.tile_size,
                    step=step, mask=call.mask)

    with share.held():
        *results, logs = zip(*run_devices(n, device, at_once=share.at_once))
    return tuple(results), Trace.from_logs(logs, threads=share.label)
