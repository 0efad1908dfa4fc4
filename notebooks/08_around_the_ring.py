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
# # 8. Around the ring: collectives, data parallelism, stock kernels, PyTorch
#
# The last of nine notebooks. The ring does not run alone in a training job: it sits beside
# other collectives, inside a grid of data-parallel replicas, on top of an attention kernel
# someone else wrote, in a framework. This notebook is about that practice:
#
# 1. the four collectives the schemes are made of, drawn and run;
# 2. context parallelism composed with data parallelism: whose gradients are summed where,
#    shown on notebook 7's model over four MPI ranks;
# 3. striped blocks on a stock causal kernel (the one-token shift), and what it costs against
#    zigzag;
# 4. the ring's step written with `torch.distributed` and flash-attn beside the project's, and
#    how the project's `lse` maps to flash-attn's `softmax_lse`.
#
# Legend: `N` devices, `S` tokens, `c = S / N` tokens per device, `H` heads, `D` head dim.

# %%
import inspect
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

import reference
from model import train, transformer
from mpi_impl.launch import find_mpiexec
from reference import attention, cost, merge, positions, ring, shard, unshard
from reference.tiles import MASKED, tile_plan, visible
from reference.virtual import run_devices

rng = np.random.default_rng(0)
COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]   # one colour per device, as in notebook 2

# %% [markdown]
# ## 1. The collectives
#
# A *collective* is an operation every device of a group calls together. Four make up the
# schemes of notebook 0 and the training step around them:
#
# - **send / receive**: the ring's shift, each device sending to the next and receiving from
#   the previous (`start_shift`, `finish_shift` of the project's communication objects);
# - **all-gather**: every device ends with every device's block (the all-gather scheme's `K`,
#   `V`; in training, FSDP's weights);
# - **reduce-scatter**: every device holds a piece for each device, and device `j` ends with
#   the sum over devices of piece `j` (the all-gather scheme's `dK, dV`; FSDP's gradients);
# - **all-to-all**: device `j` holds a piece for each device `i` and ends with piece `j` of
#   every device (Ulysses).
#
# An **all-reduce** (every device ends with the sum of everything, as data parallelism sums
# gradients) is a reduce-scatter followed by an all-gather. Here each is written with the
# ring's two verbs (and the all-to-all of a Ulysses group), run on four virtual devices, and
# checked: a ring all-gather or reduce-scatter takes `N - 1` shifts, each moving one piece
# of `1 / N` of the data.

# %%
def all_gather(comm, mine):
    """Every device's piece, in the ring's order: [from device j, j - 1, ..., j - N + 1]."""
    pieces = [mine]
    for _ in range(comm.size - 1):
        (arrived,) = comm.finish_shift(comm.start_shift((pieces[-1],), 1))
        pieces.append(arrived)
    return pieces


def reduce_scatter(comm, pieces):
    """Device j's piece j summed over every device: in shift t each device passes on its
    running sum for piece j - 1 - t and adds its own to the sum arriving (notebook 0's all-gather
    backward does this with dK, dV)."""
    j, n = comm.rank, comm.size
    total = pieces[(j - 1) % n]
    for t in range(n - 1):
        (arrived,) = comm.finish_shift(comm.start_shift((total,), 2))
        total = arrived + pieces[(j - 2 - t) % n]               # a new array: the one sent stays as it was
    return total


def four_collectives(j, comm):
    """What device j holds after each collective; device j's own data is the number j (x 10^i for piece i)."""
    (shifted,) = comm.finish_shift(comm.start_shift((np.array([j]),), 0))
    pieces = [np.array([j * 10 ** i]) for i in range(comm.size)]        # piece i, meant for device i
    return dict(send_receive=shifted, all_gather=all_gather(comm, np.array([j])),
                reduce_scatter=reduce_scatter(comm, pieces), all_to_all=comm.all_to_all(pieces),
                all_reduce=all_gather(comm, reduce_scatter(comm, pieces)))


held = run_devices(4, four_collectives)
for j, h in enumerate(held):
    assert h["send_receive"][0] == (j - 1) % 4
    assert [p[0] for p in h["all_gather"]] == [(j - t) % 4 for t in range(4)]
    assert h["reduce_scatter"][0] == sum(d * 10 ** j for d in range(4))          # piece j of every device, summed
    assert [p[0] for p in h["all_to_all"]] == [d * 10 ** j for d in range(4)]    # piece j of every device
    assert sorted(p[0] for p in h["all_reduce"]) == sorted(sum(d * 10 ** i for d in range(4)) for i in range(4))
print("device 0 after the reduce-scatter:", held[0]["reduce_scatter"], " after the all-reduce:",
      sorted(int(p[0]) for p in held[0]["all_reduce"]))


# %%
def draw_holdings(ax, holdings, title, rows):
    """holdings[j]: the cells device j holds, each (the devices it came from, label), as a column;
    a cell from several devices (a sum) is striped with their colours."""
    for j, cells in enumerate(holdings):
        ax.text(j, 4.3, f"device {j}", ha="center", va="center", fontsize=8, weight="bold")
        for row, (origins, label) in enumerate(cells):
            for s, origin in enumerate(origins):           # one stripe per device summed into the cell
                ax.add_patch(Rectangle((j - 0.42 + 0.84 * s / len(origins), 3.1 - row), 0.84 / len(origins), 0.84,
                                       facecolor=COLORS[origin], edgecolor="none"))
            ax.text(j, 3.52 - row, label, ha="center", va="center", color="white", fontsize=8, weight="bold")
    ax.set_xlim(-0.6, 3.6)
    ax.set_ylim(4.05 - rows, 4.6)
    ax.axis("off")
    ax.set_title(title, fontsize=9)


everyone = [0, 1, 2, 3]
panels = [
    ("send / receive", [[([j], f"{j}")] for j in range(4)], [[([(j - 1) % 4], f"{(j - 1) % 4}")] for j in range(4)]),
    ("all-gather", [[([j], f"{j}")] for j in range(4)], [[([(j - t) % 4], f"{(j - t) % 4}") for t in range(4)]
                                                         for j in range(4)]),
    ("reduce-scatter", [[([j], f"{j}:{i}") for i in range(4)] for j in range(4)],
     [[(everyone, f"sum :{j}")] for j in range(4)]),
    ("all-to-all", [[([j], f"{j}:{i}") for i in range(4)] for j in range(4)],
     [[([d], f"{d}:{j}") for d in range(4)] for j in range(4)]),
]
fig, axes = plt.subplots(4, 2, figsize=(8.5, 8.4), layout="constrained", height_ratios=(1.6, 4.6, 4.6, 4.6))
for (name, before, after), (ax_before, ax_after) in zip(panels, axes):
    rows_drawn = max(map(len, before + after))
    draw_holdings(ax_before, before, f"{name}: before", rows_drawn)
    draw_holdings(ax_after, after, f"{name}: after", rows_drawn)
fig.suptitle("The four collectives on 4 devices (j:i = device j's piece for device i; colour: where it came from)",
             fontsize=10)
plt.show()

# %% [markdown]
# ## 2. Context parallelism beside data parallelism
#
# Under context parallelism every device of a context group holds **all the weights** and a
# share of one sequence's tokens. Its backward gives the gradient of its share of the loss,
# which is not the gradient of anything on its own: the weights' gradients must be summed
# over the context group, as notebook 7's `train.mpi` does with an all-reduce. Data
# parallelism adds groups that work on different sequences; their gradients are averaged
# over the data-parallel group. Both are sums over groups of ranks, so they fold into one:
# an all-reduce over all `dp x cp` ranks of each share divided by the number of data-parallel
# replicas. (Megatron-LM's `parallel_state.get_data_parallel_group(with_context_parallel=True)`
# is that group.)
#
# Four MPI ranks, two data-parallel replicas of two context-parallel ranks each, notebook 7's
# small model in float64, a batch of two sequences (replica `d` takes sequence `d`):
#
# ```
#             context group 0      context group 1
#             (sequence 0)         (sequence 1)
#             rank 0   rank 1      rank 2   rank 3       data groups: {0, 2} and {1, 3}
# ```
#
# The script below computes, on every rank: its own share of the gradients, their sum over
# its context group, that averaged over its data group, and the one all-reduce over all four.
# It is written to a file and launched with `mpiexec`, as notebook 6 did.

# %%
MPIEXEC = find_mpiexec()                                      # beside this Python, else on PATH
PROJECT = Path(reference.__file__).resolve().parents[1]       # the ranks import this checkout
ENV = dict(os.environ, MPIEXEC_TIMEOUT="120", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join(filter(None, [str(PROJECT), os.environ.get("PYTHONPATH")])))
_workdir = tempfile.TemporaryDirectory(prefix="dp_cp_")       # removed when the kernel stops
OUT = Path(_workdir.name)
CONFIG = dict(vocab=11, d_model=16, n_head=2, n_layer=1, d_ff=32)
script = OUT / "dp_cp.py"
script.write_text(f'''\
"""mpiexec -n 4 python -m mpi4py dp_cp.py: 2 data-parallel replicas x 2 context-parallel ranks"""
import numpy as np
from mpi4py import MPI
from model import attention, train, transformer

world = MPI.COMM_WORLD
cp = world.Split(color=world.rank // 2, key=world.rank)      # context group: ranks 0, 1 and ranks 2, 3
dp = world.Split(color=world.rank % 2, key=world.rank)       # data group: ranks 0, 2 and ranks 1, 3
config = transformer.Config(**{CONFIG})
params = transformer.init_params(config, seed=0, std=0.3)
tokens = np.random.default_rng(0).integers(0, config.vocab, (2, 16 + 1))   # the batch: two sequences
mine = tokens[dp.rank:dp.rank + 1]                           # replica d takes sequence d (its dp rank is d)

# this rank's share: its shard of the sequence, the ring over its context group, no reduction
replica = train.Replica(config, attention.MPIRing(cp, "striped"), n_devices=cp.size, layout="striped",
                        take=lambda shards: shards[cp.rank])
loss, share = replica.loss_and_grads(params, mine)
_, over_cp = train.allreduce(cp, loss, share)                               # the sequence's gradient
_, over_dp = train.allreduce(dp, 0.0, {{k: g / dp.size for k, g in over_cp.items()}})   # the batch's mean
_, at_once = train.allreduce(world, 0.0, {{k: g / dp.size for k, g in share.items()}})  # one all-reduce
names = sorted(share)
flat = lambda grads: np.concatenate([grads[k].ravel() for k in names])
everything = world.gather(np.stack([flat(share), flat(over_cp), flat(over_dp), flat(at_once)]))
if world.rank == 0:
    np.save("grads.npy", np.stack(everything))                # (rank, stage, numbers)
''')
result = subprocess.run([str(MPIEXEC), "-n", "4", sys.executable, "-m", "mpi4py", str(script)],
                        capture_output=True, text=True, env=ENV, cwd=OUT, timeout=300)
assert result.returncode == 0, result.stdout + result.stderr
grads = np.load(OUT / "grads.npy")                            # (4 ranks, 4 stages, numbers)

# the same model in one process, dense attention: each sequence's gradient, and the batch's
config = transformer.Config(**CONFIG)
params = transformer.init_params(config, seed=0, std=0.3)
tokens = np.random.default_rng(0).integers(0, config.vocab, (2, 16 + 1))
flat = lambda g: np.concatenate([g[k].ravel() for k in sorted(g)])
one_sequence = [flat(train.dense(config).loss_and_grads(params, tokens[d:d + 1])[1]) for d in range(2)]
whole_batch = flat(train.dense(config).loss_and_grads(params, tokens)[1])

STAGES = ("its own share", "summed over its context group", "then averaged over its data group",
          "one all-reduce over all four")
print(f"{'largest difference from one process':<36}" + "".join(f"{'rank ' + str(r):>10}" for r in range(4)))
for s, stage in enumerate(STAGES):
    target = [one_sequence[r // 2] if s < 2 else whole_batch for r in range(4)]   # a share: against its sequence
    print(f"{stage:<36}" + "".join(f"{np.abs(grads[r, s] - target[r]).max():>10.1e}" for r in range(4)))
for r in range(4):
    assert np.abs(grads[r, 0] - one_sequence[r // 2]).max() > 1e-3                   # a share is not the gradient
    assert np.allclose(grads[r, 1], one_sequence[r // 2], rtol=0, atol=1e-12)        # 2 ranks = one process
    assert np.allclose(grads[r, 2], whole_batch, rtol=0, atol=1e-12)                 # the batch's gradient
    assert np.allclose(grads[r, 3], grads[r, 2], rtol=0, atol=1e-12)                 # one group, the same sum

fig, ax = plt.subplots(figsize=(7, 2.8))
for s in range(3):
    target = [one_sequence[r // 2] if s < 2 else whole_batch for r in range(4)]
    ax.bar(np.arange(4) + (s - 1) * 0.27, [np.abs(grads[r, s] - target[r]).max() for r in range(4)], width=0.27,
           label=STAGES[s], color=COLORS[s])
ax.set_yscale("log")
ax.set_xticks(range(4), [f"rank {r}" for r in range(4)])
ax.set_ylabel("largest difference\nfrom one process")
ax.set_title("The weights' gradients on 2 x 2 ranks against one process (float64)", fontsize=10)
ax.legend(fontsize=7, loc="center right")
plt.show()

# %% [markdown]
# A share alone is off by the size of the gradient itself; summed over the two ranks of its
# context group it is the single-process gradient of that sequence, to rounding; averaged
# over the data group it is the batch's; and one all-reduce over the four ranks gives the
# same. (Tensor parallelism, which splits the weights themselves, is not in this project.)
#
# ## 3. Striped blocks on a stock causal kernel
#
# A production kernel (flash-attn with `causal=True`, PyTorch's `scaled_dot_product_attention`
# with `is_causal=True`) masks by **index**: query `i` of the block sees keys `0 .. i`, the
# triangle *with* its diagonal. `reference.attention` without positions is exactly that kernel
# (positions default to `0 .. n-1`). Which of a ring's blocks can it compute as they are?
#
# Striped, query device `j` against the block of device `k` (notebook 2): query `x` sits at
# position `x N + j`, key `y` at `y N + k`. For `k <= j` the key is visible iff `y <= x`: the
# stock triangle. For `k > j` it is visible iff `y < x`: the **strict** triangle, which the stock
# kernel does not compute. Shift it by one token: give the kernel queries `1 .. c-1` and keys
# `0 .. c-2`; its query `i` is then local query `x = i + 1` and sees local keys `0 .. i`, that is
# `y < x`. Query 0 sees nothing, and gets `out = 0`, `lse = -inf` (notebook 1), set by hand.
# Derived from positions and checked:

# %%
def stock_causal(q, k, v):
    """A stock causal kernel: masks by index (query i sees keys 0..i), knows no positions."""
    return attention(q, k, v)


def striped_block(q, k, v, j, src):
    """Device j's queries against the block of device src, striped, with only the stock kernel."""
    if src <= j:                                           # the triangle with its diagonal: as it is
        return stock_causal(q, k, v)
    out = np.zeros_like(q)                                 # the strict triangle: the one-token shift
    lse = np.full((q.shape[0], q.shape[2], q.shape[1]), -np.inf)      # (B, H, c): row 0 sees no key
    out[:, 1:], lse[:, :, 1:] = stock_causal(q[:, 1:], k[:, :-1], v[:, :-1])
    return out, lse


def same(got, want):
    """Two (out, lse) results equal to rounding, rows with no visible key (lse -inf) included."""
    (out_g, lse_g), (out_w, lse_w) = got, want
    return (np.allclose(out_g, out_w, rtol=0, atol=1e-12) and np.array_equal(np.isneginf(lse_g), np.isneginf(lse_w))
            and np.allclose(lse_g[np.isfinite(lse_g)], lse_w[np.isfinite(lse_w)], rtol=0, atol=1e-12))


S8, N8 = 32, 4
c8 = S8 // N8
pos8 = positions(S8, N8, "striped")
q8, k8, v8 = (shard(rng.standard_normal((1, S8, 2, 8)), N8, "striped") for _ in range(3))
stock_mask = np.tril(np.ones((c8, c8), dtype=bool))                       # what the stock kernel computes
for j in range(N8):
    for src in range(N8):
        vis = visible(pos8[j], pos8[src])                                  # from positions: the truth
        if src <= j:
            assert (vis == stock_mask).all()
        else:                                                              # the shifted stock triangle
            assert (vis[1:, :-1] == np.tril(np.ones((c8 - 1, c8 - 1), dtype=bool))).all()
            assert not vis[0].any() and not vis[:, -1].any()               # row 0 and the last key: nothing
        assert same(striped_block(q8[j], k8[src], v8[src], j, src),
                    attention(q8[j], k8[src], v8[src], q_pos=pos8[j], k_pos=pos8[src]))
print("every striped block of every device, from the stock causal kernel with the shift: as with positions")

# %% [markdown]
# What the shift costs, and what it does not. It computes no extra pair and, at a kernel's
# tile size, no extra tile: the shifted triangle of `c - 1` tokens has the tiles of the
# strict triangle of `c`. It costs bookkeeping: a second call shape, the output and `lse`
# written one row down (`out[:, 1:]`), row 0 set by hand, and in the backward `dQ` landing
# one row down and the last key's `dK, dV` getting nothing from that block.
#
# What striping does cost, with any kernel that computes whole tiles, is its diagonal: every
# block of every round is a triangle, so every round computes a band of masked tiles (notebook
# 4). Zigzag's blocks after round 0 are two of the four chunk squares, each wholly visible or
# wholly masked: for a block from an earlier device every query sees the first chunk of keys,
# and for a later device the second chunk of queries sees every key. A stock kernel with
# `causal=False` on half the block, no mask at all, no shift; and round 0 is one stock causal
# call. That, with its tile count, is the case for zigzag, the dealing of ring-flash-attn's
# zigzag ring, of Megatron-LM's context parallelism and of Llama 3 (`2 x CP` chunks).
# Checked, and counted at a kernel's tile size (`c = 4096`, tiles of 128):

# %%
zig = positions(S8, N8, "zigzag")
half = c8 // 2
for j in range(N8):
    for src in range(N8):
        vis = visible(zig[j], zig[src])
        if src < j:                                     # every query, the first chunk of keys; nothing else
            assert vis[:, :half].all() and not vis[:, half:].any()
        elif src > j:                                   # the second chunk of queries, every key; nothing else
            assert vis[half:].all() and not vis[:half].any()
        else:
            assert (vis == stock_mask).all()            # round 0: the stock causal triangle

C_REAL, T_REAL = 4096, 128
strict = positions(N8 * C_REAL, N8, "striped")
plan_strict, _ = tile_plan(strict[0], strict[1], tile_size=T_REAL)            # device 0, the block of device 1
shifted = np.arange(C_REAL - 1)
plan_shifted, _ = tile_plan(shifted, shifted, tile_size=T_REAL)               # the stock kernel on c - 1 tokens
print(f"a striped block from a later device, c = {C_REAL}, tiles of {T_REAL}: {len(plan_strict)} tiles computed "
      f"from positions, {len(plan_shifted)} by the stock kernel on the shifted block")
assert len(plan_strict) == len(plan_shifted)
computed = {}
for layout in ("striped", "zigzag"):
    deal = positions(N8 * C_REAL, N8, layout)
    plans = [tile_plan(deal[0], deal[(0 - t) % N8], T_REAL)[0] for t in range(1, N8)]   # device 0, rounds 1..N-1
    computed[layout] = (sum(map(len, plans)), sum(kind == MASKED for plan in plans for *_, kind in plan))
    print(f"{layout:<8} device 0, rounds 1 to {N8 - 1}: {computed[layout][0]} tiles computed, "
          f"{computed[layout][1]} of them with a mask")
assert computed["zigzag"][1] == 0 and computed["striped"][1] == (N8 - 1) * C_REAL // T_REAL   # a masked band a round
assert computed["striped"][0] > computed["zigzag"][0]

# %% [markdown]
# ## 4. The same ring step in PyTorch, and flash-attn's `softmax_lse`
#
# The project's ring step, one device's loop (notebook 3):

# %%
print(inspect.getsource(ring.ring_forward))

# %% [markdown]
# The same loop with `torch.distributed` for the shift and flash-attn for the block, in the
# striped layout with the shift above. It needs a GPU per rank and flash-attn, so it is shown
# here, not run (where PyTorch is absent, defining it imports nothing):
#
# - `dist.batch_isend_irecv` posts the sends and receives together (the project's
#   `start_shift`); waiting on its requests is `finish_shift`; the send is posted first, so
#   that it overlaps the block's compute;
# - flash-attn's `flash_attn_func(q, k, v, causal=True, return_attn_probs=True)` returns
#   `(out, softmax_lse, probabilities)`; its `softmax_lse` is `(B, H, S)`, "the logsumexp of
#   each row of the matrix QK^T * scaling" (its docstring): the project's `lse`, same shape,
#   same meaning, natural log of the scaled scores;
# - the merge is the project's `merge`, in the form ring-flash-attn writes it, with sigmoids
#   (`out - sigmoid(lse_b - lse) * (out - out_b)`, `lse - logsigmoid(lse - lse_b)`), which never
#   takes the exponential of a large number.
#
# One difference to mind: for a row with no visible key flash-attn's kernels write
# `softmax_lse = +inf` (its `softmax.h`: `INFINITY` where a row's sum is 0, so that the
# backward's `exp(S - lse)` is 0), where the project writes `-inf`, the log of an empty sum.
# With the shift no such row reaches the kernel: row 0 is set to `-inf` by hand, which the
# sigmoid merge treats as empty.

# %%
def torch_merge(out, lse, block_out, block_lse):
    """`reference.merge` in PyTorch, the sigmoid form: out (B, c, H, D) float32, lse (B, H, c)."""
    import torch
    import torch.nn.functional as F
    weight = torch.sigmoid(block_lse - lse).transpose(1, 2).unsqueeze(-1)   # e^lse_b / (e^lse + e^lse_b)
    return out - weight * (out - block_out.float()), lse - F.logsigmoid(lse - block_lse)


def torch_ring_forward(q, k, v):
    """This rank's striped queries against every rank's keys: q, k, v (B, c, H, D) on this rank's
    GPU; returns (out, lse (B, H, c)). Run under torchrun, one process per GPU."""
    import torch
    import torch.distributed as dist
    from flash_attn import flash_attn_func

    j, n = dist.get_rank(), dist.get_world_size()
    out = lse = None
    for t in range(n):
        if t < n - 1:        # start the shift first: send K, V to j + 1, receive from j - 1
            k_next, v_next = torch.empty_like(k), torch.empty_like(v)
            requests = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, k, (j + 1) % n), dist.P2POp(dist.isend, v, (j + 1) % n),
                dist.P2POp(dist.irecv, k_next, (j - 1) % n), dist.P2POp(dist.irecv, v_next, (j - 1) % n)])
        src = (j - t) % n                                  # the block held: device (j - t) mod N's
        if src <= j:                                       # the triangle with its diagonal
            block_out, block_lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        else:                                              # the strict triangle: the one-token shift
            block_out = torch.zeros_like(q)
            block_lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), -float("inf"), device=q.device)
            block_out[:, 1:], block_lse[:, :, 1:], _ = flash_attn_func(q[:, 1:], k[:, :-1], v[:, :-1], causal=True,
                                                                      return_attn_probs=True)
        out, lse = (block_out.float(), block_lse) if out is None else torch_merge(out, lse, block_out, block_lse)
        if t < n - 1:        # finish the shift: the next block has arrived
            for request in requests:
                request.wait()
            k, v = k_next, v_next
    return out.to(q.dtype), lse

# %% [markdown]
# Its NumPy twin, line for line: the shift is the project's communication object, the kernel
# the stock one above, the merge in its sigmoid form. It runs on virtual devices and gives
# dense attention; and the sigmoid merge is `reference.merge`, an empty row included:

# %%
def sigmoid(x):
    with np.errstate(over="ignore"):
        return 1 / (1 + np.exp(-x))


def logsigmoid(x):
    """log(sigmoid(x)), without overflow: min(x, 0) - log(1 + e^-|x|)."""
    return np.minimum(x, 0) - np.log1p(np.exp(-np.abs(x)))


def sigmoid_merge(out, lse, block_out, block_lse):
    """torch_merge in NumPy: out (B, c, H, D), lse (B, H, c)."""
    weight = sigmoid(block_lse - lse).transpose(0, 2, 1)[..., None]
    return out - weight * (out - block_out), lse - logsigmoid(lse - block_lse)


def numpy_ring_forward(j, comm, q, k, v):
    n = comm.size
    out = lse = None
    for t in range(n):
        if t < n - 1:
            handle = comm.start_shift((k, v), 1)
        src = (j - t) % n
        block_out, block_lse = striped_block(q, k, v, j, src)
        out, lse = (block_out, block_lse) if out is None else sigmoid_merge(out, lse, block_out, block_lse)
        if t < n - 1:
            k, v = comm.finish_shift(handle)
    return out, lse


results = run_devices(N8, lambda j, comm: numpy_ring_forward(j, comm, q8[j], k8[j], v8[j]))
whole_q, whole_k, whole_v = (unshard(x, "striped") for x in (q8, k8, v8))
dense_out, dense_lse = attention(whole_q, whole_k, whole_v)
assert np.allclose(unshard([o for o, _ in results], "striped"), dense_out, rtol=0, atol=1e-12)
assert np.allclose(unshard([l for _, l in results], "striped", axis=2), dense_lse, rtol=0, atol=1e-12)

a, b = (attention(whole_q, whole_k[:, keys], whole_v[:, keys], k_pos=np.arange(S8)[keys])
        for keys in (slice(0, 16), slice(16, 32)))                     # queries 0..15 see nothing of b
merged, by_sigmoids = merge(a, b), sigmoid_merge(*a, *b)
assert np.isneginf(b[1][:, :, :16]).all()
assert np.allclose(by_sigmoids[0], merged[0], rtol=0, atol=1e-12) and np.allclose(by_sigmoids[1], merged[1], rtol=0, atol=1e-12)
print("the NumPy twin of torch_ring_forward gives dense attention; the sigmoid merge is reference.merge")

# %% [markdown]
# ## Exercises
#
# Work each out by hand first; the answers are in the cell after the list (collapsed in
# Jupyter: click to open), checked against the project.
#
# 1. A ring all-gather on `N` devices: how many shifts, and what fraction of the gathered data
#    does each device send? An all-reduce made of a reduce-scatter and an all-gather?
# 2. Four ranks of context parallelism and two data-parallel replicas of them, eight ranks:
#    over how many ranks must each weight's gradient be summed, and what is it divided by?
# 3. Striped, `N = 4`: in how many of the 16 (round, device) blocks of a forward pass does a
#    stock causal kernel need the one-token shift?
# 4. Write it: `my_zigzag_block(q, k, v, j, src, N)`, device `j`'s zigzag queries against the
#    block of device `src`, using only `stock_causal` and a stock kernel without a mask
#    (`attention(q, k, v, causal=False)`), as section 3 says zigzag allows; rows that see no key
#    get `out = 0`, `lse = -inf`. The last cell checks it against attention with positions for
#    every pair of devices.

# %% jupyter={"source_hidden": true}
# 1. N - 1 shifts, each sending 1/N of the data: (N - 1) / N of it. The all-reduce: twice that,
#    2 (N - 1) / N, in 2 (N - 1) shifts
answer_1 = lambda n: (n - 1, (n - 1) / n, 2 * (n - 1) / n)


class Counted:
    """A device's communication object that counts the shifts it starts and the bytes they carry."""

    def __init__(self, comm):
        self.comm, self.shifts, self.nbytes = comm, 0, 0

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def start_shift(self, arrays, tag):
        self.shifts, self.nbytes = self.shifts + 1, self.nbytes + sum(a.nbytes for a in arrays)
        return self.comm.start_shift(arrays, tag)


def count_collectives(j, comm):
    """Shifts and bytes of an all-gather and of an all-reduce, on data of 4 pieces of 8 bytes."""
    gather, reduce = Counted(comm), Counted(comm)
    all_gather(gather, np.array([float(j)]))
    all_gather(reduce, reduce_scatter(reduce, [np.array([float(j)])] * comm.size))
    return (gather.shifts, gather.nbytes / (8 * comm.size)), (reduce.shifts, reduce.nbytes / (8 * comm.size))


for gathered, reduced in run_devices(4, count_collectives):
    assert gathered == answer_1(4)[:2] and reduced == (2 * answer_1(4)[0], answer_1(4)[2])

# 2. every one of the 8 ranks holds the weights; the sum runs over all 8 (the context group's
#    shares make each sequence's gradient), divided by the 2 data-parallel replicas only.
#    On the 4 ranks above: the sum of the 4 shares over 2 replicas is the batch's gradient
answer_2 = (8, 2)
assert np.allclose(grads[:, 0].sum(axis=0) / 2, whole_batch, rtol=0, atol=1e-12)

# 3. device j needs the shift for a block of a later device, src > j: in round t the block is
#    device (j - t) mod 4's, later than j when t > j: 0 + 1 + 2 + 3 = 6 blocks
answer_3 = 6
assert sum((j - t) % 4 > j for t in range(4) for j in range(4)) == answer_3


# 4. after round 0, a block is half of a chunk square pair: one non-causal call on half of it
def my_zigzag_block(q, k, v, j, src, n):
    c = q.shape[1]
    if src == j:
        return stock_causal(q, k, v)
    out, lse = np.zeros_like(q), np.full((q.shape[0], q.shape[2], c), -np.inf)
    if src < j:                                          # every query sees the first chunk of keys
        out, lse = attention(q, k[:, :c // 2], v[:, :c // 2], causal=False)
    else:                                                # the second chunk of queries sees every key
        out[:, c // 2:], lse[:, :, c // 2:] = attention(q[:, c // 2:], k, v, causal=False)
    return out, lse


# %%
def check_zigzag_block(block_fn):
    """block_fn on every (device, block) pair of a zigzag ring against attention with positions."""
    qz, kz, vz = (shard(x, N8, "zigzag") for x in (whole_q, whole_k, whole_v))
    for j in range(N8):
        for src in range(N8):
            got = block_fn(qz[j], kz[src], vz[src], j, src, N8)
            want = attention(qz[j], kz[src], vz[src], q_pos=zig[j], k_pos=zig[src])
            assert np.allclose(got[0], want[0], rtol=0, atol=1e-12), (j, src)
            assert np.array_equal(np.isneginf(got[1]), np.isneginf(want[1])), (j, src)
            assert np.allclose(got[1][np.isfinite(got[1])], want[1][np.isfinite(want[1])], rtol=0, atol=1e-12)
    return True


print("my_zigzag_block needs no mask:", check_zigzag_block(my_zigzag_block))

# %% [markdown]
# **What we have seen.** The schemes are made of four collectives, each a few shifts of the
# ring or an all-to-all. Context parallelism leaves every weight on every device, so the
# weights' gradients are summed over the context group, and with data parallelism the two
# sums fold into one all-reduce. A stock causal kernel computes every striped block with a
# one-token shift for the strict triangles, at no extra tile; zigzag needs no shift and no
# mask after round 0, which is much of why frameworks ship it. And the ring's step is the same
# few lines with `torch.distributed` and flash-attn, whose `softmax_lse` is this project's
# `lse`.
