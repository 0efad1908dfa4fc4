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
# # 5. The backward pass
#
# Training needs the gradients `dQ, dK, dV` of a loss through attention. The forward pass
# saved only `out` and `lse` per query (nothing of size `n_seq x n_seq`), and the backward
# recomputes each tile's softmax weights from them (FlashAttention's backward):
#
# $$S = \sigma\, Q K^\top,\quad P = e^{S - \mathrm{lse}},\quad dV \mathrel{+}= P^\top dO,\quad
# dP = dO\,V^\top,\quad dS = P \circ (dP - \delta),\quad dQ \mathrel{+}= \sigma\, dS\,K,\quad
# dK \mathrel{+}= \sigma\, dS^\top Q$$
#
# with `delta = rowsum(dO * out)` computed once per query, and `sigma` the scale
# (`1 / sqrt(D)` unless given): the scores carry it, and so do the products that go back
# through them to `Q` and `K`.
#
# **Two meanings of S.** In these formulas, as in FlashAttention and in the code (`s`),
# `S = sigma Q K^T` is the matrix of **scores** of a tile. The other notebooks also use `S` for
# the number of **tokens**; to keep the two apart, this notebook calls the number of tokens
# `n_seq` (the paper's name), and `S` is always scores.
#
# On the ring, a query's gradient `dQ` gathers contributions from every key block: it stays
# home, like `Q`. A key's gradient `dK` (and `dV`) gathers contributions from every
# device's queries: so **dK and dV travel with K and V**, each device adding its share as
# the block passes, and one last hop brings them home to the device that owns those keys.
#
# This notebook checks what travels (from the trace's byte counts) and checks the ring's
# gradients against the dense formula and against central finite differences.

# %%
import ast
import inspect
import time

import matplotlib.pyplot as plt
import numpy as np

from reference import LAYOUTS, attention, attention_backward, positions, ring, ring_attention, ring_attention_backward
from reference import shard, step, steps, unshard
from reference.heads import kv_from_heads
from reference.masks import CAUSAL
from reference.virtual import run_devices

n_seq, N, T = 16, 4, 2                 # 16 tokens: 4 devices of 4 tokens, tiles of 2
B, HQ, HKV, D = 1, 2, 1, 4             # two query heads share one key/value head
c = n_seq // N
rng = np.random.default_rng(0)
q = rng.standard_normal((B, n_seq, HQ, D))                        # (B, n_seq, Hq, D) float64
k, v = (rng.standard_normal((B, n_seq, HKV, D)) for _ in range(2))   # (B, n_seq, Hkv, D)
dout = rng.standard_normal(q.shape)                           # the loss is sum(out * dout)

# %% [markdown]
# ## Where dS = P (dP - delta) comes from
#
# Take one query row. Its scores are `s_k` (one per key), its weights `P_k = e^{s_k} / sum_l e^{s_l}`
# (the softmax; with the row's `lse` this is `e^{s_k - lse}`), its output
# `out = sum_k P_k v_k`. Given `dO = dL/d out`:
#
# - `dP_k = dL/dP_k = dO . v_k`, a row of `dP = dO V^T`;
# - the softmax's derivative is `dP_l/ds_k = P_l (1[l = k] - P_k)`, so
#
# $$dS_k = \sum_l dP_l\, P_l (1[l = k] - P_k) = P_k \Big(dP_k - \sum_l P_l\, dP_l\Big);$$
#
# - and the sum is one number per row that needs no scores:
#   `sum_l P_l dP_l = sum_l P_l (dO . v_l) = dO . (sum_l P_l v_l) = dO . out = delta`.
#
# So `dS = P (dP - delta)` with `delta = rowsum(dO * out)`, computed once per query from the
# saved `out`: the backward never needs the whole row of `P` at once, so it can go tile by
# tile, block by block, like the forward. Checked against the softmax's Jacobian written out:

# %%
s_row = rng.standard_normal(6)                                # one row of scores S
v_row, do_row = rng.standard_normal((6, 3)), rng.standard_normal(3)   # its 6 values (6, D=3), dO (3,)
p_row = np.exp(s_row - s_row.max()) / np.exp(s_row - s_row.max()).sum()
out_row = p_row @ v_row
dp_row = v_row @ do_row                                       # dP_k = dO . v_k
jacobian = np.diag(p_row) - np.outer(p_row, p_row)            # dP_l / ds_k, symmetric
delta_row = do_row @ out_row                                  # rowsum(dO * out)
assert np.allclose(jacobian @ dp_row, p_row * (dp_row - delta_row), rtol=0, atol=1e-15)
assert np.isclose(p_row @ dp_row, delta_row, rtol=0, atol=1e-15)

# %% [markdown]
# ## The code
#
# `reference.step.backward_tile` is those formulas on one tile (version 1, the readable
# step; faster versions in `reference.steps` are checked against it). Note `dS` computed
# from `P`, `dP` and `delta` on the tile alone:

# %%
print(inspect.getsource(step.backward_tile))

# %% [markdown]
# `reference.ring.ring_backward` is the ring loop for one device: the same shape as
# `ring_forward` (notebook 3), with `dK, dV` travelling behind `K, V` (tag `DKV`) and one
# last hop home after the loop:

# %%
print(inspect.getsource(ring.ring_backward))

# %% [markdown]
# ## What a tile of the backward costs
#
# The forward's tile makes two matrix products, `S = Q K^T` and `P V`. The backward's makes
# five: `S = Q K^T` again (it recomputes `P` instead of keeping it), `dV += P^T dO`,
# `dP = dO V^T`, `dQ += dS K` and `dK += dS^T Q`. Each costs `2 D` FLOPs per (query, key)
# pair and head, so a visible pair costs `4 D` FLOPs forward and `10 D` backward, 2.5
# times as much. Counted in the code itself (`@`, and `masked_product`, a product that
# leaves out masked rows):

# %%
def products(fn):
    """Matrix products written in the source of `fn`: `a @ b` and `masked_product(...)`."""
    tree = ast.parse(inspect.getsource(fn))
    return sum(isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult)
               or isinstance(node, ast.Call) and getattr(node.func, "id", "") == "masked_product"
               for node in ast.walk(tree))


print("products per tile: forward", products(step.forward_tile), " backward", products(step.backward_tile))
assert (products(step.forward_tile), products(step.backward_tile)) == (2, 5)

# %% [markdown]
# So a backward tile costs 2.5 times a forward one in products. Measured, the ratio is
# usually lower, most of all on small blocks: part of the forward's time is outside the
# products (exponentials, rescaling, the per-block work of planning tiles).
# `docs/notes/tile-cost-by-block-shape.md` measures a backward tile of full blocks at 2.2 to
# 2.5 times a forward one, at tiles of 256 with the tuned steps `v3` and `v4`. Timed here,
# forward and backward of the same ring with the readable step, in CPU time (best of three;
# the machine may be shared, so the figure is printed and drawn, not asserted):

# %%
S_T = 2048
x = [rng.standard_normal((1, S_T, 2, 64)).astype(np.float32) for _ in range(4)]       # q, k, v, dO
seconds = {"forward": [], "backward": []}
for _ in range(3):
    start = time.process_time()
    o_t, l_t = ring_attention(*x[:3], n_devices=2, layout="striped", tile_size=256, step="v1")
    seconds["forward"].append(time.process_time() - start)
    start = time.process_time()
    ring_attention_backward(*x[:3], o_t, l_t, x[3], n_devices=2, layout="striped", tile_size=256, step="v1")
    seconds["backward"].append(time.process_time() - start)
ratio = min(seconds["backward"]) / min(seconds["forward"])
print(f"S = {S_T}, 2 devices, step v1, CPU time: forward {min(seconds['forward']) * 1e3:.0f} ms, "
      f"backward {min(seconds['backward']) * 1e3:.0f} ms: x{ratio:.1f} (products: x2.5)")

fig, ax = plt.subplots(figsize=(5, 2.2))
ax.barh(["forward", "backward"], [min(seconds["forward"]) * 1e3, min(seconds["backward"]) * 1e3], color=["#4c72b0", "#dd8452"])
ax.barh(["backward"], [2.5 * min(seconds["forward"]) * 1e3], fill=False, edgecolor="k", ls="--",
        label="2.5 x the forward (the products' ratio)")
ax.set_xlabel("CPU ms, best of three (this run)")
ax.legend(fontsize=8, loc="lower right")
plt.show()

# %% [markdown]
# ## What travels
#
# Run forward and backward on the ring with traces. The trace's `bytes_sent[t, j]` is what
# device `j` put on the ring in round `t`, as its communication object counted it (the loop
# above tells it the round, `log.rounds()`, and counts nothing itself).
#
# - forward: rounds `0 .. N-2` send the `K, V` block (with its `c` positions, and its
#   owner: two 4-byte numbers, the device it started on and whether its `K, V` are finite);
#   the last round sends nothing;
# - backward: the same `K, V` blocks, plus, in **every** round, the `dK, dV` accumulated so
#   far for the block just processed; the last round's send is the hop home.
#
# The counts below are exactly those: nothing is left over for `Q` or `dQ`, which never
# leave home. So each round of the backward sends twice the forward's messages. Per device,
# the forward sends `N - 1` messages and the backward `2N - 1` (the extra one is the hop
# home); the next section counts them as they are sent. How many bytes depends on the
# dtypes: `K, V` travel in the input dtype, `dK, dV` in the accumulation dtype (float64 for
# float64 inputs, float32 for float16 and bfloat16). Here, in float64, the gradient block is
# as large as the `K, V` block, and a backward round sends a little under twice the forward's
# bytes (positions and owner ride with `K, V` only):

# %%
out, lse, fwd = ring_attention(q, k, v, n_devices=N, layout="striped", tile_size=T, trace=True)
dq, dk, dv, bwd = ring_attention_backward(q, k, v, out, lse, dout, n_devices=N, layout="striped",
                                          tile_size=T, trace=True)

kv_block = 2 * B * c * HKV * D * 8            # K and V shards, float64
block_msg = kv_block + c * 8 + 8              # + int64 positions + the owner (two int32)
grad_msg = kv_block                           # dK and dV, float64 (the float64 accumulators)

print("forward bytes per (round, device):\n", fwd.bytes_sent)
print("backward bytes per (round, device):\n", bwd.bytes_sent)

assert (fwd.bytes_sent[:N - 1] == block_msg).all() and (fwd.bytes_sent[N - 1] == 0).all()
assert (bwd.bytes_sent[:N - 1] == block_msg + grad_msg).all()
assert (bwd.bytes_sent[N - 1] == grad_msg).all()                  # the hop home
print(f"backward over forward, bytes per round, float64: {bwd.bytes_sent[0, 0] / fwd.bytes_sent[0, 0]:.2f}")
assert bwd.bytes_sent[0, 0] / fwd.bytes_sent[0, 0] == (block_msg + grad_msg) / block_msg < 2

# %% [markdown]
# In float16 (or bfloat16), `K, V` travel in 2 bytes a number and `dK, dV` in float32's 4:
# the gradient block is twice the `K, V` block, and a backward round sends nearly three
# times the forward's bytes. Measured on the ring in float16 (64 tokens a device, `D = 16`),
# and counted by the cost model for the 7B model of notebook 0 (256k tokens on 8 devices,
# 32 K/V heads of 128), where the backward's last round adds the hop home:

# %%
from reference.scheme_cost import predict_scheme
from reference.schemes import Scheme

x16 = [rng.standard_normal(shape).astype(np.float16) for shape in ((1, 256, 2, 16), (1, 256, 1, 16), (1, 256, 1, 16))]
o16, l16, fwd16 = ring_attention(*x16, n_devices=4, layout="striped", trace=True)
*_, bwd16 = ring_attention_backward(*x16, o16, l16, x16[0], n_devices=4, layout="striped", trace=True)
per_round_16 = bwd16.bytes_sent[0, 0] / fwd16.bytes_sent[0, 0]
ring4 = Scheme.checked("ring", None, n_devices=4, Hq=2, Hkv=1)
for trace_, backward in ((fwd16, False), (bwd16, True)):                   # the cost model counts the same bytes
    predicted = predict_scheme(ring4, 256, "striped", B=1, Hq=2, Hkv=1, D=16, dtype=np.float16, backward=backward)
    assert (trace_.bytes_sent == predicted.bytes_sent).all()
ring8 = Scheme.checked("ring", None, n_devices=8, Hq=32, Hkv=32)
fwd7, bwd7 = (predict_scheme(ring8, 262144, "striped", B=1, Hq=32, Hkv=32, D=128, dtype="float16", tile_size=4096,
                             backward=backward) for backward in (False, True))
print(f"backward over forward, float16, bytes per round: {per_round_16:.2f} (measured, 64 tokens a device);  "
      f"7B, 256k tokens, 8 devices: {bwd7.bytes_sent[0, 0] / fwd7.bytes_sent[0, 0]:.2f} per round, "
      f"{bwd7.totals()['bytes_sent'] / fwd7.totals()['bytes_sent']:.2f} over the pass (cost model)")
assert 2.7 < per_round_16 < 3 and 2.99 < bwd7.bytes_sent[0, 0] / fwd7.bytes_sent[0, 0] < 3
assert 3.28 < bwd7.totals()["bytes_sent"] / fwd7.totals()["bytes_sent"] < 3.3

# %%
rounds = np.arange(N)
per_round_fwd = fwd.bytes_sent[:, 0]
per_round_bwd = bwd.bytes_sent[:, 0]
fig, ax = plt.subplots(figsize=(6, 3))
ax.bar(rounds - 0.2, per_round_fwd, width=0.4, label="forward: K, V (+ positions)")
ax.bar(rounds + 0.2, np.where(rounds < N - 1, block_msg, 0), width=0.4, label="backward: K, V (+ positions)")
ax.bar(rounds + 0.2, per_round_bwd - np.where(rounds < N - 1, block_msg, 0), width=0.4,
       bottom=np.where(rounds < N - 1, block_msg, 0), label="backward: dK, dV")
ax.set_xticks(rounds)
ax.set_xlabel("round")
ax.set_ylabel("bytes sent per device")
ax.set_title("What each device sends, per round (float64, c = 4 tokens)", fontsize=9)
ax.set_ylim(0, 1.45 * per_round_bwd.max())
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## One block's dK, round by round
#
# Follow the key block that starts on device 0. In round `t` device `t` holds it, adds its
# queries' share to the block's `dK`, and sends the sum on with the block; after the last
# round device `N-1` sends it home to device 0. We run `ring_backward` on four threads, as
# `ring_attention_backward` does, with a communication object that notes every `dK` sent.

# %%
class WatchedGrads:
    """Passes every call to the real communication object, noting each dK sent."""

    def __init__(self, comm, sent_dk):
        self.comm, self.sent_dk = comm, sent_dk
        self.rank, self.size = comm.rank, comm.size
        self.traffic = comm.traffic            # where the real one counts the bytes it moves, for the trace
        self.round = 0
        self.messages = {ring.KV: 0, ring.DKV: 0}        # shifts started, by kind

    def start_shift(self, arrays, tag):
        self.messages[tag] += 1
        if tag == ring.DKV:                    # (dK, dV) accumulated so far, (B, Hkv, c, D)
            self.sent_dk[self.round, self.rank] = kv_from_heads(arrays[0])[0, :, 0, :]   # (c, D)
            self.round += 1
        return self.comm.start_shift(arrays, tag)

    def finish_shift(self, handle):
        return self.comm.finish_shift(handle)

    def progress(self):
        self.comm.progress()


pos = positions(n_seq, N, "striped")                          # (N, c)
q_s, k_s, v_s, out_s, dout_s = (shard(x, N, "striped") for x in (q, k, v, out, dout))
lse_s = shard(lse, N, "striped", axis=2)
sent_dk = np.zeros((N, N, c, D))                              # [t, j]: the dK device j sent in round t


watched = {}                                                  # rank -> its WatchedGrads


def device(j, comm):
    watched[j] = WatchedGrads(comm, sent_dk)
    return ring.ring_backward(q_s[j], k_s[j], v_s[j], out_s[j], lse_s[j], dout_s[j], pos[j], pos[j],
                              watched[j], scale=D ** -0.5, tile_size=T,
                              step=steps.get("v1"), mask=CAUSAL)   # the step shown above, as ring_attention_backward uses


dq_w, dk_w, dv_w, _ = zip(*run_devices(N, device))
assert np.allclose(unshard(dk_w, "striped"), dk, rtol=0, atol=1e-14)   # the same gradients as above
print("messages each device sent:", {j: {"K, V": w.messages[ring.KV], "dK, dV": w.messages[ring.DKV]}
                                     for j, w in sorted(watched.items())})
assert all(w.messages == {ring.KV: N - 1, ring.DKV: N} for w in watched.values())   # forward: N - 1, its bytes_sent

# %% [markdown]
# Device `j` adds the share of its own queries only. So, independently of the ring, the
# `dK` of block 0 after round `t` is the dense gradient with `dO` kept on the queries of
# devices `0 .. t` and zeroed elsewhere (each query row's contribution is separate). The
# picture: per key of block 0 (positions `0, 4, 8, 12`), what each device adds to its `dK`,
# each bar starting where the previous device's ended, up to the finished `dK` that goes
# home. Every device adds something to every key here: key 12 is seen by queries 12 to 15,
# one on each device, and key 0 by every query. (An addition can be negative: gradients
# from different queries can pull a key in opposite directions.)

# %%
held = [sent_dk[t, t] for t in range(N)]                      # block 0 is on device t in round t
for t in range(N):
    keep = np.zeros(n_seq, dtype=bool)
    keep[pos[:t + 1].ravel()] = True                          # the queries of devices 0 .. t
    partial = attention_backward(q, k, v, out, lse, dout * keep[None, :, None, None])[1]
    assert np.allclose(held[t], partial[0, pos[0], 0, :], rtol=0, atol=1e-14)
assert np.allclose(held[N - 1], dk[0, pos[0], 0, :], rtol=0, atol=1e-14)   # complete when it comes home

# What each device added: the difference between what it sent and what it received.
# Each key's dK is a vector of D = 4 numbers; to draw it as one number per key, each
# addition is measured along the direction of the finished dK, so that the additions
# of the four devices add up to its length.
added = np.diff(np.concatenate([np.zeros((1, c, D)), held]), axis=0)     # (round, key, D)
final = held[N - 1]                                                      # (key, D): dK come home
along = np.einsum("tid,id->ti", added, final / np.linalg.norm(final, axis=-1, keepdims=True))   # (round, key)
assert np.allclose(along.sum(axis=0), np.linalg.norm(final, axis=-1), rtol=0, atol=1e-12)

COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]             # one colour per device
fig, ax = plt.subplots(figsize=(7, 3.6))
width = 0.18
for i in range(c):                                                 # one group of bars per key
    level = 0.0
    for t in range(N):                                             # each round starts where the last ended
        x = i + (t - (N - 1) / 2) * width
        ax.bar(x, along[t, i], width=width * 0.9, bottom=level, color=COLORS[t],
               label=f"added by device {t} in round {t}" if i == 0 else None)
        if t < N - 1:
            ax.plot([x, x + width], [level + along[t, i]] * 2, color="0.4", lw=0.8)   # carried to the next device
        level += along[t, i]
    ax.plot([i - 2.2 * width, i + 2.2 * width], [level] * 2, "k-", lw=2,
            label="complete: sent home to device 0" if i == 0 else None)
ax.axhline(0, color="k", lw=0.5)
levels = np.concatenate([np.zeros((1, c)), np.cumsum(along, axis=0)])   # the running sums, every bar's ends
span = levels.max() - levels.min()
ax.set_ylim(levels.min() - 0.08 * span, levels.max() + 0.08 * span)
ax.set_xticks(range(c), [f"key {p}" for p in pos[0]])
ax.set_ylabel("dK along its final direction")
ax.set_title("Block 0's dK, accumulated as it travels: each device adds its queries' share", fontsize=9)
handles, labels = ax.get_legend_handles_labels()               # the devices first, then the total
ax.legend(handles[1:] + handles[:1], labels[1:] + labels[:1], fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
plt.show()

# %% [markdown]
# ## The same work, the same balance
#
# The backward visits the same tiles as the forward, so the layouts' balance carries over:
# the per-(round, device) work tables are identical.

# %%
assert (bwd.pairs == fwd.pairs).all() and (bwd.tiles_computed == fwd.tiles_computed).all()
print(bwd.table("striped backward"))

# %% [markdown]
# ## Against the dense gradients
#
# `reference.attention_backward` is the formula on the whole `n_seq x n_seq` matrix. Every layout
# of the ring gives the same gradients to rounding (float64 here). For grouped-query heads,
# a key/value head's gradient is the sum over the query heads that read it, so `dk` has
# `k`'s shape.

# %%
dense = attention_backward(q, k, v, *attention(q, k, v), dout)
for layout in LAYOUTS:
    o, l = ring_attention(q, k, v, n_devices=N, layout=layout, tile_size=T)
    grads = ring_attention_backward(q, k, v, o, l, dout, n_devices=N, layout=layout, tile_size=T)
    errors = [float(np.abs(g - gd).max()) for g, gd in zip(grads, dense)]
    print(f"{layout:<11} max |ring - dense|  dq {errors[0]:.1e}  dk {errors[1]:.1e}  dv {errors[2]:.1e}")
    assert max(errors) < 1e-12
    assert grads[1].shape == k.shape and grads[2].shape == v.shape

# %% [markdown]
# ## Against finite differences
#
# The dense formula could share a mistake with the ring, so finally an independent check:
# the derivative of the loss `L = sum(out * dout)`, where `out` comes from the ring's own
# forward pass, by central differences,
#
# $$\frac{\partial L}{\partial x_i} \approx \frac{L(x + \epsilon e_i) - L(x - \epsilon e_i)}{2\epsilon},$$
#
# for every entry of `q`, `k` and `v` (256 numbers, two ring runs each). In float64 with
# `eps = 1e-6` the truncation error is about `eps^2` and the rounding error about
# `1e-16 / eps`, so agreement to `1e-8` is what to expect.

# %%
EPS = 1e-6


def loss(q, k, v):
    out, _ = ring_attention(q, k, v, n_devices=N, layout="striped", tile_size=T)
    return float((out * dout).sum())


def central_difference(x, index, args, which):
    plus, minus = [a.copy() for a in args], [a.copy() for a in args]
    plus[which][index] += EPS
    minus[which][index] -= EPS
    return (loss(*plus) - loss(*minus)) / (2 * EPS)


args = [q, k, v]
numeric = [np.zeros_like(a) for a in args]
for which, x in enumerate(args):
    for index in np.ndindex(x.shape):
        numeric[which][index] = central_difference(x, index, args, which)

ring_grads = (dq, dk, dv)
for name, fd, g in zip(("dq", "dk", "dv"), numeric, ring_grads):
    print(f"{name}: max |ring - finite difference| = {np.abs(fd - g).max():.1e}")
    assert np.allclose(g, fd, rtol=1e-6, atol=1e-8)

# %% [markdown]
# Every analytic gradient against its finite difference: all on the diagonal.

# %%
fig, axes = plt.subplots(1, 3, figsize=(10, 3.4), layout="constrained")
for ax, name, fd, g in zip(axes, ("dQ", "dK", "dV"), numeric, ring_grads):
    ax.plot(fd.ravel(), g.ravel(), ".", alpha=0.7, label="one entry")
    lim = np.abs(fd).max() * 1.1
    ax.plot([-lim, lim], [-lim, lim], "k-", lw=0.5, label="equal")
    ax.set_title(f"{name}: {fd.size} entries", fontsize=10)
    ax.set_xlabel("finite difference of the loss")
axes[0].set_ylabel("ring backward (the formulas)")
axes[0].legend(fontsize=8)
plt.show()

# %% [markdown]
# ## Exercises
#
# Work each out by hand first; the cell under it (collapsed in Jupyter) holds the answer
# and checks it.
#
# 1. With `n_seq = 16` on `N = 4` devices, striped, the loss depends only on the output of
#    the last token (`dO` is zero except at position 15). Which rows of `dQ` are non-zero?
#    Which keys get a non-zero `dK`?
# 2. In the backward of the striped ring above, how many bytes does one device send in
#    total over the `N` rounds? (float64; `K, V` blocks of `c` tokens, `Hkv = 1`, `D = 4`,
#    plus `c` int64 positions and the owner's 8 bytes with each `K, V` block.)
# 3. A row's `delta` is `dO . out`. If every key's value were the same vector `v0`, what
#    would `dS` be, whatever the scores?
# 4. Write it: `my_backward(q, k, v, out, lse, dout, scale)`, the backward of causal attention
#    for one head, from the formulas at the top: `q, k, v, out, dout` are `(n, D)` arrays of
#    the tokens at positions `0 .. n-1`, `lse` is `(n,)`. Return `(dq, dk, dv)`. The cell after
#    the answers checks it against `reference.attention_backward`.

# %% jupyter={"source_hidden": true}
# 1. dQ_i = sum_k dS_ik K_k and dS_i = 0 where dO_i = 0: only row 15. dK_k = sum_i dS_ik Q_i
#    gets row 15's share, and query 15 sees every key: all 16 keys (almost surely non-zero)
last = np.zeros_like(dout)
last[:, 15] = dout[:, 15]
dq_1, dk_1, _ = attention_backward(q, k, v, out, lse, last)
answer_1 = ([15], list(range(16)))
assert np.flatnonzero(np.abs(dq_1).sum(axis=(0, 2, 3))).tolist() == answer_1[0]
assert np.flatnonzero(np.abs(dk_1).sum(axis=(0, 2, 3))).tolist() == answer_1[1]

# 2. rounds 0 .. N-2 send K, V (2 * c * D * 8 bytes), positions and owner (c * 8 + 8) and
#    dK, dV (2 * c * D * 8); the last round sends dK, dV only: with c = 4, D = 4:
#    3 * (256 + 40 + 256) + 256 = 1912
answer_2 = 1912
assert (bwd.bytes_sent.sum(axis=0) == answer_2).all()

# 3. dP_k = dO . v0 for every k, and delta = dO . (sum_k P_k v0) = dO . v0: dS = P (dP - delta) = 0.
#    The scores get no gradient: whatever the weights, the output is v0.
v_same = np.broadcast_to(rng.standard_normal((1, 1, HKV, D)), v.shape).copy()
dq_3, dk_3, _ = attention_backward(q, k, v_same, *attention(q, k, v_same), dout)
answer_3 = 0.0
assert np.abs(dq_3).max() < 1e-12 and np.abs(dk_3).max() < 1e-12



# 4. recompute P from lse, then the five products; the mask from positions 0 .. n-1
def my_backward(q, k, v, out, lse, dout, scale):
    pos = np.arange(q.shape[0])
    visible = pos[:, None] >= pos[None, :]                      # (n, n): key k visible to query q
    p = np.where(visible, np.exp(scale * q @ k.T - lse[:, None]), 0.0)   # P = e^(S - lse), S = scale Q K^T
    dv = p.T @ dout
    dp = dout @ v.T
    delta = (dout * out).sum(axis=1)                           # rowsum(dO * out)
    ds = p * (dp - delta[:, None])
    return scale * ds @ k, scale * ds.T @ q, dv


# %%
def check_backward(backward_fn, n=12, D=4):
    """backward_fn on one head of random inputs against reference.attention_backward."""
    q1, k1, v1, do1 = (rng.standard_normal((1, n, 1, D)) for _ in range(4))          # (B, n, H, D)
    out1, lse1 = attention(q1, k1, v1)
    expected = attention_backward(q1, k1, v1, out1, lse1, do1)
    got = backward_fn(q1[0, :, 0], k1[0, :, 0], v1[0, :, 0], out1[0, :, 0], lse1[0, 0], do1[0, :, 0], D ** -0.5)
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert np.allclose(g, e[0, :, 0], rtol=0, atol=1e-12), name
    return True


print("my_backward gives the gradients:", check_backward(my_backward))

# %% [markdown]
# **What we have seen.** `dS = P (dP - delta)` needs only a tile and the saved `out`, so
# the backward runs the same ring with the same balance; `dQ` stays home while `dK, dV`
# travel with their blocks, gathering each device's share, and come home after the last
# round; a backward round sends twice the forward's messages and, in float16, nearly three
# times its bytes; the gradients match the dense formula and finite differences of the
# ring's own forward pass.
# Next, `06_real_processes`: the same code on real MPI processes.
