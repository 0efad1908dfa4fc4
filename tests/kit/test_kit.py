"""The conformance kit (reference.testing) catches what it is for.

A toy ring written the plain way (one process, N ranks in a loop, the
online-softmax merge, K/V with their positions and documents and dK/dV
travelling) passes `check_ring_attention` on every mask (windows, packed
documents, padding) and dtype (bfloat16 too), and so does its varlen form
(each document dealt zigzag on its own); the same toy with one planted bug
fails, and hypothesis shrinks the failure to a small case whose message names
the output, rank, global position and head:

- a wrong GQA head mapping (query head h reads key/value head h % Hkv, as
  `tile` / `repeat` instead of `repeat_interleave` gives);
- dK / dV not returned to their owner (the last shift of the backward left out);
- a stale lse (the lse of the first block returned with the final out);
- a window one key too wide; a document boundary crossed (documents masked on
  the rank's own block only); a rank's document offsets wrong; padding keys
  seen; dq rounded to bfloat16 (ring-flash-attn's `dq.to(torch.bfloat16)`).

Then the verdict's own checks, each of which a wrong ring could slip past if
left out (a missing rank or output, the returned dtype and shape, an infinity
of the wrong sign, float16 / bfloat16 held to float32 sums), the message of
`assert_attention_close`, NaN and inf rules, the error model's margin (a
correct ring uses a fraction of its tolerance; an error of a few ulps more
per block does not pass), the kit guide's example (docs/kit.md), and the lazy hypothesis import.

    .venv/bin/python -m pytest tests/kit/test_kit.py -q
"""

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from random import Random

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings

from reference import attention
from reference.testing import (ALL_DTYPES, BFLOAT16, MASKS, NAMES, Adapter, Case, ErrorModel, ProcessGroup,
                               Unsupported, VirtualRingAdapter, assert_attention_close, parse_case,
                               attention_mismatch, cases, check_ring_attention, measure, oracle,
                               tolerances)

ROOT = Path(__file__).resolve().parents[2]
# no explain phase: it runs variations of the shrunk case after it, and `find`
# returns the last case that failed, which could then be one of those
SHRINK = settings(max_examples=200, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), phases=[p for p in Phase if p != Phase.explain])


# -- a toy ring, plain, with switches for the planted bugs ----------------------

def documents(case, pos):
    """The document of each position (the toy's own reading of cu_seqlens /
    segment_ids), or None without documents; padding positions get -1."""
    if case.cu_seqlens is not None:
        doc = np.searchsorted(np.array(case.cu_seqlens), pos, side="right") - 1
    elif case.segment_ids is not None:
        doc = np.array(case.segment_ids)[np.minimum(pos, case.S - 1)]
    else:
        return None
    return np.where(pos < case.S, doc, -1)


def visible(case, q_pos, k_pos, q_doc, k_doc, plant=None):
    """(c, c) bool: which keys each query sees, from positions (and documents
    where given): causal or not, a window of W keys (|q - k| < W), padding
    neither seeing nor seen."""
    seen = (q_pos[:, None] < case.S) & (k_pos[None, :] < case.S)
    if case.causal:
        seen &= k_pos[None, :] <= q_pos[:, None]
    if case.window is not None:
        width = case.window + (1 if plant == "window" else 0)       # the bug: W + 1 keys
        seen &= np.abs(q_pos[:, None] - k_pos[None, :]) < width
    if q_doc is not None and k_doc is not None:
        seen &= q_doc[:, None] == k_doc[None, :]
    return seen


def scores(q, k, seen, scale, heads):
    """S = Q K^T * scale of one block, -inf where not `seen`: (B, Hq, c, c).
    `heads[h]` is the key/value head query head h reads."""
    s = np.einsum("bihd,bjhd->bhij", q, k[:, :, heads]) * scale
    return np.where(seen, s, -np.inf)


def block(q, k, v, seen, scale, heads):
    """out (B, c, Hq, D) and lse (B, Hq, c) of q attending to one block alone."""
    s = scores(q, k, seen, scale, heads)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)                 # a row with no visible key in this block
    with np.errstate(divide="ignore"):                   # its lse is log 0 = -inf
        lse = (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]
    p = np.exp(s - m) / np.maximum(np.exp(lse - m[..., 0]), 1e-300)[..., None]
    return np.einsum("bhij,bjhd->bihd", p, v[:, :, heads]), lse


def merge(out_a, lse_a, out_b, lse_b):
    """The online-softmax merge of two partial results over disjoint key sets."""
    lse = np.logaddexp(lse_a, lse_b)
    safe = np.where(np.isfinite(lse), lse, 0.0)
    wa, wb = (np.exp(x - safe).transpose(0, 2, 1)[..., None] for x in (lse_a, lse_b))
    return wa * out_a + wb * out_b, lse


class ToyRing(Adapter):
    """Algorithm 1 in a loop: in round t rank j holds the K/V block of rank
    (j - t) mod N, with its positions and documents; the backward's dK, dV
    travel with K, V and a last shift brings them home. Float64 inside,
    results in the input dtype. Every mask, every dtype."""
    name = "toy ring"
    masks = MASKS

    def __init__(self, plant=None):
        self.plant = plant

    def heads(self, case):
        group = case.Hq // case.Hkv
        if self.plant == "gqa":                            # the bug: h % Hkv
            return [h % case.Hkv for h in range(case.Hq)]
        return [h // group for h in range(case.Hq)]

    def docs(self, case, shards):
        """Each rank's documents, computed by the rank from its positions."""
        return [documents(case, p) for p in shards.positions]

    def mask(self, case, shards, docs, j, src):
        """Which keys of the block from rank `src` rank j's queries see."""
        k_doc = docs[src] if self.plant != "documents" or src == j else None   # the bug: remote blocks
        return visible(case, shards.positions[j], shards.positions[src], docs[j], k_doc, self.plant)

    def run(self, case, shards):
        n, scale = case.n_devices, case.scale_value
        q, k, v, dout = ([x.astype(np.float64) for x in xs] for xs in (shards.q, shards.k, shards.v, shards.dout))
        heads, docs = self.heads(case), self.docs(case, shards)
        masks = [[self.mask(case, shards, docs, j, src) for src in range(n)] for j in range(n)]
        results = []
        for j in range(n):
            out, lse = np.zeros_like(q[j]), np.full((case.B, case.Hq, case.c), -np.inf)
            for t in range(n):
                src = (j - t) % n
                out, lse = merge(out, lse, *block(q[j], k[src], v[src], masks[j][src], scale, heads))
                if t == 0:
                    first_lse = lse
            results.append(dict(out=out, lse=first_lse if self.plant == "stale-lse" else lse))
        grads = self.backward_pass(case, q, k, v, dout, [(r["out"], r["lse"]) for r in results], masks, heads)
        lse_dtype = np.float64 if case.dtype == np.float64 else np.float32
        return [dict(out=r["out"].astype(case.dtype), lse=r["lse"].astype(lse_dtype),
                     **{name: self.rounded(name, x).astype(case.dtype) for name, x in g.items()})
                for r, g in zip(results, grads)]

    def rounded(self, name, x):
        if self.plant == "bfloat16-dq" and name == "dq":    # the bug: dq.to(torch.bfloat16)
            return x.astype(BFLOAT16)
        return x

    def backward_pass(self, case, q, k, v, dout, saved, masks, heads):
        n, scale = case.n_devices, case.scale_value
        dq = [np.zeros_like(x) for x in q]
        held = [(np.zeros_like(k[j]), np.zeros_like(v[j])) for j in range(n)]   # dK, dV travelling, by holder
        for t in range(n):
            for j in range(n):
                src = (j - t) % n
                out, lse = saved[j]
                lse = np.where(np.isfinite(lse), lse, 0.0)     # hazard: a row with no visible key, -inf - -inf
                p = np.exp(scores(q[j], k[src], masks[j][src], scale, heads) - lse[..., None])
                dp = np.einsum("bihd,bjhd->bhij", dout[j], v[src][:, :, heads])
                delta = (dout[j] * out).sum(-1).transpose(0, 2, 1)[..., None]          # (B, Hq, c, 1)
                ds = p * (dp - delta)
                dq[j] += np.einsum("bhij,bjhd->bihd", ds, k[src][:, :, heads]) * scale
                dk_h = np.einsum("bhij,bihd->bjhd", ds, q[j]) * scale                   # per query head
                dv_h = np.einsum("bhij,bihd->bjhd", p, dout[j])
                for h, kv in enumerate(heads):
                    held[j][0][:, :, kv] += dk_h[:, :, h]
                    held[j][1][:, :, kv] += dv_h[:, :, h]
            if t < n - 1:                                  # K, V, dK, dV move one rank on
                held = [held[(j - 1) % n] for j in range(n)]
        # after round N-1 rank j holds the block of rank j + 1: one more shift takes it home
        if self.plant != "dkv-not-home":
            held = [held[(j - 1) % n] for j in range(n)]
        return [dict(dq=dq[j], dk=held[j][0], dv=held[j][1]) for j in range(n)]


class VarlenToyRing(ToyRing):
    """The toy as varlen rings deal packed documents: each document cut into 2N
    chunks, rank r holding chunks r and 2N-1-r of every document (zigzag within
    each document), so every document's length is a multiple of 2N; a rank
    finds its tokens' documents from its local cu_seqlens, cu_seqlens // N, as
    varlen kernels take them."""
    name = "varlen toy ring"
    masks = ("causal", "full", "cu_seqlens")

    def document_multiple(self, n_devices):
        return 2 * n_devices

    def positions(self, case):
        n, cu = case.n_devices, case.cu_seqlens or (0, case.S)
        ranks = [[] for _ in range(n)]
        for start, end in zip(cu[:-1], cu[1:]):
            chunks = np.arange(start, end).reshape(2 * n, -1)
            for r in range(n):
                ranks[r] += [*chunks[r], *chunks[2 * n - 1 - r]]
        return np.array(ranks)

    def docs(self, case, shards):
        n, cu = case.n_devices, np.array(case.cu_seqlens or (0, case.S))
        result = []
        for r in range(n):
            local = cu // n
            if self.plant == "rank-offsets" and r > 0:   # the bug: later ranks' boundaries one token late
                local[1:-1] += 1
            result.append(np.searchsorted(local, np.arange(case.c), side="right") - 1)
        return result


def shrunk_failure(adapter, strategy=None):
    """The minimal case hypothesis finds for `adapter`, and the kit's message on it."""
    def fails(case):
        try:
            check_ring_attention(adapter, case)
        except AssertionError:
            return True
        return False
    strategy = cases(dtypes=(np.float64, np.float32), max_devices=4) if strategy is None else strategy
    case = find(strategy, fails, settings=SHRINK, random=Random(0))     # the same search on every run
    with pytest.raises(AssertionError) as e:
        check_ring_attention(adapter, case)
    return case, str(e.value)


@settings(max_examples=25, deadline=None)
@given(cases(max_devices=4))
def test_the_toy_ring_passes(case):
    check_ring_attention(ToyRing(), case)


def test_wrong_gqa_head_mapping_is_caught_and_shrunk():
    case, msg = shrunk_failure(ToyRing("gqa"))
    # the smallest case where h % Hkv differs from h // G: two kv heads of two query heads each
    assert (case.Hkv, case.Hq, case.n_devices, case.B) == (2, 4, 1, 1), case
    assert re.search(r"out: \d+ of \d+ elements out of tolerance; first at rank 0, global position 0 "
                     r"\(local 0\), batch 0, head 1, dim 0", msg), msg
    assert "toy ring differs from the float64 oracle" in msg and "Case(layout=" in msg


def test_dk_dv_left_on_the_wrong_rank_is_caught_and_shrunk():
    case, msg = shrunk_failure(ToyRing("dkv-not-home"))
    assert case.n_devices == 2 and case.S <= 4 and case.Hq == case.Hkv == 1, case
    assert re.search(r"^  dk: \d+ of \d+ elements out of tolerance; first at rank 0, global position \d+ "
                     r"\(local 0\), batch 0, kv head 0, dim 0: got .*, error .* > tolerance", msg, re.M), msg


def test_stale_lse_is_caught_and_shrunk():
    case, msg = shrunk_failure(ToyRing("stale-lse"))
    assert case.n_devices == 2 and case.S == 2 and case.Hq == 1, case
    assert re.search(r"^  lse: 1 of 1 elements out of tolerance; first at rank \d, global position \d \(local 0\), "
                     r"batch 0, head 0: got .*, error .* > tolerance", msg, re.M), msg


# -- masks and bfloat16 -------------------------------------------------------------

EVERY_MASK = dict(dtypes=ALL_DTYPES, masks=MASKS, max_devices=4)


@settings(max_examples=40, deadline=None)
@given(cases(**EVERY_MASK))
def test_the_toy_ring_passes_every_mask_and_bfloat16(case):
    check_ring_attention(ToyRing(), case)


@settings(max_examples=25, deadline=None)
@given(cases(layouts=("zigzag",), dtypes=ALL_DTYPES, masks=VarlenToyRing.masks, max_devices=4,
             document_multiple=VarlenToyRing().document_multiple))
def test_a_varlen_ring_with_per_document_zigzag_positions_passes(case):
    """Positions may be any permutation: here each document is dealt zigzag on its own."""
    check_ring_attention(VarlenToyRing(), case)


def masked(*masks, dtypes=(np.float64, np.float32)):
    """Cases with these masks drawn (and causal / full), for the shrinking tests."""
    return cases(dtypes=dtypes, masks=("causal", "full") + masks, max_devices=4)


def test_a_window_one_key_too_wide_is_caught_and_shrunk():
    case, msg = shrunk_failure(ToyRing("window"), masked("window"))
    # the smallest: one device, two tokens, a window of one key (the query itself), causal
    assert (case.n_devices, case.S, case.window, case.causal, case.Hq) == (1, 2, 1, True, 1), case
    assert re.search(r"out: 1 of 2 elements out of tolerance; first at rank 0, global position 1 \(local 1\), "
                     r"batch 0, head 0, dim 0", msg), msg


def test_a_document_boundary_crossed_is_caught_and_shrunk():
    # the bug: documents masked on the rank's own block only, not on blocks from other ranks
    case, msg = shrunk_failure(ToyRing("documents"), masked("cu_seqlens", "segment_ids"))
    assert case.n_devices == 2 and case.S == 2 and (case.cu_seqlens or case.segment_ids), case
    assert re.search(r"^  out: \d+ of \d+ elements out of tolerance; first at rank \d, global position \d "
                     r"\(local 0\), batch 0, head 0, dim 0", msg, re.M), msg


def test_a_ranks_document_offsets_wrong_is_caught_and_shrunk():
    adapter = VarlenToyRing("rank-offsets")
    case, msg = shrunk_failure(adapter, cases(layouts=("zigzag",), dtypes=(np.float64,), masks=adapter.masks,
                                              max_devices=4, document_multiple=adapter.document_multiple))
    # two ranks, two documents of 2N = 4 tokens: rank 1 puts its token 4 in the first one,
    # so rank 0's query 7 (local 3, in the second) does not see it
    assert case.n_devices == 2 and case.cu_seqlens == (0, 4, 8), case
    assert "out: 1 of 4 elements out of tolerance; first at rank 0, global position 7 (local 3)" in msg, msg


@settings(max_examples=50, deadline=None)
@given(cases(devices=(2, 3, 4), head_multiple=lambda n: n))
def test_head_multiple_makes_both_head_counts_multiples(case):
    # Ulysses deals Hq / N query heads and Hkv / N key/value heads to each rank
    assert case.Hq % case.n_devices == 0 and case.Hkv % case.n_devices == 0, case


@settings(max_examples=30, deadline=None)
@given(cases(devices=(2, 4), head_multiple=lambda n: n, shapes=3))
def test_head_multiple_holds_in_a_shape_pool(case):
    # a compiled Ulysses ring draws its shapes from a pool: the pool deals heads the same way
    assert case.Hq % case.n_devices == 0 and case.Hkv % case.n_devices == 0, case


def test_head_multiple_still_draws_grouped_heads():
    # two KV heads on each unit of 2 first (tests/kit/test_kit_heads.py), then groups of two query heads
    case = find(cases(devices=(4,), head_multiple=2), lambda case: case.Hq > case.Hkv, settings=SHRINK)
    assert (case.Hkv, case.Hq) == (4, 8), case
    case = find(cases(devices=(4,), head_multiple=2), lambda case: case.Hkv == 2, settings=SHRINK)
    assert case.Hq == 2, case


def test_padding_seen_by_a_real_query_is_caught_and_shrunk():
    class SeesPadding(ToyRing):
        name = "toy ring that sees padding"

        def mask(self, case, shards, docs, j, src):
            wide = dataclasses.replace(case, S=case.padded)       # padding keys count as real
            return visible(wide, shards.positions[j], shards.positions[src], docs[j], docs[src])

    case, msg = shrunk_failure(SeesPadding(), masked("padding"))
    # one real token and one of padding: the padding query's dout reaches the real key's dK, dV
    assert case.masks == ("causal", "padding") and case.n_devices == 2 and case.S == 1, case
    assert "first at rank 0, global position 0 (local 0)" in msg, msg


def test_a_gradient_rounded_to_bfloat16_is_caught_and_shrunk():
    # ring-flash-attn's contiguous ring returns dq.to(torch.bfloat16) whatever the
    # input dtype: 2**-9 relative error, caught in float32 (and float64)
    case, msg = shrunk_failure(ToyRing("bfloat16-dq"), cases(dtypes=(np.float32,), max_devices=4))
    assert (case.n_devices, case.S, case.dtype) == (1, 2, np.float32), case     # one token has dq = 0 exactly
    assert re.search(r"^  dq: \d+ of \d+ elements out of tolerance; first at rank 0, global position 1", msg, re.M), msg
    # on bfloat16 inputs the same rounding is the output's own, within the line
    check_ring_attention(ToyRing("bfloat16-dq"), dataclasses.replace(case, dtype=BFLOAT16))


def test_cases_draw_every_mask_and_bfloat16_and_shrink_to_no_mask():
    drawn = set()

    @settings(max_examples=60, derandomize=True, database=None)
    @given(cases(**EVERY_MASK))
    def draw(case):
        drawn.update(case.masks + (np.dtype(case.dtype).name,))

    draw()
    assert drawn >= set(MASKS) | {"bfloat16"}, drawn
    simplest = find(cases(**EVERY_MASK), lambda c: c.n_devices == 2 and c.S > 2, settings=SHRINK)
    assert simplest.masks == ("causal",) and simplest.dtype == np.float64, simplest
    padded = find(cases(**EVERY_MASK), lambda c: "padding" in c.masks and c.n_devices == 3, settings=SHRINK)
    assert (padded.S, padded.padded, padded.c) == (2, 3, 1), padded


def test_adapters_say_which_masks_and_dtypes_they_take():
    case = Case("striped", 2, 1, 5, 1, 1, 2, None, True, None, BFLOAT16, "gaussian", 0, window=2)
    assert case.masks == ("causal", "window", "padding")
    assert Adapter().supports(case) == "mask window, padding not supported (takes causal, full)"
    assert ToyRing().supports(case) is None
    with pytest.raises(Unsupported, match="dtype bfloat16 not supported"):
        check_ring_attention(type("F32", (ToyRing,), dict(dtypes=(np.float32,)))(), case)


def test_a_ring_with_no_key_mask_takes_padding_only_causal():
    # S=5 on 2 ranks: position 5 is padding, after every real query (causal hides it, full shows it)
    causal = Case("contiguous", 2, 1, 5, 1, 1, 2, None, True, None, np.float32, "gaussian", 0)
    full = dataclasses.replace(causal, causal=False)
    unpadded = dataclasses.replace(full, S=6)
    blind = type("Blind", (ToyRing,), dict(no_key_mask="no key mask: its function takes none"))()
    assert [blind.supports(c) for c in (causal, full, unpadded)] == [None, "no key mask: its function takes none", None]
    assert ToyRing().supports(full) is None                   # default: it masks padding keys
    with pytest.raises(Unsupported, match="no key mask"):
        check_ring_attention(blind, full)


def test_a_case_prints_as_the_line_that_rebuilds_it():
    case = Case("zigzag", 2, 1, 7, 2, 1, 3, (2, 3), False, 0.3, BFLOAT16, "exact", 5, window=3,
                segment_ids=[0, 1, 0, 0, 1, 1, 2])
    assert parse_case(repr(case)) == case and "dtype=ml_dtypes.bfloat16" in repr(case)
    assert parse_case(repr(dataclasses.replace(case, segment_ids=None, cu_seqlens=(0, 2, 7)))).cu_seqlens == (0, 2, 7)
    with pytest.raises(ValueError, match="cu_seqlens must rise strictly from 0 to the sequence length 7"):
        dataclasses.replace(case, segment_ids=None, cu_seqlens=(0, 2, 6))
    with pytest.raises(ValueError, match="not a Case"):
        parse_case("Case(layout=")


# -- the verdict: each check that could be left out fails a wrong ring ----------------

class Edited(VirtualRingAdapter):
    """The virtual ring, with its results edited by `edit(case, results)`."""

    def __init__(self, edit):
        self.edit = edit

    def run(self, case, shards):
        results = super().run(case, shards)
        return self.edit(case, results) or results


CASE = Case("striped", 2, 1, 4, 2, 1, 2, None, True, None, np.float32, "gaussian", 1)


def test_a_missing_rank_or_output_fails():
    with pytest.raises(AssertionError, match="run must return a list of 2 dicts.*it returned 1 ranks' results"):
        check_ring_attention(Edited(lambda case, results: results[:1]), CASE)


class ReturnsNothing(VirtualRingAdapter):
    name = "forgetful"

    def run(self, case, shards):
        super().run(case, shards)           # and forgets to return it


def test_a_run_that_returns_the_wrong_kind_of_thing_is_named():
    with pytest.raises(AssertionError, match=r"forgetful: run must return a list of 2 dicts, one per rank, "
                                             r"mapping 'out', 'lse'.*it returned NoneType"):
        check_ring_attention(ReturnsNothing(), CASE)
    with pytest.raises(AssertionError, match="rank 1's is a tuple"):
        check_ring_attention(Edited(lambda case, results: [results[0], tuple(results[1].values())]), CASE)
    for name in NAMES:
        def drop(case, results, name=name):
            del results[1][name]
        with pytest.raises(AssertionError, match=f"{name}: rank 1 returned no '{name}'"):
            check_ring_attention(Edited(drop), CASE)


def test_the_returned_dtype_and_shape_are_checked():
    def widen(case, results):
        results[1]["dk"] = results[1]["dk"].astype(np.float64)
    with pytest.raises(AssertionError, match="dk: rank 1 returned float64, expected the input dtype float32"):
        check_ring_attention(Edited(widen), CASE)

    def cut(case, results):
        results[0]["lse"] = results[0]["lse"][:, :, :1]
    with pytest.raises(AssertionError, match=r"lse: rank 0 returned shape \(1, 2, 1\), expected \(1, 2, 2\)"):
        check_ring_attention(Edited(cut), CASE)


@pytest.mark.parametrize("name", NAMES)
def test_every_rank_is_held_to_the_line(name):
    """One output of the last rank off by a hundredth: it fails, naming that rank."""
    def nudge(case, results):
        results[-1][name] = (results[-1][name] + 0.01).astype(results[-1][name].dtype)
    with pytest.raises(AssertionError, match=rf"{name}: .* first at rank 1, "):
        check_ring_attention(Edited(nudge), CASE)


def test_positions_must_deal_every_token_once():
    """An adapter's positions are a permutation of the padded tokens: one
    token dealt twice (and another never) is the adapter's error, said first."""
    class Twice(VirtualRingAdapter):
        def positions(self, case):
            pos = super().positions(case).copy()
            pos[1, 0] = pos[0, 0]
            return pos
    with pytest.raises(AssertionError, match=r"positions must be a permutation of 0..3 as \(2, 2\)"):
        check_ring_attention(Twice(), CASE)


def test_results_that_are_not_float_arrays_fail():
    """lse is checked for floats only by kind (it may be float32 or float64):
    the right values in an object array are still not an attention result."""
    def objects(case, results):
        results[1]["lse"] = results[1]["lse"].astype(object)
    with pytest.raises(AssertionError, match="lse: rank 1 returned object values, expected floats"):
        check_ring_attention(Edited(objects), CASE)


def test_a_result_of_another_shape_is_not_broadcast():
    """attention_mismatch compares shapes first: a (1, 3, 1, 1) result is not
    spread over a (1, 3, 2, 2) expected value, even where the values agree."""
    expected = np.zeros((1, 3, 2, 2))
    msg = attention_mismatch(np.zeros((1, 3, 1, 1)), expected, 1.0, name="dq", rank=1)
    assert msg == "dq on rank 1: shape (1, 3, 1, 1), expected (1, 3, 2, 2)", msg
    with pytest.raises(AssertionError, match="shape"):
        assert_attention_close(np.zeros((1, 3, 2, 1)), expected, 1.0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")      # inf - inf in the ring's threads, as it should
def test_an_infinity_of_the_wrong_sign_fails():
    """out is +inf where a visible value is +inf: -inf there is not the same result."""
    plus, minus = np.full((1, 1, 1, 1), np.inf), np.full((1, 1, 1, 1), -np.inf)
    assert "got -inf, expected inf" in (attention_mismatch(minus, plus, 1.0) or "agrees")
    assert "got inf, expected -inf" in (attention_mismatch(plus, minus, 1.0) or "agrees")
    case = dataclasses.replace(CASE, poison=(("v", 0, 0, 0, 0, "inf"),))        # every row sees key 0
    assert np.isposinf(oracle(case)["out"][..., 0]).all()
    check_ring_attention(VirtualRingAdapter(), case)

    def flip(case, results):
        for r in results:
            r["out"] = np.where(np.isposinf(r["out"]), -np.inf, r["out"]).astype(r["out"].dtype)
    with pytest.raises(AssertionError, match="out: .* got -inf, expected inf"):
        check_ring_attention(Edited(flip), case)


def test_float16_and_bfloat16_inputs_are_held_to_float32_sums():
    """Unless an adapter declares otherwise, float16 and bfloat16 inputs are
    summed in float32: an out 4 float16 ulps off fails, though it would pass
    a float16 sum's line."""
    assert Adapter().accumulate_dtype(np.float16) == np.float32 == Adapter().accumulate_dtype(BFLOAT16)
    case = dataclasses.replace(CASE, dtype=np.float16, S=8, D=8)

    def nudge(case, results):
        for r in results:
            r["out"] = (r["out"].astype(np.float32) * (1 + 4 * 2.0 ** -10)).astype(np.float16)
    with pytest.raises(AssertionError, match="out: .* out of tolerance"):
        check_ring_attention(Edited(nudge), case)
    check_ring_attention(type("Sums16", (Edited,), dict(accumulate_dtype=lambda self, d: np.float16))(nudge), case)


def test_lse_of_float16_inputs_is_held_as_float32():
    """lse is returned in float32 for float16 inputs, and held to float32's
    rounding: off by 2e-4 of itself fails, though float16's line would pass it."""
    case = dataclasses.replace(CASE, dtype=np.float16, S=8, D=8)

    def nudge(case, results):
        for r in results:
            r["lse"] = (r["lse"] * (1 + 2e-4)).astype(np.float32)
    with pytest.raises(AssertionError, match="lse: .* out of tolerance"):
        check_ring_attention(Edited(nudge), case)


# -- the comparison ----------------------------------------------------------------

def test_message_names_the_first_and_the_worst_element():
    expected = np.zeros((1, 3, 2, 2))
    actual = expected.copy()
    actual[0, 1, 1, 0] = 1e-3
    actual[0, 2, 0, 1] = 5e-2
    msg = attention_mismatch(actual, expected, 1e-4, name="dq", positions=np.array([5, 9, 13]), rank=2)
    assert msg.startswith("dq: 2 of 12 elements out of tolerance; first at rank 2, global position 9 (local 1), "
                          "batch 0, head 1, dim 0: got 0.001, expected 0.0, error 0.001 > tolerance 0.0001 (10x)"), msg
    assert "worst at rank 2, global position 13 (local 2), batch 0, head 0, dim 1" in msg and "(500x" in msg
    with pytest.raises(AssertionError, match="first at rank 2, global position 9"):
        assert_attention_close(actual, expected, 1e-4, name="dq", positions=np.array([5, 9, 13]), rank=2)
    assert_attention_close(actual, expected, 0.1)


def test_nan_and_inf_rules():
    """NaN where expected NaN, the same inf where expected inf, finite and close elsewhere."""
    lse = np.array([[[1.0, -np.inf, np.nan]]])                           # (B, H, c)
    assert attention_mismatch(lse, lse, 0.0, name="lse") is None
    assert "got nan, expected 1.0" in attention_mismatch(np.array([[[np.nan, -np.inf, np.nan]]]), lse, 1.0, name="lse")
    assert "got 0.0, expected -inf" in attention_mismatch(np.array([[[1.0, 0.0, np.nan]]]), lse, 1.0, name="lse")
    assert "global position 2" in attention_mismatch(np.array([[[1.0, -np.inf, 3.0]]]), lse, 1.0, name="lse")


def test_the_line_is_the_tolerance_itself():
    """Each element is held to its own tolerance, no looser: an error 1% over
    it fails, whichever element and sign, and an error just under passes."""
    rng = np.random.default_rng(0)
    expected = rng.standard_normal((1, 4, 2, 3))
    tol = 10.0 ** rng.uniform(-8, -2, expected.shape)                   # per element, six decades
    for sign in (1, -1):
        assert attention_mismatch(expected + sign * 0.99 * tol, expected, tol) is None
        for index in np.ndindex(expected.shape):
            actual = expected.copy()
            actual[index] += sign * 1.01 * tol[index]
            msg = attention_mismatch(actual, expected, tol)
            assert msg is not None and msg.startswith("out: 1 of 24 elements out of tolerance"), (index, msg)
    assert attention_mismatch(expected + 0.99e-3, expected, 1e-3) is None      # one number for all
    assert attention_mismatch(expected + 1.01e-3, expected, 1e-3) is not None


@settings(max_examples=10, deadline=None)
@given(cases(max_devices=4, poison=True, poison_values=("nan",)))
def test_nan_reaches_the_rows_it_should(case):
    """An injected NaN: the virtual ring follows the oracle's NaN pattern (docs/design.md)."""
    check_ring_attention(VirtualRingAdapter(), case)


def test_a_row_of_minus_inf_scores_follows_the_dense_formula():
    # the kit's first finding in this project (the ring gave out 0 and lse -inf
    # where the dense formula gives NaN), fixed: the rows that see a key are
    # told apart from those that see none by position, not by l == 0
    case = Case("contiguous", 1, 1, 1, 1, 1, 1, 1, False, None, np.float64, "gaussian", 0,
                poison=(("q", 0, 0, 0, 0, "inf"),))
    assert oracle(case)["out"][0, 0, 0, 0] != oracle(case)["out"][0, 0, 0, 0]       # NaN
    check_ring_attention(VirtualRingAdapter(), case)


def test_replicated_outputs_must_agree_between_ranks():
    class Replicated(VirtualRingAdapter):
        replicated = ("lse",)

        def __init__(self, skew=0.0):
            self.skew = skew

        def run(self, case, shards):
            results = super().run(case, shards)
            whole = attention(*(x.astype(np.float64) for x in case.inputs()[:3]), causal=case.causal,
                              scale=case.scale)[1].astype(results[0]["lse"].dtype)
            for r, got in enumerate(results):
                got["lse"] = whole + (self.skew if r == 1 else 0.0)
            return results

    case = Case("striped", 2, 1, 4, 1, 1, 2, None, True, None, np.float64, "gaussian", 0)
    check_ring_attention(Replicated(), case)
    with pytest.raises(AssertionError, match="lse: rank 1's copy differs from rank 0's"):
        check_ring_attention(Replicated(skew=1e-15), case)


# -- the error model ---------------------------------------------------------------

def test_correct_rings_use_a_fraction_of_the_tolerance():
    """The line sits above the worst error of the oracle at the dtype and of
    the virtual ring (`python -m reference.testing measure` measures 400 cases: at most
    0.34 of it in float32 and float64, 0.98 in float16, which is its final rounding),
    and not far above: 30 cases here."""
    table = measure(examples=30, seed=1)
    for dtype, (dense, ring) in table.items():
        assert max(dense, ring) <= 1.0, (dtype, dense, ring)
    assert max(table["float32"]) > 0.02 and max(table["float64"]) > 0.02, table   # not far above


def test_a_few_ulps_per_block_too_many_are_caught():
    """An out with an extra relative error of 64 float32 ulps per element (a
    missing rescale would be far more) fails the float32 line."""
    case = Case("striped", 4, 1, 32, 2, 1, 8, 3, True, None, np.float32, "gaussian", 7)

    class Nudged(VirtualRingAdapter):
        def run(self, case, shards):
            results = super().run(case, shards)
            for r in results:
                r["out"] = (r["out"] * np.float32(1 + 64 * np.finfo(np.float32).eps)).astype(np.float32)
            return results

    usage = {}
    check_ring_attention(VirtualRingAdapter(), case, usage=usage)
    assert set(usage) == {"out", "lse", "dq", "dk", "dv"} and 0 < usage["out"] < 1, usage
    with pytest.raises(AssertionError, match="out: .* out of tolerance"):
        check_ring_attention(Nudged(), case)


def test_tolerance_model_scales_with_the_problem():
    """The budget grows with the score scale L (large logits) and with the
    accumulation precision; rows with no visible key get none."""
    small = Case("contiguous", 1, 1, 8, 1, 1, 4, None, True, None, np.float32, "gaussian", 3)
    large = dataclasses.replace(small, kind="large_logits")
    assert tolerances(large)["out"].max() > 20 * tolerances(small)["out"].max()
    assert (tolerances(small, accumulate=np.float16)["dq"] > 1000 * tolerances(small)["dq"]).all()
    assert ErrorModel(growth=2).tolerance(np.ones(1), np.zeros(1), np.zeros(1), accumulate=np.float64,
                                          output=np.float64)[0] == pytest.approx(2 * 2.0 ** -53, rel=1e-6)
    assert oracle(small)["magnitude"]["dk"].shape == (1, 8, 1, 4)


# -- the kit guide's example, and the import without hypothesis -------------------------

def guide_example():
    text = (ROOT / "docs" / "kit.md").read_text()
    section = text[text.index("# Testing your own ring attention"):]
    return section[section.index("```python") + len("```python"):section.index("```\n", section.index("```python"))]


def test_the_guides_example_passes_and_catches_its_planted_bug(tmp_path):
    import runpy
    path = tmp_path / "guide_example.py"           # a file of its own: hypothesis reads its source
    path.write_text(guide_example())
    namespace = runpy.run_path(str(path))
    namespace["test_mine"]()
    with pytest.raises(AssertionError) as e:
        namespace["test_planted"]()
    assert re.search(r"first at rank \d+, global position \d+ \(local \d+\), batch 0, head 1", str(e.value)), e.value
    assert "Hkv=2" in str(e.value)
    text = (ROOT / "docs" / "kit.md").read_text()           # the guide shows the element as it is raised
    after = text[text.index("fails `test_planted` on the smallest case"):]
    shown = after[after.index("```\n") + 4:after.index("\n```", after.index("```\n") + 4)].splitlines()
    assert shown[0] in str(e.value) and shown[2] in str(e.value), (shown, str(e.value))


def test_strategies_say_which_extra_to_install_without_hypothesis():
    code = ("import sys; sys.modules['hypothesis'] = None\n"
            "import reference.testing as t\n"
            "try:\n    t.cases()\nexcept ImportError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'striped-attention[test]'" in proc.stdout, proc.stdout


def test_process_group_times_out_instead_of_hanging(tmp_path):
    """A group that never connects, and one that never answers: TimeoutError
    within the limit, with the group's output."""
    with pytest.raises(TimeoutError, match="did not connect within 2 s"):
        ProcessGroup([sys.executable, "-c", "import time; time.sleep(30)"], start_timeout=2)
    silent = ("import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
              "print('connected', flush=True); time.sleep(30)")
    group = ProcessGroup([sys.executable, "-c", silent, "{socket}"], timeout=1)
    with pytest.raises(TimeoutError, match="(?s)no reply within 1 s.*connected"):
        group.request({"case": None})


def test_conformance_report_names_a_peers_frame_without_local_paths():
    """CONFORMANCE.md quotes where a peer raised, as site-packages/..., not as this machine's path."""
    from reference.testing.compare import where_raised
    text = ('Traceback (most recent call last):\n'
            '  File "/home/someone/checkout/conformance/.venv/lib/python3.11/site-packages/pkg/mod.py", line 7, in f\n'
            '    x = torch.full(shape, big)\n'
            'RuntimeError: value cannot be converted')
    assert where_raised(text) == ('RuntimeError: value cannot be converted\n'
                                   '  at File "site-packages/pkg/mod.py", line 7, in f\n'
                                   '     x = torch.full(shape, big)')
