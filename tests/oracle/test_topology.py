"""The cost model on a machine of nodes (`reference.topology`), held to times
worked out by hand:

- each message is charged to the link it crosses as the placement puts its two
  ranks: USP's all-to-all on the link inside a node and its ring between nodes
  (in-order), or the other way round (ring-in-nodes);
- a link's latency counts once per round in which it carries bytes;
- a message is charged in the round it travels: the ring's backward sends each
  dK, dV after a round's compute, so it travels in the next round, and every
  byte is paid once;
- the compute side is a FLOP/s rate or an object that says each round's and
  device's seconds; `choose` picks the placement as well as the scheme.

    .venv/bin/python -m pytest tests/oracle/test_topology.py -q
"""

import argparse

import numpy as np
import pytest

from reference import scheme_cost, topology
from reference.schemes import Scheme
from reference.topology import Link, Machine, Placement

SHAPE = dict(B=1, Hq=4, Hkv=4, D=16, tile_size=16)
FREE, SLOW = Link(float("inf")), Link(1e-9)          # no time at all; 1 byte a second
NO_COMPUTE = 1e30                                     # FLOP/s: compute takes nothing


def block_bytes(tokens, Hkv=4, D=16, itemsize=4):
    """One K/V block on the wire (reference/scheme_cost.py's docstring): K and V, positions, owner."""
    return 2 * Hkv * tokens * D * itemsize + 8 * tokens + 8


def usp_forward():
    """USP, u = 2, on 4 devices of S = 256 (c = 64): its forward, its two
    all-to-alls' bytes per device, and its ring's one block."""
    scheme = Scheme.checked("usp", 2, n_devices=4, Hq=4, Hkv=4)
    c, e = 64, 4
    trade_in = (c * 4 * 16 + 2 * c * 4 * 16) * e // 2           # (u - 1) / u of q, k, v
    trade_out = (c * 4 * 16 * e + 4 * c * 4) // 2               # of out and lse (float32)
    return scheme, scheme_cost.predict_scheme(scheme, 256, "striped", **SHAPE), trade_in + trade_out, \
        block_bytes(2 * c, Hkv=2)


def test_each_message_is_charged_to_the_link_its_placed_ranks_cross():
    scheme, fwd, trades, block = usp_forward()
    fast_inside, slow_inside = Machine(2, FREE, SLOW), Machine(2, SLOW, FREE)
    inside, across = topology.placements(scheme, fast_inside)
    assert (inside.name, across.name) == ("in-order", "ring-in-nodes") and across.order == (0, 2, 1, 3)
    assert fwd.seconds(fast_inside, NO_COMPUTE, inside) == pytest.approx(block)       # the ring between nodes
    assert fwd.seconds(fast_inside, NO_COMPUTE, across) == pytest.approx(trades)      # the all-to-alls between
    assert fwd.seconds(slow_inside, NO_COMPUTE, inside) == pytest.approx(trades)
    assert fwd.seconds(slow_inside, NO_COMPUTE, across) == pytest.approx(block)
    for machine, place in ((fast_inside, inside), (fast_inside, across)):
        on = fwd.link_bytes(machine, place)
        np.testing.assert_array_equal(on["intra"] + on["inter"], fwd.bytes_sent)
    assert fwd.link_bytes(Machine(4, SLOW, SLOW))["inter"].sum() == 0                  # one node: all inside


def test_a_latency_counts_once_in_each_round_its_link_carries_bytes():
    """A link of no bandwidth cost and 1 s of latency: in-order, one round ships
    the ring's block between nodes (the last ships nothing); ring-in-nodes, both
    rounds trade over it (the all-to-all before the first and after the last)."""
    scheme, fwd, _, _ = usp_forward()
    machine = Machine(2, FREE, Link(float("inf"), latency_us=1e6))
    inside, across = topology.placements(scheme, machine)
    assert fwd.seconds(machine, NO_COMPUTE, inside) == pytest.approx(1.0)
    assert fwd.seconds(machine, NO_COMPUTE, across) == pytest.approx(2.0)


@pytest.mark.parametrize("name, u, backward, want", [
    ("ring", None, False, 3.0), ("ring", None, True, 5.0),             # a round's queue pays it once; the hop home after
    ("all_gather", None, True, 6.0),                                   # gather shifts, then reduce-scatter shifts
    ("ulysses", None, False, 2.0), ("ulysses", None, True, 2.0),       # two trades, pieces to all peers at once
])
def test_exposed_shifts_to_one_peer_each_pay_the_latency(name, u, backward, want):
    """1 s of latency and no bandwidth cost: the latencies a pass pays."""
    scheme = Scheme.checked(name, u, n_devices=4, Hq=4, Hkv=4)
    cost = scheme_cost.predict_scheme(scheme, 256, "striped", backward=backward, **SHAPE)
    assert cost.seconds(Machine(1, FREE, Link(float("inf"), latency_us=1e6)), NO_COMPUTE) == pytest.approx(want)


def test_the_rings_backward_pays_each_dk_dv_once_in_the_round_it_travels():
    """N = 4 rounds over one slow link, no compute: the blocks of rounds 0..2 and
    the four dK, dV hops (the last one home), each once: 3 blocks + 4 dK, dV."""
    ring = Scheme.checked("ring", None, n_devices=4, Hq=4, Hkv=4)
    bwd = scheme_cost.predict_scheme(ring, 256, "striped", backward=True, **SHAPE)
    block, dkv = block_bytes(64), 2 * 4 * 64 * 16 * 4
    assert bwd.seconds(1.0, NO_COMPUTE) == pytest.approx(3 * block + 4 * dkv)
    assert bwd.bytes_sent.sum(axis=0).tolist() == [3 * block + 4 * dkv] * 4     # what the trace counts, by round sent


class EachRound:
    """Compute of `seconds` in every round on every device."""

    def __init__(self, seconds):
        self.each = seconds

    def seconds(self, cost):
        return np.full(cost.kv_bytes.shape, self.each)


@pytest.mark.parametrize("round_s, want", [(1.0, 2 * 1.0 + 5.0), (4.0, 4 * 4.0)])
def test_the_double_rings_outer_block_travels_through_its_steps_rounds(round_s, want):
    """Two nodes of two, the link between them taking 5 s for the outer block,
    posted at the first round of the step and needed after the second: the two
    rounds share its time (a round of 1 s: 2 s of rounds, the block 3 s
    later), and rounds of 4 s hide it."""
    scheme = Scheme.checked("double_ring", n_devices=4, Hq=4, Hkv=4, ring_inner=2)
    fwd = scheme_cost.predict_scheme(scheme, 256, "striped", **SHAPE)
    between = Link(block_bytes(64) / 5.0 / topology.GB)
    assert fwd.seconds(Machine(2, FREE, between), EachRound(round_s)) == pytest.approx(want)


@pytest.mark.parametrize("name, w", [("ring", None), ("double_ring", 2)])
def test_the_hop_home_follows_all_the_compute(name, w):
    """Rounds of 10 s hide every shift but the last dK, dV hop home, sent when
    no compute is left: 1 s more, on the link between nodes or inside one."""
    scheme = Scheme.checked(name, n_devices=4, Hq=4, Hkv=4, ring_inner=w)
    bwd = scheme_cost.predict_scheme(scheme, 256, "striped", backward=True, **SHAPE)
    dkv = 2 * 4 * 64 * 16 * 4
    link = Link(dkv / topology.GB)
    assert bwd.seconds(Machine(2, link, link), EachRound(10.0)) == pytest.approx(4 * 10.0 + 1.0)


def test_the_hop_home_and_the_all_to_all_after_it_go_one_after_the_other():
    """USP (u = 2) in order on 2 nodes of 2, no bandwidth cost, 1 s of latency
    inside a node and 10 s between: round 0 trades (1 s) before its block
    crosses (10 s); round 1's dK, dV cross (10 s) while it computes nothing,
    then its hop home (10 s), then the trade inside the node (1 s): 32 s, on
    two links that a pass uses one after the other."""
    scheme = Scheme.checked("usp", 2, n_devices=4, Hq=4, Hkv=4)
    bwd = scheme_cost.predict_scheme(scheme, 256, "striped", backward=True, **SHAPE)
    machine = Machine(2, Link(float("inf"), latency_us=1e6), Link(float("inf"), latency_us=1e7))
    assert bwd.round_seconds(machine, NO_COMPUTE).tolist() == pytest.approx([11.0, 21.0])



def test_a_round_lasts_what_its_busiest_device_does_not_the_worst_of_each_apart():
    """The ring's backward on nodes of 3 (ranks 0..2, and 3), 1 s of latency
    between nodes: ranks 3, 0 and 2 move bytes across in every round, and in
    the last their hop home after it (1 s + 1 s); rank 1 moves inside its node
    only and computes 10 s a round. Each round lasts 10 s: no device is busy
    for rank 1's compute and rank 0's exposed hop together."""
    ring = Scheme.checked("ring", None, n_devices=4, Hq=4, Hkv=4)
    bwd = scheme_cost.predict_scheme(ring, 256, "striped", backward=True, **SHAPE)
    machine = Machine(3, FREE, Link(float("inf"), latency_us=1e6))
    assert bwd.round_seconds(machine, NO_COMPUTE).tolist() == pytest.approx([1.0, 1.0, 1.0, 2.0])

    class RankOneComputes:
        def seconds(self, cost):
            return np.broadcast_to([0.0, 10.0, 0.0, 0.0], cost.kv_bytes.shape)
    assert bwd.round_seconds(machine, RankOneComputes()).tolist() == pytest.approx([10.0] * 4)

def test_compute_is_a_rate_or_an_object_that_says_each_rounds_seconds():
    ring = Scheme.checked("ring", None, n_devices=4, Hq=4, Hkv=4)
    fwd = scheme_cost.predict_scheme(ring, 256, "striped", **SHAPE)

    class Measured:
        def __init__(self, shape):
            self.shape = shape

        def seconds(self, cost):
            return np.full(self.shape, 2.0)

    assert fwd.seconds(float("inf"), Measured((4, 4))) == 4 * 2.0
    with pytest.raises(ValueError, match=r"must be \(rounds, devices\) \(4, 4\), got \(4,\)"):
        fwd.seconds(float("inf"), Measured((4,)))
    assert fwd.seconds(float("inf"), 1e9) == fwd.seconds(float("inf"), scheme_cost.FlopRate(1e9))


def test_choose_picks_the_placement_whose_slow_link_carries_less():
    """USP's forward: its two trades move 33,280 bytes a device, its ring's block
    33,800: the slower link gets the trades."""
    scheme, fwd, trades, block = usp_forward()
    assert trades < block
    for machine, want in ((Machine(2, FREE, SLOW), "ring-in-nodes"), (Machine(2, SLOW, FREE), "in-order")):
        costs = scheme_cost.placed({scheme: (fwd,)}, machine)
        best, where = scheme_cost.choose(costs, machine, NO_COMPUTE)
        assert (best, where.name) == (scheme, want)


def test_placements_are_the_ones_that_differ():
    fast_inside = Machine(2, FREE, SLOW)
    usp = Scheme.checked("usp", 2, n_devices=4, Hq=4, Hkv=4)
    for scheme in (Scheme("ring", 4, 1), Scheme("all_gather", 4, 1), Scheme("ulysses", 4, 4)):
        assert [p.name for p in topology.placements(scheme, fast_inside)] == ["in-order"]
    for machine in (Machine(4, FREE, SLOW), Machine(2, SLOW, SLOW), Machine.one_link(1e9)):   # one node; equal links
        assert [p.name for p in topology.placements(usp, machine)] == ["in-order"]
    with pytest.raises(ValueError, match="is not one of usp .u=2.'s on one link of 1 GB/s: in-order"):
        topology.placement(usp, Machine.one_link(1e9), "ring-in-nodes")
    _, fwd, _, _ = usp_forward()
    with pytest.raises(ValueError, match=r"each once, got \[0, 0, 1, 2\]"):
        fwd.seconds(fast_inside, 1e9, Placement("mine", (0, 0, 1, 2)))



def test_ring_in_nodes_puts_each_ring_group_on_one_nodes_ranks_in_ring_order():
    """USP u = 2 on 2 nodes of 4: ring groups (0, 2, 4, 6) and (1, 3, 5, 7) on
    machine ranks 0..3 and 4..7 in ring order, each Ulysses pair across the
    nodes (on 4 ranks the order is its own inverse; on 8 it is not)."""
    usp = Scheme.checked("usp", 2, n_devices=8, Hq=8, Hkv=8)
    across = topology.placement(usp, Machine(4, FREE, SLOW), "ring-in-nodes")
    assert across.order == (0, 4, 1, 5, 2, 6, 3, 7)
    for g in range(8):
        assert [across.order[h] for h in usp.ring_group(g)] == list(range(g % 2 * 4, g % 2 * 4 + 4))
        assert {across.order[h] // 4 for h in usp.ulysses_group(g)} == {0, 1}

@pytest.mark.parametrize("make, words", [
    (lambda: Link(0.0), "bandwidth must be a number of GB/s above 0"),
    (lambda: Link(float("nan")), "bandwidth must be"),
    (lambda: Link(1.0, -1.0), "latency must be a finite number of microseconds"),
    (lambda: Machine(0, FREE, FREE), "ranks_per_node must be a positive int, got 0"),
    (lambda: Machine(2, 1.0, FREE), "intra must be a reference.topology.Link, got float"),
    (lambda: Machine.one_link(0), "link_bytes_per_s must be a number above 0"),
])
def test_a_bad_machine_is_refused_naming_what(make, words):
    with pytest.raises((ValueError, TypeError), match=words):
        make()


def test_a_named_machine_takes_the_options_that_change_it():
    args = argparse.Namespace(machine="h100-ndr", ranks_per_node=None, intra=None, inter=25.0,
                              intra_latency_us=None, inter_latency_us=None)
    machine = topology.machine_of(args)
    assert machine.inter == Link(25.0, 5.0) and machine.intra == topology.MACHINES["h100-ndr"].intra
    assert machine.ranks_per_node == 8 and machine.name == "h100-ndr, changed"
    args.machine = None
    with pytest.raises(ValueError, match="give --ranks-per-node, --intra too"):
        topology.machine_of(args)


def test_the_commands_tabulate_each_placement_and_name_the_one_chosen(capsys):
    """`python -m reference.cost` on nodes: a row per scheme and placement, the
    bytes over each link, and the choice with its placement; `mpi_impl`'s
    choice line on emulated nodes says so and names the placements."""
    from mpi_impl import cli, scheme_args
    from reference import cost
    cost.main(["--scheme", "all", "--n-devices", "4", "--seq-len", "1024", "--kv-heads", "4", "--ranks-per-node", "2",
               "--intra", "450", "--inter", "0.5"])
    lines = capsys.readouterr().out.splitlines()
    assert "2 nodes of 2 ranks, intra 450 GB/s, inter 0.5 GB/s" in lines[0]
    rows = [line.split()[:4] for line in lines[3:-1]]
    assert rows == [["ring", "1", "-", "in-order"], ["all_gather", "1", "-", "in-order"], ["usp", "2", "-", "in-order"],
                    ["usp", "2", "-", "ring-in-nodes"], ["ulysses", "4", "-", "in-order"],
                    ["double_ring", "1", "2", "in-order"]]
    seconds = {tuple(row): sum(map(float, line.split()[-2:])) for row, line in zip(rows, lines[3:-1])}
    assert seconds["usp", "2", "-", "in-order"] < seconds["usp", "2", "-", "ring-in-nodes"]   # all-to-all on the fast link
    assert lines[-1].startswith("choice: double_ring (ring_inner=2), in-order")  # the slow link's bytes overlapped
    args = cli.build_parser().parse_args(["--seq-len", "256", "--heads", "4", "--head-dim", "16", "--ranks-per-node",
                                          "2", "--intra", "1", "--inter", "0.1"])
    line = scheme_args.choice_line(args, 4, "striped", cli.mask_options(args), 1e9)
    assert "emulated 2 nodes of 2 ranks, intra 1 GB/s, inter 0.1 GB/s, this run placed in-order" in line
    assert "usp (u=2) in-order" in line and "usp (u=2) ring-in-nodes" in line and "ulysses (u=4) " in line
