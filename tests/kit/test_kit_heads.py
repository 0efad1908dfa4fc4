"""The kit's cases for rings that deal heads to ranks (Ulysses), and its dropout.

A toy Ulysses (the all-to-all as "every rank sees the whole sequence of its
heads": rank r attends query heads r*Hq/u .. with the KV heads they read) shows
what the cases must draw to catch a wrong dealing of the heads:

- KV heads dealt strided (rank r takes r, r + u, ...) instead of in blocks passes
  cases with one KV head a rank (the cases before two a rank were drawn) and is
  caught on the first case drawn, the smallest: two KV heads a rank;
- an adapter that declares `replicates_kv_heads` is also given fewer KV heads
  than u (MQA included), and one that keeps one rank's dK, dV of a replicated
  KV head instead of summing them back is caught; one that does not declare it
  is never given them;
- dropout is drawn for adapters that declare it (`DROPOUT`): a Ulysses whose keep
  mask is keyed on each rank's local head numbers is caught, this project's
  Ulysses and USP agree.

    .venv/bin/python -m pytest tests/kit/test_kit_heads.py -q
"""

import dataclasses
from random import Random

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings

from reference import attention, attention_backward
from reference.layouts import shard_at, unshard_at
from reference.testing import (DROPOUT, MASKS, PLAIN, Adapter, Case, VirtualRingAdapter, cases, check_ring_attention,
                               kv_head_counts, parse_case)
from reference.testing.check import check_adapter, make_plan

SHRINK = settings(max_examples=100, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), phases=[p for p in Phase if p != Phase.explain])


class ToyUlysses(Adapter):
    """Ulysses of degree u = N, in one process: after the all-to-all rank r holds
    the whole sequence of query heads r*Hq/u .. (r+1)*Hq/u - 1 and of the KV heads
    they read, attends with `reference.attention`, and the all-to-all back deals
    the tokens again. `plant`: "strided" (KV heads r, r + u, ...), "not-summed"
    (a replicated KV head's dK, dV: the last rank's copy, not the sum),
    "local-dropout" (the keep mask keyed on the rank's local head numbers)."""
    name = "toy Ulysses"
    dtypes = (np.float64, np.float32)
    world_sizes = (2, 3, 4)

    def __init__(self, plant=None, replicates=False):
        self.plant, self.replicates_kv_heads = plant, replicates
        self.masks = MASKS + DROPOUT if plant == "local-dropout" else MASKS
        self.name = f"toy Ulysses ({plant or 'right'}{', replicating' if replicates else ''})"

    def head_multiple(self, n_devices):
        return n_devices

    def kv_heads(self, case, r):
        """The KV heads rank r holds: a block, one replicated head, or (planted) strided."""
        u, group = case.n_devices, case.Hq // case.Hkv
        if case.Hkv < u:                                   # replicated: every query head of r reads one
            return np.array([r * (case.Hq // u) // group])
        if self.plant == "strided":
            return np.arange(r, case.Hkv, u)
        return np.arange(r * case.Hkv // u, (r + 1) * case.Hkv // u)

    def run(self, case, shards):
        pos, u, hq = shards.positions, case.n_devices, case.Hq // case.n_devices
        q, k, v, dout = (unshard_at(x, pos, case.S).astype(np.float64) for x in (shards.q, shards.k, shards.v,
                                                                                   shards.dout))
        full = dict(out=np.zeros_like(q), lse=np.zeros((case.B, case.Hq, case.S)), dq=np.zeros_like(q),
                    dk=np.zeros_like(k), dv=np.zeros_like(v))
        opts = dict(causal=case.causal, scale=case.scale, **case.mask_options())
        for r in range(u):
            qh, kvh = np.arange(r * hq, (r + 1) * hq), self.kv_heads(case, r)
            q_r, k_r, v_r, dout_r = q[:, :, qh], k[:, :, kvh], v[:, :, kvh], dout[:, :, qh]
            out, lse = attention(q_r, k_r, v_r, **opts)     # (local heads: dropout keys on them, see below)
            dq, dk, dv = attention_backward(q_r, k_r, v_r, out, lse, dout_r, **opts)
            full["out"][:, :, qh], full["lse"][:, qh], full["dq"][:, :, qh] = out, lse, dq
            if self.plant == "not-summed":
                full["dk"][:, :, kvh], full["dv"][:, :, kvh] = dk, dv
            else:                                           # a replicated head's copies summed back
                full["dk"][:, :, kvh] += dk
                full["dv"][:, :, kvh] += dv
        lse_dtype = np.float64 if case.dtype == np.float64 else np.float32
        dealt = {name: shard_at(x.astype(lse_dtype if name == "lse" else case.dtype), pos,
                                axis=2 if name == "lse" else 1) for name, x in full.items()}
        return [{name: x[r] for name, x in dealt.items()} for r in range(u)]


def verdict_of(adapter, examples=15):
    return check_adapter(adapter, make_plan(adapter, examples=examples, shrink_seconds=30))


def test_kv_heads_are_drawn_two_a_rank_first_and_fewer_only_where_replicated():
    assert kv_head_counts(1) == (1, 2, 3)                               # no Ulysses: as before
    assert kv_head_counts(2) == (4, 2) and kv_head_counts(2, max_kv_heads=8) == (4, 2, 6, 8)
    assert kv_head_counts(4, replicates_kv_heads=True) == (8, 4, 2, 1)
    assert kv_head_counts(3, replicates_kv_heads=True) == (6, 3, 1)
    first = find(cases(devices=(4,), head_multiple=4), lambda case: True, settings=SHRINK, random=Random(0))
    assert (first.Hkv, first.Hq) == (8, 8), first                        # the smallest: two KV heads a rank


def test_a_strided_kv_dealing_passes_one_kv_head_a_rank_and_fails_the_first_case_of_two():
    strided = ToyUlysses("strided")

    @settings(max_examples=15, deadline=None, database=None)
    @given(cases(devices=strided.world_sizes, head_multiple=strided.head_multiple, dtypes=strided.dtypes)
           .filter(lambda case: case.Hkv == case.n_devices))           # one KV head a rank: what was drawn
    def one_a_rank(case):
        check_ring_attention(strided, case)
    one_a_rank()

    verdict = verdict_of(strided)
    assert not verdict.agrees and verdict.examples == {2: 0}, verdict.examples      # caught on its first case
    case = verdict.case
    assert (case.n_devices, case.B, case.S, case.Hkv, case.Hq, case.D) == (2, 1, 2, 4, 4, 1), case
    assert verdict_of(ToyUlysses()).agrees


def test_fewer_kv_heads_than_ranks_are_drawn_only_for_an_adapter_that_replicates_them():
    @settings(max_examples=60, deadline=None, database=None)
    @given(cases(devices=(2, 4), head_multiple=lambda n: n))
    def blocks_only(case):
        assert case.Hkv % case.n_devices == 0 and case.Hq % case.n_devices == 0, case
    blocks_only()
    fewer = find(cases(devices=(4,), head_multiple=4, replicates_kv_heads=True), lambda case: case.Hkv == 1,
                 settings=SHRINK, random=Random(0))
    assert (fewer.Hkv, fewer.Hq) == (1, 4), fewer                                       # MQA over 4 ranks
    case = Case("contiguous", 4, 1, 4, 4, 2, 1, None, True, None, np.float64, "gaussian", 0)
    assert ToyUlysses().supports(case).startswith("heads Hq=4, Hkv=2 not dealt to 4 ranks")
    assert ToyUlysses(replicates=True).supports(case) is None


def test_a_replicated_kv_heads_gradient_not_summed_back_is_caught():
    assert verdict_of(ToyUlysses(replicates=True)).agrees
    verdict = verdict_of(ToyUlysses("not-summed", replicates=True))
    assert not verdict.agrees
    case = verdict.case
    assert case.Hkv < case.n_devices and case.n_devices == 2, case                    # one KV head, two ranks
    assert "\n  dk: " in verdict.message or "\n  dv: " in verdict.message, verdict.message


def test_dropout_is_drawn_where_declared_and_shrinks_to_none():
    drawn = set()

    @settings(max_examples=40, deadline=None, database=None, derandomize=True)   # not the tests run before
    @given(cases(masks=PLAIN + DROPOUT))
    def draw(case):
        drawn.add(case.dropout)
    draw()
    assert drawn >= {None, 0.5}, drawn
    case = find(cases(masks=PLAIN + DROPOUT), lambda case: case.dropout is not None, settings=SHRINK, random=Random(0))
    assert case.masks == ("causal", "dropout") and case.dropout == 0.5, case
    assert parse_case(repr(case)) == case and "dropout=0.5" in repr(case)
    assert Adapter().supports(case) == "mask dropout not supported (takes causal, full)"
    assert case.mask_options()["seed"] == case.seed


def test_dropout_keyed_on_local_heads_is_caught_and_every_scheme_agrees():
    planted = ToyUlysses("local-dropout")
    verdict = check_adapter(planted, make_plan(planted, masks=("causal", "full", "dropout"), examples=20,
                                               shrink_seconds=30))
    assert not verdict.agrees and verdict.case.dropout, verdict.case
    # this project's schemes key on global heads (reference.step.Queries.heads)
    for adapter in (VirtualRingAdapter("ulysses"), VirtualRingAdapter("usp", ulysses_degree=2)):
        plan = make_plan(adapter, world_sizes=(2, 4), masks=("causal", "full", "dropout"), examples=8)
        assert check_adapter(adapter, plan).agrees


class IgnoresDropout(VirtualRingAdapter):
    """Declares dropout and runs without it."""
    name = "planted: dropout ignored"

    def run(self, case, shards):
        return super().run(dataclasses.replace(case, dropout=None), shards)


@pytest.mark.parametrize("p", [0.1, 0.9])
def test_the_line_holds_a_correct_ring_with_dropout_and_catches_one_without(p):
    case = Case("striped", 4, 2, 16, 8, 4, 4, 3, True, None, np.float16, "gaussian", 3, dropout=p)
    check_ring_attention(VirtualRingAdapter("ulysses"), case)
    with pytest.raises(AssertionError, match="differs from the float64 oracle"):
        check_ring_attention(IgnoresDropout(), case)
