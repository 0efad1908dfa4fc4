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
import time
from contextlib import nullcontext

import numpy as np

from . import cores, schemes, steps
from .call import check_call
from .layouts import shard_at, unshard_at
from .ring import DKV, KV
from .trace import Trace, Traffic

POLL_S = 0.05
DEADLOCK_S = 2.0        # every device still running has waited this long, nothing on its way: none will move


class VirtualRing:
    """One device's end of a ring of threads: `start_shift` posts a copy of
    the arrays to the next device's mailbox, `finish_shift` takes what the
    previous device posted with the same tag; `turn` holds one of the cores
    while the device computes. `group(members)` is the same device's end of a
    smaller ring (the devices `members`, in their order), and `all_to_all`
    trades a piece with every member of the group (a scheme's Ulysses group).
    Every group of a device counts the bytes it moves into the device's `traffic`."""

    def __init__(self, rank, size, mailboxes, failed, turns=None, members=None, watchdog=None, traffic=None):
        self.rank, self.size = rank, size
        self.members = tuple(range(size)) if members is None else members
        self._mailboxes, self._failed = mailboxes, failed
        self._turns = turns
        self._watchdog = watchdog or Watchdog(())
        self._taken = {}            # (tag, group rank) -> messages taken from it: the round of the next
        self.traffic = traffic or Traffic()

    def group(self, members):
        """This device's end of the ring of `members` (global ranks, this device among them)."""
        me = self.members[self.rank]
        return VirtualRing(members.index(me), len(members), self._mailboxes, self._failed, self._turns,
                           tuple(members), self._watchdog, self.traffic)

    def turn(self):
        """A `with` block that computes on one of the cores: with more devices
        than the cores hold, it waits until one is free (`reference.cores`)."""
        return nullcontext() if self._turns is None else self._turns

    def start_shift(self, arrays, tag):
        arrays = tuple(arrays)
        self._box((self.rank + 1) % self.size, tag).put(tuple(a.copy() for a in arrays))
        self.traffic.moved(tag, sent=arrays if self.size > 1 else ())
        return tag

    def progress(self):
        """Nothing to move: `start_shift` posted a copy of the block at once."""

    def finish_shift(self, tag):
        arrived = self._take(self._box(self.rank, tag), tag, (self.rank - 1) % self.size)
        self.traffic.moved(tag, received=arrived if self.size > 1 else ())
        return arrived

    def all_to_all(self, pieces):
        """Piece i to group rank i; returns the piece each group rank sent here, in rank order."""
        for i, piece in enumerate(pieces):
            self._box(i, ("all_to_all", self.rank)).put(piece.copy())
        got = [self._take(self._box(self.rank, ("all_to_all", i)), "all_to_all", i) for i in range(self.size)]
        self.traffic.traded(pieces, got, self.rank)
        return got

    def _box(self, rank, tag):
        """The mailbox of group rank `rank` for `tag` (made on first use; dict.setdefault is atomic)."""
        return self._mailboxes.setdefault((self.members, rank, tag), queue.Queue())

    def _take(self, box, tag, source):
        """The next message in `box`: tag `tag`'s from group rank `source`."""
        me, key = self.members[self.rank], (tag, source)
        round_ = self._taken.get(key, 0)
        self._watchdog.waits(me, box, f"{_tag_name(tag)} from device {self.members[source]}, round {round_}")
        try:
            while True:     # poll, so that a failure on another device, or a deadlock, ends the wait
                try:
                    message = box.get(timeout=POLL_S)
                    self._taken[key] = round_ + 1
                    return message
                except queue.Empty:
                    if self._failed.is_set():
                        raise RuntimeError("another virtual device failed") from None
                    self._watchdog.check()
        finally:
            self._watchdog.woke(me)


class Deadlock(AssertionError):
    """Every virtual device still running waits for a message that no device will send."""


class Watchdog:
    """Ends a deadlock of the virtual devices within seconds, with an error
    naming each device and what it waits for, instead of a hang until a
    test's timeout: when every device still running has been waiting for
    `patience` seconds, each on a mailbox with nothing in it, no device is
    left to post a message, so none will ever come. A device that computes,
    or waits for its turn at a core, is not waiting."""

    def __init__(self, devices, patience=None):
        self._lock = threading.Lock()
        self._devices, self._running = set(devices), set(devices)
        self._waiting = {}          # device -> (mailbox, what it waits for, since)
        self.patience = DEADLOCK_S if patience is None else patience

    def waits(self, device, box, what):
        with self._lock:
            self._waiting[device] = (box, what, time.monotonic())

    def woke(self, device):
        with self._lock:
            self._waiting.pop(device, None)

    def ended(self, device):
        with self._lock:
            self._running.discard(device)
            self._waiting.pop(device, None)

    def check(self):
        """Raise Deadlock if no running device can move (class docstring)."""
        with self._lock:
            now, waiting = time.monotonic(), self._waiting
            if not self._running or set(waiting) != self._running:
                return
            if any(box.qsize() or now - since < self.patience for box, _, since in waiting.values()):
                return
            stuck = "; ".join(f"device {d} waits for the {what}" for d, (_, what, _) in sorted(waiting.items()))
            ended = sorted(self._devices - self._running)
        raise Deadlock(f"virtual devices deadlocked: {stuck}; nothing is on its way to any of them"
                       + (f" (device{'s' * (len(ended) > 1)} {', '.join(map(str, ended))} ended)" if ended else ""))


def _tag_name(tag):
    return {KV: "K/V block", DKV: "dK/dV block", "all_to_all": "all-to-all piece"}.get(tag, f"message tagged {tag!r}")


def run_devices(n_devices, device_fn, at_once=None):
    """Run ``device_fn(rank, comm)`` on N threads; return their results in rank
    order, or raise the first device's exception. `at_once`: how many devices
    compute at a time (their `turn`s; None: all)."""
    mailboxes = {}
    failed = threading.Event()
    turns = None if at_once is None or at_once >= n_devices else threading.BoundedSemaphore(at_once)
    watchdog = Watchdog(range(n_devices))
    results, errors = [None] * n_devices, [None] * n_devices

    def run(rank):
        try:
            results[rank] = device_fn(rank, VirtualRing(rank, n_devices, mailboxes, failed, turns, watchdog=watchdog))
        except BaseException as e:      # noqa: BLE001 - re-raised below
            errors[rank] = e
            failed.set()
        finally:
            watchdog.ended(rank)

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
                   segment_ids=None, dropout=0.0, seed=0, threads=None, blas_threads=None, scheme="ring",
                   ulysses_degree=None, ring_inner=None):
    """Exact attention over N virtual devices. Returns (out, lse) or (out, lse, Trace).
    `step`: a name of `reference.steps` ("v1", the readable step, by default;
    "auto": the fastest for the arrays) or a `reference.step.Step`.
    Mask options (`reference.masks`): a sliding `window`, packed documents
    (`cu_seqlens` or `segment_ids`), `dropout` with its `seed`; any S.
    `scheme`: "ring" (the paper's), "all_gather", "ulysses" or "usp" with
    `ulysses_degree`, "double_ring" with `ring_inner` (`reference.schemes`);
    the layout deals the ring's tokens.
    `threads` (workers per device, for steps that take them) and
    `blas_threads` (per product): the devices' share of the cores by default
    (`reference.cores`); the trace says what ran (``Trace.threads``)."""
    call = check_call(q, k, v, n_devices=n_devices, layout=layout, causal=causal, scale=scale, tile_size=tile_size,
                      step=step, window=window, cu_seqlens=cu_seqlens, segment_ids=segment_ids, dropout=dropout,
                      seed=seed, scheme=scheme, ulysses_degree=ulysses_degree, ring_inner=ring_inner)
    pos, S = call.positions, q.shape[1]
    (outs, lses), ran = run_shards(call, [shard_at(x, pos) for x in (q, k, v)], threads=threads,
                                   blas_threads=blas_threads)
    out, lse = unshard_at(outs, pos, S, axis=1), unshard_at(lses, pos, S, axis=2)
    return (out, lse, ran) if trace else (out, lse)


def ring_attention_backward(q, k, v, out, lse, dout, *, n_devices, layout="striped", causal=True,
                            scale=None, tile_size=None, step=steps.DEFAULT, trace=False, window=None,
                            cu_seqlens=None, segment_ids=None, dropout=0.0, seed=0, threads=None,
                            blas_threads=None, scheme="ring", ulysses_degree=None, ring_inner=None):
    """Gradients (dq, dk, dv) over N virtual devices, or (dq, dk, dv, Trace);
    mask, scheme and thread options as `ring_attention` (dropout drops the forward's pairs again)."""
    call = check_call(q, k, v, n_devices=n_devices, layout=layout, causal=causal, scale=scale, tile_size=tile_size,
                      step=step, grads=(out, lse, dout), window=window, cu_seqlens=cu_seqlens,
                      segment_ids=segment_ids, dropout=dropout, seed=seed, scheme=scheme,
                      ulysses_degree=ulysses_degree, ring_inner=ring_inner)
    pos = call.positions
    shards = [shard_at(x, pos) for x in (q, k, v, out)] + [shard_at(lse, pos, axis=2), shard_at(dout, pos)]
    grads, ran = run_shards(call, shards, threads=threads, blas_threads=blas_threads)
    grads = tuple(unshard_at(g, pos, q.shape[1], axis=1) for g in grads)
    return grads + (ran,) if trace else grads


def run_shards(call, shards, *, threads=None, blas_threads=None):
    """The devices of a checked `call` (`reference.call.check_call`) on shards
    already dealt as its positions deal them: `shards` is [qs, ks, vs], or
    [qs, ks, vs, outs, lses, douts] for the backward, each a list of N arrays
    (`reference.layouts.shard_at`; lse's (B, Hq, c)). Returns the per-device
    results, (outs, lses) or (dqs, dks, dvs), each a tuple of N arrays, and the
    Trace. Device j runs `schemes.forward` (or `backward`), the ring's
    `ring.ring_forward` for the ring, on its shards."""
    scheme, pos = call.scheme, call.positions                         # (N, c)
    step, share = cores.for_devices(call.step, scheme.n, threads=threads, blas_threads=blas_threads)
    passes = schemes.backward if call.backward else schemes.forward

    def device(j, comm):
        comms = schemes.device_comms(scheme, j, comm.group)
        group_pos = np.concatenate([pos[g] for g in scheme.ulysses_group(j)])   # this ring rank's tokens
        return passes(*(s[j] for s in shards), group_pos, comms, scheme=scheme, scale=call.scale,
                      tile_size=call.tile, step=step, mask=call.mask)

    with share.held():
        *results, logs = zip(*run_devices(scheme.n, device, at_once=share.at_once))
    return tuple(results), Trace.from_logs(logs, threads=share.label)
