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
# # 3. The ring, round by round
#
# The paper's Algorithm 1, for each device `j` in parallel:
#
# ```
# for round t = 0 .. N-1:
#     k = (j - t) mod N                       # the block held this round
#     Out_j = AccumulateAttentionFragment(Out_j, Q_j, K_k, V_k, GetMask(j, k))
#     send K_k, V_k to device (j + 1) mod N; receive K_(k-1), V_(k-1) from (j - 1) mod N
# normalize(Out_j)
# ```
#
# `reference.ring.ring_forward` is that loop for **one** device. It is the same code for
# every backend; only the communication object `comm` changes. It needs three verbs:
#
# ```python
# handle = comm.start_shift(arrays, tag)   # send to rank+1, receive from rank-1
# arrays = comm.finish_shift(handle)       # wait for the receive; returns what arrived
# comm.progress()                          # let the transfers in flight move
# ```
#
# The third is for the step, which calls it between its tiles (more below).
#
# Notebook 0 set the ring beside the two other ways to spread attention, the all-gather
# and Ulysses; the notebooks follow the ring from here, and the same `run_devices` runs the
# other two (`ring_attention(..., scheme="ulysses")`).
#
# `reference.virtual` provides N *virtual* devices (threads in this process, sharing
# nothing: a message is a copy). Here we run them on a small case, watch the blocks go
# round, and read the trace: the work each device did in each round.
#
# Legend: `N` devices, `S` tokens, `c = S // N`, `T` tile size.

# %%
import matplotlib.pyplot as plt
import numpy as np

import inspect
import threading

from reference import LAYOUTS, Trace, attention, cost, lockstep, merge, positions, ring_attention, shard, unshard
from reference import ring, steps
from reference.masks import CAUSAL
from reference.virtual import run_devices

S, N, T = 32, 4, 2            # 4 devices of c = 8 tokens, tiles of 2 x 2: 4 x 4 tiles per block
B, HQ, HKV, D = 1, 2, 1, 8    # two query heads sharing one key/value head
c = S // N
rng = np.random.default_rng(0)
q = rng.standard_normal((B, S, HQ, D))                        # (B, S, Hq, D)
k, v = (rng.standard_normal((B, S, HKV, D)) for _ in range(2))   # (B, S, Hkv, D)
dense_out, dense_lse = attention(q, k, v)


# %% [markdown]
# A message is a copy: each device sends its array to the next one, and what arrives is
# the sender's values in memory of the receiver's own, which the sender may write again
# at once.

# %%
def one_shift(j, comm):
    mine = np.full(3, float(j))
    (got,) = comm.finish_shift(comm.start_shift((mine,), 1))
    return mine, got


pairs = run_devices(N, one_shift)
for j, (mine, got) in enumerate(pairs):
    sender = pairs[(j - 1) % N][0]                                 # device j receives from j - 1
    assert (got == (j - 1) % N).all() and not np.shares_memory(got, sender)

# %% [markdown]
# ## Algorithm 1 in lockstep
#
# First the algorithm with every device in one loop per round, no threads and no messages:
# in round `t` device `j` holds the block that started on device `src = (j - t) mod N`, so
# indexing the blocks by `src` *is* the transfer. This is `reference.lockstep`, short
# enough to step through in a debugger:

# %%
print(inspect.getsource(lockstep.ring_attention))

# %%
lock_out, lock_lse = lockstep.ring_attention(q, k, v, n_devices=N, layout="striped", tile_size=T)
assert np.allclose(lock_out, dense_out, rtol=0, atol=1e-12)
assert np.allclose(lock_lse, dense_lse, rtol=0, atol=1e-12)

# %% [markdown]
# Real devices do not run in lockstep: each runs its own loop and waits only for the block
# it needs next. `reference.ring.ring_forward` is that loop for **one** device, with the
# paper's lines as comments: the send is started before the compute, so that the two
# can overlap, and the receive is waited for after it:

# %%
print(inspect.getsource(ring.ring_forward))

# %% [markdown]
# Starting the send first lets the transfer overlap the compute; whether it does is up to
# the communication object. Here (`reference.virtual`) `start_shift` copies the block into
# the next device's mailbox at once, so a block is there before its receiver needs it
# unless the sender is behind. On MPI ranks (notebook 6) a large message moves only while
# a rank is inside an MPI call, not while its process computes. So the communication
# object has a third verb, `progress`, and the loop hands it to the step
# (`progress=comm.progress`), which calls it between its tiles: on MPI each call tests the
# transfers in flight, and a block sent at the start of a round moves during the step.
# Here it has nothing to do.

# %%
assert "progress=comm.progress" in inspect.getsource(ring.ring_forward)   # handed to the step
assert "progress" in inspect.signature(steps.get("v1").forward).parameters   # which takes it

# %% [markdown]
# Run on N threads (`reference.ring_attention`), it gives the lockstep's answer bit for
# bit: the same step, on the same blocks, in the same order on every device.

# %%
threaded_out, threaded_lse = ring_attention(q, k, v, n_devices=N, layout="striped", tile_size=T)
assert (threaded_out == lock_out).all() and (threaded_lse == lock_lse).all()

# %% [markdown]
# ## Watching the blocks travel
#
# We wrap each device's communication object so that it notes what it sends, then run
# `ring_forward` on four threads with `run_devices`, as `ring_attention` does (which
# also has the threads take turns at the cores: here all four run at once).
# A block travels as `(K, V, positions of its keys, the device it started on)`:
# positions travel with the tokens, so each mask is computed from them.

# %%
class WatchedRing:
    """Passes every call to the real communication object, noting each send."""

    def __init__(self, comm, sent):
        self.comm, self.sent = comm, sent
        self.rank, self.size = comm.rank, comm.size
        self.traffic = comm.traffic            # where the real one counts the bytes it moves, for the trace
        self.round = 0

    def start_shift(self, arrays, tag):
        k_pos = arrays[2]                      # (c,) global positions of the keys sent
        self.sent[self.round, self.rank] = k_pos
        self.round += 1
        return self.comm.start_shift(arrays, tag)

    def finish_shift(self, handle):
        return self.comm.finish_shift(handle)

    def progress(self):
        self.comm.progress()


watched = {}                                                   # layout -> (pos, sent, trace)
for layout in ("contiguous", "striped"):
    pos = positions(S, N, layout)                              # (N, c)
    qs, ks, vs = (shard(x, N, layout) for x in (q, k, v))      # N shards (B, c, H, D)
    sent = np.full((N, N, c), -1)                              # [t, j] -> positions sent

    def device(j, comm):
        return ring.ring_forward(qs[j], ks[j], vs[j], pos[j], pos[j], WatchedRing(comm, sent),
                                 scale=D ** -0.5, tile_size=T, step=steps.get("v1"), mask=CAUSAL)

    outs, lses, logs = zip(*run_devices(N, device))
    trace = Trace.from_logs(logs)                              # arrays [t, j]
    out = unshard(outs, layout)                                # back to natural order
    assert np.allclose(out, dense_out, rtol=0, atol=1e-12)
    assert np.allclose(unshard(lses, layout, axis=2), dense_lse, rtol=0, atol=1e-12)
    watched[layout] = pos, sent, trace

# %% [markdown]
# What each device holds in each round, with the work it did on it: visible (query, key)
# pairs, and tiles computed out of the `4 x 4` tiles of the block. First contiguous: the
# keys a device holds are either all before its queries (a full block, 64 pairs), all after
# them (nothing to do), or its own.

# %%
def print_rounds(layout):
    pos, sent, trace = watched[layout]
    for t in range(N):
        print(f"round {t}")
        for j in range(N):
            src = trace.source[t, j]
            print(f"  dev{j}: queries {pos[j]}  keys {pos[src]} (from dev{src})  {trace.pairs[t, j]:>2} pairs, "
                  f"{trace.tiles_computed[t, j]}/{trace.tiles_computed[t, j] + trace.tiles_skipped[t, j]} tiles")


print_rounds("contiguous")

# %% [markdown]
# Striped, the same rounds: every device's queries and keys are spread over the whole
# sequence, and every block is a triangle, 36 pairs with its diagonal (keys from an earlier
# device) or 28 without (a later device). No device is idle and none holds a full block.

# %%
print_rounds("striped")
assert set(watched["striped"][2].pairs.ravel()) == {c * (c + 1) // 2, c * (c - 1) // 2}
assert set(watched["contiguous"][2].pairs[1:].ravel()) == {0, c * c}

# %% [markdown]
# Checked against Algorithm 1: in round `t` device `j` holds the block of device
# `(j - t) mod N`; what device `j` sends in round `t` is what device `j + 1` holds in round
# `t + 1`; and nothing is sent after the last round.

# %%
for layout, (pos, sent, trace) in watched.items():
    for t in range(N):
        for j in range(N):
            assert trace.source[t, j] == (j - t) % N
            if t < N - 1:
                assert (sent[t, j] == pos[trace.source[t + 1, (j + 1) % N]]).all()
    assert (sent[N - 1] == -1).all()                 # no transfer after the last round
    assert (trace.bytes_sent[N - 1] == 0).all() and (trace.bytes_sent[:N - 1] > 0).all()
layout, (pos, sent, trace) = "contiguous", watched["contiguous"]

# %% [markdown]
# ## The work table
#
# `Trace.table()` prints the same per-(round, device) work compactly, with the busiest and
# idlest device of each round.

# %%
print(trace.table(f"{layout}: S={S}, N={N}, tile={T}"))

# %% [markdown]
# ## When a device may start its next round
#
# The ring has no barrier between rounds. Device `j` needs, for round `t + 1`, the block its
# left neighbour `j - 1` held in round `t`, and `ring_forward` (above) posts that send at the
# **start** of the neighbour's round, before its compute. So device `j` starts round `t + 1`
# once it has finished round `t` itself and its left neighbour has *started* round `t`: it
# never waits for the neighbour to finish. (The transfer itself takes time on a real link,
# and notebook 6 measures it; here it is taken as instant.)
#
# A different rule is easy to believe: "wait for the neighbour to finish its round". The two
# differ. Take two devices whose work is 10 units in round 0 for device 0 only, and 10 in
# round 1 for device 1 only: device 1's round-1 block is device 0's own, sent as device 0
# starts, so device 1 works at once and both finish at 10; under the other rule device 1
# would wait for device 0's round and finish at 20. Both rules in code, with one unit of work
# as the unit of time, and drawn:

# %%
def ring_schedule(work, rule="send"):
    """(start, done): when each device starts and ends each round, with each round taking its
    work. Round t + 1 starts once the device has finished round t and its left neighbour has
    started round t (rule "send": the neighbour posts its block as it starts, as `ring_forward`
    does), or finished it (rule "finish"). work: (rounds, devices)."""
    start, done = np.zeros(work.shape, dtype=float), np.zeros(work.shape, dtype=float)
    for t, row in enumerate(work):
        if t:
            neighbour = start[t - 1] if rule == "send" else done[t - 1]
            start[t] = np.maximum(done[t - 1], np.roll(neighbour, 1))      # np.roll: the left neighbour
        done[t] = start[t] + row
    return start, done


def draw_schedule(ax, work, rule, title):
    """One bar per (round, device) step with work, coloured and labelled by its round."""
    start, done = ring_schedule(work, rule)
    for (t, j), w in np.ndenumerate(work):
        if w:                                      # a step with nothing to do takes no time: not drawn
            ax.barh(j, w, left=start[t, j], color=COLORS[t % len(COLORS)], edgecolor="k", lw=0.5)
            ax.text(start[t, j] + w / 2, j, f"round {t}" if w >= 0.06 * done.max() else str(t),
                    ha="center", va="center", fontsize=7)
    ax.set_yticks(range(work.shape[1]), [f"device {j}" for j in range(work.shape[1])])
    ax.invert_yaxis()
    ax.set_xlabel("time (units of work)")
    ax.set_title(f"{title}: all done at {done[-1].max():.0f}", fontsize=9)


COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]            # one colour per round
two = np.array([[10, 0],                                         # (round, device)
                [0, 10]])
fig, axes = plt.subplots(1, 2, figsize=(10, 2.2), sharex=True, layout="constrained")
draw_schedule(axes[0], two, "send", "the code: after the neighbour's send")
draw_schedule(axes[1], two, "finish", "the other rule: after the neighbour's round")
plt.show()
assert ring_schedule(two, "send")[1].max() == 10 and ring_schedule(two, "finish")[1].max() == 20

# %% [markdown]
# The code runs the first rule, and this can be checked on the threads themselves: below,
# device 0's communication object holds device 0 inside its first round's step (in
# `progress`, which the step calls between tiles) until device 1 has finished its whole pass.
# Under the other rule device 1 could not finish before device 0's round 0 did, and the wait
# would time out.

# %%
class HeldRing:
    """Device 0's end of the ring, holding device 0's first step until device 1 is done; every
    other call goes to the real communication object."""

    def __init__(self, comm, device_1_done):
        self.comm, self.device_1_done, self.waited = comm, device_1_done, None

    def __getattr__(self, name):                   # rank, size, start_shift, finish_shift, ...
        return getattr(self.comm, name)

    def progress(self):
        if self.comm.rank == 0 and self.waited is None:
            self.waited = self.device_1_done.wait(timeout=60)
        self.comm.progress()


device_1_done = threading.Event()
pos2 = positions(S, 2, "contiguous")                              # (2, c) on two devices
q2, k2, v2 = (shard(x, 2, "contiguous") for x in (q, k, v))


def held_device(j, comm):
    held = HeldRing(comm, device_1_done)
    out, lse, _ = ring.ring_forward(q2[j], k2[j], v2[j], pos2[j], pos2[j], held, scale=D ** -0.5,
                                    tile_size=T, step=steps.get("v1"), mask=CAUSAL)
    if j == 1:
        device_1_done.set()                       # device 1 has done both its rounds
    return out, held.waited


held_runs = run_devices(2, held_device)
print("device 0 waited inside its round 0 until device 1 had finished both rounds:", held_runs[0][1])
assert held_runs[0][1] is True
assert np.allclose(unshard([o for o, _ in held_runs], "contiguous"), dense_out, rtol=0, atol=1e-12)

# %% [markdown]
# With transfers taken as instant and every device equally fast, the ring then takes at least
# its busiest device's total and at most the sum over rounds of each round's
# busiest device, the **critical path**: each round starts no later than under the "finish"
# rule, which a round's busiest device bounds. For the three layouts and this causal mask the
# two bounds coincide (the busiest device is busiest in every round), so both rules give the
# critical path:

# %%
for name in LAYOUTS:
    work = cost.predict(S, N, name, tile_size=T).pairs
    finish = {rule: ring_schedule(work, rule)[1].max() for rule in ("send", "finish")}
    assert work.sum(axis=0).max() <= finish["send"] <= finish["finish"] <= work.max(axis=1).sum()   # the bounds
    assert finish["send"] == finish["finish"] == work.max(axis=1).sum(), name                      # both met
    print(f"{name:>10}: busiest device's total {work.sum(axis=0).max():4d}, ring {finish['send']:5.0f}, "
          f"critical path {work.max(axis=1).sum():4d}")

# %% [markdown]
# Other masks separate them. Packed documents (`cu_seqlens`: three documents of 20, 7 and 5
# tokens here) on contiguous blocks: in round 1 device 1 has a full block to do, and device 2
# needs for its round 2 the block device 1 holds then. Under the code's rule device 2 gets it
# as device 1 starts that long round; under the other it would wait for its end. The code's
# rule gives the busiest device's total, 100 units; the other, the critical path, 132:

# %%
docs = cost.predict(S, N, "contiguous", tile_size=T, cu_seqlens=np.array([0, 20, 27, 32])).pairs
print("visible pairs per (round, device), packed documents:\n", docs)
finish_docs = {rule: ring_schedule(docs, rule)[1].max() for rule in ("send", "finish")}
print(f"ring, the code's rule: {finish_docs['send']:.0f};  the other rule: {finish_docs['finish']:.0f};  "
      f"busiest device's total {docs.sum(axis=0).max()}, critical path {docs.max(axis=1).sum()}")
assert finish_docs["send"] == docs.sum(axis=0).max() == 100
assert finish_docs["finish"] == docs.max(axis=1).sum() == 132

fig, axes = plt.subplots(1, 2, figsize=(11, 2.8), sharex=True, layout="constrained")
draw_schedule(axes[0], docs, "send", "the code: after the neighbour's send")
draw_schedule(axes[1], docs, "finish", "the other rule: after the neighbour's round")
plt.show()

# %% [markdown]
# ## Every layout
#
# `ring_attention(..., trace=True)` does all of the above (shard, run the devices,
# unshard) and returns the trace. Each layout gives the dense answer; only the work
# distribution differs.

# %%
traces = {}
for layout in LAYOUTS:
    out, lse, traces[layout] = ring_attention(q, k, v, n_devices=N, layout=layout, tile_size=T, trace=True)
    assert np.allclose(out, dense_out, rtol=0, atol=1e-12)
    assert np.allclose(lse, dense_lse, rtol=0, atol=1e-12)
    print(traces[layout].table(f"\n{layout}"))

# %% [markdown]
# The cost model, `reference.cost.predict`, counts the same tiles and pairs from positions
# alone, without running attention. It agrees with the run exactly, which is what lets
# notebook 4 use it for sizes far too large to run here.

# %%
for layout, tr in traces.items():
    p = cost.predict(S, N, layout, tile_size=T)
    for field in ("source", "pairs", "tiles_computed", "tiles_skipped"):
        assert (getattr(p, field) == getattr(tr, field)).all(), (layout, field)

# %% [markdown]
# ## Heat maps: work per (round, device)
#
# Top: visible pairs; bottom: tiles computed. Contiguous has a cold lower-left (devices
# whose block is all in the future) and a hot band (devices with a full block); striped
# and zigzag are nearly flat.

# %%
fig, axes = plt.subplots(2, len(LAYOUTS), figsize=(10, 6.5), sharey=True, layout="constrained")
for col, (layout, tr) in enumerate(traces.items()):
    for row, (field, vmax, words) in enumerate([("pairs", c * c, f"visible pairs (of {c * c})"),
                                                ("tiles_computed", (c // T) ** 2, f"tiles computed (of {(c // T) ** 2})")]):
        work = getattr(tr, field)                               # (t, j)
        ax = axes[row, col]
        im = ax.imshow(work, cmap="magma", vmin=0, vmax=vmax)
        for t in range(N):
            for j in range(N):
                ax.text(j, t, work[t, j], ha="center", va="center",
                        color="white" if work[t, j] < vmax / 2 else "black")
        ax.set_title(f"{layout}: {words}", fontsize=9)
        ax.set_xlabel("device j")
        ax.set_xticks(range(N)), ax.set_yticks(range(N))     # rounds and devices are integers
    axes[0, col].set_ylabel("round t")
    axes[1, col].set_ylabel("round t")
plt.show()

# %% [markdown]
# The critical paths, and the speed-up they imply, as the cost model predicts them. With
# exact (pair-level) skipping striped's speed-up tends to `(2N - 1) / N` as blocks grow,
# held back at this tiny size by its diagonal (the `c(c+1)/2` against `c(c-1)/2` of
# notebook 2). Zigzag is flatter still here: after round 0 each of its devices holds
# exactly half of a `c x c` square.

# %%
crit = {layout: int(tr.critical_path("pairs")) for layout, tr in traces.items()}
crit_tiles = {layout: int(tr.critical_path("tiles_computed")) for layout, tr in traces.items()}
print("critical path, pairs:", crit)
print("critical path, tiles:", crit_tiles)

assert all(tr.pairs.sum() == traces["contiguous"].pairs.sum() for tr in traces.values())   # same total work
cont = traces["contiguous"].pairs
assert all(cont[t, j] == 0 for t in range(1, N) for j in range(t))           # the cold lower-left
assert all(cont[t, j] == c * c for t in range(1, N) for j in range(t, N))     # the hot band
assert crit["striped"] < crit["contiguous"] and crit["zigzag"] < crit["contiguous"]
assert crit_tiles["striped"] < crit_tiles["contiguous"]
assert crit["contiguous"] / crit["striped"] == cost.speedup(S, N, "striped", T, mode="pairs")
assert crit["contiguous"] / crit["striped"] < cost.striped_limit(N)
assert (traces["zigzag"].pairs[1:] == c * c // 2).all()

# %% [markdown]
# ## Exercises
#
# Work each out by hand first. Exercise 2 asks for a prediction, then a run: change the
# parameter in the cell under the list and run it. The answers are in the cell after it
# (collapsed in Jupyter: click to open), checked against the project.
#
# 1. Striped, `S = 64` on `N = 4`: which device's block does device 2 hold in round 3, and
#    how many visible pairs does device 0 compute in round 1?
# 2. Contiguous, pairs skipped exactly: the critical path at `S = 32` is printed above (228).
#    Predict it at `S = 64` (still `N = 4`); then set `S_TRY = 64` in the cell below and run
#    it (the ring runs, and its trace counts).
# 3. Device `j` sends a block in every round but the last. How many messages does the whole
#    ring send in one forward pass?
# 4. Write it: `my_ring(q_dev, k_dev, v_dev, pos)`, Algorithm 1 in lockstep from two of the
#    project's functions, `attention` (with positions, the per-device oracle) and `merge`. Each
#    device starts holding its own block; in each of the `N` rounds every device attends its
#    queries to the block it holds and merges the result into its running `(out, lse)`, then
#    every block moves one device on (device `j` receives device `j - 1`'s, with its
#    positions). Return the `N` devices' `(out, lse)`. The last cell checks it on every layout.

# %%
S_TRY = 64                                       # exercise 2: tokens, on N = 4 devices
*_, trace_try = ring_attention(*(rng.standard_normal((1, S_TRY, 1, 4)) for _ in range(3)), n_devices=N,
                               layout="contiguous", tile_size=1, trace=True)
print(f"contiguous, S = {S_TRY}, N = {N}: critical path {trace_try.critical_path('pairs'):.0f} pairs")

# %% jupyter={"source_hidden": true}
# 1. (2 - 3) mod 4 = 3; in round 1 device 0 holds device 3's block. Key y of device 3 sits at
#    position 4y + 3 and query x of device 0 at 4x: the key is visible iff 4y + 3 <= 4x, iff
#    y < x. A strict triangle, the diagonal left out: c (c - 1) / 2 = 16 * 15 / 2 = 120 pairs
answer_1 = (3, 120)
p64 = cost.predict(64, 4, "striped")
assert p64.source[3, 2] == answer_1[0] and p64.pairs[1, 0] == answer_1[1]

# 2. round 0: a triangle with its diagonal, c (c + 1) / 2; then a full past block, c^2, on the
#    busiest device of each of the 3 other rounds: at S = 64, c = 16: 136 + 3 * 256 = 904
c_try = S_TRY // N
answer_2 = c_try * (c_try + 1) // 2 + (N - 1) * c_try ** 2
assert trace_try.critical_path("pairs") == answer_2

# 3. N devices x (N - 1) rounds = 12
answer_3 = 12
assert (traces["striped"].bytes_sent > 0).sum() == answer_3


# 4. the lockstep loop of Algorithm 1: attend, merge, shift
def my_ring(q_dev, k_dev, v_dev, pos):
    n = len(q_dev)
    held = [(k_dev[j], v_dev[j], pos[j]) for j in range(n)]          # round 0: each device's own block
    acc = [None] * n                                                   # each device's (out, lse) so far
    for t in range(n):
        for j in range(n):
            k_b, v_b, pos_b = held[j]
            part = attention(q_dev[j], k_b, v_b, q_pos=pos[j], k_pos=pos_b)
            acc[j] = part if acc[j] is None else merge(acc[j], part)
        held = [held[(j - 1) % n] for j in range(n)]                   # the shift: device j gets j - 1's
    return acc


# %%
def check_ring(ring_fn):
    """ring_fn on the shards of every layout (4 devices, 32 tokens, two query heads per K/V head)
    must give dense attention, out and lse, once put back in natural order."""
    for layout_ in LAYOUTS:
        pos_ = positions(S, N, layout_)
        shards_ = [shard(x, N, layout_) for x in (q, k, v)]
        results = ring_fn(*shards_, pos_)
        assert np.allclose(unshard([o for o, _ in results], layout_), dense_out, rtol=0, atol=1e-12), layout_
        assert np.allclose(unshard([l for _, l in results], layout_, axis=2), dense_lse, rtol=0, atol=1e-12), layout_
    return True


print("my_ring is the ring:", check_ring(my_ring))

# %% [markdown]
# **What we have seen.** The ring is Algorithm 1 run by N copies of one function; every
# layout gives the dense answer; the trace records each device's work in each round and the
# cost model predicts it exactly; striping flattens the work so that no round waits for a
# device with a full block. Next, `04_tiles_and_speedup`: how much of that balance turns
# into speed depends on the tile size.
