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
# # 0. Why a ring: memory as the sequence grows
#
# Striped Attention (Brandon et al. 2023) is a faster way of running *Ring Attention*
# (Liu et al. 2023) for causal models. Before how, this notebook says why anyone spreads one
# attention over several devices at all: because of memory. We measure what attention and
# a model keep as the sequence grows, see what one device can hold, cut the sequence over
# devices, try the naive way of giving each device the keys it needs, and arrive at the
# ring. The eight notebooks, in reading order:
#
# 0. **why a ring** (this notebook): memory, context parallelism, the ring drawn;
# 1. attention and the online softmax: one block of keys at a time, exactly;
# 2. layouts: which device holds which token (contiguous, striped, zigzag);
# 3. the ring, round by round, and the work each device does;
# 4. tiles, and the speed-up they turn balance into;
# 5. the backward pass;
# 6. real processes with MPI;
# 7. the whole model: a transformer trained over the ring.
#
# Every number on the way is computed by the project's code and checked with an `assert`.
#
# Legend: `S` tokens in the sequence, `N` devices, `c = S / N` tokens per device,
# `H` heads, `D` head dimension, `d` model width, `f` MLP width, `L` layers.

# %%
import tracemalloc

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

from model import attention as model_attention
from model import recipe, transformer
from reference import attention, positions, ring_attention, shard, unshard
from reference.tms import MODELS

GiB = 2 ** 30
COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]   # one colour per device, as in notebook 2

# %% [markdown]
# ## The scores: S x S numbers per head
#
# Attention compares every query with every key: the scores `Q K^T` form an `S x S` matrix
# per head and per layer. Kept whole, as the formula is written, that is `S^2` numbers.
# In bfloat16 (2 bytes a number):

# %%
BF16 = 2                                            # bytes per number
print(f"{'S':>9} {'scores, one head, one layer':>29}")
for S in (4096, 16384, 65536, 131072, 262144, 1048576):
    print(f"{S:>9} {BF16 * S * S / GiB:>25.2f} GiB")
assert BF16 * 131072 ** 2 == 32 * GiB               # 128k tokens: 32 GiB for ONE head of ONE layer

# %% [markdown]
# An A100 (the paper's GPUs) holds 80 GB. At 128k tokens one head's scores take 32 GiB,
# and a model has tens of heads in each of tens of layers.
#
# The scores need not be kept whole. Notebook 1 shows the *online softmax*: a device can
# attend to the keys one block (one tile) at a time, keeping per query only a running max,
# a running sum and an unnormalised output, and still get the exact answer. Measured here
# with Python's `tracemalloc` (it sees every NumPy allocation): the peak memory of
# `reference.attention`, the dense formula, against `reference.ring_attention` on a single
# device with tiles of 128 x 128, which never holds more than a tile of scores:

# %%
def peak_bytes(run):
    """The largest memory allocated at once while `run()` runs, in bytes."""
    tracemalloc.start()
    run()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


rng = np.random.default_rng(0)
seq_lens = [256, 512, 1024, 2048]
dense_peak, tiled_peak = [], []
for S in seq_lens:
    q, k, v = (rng.standard_normal((1, S, 1, 32)).astype(np.float32) for _ in range(3))   # (B, S, H, D)
    dense_peak.append(peak_bytes(lambda: attention(q, k, v)))
    tiled_peak.append(peak_bytes(lambda: ring_attention(q, k, v, n_devices=1, tile_size=128)))
    print(f"S = {S:>4}: dense {dense_peak[-1] / 2**20:6.1f} MiB   tiles of 128 {tiled_peak[-1] / 2**20:5.1f} MiB")

fig, ax = plt.subplots(figsize=(6, 3.6))
ax.loglog(seq_lens, np.array(dense_peak) / 2**20, "o-", label="dense formula (the S x S scores)")
ax.loglog(seq_lens, np.array(tiled_peak) / 2**20, "s-", label="one block of keys at a time (tiles of 128)")
ax.set_xticks(seq_lens, seq_lens)
ax.set_yticks([0.5, 1, 2, 5, 10, 20, 50], ["0.5", "1", "2", "5", "10", "20", "50"])
ax.minorticks_off()
ax.set_xlabel("sequence length S (tokens)")
ax.set_ylabel("peak memory (MiB)")
ax.set_title("Attention's peak memory, measured (one head, D = 32, float32)", fontsize=10)
ax.legend(fontsize=8)
ax.grid(alpha=0.3, which="both")
plt.show()

for S, dense_b, tiled_b in zip(seq_lens, dense_peak, tiled_peak):
    assert dense_b >= 4 * S * S                          # at least one float32 S x S matrix
assert dense_peak[-1] / dense_peak[-2] > 3.5             # doubling S: four times the memory
assert tiled_peak[-1] / tiled_peak[-2] < 2.1             # doubling S: at most twice
assert tiled_peak[-1] < dense_peak[-1] / 10

# %% [markdown]
# ## The activations: linear in S, and still too many
#
# Without the `S x S` scores, memory grows linearly with `S`, but with a large constant.
# To train, the backward pass needs what the forward computed: each layer keeps its
# inputs, its projections, its MLP's hidden values, for every token. Notebook 7's model
# (`model/`, a small decoder-only transformer in NumPy) returns what it keeps for the
# backward as its *cache*; counting the distinct arrays in it (parameters left out):

# %%
def cache_numbers(config, S):
    """Numbers the model keeps between its forward and its backward for one sequence of S tokens."""
    params = transformer.init_params(config, seed=0)
    tokens = np.random.default_rng(0).integers(0, config.vocab, (1, S + 1))
    tokens_here = recipe.shift_then_shard(tokens, 1, "contiguous")[0]      # all S tokens, natural order
    _, cache = transformer.forward(params, config, tokens_here.x, tokens_here.y, tokens_here.pos,
                                   model_attention.Dense(), n_labels=S)
    stack, owners = [cache], {}
    while stack:                                       # every array in the nested tuples, once
        x = stack.pop()
        if isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, np.ndarray):
            owner = x if x.base is None else x.base       # a view counts as the array it shows
            owners[id(owner)] = owner
    params_ids = {id(p) for p in params.values()}
    return sum(a.size for key, a in owners.items() if key not in params_ids)


per_layer = {}
for d, f, H in [(64, 256, 4), (128, 256, 4), (64, 512, 2)]:
    one, two = (transformer.Config(vocab=16, d_model=d, n_head=H, n_layer=L, d_ff=f) for L in (2, 3))
    assert cache_numbers(one, 128) == 2 * cache_numbers(one, 64)           # linear in S
    per_layer[d, f, H] = (cache_numbers(two, 64) - cache_numbers(one, 64)) / 64   # one more layer, per token
    print(f"d = {d:>3}, f = {f}, H = {H}: {per_layer[d, f, H]:.0f} numbers per token per layer"
          f"  (9d + 3f + H + 2 = {9 * d + 3 * f + H + 2})")
    assert per_layer[d, f, H] == 9 * d + 3 * f + H + 2

# %% [markdown]
# So this model keeps `9d + 3f + H + 2` numbers per token and layer: the normed inputs of
# its two sublayers and their gains' statistics, `q`, `k`, `v`, the attention output (and a
# copy of it in the output projection), `lse` (one per head), the MLP's input and its three
# hidden arrays of width `f`. Built at the size of the paper's 7B model (its Table 1) and
# kept in bfloat16, per token that is:

# %%
big = MODELS["7B"]                                   # d_model 4096, d_ff 11008, 32 layers, 32 heads
d, f, H, L = big["d_model"], big["d_ff"], big["n_head"], big["n_layer"]
all_kept = (9 * d + 3 * f + H + 2) * L * BF16        # bytes per token
inputs_only = d * L * BF16                           # only each layer's input, the rest recomputed
print(f"everything the backward reads: {all_kept / 2**20:.2f} MiB per token")
print(f"each layer's input only:       {inputs_only / 2**20:.2f} MiB per token")
print(f"at S = 262144 (the paper's 256k): {all_kept * 262144 / GiB:.0f} GiB, or {inputs_only * 262144 / GiB:.0f} GiB")
assert inputs_only * 262144 == 64 * GiB

# %% [markdown]
# Real training recomputes most of this in the backward (*activation checkpointing*) and
# keeps only each layer's input, `d` numbers per token per layer. Even that minimum, at the
# paper's 256k tokens, is 64 GiB: most of an 80 GB device before the weights, their
# gradients, the optimiser's state and the working memory of one layer's recomputation.
# Whatever is kept grows with `S`, and one device has a fixed size.
#
# ## Cut the sequence over devices (context parallelism)
#
# So cut the sequence into `N` pieces of `c = S / N` tokens and give one to each device:
# every activation above is per token, so each device keeps `1 / N` of them. This is
# *context parallelism* (or sequence parallelism): the devices split the tokens, not the
# weights. It works because every layer but attention treats each token on its own: the
# embedding, the norms, the projections, the MLP and the loss of a token read that token
# only. For instance the MLP of notebook 7's model on one device's tokens is exactly that
# device's rows of the MLP on the whole sequence:

# %%
config = transformer.Config(vocab=16, d_model=32, n_head=2, n_layer=1, d_ff=64)
params = transformer.init_params(config, seed=0, std=0.3)
x = np.random.default_rng(1).standard_normal((1, 16, 32))                 # (B, S, d) one layer's input
whole, _ = transformer.mlp_forward(x, params, 0)
pieces = [transformer.mlp_forward(piece, params, 0)[0] for piece in shard(x, 4, "striped")]
assert np.allclose(unshard(pieces, "striped"), whole, rtol=0, atol=1e-15)

fig, ax = plt.subplots(figsize=(6.4, 3.6))
seq = 2.0 ** np.arange(14, 25)                       # 16k to 16M tokens
for n, style in [(1, "-"), (8, "--"), (32, ":")]:
    ax.loglog(seq, inputs_only * seq / n / GiB, style, color="#4c72b0",
              label=f"each layer's input, N = {n} device{'s' if n > 1 else ''}")
ax.axhline(80e9 / GiB, color="k", lw=1)
ax.text(seq[0], 80e9 / GiB * 1.15, "one A100: 80 GB", fontsize=8)
ax.set_xticks(seq[::2], ["16k", "64k", "256k", "1M", "4M", "16M"])
gib_ticks = [0.25, 1, 4, 16, 64, 256, 1024, 4096]
ax.set_yticks(gib_ticks, [f"{g:g}" for g in gib_ticks])
ax.minorticks_off()
ax.set_xlabel("sequence length S (tokens)")
ax.set_ylabel("GiB per device")
ax.set_title("The least a 7B model keeps per device (bfloat16)", fontsize=10)
ax.legend(fontsize=8, loc="lower right")
ax.grid(alpha=0.3, which="both")
plt.show()

fits = {n: max(s for s in seq if inputs_only * s / n <= 80e9) for n in (1, 8, 32)}
print("longest sequence whose layer inputs fit in 80 GB:", {n: int(s) for n, s in fits.items()})
assert fits[8] == 8 * fits[1] and fits[32] == 4 * fits[8]          # N devices: N times the tokens

# %% [markdown]
# ## Attention needs every earlier key
#
# Attention is the exception: query `p` reads the keys and values of every token `<= p`,
# wherever they are. With the sequence cut over devices, each device's queries need the
# keys and values of the others.
#
# **The naive way: all-gather.** Every device collects everyone's `K` and `V`, then attends
# its queries to all of them. It gives the right answer:

# %%
S, N, H, D = 64, 4, 2, 8
q, k, v = (rng.standard_normal((1, S, H, D)) for _ in range(3))          # (B, S, H, D)
pos = positions(S, N, "striped")                                          # (N, c): who holds what
q_dev, k_dev, v_dev = (shard(x, N, "striped") for x in (q, k, v))        # device j's tokens: [j]
k_all, v_all = np.concatenate(k_dev, axis=1), np.concatenate(v_dev, axis=1)   # the all-gather
outs = [attention(q_dev[j], k_all, v_all, q_pos=pos[j], k_pos=pos.ravel())[0] for j in range(N)]
assert np.allclose(unshard(outs, "striped"), attention(q, k, v)[0], rtol=0, atol=1e-12)

own_kv = k_dev[0].nbytes + v_dev[0].nbytes
gathered_kv = k_all.nbytes + v_all.nbytes
print(f"K, V of one device's own tokens: {own_kv} bytes; after the all-gather each device holds {gathered_kv}")
assert gathered_kv == N * own_kv

# %% [markdown]
# But now every device holds the whole sequence's keys and values, `2 S H D` numbers,
# however many devices share the work: the memory we cut by `N` comes back for attention,
# one layer at a time (the gathered blocks can go once that layer is done; for training,
# their gradients come back too). How much that is, and the other ways, are below.
#
# **The ring.** Instead, pass the blocks around. Each device keeps its queries; in each of
# `N` rounds it attends them to the one key/value block it holds and passes that block to
# the next device, receiving the previous device's. After `N` rounds every device has seen
# every block, and the online softmax has merged them exactly (notebook 1). A device holds
# two blocks at a time, the one it computes on and the one arriving: `2 / N` of what
# the all-gather holds. And since a block travels while the device computes on the one
# it holds, the transfers can hide behind the compute.
#
# `reference.ring_attention` runs `N` such devices (threads here) and its trace records
# what each one sent in each round:

# %%
out, lse, trace = ring_attention(q, k, v, n_devices=N, layout="striped", trace=True)
assert np.allclose(out, attention(q, k, v)[0], rtol=0, atol=1e-12)
block_msg = own_kv + pos[0].nbytes + 8                  # K, V, their positions, the owner's id
print("bytes each device sent, per round (rows) and device (columns):\n", trace.bytes_sent)
assert (trace.bytes_sent[:N - 1] == block_msg).all()    # one block per round
assert (trace.bytes_sent[N - 1] == 0).all()             # nothing after the last round

n_devices = [2, 4, 8, 16, 32]
whole_kv = k.nbytes + v.nbytes                          # the sequence's K and V, one layer
held = {"all-gather": [], "ring": []}
for n in n_devices:
    k_n, v_n = shard(k, n, "striped"), shard(v, n, "striped")
    held["all-gather"].append(sum(x.nbytes for x in k_n + v_n) / whole_kv)       # everyone's blocks
    held["ring"].append(2 * (k_n[0].nbytes + v_n[0].nbytes) / whole_kv)          # two blocks
fig, ax = plt.subplots(figsize=(6, 3.4))
ax.plot(n_devices, held["all-gather"], "o-", label="all-gather: every device's block")
ax.plot(n_devices, held["ring"], "s-", label="ring: the block held and the one arriving")
ax.set_xscale("log", base=2)
ax.set_xticks(n_devices, n_devices)
ax.set_ylim(0, 1.15)
ax.set_xlabel("devices N")
ax.set_ylabel("share of the sequence's K, V")
ax.set_title("Keys and values one device holds, for one attention layer", fontsize=10)
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
plt.show()
assert held["all-gather"] == [1.0] * len(n_devices)
assert held["ring"] == [2 / n for n in n_devices]

# %% [markdown]
# ## Three ways to spread attention, side by side
#
# The all-gather and the ring are two of the three ways the field spreads attention over
# devices. The third, **Ulysses**, cuts the other axis for attention alone: an all-to-all
# trades each device's shard of every head for the whole sequence of `H / N` heads, each
# device attends on its own, and a second all-to-all trades back. It needs the heads (and
# the key/value heads) divisible by `N`. **USP** runs Ulysses in groups of `u` devices and
# the ring across the `N / u` groups. All four run here (`scheme=`), and the project's cost
# model (`reference.scheme_cost`) counts, per device, the K/V bytes each holds and the bytes
# each sends, byte for byte as the runs' traces record them:

# %%
from reference.scheme_cost import predict_scheme
from reference.schemes import Scheme

PLANS = (("ring", None), ("all_gather", None), ("ulysses", None), ("usp", 2))
S4, N4, H4, D4 = 64, 4, 4, 8
q4, k4, v4 = (rng.standard_normal((1, S4, H4, D4)) for _ in range(3))
for name, u in PLANS:
    out4, _, tr = ring_attention(q4, k4, v4, n_devices=N4, scheme=name, ulysses_degree=u, trace=True)
    assert np.allclose(out4, attention(q4, k4, v4)[0], rtol=0, atol=1e-12)          # the same answer
    cost4 = predict_scheme(Scheme.checked(name, u, n_devices=N4, Hq=H4, Hkv=H4), S4, "striped",
                           B=1, Hq=H4, Hkv=H4, D=D4, dtype=np.float64)
    assert (tr.kv_bytes == cost4.kv_bytes).all() and (tr.bytes_sent == cost4.bytes_sent).all()

# %% [markdown]
# The same count at the paper's size: a 7B model (32 heads of 128, bfloat16), 256k tokens
# on 8 devices, one attention layer's forward:

# %%
S7, N7, H7, D7 = 262144, 8, 32, 128
costs = {}
for name, u in PLANS:
    scheme = Scheme.checked(name, u, n_devices=N7, Hq=H7, Hkv=H7)
    costs[scheme.label] = predict_scheme(scheme, S7, "striped", B=1, Hq=H7, Hkv=H7, D=D7, dtype="float16",
                                         tile_size=4096).totals()
print(f"{'scheme':<14} {'K/V held, GiB':>14} {'sent, GiB':>10}   (per device, one layer, forward)")
for label, t in costs.items():
    print(f"{label:<14} {t['peak_kv'] / GiB:>14.2f} {t['bytes_sent'] / GiB:>10.2f}")
fig, axes = plt.subplots(1, 2, figsize=(8, 3))
for ax, key, title in zip(axes, ("peak_kv", "bytes_sent"), ("K/V held per device", "bytes sent per device")):
    ax.bar(list(costs), [t[key] / GiB for t in costs.values()], color=["#4c72b0", "#dd8452", "#55a868", "#c44e52"])
    ax.set_title(title + " (GiB)", fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
plt.tight_layout()
plt.show()
whole_layer_kv = 2 * S7 * H7 * D7 * BF16                                       # one layer's K and V
assert whole_layer_kv == 4 * GiB and 4 * GiB < costs["all_gather"]["peak_kv"] < 4.01 * GiB
assert costs["ring"]["peak_kv"] * 3.99 < costs["all_gather"]["peak_kv"]       # two blocks of eight
assert costs["ulysses (u=8)"]["peak_kv"] < costs["ring"]["peak_kv"]            # its heads' whole sequence
assert costs["ring"]["bytes_sent"] == costs["all_gather"]["bytes_sent"]        # the same blocks, moved once
assert costs["ulysses (u=8)"]["bytes_sent"] * 3.9 < costs["ring"]["bytes_sent"]

# %% [markdown]
# So at 7B and 256k tokens the all-gather holds 4 GiB of one layer's keys and values while
# that layer runs: a cost, but small beside the 64 GiB of layer inputs kept for the
# backward (above), which is why it is used in practice (Llama 3 was trained with it). It
# moves the same bytes as the ring, all before the first tile, so nothing hides them.
# Ulysses holds and moves least, but only while the heads divide over the devices (32 heads:
# at most 32 devices), and its two all-to-alls cannot overlap the compute. The ring holds
# two blocks, whatever `N`, and hides each transfer behind a round of compute; it is the
# one that keeps working when the sequence outgrows what a device can gather and the heads
# run out. USP sits between them. These notebooks follow the ring, where the causal mask
# creates the imbalance that striping removes; `python -m reference.cost --scheme all`
# puts the four side by side for any shape and link. Other people's Ulysses and USP
# (Ulysses x ring) implementations are checked against this project's oracle by its
# conformance kit: `conformance/CONFORMANCE.md` lists what each gave,
# and `conformance/pages/yunchang.md` the Ulysses and USP rings of one of them.

# %% [markdown]
# ## The ring, drawn
#
# Four devices, sixteen tokens. In round `t` device `j` holds the block that started on
# device `(j - t) mod N`, and sends it on to device `j + 1`. Below, read from a run's trace:
# each device's queries (which never move), the key/value block it holds, coloured by the
# device it started on, how many (query, key) pairs of it are visible (the work), and the
# arrows: the block each device sends at the end of the round. No block moves after the
# last round.
#
# Top: **contiguous** blocks (Ring Attention). Bottom: **striped** (the paper): token `p`
# on device `p mod N`. Same ring, same messages; what differs is who holds which tokens,
# and so the work in each round: under contiguous a device holding a block of later tokens
# has nothing to do (0 pairs) while another has a full block (16), in every round after the
# first; under striped every device has 6 or 10.

# %%
S, N = 16, 4
c = S // N
q, k, v = (rng.standard_normal((1, S, 1, 4)) for _ in range(3))
runs = {layout: ring_attention(q, k, v, n_devices=N, layout=layout, trace=True)[2] for layout in ("contiguous", "striped")}
ANGLE = np.pi / 2 - np.arange(N) * 2 * np.pi / N        # device 0 at the top, the ring clockwise
XY = np.stack([np.cos(ANGLE), np.sin(ANGLE)], axis=1)


def draw_round(ax, layout, tr, t):
    """Device j's box at XY[j]: its queries, the block it holds (coloured by where it
    started), its visible pairs; an arrow to device j + 1 for what it sends."""
    pos = positions(S, N, layout)
    for j in range(N):
        src = tr.source[t, j]
        x, y = XY[j]
        ax.add_patch(FancyBboxPatch((x - 0.5, y - 0.36), 1.0, 0.72, boxstyle="round,pad=0.02",
                                    facecolor="white", edgecolor="0.3", lw=1))
        ax.text(x, y + 0.24, f"device {j}", ha="center", va="center", fontsize=8, weight="bold")
        ax.text(x, y + 0.08, f"Q: {' '.join(map(str, pos[j]))}", ha="center", va="center", fontsize=8)
        ax.text(x, y - 0.09, f"K,V: {' '.join(map(str, pos[src]))}", ha="center", va="center", fontsize=8,
                color="white", bbox=dict(boxstyle="round,pad=0.2", facecolor=COLORS[src], edgecolor="none"))
        ax.text(x, y - 0.26, f"work: {tr.pairs[t, j]} pairs", ha="center", va="center", fontsize=8)
        if t < N - 1:                                   # the transfer to the next device
            nxt = XY[(j + 1) % N]
            ax.add_patch(FancyArrowPatch(XY[j] + 0.3 * (nxt - XY[j]), XY[j] + 0.7 * (nxt - XY[j]),
                                         connectionstyle="arc3,rad=-0.25", arrowstyle="-|>", mutation_scale=16,
                                         color=COLORS[src], lw=2.5, zorder=3))
    ax.set_xlim(-1.55, 1.55)
    ax.set_ylim(-1.45, 1.45)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"{layout}, round {t}" + ("" if t < N - 1 else " (no transfer)"), fontsize=10)


fig, axes = plt.subplots(2, N, figsize=(13, 7), layout="constrained")
for row, (layout, tr) in enumerate(runs.items()):
    for t in range(N):
        draw_round(axes[row, t], layout, tr, t)
fig.legend(handles=[Patch(color=COLORS[j], label=f"block that started on device {j}") for j in range(N)],
           loc="outside lower center", ncol=N, fontsize=8)
fig.suptitle("The ring: queries stay, key/value blocks move one device on per round (arrows: this round's sends)",
             fontsize=10)
plt.show()

# %% [markdown]
# What the pictures show, checked on the traces: the block held is the one of device
# `(j - t) mod N`; what device `j` sends in round `t` is what device `j + 1` holds in round
# `t + 1`; every device sees every block once; and the work per round.

# %%
for layout, tr in runs.items():
    for t in range(N):
        for j in range(N):
            assert tr.source[t, j] == (j - t) % N
            if t < N - 1:
                assert tr.source[t + 1, (j + 1) % N] == tr.source[t, j]     # the arrow's block arrives
    assert all(sorted(tr.source[:, j]) == list(range(N)) for j in range(N))  # every block, once
cont, strip = runs["contiguous"].pairs, runs["striped"].pairs
assert (cont[0] == c * (c + 1) // 2).all() and set(cont[1:].ravel()) == {0, c * c}   # idle or full
assert set(strip.ravel()) == {c * (c - 1) // 2, c * (c + 1) // 2}                  # 6 or 10, always
print("busiest device per round, contiguous:", cont.max(axis=1), " striped:", strip.max(axis=1))

# %% [markdown]
# ## Exercises
#
# Work each out by hand first; the cell under it (collapsed in Jupyter: click to open) holds
# the answer and checks it against the project.
#
# 1. One head of one layer at 64k tokens (65536): how many GiB do its bfloat16 scores take?
# 2. The 7B model at 256k tokens, on 16 devices instead of 8: how much K/V does the ring hold
#    per device, and the all-gather? (Ignore the few bytes of positions.)
# 3. With 32 heads, what is the largest number of devices Ulysses can use on its own, and
#    what does the project say when asked for more?
# 4. The ring on `N` devices sends each device's block to every other device once. What
#    fraction of the whole sequence's K and V does one device send in a forward pass, as
#    `N` grows?

# %% jupyter={"source_hidden": true}
# 1. 65536^2 scores x 2 bytes = 2^33 bytes = 8 GiB
answer_1 = 8
assert 65536 ** 2 * BF16 == answer_1 * GiB

# 2. the ring: two blocks of 1/16 of one layer's 4 GiB = 0.5 GiB; the all-gather: still all 4 GiB
answer_2 = (0.5, 4.0)
for (name, held_gib) in zip(("ring", "all_gather"), answer_2):
    t = predict_scheme(Scheme.checked(name, None, n_devices=16, Hq=H7, Hkv=H7), S7, "striped",
                       B=1, Hq=H7, Hkv=H7, D=D7, dtype="float16", tile_size=4096).totals()
    assert abs(t["peak_kv"] / GiB - held_gib) < 0.01 * held_gib

# 3. 32: each device must get a whole number of heads; 64 devices is refused before any work
answer_3 = 32
Scheme.checked("ulysses", None, n_devices=answer_3, Hq=H7, Hkv=H7)
try:
    Scheme.checked("ulysses", None, n_devices=2 * answer_3, Hq=H7, Hkv=H7)
    raise AssertionError("64 devices accepted")
except ValueError as e:
    print(e)

# 4. N - 1 of its N blocks' worth over the pass, each 1/N of the sequence: (N - 1) / N, close to all of it
answer_4 = lambda n: (n - 1) / n
for n in (4, 8):
    t = predict_scheme(Scheme.checked("ring", None, n_devices=n, Hq=H7, Hkv=H7), S7, "striped",
                       B=1, Hq=H7, Hkv=H7, D=D7, dtype="float16", tile_size=4096).totals()
    assert abs(t["bytes_sent"] / whole_layer_kv - answer_4(n)) < 0.01

# %% [markdown]
# **What we have seen.** Memory grows with the sequence: quadratically for the scores,
# which the online softmax removes, and linearly for everything else, which only cutting
# the sequence over devices divides. Attention then needs other devices' keys: gathering
# them all holds one layer's keys and values at a time, Ulysses trades the sequence for
# heads, and passing them around a ring holds two blocks. A round
# lasts as long as its busiest device, and under contiguous blocks that device has a full
# block while others idle: the rest of these notebooks is about that imbalance and how
# striping removes it. Next, `01_attention_and_online_softmax`: why one block at a time
# gives the exact answer.
