"""Every scheme on GPUs made of NumPy (tests/support/gpu/queued_device.py): no piece crosses pageable host memory.

The all-to-all of Ulysses and USP (`mpi_impl.groups.AllToAll`, a K/V head
copied to several ranks too) and the double ring's three rings move device
pieces through the ring's memory object (`gpu_impl.transfer`): device buffers
where MPI is CUDA-aware, pinned host memory with asynchronous copies where it
is not. Here, on threads with a communicator that splits and exchanges as
MPI does:

- gpu_impl's public functions under every scheme and both transfer paths
  agree with dense attention, and the fake GPU counts no float bytes moved
  through pageable memory (a `get()` or an upload of host data);
- on the staged path the bytes each device downloads and uploads are the
  cost model's (`SchemeCost.staged_copies`), per device, forward and
  backward; on the cuda-aware path it copies none;
- the all-to-all on device pieces hands back device arrays, on each path and
  without a memory object (through host memory, then).

    .venv/bin/python -m pytest tests/gpu/test_gpu_schemes.py -q
"""

import dataclasses
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import gpu_impl
from conftest import Case, assert_close
from gpu_impl import api
from gpu_impl.transfer import memory_for
from mpi_impl.groups import AllToAll
from reference import attention, attention_backward
from reference.layouts import shard_at
from reference.scheme_cost import predict_scheme
from reference.schemes import Scheme
from reference.virtual import run_devices

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support" / "gpu"))
from queued_device import DeviceArray, QueuedDevice  # noqa: E402
from strict_comm import World  # noqa: E402
from test_gpu import ThreadComm, fake_mpi  # noqa: E402,F401 - the fixture

# (scheme, ulysses_degree, ring_inner, K/V heads): Ulysses with one K/V head copied to its 4 ranks (MQA)
SCHEMES = [("ring", None, None, 4), ("all_gather", None, None, 4), ("ulysses", 4, None, 4), ("usp", 2, None, 4),
           ("ulysses", 4, None, 1), ("double_ring", None, 2, 4)]
IDS = ["ring", "all_gather", "ulysses", "usp", "ulysses-mqa", "double_ring"]


def shared(n):
    """What the n threads of one communicator share: mailboxes, allgather's slots and barrier, its splits."""
    return dict(world=World(n), gathered=[None] * n, barrier=threading.Barrier(n), splits={}, lock=threading.Lock())


class GroupComm(ThreadComm):
    """A communicator of threads with what the schemes ask of MPI beside the
    ring's: Split (collective; members ordered by key) and Alltoall, Alltoallv
    (byte buffers, host or device: MPI reads and writes them as they are)."""

    def __init__(self, rank, size, group):
        super().__init__(rank, size, group["world"], group["gathered"], group["barrier"])
        self.group, self.splits = group, 0

    def Split(self, color, key):
        members = self.allgather((color, key, self.rank))
        mine = [g for c, k, g in sorted(m for m in members if m[0] == color)]
        self.splits += 1
        with self.group["lock"]:
            group = self.group["splits"].setdefault((self.splits, color), shared(len(mine)))
        return GroupComm(mine.index(self.rank), len(mine), group)

    def Alltoallv(self, send, received):
        (sbuf, scounts, sdispls, _), (rbuf, rcounts, rdispls, _) = send, received
        sbuf, rbuf = (np.asarray(b).view(np.ndarray).reshape(-1).view(np.uint8) for b in (sbuf, rbuf))
        for i in range(self.size):
            if scounts[i]:
                self.group["world"].post(i, ("a2a", self.rank), sbuf[sdispls[i]:sdispls[i] + scounts[i]].copy())
        for j in range(self.size):
            if rcounts[j]:
                rbuf[rdispls[j]:rdispls[j] + rcounts[j]] = self.group["world"].take(self.rank, ("a2a", j), "a piece")

    def Alltoall(self, send, received):
        row = np.asarray(send).nbytes // self.size
        spec = [row] * self.size, [i * row for i in range(self.size)], None
        self.Alltoallv((send, *spec), (received, *spec))


CASE = Case(layout="striped", n_devices=4, B=1, S=32, Hq=4, Hkv=4, D=8, tile_size=4, causal=True, scale=None,
            dtype=np.float32, kind="gaussian", seed=8)


def run_scheme(case, scheme, u, w, transfer, monkeypatch):
    """gpu_impl.ring_attention and its backward under `scheme` on 4 threads,
    each with its QueuedDevice; per device: the results on the host, and the
    fake's counts of pageable bytes and copied bytes, forward and backward."""
    monkeypatch.setattr(api, "CupyDevice", lambda cupy, index: _THREAD.gpu)
    n, layout = case.n_devices, case.layout
    q, k, v, dout = case.inputs()
    pos = plan_of(case, scheme, u, w).positions(case.S, layout)   # the scheme deals the tokens
    gpus = [QueuedDevice(("copies-early", "copies-late")[j % 2]) for j in range(n)]
    world = shared(n)

    def device(j, _virtual):
        gpu = _THREAD.gpu = gpus[j]
        with gpu.installed():
            comm = GroupComm(j, n, world)
            opts = dict(comm=comm, layout=layout, tile_size=case.tile_size, transfer=transfer, scheme=scheme,
                        ulysses_degree=u, ring_inner=w)
            qj, kj, vj, dj = (gpu.asarray(shard_at(x, pos)[j]) for x in (q, k, v, dout))
            counts = []
            out, lse = gpu_impl.ring_attention(qj, kj, vj, **opts)
            counts.append((gpu.pageable_bytes, dict(gpu.copied_bytes)))
            grads = gpu_impl.ring_attention_backward(qj, kj, vj, out, lse, dj, **opts)
            counts.append((gpu.pageable_bytes, dict(gpu.copied_bytes)))
            assert all(isinstance(x, DeviceArray) for x in (out, lse) + grads)
            return tuple(x.get() for x in (out, lse) + grads), counts

    with gpus[0].installed():
        return run_devices(n, device)


_THREAD = threading.local()


def plan_of(case, scheme, u, w):
    return Scheme.checked(scheme, u, n_devices=case.n_devices, Hq=case.Hq, Hkv=case.Hkv, ring_inner=w)


def unshard_at(shards, pos, axis):
    """The inverse of `shard_at`: shard j's tokens back at positions pos[j]."""
    full = np.empty(shards[0].shape[:axis] + (pos.size,) + shards[0].shape[axis + 1:], shards[0].dtype)
    for j, x in enumerate(shards):
        full[(slice(None),) * axis + (pos[j],)] = x
    return full


@pytest.mark.parametrize("transfer", ["staged", "cuda-aware-unchecked"])
@pytest.mark.parametrize("scheme, u, w, Hkv", SCHEMES, ids=IDS)
def test_every_scheme_moves_no_piece_through_pageable_memory(scheme, u, w, Hkv, transfer, monkeypatch, fake_mpi):
    """Results equal dense attention's; no float byte through pageable memory;
    the staged path's copies are the cost model's, device by device, and the
    cuda-aware path's none."""
    case = dataclasses.replace(CASE, Hkv=Hkv)
    results = run_scheme(case, scheme, u, w, transfer, monkeypatch)
    plan = plan_of(case, scheme, u, w)
    q, k, v, dout = case.inputs()
    out, lse = attention(q, k, v)
    for i, (name, want) in enumerate(zip(("out", "lse", "dq", "dk", "dv"),
                                         (out, lse) + attention_backward(q, k, v, out, lse, dout))):
        got = unshard_at([r[0][i] for r in results], plan.positions(case.S, case.layout),
                         axis=2 if name == "lse" else 1)
        assert_close(got, want, case.dtype, what=f"{name} of {scheme} ({transfer})")
    shapes = dict(B=case.B, Hq=case.Hq, Hkv=case.Hkv, D=case.D, dtype=case.dtype, tile_size=case.tile_size)
    predicted = [predict_scheme(plan, case.S, case.layout, backward=b, **shapes).staged_copies() for b in (0, 1)]
    if plan.r == 1:
        # reference/ring.py sends dK, dV "home" after the last round even in a ring
        # of one rank (Ulysses): a shift to itself, staged through pinned memory,
        # which its trace and the cost model leave out ("a ring of one keeps them")
        hop = 2 * case.B * case.Hkv * plan.kv_copies(case.Hkv) * case.c * case.D * np.dtype(np.float32).itemsize
        predicted[1] = tuple(x + hop for x in predicted[1])
    for j, (_, counts) in enumerate(results):
        assert [pageable for pageable, _ in counts] == [0, 0], f"device {j}: floats through pageable memory"
        before = {"download": 0, "upload": 0}
        for (_, copied), (down, up) in zip(counts, predicted):
            got = {kind: copied[kind] - before[kind] for kind in copied}
            want = ({"download": int(down[:, j].sum()), "upload": int(up[:, j].sum())} if transfer == "staged"
                    else {"download": 0, "upload": 0})
            assert got == want, f"device {j} of {scheme} ({transfer}): copied {got}, the cost model {want}"
            before = copied


class Partner:
    """Rank 0 of a 2-rank group whose partner sent `theirs` (bytes). MPI knows
    nothing of streams: when it is called, the host must have waited for the
    GPU since the exchange began (`gpu.host_syncs`), on any path."""

    def __init__(self, theirs, gpu):
        self.theirs, self.gpu, self.syncs = theirs, gpu, len(gpu.host_syncs)

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def Alltoallv(self, send, received):
        (rbuf, counts, displs, _) = received
        assert send[1][0] == 0 and counts[0] == 0, "the rank's own piece is sent"
        assert len(self.gpu.host_syncs) > self.syncs, "MPI called before the host waited for the GPU"
        np.asarray(rbuf).view(np.ndarray)[displs[1]:displs[1] + counts[1]] = self.theirs

    def Alltoall(self, send, received):
        half = len(send) // 2
        received[:half], received[half:] = send[:half], self.theirs


@pytest.mark.parametrize("path", [None, "staged", "cuda-aware"])
def test_the_all_to_all_hands_back_device_arrays(path, fake_mpi):
    """Device pieces in, device pieces out, in rank order, whatever moves them
    (without a memory object: through host memory); the own piece a copy,
    never sent; MPI called only after the host waited for the GPU."""
    gpu = QueuedDevice()
    with gpu.installed():
        mine = [gpu.asarray(np.arange(4, dtype=np.float32)), gpu.asarray(np.full(4, -1, np.float32))]
        theirs = np.arange(4, 8, dtype=np.float32).view(np.uint8)
        got = AllToAll(Partner(theirs, gpu), memory_for(path, gpu) if path else None).all_to_all(mine)
        assert all(isinstance(g, DeviceArray) for g in got), [type(g) for g in got]
        assert [g.get().tolist() for g in got] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert got[0] is not mine[0] and not np.shares_memory(got[0], mine[0])
