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
# ring. The nine notebooks, in reading order:
#
# 0. **why a ring** (this notebook): memory, context parallelism, the ring drawn;
# 1. attention and the online softmax: one block of keys at a time, exactly;
# 2. layouts: which device holds which token (contiguous, striped, zigzag);
# 3. the ring, round by round, and the work each device does;
# 4. tiles, and the speed-up they turn balance into;
# 5. the backward pass;
# 6. real processes with MPI;
# 7. the whole model: a transformer trained over the ring;
# 8. around the ring: the collectives, data parallelism beside it, stock kernels, and the
#    same ring in PyTorch.
#
# Every number on the way is computed by the project's code and checked with an `assert`.
#
# Legend: `S` tokens in the sequence, `N` devices, `c = S / N` tokens per device,
# `H` heads, `D` head dimension, `d` model width, `f` MLP width, `L` layers.

# %%
import tracemalloc

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch, Patch, Rectangle

from model import attention as model_attention
from model import recipe, transformer
from reference import attention, positions, ring_attention, shard, unshard
from reference.tms import MODELS
from reference.virtual import run_devices

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
# So this model keeps `9d + 3f + H + 2` numbers per token and layer. Which arrays they are,
# read from one layer's cache (the sizes are per token):

# %%
def one_layer_cache(config, S):
    """The named arrays one layer keeps for its backward, for one sequence of S tokens."""
    params = transformer.init_params(config, seed=0)
    tokens = np.random.default_rng(0).integers(0, config.vocab, (1, S + 1))
    here = recipe.shift_then_shard(tokens, 1, "contiguous")[0]
    _, (_, layers, *_) = transformer.forward(params, config, here.x, here.y, here.pos,
                                             model_attention.Dense(), n_labels=S)
    (xhat1, r1, _), attn, (xhat2, r2, _), ((mlp_in, _), (hidden, tanh), (gelu, _)) = layers[0]
    (attn_in, _), _, _, _, q_rot, k_rot, v_, out_, lse_, (out_for_wo, _) = attn
    return {"norm 1: x / rms(x)": xhat1, "norm 1: 1 / rms(x)": r1, "attention's input (x / rms times the gain)": attn_in,
            "q, rotated": q_rot, "k, rotated": k_rot, "v": v_, "attention output": out_,
            "lse (one per head)": lse_, "attention output again, laid out for W_O": out_for_wo,
            "norm 2: x / rms(x)": xhat2, "norm 2: 1 / rms(x)": r2, "MLP input (x / rms times the gain)": mlp_in,
            "MLP hidden, x W_1": hidden, "tanh inside the GELU": tanh, "GELU output": gelu}


small = transformer.Config(vocab=16, d_model=64, n_head=4, n_layer=1, d_ff=256)
kept = {name: a.size // 64 for name, a in one_layer_cache(small, 64).items()}        # numbers per token
for name, width in kept.items():
    print(f"{name:<44} {width:>4}")
d, f, H = small.d_model, small.d_ff, small.n_head
print(f"{'sum':<44} {sum(kept.values()):>4}  = 9d + 3f + H + 2 = {9 * d + 3 * f + H + 2}")
assert sum(kept.values()) == 9 * d + 3 * f + H + 2 == per_layer[d, f, H]
assert sorted(kept.values()).count(d) == 9 and sorted(kept.values()).count(f) == 3

# %% [markdown]
# Nine arrays of width `d`: each norm's normalised input and its scaled output (four),
# `q`, `k`, `v`, and the attention output twice (as attention returns it, and re-laid out
# for the output projection); two numbers for the norms' `1 / rms`; `H` for `lse`; three
# of width `f` in the MLP. Built at the size of the paper's 7B model (its Table 1) and
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
block_msg = own_kv + pos[0].nbytes + 8                  # K, V, their positions, the owner (two int32)
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
# devices. The third, **Ulysses** (DeepSpeed-Ulysses), cuts the other axis, for attention
# alone: an all-to-all trades each device's shard of every head for the whole sequence of
# `H / N` heads, each device attends on its own, and a second all-to-all trades the output
# back. Its devices must share out the heads (and the key/value heads) evenly. **USP** runs
# Ulysses in groups of `u` devices and the ring across the `N / u` groups.
#
# Each moves data with a different *collective*: an operation that every device of a group
# calls together. Here are the three, run on four of the project's virtual devices
# (`reference.virtual.run_devices`, whose communication objects have the ring's `start_shift`
# and `finish_shift`, and the `all_to_all` of a Ulysses group):
#
# - the ring's **shift**: each device sends its block to the next device and receives the
#   previous device's (a pass makes `N - 1` of them);
# - the **all-gather**: every device ends with every device's block (here made of `N - 1`
#   shifts, each block kept);
# - the **all-to-all**: device `j` holds one piece for each device `i` (for Ulysses, its
#   tokens `t j` of head group `h i`) and ends with its own piece of every device (the
#   whole sequence of its head group).

# %%
def collectives(j, comm):
    """What device j holds after a ring shift, an all-gather and an all-to-all."""
    (shifted,) = comm.finish_shift(comm.start_shift((np.array([j]),), 1))
    gathered = [np.array([j])]
    for _ in range(comm.size - 1):                       # the all-gather: N - 1 shifts, each block kept
        (arrived,) = comm.finish_shift(comm.start_shift((gathered[-1],), 2))
        gathered.append(arrived)
    pieces = comm.all_to_all([np.array([j, i]) for i in range(comm.size)])   # piece i: (tokens j, heads i)
    return int(shifted[0]), [int(g[0]) for g in gathered], [tuple(map(int, p)) for p in pieces]


held_after = run_devices(4, collectives)
for j, (shifted, gathered, pieces) in enumerate(held_after):
    assert shifted == (j - 1) % 4                                   # the previous device's block
    assert gathered == [(j - t) % 4 for t in range(4)]              # every block, the ring's order
    assert pieces == [(i, j) for i in range(4)]                     # tokens of every device, heads j


def draw_holdings(ax, holdings, title, rows):
    """holdings[j]: the (device it came from, label) of each block device j holds, as a column
    of up to `rows` cells."""
    for j, cells in enumerate(holdings):
        ax.text(j, 4.3, f"device {j}", ha="center", va="center", fontsize=8, weight="bold")
        for row, (origin, label) in enumerate(cells):
            ax.add_patch(Rectangle((j - 0.42, 3.1 - row), 0.84, 0.84, facecolor=COLORS[origin], edgecolor="white"))
            ax.text(j, 3.52 - row, label, ha="center", va="center", color="white", fontsize=8)
    ax.set_xlim(-0.6, 3.6)
    ax.set_ylim(4.05 - rows, 4.6)
    ax.axis("off")
    ax.set_title(title, fontsize=9)


kv = lambda j: (j, f"K,V {j}")
rows = [("ring shift (send, receive)", [[kv(j)] for j in range(4)], [[kv(s)] for s, _, _ in held_after]),
        ("all-gather", [[kv(j)] for j in range(4)], [[kv(g) for g in gathered] for _, gathered, _ in held_after]),
        ("all-to-all (Ulysses)", [[(j, f"t{j} h{i}") for i in range(4)] for j in range(4)],
         [[(t, f"t{t} h{h}") for t, h in pieces] for _, _, pieces in held_after])]
fig, axes = plt.subplots(3, 2, figsize=(8.5, 6.2), layout="constrained", height_ratios=(1.6, 4.6, 4.6))
for (name, before, after), (ax_before, ax_after) in zip(rows, axes):
    rows_drawn = max(map(len, before + after))
    draw_holdings(ax_before, before, f"{name}: before", rows_drawn)
    draw_holdings(ax_after, after, f"{name}: after", rows_drawn)
fig.suptitle("What each device holds before and after a collective (colour: the device it came from)", fontsize=10)
plt.show()

# %% [markdown]
# All four run here (`scheme=`; a fifth, the double ring, is for machines of nodes, below), and
# the project's cost model (`reference.scheme_cost`) counts, per device, the K/V bytes each
# holds and the bytes each sends, byte for byte as the runs' traces record them:

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
# ## The four at the paper's size
#
# The same count for a 7B model (32 query heads of 128), 256k tokens on 8 devices, 2 bytes a
# number, one attention layer: its forward, and a training step (forward and backward). Twice:
# with 32 key/value heads, as the paper's model, and with 8 (grouped-query attention, GQA: 4
# query heads share each key/value head, the shape of Llama 3 8B's attention). Beside them, what a
# device holds anyway, so that each figure has something to be set against: each layer's
# input for the backward (the least it keeps, above), divided over the 8 devices, and its own
# share of one layer's `K` and `V`.

# %%
S7, N7, H7, D7 = 262144, 8, 32, 128
c7 = S7 // N7                                       # tokens per device
KV_HEADS = (32, 8)                                  # the paper's 7B; the same with GQA


def scheme_costs(Hkv):
    """{label: (forward, backward)}: the cost model's SchemeCost of each scheme, one layer."""
    costs = {}
    for name, u in PLANS:
        scheme = Scheme.checked(name, u, n_devices=N7, Hq=H7, Hkv=Hkv)
        costs[scheme.label] = tuple(predict_scheme(scheme, S7, "striped", B=1, Hq=H7, Hkv=Hkv, D=D7,
                                                   dtype="float16", tile_size=4096, backward=backward)
                                    for backward in (False, True))      # float16: 2 bytes, as bfloat16
    return costs


costs = {Hkv: scheme_costs(Hkv) for Hkv in KV_HEADS}
inputs_per_device = inputs_only * c7                 # every layer's input, this device's tokens
own_kv = {Hkv: 2 * c7 * Hkv * D7 * BF16 for Hkv in KV_HEADS}
print(f"per device, N = {N7}: each layer's input, all {L} layers: {inputs_per_device / GiB:.0f} GiB;  "
      f"its own K, V of one layer: {own_kv[32] / GiB:.2f} GiB (32 K/V heads), {own_kv[8] / GiB:.3f} GiB (8)\n")
print(f"{'scheme':<14} {'K/V heads':>9} {'K/V held':>9} {'sent, forward':>14} {'sent, training step':>20}"
      f" {'of which exposed':>17}   (GiB per device, one layer)")
table = {}
for Hkv in KV_HEADS:
    for label, (fwd, bwd) in costs[Hkv].items():
        step = fwd.bytes_sent.sum(axis=0) + bwd.bytes_sent.sum(axis=0)                 # (devices,)
        exposed = fwd.exposed.sum(axis=0) + bwd.exposed.sum(axis=0)
        table[label, Hkv] = dict(held=max(fwd.totals()["peak_kv"], bwd.totals()["peak_kv"]) / GiB,
                                 forward=fwd.totals()["bytes_sent"] / GiB, step=step.max() / GiB,
                                 exposed=exposed.max() / GiB)
        t = table[label, Hkv]
        print(f"{label:<14} {Hkv:>9} {t['held']:>9.2f} {t['forward']:>14.2f} {t['step']:>20.2f} {t['exposed']:>17.2f}")

labels = list(costs[32])
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), layout="constrained")
for ax, key, title in zip(axes, ("held", "step"), ("K/V held per device", "sent per device, one training step")):
    for i, Hkv in enumerate(KV_HEADS):
        x = np.arange(len(labels)) + (i - 0.5) * 0.4
        ax.bar(x, [table[label, Hkv][key] for label in labels], width=0.4, color=COLORS[i], label=f"{Hkv} K/V heads")
        if key == "step":                                # the part no compute overlaps
            ax.bar(x, [table[label, Hkv]["exposed"] for label in labels], width=0.4, fill=False, hatch="//",
                   edgecolor="0.2", lw=0, label="exposed (no compute overlaps it)" if i == 0 else None)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_title(title + " (GiB)", fontsize=10)
axes[0].axhline(inputs_per_device / GiB, color="k", ls="--", lw=1, label="each layer's input, kept per device")
axes[0].axhline(own_kv[32] / GiB, color="k", ls=":", lw=1, label="its own K, V (32 heads)")
axes[0].legend(fontsize=7)
axes[1].legend(fontsize=7)
plt.show()

assert inputs_per_device == 8 * GiB and own_kv[32] == GiB / 2
assert N7 * 2 * c7 * 32 * D7 * 4 == 8 * GiB                 # the all-gather's backward: every block's dK, dV, float32
held_ag = table["all_gather", 32]["held"]
assert 4 < held_ag < 4.01 and held_ag < 0.51 * inputs_per_device / GiB   # half again the layer inputs
assert table["ring", 32]["held"] * 3.99 < held_ag                          # two blocks of eight
for Hkv in KV_HEADS:
    ring, gather, ulysses = (table[label, Hkv] for label in ("ring", "all_gather", "ulysses (u=8)"))
    assert ring["forward"] == gather["forward"]                  # the same blocks, moved once
    assert gather["exposed"] == gather["step"] and ulysses["exposed"] == ulysses["step"]
    assert ring["exposed"] * GiB == 2 * c7 * Hkv * D7 * 4        # only dK, dV's last hop home (float32)
assert abs(table["ring", 8]["held"] - 0.25) < 0.01 and abs(table["ring", 8]["forward"] - 0.88) < 0.01
assert abs(table["ring", 32]["step"] - 15.0) < 0.01 and abs(table["ulysses (u=8)", 32]["step"] - 2.63) < 0.01

# %% [markdown]
# **Ulysses moves `Q` and `O` too.** The ring and the all-gather move only keys and values.
# Ulysses' all-to-alls trade every array attention reads or writes: in the forward, `Q`, `K`
# and `V` before and the output `O` (and `lse`) after, `(u - 1) / u` of each; in the backward,
# `Q, K, V, O, dO, lse` before and `dQ, dK, dV` after. Named, its forward at this size:

# %%
def ulysses_forward_bytes(Hkv):
    """Bytes one device sends in Ulysses' two all-to-alls of the forward, by array."""
    share = (N7 - 1) / N7                             # of each array, to the group's 7 others
    q_or_o, k_or_v = c7 * H7 * D7 * BF16, c7 * Hkv * D7 * BF16
    return {"Q": share * q_or_o, "K": share * k_or_v, "V": share * k_or_v, "O": share * q_or_o,
            "lse": share * c7 * H7 * 4}              # lse travels in float32


for Hkv in KV_HEADS:
    named = ulysses_forward_bytes(Hkv)
    print(f"{Hkv} K/V heads: " + ", ".join(f"{k} {b / GiB:.3f}" for k, b in named.items())
          + f" GiB; Q and O: {(named['Q'] + named['O']) / sum(named.values()):.0%}")
    assert abs(sum(named.values()) - costs[Hkv]["ulysses (u=8)"][0].totals()["bytes_sent"]) < 8
assert abs((lambda b: (b["Q"] + b["O"]) / sum(b.values()))(ulysses_forward_bytes(8)) - 0.8) < 0.01

# %% [markdown]
# What the table says, per device and per layer:
#
# - **The all-gather** holds one layer's whole `K` and `V` while the layer runs: 4 GiB with
#   32 K/V heads, half as much again as the 8 GiB of layer inputs the device keeps for the
#   whole model (with 8 K/V heads, 1 GiB). In the backward it also computes a `dK, dV` for
#   every gathered block before its reduce-scatter sums them over the devices; the project's
#   keeps them all, in float32: 8 GiB more with 32 K/V heads. It sends what the ring sends,
#   but before the first tile (and the reduce-scatter after the last), where no compute
#   hides it: all its bytes are exposed.
# - **The ring** holds two blocks (1 GiB, or 0.25 GiB with GQA), whatever `N`, and sends each
#   block while the device computes on another; it hides a transfer when a round's compute
#   outlasts it (notebook 4 works out when). Per training step it sends the most: 15 GiB, as
#   `dK, dV` travel round the ring in float32 beside `K, V`. Only their last hop, home to the
#   block's owner after the last tile, has no compute left to hide behind: 1 GiB exposed.
# - **Ulysses** holds and sends least here (2.6 GiB a step), but all of it exposed; in the
#   forward half of it is `Q` and `O` (80% with GQA, where `K, V` are small), in the backward
#   `Q, O, dO, dQ` are four of its seven arrays. It spreads heads: with 32 heads it
#   reaches at most 32 devices, and with 8 K/V heads it must copy each K/V head to several
#   devices beyond 8. **USP** sits between: Ulysses in groups of `u`, the ring across them.
#
# Llama 3 was trained with the all-gather (*The Llama 3 Herd of Models*, 2024, arXiv:2407.21783,
# section 3.3.2, "Context parallelism for long sequences"). Its authors chose it over the
# ring, knowing that its transfers are exposed, for two reasons: it is "easier and more
# flexible to support different types of attention masks", "such as the document mask" (every
# device holds every key, so a mask of packed documents is just a mask; on the ring each
# round's work depends on where documents fall), and the exposed all-gather is small because
# with GQA the "K and V tensors are much smaller than Q tensor" (Llama 3 405B: 8 K/V heads for
# 128 query heads), against attention's compute, quadratic in the sequence. They deal the
# tokens as zigzag does, `2 x CP` chunks, rank `i` holding chunks `i` and `2 x CP - 1 - i`,
# "for better load balancing" (notebook 2). These notebooks follow the ring, where the causal
# mask creates the imbalance that striping removes.
#
# ### From bytes to time
#
# Bytes cost time at the speed of the link they cross. The cost model turns its counts into a
# predicted time on one link for every transfer, given its bandwidth and a compute rate: per
# round, the busiest device's compute or its overlapped transfer, whichever is longer, plus the
# exposed ones. At 25 GB/s a direction (one 200 Gb/s port) and 400 TFLOP/s of attention, the
# figures `python -m reference.cost --scheme all` uses unless told otherwise:

# %%
LINK, RATE = 25e9, 400e12                           # bytes/s each way, attention FLOP/s (assumed)
print(f"{'scheme':<14} {'K/V heads':>9} {'forward ms':>11} {'backward ms':>12} {'compute alone, ms':>18}")
for Hkv in KV_HEADS:
    for label, (fwd, bwd) in costs[Hkv].items():
        timed = [c.seconds(LINK, RATE) * 1e3 for c in (fwd, bwd)]
        alone = sum(c.seconds(float("inf"), RATE) * 1e3 for c in (fwd, bwd))   # an infinitely fast link
        print(f"{label:<14} {Hkv:>9} {timed[0]:>11.0f} {timed[1]:>12.0f} {alone:>18.0f}")
ring_fwd, ring_bwd = costs[32]["ring"]
assert ring_fwd.seconds(LINK, RATE) == ring_fwd.seconds(float("inf"), RATE)    # the forward's blocks hide
assert ring_bwd.seconds(LINK, RATE) > ring_bwd.seconds(float("inf"), RATE)     # the backward's do not, quite
hop_home = {Hkv: 2 * c7 * Hkv * D7 * 4 / LINK for Hkv in KV_HEADS}             # the last dK, dV (float32), s
assert (round(hop_home[32] * 1e3), round(hop_home[8] * 1e3)) == (43, 11)
last = ring_bwd.round_seconds(LINK, RATE)[-1] - ring_bwd.round_seconds(float("inf"), RATE)[-1]
assert np.isclose(last, hop_home[32])                                         # exposed: no compute after it
ring8_fwd, ring8_bwd = costs[8]["ring"]
assert ring8_fwd.seconds(LINK, RATE) == ring8_fwd.seconds(float("inf"), RATE)
assert np.isclose(ring8_bwd.seconds(LINK, RATE) - ring8_bwd.seconds(float("inf"), RATE), hop_home[8])
compute_only = {label: sum(c.seconds(float("inf"), RATE) for c in pair) for label, pair in costs[32].items()}
assert 0.85 < compute_only["ulysses (u=8)"] / compute_only["ring"] < 0.95   # a tenth less compute

# %% [markdown]
# At this size the ring's forward hides every block. Its backward, sending 1.5 GiB a round
# with 32 K/V heads, waits a little in each round on this link, and 43 ms for the last `dK, dV`
# hop home, which no compute follows; with 8 K/V heads it hides every round's transfers and
# waits only for that last hop (11 ms). The all-gather pays for all its bytes on top of the
# compute, and Ulysses for its (fewer) ones.
# Ulysses also computes a tenth less here: each device attends its heads over one causal
# triangle of the whole sequence, whose masked diagonal tiles it pays once, where the striped
# ring pays a diagonal band in every round (notebook 4).
# `python -m reference.cost --scheme all` prints the same table for any shape, link and
# compute rate. Other people's Ulysses and USP (Ulysses x ring) implementations are checked
# against this project's oracle by its conformance kit:
# `conformance/CONFORMANCE.md` lists what each gave, and `conformance/pages/yunchang.md`
# the Ulysses and USP rings of one of them. One link for every transfer is the simplest
# machine: real ones have fast links inside a node and slower ones between nodes, and a
# scheme's time then depends on which of its transfers cross which.

# %% [markdown]
# ## Two links: inside a node, between nodes
#
# A cluster's devices sit in nodes, and each device has two links: one to the devices of its
# own node (an H100 node's NVLink: 450 GB/s a direction between any two of its 8 GPUs) and one
# to the other nodes (a network port a GPU: 50 GB/s for InfiniBand NDR's 400 Gb/s, 25 for
# HDR's 200). `reference.topology` describes such a machine, ranks per node and each link's
# bandwidth and latency, and names a few, the source of every figure in its file:

# %%
import inspect

from reference.scheme_cost import candidates, choose, key_seconds, placed
from reference.topology import MACHINES, Link, Machine, crossings, placements

for name in ("h100-ndr", "h100-hdr"):
    print(MACHINES[name].describe(16))
print(inspect.getsource(crossings))

# %% [markdown]
# A message between two ranks of one node crosses the first link; between nodes, the second.
# Which of a scheme's messages cross depends on where its ranks run, its *placement*: scheme
# rank `g` on machine rank `order[g]`, machine rank `m` on node `m // R` (`R` ranks a node).
# Every scheme runs *in order* (`order[g] = g`): the ring goes from node to node, and a Ulysses
# group of `u` consecutive ranks sits inside one node when `u` divides `R`. USP also runs
# *ring-in-nodes*: each of its rings inside a node, each Ulysses group across the nodes. And a
# fifth scheme is made for two links, the **double ring** (LoongTrain, Gu et al. 2024,
# arXiv:2406.18485; `scheme="double_ring", ring_inner=w`): the ring's rounds run on an inner
# ring of `w` consecutive ranks (a node's), while each block bound for the next group travels
# on an outer ring, with `w` rounds of compute to hide behind. Its results are the ring's.
#
# Drawn for four ranks on two nodes of two: the messages of one forward pass of each scheme,
# as the cost model lists them (`SchemeCost.moves`: each message's sender, receiver, bytes,
# and whether compute overlaps it), between the ranks where they run. `g0 .. g3` are the
# scheme's ranks; blue arrows stay inside a node, red ones cross; dashed ones are exposed.

# %%
LINK_COLORS = {"intra": COLORS[0], "inter": COLORS[3]}            # inside a node, between nodes
h100 = MACHINES["h100-hdr"]
toy = Machine(2, h100.intra, h100.inter)                          # 2 nodes of 2 ranks
SPOT = {0: (0, 1), 1: (0, 0), 2: (1.6, 0), 3: (1.6, 1)}           # machine rank -> where it is drawn


def forward_pairs(scheme, placement):
    """{(machine rank from, to): (bytes, exposed)}: the forward messages of `scheme` on the S4
    tokens above, its ranks placed by `placement`."""
    moves = predict_scheme(scheme, S4, "striped", B=1, Hq=H4, Hkv=H4, D=D4, dtype=np.float64).moves
    order = np.asarray(placement.order)
    pairs = {}
    for a, b, nbytes, exposed in zip(order[moves.src].tolist(), order[moves.dst].tolist(), moves.nbytes.tolist(),
                                     moves.exposed.tolist()):
        total, was = pairs.get((a, b), (0, exposed))
        assert was == exposed                            # a pair's messages: all exposed, or none
        pairs[a, b] = (total + nbytes, exposed)
    return pairs


def draw_links(ax, title, placement, pairs, widest):
    """Two node boxes, scheme rank g drawn where it runs, an arrow per pair that sends."""
    for node in range(2):
        ax.add_patch(FancyBboxPatch((1.6 * node - 0.35, -0.35), 0.7, 1.7, boxstyle="round,pad=0.02",
                                    facecolor="0.95", edgecolor="0.6"))
        ax.text(1.6 * node, 1.5, f"node {node}", ha="center", fontsize=8)
    for g, m in enumerate(placement.order):
        ax.add_patch(Circle(SPOT[m], 0.16, facecolor="white", edgecolor="0.3", zorder=4))
        ax.text(*SPOT[m], f"g{g}", ha="center", va="center", fontsize=8, zorder=5)
    for (a, b), (nbytes, exposed) in pairs.items():
        ax.add_patch(FancyArrowPatch(SPOT[a], SPOT[b], connectionstyle="arc3,rad=0.18", arrowstyle="-|>",
                                     mutation_scale=10, shrinkA=12, shrinkB=12, lw=0.8 + 3 * nbytes / widest,
                                     ls="--" if exposed else "-", color=LINK_COLORS[toy.link(a, b)], zorder=3))
    ax.set_xlim(-0.5, 2.1)
    ax.set_ylim(-0.5, 1.7)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=9)


toy_plans = {(s.label, p.name): (s, p) for s in candidates(N4, H4, H4) for p in placements(s, toy)}
toy_pairs = {key: forward_pairs(s, p) for key, (s, p) in toy_plans.items()}
widest = max(nbytes for pairs in toy_pairs.values() for nbytes, _ in pairs.values())
fig, axes = plt.subplots(2, 3, figsize=(9, 6.2), layout="constrained")
for ax, (key, (s, p)) in zip(axes.ravel(), toy_plans.items()):
    draw_links(ax, ", ".join(key), p, toy_pairs[key], widest)
fig.legend(handles=[Line2D([], [], color=LINK_COLORS["intra"], lw=2, label="inside a node"),
                    Line2D([], [], color=LINK_COLORS["inter"], lw=2, label="between nodes"),
                    Line2D([], [], color="0.3", lw=2, ls="--", label="exposed (no compute overlaps it)")],
           loc="outside lower center", ncol=3, fontsize=8)
fig.suptitle("One forward pass on 2 nodes of 2 ranks: who sends to whom, over which link (width: bytes)",
             fontsize=10)
plt.show()

# %% [markdown]
# What the picture shows, checked: the ring in order crosses nodes in 2 of its 4 shifts, and
# rank `g1` sends every block it passes on across; the all-gather sends over the same pairs,
# exposed; USP in order keeps its all-to-all (exposed) inside the nodes and sends its ring
# across, and ring-in-nodes does the opposite; 8 of Ulysses' 12 pairs cross; the double ring
# sends each rank's three blocks of the pass two inside its node and one across.

# %%
def link_of(pairs):
    return {pair: toy.link(*pair) for pair in pairs}


block4 = toy_pairs["ring", "in-order"][0, 1][0] // (N4 - 1)               # one K/V block, with its positions
assert list(link_of(toy_pairs["ring", "in-order"]).values()).count("inter") == 2
assert link_of(toy_pairs["ring", "in-order"])[1, 2] == "inter"              # g1 -> g2: all 3 of g1's blocks
all_gather_pairs = toy_pairs["all_gather", "in-order"]
assert all_gather_pairs.keys() == toy_pairs["ring", "in-order"].keys() and all(e for _, e in all_gather_pairs.values())
for placement, all_to_all_link, ring_link in (("in-order", "intra", "inter"), ("ring-in-nodes", "inter", "intra")):
    pairs = toy_pairs["usp (u=2)", placement]
    assert all(toy.link(*pair) == (all_to_all_link if exposed else ring_link) for pair, (_, exposed) in pairs.items())
assert list(link_of(toy_pairs["ulysses (u=4)", "in-order"]).values()).count("inter") == 8
for a in range(N4):
    sent = {link: sum(nbytes for (src, dst), (nbytes, _) in toy_pairs["double_ring (w=2)", "in-order"].items()
                      if src == a and toy.link(src, dst) == link) for link in LINK_COLORS}
    assert sent == {"intra": 2 * block4, "inter": block4}

# %% [markdown]
# ### At size: 16 H100s, two nodes of eight
#
# Llama 3 8B's attention (32 query heads, 8 K/V heads of 128), 64k tokens over 16 GPUs (4096
# each), tiles of 1024, 400 TFLOP/s of attention a GPU: every scheme the heads allow
# (`candidates`), in each of its placements (`placed`). For each, the most bytes any rank sends
# over each link in a forward and a backward pass (`SchemeCost.link_bytes`), and the predicted
# time of the two passes (`SchemeCost.seconds`: per round, the busiest rank's compute or its
# slowest overlapped link, whichever is longer, plus what is exposed) between nodes of NDR, of
# HDR, and of slower links. `python -m reference.cost --scheme all --machine h100-hdr
# --n-devices 16 --seq-len 65536 --tile-size 1024` prints the same rows.

# %%
S16, N16, HKV16, TILE16 = 65536, 16, 8, 1024
RATE16 = h100.tflops * 1e12                                   # attention FLOP/s a GPU
costs16 = {s: tuple(predict_scheme(s, S16, "striped", B=1, Hq=H7, Hkv=HKV16, D=D7, dtype="float16",
                                   tile_size=TILE16, backward=backward) for backward in (False, True))
           for s in candidates(N16, H7, HKV16)}
plans16 = placed(costs16, h100)                               # {(Scheme, Placement): (forward, backward)}


def with_inter(gbs):
    """The H100 nodes of 8, with `gbs` GB/s a direction between nodes."""
    return Machine(8, h100.intra, Link(gbs, h100.inter.latency_us), name=f"{gbs:g} GB/s between nodes")


def on_links(pair, machine, placement):
    """{link: GiB}: the most any rank sends over each link, forward and backward."""
    return {name: sum(c.link_bytes(machine, placement)[name].sum(axis=0) for c in pair).max() / GiB
            for name in LINK_COLORS}


machines16 = {"h100-ndr": MACHINES["h100-ndr"], "h100-hdr": h100, "12.5 GB/s": with_inter(12.5),
              "3 GB/s": with_inter(3)}
ms16 = {name: {key: key_seconds(key, pair, m, RATE16) * 1e3 for key, pair in plans16.items()}
        for name, m in machines16.items()}
links16 = {key: on_links(pair, h100, key[1]) for key, pair in plans16.items()}
print(f"{'scheme':<18} {'placement':<14} {'intra GiB':>9} {'inter GiB':>9}"
      + "".join(f"{name:>10}" for name in machines16) + "   (ms, forward + backward)")
for (s, p), on in links16.items():
    print(f"{s.label:<18} {p.name:<14} {on['intra']:>9.2f} {on['inter']:>9.2f}"
          + "".join(f"{ms16[name][s, p]:>10.1f}" for name in machines16))
chosen16 = {name: choose(plans16, m, RATE16) for name, m in machines16.items()}
for name, (s, p) in chosen16.items():
    print(f"choice, {name}: {s.label}, {p.name}")

inter_gbs = np.geomspace(3, 450, 13)                          # from 3 GB/s to the node's own 450
swept = {key: np.array([key_seconds(key, pair, with_inter(g), RATE16) for g in inter_gbs]) * 1e3
         for key, pair in plans16.items()}
picked = [min(plans16, key=lambda key: swept[key][i]) for i in range(len(inter_gbs))]

fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
labels16 = [f"{s.label}, {p.name}" for s, p in plans16]
y = np.arange(len(labels16))
for offset, link, words in ((-0.2, "intra", "inside a node"), (0.2, "inter", "between nodes")):
    axes[0].barh(y + offset, [links16[key][link] for key in plans16], 0.4, color=LINK_COLORS[link], label=words)
axes[0].set_yticks(y, labels16, fontsize=7)
axes[0].invert_yaxis()
axes[0].set_xlabel("GiB, the most one rank sends over the link (forward + backward)")
axes[0].set_title("Bytes on each link, 2 nodes of 8", fontsize=10)
axes[0].legend(fontsize=7)
drawn = [key for key in plans16 if (key[0].label, key[1].name) in
         {("ring", "in-order"), ("double_ring (w=8)", "in-order"), ("ulysses (u=16)", "in-order"),
          ("usp (u=8)", "in-order"), ("usp (u=8)", "ring-in-nodes")}]
for key, color in zip(drawn, COLORS + ["0.4"]):
    axes[1].plot(inter_gbs, swept[key], "o-" if key[1].name == "in-order" else "o:", ms=3, color=color,
                 label=f"{key[0].label}, {key[1].name}")
for name in ("h100-hdr", "h100-ndr"):
    axes[1].axvline(MACHINES[name].inter.gbs, color="0.6", lw=0.8)
    axes[1].text(MACHINES[name].inter.gbs * 1.05, 55, name, rotation=90, fontsize=7, va="bottom")
axes[1].plot(inter_gbs, [swept[key][i] for i, key in enumerate(picked)], "o", ms=9, mfc="none", mec="k",
             label="the model's choice")
axes[1].set_xscale("log")
axes[1].set_yscale("log")
axes[1].set_xticks([3, 6, 12.5, 25, 50, 100, 200, 450], ["3", "6", "12.5", "25", "50", "100", "200", "450"])
axes[1].set_yticks([20, 30, 50, 100, 200, 300], ["20", "30", "50", "100", "200", "300"])
axes[1].minorticks_off()
axes[1].set_xlabel("link between nodes, GB/s a direction")
axes[1].set_ylabel("predicted forward + backward, ms")
axes[1].set_title("Time as the link between nodes slows", fontsize=10)
axes[1].legend(fontsize=7)
axes[1].grid(alpha=0.3)
plt.show()

# %% [markdown]
# What the model says at this size, checked below:
#
# - **Ulysses** over all 16 computes least (19.5 ms of compute alone, the ring 24.1: one causal
#   triangle per head, where the striped ring pays a masked band every round, notebook 4), but
#   its all-to-all, exposed, crosses nodes. It is the choice only at the right of the plot,
#   from 195 GB/s between nodes among the points drawn (four times NDR's 50).
# - Below that, **USP with Ulysses groups of 8, in order**, is the choice: the all-to-all stays
#   inside each node, and between nodes go only the blocks of its ring of two (at most 0.09
#   GiB from a rank, against 0.21 inside): 21.0 ms at NDR, 21.7 at HDR. This is how
#   Megatron-LM's hierarchical context parallelism (`a2a+p2p`) places the two. Placed
#   ring-in-nodes, the same scheme sends its all-to-all across, and takes 22.5 and 25.0 ms.
# - **The ring** in order sends all that ranks 7 and 15 pass on to the next node (0.97 GiB,
#   blocks and their `dK, dV`): at NDR the compute hides it but for the last hop home (24.7 ms,
#   its compute alone 24.1), at HDR it does not (42.6 ms). **The double ring** (`w = 8`) sends a tenth of that between
#   nodes, each block with 8 rounds to cross in: 25.7 ms at HDR. Both compute a fifth more than
#   USP here, so neither is picked.
# - **The all-gather** exposes every byte: 44.4 ms at NDR, 64.6 at HDR.

# %%
key16 = {(s.label, p.name): (s, p) for s, p in plans16}
ring16, double16, ulysses16 = (key16[label, "in-order"] for label in ("ring", "double_ring (w=8)", "ulysses (u=16)"))
usp_inside, usp_across = key16["usp (u=8)", "in-order"], key16["usp (u=8)", "ring-in-nodes"]
alone16 = {key: key_seconds(key, pair, Machine.one_link(float("inf")), RATE16) * 1e3     # compute alone
           for key, pair in plans16.items()}
ndr, hdr = ms16["h100-ndr"], ms16["h100-hdr"]
for name in machines16:
    assert chosen16[name] == usp_inside and ms16[name][usp_inside] < ms16[name][usp_across]
ulysses_from = min(g for g, key in zip(inter_gbs, picked) if key == ulysses16)
assert round(ulysses_from) == 195 and all(key == (ulysses16 if g >= ulysses_from else usp_inside)
                                          for g, key in zip(inter_gbs, picked))
assert min(alone16, key=alone16.get) == ulysses16 and 1.19 < alone16[ring16] / alone16[usp_inside] < 1.23
assert links16[usp_inside]["intra"] > 2 * links16[usp_inside]["inter"]
assert links16[ring16]["inter"] > 10 * links16[double16]["inter"] and alone16[double16] == alone16[ring16]
ring_next = (np.arange(N16) + 1) % N16                                     # the ring: g sends to g + 1
assert np.flatnonzero(crossings(np.arange(N16), ring_next, h100, range(N16))).tolist() == [7, 15]
assert ndr[ring16] < 1.03 * alone16[ring16] and hdr[ring16] > 1.7 * alone16[ring16]
assert hdr[double16] < 1.07 * alone16[double16] and ulysses16 not in (chosen16["h100-ndr"], chosen16["h100-hdr"])
assert all(ms16[name][key16["all_gather", "in-order"]] == max(ms16[name].values()) for name in machines16)
print({label: round(alone16[key], 1) for label, key in (("ulysses", ulysses16), ("usp (u=8)", usp_inside),
                                                        ("ring", ring16))}, "ms of compute alone")

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
# Work each out by hand first. Exercises 1 and 3 ask for a prediction, then a run: change the
# parameter in the cell under them and run it. The answers are in the cell after those
# (collapsed in Jupyter: click to open), checked against the project.
#
# 1. The dense formula's peak memory grew about four times each time `S` doubled (the first
#    plot, up to 53 MiB at `S = 2048`). Predict its peak at `S = 3072`; then set `S_TRY = 3072`
#    in the cell below and run it (it measures).
# 2. The 7B model at 256k tokens, on 16 devices instead of 8: how much K/V does the ring hold
#    per device, and the all-gather? (Ignore the few bytes of positions.)
# 3. Predict how the bytes one device sends in a forward change from `N = 8` to `N = 16` (same
#    `S`, 32 K/V heads): for the ring, and for Ulysses. Then set `N_TRY = 16` and run.
# 4. The ring on `N` devices sends each device's block to every other device once. What
#    fraction of one layer's `K` and `V` does one device send in a forward pass, as `N` grows?
# 5. The 16 GPUs and the attention of *At size* above, on nodes of 4 instead of 8 (four
#    nodes, HDR between them: `Machine(4, h100.intra, h100.inter)`): which scheme and placement
#    does the model pick, and which link carries more of its bytes (the most one rank sends
#    over each, as the bars count them)? Then check with `python -m reference.cost --scheme all
#    --machine h100-hdr --ranks-per-node 4 --n-devices 16 --seq-len 65536 --tile-size 1024`.
# 6. Write it: Ulysses' first all-to-all, `my_to_heads(shards)`. `shards` are the `N` devices'
#    arrays `(B, S / N, H, D)`, device `j` holding tokens `j S / N .. (j + 1) S / N - 1` (the
#    contiguous layout) of every head; return the `N` arrays `(B, S, H / N, D)` that the devices
#    hold after it, device `i` holding head group `i` (heads `i H / N ..`) of every token, in
#    token order. The last cell checks it: each device's attention on its heads must equal
#    those heads of dense attention.

# %%
S_TRY = 3072                                       # exercise 1: the sequence length to measure
q_try, k_try, v_try = (rng.standard_normal((1, S_TRY, 1, 32)).astype(np.float32) for _ in range(3))
measured_try = peak_bytes(lambda: attention(q_try, k_try, v_try))
print(f"dense attention at S = {S_TRY}: peak {measured_try / 2**20:.1f} MiB")

# %%
N_TRY = 16                                         # exercise 3: devices (a divisor of the 32 heads)
for label, scheme in [("ring", Scheme.checked("ring", None, n_devices=N_TRY, Hq=H7, Hkv=H7)),
                      ("ulysses", Scheme.checked("ulysses", None, n_devices=N_TRY, Hq=H7, Hkv=H7))]:
    sent = predict_scheme(scheme, S7, "striped", B=1, Hq=H7, Hkv=H7, D=D7, dtype="float16",
                          tile_size=4096).totals()["bytes_sent"]
    print(f"N = {N_TRY}, {label}: {sent / GiB:.2f} GiB sent per device, forward (N = 8: "
          f"{table[label if label == 'ring' else 'ulysses (u=8)', 32]['forward']:.2f})")

# %% jupyter={"source_hidden": true}
# 1. (3072 / 2048)^2 = 2.25 times the peak at 2048: about 120 MiB (the S x S scores dominate)
answer_1 = dense_peak[-1] * (S_TRY / 2048) ** 2
assert 0.9 < measured_try / answer_1 < 1.1

# 2. the ring: two blocks of 1/16 of one layer's 4 GiB = 0.5 GiB; the all-gather: still all 4 GiB
answer_2 = (0.5, 4.0)
for (name, held_gib) in zip(("ring", "all_gather"), answer_2):
    t = predict_scheme(Scheme.checked(name, None, n_devices=16, Hq=H7, Hkv=H7), S7, "striped",
                       B=1, Hq=H7, Hkv=H7, D=D7, dtype="float16", tile_size=4096).totals()
    assert abs(t["peak_kv"] / GiB - held_gib) < 0.01 * held_gib

# 3. the ring sends N - 1 blocks of 1/N of the layer's 4 GiB (and their positions): 3.50 -> 3.75 GiB,
#    hardly less. Ulysses trades (N - 1) / N of this device's Q, K, V, O, each (S / N) H D x 2 bytes
#    (and lse): its share of the sequence halves, so its bytes nearly halve, 0.88 -> 0.47 GiB
whole_kv = 2 * S7 * H7 * D7 * BF16
c_try = S7 // N_TRY
answer_3 = {"ring": (N_TRY - 1) * (2 * c_try * H7 * D7 * BF16 + 8 * c_try + 8),     # K, V, positions, owner
            "ulysses": (N_TRY - 1) / N_TRY * (4 * c_try * H7 * D7 * BF16 + c_try * H7 * 4)}
for name, expected in answer_3.items():
    t = predict_scheme(Scheme.checked(name, None, n_devices=N_TRY, Hq=H7, Hkv=H7), S7, "striped",
                       B=1, Hq=H7, Hkv=H7, D=D7, dtype="float16", tile_size=4096).totals()
    assert abs(t["bytes_sent"] - expected) < 1e-4 * expected, name

# 4. N - 1 of its N blocks' worth over the pass, each 1/N of the sequence: (N - 1) / N, close to all of it
answer_4 = lambda n: (n - 1) / n
for n in (4, 8):
    t = predict_scheme(Scheme.checked("ring", None, n_devices=n, Hq=H7, Hkv=H7), S7, "striped",
                       B=1, Hq=H7, Hkv=H7, D=D7, dtype="float16", tile_size=4096).totals()
    assert abs(t["bytes_sent"] / whole_kv - answer_4(n)) < 0.01

# 5. Ulysses groups of a node's 4 ranks keep the all-to-all on NVLink; in order, rank g's ring group
#    is g, g + 4, g + 8, g + 12 (mod 16), one rank a node, so every block of its ring crosses:
#    usp (u=4), in-order, with more bytes between nodes (0.22 GiB) than inside (0.18)
answer_5 = ("usp (u=4)", "in-order", "inter")
quad = Machine(4, h100.intra, h100.inter)                      # 4 nodes of 4
s5, p5 = choose(placed(costs16, quad), quad, RATE16)
on5 = on_links(costs16[s5], quad, p5)
assert (s5.label, p5.name, max(on5, key=on5.get)) == answer_5
assert (round(on5["inter"], 2), round(on5["intra"], 2)) == (0.22, 0.18)


# 6. cut each device's array into N head groups; device i takes group i of every device, in order
def my_to_heads(shards):
    groups = [np.split(x, len(shards), axis=2) for x in shards]           # groups[j][i]: (B, S / N, H / N, D)
    return [np.concatenate([groups[j][i] for j in range(len(shards))], axis=1) for i in range(len(shards))]


# %%
def check_to_heads(to_heads, S=32, N=4, H=8, D=4):
    """Ulysses on N devices with `to_heads` as its all-to-all: each device's attention on the heads
    it receives must be those heads of dense attention."""
    q, k, v = (rng.standard_normal((1, S, H, D)) for _ in range(3))       # (B, S, H, D)
    whole = attention(q, k, v)[0]
    held = [to_heads(shard(x, N, "contiguous")) for x in (q, k, v)]      # each: N arrays (B, S, H / N, D)
    for i in range(N):
        group = slice(i * H // N, (i + 1) * H // N)
        assert held[0][i].shape == (1, S, H // N, D), held[0][i].shape
        assert np.allclose(attention(held[0][i], held[1][i], held[2][i])[0], whole[:, :, group], rtol=0, atol=1e-12)
    return True


print("my_to_heads is Ulysses' all-to-all:", check_to_heads(my_to_heads))

# %% [markdown]
# **What we have seen.** Memory grows with the sequence: quadratically for the scores,
# which the online softmax removes, and linearly for everything else, which only cutting
# the sequence over devices divides. Attention then needs other devices' keys: gathering
# them all holds one layer's keys and values at a time and exposes its transfers, Ulysses
# trades the sequence for heads and moves least (`Q` and `O` included) but all of it
# exposed, and passing them around a ring holds two blocks and hides its transfers behind
# the compute (all but the backward's last hop home), while sending the most. On nodes, which
# link each transfer crosses decides as much: the model puts the exposed all-to-all inside a
# node and lets the ring's blocks cross between nodes behind the compute. A round lasts as
# long as its busiest device, and under contiguous blocks that device has a full block while
# others idle: the rest of these notebooks is about that imbalance and how striping removes
# it. Next, `01_attention_and_online_softmax`: why one block at a time gives the exact answer.
