"""The five schemes on virtual devices (`reference.schemes`): the ring, the
all-gather, Ulysses, USP and the double ring, each pointed at by the kit as a
user would point it at anyone's ring, against the float64 oracle on every
layout, mask, dtype and GQA shape it draws (Ulysses and USP with fewer K/V
heads than their degree too, MQA included); the kit catching planted bugs with
the smallest case: a Ulysses dealing heads in the wrong order after the
all-to-all, a USP with its ring and Ulysses groups swapped, a Ulysses whose
copies of a K/V head keep their own dK, dV, and a double ring sending on its
outer ring the block of the step's last inner round instead of its first; and
bad input refused before any work. MPI ranks run the same schemes in
tests/mpi/test_backends.py.

    .venv/bin/python -m pytest tests/oracle/test_schemes.py -q
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.virtual
from reference import double_ring, ring_attention, ring_attention_backward, schemes
from reference.cost import candidates, choose, predict_scheme
from reference.testing import VirtualRingAdapter, check_ring_attention
from reference.testing import MASKS, cases
from reference.testing.check import check_adapter, make_plan


def double_ring_on(w, world_sizes):
    adapter = VirtualRingAdapter("double_ring", ring_inner=w)
    adapter.world_sizes = world_sizes
    return adapter


# the double ring on two and three groups of two, on one group (N = 2), and on its outer ring alone (w = 1)
ADAPTERS = [VirtualRingAdapter(), VirtualRingAdapter("all_gather"), VirtualRingAdapter("ulysses"),
            VirtualRingAdapter("usp", ulysses_degree=2), double_ring_on(2, (2, 4, 6)), double_ring_on(1, (1, 3))]


def drawn(adapter):
    return cases(devices=adapter.world_sizes, masks=MASKS, head_multiple=adapter.head_multiple,
                 replicates_kv_heads=adapter.replicates_kv_heads, keep=lambda case: not adapter.supports(case))


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda a: a.scheme + (f"-{a.ring_inner}" if a.ring_inner else ""))
def test_each_scheme_agrees_with_the_oracle(adapter):
    @settings(max_examples=40, deadline=None)
    @given(case=drawn(adapter))
    def agrees(case):
        check_ring_attention(adapter, case)
    agrees()


def test_ulysses_spreads_whole_heads_and_usp_deals_the_ring_tokens():
    """Positions: Ulysses holds contiguous tokens whatever the layout (its
    ring has one rank); USP u=2 on 4 devices stripes over its two ring ranks."""
    ulysses, usp = schemes.Scheme("ulysses", 4, 4), schemes.Scheme("usp", 4, 2)
    assert ulysses.positions(8, "striped").tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert usp.positions(8, "striped").tolist() == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert usp.ring_group(1) == (1, 3) and usp.ulysses_group(3) == (2, 3)


def test_the_double_ring_deals_as_the_ring_and_meets_every_block_once():
    """Its tokens are the ring's; rank (o, i) meets its group's blocks first,
    then those of the groups before it; its three rings' next ranks are
    (o, i + 1), (o + 1, i) and (o + 1, i + 1)."""
    plan = schemes.Scheme.checked("double_ring", n_devices=6, Hq=2, Hkv=2, ring_inner=3)
    assert np.array_equal(plan.positions(12, "zigzag"), reference.positions(12, 6, "zigzag"))
    assert plan.sources().tolist() == [[0, 1, 2, 3, 4, 5], [2, 0, 1, 5, 3, 4], [1, 2, 0, 4, 5, 3],
                                       [3, 4, 5, 0, 1, 2], [5, 3, 4, 2, 0, 1], [4, 5, 3, 1, 2, 0]]
    assert sorted(plan.sources()[:, 4]) == list(range(6))
    inner, outer, home = plan.double_ring_groups(4)                       # rank 4 is (1, 1)
    assert (inner, outer, home) == ((3, 4, 5), (1, 4), (0, 4, 2, 3, 1, 5))
    assert [m[(m.index(4) + 1) % len(m)] for m in (inner, outer, home)] == [5, 1, 2]


class HeadsReversed(VirtualRingAdapter):
    """Ulysses whose all-to-all deals group rank i the heads of piece u-1-i."""

    def __init__(self):
        super().__init__("ulysses")
        self.name = "planted: Ulysses heads in the wrong order"

    def run(self, case, shards):
        real = schemes.to_heads

        def to_heads(a2a, arrays, **axes):
            return real(Reversed(a2a), arrays, **axes)
        schemes.to_heads = to_heads
        try:
            return super().run(case, shards)
        finally:
            schemes.to_heads = real


class Reversed:
    """A Ulysses group whose all-to-all sends piece u-1-i to group rank i."""

    def __init__(self, a2a):
        self.a2a, self.rank, self.size = a2a, a2a.rank, a2a.size

    def all_to_all(self, pieces):
        return self.a2a.all_to_all(pieces[::-1])


class GroupsSwapped(VirtualRingAdapter):
    """USP whose devices talk over their Ulysses group as the ring and over the
    ring group as the Ulysses group, while the tokens are dealt as for the right
    groups (a communicator split the wrong way round)."""

    def __init__(self):
        super().__init__("usp", ulysses_degree=2)
        self.name = "planted: USP groups swapped"

    def run(self, case, shards):
        real = schemes.Comms
        schemes.Comms = lambda ring, ulysses: real(ulysses, ring)
        try:
            return super().run(case, shards)
        finally:
            schemes.Comms = real


class CopiesNotSummed(VirtualRingAdapter):
    """Ulysses that copies a K/V head to the ranks reading it, and returns one
    copy's dK, dV instead of their sum."""

    def __init__(self):
        super().__init__("ulysses")
        self.name = "planted: a K/V head's copies' dK, dV not summed back"

    def run(self, case, shards):
        real = schemes.sum_copies
        schemes.sum_copies = lambda x, copies: x[:, :, ::copies]
        try:
            return super().run(case, shards)
        finally:
            schemes.sum_copies = real


class OuterBlockLate(double_ring.DoubleRing):
    """A double ring that sends on its outer ring the block of the step's last
    inner round, at the step's end, instead of the block it began the step with."""

    def start_shift(self, arrays, tag):
        if tag != double_ring.KV:
            return super().start_shift(arrays, tag)
        t = self._started[tag]
        self._started[tag] += 1
        ring = self.inner if t % self.w < self.w - 1 else self.outer
        return double_ring.Shift(ring, ring.start_shift(arrays, tag), t)


class OuterStepLate(VirtualRingAdapter):
    def __init__(self):
        super().__init__("double_ring", ring_inner=2)
        self.name = "planted: the outer ring's shift taken at the step's end"

    def run(self, case, shards):
        real = double_ring.DoubleRing
        double_ring.DoubleRing = OuterBlockLate
        try:
            return super().run(case, shards)
        finally:
            double_ring.DoubleRing = real


def test_the_kit_catches_a_ulysses_that_deals_heads_in_the_wrong_order():
    planted = HeadsReversed()
    verdict = check_adapter(planted, make_plan(planted, world_sizes=(1, 2, 3), examples=40, shrink_seconds=60))
    assert not verdict.agrees, "the planted Ulysses bug went unseen"
    case = verdict.case
    # the smallest case: two devices (one cannot misdeal), two KV heads each (the kit's smallest for
    # Ulysses), the default shape otherwise
    assert (case.n_devices, case.Hkv, case.Hq, case.B, case.S) == (2, 4, 4, 1, 2), case
    assert "differs from the float64 oracle" in verdict.message


def test_the_kit_catches_a_usp_with_its_groups_swapped():
    planted = GroupsSwapped()
    verdict = check_adapter(planted, make_plan(planted, world_sizes=(2, 4), examples=40, shrink_seconds=60))
    assert not verdict.agrees, "the planted USP bug went unseen"
    case = verdict.case
    # the smallest case: N = 2 (one ring rank of a Ulysses pair, talked to as a ring of two), one token
    # each, two KV heads a rank
    assert (case.n_devices, case.Hkv, case.Hq, case.B, case.S) == (2, 4, 4, 1, 2), case


def test_the_kit_catches_copies_of_a_kv_head_whose_gradients_are_not_summed():
    planted = CopiesNotSummed()
    verdict = check_adapter(planted, make_plan(planted, world_sizes=(1, 2, 3), examples=40, shrink_seconds=60))
    assert not verdict.agrees, "the planted replication bug went unseen"
    case = verdict.case
    # the smallest case: two devices, one K/V head (MQA) copied to both, one query head each, a token each
    assert (case.n_devices, case.Hkv, case.Hq, case.B, case.S) == (2, 1, 2, 1, 2), case
    assert "dk: " in verdict.message, verdict.message


def test_the_kit_catches_a_double_ring_whose_outer_step_is_taken_in_the_wrong_order():
    planted = OuterStepLate()
    verdict = check_adapter(planted, make_plan(planted, examples=40, shrink_seconds=60))
    assert not verdict.agrees, "the planted double ring bug went unseen"
    case = verdict.case
    # the smallest case: two groups of two (N = 2 has no outer ring), a token each; the forward is
    # still right (every block met once), the gradients of the blocks that crossed groups go astray
    assert (case.n_devices, case.Hkv, case.Hq, case.B, case.S) == (4, 1, 1, 1, 4), case
    assert "dk: " in verdict.message, verdict.message


# -- bad input, before any work ----------------------------------------------------------

@pytest.fixture
def no_work(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("work started before the input was checked")
    monkeypatch.setattr(reference.virtual, "run_devices", started)
    monkeypatch.setattr(reference.virtual, "shard_at", started)


def arrays(Hq=4, Hkv=2, S=8):
    rng = np.random.default_rng(0)
    return rng.standard_normal((1, S, Hq, 4)), *rng.standard_normal((2, 1, S, Hkv, 4))


@pytest.mark.parametrize("options, Hq, Hkv, message", [
    (dict(scheme="tree"), 4, 2, "scheme must be one of"),
    (dict(scheme="ring", ulysses_degree=2), 4, 2, "applies to scheme 'ulysses' or 'usp'"),
    (dict(scheme="all_gather", ulysses_degree=2), 4, 2, "applies to scheme 'ulysses' or 'usp'"),
    (dict(scheme="usp"), 4, 2, "needs ulysses_degree"),
    (dict(scheme="usp", ulysses_degree=3), 6, 3, r"ulysses_degree \(3\) must divide the number of devices \(4\)"),
    (dict(scheme="usp", ulysses_degree=0), 4, 2, "positive int"),
    (dict(scheme="usp", ulysses_degree=2.0), 4, 2, "positive int"),
    (dict(scheme="ulysses"), 12, 3, r"key/value heads \(3\) a multiple of it or a divisor"),
    (dict(scheme="ulysses"), 2, 1, r"query heads \(2\) must be a multiple of ulysses_degree \(4\)"),
    (dict(scheme="ulysses", ulysses_degree=2), 4, 4, "use scheme='usp'"),
    (dict(scheme="usp", ulysses_degree=2), 6, 3, r"key/value heads \(3\)"),
    (dict(scheme="double_ring"), 4, 2, "needs ring_inner"),
    (dict(scheme="double_ring", ring_inner=3), 4, 2, r"ring_inner \(3\) must divide the number of devices \(4\)"),
    (dict(scheme="double_ring", ring_inner=0), 4, 2, "ring_inner must be a positive int"),
    (dict(scheme="double_ring", ring_inner=2.0), 4, 2, "ring_inner must be a positive int"),
    (dict(scheme="double_ring", ring_inner=2, ulysses_degree=2), 4, 2, "applies to scheme 'ulysses' or 'usp'"),
    (dict(scheme="ring", ring_inner=2), 4, 2, "ring_inner=2 applies to scheme 'double_ring'"),
    (dict(scheme="usp", ulysses_degree=2, ring_inner=2), 4, 2, "applies to scheme 'double_ring'"),
])
def test_bad_schemes_are_refused_before_any_work(no_work, options, Hq, Hkv, message):
    q, k, v = arrays(Hq, Hkv)
    with pytest.raises(ValueError, match=message):
        ring_attention(q, k, v, n_devices=4, **options)
    with pytest.raises(ValueError, match=message):
        ring_attention_backward(q, k, v, q, np.zeros((1, Hq, 8)), q, n_devices=4, **options)


@pytest.mark.parametrize("options", [dict(scheme="ulysses"), dict(scheme="usp", ulysses_degree=2),
                                     dict(scheme="all_gather"), dict(ulysses_degree=2),
                                     dict(scheme="double_ring", ring_inner=2), dict(ring_inner=2)])
def test_the_lockstep_ring_refuses_another_scheme(options):
    """reference.lockstep is the ring alone: another scheme is an error, never the ring run in its place."""
    from reference import lockstep
    q, k, v = arrays(4, 4)
    with pytest.raises(ValueError, match="runs the ring only"):
        lockstep.ring_attention(q, k, v, n_devices=4, **options)
    with pytest.raises(ValueError, match="runs the ring only"):
        lockstep.ring_attention_backward(q, k, v, q, np.zeros((1, 4, 8)), q, n_devices=4, **options)


@settings(max_examples=10, deadline=None)
@given(st.sampled_from(["ring", "all_gather", "ulysses", "usp", "double_ring"]),
       st.sampled_from(["striped", "zigzag", "contiguous"]))
def test_every_scheme_gives_the_same_answer_as_the_ring(scheme, layout):
    """Bit-level agreement is not promised (sums in other orders), the dense line is."""
    q, k, v = arrays(Hq=4, Hkv=4, S=16)
    u, w = (2 if scheme == "usp" else None), (2 if scheme == "double_ring" else None)
    out, lse = ring_attention(q, k, v, n_devices=4, layout=layout, scheme=scheme, ulysses_degree=u, ring_inner=w)
    ring_out, ring_lse = ring_attention(q, k, v, n_devices=4, layout=layout)
    np.testing.assert_allclose(out, ring_out, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse, ring_lse, rtol=0, atol=1e-13)


# -- the cost model holds the trace ------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(scheme=st.sampled_from(["ring", "all_gather", "ulysses", "usp", "double_ring"]), n=st.integers(1, 6),
       layout=st.sampled_from(["striped", "zigzag", "contiguous"]), S=st.integers(1, 24),
       group=st.sampled_from([1, 2]), dtype=st.sampled_from([np.float64, np.float32, np.float16]),
       backward=st.booleans(), window=st.sampled_from([None, 3]), tile=st.sampled_from([None, 2, 3]),
       fewer_kv_heads=st.booleans(), inner=st.sampled_from([1, 2, 3]))
def test_the_trace_moves_holds_and_computes_what_the_cost_model_predicts(scheme, n, layout, S, group, dtype,
                                                                         backward, window, tile, fewer_kv_heads,
                                                                         inner):
    u = {"ulysses": n, "usp": 2 if n % 2 == 0 else 1}.get(scheme, 1)
    w = inner if scheme == "double_ring" and n % inner == 0 else None
    if scheme == "usp" and u == 1 or scheme == "double_ring" and w is None:
        scheme = "ring"
    Hkv = 1 if fewer_kv_heads else 2 * u                      # one K/V head: copied to the u ranks (u > 1)
    Hq = max(Hkv, u) * group
    rng = np.random.default_rng(S)
    q = rng.standard_normal((1, S, Hq, 3)).astype(dtype)
    k, v = rng.standard_normal((2, 1, S, Hkv, 3)).astype(dtype)
    options = dict(n_devices=n, layout=layout, scheme=scheme, window=window, tile_size=tile, ring_inner=w,
                   ulysses_degree=u if scheme in ("ulysses", "usp") else None)
    out, lse, trace = ring_attention(q, k, v, trace=True, **options)
    if backward:
        *_, trace = ring_attention_backward(q, k, v, out, lse, q, trace=True, **options)
    plan = schemes.Scheme(scheme, n, u, w)
    predicted = predict_scheme(plan, S, layout, B=1, Hq=Hq, Hkv=Hkv, D=3, dtype=dtype, tile_size=tile,
                               window=window, backward=backward)
    for name in ("bytes_sent", "bytes_received", "kv_bytes"):
        np.testing.assert_array_equal(getattr(trace, name), getattr(predicted, name), err_msg=name)
    for name in ("source", "tiles_computed", "tiles_skipped", "pairs"):
        np.testing.assert_array_equal(getattr(trace, name), getattr(predicted.work, name), err_msg=name)


def test_the_double_rings_messages_cross_the_links_it_was_built_for():
    """Two nodes of two: K, V go inside a node in the first round of each outer
    step and across nodes in the second step's only; dK, dV across nodes only
    at a step's end (to the next node's next place), so that a placement of
    the ranks on nodes charges each message to its link; each round holds
    three blocks but the last (`reference.double_ring.held_blocks`)."""
    plan = schemes.Scheme.checked("double_ring", n_devices=4, Hq=2, Hkv=2, ring_inner=2)
    cost = predict_scheme(plan, 8, "striped", B=1, Hq=2, Hkv=2, D=4, backward=True)
    node = np.arange(4) // 2
    moves = cost.moves
    across = node[moves.src] != node[moves.dst]
    block = 2 * 2 * 2 * 4 * 4 + 8 * 2 + 8
    kv = moves.nbytes == block
    assert sorted(zip(moves.sent[kv & across], moves.received[kv & across])) == [(0, 1)] * 4   # overlaps a round
    assert sorted(zip(moves.sent[kv & ~across], moves.received[kv & ~across])) == [(0, 0)] * 4 + [(2, 2)] * 4
    assert set(zip(moves.src[~kv & across], moves.dst[~kv & across], moves.sent[~kv & across])) == \
        {(0, 3, 1), (1, 2, 1), (2, 1, 1), (3, 0, 1), (0, 3, 3), (1, 2, 3), (2, 1, 3), (3, 0, 3)}
    # held, in rounds 0..3: its own block and the inner and outer ones arriving; the one attended to
    # and the outer ones arriving and still leaving; the inner ring's copy beside them; one
    assert cost.kv_bytes.tolist() == [[3 * block] * 4] * 3 + [[block] * 4]


def test_the_command_tabulates_every_scheme_and_names_its_choice(capsys):
    from reference.cost import main
    main(["--scheme", "all", "--n-devices", "4", "--seq-len", "4096", "--kv-heads", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in lines[3:-1]] == [["ring", "1", "-"], ["all_gather", "1", "-"],
                                                           ["usp", "2", "-"], ["ulysses", "4", "-"],
                                                           ["double_ring", "1", "2"]]
    assert all(len(line.split()) == 14 for line in lines[3:-1]), lines      # no column runs into the next
    assert lines[-1].split()[1].rstrip(",") in ("ring", "all_gather", "usp", "ulysses", "double_ring")


def total(pair, what):
    return sum(what(c) for c in pair)


def test_the_choice_follows_the_link_the_compute_and_the_memory():
    costs = {s: tuple(predict_scheme(s, 4096, "striped", B=1, Hq=8, Hkv=8, D=64, backward=b) for b in (False, True))
             for s in candidates(4, 8, 8)}
    assert [(s.name, s.u, s.w) for s in costs] == [("ring", 1, None), ("all_gather", 1, None), ("usp", 2, None),
                                                  ("ulysses", 4, None), ("double_ring", 1, 2)]
    moved = {s: total(pair, lambda c: np.maximum(c.bytes_sent, c.bytes_received).max(axis=1).sum())
             for s, pair in costs.items()}
    flops = {s: total(pair, lambda c: (c.work.tile_area * c.flops_per_entry).max(axis=1).sum())
             for s, pair in costs.items()}
    assert choose(costs, 1.0, 1e30) == min(moved, key=moved.get)           # a slow link: the fewest bytes
    assert choose(costs, 1e30, 1.0) == min(flops, key=flops.get)           # slow compute: the shortest path
    peak = {s: max(c.kv_bytes.max() for c in pair) for s, pair in costs.items()}
    assert choose(costs, 1e30, 1.0, min(peak.values())) == min(peak, key=peak.get)
    with pytest.raises(ValueError, match="fit"):
        choose(costs, 1e12, 1e9, min(peak.values()) - 1)


@pytest.mark.parametrize("n, u", [(3, 2), (6, 4), (9, 2)])
def test_a_degree_that_does_not_divide_the_devices_is_refused_whatever_the_degree(n, u):
    with pytest.raises(ValueError, match=rf"ulysses_degree \({u}\) must divide the number of devices \({n}\)"):
        schemes.Scheme.checked("usp", u, n_devices=n, Hq=8, Hkv=4)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_usp_without_a_degree_is_refused_on_any_number_of_devices(n):
    with pytest.raises(ValueError, match="needs ulysses_degree"):
        schemes.Scheme.checked("usp", None, n_devices=n, Hq=8, Hkv=8)


@pytest.mark.parametrize("causal", [False, True])
def test_every_scheme_does_the_same_arithmetic_in_all(causal):
    """Summed over devices and rounds, every scheme computes the same attention:
    without a mask, 4 D flops for each of S x S pairs of each query head, whatever
    the scheme deals over its devices (its heads or its tokens); with the causal
    mask, the same flops in every scheme whose ring has the same tiles."""
    from reference.scheme_cost import predict_scheme
    S, B, Hq, Hkv, D, n = 64, 1, 8, 4, 16, 4
    totals = {}
    for name, u, w in (("ring", None, None), ("all_gather", None, None), ("ulysses", None, None), ("usp", 2, None),
                       ("double_ring", None, 2)):
        scheme = schemes.Scheme.checked(name, u, n_devices=n, Hq=Hq, Hkv=Hkv, ring_inner=w)
        cost = predict_scheme(scheme, S, "striped", B=B, Hq=Hq, Hkv=Hkv, D=D, tile_size=1, causal=causal)
        totals[name] = int((cost.work.tile_area * cost.flops_per_entry).sum())
    pairs = S * S if not causal else S * (S + 1) // 2
    assert totals == dict.fromkeys(totals, 4 * D * B * Hq * pairs), totals


def test_the_candidates_are_the_schemes_whose_degree_divides_devices_and_heads():
    """A Ulysses degree divides N and the query heads, and is a multiple or a
    divisor of the K/V heads (copied then); a double ring's inner ring divides
    N, strictly between 1 and N (the ring itself at either end)."""
    from reference.scheme_cost import candidates
    labels = [s.label for s in candidates(4, Hq=8, Hkv=2)]
    assert labels == ["ring", "all_gather", "usp (u=2)", "ulysses (u=4)", "double_ring (w=2)"]   # u=4: 2 copies
    assert [s.label for s in candidates(4, Hq=2, Hkv=1)] == ["ring", "all_gather", "usp (u=2)", "double_ring (w=2)"]
    assert [s.label for s in candidates(6, Hq=6, Hkv=6)] == ["ring", "all_gather", "usp (u=2)", "usp (u=3)",
                                                             "ulysses (u=6)", "double_ring (w=2)",
                                                             "double_ring (w=3)"]
    assert [s.label for s in candidates(6, Hq=12, Hkv=4)] == ["ring", "all_gather", "usp (u=2)",
                                                              "double_ring (w=2)", "double_ring (w=3)"]


def test_a_round_lasts_its_compute_or_its_overlapped_transfer_whichever_is_longer():
    """The ring's transfers overlap its compute: with a link so fast that they
    take a millionth of it, the predicted time is the critical path's compute
    alone; with a link so slow that compute is a millionth, the bytes alone."""
    from reference.scheme_cost import predict_scheme
    scheme = schemes.Scheme.checked("ring", None, n_devices=4, Hq=4, Hkv=4)
    cost = predict_scheme(scheme, 256, "striped", B=1, Hq=4, Hkv=4, D=16, tile_size=16)
    rate = 1e9
    compute = cost.totals()["critical_flops"] / rate
    moved = float(cost.bytes_sent.max(axis=1).sum())
    assert cost.seconds(moved / compute * 1e6, rate) == pytest.approx(compute, rel=1e-12)
    assert cost.seconds(moved / compute * 1e-6, rate) == pytest.approx(compute * 1e6, rel=1e-5)


def test_a_scheme_is_chosen_only_if_both_its_passes_fit_in_memory():
    """choose() takes a (forward, backward) pair per scheme: one whose backward
    holds more than the memory given is left out, however fast."""
    from types import SimpleNamespace

    from reference.scheme_cost import choose

    def cost(seconds, peak):
        return SimpleNamespace(seconds=lambda link, rate, placement=None: seconds, kv_bytes=np.array([peak]))
    fast, slow = schemes.Scheme("all_gather", 4, 1), schemes.Scheme("ring", 4, 1)
    costs = {fast: (cost(1.0, 100), cost(1.0, 900)), slow: (cost(5.0, 100), cost(5.0, 100))}
    assert choose(costs, 1e9, 1e9) is fast
    assert choose(costs, 1e9, 1e9, memory_bytes=500) is slow
    with pytest.raises(ValueError, match="fit in 50 bytes"):
        choose(costs, 1e9, 1e9, memory_bytes=50)


@pytest.mark.parametrize("layout", ["striped", "zigzag"])
@pytest.mark.parametrize("scheme, u, w, Hkv", [("ring", None, None, 4), ("all_gather", None, None, 4),
                                               ("ulysses", None, None, 4), ("usp", 2, None, 4),
                                               ("ulysses", None, None, 2), ("usp", 2, None, 1),
                                               ("double_ring", None, 2, 4)])
def test_dropout_drops_the_same_pairs_under_every_scheme(scheme, u, w, Hkv, layout):
    """Dropout keys on global heads and positions: each scheme, whichever heads
    and tokens a device holds (copies of K/V heads included), gives the dense
    oracle's output and gradients (with the keep mask keyed on a device's own
    head numbers, Ulysses is off by about 2)."""
    rng = np.random.default_rng(11)
    q = rng.standard_normal((2, 32, 8, 8))
    k, v = (rng.standard_normal((2, 32, Hkv, 8)) for _ in range(2))
    dout = rng.standard_normal(q.shape)
    opts = dict(dropout=0.3, seed=5, window=12)
    want = reference.attention(q, k, v, **opts)
    want_grads = reference.attention_backward(q, k, v, *want, dout, **opts)
    scheme_opts = dict(scheme=scheme, ulysses_degree=u, ring_inner=w, tile_size=4)
    got = ring_attention(q, k, v, n_devices=4, layout=layout, **scheme_opts, **opts)
    got_grads = ring_attention_backward(q, k, v, *want, dout, n_devices=4, layout=layout, **scheme_opts, **opts)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got + got_grads, want + want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10, err_msg=f"{name} of {scheme} with dropout")
