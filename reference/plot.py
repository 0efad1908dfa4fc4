"""Pictures of traces: where each device's time went, round after round.

`plot_timeline` draws, for each layout, one line per device: each round's
step (coloured, forward then backward) and the wait for the next block (grey)
laid end to end, from a run's `reference.trace.Trace`s. A balanced layout
ends its lines together; an unbalanced one leaves some devices waiting.

    mpiexec -n 2 python -m mpi4py -m mpi_impl --seq-len 8192 --backward --plot timeline.png
    plot_timeline("timeline.png", {"striped": {"forward": trace}}, "S=8192, N=2")

matplotlib is imported when a picture is drawn, so the reference needs it only then.
"""

COLOURS = {"forward": "tab:blue", "backward": "tab:orange"}


def plot_timeline(path, traces, title=""):
    """One panel per layout, one line per device, written to `path` (PNG).
    `traces`: {layout: {"forward": Trace, "backward": Trace (optional)}}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = next(iter(traces.values()))["forward"].n_devices
    fig, axes = plt.subplots(len(traces), 1, figsize=(10, 1.2 + 0.45 * n * len(traces)), sharex=True,
                             squeeze=False)
    for ax, (layout, passes) in zip(axes[:, 0], traces.items()):
        draw_rounds(ax, list(passes.items()))
        ax.set_ylabel(layout)
    axes[-1, 0].set_xlabel("seconds (per device: compute, then wait, round after round)")
    axes[0, 0].set_title(title)
    axes[0, 0].legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_rounds(ax, passes):
    """On `ax`, per device j: compute_s[t, j] then wait_s[t, j] for every round
    of every pass, [(name, Trace), ...], as horizontal bars."""
    n = passes[0][1].n_devices
    for j in range(n):
        x = 0.0
        for kind, tr in passes:
            for t in range(tr.compute_s.shape[0]):
                c, w = tr.compute_s[t, j], tr.wait_s[t, j]
                ax.barh(j, c, left=x, color=COLOURS[kind], edgecolor="white", linewidth=0.5,
                        label=f"{kind} compute" if (j, t) == (0, 0) else None)
                first = (j, t, kind) == (0, 0, "forward")
                ax.barh(j, w, left=x + c, color="0.75", label="wait" if first else None)
                x += c + w
    ax.set_yticks(range(n), [f"rank {j}" for j in range(n)])
    ax.invert_yaxis()
