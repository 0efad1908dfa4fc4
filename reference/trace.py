"""The trace: what every device did in every round, as arrays indexed [t, j].

Fields (all shape (N rounds, N devices)):
  source          the device the K/V block held in round t started on
  tiles_computed  tiles attended to (full or masked)
  tiles_skipped   tiles skipped because no query in them can see any key
  pairs           visible (query, key) pairs, per batch element and head
  bytes_sent      bytes this device put on the ring in round t
  compute_s, compute_cpu_s, wait_s   wall and CPU seconds of the step, and wall
                  seconds spent waiting for a transfer (zero where not timed)
and `step`, the step version that ran (e.g. "v3, 2 workers"), and `threads`, how
the virtual devices shared the cores (`reference.cores`; empty elsewhere).

`Trace.table()` prints the per-device work; `Trace.from_logs` builds one from
the per-device `RoundLog`s that `reference.ring` returns.
"""

from dataclasses import dataclass

import numpy as np

from .ring import RoundLog


@dataclass
class Trace:
    source: np.ndarray
    tiles_computed: np.ndarray
    tiles_skipped: np.ndarray
    pairs: np.ndarray
    bytes_sent: np.ndarray
    compute_s: np.ndarray
    compute_cpu_s: np.ndarray
    wait_s: np.ndarray
    step: str = ""
    threads: str = ""

    @classmethod
    def from_logs(cls, logs, threads=""):
        """One RoundLog per device (in rank order) -> Trace with [t, j] arrays."""
        return cls(**{name: np.stack([getattr(log, name) for log in logs], axis=1)
                      for name in RoundLog.FIELDS}, step=logs[0].step, threads=threads)

    @classmethod
    def from_dict(cls, d):
        return cls(**{name: np.asarray(d[name]) for name in RoundLog.FIELDS}, step=d.get("step", ""),
                   threads=d.get("threads", ""))

    def to_dict(self):
        return {**{name: getattr(self, name).tolist() for name in RoundLog.FIELDS}, "step": self.step,
                "threads": self.threads}

    @property
    def n_devices(self):
        return self.pairs.shape[1]

    def critical_path(self, field="pairs"):
        """Sum over rounds of the busiest device's `field`."""
        return getattr(self, field).max(axis=1).sum()

    def table(self, title=""):
        return work_table(self.pairs, self.tiles_computed, self.tiles_skipped, self.source, title)


def work_table(pairs, computed, skipped, source=None, title=""):
    """Per round and device: visible pairs, and tiles computed / total.

    round |  dev0         dev1        ... | busiest  idlest
    """
    n_rounds, n = pairs.shape
    width = max(12, len(f"{pairs.max()} {computed.max()}/{(computed + skipped).max()}") + 2)
    head = f"{'round':>5} | " + "".join(f"{'dev%d' % j:<{width}}" for j in range(n)) + "| busiest  idlest"
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    for t in range(n_rounds):
        cells = "".join(f"{f'{pairs[t, j]} {computed[t, j]}/{computed[t, j] + skipped[t, j]}':<{width}}"
                        for j in range(n))
        lines.append(f"{t:>5} | {cells}| {pairs[t].max():>7}  {pairs[t].min():>6}")
    lines.append(f"critical path (sum of busiest): {pairs.max(axis=1).sum()} pairs, "
                 f"{computed.max(axis=1).sum()} tiles; total work {pairs.sum()} pairs")
    if source is not None:
        lines.append("cells: visible pairs, tiles computed/total; "
                     f"round 1 sources: {source[min(1, n_rounds - 1)].tolist()}")
    return "\n".join(lines)
