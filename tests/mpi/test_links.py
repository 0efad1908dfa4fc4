"""Links emulated on one machine (`mpi_impl.links`): each message waits for its link, and the trace's
bytes per link are the cost model's, byte for byte.

- a rank's messages on one link queue behind each other, each delivered a
  latency after its last byte left; its other link is its own (a fake clock);
- the hold sleeps in short naps until the delivery time, testing the other
  transfers between them;
- a RingComm's receiver holds each shift until the time its sender stamped on
  it, and the stamp is not counted as bytes moved (threads over `CheckingMPI`);
- on real MPI ranks, 4 as 2 emulated nodes of 2, every scheme the shapes allow
  (`reference.scheme_cost.candidates`) in every placement
  (`reference.topology.placements`), forward and backward: the trace's
  ``sent_intra`` and ``sent_inter`` equal `SchemeCost.link_bytes`, and the
  results the dense oracle's. One launch runs them all.

    .venv/bin/python -m pytest tests/mpi/test_links.py -q
"""

import functools
import json

import numpy as np
import pytest

from mpi_impl import comm as comm_module
from mpi_impl import links as links_module
from mpi_impl.comm import RingComm
from mpi_impl.links import EmulatedLinks, LinkView, hold_until
from reference import positions, ring, shard, steps
from reference.masks import CAUSAL
from reference.scheme_cost import candidates, predict_scheme
from reference.schemes import Scheme
from reference.topology import Link, Machine, placements
from strict_comm import CheckingMPI, run_threads
from test_mpi import MPIEXEC, WORKERS, mpirun

MACHINE = Machine(2, Link(1.0, 10.0), Link(0.5, 20.0))      # 1 GB/s + 10 us inside a node, 0.5 GB/s + 20 us between


class Clock:
    """time.monotonic and time.sleep of a fake clock: a sleep moves it on."""

    def __init__(self, now):
        self.now, self.naps = now, []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.naps.append(seconds)
        self.now += seconds


def test_a_links_messages_queue_behind_each_other_and_the_other_link_is_free(monkeypatch):
    clock = Clock(100.0)
    monkeypatch.setattr(links_module.time, "monotonic", clock.monotonic)
    rank0 = EmulatedLinks(MACHINE, 0)
    at = functools.partial(pytest.approx, abs=1e-9)         # a latency is microseconds: approx's 1e-6 of 100 s hides it
    assert rank0.post("intra", 10 ** 9) == at(101.0 + 10e-6)          # 1 s of bytes, then the latency
    assert rank0.post("intra", 10 ** 9) == at(102.0 + 10e-6)          # behind the first's bytes, not its latency
    assert rank0.post("inter", 10 ** 9) == at(102.0 + 20e-6)          # its own link: from now
    clock.now = 105.0
    assert rank0.post("intra", 5 * 10 ** 8) == at(105.5 + 10e-6)      # idle since 102: from now
    view = LinkView(rank0, peers=(3, 0, 1, 2), me=1)                             # a communicator of its own order
    assert [view.link(i) for i in range(4)] == ["inter", "intra", "intra", "inter"]


def test_the_hold_sleeps_in_short_naps_testing_between_them(monkeypatch):
    clock, tested = Clock(10.0), []
    monkeypatch.setattr(links_module.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(links_module.time, "sleep", clock.sleep)
    hold_until(10.0105, lambda: tested.append(clock.now))
    assert clock.now == pytest.approx(10.0105, abs=1e-9)                        # the last nap ends at the time
    assert max(clock.naps) <= links_module.HOLD_NAP_S and len(tested) == len(clock.naps)
    hold_until(5.0)                                                              # past: at once
    assert len(clock.naps) == len(tested)


def test_each_shift_is_held_until_its_senders_stamp(monkeypatch):
    """Rank j holds round t's block until the time rank j - 1 stamped when it
    posted it; the trace counts the block's bytes, not the stamp's, on the link
    it crossed."""
    n, S, Hkv, D = 4, 16, 2, 4
    posted, held = [], []
    real_post = EmulatedLinks.post

    def post(self, link, nbytes):
        when = real_post(self, link, nbytes)
        posted.append((self.rank, when))
        return when
    monkeypatch.setattr(EmulatedLinks, "post", post)
    monkeypatch.setattr(comm_module, "hold_until", lambda when, test=None: held.append(when))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, S, h, D)) for h in (4, Hkv, Hkv))
    pos = positions(S, n, "striped")
    qs, ks, vs = (shard(x, n, "striped") for x in (q, k, v))
    opts = dict(mask=CAUSAL, scale=D ** -0.5, tile_size=2, step=steps.get("v1"))

    def device(j, world):
        ring_comm = RingComm(CheckingMPI(j, world), links=LinkView(EmulatedLinks(MACHINE, j), tuple(range(n)), j))
        *_, log = ring.ring_forward(qs[j], ks[j], vs[j], pos[j], pos[j], ring_comm, **opts)
        ring_comm.close()
        return log

    logs = run_threads(n, device)
    assert sorted(held) == sorted(when for _, when in posted) and len(held) == n * (n - 1)
    want = predict_scheme(Scheme("ring", n, 1), S, "striped", B=1, Hq=4, Hkv=Hkv, D=D, dtype=np.float64,
                          tile_size=2).link_bytes(MACHINE)
    for j, log in enumerate(logs):
        for name in ("intra", "inter"):
            np.testing.assert_array_equal(getattr(log, f"sent_{name}"), want[name][:, j], err_msg=f"{name}, rank {j}")


pytestmark_mpi = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")
FAST = Machine(2, Link(1000.0), Link(100.0))        # fast enough that the holds cost nothing here
SHAPES = dict(S=32, Hq=8, Hkv=4, D=8, layout="zigzag", tile=4)


@pytestmark_mpi
def test_the_emulated_runs_bytes_per_link_are_the_models_for_every_scheme_and_placement(tmp_path):
    n = 4
    runs = [(s, p) for s in candidates(n, SHAPES["Hq"], SHAPES["Hkv"]) for p in placements(s, FAST)]
    assert len(runs) >= 6                           # ring, all-gather, USP twice, Ulysses, the double ring
    spec = dict(ranks_per_node=FAST.ranks_per_node, intra=FAST.intra.gbs, inter=FAST.inter.gbs, **SHAPES,
                runs=[(s.describe(), p.name) for s, p in runs])
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc, _ = mpirun(n, str(WORKERS / "links_worker.py"), str(tmp_path / "spec.json"), str(tmp_path / "out.npz"))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    got = np.load(tmp_path / "out.npz")
    shape = dict(B=1, Hq=SHAPES["Hq"], Hkv=SHAPES["Hkv"], D=SHAPES["D"], dtype=np.float64, tile_size=SHAPES["tile"])
    for i, (scheme, where) in enumerate(runs):
        assert got[f"{i}/error"] < 1e-10, (scheme.label, where.name)
        for kind in ("forward", "backward"):
            cost = predict_scheme(scheme, SHAPES["S"], SHAPES["layout"], backward=kind == "backward", **shape)
            on = cost.link_bytes(FAST, where)
            for name in ("intra", "inter"):
                np.testing.assert_array_equal(got[f"{i}/{kind}/sent_{name}"], on[name],
                                              err_msg=f"{scheme.label} {where.name} {kind} {name}")
            assert on["inter"].sum() > 0 and on["intra"].sum() > 0, (scheme.label, where.name, kind)
