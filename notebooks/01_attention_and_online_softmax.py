# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 1. Attention, the causal mask, and the online softmax
#
# The second of nine notebooks on Striped Attention (Brandon et al. 2023). Notebook 0
# showed why attention is spread over a ring of devices: one device cannot hold a long
# sequence, so each holds a block of it and attends to the other blocks as they pass.
# This notebook shows why that gives the exact answer:
#
# 0. why a ring: memory as the sequence grows;
# 1. **attention and the online softmax** (this notebook): why a device can attend to
#    one block of keys at a time and still get the exact answer;
# 2. layouts: which device holds which token;
# 3. the ring, round by round;
# 4. tiles, and the speed-up they turn balance into;
# 5. the backward pass;
# 6. real processes with MPI;
# 7. the whole model: a transformer trained over the ring;
# 8. around the ring: the collectives, data parallelism, stock kernels, PyTorch.
#
# Every claim here is followed by an `assert` or a picture (the timings of notebooks 5, 6
# and 7 are printed and drawn, never asserted). Nothing is re-implemented here:
# the notebooks call the project's own code (`reference`, pure NumPy; later `mpi_impl`
# and `model`).
#
# Shapes follow flash-attn: `q` is `(B, S, Hq, D)` (batch, tokens, heads, head dim),
# `k` and `v` are `(B, S, Hkv, D)`, and `lse` (the log-sum-exp of each query's scores)
# is `(B, Hq, S)`.

# %%
import matplotlib.pyplot as plt
import numpy as np

import inspect

from reference import attention, merge, steps
from reference.heads import q_from_heads, rows_from_heads
from reference.ring import own_block
from reference.step import ForwardAcc, Queries, finish_forward, forward_tile, tile_rows
from reference.tiles import MASKED, tile_plan, visible

rng = np.random.default_rng(0)

# %% [markdown]
# ## Causal attention (paper, section 2.1)
#
# $$\mathrm{CausalAttn}(Q, K, V) = \mathrm{Softmax}(Q K^\top \cdot \mathrm{scale} + C)\,V,
# \qquad C_{q,k} = \begin{cases} -\infty & \text{pos}_k > \text{pos}_q \\ 0 & \text{otherwise}\end{cases}$$
#
# The mask says: a token only looks at itself and at tokens before it. In this project
# the mask is always computed from **positions**, `q_pos[:, None] >= k_pos[None, :]`,
# never from array indices: that is what will let us shuffle tokens between devices
# later without changing the answer.

# %%
S = 16
pos = np.arange(S)
mask = visible(pos, pos)                     # (S, S) True where key k is visible to query q

plt.figure(figsize=(3.4, 3.4))
plt.imshow(mask, cmap="Greys_r")
plt.xlabel("key position")
plt.ylabel("query position")
plt.title("causal mask: white visible,\nblack masked (key after query)", fontsize=10)
plt.show()

assert (mask == np.tril(np.ones((S, S), dtype=bool))).all()
assert mask.sum() == S * (S + 1) // 2        # about half the pairs: the work causality saves

# %% [markdown]
# `reference.attention` is the dense oracle: it builds the whole `(S, S)` score matrix,
# so it is only for checking. It returns the output and `lse`, the log of each row's
# softmax denominator. `lse` is what makes the softmax weights recoverable later:
# `P = exp(scores - lse)`, and each row of `P` sums to one.

# %%
B, H, D = 1, 1, 8
q, k, v = (rng.standard_normal((B, S, H, D)) for _ in range(3))   # (B, S, H, D) float64
scale = D ** -0.5

out, lse = attention(q, k, v, causal=True)   # out (B, S, H, D), lse (B, H, S)
scores = q[0, :, 0] @ k[0, :, 0].T * scale   # (S, S) for the one batch element and head
P = np.where(mask, np.exp(scores - lse[0, 0][:, None]), 0.0)

assert np.allclose(P.sum(axis=1), 1.0)                   # lse normalises every row
assert np.allclose(P @ v[0, :, 0], out[0, :, 0])         # and out = P V

weights = plt.get_cmap("YlOrRd").with_extremes(bad="black")       # masked cells: black, as above
plt.figure(figsize=(3.8, 3.4))
plt.imshow(np.ma.masked_where(~mask, P), cmap=weights, vmin=0)
plt.xlabel("key position")
plt.ylabel("query position")
plt.title("attention weights P\n(black: masked, weight 0)", fontsize=10)
plt.colorbar(fraction=0.046, label="weight (each row sums to 1)")
plt.show()

# %% [markdown]
# ## Why a running maximum: `exp` overflows
#
# A softmax computed as written, `exp(s) / sum(exp(s))`, overflows as soon as a score
# passes about 88 in float32 (709 in float64): `exp` gives `inf`, and `inf / inf` is NaN.
# Subtracting the row's maximum first changes nothing mathematically (the factor
# $e^{-\max}$ cancels between numerator and denominator) and keeps every exponent at or
# below 0. Scores that large are real: a dot product of two 128-dimensional vectors whose
# entries are about 1 is already about 11 before scaling, and trained models see far larger.

# %%
s_big = np.array([100.0, 99.0, 98.0], dtype=np.float32)        # three scores of one row
with np.errstate(over="ignore", invalid="ignore"):
    naive = np.exp(s_big) / np.exp(s_big).sum()                  # exp(100) is inf in float32
shifted = np.exp(s_big - s_big.max()) / np.exp(s_big - s_big.max()).sum()
print("naive:", naive, "  shifted by the max:", shifted)
assert np.isnan(naive).all() and np.isclose(shifted.sum(), 1.0)

# %% [markdown]
# ## The online softmax: one block of keys at a time
#
# In a ring, a device never holds all keys at once: it sees one block per round. It keeps,
# for each of its query rows, a running maximum `m`, a running sum `l` and an
# unnormalised output `O` (Rabe and Staats 2021; this is Algorithm 1's `Out_j`).
# For a new block of scores `S_b`:
#
# $$m' = \max(m, \max_k S_b), \quad l' = l\,e^{m - m'} + \sum_k e^{S_b - m'}, \quad
# O' = O\,e^{m - m'} + e^{S_b - m'} V_b$$
#
# and at the end `out = O / l`, `lse = m + log l`. The factor $e^{m - m'}$ rescales what was
# accumulated against the old maximum; nothing is lost.
#
# First the identity on one row of six scores, with one value per key, split into two
# blocks of three; each block keeps its own `m`, `l` and `O`, and the merge rescales both
# to the larger maximum:

# %%
row = rng.standard_normal(6)                  # the scores of one query against six keys
vals = rng.standard_normal(6)                 # one value per key (V with D = 1)
blocks = []
for keys in (slice(0, 3), slice(3, 6)):
    m_b = row[keys].max()
    p_b = np.exp(row[keys] - m_b)
    blocks.append((m_b, p_b.sum(), p_b @ vals[keys]))       # (m, l, O) of one block
(m_a, l_a, o_a), (m_b, l_b, o_b) = blocks
m = max(m_a, m_b)
l = l_a * np.exp(m_a - m) + l_b * np.exp(m_b - m)
o = o_a * np.exp(m_a - m) + o_b * np.exp(m_b - m)

weights_full = np.exp(row) / np.exp(row).sum()             # the softmax of the whole row
assert np.isclose(m + np.log(l), np.log(np.exp(row).sum()))   # merged lse == full lse
assert np.isclose(o / l, weights_full @ vals)                  # merged out == full softmax average

# %% [markdown]
# The same merge on whole outputs: `reference.merge` combines two partial results, each
# the attention of the queries to one block of keys, into the attention to both. Dense
# attention takes the positions of its queries and keys, so it gives the partial result
# of any block: this is the per-device oracle of a ring. We split the 16 keys into two
# blocks, positions `0..7` and `8..15`:
#
# $$\mathrm{lse} = \log(e^{\mathrm{lse}_a} + e^{\mathrm{lse}_b}), \qquad
# \mathrm{out} = e^{\mathrm{lse}_a - \mathrm{lse}}\,\mathrm{out}_a + e^{\mathrm{lse}_b - \mathrm{lse}}\,\mathrm{out}_b$$

# %%
print(inspect.getsource(merge))

# %%
first, second = slice(0, 8), slice(8, 16)               # two key blocks
part = {name: attention(q, k[:, keys], v[:, keys], q_pos=pos, k_pos=pos[keys])
        for name, keys in (("first", first), ("second", second))}
merged_out, merged_lse = merge(part["second"], part["first"])   # in the "wrong" order: it does not matter

print("max |merged - dense| out:", np.abs(merged_out - out).max(), " lse:", np.abs(merged_lse - lse).max())
assert np.allclose(merged_out, out, rtol=0, atol=1e-12)
assert np.allclose(merged_lse, lse, rtol=0, atol=1e-12)

# %% [markdown]
# ## The step that does it, tile by tile
#
# On a device the merge happens inside the per-device step, `reference.step` (Algorithm 1's
# `AccumulateAttentionFragment`), one tile of queries by keys at a time. This is its
# readable version (version 1; faster ones, `reference.steps`, are checked against it).
#
# **The layout first.** The step does not work on `(B, S, Hq, D)`: it regroups the queries
# as `(B, Hkv, c, G, D)`, the *compute layout*:
#
# - `c` is the number of queries this device holds (here all `S = 16`);
# - `G = Hq / Hkv` is the number of query heads that share one key/value head (grouped-query
#   attention; `G = 1` here, one head of each);
# - a **tile** is `tq` queries by `tk` keys; `tile_size=4` below asks for `tq = tk = 4`, so the
#   16 queries and a block of 8 keys make 4 x 2 tiles;
# - inside a tile the `tq` queries of every head in the group are stacked as `R = tq * G`
#   rows (query-major), so that one matrix product `Q K^T` of shape `(R, tk)` covers the
#   whole group: `K` and `V` are read once for `G` heads.
#
# Its inputs are small named types:
#
# - `Queries.prepare(q, ...)`: this device's queries `Q_j`, pre-scaled, with their positions;
# - `own_block(k, v, k_pos, rank)`: a key/value block `K_k, V_k` with its positions;
# - `ForwardAcc.zeros(...)`: the empty running state (`m = -inf`, `l = 0`, `O = 0`);
# - `step.forward(acc, queries, block, ...)`: merge one block; `finish_forward(acc)`:
#   `out = O / l`, `lse = m + log l`.
#
# Three names in the tile code guard rare inputs and can be skipped on a first reading:
#
# - `guard` is true only when the block holds a NaN or an inf (checked once per block);
# - `z` holds the dropout weights of the tile, or `None` without dropout (the usual case);
# - `masked_product(p, v, vis)` is `p @ v`, except that with `vis` given a masked pair adds
#   exactly 0 even where `V` holds NaN or inf (`0 x NaN` is NaN in floating point).
#
# Here is the update of one tile, the formulas above line by line (`s` is `S`, `p` is `P`,
# `alpha` is $e^{m - m'}$):

# %%
print(inspect.getsource(forward_tile))

# %%
step = steps.get("v1")                                  # the readable step
queries = Queries.prepare(q, n_kv_heads=H, q_pos=pos, scale=scale)   # Q_j: (B, Hkv, S, G, D)


def block(keys):
    """The key/value block holding the keys at positions `keys`."""
    return own_block(k[:, keys], v[:, keys], pos[keys], rank=0)


acc = ForwardAcc.zeros(queries.q)
for keys in (second, first):
    step.forward(acc, queries, block(keys), causal=True, tile_size=4)
out_h, lse_h = finish_forward(acc)
assert np.allclose(q_from_heads(out_h), out, rtol=0, atol=1e-12)
assert np.allclose(rows_from_heads(lse_h), lse, rtol=0, atol=1e-12)

# %% [markdown]
# ## The running max, and a row with no visible key
#
# Look at the state after the first block only (keys `8..15`). `m` is each query's running
# max: the largest score it has seen so far, over the keys it may see. Queries `0..7` see
# none of those keys: their running max is still `-inf`. The naive update would compute
# `exp(-inf - (-inf)) = exp(nan)`. The step guards against this (the hazard comment in
# `forward_tile` above): such a row stays at `m = -inf, l = 0, O = 0`, with no NaN, and the
# next block merges into it as if it were empty.
#
# With striping (notebook 2), in every round after the first some device holds a block from
# a device after it, and its first query sees none of that block's keys: on the ring this
# case is not a corner, it happens every round.

# %%
acc = ForwardAcc.zeros(queries.q)
step.forward(acc, queries, block(second), causal=True, tile_size=4)
m_rows = rows_from_heads(acc.m)[0, 0]                    # (S,) running max per query
l_rows = rows_from_heads(acc.l)[0, 0]
print("m after block 8..15:", np.round(m_rows, 2))

seen_scores = np.where(visible(pos, pos[second]), scores[:, second], -np.inf)   # (S, 8) what each row may see
true_max = seen_scores.max(axis=1)
print("true max of the visible scores:", np.round(true_max, 2))
assert np.allclose(m_rows[8:], true_max[8:], rtol=0, atol=1e-12)  # m is the max, not just some shift
assert np.isneginf(m_rows[:8]).all() and (l_rows[:8] == 0).all()    # queries 0..7 saw nothing
assert np.isfinite(m_rows[8:]).all() and (l_rows[8:] > 0).all()
assert not np.isnan(acc.o).any() and not np.isnan(acc.l).any()

# %% [markdown]
# If we stopped here, `finish_forward` would give those rows `out = 0` and `lse = -inf`
# (a row that saw no key has nothing to average), still without NaN. Then merging the other
# block makes them exactly right:

# %%
only_second_out, only_second_lse = finish_forward(acc)
empty_rows = rows_from_heads(only_second_lse)[0, 0, :8]
assert np.isneginf(empty_rows).all()
assert (q_from_heads(only_second_out)[0, :8] == 0).all()
assert not np.isnan(only_second_out).any()

step.forward(acc, queries, block(first), causal=True, tile_size=4)
out_h, lse_h = finish_forward(acc)
assert np.allclose(q_from_heads(out_h), out, rtol=0, atol=1e-12)
assert np.allclose(rows_from_heads(lse_h), lse, rtol=0, atol=1e-12)

# %% [markdown]
# A row with no visible key and a row whose visible scores are all `-inf` are different
# things: the first has nothing to average (`out = 0`, `lse = -inf`); the second has keys
# whose weights are `exp(-inf) = 0` and sum to 0, so the formula gives `0 / 0 = NaN`, and the
# step follows the formula, as dense attention does.
#
# To see the second case, give query 5 a first coordinate of `-inf` and every key a positive
# first coordinate: all of query 5's scores are `-inf`, and only its row becomes NaN, in
# dense attention and in the step alike.

# %%
q_inf = q.copy()
q_inf[0, 5, 0, 0] = -np.inf                       # query 5: every score -inf ...
k_pos1 = k.copy()
k_pos1[..., 0] = np.abs(k_pos1[..., 0]) + 0.1     # ... as every key's first coordinate is > 0

with np.errstate(invalid="ignore"):
    dense_out, dense_lse = attention(q_inf, k_pos1, v, causal=True)
    queries_inf = Queries.prepare(q_inf, n_kv_heads=H, q_pos=pos, scale=scale)
    acc = ForwardAcc.zeros(queries_inf.q)
    for keys in (second, first):
        step.forward(acc, queries_inf, own_block(k_pos1[:, keys], v[:, keys], pos[keys], rank=0),
                     causal=True, tile_size=4)
    step_out, step_lse = (f(x) for f, x in zip((q_from_heads, rows_from_heads), finish_forward(acc)))

nan_rows = np.isnan(step_out[0, :, 0]).any(axis=-1)
print("rows with NaN in out:", np.flatnonzero(nan_rows).tolist())
assert np.flatnonzero(nan_rows).tolist() == [5] and np.isnan(step_lse[0, 0, 5])
assert np.isnan(dense_out[0, 5]).all() and np.isnan(dense_lse[0, 0, 5])
keep = np.arange(S) != 5                          # every other row: as dense attention
assert np.allclose(step_out[:, keep], dense_out[:, keep], rtol=0, atol=1e-12)

# %% [markdown]
# ## Picture: the running state, block by block
#
# Each query's `lse` after one and two blocks, against the dense `lse`. After the
# first block (keys `8..15`) only the second half has a value; after the second block the
# curves coincide.

# %%
acc = ForwardAcc.zeros(queries.q)
partial = []
for keys in (second, first):
    step.forward(acc, queries, block(keys), causal=True, tile_size=4)
    partial.append(rows_from_heads(finish_forward(acc)[1])[0, 0])

plt.figure(figsize=(6, 3))
plt.plot(pos, lse[0, 0], "k-", lw=3, alpha=0.3, label="dense attention, all keys at once")
plt.plot(pos, np.where(np.isneginf(partial[0]), np.nan, partial[0]), "o", label="after the block of keys 8..15")
plt.plot(pos, partial[1], "x", label="after the block of keys 0..7 as well")
plt.xlabel("query position")
plt.ylabel("lse (log of the softmax sum)")
plt.title("Each query's lse, block by block (queries 0..7 see no key of 8..15)", fontsize=9)
plt.legend()
plt.show()

assert np.allclose(partial[1], lse[0, 0])
assert (partial[0][8:] <= lse[0, 0][8:] + 1e-12).all()   # more keys only add to the sum

# %% [markdown]
# ## Exercises
#
# Work each out by hand first; the cell under it (collapsed in Jupyter: click to open) holds
# the answer and checks it against the project.
#
# 1. In float64, `exp` overflows a little above 709. A row's scores are `[800, 799]`: what are
#    its two softmax weights, to three digits?
# 2. Two blocks of one query's keys give `(m, l) = (2, 3)` and `(5, 1)`. What are the merged
#    `m`, `l` and `lse`?
# 3. `Hq = 8` query heads, `Hkv = 2` key/value heads, `tile_size = 64`: what are `G` and the
#    number of rows `R` of one tile's score matrix?
# 4. Queries and keys at positions `0..15`, `tile_size=4`, causal: how many of the 16 tiles
#    does the step skip because no pair in them is visible, and how many need a mask?
# 5. Write it: `my_merge(a, b)`, the merge of two partial results `a = (out_a, lse_a)` and
#    `b = (out_b, lse_b)` over disjoint key blocks (`out` is `(B, S, H, D)`, `lse` is
#    `(B, H, S)`), as the formulas above say. A row that sees no key of a block has `out = 0`,
#    `lse = -inf` there; a row that sees no key of either must come out as `0` and `-inf`, not
#    NaN. The cell after the answers checks it against dense attention.

# %% jupyter={"source_hidden": true}
# 1. shift by 800: exp(0) = 1 and exp(-1) = 0.368; weights 1 / 1.368 and 0.368 / 1.368
answer_1 = (0.731, 0.269)
with np.errstate(over="ignore", invalid="ignore"):
    assert np.isnan(np.exp(np.array([800.0, 799.0])) / np.exp(np.array([800.0, 799.0])).sum()).all()
assert np.allclose(np.exp([0.0, -1.0]) / np.exp([0.0, -1.0]).sum(), answer_1, atol=5e-4)

# 2. m = max(2, 5) = 5; l = 3 e^(2 - 5) + 1 e^0 = 1 + 3 e^-3 = 1.149; lse = 5 + log(1.149)
answer_2 = (5.0, 1 + 3 * np.exp(-3.0), 5 + np.log(1 + 3 * np.exp(-3.0)))
m2, l2 = max(2.0, 5.0), 3 * np.exp(2.0 - 5.0) + 1 * np.exp(5.0 - 5.0)
assert np.allclose((m2, l2, m2 + np.log(l2)), answer_2)
assert np.isclose(answer_2[2], np.logaddexp(2 + np.log(3), 5 + np.log(1)))   # lse of each block, merged

# 3. G = Hq / Hkv = 4 query heads per key/value head; R = tq * G = 64 * 4 = 256 rows
answer_3 = (4, 256)
gq = Queries.prepare(rng.standard_normal((1, 64, 8, 16)), n_kv_heads=2, q_pos=np.arange(64), scale=0.25)
assert gq.q.shape[3] == answer_3[0]
assert tile_rows(gq.q, slice(0, 64)).shape[2] == answer_3[1]      # the rows of one 64-query tile

# 4. 4 x 4 tiles: the 6 above the diagonal are skipped, the 4 on it are masked, 6 are full
answer_4 = (6, 4)
plan, skipped = tile_plan(pos, pos, tile_size=4)            # causal
assert (skipped, sum(kind == MASKED for _, _, kind in plan)) == answer_4



# 5. lse = log(e^lse_a + e^lse_b), then each output weighted by e^(its lse - lse); where both
#    lse are -inf (no key in either block) the weights must be 0, not exp(-inf + inf) = NaN
def my_merge(a, b):
    (out_a, lse_a), (out_b, lse_b) = a, b                    # out (B, S, H, D), lse (B, H, S)
    lse = np.logaddexp(lse_a, lse_b)                         # -inf only where both are
    seen = np.where(np.isneginf(lse), 0.0, lse)              # subtract 0 where no key was seen
    w_a, w_b = (np.exp(x - seen).transpose(0, 2, 1)[..., None] for x in (lse_a, lse_b))   # (B, S, H, 1)
    return w_a * out_a + w_b * out_b, lse


# %%
def check_merge(merge_fn):
    """merge_fn on partial results of two key blocks, in both orders, against dense attention on
    both blocks; the keys 8..15 in two halves leave queries 0..7 with no visible key in either."""
    for blocks in ((slice(0, 8), slice(8, 16)), (slice(8, 12), slice(12, 16))):
        keys = np.arange(S)[blocks[0]].tolist() + np.arange(S)[blocks[1]].tolist()
        whole = attention(q, k[:, keys], v[:, keys], q_pos=pos, k_pos=pos[keys])
        parts = [attention(q, k[:, b], v[:, b], q_pos=pos, k_pos=pos[b]) for b in blocks]
        for x, y in (parts, parts[::-1]):
            out_m, lse_m = merge_fn(x, y)
            assert not np.isnan(out_m).any() and not np.isnan(lse_m).any()
            assert np.allclose(out_m, whole[0], rtol=0, atol=1e-12) and np.array_equal(np.isneginf(lse_m), np.isneginf(whole[1]))
            assert np.allclose(lse_m[np.isfinite(lse_m)], whole[1][np.isfinite(whole[1])], rtol=0, atol=1e-12)
    return True


print("my_merge merges:", check_merge(my_merge), "  and so does reference.merge:", check_merge(merge))

# %% [markdown]
# **What we have seen.** A device can attend to keys one block at a time, in any order,
# keeping three small arrays per query row, and the result equals dense attention to
# rounding; rows that see nothing in a block are harmless. Next, in
# `02_layouts`, we decide which device holds which tokens.
