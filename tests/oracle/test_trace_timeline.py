"""The trace's timeline read back: a wait split by what was missing
(`reference.trace.wait_parts`), and the timeline picture drawn from it
(`reference.plot`), on hand-made traces whose answers are known."""

import numpy as np
import pytest

from reference.trace import Trace, wait_parts


def three_ranks():
    """Rank 0 finishes round 0 at 0.1 s and waits until 0.4 s for the block of
    rank 2 (its sender), which started round 0 only at 0.3 s: 0.2 s not yet
    sent, then 0.1 s arriving. Rank 1 waits 0.05 s for rank 0's block, sent at 0."""
    z = np.zeros((3, 3))
    start = np.array([[0.0, 0.0, 0.3], [0.4, 0.2, 0.5], [0.6, 0.6, 0.7]])     # [t, j]
    compute = np.full((3, 3), 0.1)
    wait = np.zeros((3, 3))
    wait[0, 0], wait[0, 1] = 0.3, 0.05
    arrived = np.where(np.arange(3)[:, None] < 2, start + compute + wait, np.nan)
    return Trace(source=z, tiles_computed=z, tiles_skipped=z, pairs=z, bytes_sent=z, compute_s=compute,
                 compute_cpu_s=compute, wait_s=wait, start_s=start, arrived_s=arrived)


def test_a_wait_splits_into_not_yet_sent_and_arriving():
    not_sent, in_flight = wait_parts(three_ranks())
    assert not_sent[0, 0] == pytest.approx(0.2) and in_flight[0, 0] == pytest.approx(0.1)
    assert not_sent[0, 1] == 0 and in_flight[0, 1] == pytest.approx(0.05)     # its sender started first
    assert np.allclose(not_sent + in_flight, three_ranks().wait_s)
    assert (not_sent[1:] == 0).all() and (in_flight[1:] == 0).all()


def test_a_trace_without_a_timeline_has_none_to_split():
    trace = three_ranks()
    trace.start_s = np.full((3, 3), np.nan)
    assert np.isnan(wait_parts(trace)[0]).all()


@pytest.mark.parametrize("timed", [True, False])
def test_the_timeline_draws_what_the_trace_holds(timed):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from reference.plot import NOT_SENT, timeline_figure
    trace = three_ranks()
    if not timed:
        trace.start_s = np.full((3, 3), np.nan)
    fig = timeline_figure(plt, {"striped": {"forward": trace}})
    ax = fig.axes[0]
    red = [p for p in ax.patches if p.get_facecolor()[:3] == matplotlib.colors.to_rgb(NOT_SENT) and p.get_width()]
    labels = [text.get_text() for text in ax.texts]
    left, right = ax.get_xlim()
    ends = [p.get_x() + p.get_width() for p in ax.patches]
    plt.close(fig)
    assert left <= 0 and max(ends) < right                             # the last bar is not clipped
    assert labels == [str(t) for j in range(3) for t in range(3)]        # every step, its round written in it
    if timed:
        assert [(p.get_x(), p.get_width()) for p in red] == [pytest.approx((0.1, 0.2))]
        assert ax.get_xlabel() == "seconds since the ring began"
    else:
        assert not red
