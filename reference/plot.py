"""Pictures of traces: where each device's time went, round after round.

`plot_timeline` draws, for each layout, one line per device: each round's
step (coloured, forward then backward, its round number written in it) and
the wait for the next block, from a run's `reference.trace.Trace`s. Where the
trace holds the timeline (start_s: MPI ranks start their clocks together),
the bars stand at the times they happened, and a forward pass's waits are
split (`reference.trace.wait_parts`): waiting for a block its sender had not
yet sent (red), and for a transfer still arriving (grey); a black tick marks
when the block arrived. A backward pass's waits (for K, V or for dK, dV) and
those of a trace without the timeline stay whole (light grey); without it, the
rounds are laid end to end. A balanced layout ends its lines together; an
unbalanced one leaves some devices waiting.

    mpiexec -n 2 python -m mpi4py -m mpi_impl --seq-len 8192 --backward --plot timeline.png
    plot_timeline("timeline.png", {"striped": {"forward": trace}}, "S=8192, N=2")

matplotlib is imported when a picture is drawn, so the reference needs it only then.
"""

import numpy as np

from .trace import wait_parts

COLOURS = {"forward": "tab:blue", "backward": "tab:orange"}
NOT_SENT, IN_FLIGHT, WAIT = "tab:red", "0.75", "0.88"


def plot_timeline(path, traces, title=""):
    """One panel per layout, one line per device, written to `path` (PNG).
    `traces`: {layout: {"forward": Trace, "backward": Trace (optional)}}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = timeline_figure(plt, traces, title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline_figure(plt, traces, title=""):
    """The figure `plot_timeline` writes, drawn with `plt` (matplotlib.pyplot)."""
    n = next(iter(traces.values()))["forward"].n_devices
    fig, axes = plt.subplots(len(traces), 1, figsize=(10, 1.6 + 0.45 * n * len(traces)), sharex=True,
                             squeeze=False, layout="constrained")
    timed = True
    for ax, (layout, passes) in zip(axes[:, 0], traces.items()):
        timed &= draw_rounds(ax, list(passes.items()))
        ax.set_ylabel(layout)
    right = max(ax.dataLim.x1 for ax in axes[:, 0])     # a bar's sticky edge would clip the last bar
    axes[0, 0].set_xlim(0, 1.02 * right)
    axes[-1, 0].set_xlabel("seconds since the ring began" if timed else
                           "seconds (per device: compute, then wait, round after round)")
    axes[0, 0].set_title(title)
    handles, labels = [], []
    for ax in axes[:, 0]:               # each kind of bar once, whichever panel drew it
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle), labels.append(label)
    fig.legend(handles, labels, loc="outside lower center", ncols=3, fontsize="small")     # under the panels
    return fig


def draw_rounds(ax, passes):
    """On `ax`, per device j, every round t of every pass, [(name, Trace), ...]:
    the step (compute_s[t, j], labelled t) then the wait (wait_s[t, j]), as
    horizontal bars; at start_s where every pass recorded it (a later pass
    after the end of the one before), else end to end. True if timed."""
    n = passes[0][1].n_devices
    timed = all(np.isfinite(tr.start_s).all() for _, tr in passes)
    seen = set()

    def bar(j, width, left, colour, label, **kw):
        ax.barh(j, width, left=left, color=colour, label=None if label in seen else label, **kw)
        seen.add(label)

    offset = 0.0
    for kind, tr in passes:
        split = timed and kind == "forward"          # a backward's waits mix K, V with dK, dV
        not_sent, in_flight = wait_parts(tr) if split else (np.zeros_like(tr.wait_s), tr.wait_s)
        starts = tr.start_s if timed else np.cumsum(tr.compute_s + tr.wait_s, axis=0) - tr.compute_s - tr.wait_s
        wide = 0.02 * (starts + tr.compute_s + tr.wait_s).max()      # a bar wide enough for its round number
        for j in range(n):
            for t in range(tr.compute_s.shape[0]):
                x, c = offset + starts[t, j], tr.compute_s[t, j]
                bar(j, c, x, COLOURS[kind], f"{kind} compute (round t)", edgecolor="white", linewidth=0.5)
                if c > wide:
                    ax.text(x + c / 2, j, str(t), ha="center", va="center", fontsize=7, color="white")
                bar(j, not_sent[t, j], x + c, NOT_SENT, "waiting for a block not yet sent")
                bar(j, in_flight[t, j], x + c + not_sent[t, j], IN_FLIGHT if split else WAIT,
                    "waiting for a transfer to arrive" if split else f"{kind}: waiting for a block")
                if timed and np.isfinite(tr.arrived_s[t, j]):
                    ax.plot([offset + tr.arrived_s[t, j]] * 2, [j - 0.4, j + 0.4], "k-", lw=0.8,
                            label=None if "arrived" in seen else "block arrived")
                    seen.add("arrived")
        offset += (starts + tr.compute_s + tr.wait_s).max()
    ax.set_yticks(range(n), [f"rank {j}" for j in range(n)])
    ax.invert_yaxis()
    return timed
