"""How the ring's threads share the machine's cores: BLAS threads per product, workers per device.

Every virtual device is a thread (`reference.virtual`), every device's step
calls BLAS, and OpenBLAS starts a thread per core for each product unless
told otherwise: unplanned, a ring of 8 devices on 2 cores ran 4 to 7 times
slower than with BLAS held to one thread. So the ring decides, once, before
its devices start:

- a device's share of the cores: ``cores // N`` (at least 1);
- BLAS threads per product: the share (1 with more devices than cores);
- worker threads of a step that takes them (v3, v4, v5): the share, and then
  one BLAS thread per product (two levels of threads oversubscribe the cores);
- devices computing at once: as many as the cores hold; the others wait for
  their turn before each step (`reference.virtual`).

Arguments choose otherwise (``threads=``, ``blas_threads=``; ``--threads`` and
``--blas-threads`` on the command lines) within the caller's budget, and the
trace says what ran (``Trace.threads``). A limit set inside another never
raises the thread count (docs/design.md, "Threads and cores"): `budget` is the
share held around the call (`Share.held`), else this process's cores capped by
BLAS's thread count now; `share` deals it; `blas_limit(n)` holds BLAS to
``min(n, its count now)`` with threadpoolctl, around the call only. Why one
hold at a time, and what taking turns bought: docs/mpi.md, "Threads and cores".

    step, share = cores.for_devices(step, n_devices=8)   # Share(cores=2, devices=8, workers=1, blas=1)
    with share.held():
        ...                                      # run the devices; cores.budget() is 1 in there
    cores.blas_description()                     # 'openblas 0.3.31 (SkylakeX kernels, pthreads), 2 threads'
"""

import copy
import os
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Share:
    """What each of `devices` threads running at once may use of `cores` cores."""
    cores: int
    devices: int
    workers: int         # worker threads per device, for steps that take them
    blas: int            # BLAS threads per product

    @property
    def at_once(self):
        """How many devices compute at a time: as many as the cores hold."""
        return max(1, min(self.devices, self.cores // (self.workers * self.blas)))

    @contextmanager
    def held(self):
        """Inside a `with` block: BLAS held to this share's threads, and a
        device's cores (workers x BLAS threads) the budget of any call made there."""
        entry = (object(), self.workers * self.blas)       # removed by identity below
        _HELD.append(entry)
        try:
            with blas_limit(self.blas):
                yield self
        finally:
            _HELD.remove(entry)

    @property
    def label(self):
        """What ran, as the trace and the tables print it."""
        return (f"{self.devices} device{'s' if self.devices > 1 else ''} on {self.cores} "
                f"core{'s' if self.cores > 1 else ''}: {self.blas} BLAS thread{'s' if self.blas > 1 else ''} "
                f"per product, {self.workers} worker{'s' if self.workers > 1 else ''} per device"
                + (f", {self.at_once} computing at once" if self.at_once < self.devices else ""))


def share(n_devices, *, takes_workers=True, threads=None, blas_threads=None, cores=None):
    """The budget's share of each of `n_devices` threads running at once (module
    docstring), for a step that takes worker threads or not. `cores`: the
    budget (None: `budget()`). `threads` (workers per device) and `blas_threads`
    choose otherwise, within the budget: a device's workers x BLAS threads
    never exceed it (with more devices than that, they take turns: `at_once`)."""
    for name, value in (("threads", threads), ("blas_threads", blas_threads)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int (threads per device) or None (the device's share "
                             f"of the cores), got {value!r}")
    cores = budget() if cores is None else cores
    each = max(1, cores // n_devices)
    blas = min(cores, blas_threads) if blas_threads is not None else None
    workers = (each if takes_workers else 1) if threads is None else threads
    if blas is None:
        blas = each if workers == 1 else 1
    workers = min(workers, max(1, cores // blas))
    return Share(cores=cores, devices=n_devices, workers=workers, blas=blas)


def for_devices(step, n_devices, *, threads=None, blas_threads=None, cores=None):
    """(`step` with its share of worker threads, the `Share`) for `n_devices`
    threads running it at once. `threads` above 1 needs a step that takes workers."""
    if threads is not None and threads != 1 and not step.takes_workers:
        raise ValueError(f"step {step.name!r} runs on its device's thread; threads={threads!r} applies to "
                         "steps that take workers (v3, v4, v5)")
    got = share(n_devices, takes_workers=step.takes_workers, threads=threads, blas_threads=blas_threads,
                cores=cores)
    if step.takes_workers and step.workers != got.workers:
        step = copy.copy(step)                 # the caller's step is left as it is
        step.workers = got.workers
    return step, got


def available_cores():
    """The cores this process may run on (its affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def budget():
    """The cores a call made now may use (module docstring): the share held
    around it (`Share.held`), else this process's cores capped by BLAS's
    thread count now, an outer limit of the caller's."""
    if _HELD:
        return _HELD[-1][1]
    count = blas_threads()
    return max(1, min(available_cores(), count)) if count else available_cores()


# -- holding BLAS's thread count -------------------------------------------------

_CONTROLLER = []        # threadpoolctl's view of the loaded libraries, made once
_HELD = []              # the budgets of the shares held now, innermost last (process-wide)


def _controller():
    if not _CONTROLLER:
        from threadpoolctl import ThreadpoolController
        _CONTROLLER.append(ThreadpoolController())
    return _CONTROLLER[0]


def blas_limit(n):
    """Hold BLAS to at most `n` threads inside a `with` block, never more than
    it has now (a limit inside another never raises the count)."""
    now = blas_threads()
    return _controller().limit(limits=min(n, now) if now else n, user_api="blas")


def blas_threads():
    """BLAS's thread count now (the first BLAS library's; None without one)."""
    libs = _controller().select(user_api="blas").lib_controllers
    return libs[0].num_threads if libs else None


def blas_info():
    """threadpoolctl's description of every BLAS library loaded (a list of dicts)."""
    return [lib.info() for lib in _controller().select(user_api="blas").lib_controllers]


def blas_description():
    """'openblas 0.3.31 (SkylakeX kernels, pthreads), 2 threads' for each BLAS loaded."""
    parts = []
    for info in blas_info():
        kernels = f"{info.get('architecture')} kernels, " if info.get("architecture") else ""
        parts.append(f"{info['internal_api']} {info['version']} ({kernels}{info.get('threading_layer', '?')}), "
                     f"{info['num_threads']} thread{'s' if info['num_threads'] != 1 else ''}")
    return "; ".join(parts) or "no BLAS library found by threadpoolctl"
