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
# # 2. Layouts: which device holds which token
#
# Ring Attention (Liu et al. 2023) cuts the sequence into N contiguous blocks, one per
# device. Each device keeps its queries and, round by round, attends them to every
# device's keys as the key/value blocks travel around the ring (paper, section 2.2 and
# Algorithm 1): in round `t`, device `j` holds the block that started on device
# `(j - t) mod N`.
#
# Striped Attention changes only **which tokens each device holds**. This notebook draws
# the three layouts of `reference.layouts` and, for each round, which device computes
# which (query, key) pair: the paper's Figures 2, 3 and 4.
#
# Legend: `N` devices, `S` tokens, `c = S // N` tokens per device.

# %%
import inspect

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from reference import LAYOUTS, cost, layouts, positions, shard, unshard
from reference.layouts import inverse_positions
from reference.tiles import visible

S, N = 16, 4              # the paper's figures: 16 tokens on 4 devices
c = S // N
COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]   # one colour per device
DEVICE_CMAP = ListedColormap(COLORS)

# %% [markdown]
# ## Three layouts
#
# `positions(S, N, layout)` is an `(N, c)` array: row `j` lists the global positions held
# by device `j`, in its local order.
#
# - **contiguous** (Ring Attention): device `r` holds `r*c .. (r+1)*c - 1`;
# - **striped** (the paper): device `r` holds `r, r+N, r+2N, ...`, tokens dealt round-robin;
# - **zigzag** (common in practice): `2N` chunks, device `r` holds chunk `r` and chunk `2N-1-r`.

# %% [markdown]
# The permutation is named once, in `reference/layouts.py`; everything else asks it. Here
# is the code, the worked example of its docstring included:

# %%
print(inspect.getsource(layouts.positions))

# %%
for layout in LAYOUTS:
    print(f"{layout:<11}", "  ".join(f"dev{j} {p}" for j, p in enumerate(positions(S, N, layout))))

# %% [markdown]
# Its inverse says where each global position lives in the concatenation of all shards;
# `unshard` uses it to put the tokens back in natural order:

# %%
print(inspect.getsource(layouts.inverse_positions))

# %%
for layout in LAYOUTS:
    flat, index = positions(S, N, layout).ravel(), inverse_positions(S, N, layout)
    assert (flat[index] == np.arange(S)).all() and (index[flat] == np.arange(S)).all()
# the docstring's example, S=8, N=4, striped
print("positions flattened", positions(8, 4, "striped").ravel(), " inverse", inverse_positions(8, 4, "striped"))
assert positions(8, 4, "striped").ravel().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
assert inverse_positions(8, 4, "striped").tolist() == [0, 2, 4, 6, 1, 3, 5, 7]

# %%
owner = {}
for layout in LAYOUTS:
    pos = positions(S, N, layout)                           # (N, c)
    owner[layout] = np.empty(S, dtype=int)
    owner[layout][pos] = np.arange(N)[:, None]              # owner[p] = the device holding p
    # every position is held by exactly one device
    assert sorted(pos.ravel()) == list(range(S))

assert (owner["contiguous"] == np.arange(S) // c).all()
assert (owner["striped"] == np.arange(S) % N).all()

fig, axes = plt.subplots(1, len(LAYOUTS), figsize=(11, 2.4), layout="constrained")
for ax, layout in zip(axes, LAYOUTS):
    pos = positions(S, N, layout)                           # (N, c)
    ax.imshow(pos, cmap="viridis", vmin=0, vmax=S - 1)      # colour = position: early dark, late light
    for (j, i), p in np.ndenumerate(pos):
        ax.text(i, j, str(p), ha="center", va="center", color="white" if p < S / 2 else "black")
    ax.set_yticks(range(N), [f"device {j}" for j in range(N)])
    ax.set_xticks(range(c))
    ax.set_xlabel("local index on the device")
    ax.set_title(layout, fontsize=10)
fig.suptitle("the global position of each device's tokens (colour: early to late)", fontsize=10)
plt.show()

# %% [markdown]
# `shard` cuts an array in natural token order into the N shards of a layout, and
# `unshard` puts them back. Positions travel with the tokens: the shard of device `j`
# holds exactly the tokens `positions(S, N, layout)[j]`.

# %%
x = np.arange(S)[None, :, None, None] * 1.0                 # (B=1, S, H=1, D=1): token i holds i
for layout in LAYOUTS:
    shards = shard(x, N, layout)                            # N arrays (1, c, 1, 1)
    assert all((s.ravel() == p).all() for s, p in zip(shards, positions(S, N, layout)))
    assert (unshard(shards, layout) == x).all()

# %% [markdown]
# ## Each device's mask in each round (Figures 2 and 3)
#
# In round `t`, device `j` attends its queries (positions `pos[j]`) to the keys of device
# `k = (j - t) mod N`. Its mask is computed from positions,
# `visible(pos[j], pos[k]) = pos[j][:, None] >= pos[k][None, :]`, a `c x c` square.
#
# As in the paper, one picture per layout: a row per round, a column per device, and under
# each the square mask of that device in that round, its rows labelled with the positions
# of the device's queries and its columns with the positions of the keys it holds. Black is
# masked (skippable), the device's colour is work it must do. Contiguous is the paper's
# Figure 2 (Ring Attention), striped its Figure 3.

# %%
def block_masks(layout):
    """mask[t][j]: the (c, c) visibility of device j's queries to the block it holds in round t."""
    pos = positions(S, N, layout)
    return [[visible(pos[j], pos[(j - t) % N]) for j in range(N)] for t in range(N)]


masks = {layout: block_masks(layout) for layout in LAYOUTS}

for layout, figure in [("contiguous", "Figure 2"), ("striped", "Figure 3"), ("zigzag", "not in the paper")]:
    pos = positions(S, N, layout)
    fig, axes = plt.subplots(N, N, figsize=(7, 7.4), layout="constrained")
    for t in range(N):
        for j in range(N):
            ax, k = axes[t, j], (j - t) % N
            ax.imshow(masks[layout][t][j], cmap=ListedColormap(["black", COLORS[j]]), vmin=0, vmax=1)
            ax.set_yticks(range(c), pos[j], fontsize=7)           # device j's query positions
            ax.set_xticks(range(c), pos[k], fontsize=7)           # positions of the keys it holds
            ax.tick_params(length=0)
            if t == 0:
                ax.set_title(f"device {j}", fontsize=9)
            if j == 0:
                ax.set_ylabel(f"round {t}\nquery", fontsize=9)
            if t == N - 1:
                ax.set_xlabel("key", fontsize=8)
    fig.suptitle(f"{layout} ({figure}): each device's mask in each round, black = masked", fontsize=10)
    plt.show()

# %% [markdown]
# What the pictures show, as asserts. For **contiguous** (Ring Attention's `GetMask`):
# the own block is a triangle, a block from an earlier device is fully visible, and a
# block from a later device is fully masked. So in every round after the first, some
# device has a full block of work while another has none, and the round waits for the
# busiest.

# %%
tri = np.tril(np.ones((c, c), dtype=bool))          # y <= x: the diagonal included
strict = np.tril(np.ones((c, c), dtype=bool), -1)   # y < x
for t in range(N):
    for j in range(N):
        k = (j - t) % N
        m = masks["contiguous"][t][j]
        expected = tri if j == k else np.ones_like(tri) if j > k else np.zeros_like(tri)
        assert (m == expected).all()

# %% [markdown]
# For **striped** (the paper's `GetMaskStripedAttention`): query `x` of device `j` is at
# position `x*N + j`, key `y` of device `k` at `y*N + k`, and `y*N + k <= x*N + j` holds iff
# `y < x`, or `y == x` and `k <= j`. So every mask is a triangle: with the diagonal when
# `j >= k`, without it when `j < k`. Every device has about half a block of work in
# every round. (Each strict triangle has a first row with no visible key: the case
# notebook 1 showed is harmless.)

# %%
for t in range(N):
    for j in range(N):
        k = (j - t) % N
        assert (masks["striped"][t][j] == (tri if j >= k else strict)).all()
        # the paper's Work(i, j) = c(c+1)/2 if i >= j else c(c-1)/2 (section 2.2)
        assert masks["striped"][t][j].sum() == cost.paper_work(j, k, c)

# %% [markdown]
# ## The (query, key) grid coloured by device (Figure 4)
#
# The same thing seen from the whole `S x S` attention matrix, in natural token order:
# a cell is coloured by the device that computes that (query, key) pair in that round;
# white cells are not computed that round (black: masked by causality, never computed).

# %%
def round_grid(layout, t):
    """(S, S) grid: the device computing pair (q, k) in round t, -1 if masked, NaN if not this round."""
    pos = positions(S, N, layout)
    grid = np.full((S, S), np.nan)
    for j in range(N):
        keys = pos[(j - t) % N]
        grid[np.ix_(pos[j], keys)] = j
    grid[~visible(np.arange(S), np.arange(S))] = -1
    return grid


cmap = ListedColormap(["black"] + COLORS)
cmap.set_bad("white")
fig, axes = plt.subplots(len(LAYOUTS), N, figsize=(11, 8.6), layout="constrained")
for row, layout in enumerate(LAYOUTS):
    for t in range(N):
        ax = axes[row, t]
        ax.imshow(round_grid(layout, t), cmap=cmap, vmin=-1.5, vmax=N - 0.5)
        ax.set_xticks(range(0, S, 2)), ax.set_yticks(range(0, S, 2))
        ax.tick_params(labelsize=7)
        ax.set_title(f"{layout}, round {t}", fontsize=9)
        if t == 0:
            ax.set_ylabel("query position")
        if row == len(LAYOUTS) - 1:
            ax.set_xlabel("key position")
legend = [Patch(color=COLORS[j], label=f"computed by device {j}") for j in range(N)]
legend += [Patch(color="black", label="masked (key after query)"),
           Patch(facecolor="white", edgecolor="grey", label="computed in another round")]
fig.legend(handles=legend, loc="outside lower center", ncol=3, fontsize=9)
plt.show()

# %% [markdown]
# Over all rounds and devices, every visible pair is computed exactly once, whatever the
# layout: the layouts differ only in **when** and **where** each pair is computed. The
# visible pairs per device and round (what the grids count) show the balance.

# %%
causal = visible(np.arange(S), np.arange(S))
for layout in LAYOUTS:
    pos = positions(S, N, layout)
    times_computed = np.zeros((S, S), dtype=int)
    for t in range(N):
        for j in range(N):
            times_computed[np.ix_(pos[j], pos[(j - t) % N])] += 1
    assert (times_computed == 1).all()                       # every pair in exactly one (t, j)

    work = np.array([[masks[layout][t][j].sum() for j in range(N)] for t in range(N)])   # (t, j)
    assert work.sum() == causal.sum()
    print(f"{layout:<11} visible pairs per (round, device):", work.tolist(),
          f" busiest per round: {work.max(axis=1).tolist()}")

# %% [markdown]
# ## Exercises
#
# Work each out by hand first. Exercise 2 asks for a prediction, then a run: change the
# parameter in the cell under the list and run it. The answers are in the cell after it
# (collapsed in Jupyter: click to open), checked against the project.
#
# 1. `S = 24` tokens on `N = 4` devices, striped. Which device holds token 13, and at
#    which local index?
# 2. Zigzag, `S = 32`, `N = 4` (twice the tokens of the pictures): predict how many visible
#    pairs each device computes in round 1, and say why it is the same number for every
#    device; then set `S_TRY = 32` in the cell below and run it.
# 3. Striped, `S = 4096`, `N = 8`: how many visible pairs does the busiest device compute
#    in each round? And contiguous's busiest device in round 1?
# 4. Write it: `my_owner(p, S, N, layout)`, the device that holds global position `p` and its
#    local index there, for each of the three layouts, from their definitions above (with `S` a
#    multiple of `2N`). The cell after the answers checks it against `positions` for every
#    position of several sizes.

# %%
S_TRY = 32                                       # exercise 2: tokens (a multiple of 2N = 8)
zigzag_round_1 = cost.predict(S_TRY, N, "zigzag").pairs[1]          # (devices,) visible pairs
print(f"zigzag, S = {S_TRY}, N = {N}, round 1: visible pairs per device {zigzag_round_1.tolist()}")

# %% jupyter={"source_hidden": true}
# 1. 13 = 3 * 4 + 1: device 13 mod 4 = 1, local index 13 // 4 = 3
answer_1 = (1, 3)
assert positions(24, 4, "striped")[answer_1] == 13

# 2. c = 8 tokens in two chunks of 4; from round 1 on, the block held is half past and half
#    future chunk by chunk: two of its four chunk-squares are fully visible, c^2 / 2 = 32 pairs
answer_2 = (S_TRY // N) ** 2 // 2
assert (zigzag_round_1 == answer_2).all()

# 3. c = 512; every round some device holds a block from a device before it (the diagonal
#    included): c (c + 1) / 2 = 131328. Contiguous, round 1: a full past block, c^2 = 262144
answer_3 = (131328, 262144)
assert (cost.predict(4096, 8, "striped").pairs.max(axis=1) == answer_3[0]).all()
assert cost.predict(4096, 8, "contiguous").pairs[1].max() == answer_3[1]



# 4. contiguous: blocks of c; striped: dealt round-robin; zigzag: 2N chunks of c / 2, chunk k on
#    device k (first half of its tokens) or, for k >= N, on device 2N - 1 - k (second half)
def my_owner(p, S, N, layout):
    c = S // N
    if layout == "contiguous":
        return p // c, p % c
    if layout == "striped":
        return p % N, p // N
    half = c // 2
    chunk = p // half
    return (chunk, p % half) if chunk < N else (2 * N - 1 - chunk, half + p % half)


# %%
def check_owner(owner_fn):
    """owner_fn(p, S, N, layout) -> (device, local index), against `positions` for every position."""
    for S_, N_ in [(16, 4), (24, 2), (64, 8), (48, 3)]:
        for layout in LAYOUTS:
            pos = positions(S_, N_, layout)                        # (N, c): pos[device, local]
            for p in range(S_):
                device, local = owner_fn(p, S_, N_, layout)
                assert pos[device, local] == p, (layout, S_, N_, p, device, local)
    return True


print("my_owner finds every token:", check_owner(my_owner))

# %% [markdown]
# **What we have seen.** Contiguous blocks put all of a round's work on some devices and
# none on others; striping (and zigzag) gives every device about half a block every round.
# The total work is the same. Next, `03_the_ring` runs the ring and records this work.
