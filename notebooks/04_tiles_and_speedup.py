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
# # 4. Tiles: how balance becomes speed
#
# Notebook 3 showed that striping balances the *visible pairs*. But a kernel does not
# skip single pairs: it cuts each (query block, key block) pair into tiles of
# `tq x tk` and skips a tile only when **no** pair in it is visible (paper, section 2.2.1).
# A tile is, by `reference.tiles.classify`:
#
# - **SKIP** when `max(pos_q) < min(pos_k)`: nothing visible, not computed;
# - **FULL** when `min(pos_q) >= max(pos_k)`: all visible, computed without a mask;
# - **MASKED** otherwise: computed, with the mask.
#
# So the speed-up depends on how many tiles a block has. This notebook works through the
# paper's example, sweeps the cost model (`reference.cost`) over N and tile size, and
# recomputes the paper's Theoretical Maximum Speedup table (section 4).
#
# Legend: `N` devices, `S` tokens, `c = S // N` tokens per device, `m = c / tile` tiles
# per block side.

# %%
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap

import reference.masks
from reference import cost, positions
from reference.tiles import FULL, MASKED, SKIP, classify
from reference.tms import critical_path_pairs, paper_rows

KIND_CMAP = ListedColormap(["black", "#55a868", "#dd8452"])   # SKIP, FULL, MASKED
KIND_NAMES = {SKIP: "skip", FULL: "full", MASKED: "masked"}

# %% [markdown]
# ## The paper's example (section 2.2.1)
#
# Tiles of `512 x 512`, blocks of `1536 x 1536` (nine tiles). A causal block on the
# diagonal has three fully visible tiles, three partly masked, and three fully masked:
# skipping those saves a third of the compute, not the half of the FLOPs that causality
# saves in principle. A fully visible block needs all nine.
#
# With `N = 4`, `S = 4 * 1536`, we classify the tiles of three blocks of **contiguous**
# (the own block in round 0, a past block, a future block) and two of **striped**
# (a block from an earlier device, one from a later device).

# %%
N, c, TILE = 4, 1536, 512
S = N * c
cont, strip = positions(S, N, "contiguous"), positions(S, N, "striped")
blocks = {
    "contiguous, own block": classify(cont[1], cont[1], TILE),
    "contiguous, past block": classify(cont[1], cont[0], TILE),
    "contiguous, future block": classify(cont[1], cont[2], TILE),
    "striped, earlier device": classify(strip[1], strip[0], TILE),
    "striped, later device": classify(strip[1], strip[2], TILE),
}

fig, axes = plt.subplots(1, len(blocks), figsize=(13, 3))
for ax, (name, kinds) in zip(axes, blocks.items()):
    ax.imshow(kinds, cmap=KIND_CMAP, vmin=-0.5, vmax=2.5)
    for (a, b), kind in np.ndenumerate(kinds):
        ax.text(b, a, KIND_NAMES[kind], ha="center", va="center", color="white", fontsize=8)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("key tile")
    ax.set_xticks(range(3)), ax.set_yticks(range(3))
axes[0].set_ylabel("query tile")
plt.show()

counts = {name: {KIND_NAMES[kd]: int((kinds == kd).sum()) for kd in KIND_NAMES} for name, kinds in blocks.items()}
for name, n in counts.items():
    print(f"{name:<26} {n}")

assert counts["contiguous, own block"] == {"skip": 3, "full": 3, "masked": 3}     # the paper's 33%
assert counts["contiguous, past block"] == {"skip": 0, "full": 9, "masked": 0}    # all nine
assert counts["contiguous, future block"] == {"skip": 9, "full": 0, "masked": 0}
# striping: every block looks like the diagonal one, whichever device it came from
assert counts["striped, earlier device"] == counts["striped, later device"] == {"skip": 3, "full": 3, "masked": 3}

# %% [markdown]
# So with contiguous blocks the skipping helps in round 0 only: after that, in every round
# some device holds a past block and computes all nine tiles. With striped blocks every
# device skips three tiles in every round. For this example the cost model predicts:

# %%
p_cont = cost.predict(S, N, "contiguous", TILE)
p_strip = cost.predict(S, N, "striped", TILE)
print("tiles computed per (round, device), contiguous:\n", p_cont.tiles_computed)
print("tiles computed per (round, device), striped:\n", p_strip.tiles_computed)
print(f"predicted speedup: {cost.speedup(S, N, 'striped', TILE):.3f}")

assert (p_strip.tiles_computed == 6).all()
assert (p_cont.tiles_computed.max(axis=1) == [6, 9, 9, 9]).all()
assert cost.speedup(S, N, "striped", TILE) == (6 + 9 * (N - 1)) / (6 * N)

# %% [markdown]
# ## Predicted speed-up against N and tile size
#
# The critical path is the sum over rounds of the busiest device's work. Counting work as
# the **area of the tiles computed** (mode `"tiles"`, what a tiled kernel pays) gives the
# speed-up of striped over contiguous as a function of `m = c / tile`, the number of tiles
# per block side, and of N only: the tile size itself drops out, so a tile of 8 keeps the
# sequences short. Zigzag (dotted, even `m` only: its two chunks per device must align
# with tiles) is drawn for comparison. Dashed: the ceiling `(2N - 1) / N`
# (`cost.striped_limit`).

# %%
TILE_SMALL = 8
ms = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
NS = (2, 4, 8)
by_tiles = {n: [cost.speedup(n * m * TILE_SMALL, n, "striped", TILE_SMALL, "tiles") for m in ms] for n in NS}
ms_even = [m for m in ms if m % 2 == 0]
zigzag = {n: [cost.speedup(n * m * TILE_SMALL, n, "zigzag", TILE_SMALL, "tiles") for m in ms_even] for n in NS}

fig, ax = plt.subplots(figsize=(7, 4))
for n, color in zip(NS, ["#4c72b0", "#dd8452", "#55a868"]):
    ax.plot(ms, by_tiles[n], "o-", color=color, label=f"N={n} striped, tiles")
    ax.plot(ms_even, zigzag[n], "x:", color=color, label=f"N={n} zigzag, tiles")
    ax.axhline(cost.striped_limit(n), color=color, ls="--", lw=0.8)
ax.plot([], [], "k--", lw=0.8, label="ceiling (2N - 1) / N")
ax.set_xscale("log", base=2)
ax.set_xticks(ms, ms)
ax.minorticks_off()
ax.set_xlabel("tiles per block side  m = c / tile")
ax.set_ylabel("predicted speed-up over contiguous")
ax.set_title("Whole tiles skipped: the speed-up grows with the tiles per block", fontsize=10)
ax.legend(fontsize=7, ncol=3)
plt.show()

for n in NS:
    assert by_tiles[n][0] == 1.0                                  # one tile per block: nothing to skip
    assert all(a < b for a, b in zip(by_tiles[n], by_tiles[n][1:]))   # more tiles, more skipped
    assert by_tiles[n][-1] > 0.95 * cost.striped_limit(n)          # 32 tiles: within 5% of the ceiling
assert by_tiles[2][-1] < by_tiles[4][-1] < by_tiles[8][-1]         # and more devices gain more
for n in NS:                                                       # zigzag: at least striped's
    assert all(z >= by_tiles[n][ms.index(m)] for m, z in zip(ms_even, zigzag[n]))

# %% [markdown]
# ## Closed forms, and exact skipping at realistic block sizes
#
# Each curve has a closed form. Write `u` for the unit that work is counted in: `u = T`
# (the tile size) when whole tiles are computed, `u = 1` when single pairs are skipped
# (mode `"pairs"`, a kernel that skips exactly). A causal square of side `c` then costs
# `c (c + u) / 2`: the triangle plus half a diagonal band of width `u`.
#
# | layout | busiest device, round 0 | busiest device, each round t >= 1 | critical path |
# | --- | --- | --- | --- |
# | contiguous | `c(c+u)/2` | `c^2` (a past block) | `c(c+u)/2 + (N-1) c^2` |
# | striped | `c(c+u)/2` | `c(c+u)/2` (a triangle, every round) | `N c(c+u)/2` |
# | zigzag | `c(c+u)/2` | `c^2/2` (two of its four chunk squares, no diagonal) | `N c^2/2 + c u/2` |
#
# so, with `A = (2N - 1) c`,
#
# $$\text{striped: } \frac{A + u}{N (c + u)}, \qquad \text{zigzag: } \frac{A + u}{N c + u},
# \qquad \text{both} \to \frac{2N - 1}{N}.$$
#
# Striped pays a diagonal band in **every** round (every block is a triangle), zigzag only
# in round 0. The difference is `(N - 1) c u / 2`: with tiles (`u = T`) that is
# `(N-1)/2` tile rows of the block, with exact skipping (`u = 1`) it is `(N-1)/2` pairs per
# query row, nothing at any real block size.
#
# The curves above use blocks of 8 to 256 tokens. Real blocks are thousands of tokens
# (the paper's smallest is 4096 per device). Below, tiles of 128 and blocks of 512 to
# 16384 tokens: the cost model, counted from positions, against the closed forms, exactly.
# The cost model classifies every tile of every (round, device) block with
# `reference.tiles.classify` and counts them: `reference.cost.predict` deals the positions of
# a layout and hands them to `reference.cost.predict_positions`, which does the counting:

# %%
import inspect

from reference import tiles

print(inspect.getsource(tiles.classify))
print(inspect.getsource(cost.predict_positions))

# %%
T_REAL = 128
cs = [512, 1024, 2048, 4096, 8192, 16384]
curves = {}                                   # (N, layout, mode) -> speedups over cs
for n in (4, 8):
    for c_ in cs:
        crit = {(layout, mode): cost.predict(n * c_, n, layout, T_REAL).critical_path(mode)
                for layout in ("contiguous", "striped", "zigzag") for mode in cost.MODES}
        for mode, u in [("tiles", T_REAL), ("pairs", 1)]:
            assert crit["contiguous", mode] == c_ * (c_ + u) // 2 + (n - 1) * c_ * c_
            assert crit["striped", mode] == n * c_ * (c_ + u) // 2
            assert crit["zigzag", mode] == n * c_ * c_ // 2 + c_ * u // 2
            for layout in ("striped", "zigzag"):
                curves.setdefault((n, layout, mode), []).append(crit["contiguous", mode] / crit[layout, mode])

fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
for ax, n in zip(axes, (4, 8)):
    for (layout, mode), style in {("striped", "tiles"): "o-", ("zigzag", "tiles"): "x:",
                                  ("striped", "pairs"): "s-", ("zigzag", "pairs"): "+--"}.items():
        ax.plot(cs, curves[n, layout, mode], style, label=f"{layout}, {'tiles of 128' if mode == 'tiles' else 'exact skipping'}")
    ax.axhline(cost.striped_limit(n), color="k", ls="--", lw=0.8, label="ceiling (2N - 1) / N")
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, cs)
    ax.minorticks_off()
    ax.set_xlabel("tokens per device c")
    ax.set_title(f"N = {n} devices", fontsize=9)
axes[0].set_ylabel("predicted speed-up over contiguous")
axes[0].legend(fontsize=8)
plt.show()

for n in (4, 8):
    for i, c_ in enumerate(cs):
        A = (2 * n - 1) * c_
        assert np.isclose(curves[n, "striped", "tiles"][i], (A + T_REAL) / (n * (c_ + T_REAL)), rtol=1e-12)
        assert np.isclose(curves[n, "zigzag", "tiles"][i], (A + T_REAL) / (n * c_ + T_REAL), rtol=1e-12)
        assert np.isclose(curves[n, "striped", "pairs"][i], (A + 1) / (n * (c_ + 1)), rtol=1e-12)
        # with tiles larger than 2N, striped with exact skipping beats zigzag with tiles
        assert curves[n, "striped", "pairs"][i] > curves[n, "zigzag", "tiles"][i]
        # and with the same kind of kernel zigzag is ahead, by less than 1/m of the ceiling
        assert curves[n, "striped", "tiles"][i] < curves[n, "zigzag", "tiles"][i]
        assert curves[n, "zigzag", "tiles"][i] - curves[n, "striped", "tiles"][i] < cost.striped_limit(n) * T_REAL / c_

# %% [markdown]
# So zigzag with tiles beats striped with exact skipping only while `T <= 2N`, and only
# with tiles that line up with its chunks (expand the two closed forms, which assume they
# do: the sign of the difference is that of `c (2N - T) + T`, still positive at `T = 2N`,
# by the margin `T`). A tile that cuts across zigzag's chunks (6 or 7 at N = 4) loses
# already. That is the tiny-tile corner the first plot lives in. At the same tile size zigzag is ahead of
# striped by the diagonal band striped computes every round: a few percent at 16 tiles per
# block, under 1% at 128; both reach the same ceiling. What striping has for it is that its
# balance needs no alignment: any `c`, any tile, every round the same triangle.

# %%
for tile in (2, 4, 6, 7, 8, 16, 32):                              # N = 4, c = 256: the sign of c (2N - T) + T
    zig_tiles, str_pairs = (cost.speedup(4 * 256, 4, layout, tile, mode) for layout, mode in [("zigzag", "tiles"), ("striped", "pairs")])
    lines_up = 128 % tile == 0                                    # zigzag's chunks hold c / 2 = 128 tokens
    assert (zig_tiles > str_pairs) == (lines_up and 256 * (2 * 4 - tile) + tile > 0), tile

# %% [markdown]
# ## Communication against compute
#
# The ring hides a transfer only if the round's compute lasts at least as long as sending
# the next block. The message is the same for every layout: each round every device sends
# its `K, V` block, `2 c H D` numbers (plus `c` positions), whichever tokens they are. The
# virtual ring's trace says so:

# %%
from reference import ring_attention

rng = np.random.default_rng(0)
q_, k_, v_ = (rng.standard_normal((1, 64, 2, 8)) for _ in range(3))      # (B, S, H, D)
sent = {layout: ring_attention(q_, k_, v_, n_devices=4, layout=layout, tile_size=4, trace=True)[2].bytes_sent
        for layout in ("contiguous", "striped", "zigzag")}
print("bytes sent per (round, device), striped:\n", sent["striped"])
assert all((b == sent["striped"]).all() for b in sent.values())
assert (sent["striped"][:-1] == 2 * 16 * 2 * 8 * 8 + 16 * 8 + 8).all()   # K, V (float64), positions, owner

# %% [markdown]
# The compute is not. After round 0 contiguous's round lasts as long as its busiest device,
# which holds a full past block, `c^2` pairs; striping halves that to `c(c+T)/2`. With
# attention costing `4 D` FLOPs per (query, key) pair and head at `F` FLOP/s, and a link of
# `B` bytes/s carrying `b`-byte numbers, a round of work `w` hides its transfer when
#
# $$\frac{4 D H\, w}{F} \ge \frac{2 c H D\, b}{B} \iff w \ge c\, r, \qquad r = \frac{b F}{2 B}\ \text{tokens},$$
#
# so contiguous hides it from `c >= r` and striped from `c >= 2r - T`: **the block size
# needed to hide a transfer doubles** (zigzag's `c^2/2` needs `c >= 2r`). Striping removes
# the idle devices, and with them the slack that hid the communication. For illustration
# take `F = 150` TFLOP/s in attention, `B = 25` GB/s per direction (one 200 Gb/s
# InfiniBand HDR port, a link between nodes) and bfloat16 (`b = 2`): `r = 6000` tokens.

# %%
F_ATTN, LINK, WORD = 150e12, 25e9, 2             # FLOP/s, bytes/s, bytes per number (assumed)
r = WORD * F_ATTN / (2 * LINK)                   # tokens
H_, D_, N_, T_ = 8, 128, 4, 128
cs_comm = np.arange(1024, 16384 + 1, 512)
compute_ms, hidden_from = {}, {}
for layout in ("contiguous", "striped", "zigzag"):
    # busiest device's work in the rounds that send and are not round 0: t = 1 .. N-2
    work = np.array([cost.predict(N_ * c_, N_, layout, T_REAL).tile_area[1:N_ - 1].max() for c_ in cs_comm])
    compute_ms[layout] = 4 * D_ * H_ * work / F_ATTN * 1e3
    transfer_ms = 2 * cs_comm * H_ * D_ * WORD / LINK * 1e3
    hidden_from[layout] = int(cs_comm[np.argmax(compute_ms[layout] >= transfer_ms)])

fig, ax = plt.subplots(figsize=(7, 3.5))
for layout, style in [("contiguous", "o-"), ("striped", "s-"), ("zigzag", "x:")]:
    ax.plot(cs_comm, compute_ms[layout], style, ms=3, label=f"compute, busiest device: {layout}")
ax.plot(cs_comm, transfer_ms, "k--", label="transfer of one K, V block (every layout)")
ax.set_xlabel("tokens per device c")
ax.set_ylabel("ms per round (rounds t >= 1)")
ax.set_title("A round hides its transfer above the dashed line (assumed: 150 TFLOP/s, 25 GB/s, bf16)", fontsize=9)
ax.legend(fontsize=8)
plt.show()
print(f"r = {r:.0f} tokens; transfer hidden from c = {hidden_from}")

assert abs(hidden_from["contiguous"] - r) < 512                  # c >= r, on a grid of 512
assert abs(hidden_from["striped"] - (2 * r - T_REAL)) < 512     # c >= 2r - T
assert abs(hidden_from["zigzag"] - 2 * r) < 512                 # c >= 2r

# %% [markdown]
# ### The paper's hardware (section 3.2)
#
# On TPUs the tile was `2048 x 2048`; on A100s, `2048` queries by `4096` keys. At the
# smallest per-device block, `4096`, the paper says striping saves 25% of the attention
# FLOPs on TPUs and nothing on GPUs. The cost model agrees:

# %%
c_small, N8 = 4096, 8
for name, tile, saved in [("TPU", (2048, 2048), 0.25), ("A100", (2048, 4096), 0.0)]:
    p = cost.predict(N8 * c_small, N8, "striped", tile)
    area = p.tile_area.max(axis=1)                               # busiest device per round
    print(f"{name}: busiest striped device computes {area.max() / c_small**2:.0%} of a block every round; "
          f"speedup {cost.speedup(N8 * c_small, N8, 'striped', tile):.3f}")
    assert (area == (1 - saved) * c_small ** 2).all()

# %% [markdown]
# ## The Theoretical Maximum Speedup, recomputed (section 4)
#
# The paper bounds the end-to-end training speed-up by counting FLOPs on the critical path,
# attention and the rest of the model (projections, MLP, LM head), assuming perfect
# overlap and element-exact skipping. Per device and layer, with `d` the model width, `f`
# the MLP width, `V` the vocabulary, `L` the layers and `h` the cost of an attention FLOP
# against a linear-layer FLOP (2 on the paper's A100s, where attention ran in TF32 and the
# rest in bfloat16; 1 on TPUs):
#
# $$F_\text{lin} = c\,(8d^2 + 4df + 2dV/L), \qquad
# \text{TMS} = \frac{F_\text{lin} + 4dh\,P_\text{ring}}{F_\text{lin} + 4dh\,P_\text{striped}},$$
#
# $$P_\text{ring} = \frac{c(c+1)}{2} + (N-1)\,c^2, \qquad P_\text{striped} = N\,\frac{c(c+1)}{2},$$
#
# the `P` being the critical path in visible (query, key) pairs: round 0's causal block,
# then a full block in every round for Ring Attention, a triangle with its diagonal in
# every round for striped. `reference.tms` implements it (its docstring says where each
# constant comes from) and recomputes every TMS the paper prints (Tables 3, 4, 5 and
# Appendix A), typed in `reference/data/paper_tms.csv`.
#
# Its attention term is the critical path in visible pairs, the same count the cost model
# makes from positions:

# %%
for n, cc in [(2, 16), (4, 32), (8, 24)]:
    ring_pairs, striped_pairs = critical_path_pairs(n, cc)
    assert ring_pairs == cost.predict(n * cc, n, "contiguous").critical_path("pairs")
    assert striped_pairs == cost.predict(n * cc, n, "striped").critical_path("pairs")
    assert (ring_pairs, striped_pairs) == (cc * (cc + 1) // 2 + (n - 1) * cc * cc, n * cc * (cc + 1) // 2)

# %%
rows = paper_rows()
diff = np.array([r["tms_recomputed"] - r["tms"] for r in rows])
print(f"{len(rows)} rows; largest |recomputed - paper| = {np.abs(diff).max():.4f}\n")
print("TMS as the paper prints it and as recomputed; the speed-up the paper measured on its hardware")
print(f"{'table':>5} {'hw':>5} {'model':>5} {'mesh':>5} {'n_seq':>7} {'TMS paper':>9} {'ours':>6} {'paper measured':>14}")
for r in rows:
    if r["table"] == "3":
        print(f"{r['table']:>5} {r['hardware']:>5} {r['model']:>5} {r['model_parallel']}x{r['seq_parallel']:<3} "
              f"{r['n_seq']:>7} {r['tms']:>9.2f} {r['tms_recomputed']:>6.3f} {r['speedup']:>14.2f}")

assert np.abs(diff).max() < 0.01

# %% [markdown]
# Left: every recomputed TMS against the paper's. Right: for Table 3 (A100, mesh 2 x 4),
# the TMS and the speed-up the paper measured against sequence length: the bound rises with
# the block size, and the paper's measurements follow below it.

# %%
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 4))
paper = np.array([r["tms"] for r in rows])
ours = np.array([r["tms_recomputed"] for r in rows])
ax0.plot(paper, ours, ".", alpha=0.6)
ax0.plot([1, 2], [1, 2], "k-", lw=0.5)
ax0.set_xlabel("TMS printed in the paper")
ax0.set_ylabel("TMS recomputed (reference.tms)")
ax0.set_title(f"{len(rows)} rows, max |diff| {np.abs(diff).max():.4f}", fontsize=9)

for model in ("1B", "3B", "7B"):
    sel = [r for r in rows if r["table"] == "3" and r["model"] == model]
    n_seq = [r["n_seq"] for r in sel]
    line, = ax1.plot(n_seq, [r["tms_recomputed"] for r in sel], "-", label=f"{model} TMS")
    ax1.plot(n_seq, [r["speedup"] for r in sel], "o--", color=line.get_color(), label=f"{model} measured by the paper")
ax1.set_xscale("log", base=2)
ax1.set_xlabel("sequence length (tokens)")
ax1.set_ylabel("speed-up over Ring Attention")
ax1.set_title("paper Table 3: A100, mesh 2 x 4 (TMS: solid)", fontsize=9)
ax1.legend(fontsize=7)
plt.show()

table3 = [r for r in rows if r["table"] == "3"]
assert all(r["speedup"] < r["tms"] for r in table3)      # the bound holds for every one of the paper's measurements

# %% [markdown]
# ## Sliding windows: when contiguous wins
#
# With a sliding window of `W` tokens, a query sees only the previous `W` keys, itself
# included (`reference.masks`: `pos_q - W < pos_k <= pos_q`). Tiles are classified exactly
# from positions, as always. Under **contiguous**, a block far behind the queries lies wholly
# outside every window, so in most rounds a device computes nothing (the block still
# travels). Under **striped**, every block holds keys next to every query, so no round is
# empty; and each tile spans `N` times as many positions as it has rows (`tile * N = 512`
# here), more than the window: the tiles near the block's diagonal are all partly visible,
# computed with a mask, and the others skipped, in every round.
#
# `S = 4096`, `N = 4`, tiles of `128 x 128`, `W = 256`: the tiles of device 1 in each round.

# %%
S_W, N_W, TILE_W, W = 4096, 4, 128, 256
window_mask = reference.masks.make_mask(window=W)
fig, axes = plt.subplots(2, N_W, figsize=(10, 5.4))
for row, layout in enumerate(("contiguous", "striped")):
    pos_w = positions(S_W, N_W, layout)
    for t in range(N_W):
        kinds = classify(pos_w[1], pos_w[(1 - t) % N_W], TILE_W, window_mask)
        axes[row, t].imshow(kinds, cmap=KIND_CMAP, vmin=0, vmax=2)
        axes[row, t].set_title(f"{layout}, round {t}:\n{int((kinds != SKIP).sum())} of {kinds.size} tiles computed",
                               fontsize=8)
        axes[row, t].set_xticks([])
        axes[row, t].set_yticks([])
        axes[row, t].set_xlabel("key tiles", fontsize=8)
    axes[row, 0].set_ylabel("query tiles of device 1", fontsize=8)
plt.suptitle(f"window W = {W}: black skipped, green full (no mask), orange partly visible (masked)", fontsize=10)
plt.show()

win = {layout: cost.predict(S_W, N_W, layout, TILE_W, window=W) for layout in ("contiguous", "striped")}
print("tiles computed per round (rows) and device (columns)")
for layout, p in win.items():
    print(layout, p.tiles_computed.tolist())
kinds_striped = classify(positions(S_W, N_W, "striped")[1], positions(S_W, N_W, "striped")[0], TILE_W, window_mask)
print("striped, device 1, round 1:", {KIND_NAMES[kd]: int((kinds_striped == kd).sum()) for kd in KIND_NAMES})
assert (win["contiguous"].tiles_computed[2:] == 0).all()        # rounds 2 and 3: nothing visible
assert (win["contiguous"].tiles_computed[:2].max(axis=1) == [21, 3]).all()
assert (win["striped"].tiles_computed == 15).all()              # striped: 15 of 64, every round, every device
assert (kinds_striped == FULL).sum() == 0 and (kinds_striped == MASKED).sum() == 15   # all partly visible

# %% [markdown]
# Which layout wins depends on `W` against the block `c = S / N` and the tile: the cost
# model's speed-up of striped over contiguous, in tiles (what a tiled kernel pays) and in
# visible pairs (element-exact skipping). In pairs the layouts tie for short windows (each
# does about `c W` pairs on its critical path) and striped pulls ahead as `W` approaches
# `S`, where the window is the plain causal mask; in tiles, striped loses until the window
# is long against `tile * N`. `python -m bench.masks` prints the same at larger sizes.

# %%
ws = [64, 128, 256, 512, 1024, 2048, 4096]
by_tiles = [cost.speedup(S_W, N_W, "striped", TILE_W, window=w) for w in ws]
by_pairs = [cost.speedup(S_W, N_W, "striped", TILE_W, "pairs", window=w) for w in ws]
plt.figure(figsize=(6, 3.5))
plt.plot(ws, by_tiles, "o-", label=f"a kernel skipping whole tiles of {TILE_W}")
plt.plot(ws, by_pairs, "s--", label="a kernel skipping single pairs (exact)")
plt.axhline(1, color="k", lw=0.5)
plt.xscale("log", base=2)
plt.xlabel("window W (tokens)")
plt.ylabel("predicted striped speed-up\nover contiguous")
plt.title(f"Sliding window: S = {S_W}, N = {N_W}; below 1, contiguous is faster", fontsize=9)
plt.legend(fontsize=8)
plt.show()
assert by_tiles[0] < 1 < by_tiles[-1]                            # contiguous wins short windows
assert by_tiles[-1] == cost.speedup(S_W, N_W, "striped", TILE_W)  # W = S: plain causal attention

# %% [markdown]
# ## Exercises
#
# Work each out by hand first; the cell under it (collapsed in Jupyter: click to open) holds
# the answer and checks it against the project.
#
# 1. Striped on `N = 4` devices, blocks of `m = 4` tiles per side, whole tiles computed: what
#    speed-up over contiguous does the cost model predict? (Use the closed form.)
# 2. What is the ceiling of striped's speed-up on 8 devices?
# 3. The link doubles to 50 GB/s, everything else as in "Communication against compute":
#    from which block size `c` does striped hide its transfer, with tiles of 128?
# 4. Write it: `my_tiles_computed(q_pos, k_pos, T)`, how many of the `(c / T)^2` tiles of one
#    (query block, key block) pair a causal kernel computes, from the positions alone (tiles of
#    `T x T` in local order; a tile is skipped when no pair in it is visible). The cell after
#    the answers checks it against the cost model for every round and device of every layout.

# %% jupyter={"source_hidden": true}
# 1. u = T, c = 4T, A = (2N - 1) c = 28T: (A + u) / (N (c + u)) = 29T / 20T = 1.45
answer_1 = 1.45
assert np.isclose(cost.speedup(4 * 4 * TILE_SMALL, 4, "striped", TILE_SMALL, "tiles"), answer_1)

# 2. (2N - 1) / N = 15 / 8
answer_2 = 1.875
assert cost.striped_limit(8) == answer_2

# 3. r = b F / (2 B) = 2 x 150e12 / 1e11 = 3000 tokens; striped from c >= 2r - T = 5872
answer_3 = 5872
assert 2 * (WORD * F_ATTN / (2 * 50e9)) - T_REAL == answer_3
c_hide = np.arange(T_REAL, 16384 + 1, T_REAL)       # the first block size, in tiles of 128, that hides it
work = np.array([cost.predict(N_ * c_, N_, "striped", T_REAL).tile_area[1:N_ - 1].max() for c_ in c_hide])
hides = 4 * D_ * H_ * work / F_ATTN >= 2 * c_hide * H_ * D_ * WORD / 50e9
assert abs(c_hide[np.argmax(hides)] - answer_3) < T_REAL



# 4. a tile is skipped iff its latest query comes before its earliest key: max(pos_q) < min(pos_k)
def my_tiles_computed(q_pos, k_pos, T):
    q_tiles, k_tiles = q_pos.reshape(-1, T), k_pos.reshape(-1, T)          # (c / T, T): one row per tile
    return int((q_tiles.max(axis=1)[:, None] >= k_tiles.min(axis=1)[None, :]).sum())


# %%
def check_tiles_computed(count_fn):
    """count_fn(q_pos, k_pos, T) for every (round, device) block against `cost.predict`."""
    for S_, N_, T_ in [(64, 4, 4), (96, 3, 8), (128, 8, 2)]:
        for layout in ("contiguous", "striped", "zigzag"):
            pos = positions(S_, N_, layout)                                 # (N, c)
            expected = cost.predict(S_, N_, layout, T_).tiles_computed      # (rounds, devices)
            for (t, j), n in np.ndenumerate(expected):
                assert count_fn(pos[j], pos[(j - t) % N_], T_) == n, (layout, S_, N_, T_, t, j)
    return True


print("my_tiles_computed counts as the cost model does:", check_tiles_computed(my_tiles_computed))

# %% [markdown]
# **What we have seen.** Striped blocks skip the same fraction of tiles in every round, so
# the speed-up grows with the number of tiles per block, from none at one tile to close to
# `(2N - 1) / N`; the paper's 33% and 25% examples and its whole TMS table follow from
# counting. Next, `05_backward`: the same ring, run backwards.
