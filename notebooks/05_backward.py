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
# saved only `out` and `lse` per query (nothing of size `S x S`), and the backward
# recomputes each tile's softmax weights from them (FlashAttention's backward):
#
# $$P = e^{S - \mathrm{lse}},\quad dV \mathrel{+}= P^\top dO,\quad dP = dO\,V^\top,\quad
# dS = P \circ (dP - \delta),\quad dQ \mathrel{+}= dS\,K,\quad dK \mathrel{+}= dS^\top Q$$
#
# with `delta = rowsum(dO * out)` computed once per query.
#
# On the ring, a query's gradient `dQ` gathers contributions from every key block: it stays
# home, like `Q`. A key's gradient `dK` (and `dV`) gathers contributions from every
# device's queries: so **dK and dV travel with K and V**, each device adding its share as
# the block passes, and one last hop brings them home to the device that owns those keys.
#
# This notebook checks what travels (from the trace's byte counts) and checks the ring's
# gradients against the dense formula and against central finite differences.

# %%
import matplotlib.pyplot as plt
import numpy as np

from reference import LAYOUTS, attention, attention_backward, ring_attention, ring_attention_backward

S, N, T = 16, 4, 2                     # 4 devices of 4 tokens, tiles of 2
B, HQ, HKV, D = 1, 2, 1, 4             # two query heads share one key/value head
c = S // N
rng = np.random.default_rng(0)
q = rng.standard_normal((B, S, HQ, D))                        # (B, S, Hq, D) float64
k, v = (rng.standard_normal((B, S, HKV, D)) for _ in range(2))   # (B, S, Hkv, D)
dout = rng.standard_normal(q.shape)                           # the loss is sum(out * dout)

# %% [markdown]
# ## What travels
#
# Run forward and backward on the ring with traces. The trace's `bytes_sent[t, j]` is what
# device `j` put on the ring in round `t`.
#
# - forward: rounds `0 .. N-2` send the `K, V` block (with its `c` positions and the id of
#   the device it started on); the last round sends nothing;
# - backward: the same `K, V` blocks, plus, in **every** round, the `dK, dV` accumulated so
#   far for the block just processed; the last round's send is the hop home.
#
# The counts below are exactly those: nothing is left over for `Q` or `dQ`, which never
# leave home.

# %%
out, lse, fwd = ring_attention(q, k, v, n_devices=N, layout="striped", tile_size=T, trace=True)
dq, dk, dv, bwd = ring_attention_backward(q, k, v, out, lse, dout, n_devices=N, layout="striped",
                                          tile_size=T, trace=True)

kv_block = 2 * B * c * HKV * D * 8            # K and V shards, float64
block_msg = kv_block + c * 8 + 8              # + int64 positions + the int64 owner id
grad_msg = kv_block                           # dK and dV, float64 (the float64 accumulators)

print("forward bytes per (round, device):\n", fwd.bytes_sent)
print("backward bytes per (round, device):\n", bwd.bytes_sent)

assert (fwd.bytes_sent[:N - 1] == block_msg).all() and (fwd.bytes_sent[N - 1] == 0).all()
assert (bwd.bytes_sent[:N - 1] == block_msg + grad_msg).all()
assert (bwd.bytes_sent[N - 1] == grad_msg).all()                  # the hop home

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
ax.set_ylim(0, 1.45 * per_round_bwd.max())
ax.legend(fontsize=8)
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
# `reference.attention_backward` is the formula on the whole `S x S` matrix. Every layout
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
fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
for ax, name, fd, g in zip(axes, ("dq", "dk", "dv"), numeric, ring_grads):
    ax.plot(fd.ravel(), g.ravel(), ".", alpha=0.7)
    lim = np.abs(fd).max() * 1.1
    ax.plot([-lim, lim], [-lim, lim], "k-", lw=0.5)
    ax.set_title(name)
    ax.set_xlabel("central difference")
axes[0].set_ylabel("ring backward")
plt.show()

# %% [markdown]
# **What we have seen.** The backward runs the same ring with the same balance; `dQ` stays
# home while `dK, dV` travel with their blocks and come home after the last round; the
# gradients match the dense formula and finite differences of the ring's own forward pass.
# Next, `06_real_processes`: the same code on real MPI processes.
