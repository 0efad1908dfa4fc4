"""make gpu-check's steps on the ring: a checked run where the GPU lags,
the command line, the trace (scripts/gpu_check.py runs them).
"""

import json
import time
from pathlib import Path

import numpy as np

from gpu_check_base import RANKS, SCRIPT, Result, fenced, mpirun, run

# -- a checked run where the GPU lags ----------------------------------------------------------

CHECK_SEED = 7
CHECK_LIMIT = 1e-2      # float16 inputs, float32 accumulation: a stream race gives errors of order 1


def checked_run(ctx):
    """The ring forward and backward on RANKS ranks at the shape where the GPU
    lags the host most (Hq = 8, float16, striped), transfer as 'auto' picks,
    against causal attention and its gradients in float64 computed on the GPU
    itself (rank 0, `dense_reference_gpu`): max |ring - reference| over
    max(1, |reference|), per output."""
    cfg = ctx.sizes.checked
    what = (f"S = {cfg['seq_len']}, Hq = {cfg['heads']}, Hkv = {cfg['kv_heads']}, D = {cfg['head_dim']}, "
            f"float16, striped, tile {cfg['tile']} (backward {cfg['backward_tile']}), {RANKS} ranks, forward and backward")
    if ctx.dry:
        return Result(True, f"dry run: {what}")
    path = ctx.work / "checked.json"
    rc, out = run(ctx, mpirun(ctx, str(SCRIPT), "--checked-run", str(path), json.dumps(cfg)), ctx.left())
    if rc != 0 or not path.exists():
        return Result(False, f"{what}\n\n" + fenced(out, 30) + f"\n\nFAILED: exit status {rc}")
    doc = json.loads(path.read_text())
    rows = [f"| {name} | {err:.1e} | {'ok' if err <= CHECK_LIMIT else 'FAILED'} |" for name, err in doc["errors"].items()]
    ok = all(err <= CHECK_LIMIT for err in doc["errors"].values())
    return Result(ok, f"{what}; transfer {doc['transfer']}; ring {doc['ring_s']:.1f} s, reference on the GPU "
                      f"{doc['reference_s']:.1f} s. Error over max(1, |reference|), limit {CHECK_LIMIT}:\n\n"
                      "| output | max error | |\n| :--- | ---: | :--- |\n" + "\n".join(rows))


def checked_run_worker(path, cfg):
    """Under mpiexec: this rank's striped shard through gpu_impl, forward and
    backward; rank 0 gathers, computes the reference on its GPU and writes the errors."""
    import gpu_impl
    gpu_impl.use_local_device()                         # before MPI starts
    import cupy
    from mpi4py import MPI
    from reference import positions, unshard
    from reference.inputs import make_shard
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    S, hq, hkv, D = cfg["seq_len"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    shapes = [(1, S, hq, D), (1, S, hkv, D), (1, S, hkv, D), (1, S, hq, D)]      # q, k, v, dout

    def inputs(pos):
        return [make_shard(CHECK_SEED, i, shape, pos, np.float16) for i, shape in enumerate(shapes)]
    q, k, v, dout = (cupy.asarray(x) for x in inputs(positions(S, n, "striped")[rank]))
    tile, backward_tile = (tuple(cfg[t]) if isinstance(cfg[t], list) else cfg[t] for t in ("tile", "backward_tile"))
    comm.Barrier()
    start = time.perf_counter()
    out, lse = gpu_impl.ring_attention(q, k, v, comm=comm, layout="striped", tile_size=tile)
    dq, dk, dv = gpu_impl.ring_attention_backward(q, k, v, out, lse, dout, comm=comm, layout="striped",
                                                  tile_size=backward_tile)
    cupy.cuda.Device().synchronize()
    ring_s = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    got = {name: comm.gather(cupy.asnumpy(x)) for name, x in dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv).items()}
    if rank != 0:
        return
    got = {name: unshard(parts, "striped", axis=2 if name == "lse" else 1) for name, parts in got.items()}
    start = time.perf_counter()
    want = dense_reference_gpu(cupy, *(x[0] for x in inputs(np.arange(S))))
    reference_s = time.perf_counter() - start
    errors = {}
    for name, w in want.items():
        g = got[name][0].astype(np.float64)
        errors[name] = float(np.abs(g - w).max() / max(1.0, np.abs(w).max()))
    Path(path).write_text(json.dumps(dict(errors=errors, ring_s=ring_s, reference_s=reference_s,
                                          transfer=gpu_impl.choose_transfer("auto")[0])))


def dense_reference_gpu(cupy, q, k, v, dout, chunk=4096):
    """Causal attention and its gradients in float64 on the GPU, one query head
    and `chunk` queries at a time (reference/dense.py's formulas, memory
    chunk x S per matrix). q, dout (S, Hq, D), k, v (S, Hkv, D) NumPy ->
    {out, lse (Hq, S), dq, dk, dv} NumPy float64."""
    S, Hq, D = q.shape
    G, scale = Hq // k.shape[1], D ** -0.5
    res = dict(out=np.empty(q.shape), lse=np.empty((Hq, S)), dq=np.empty(q.shape),
               dk=np.zeros(k.shape), dv=np.zeros(v.shape))
    for h in range(Hq):
        kh, vh = (cupy.asarray(x[:, h // G], dtype=cupy.float64) for x in (k, v))       # (S, D)
        dkh, dvh = cupy.zeros_like(kh), cupy.zeros_like(vh)
        for start in range(0, S, chunk):
            rows = slice(start, min(start + chunk, S))
            qc, doc = (cupy.asarray(x[rows, h], dtype=cupy.float64) for x in (q, dout))   # (C, D)
            s = qc @ kh.T * scale                                       # S = Q K^T   (C, S)
            visible = cupy.arange(S)[None, :] <= cupy.arange(rows.start, rows.stop)[:, None]
            s = cupy.where(visible, s, -cupy.inf)                       # causal: every row sees key 0
            m = s.max(axis=1, keepdims=True)
            lse = m + cupy.log(cupy.exp(s - m).sum(axis=1, keepdims=True))     # (C, 1)
            p = cupy.exp(s - lse)                                       # P = exp(S - lse)
            oc = p @ vh                                                 # O = P V     (C, D)
            delta = (doc * oc).sum(axis=1, keepdims=True)               # rowsum(dO * O)
            ds = p * (doc @ vh.T - delta)                               # dS = P (dP - delta)
            res["out"][rows, h], res["lse"][h, rows] = cupy.asnumpy(oc), cupy.asnumpy(lse[:, 0])
            res["dq"][rows, h] = cupy.asnumpy(ds @ kh * scale)          # dQ = dS K scale
            dkh += ds.T @ qc * scale                                    # dK = dS^T Q scale
            dvh += p.T @ doc                                            # dV = P^T dO
        res["dk"][:, h // G] += cupy.asnumpy(dkh)
        res["dv"][:, h // G] += cupy.asnumpy(dvh)
    return res


# -- the command line and its trace -------------------------------------------------------------------

def parse_cli(args):
    """gpu_impl's parser and mpi_impl's option check on these arguments (no MPI, no GPU)."""
    from gpu_impl.__main__ import parse
    from mpi_impl.cli import check_args
    _, parsed = parse(args)
    problem = check_args(parsed, RANKS)
    if problem:
        raise ValueError(problem)
    return parsed


def command_line(ctx):
    realistic = list(ctx.sizes.realistic)
    shown = " ".join(["mpiexec", "-n", str(RANKS), "python", "-m", "mpi4py", "-m", "gpu_impl", *realistic])
    if ctx.dry:
        parse_cli(realistic)
        return Result(True, f"dry run: `{shown}` parses")
    rc, out = run(ctx, mpirun(ctx, "-m", "gpu_impl", *realistic), ctx.left())
    return Result(rc == 0, f"`{shown}`\n\n" + fenced(out, 30) + ("" if rc == 0 else f"\n\nFAILED: exit status {rc}"))


SHIFT_S = 15        # of the trace step's time, kept for timing a shift alone


def trace(ctx):
    path = ctx.work / "trace.json"
    traced = list(ctx.sizes.traced)
    args = traced + ["--trace-out", str(path)]
    shown = " ".join(["mpiexec", "-n", str(RANKS), "python", "-m", "mpi4py", "-m", "gpu_impl", *traced])
    if ctx.dry:
        parse_cli(args)
        table = overlap_table(example_trace_doc(), {"seconds": 1e-3, "bytes": 1, "path": "staged"})
        return Result("transfers overlap the steps" in table, f"dry run: `{shown}` parses; the overlap "
                                                              f"table is drawn from a trace")
    rc, out = run(ctx, mpirun(ctx, "-m", "gpu_impl", *args), ctx.left() - SHIFT_S)
    if rc != 0:
        return Result(False, f"`{shown}`\n\n" + fenced(out, 30) + f"\n\nFAILED: exit status {rc}")
    from reference.trace import read_trace
    doc = read_trace(path)
    nbytes = int(doc["layouts"]["striped"]["forward"].bytes_sent[0].max())
    alone = ctx.work / "shift.json"
    rc, shift_out = run(ctx, mpirun(ctx, str(SCRIPT), "--time-shifts", str(alone), str(nbytes)), ctx.left())
    shift = json.loads(alone.read_text()) if rc == 0 else None
    text = f"`{shown}`\n\n" + fenced(out, 12) + "\n\n" + overlap_table(doc, shift)
    return Result(True, text if shift else text + "\n\ntiming a shift alone failed:\n\n" + fenced(shift_out, 20))


def overlap_table(doc, shift=None):
    """Per round of striped (forward, then backward): each rank's step time on the
    GPU and the GPU's idle time before its next step; and the verdict, against
    `shift` ({"seconds", "bytes", "path"}: one forward block's shift timed alone)."""
    lines = []
    for kind in ("forward", "backward"):
        tr = doc["layouts"]["striped"].get(kind)
        if tr is None:
            continue
        n = tr.compute_s.shape[1]
        lines.append(f"\n{kind}, striped: per round, each rank's step time / idle time before its next step (ms)\n")
        lines.append("| round | " + " | ".join(f"rank {j}" for j in range(n)) + " | MB sent per rank |")
        lines.append("| ---: " * (n + 2) + "|")
        for t in range(tr.compute_s.shape[0]):
            cells = " | ".join(f"{tr.compute_s[t, j] * 1e3:.1f} / {tr.wait_s[t, j] * 1e3:.1f}" for j in range(n))
            lines.append(f"| {t} | {cells} | {tr.bytes_sent[t].max() / 1e6:.1f} |")
        idle, busy = tr.wait_s[:-1].sum(), tr.compute_s.sum()
        lines.append(f"\nGPU idle between steps (the last round's wait for the final transfer left out): "
                     f"{idle * 1e3:.1f} ms against {busy * 1e3:.1f} ms in steps ({idle / max(busy, 1e-12):.1%}). "
                     f"With {RANKS} ranks on one GPU the ranks time-share it, so a step's time includes "
                     f"the others' kernels.")
        if shift and kind == "forward":
            per_round = tr.wait_s[:-1].mean(axis=1).max() if tr.wait_s.shape[0] > 1 else 0.0
            hidden = per_round < 0.5 * shift["seconds"]
            lines.append(f"\nOne block's shift alone ({shift['bytes'] / 1e6:.1f} MB, {shift['path']}): "
                         f"{shift['seconds'] * 1e3:.1f} ms; idle per round in the ring (worst rank mean): "
                         f"{per_round * 1e3:.1f} ms: transfers "
                         f"{'overlap the steps' if hidden else 'do NOT overlap the steps'}.")
    return "\n".join(lines)


def time_shifts(out, nbytes):
    """Under mpiexec: one K, V block of `nbytes` shifted round the ring alone,
    through the path transfer='auto' picks; rank 0 writes the median time."""
    import gpu_impl
    gpu_impl.use_local_device()
    import cupy
    from mpi4py import MPI
    from gpu_impl.device import CupyDevice
    from gpu_impl.transfer import choose_transfer, memory_for
    from mpi_impl.comm import RingComm
    comm = MPI.COMM_WORLD
    device = CupyDevice(cupy, cupy.cuda.Device().id)
    path, _ = choose_transfer("auto")
    ring = RingComm.on(comm, memory_for(path, device))
    block = tuple(cupy.zeros(max(1, nbytes // 4), dtype=cupy.float16) for _ in range(2))     # K, V
    times = []
    for _ in range(7):
        comm.Barrier()
        start = time.perf_counter()
        block = ring.finish_shift(ring.start_shift(block, 1))
        device.compute.synchronize()                    # the upload is done (the compute stream waits for it)
        times.append(time.perf_counter() - start)
    seconds = comm.allreduce(float(np.median(times[1:])), op=MPI.MAX)
    ring.free()
    if comm.Get_rank() == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, "bytes": nbytes, "path": path}))


def example_trace_doc():
    """A trace document shaped like the command line's, for the dry run's table."""
    from reference.trace import Trace
    z = np.zeros((RANKS, RANKS))
    tr = Trace(source=z.astype(int), tiles_computed=z.astype(int), tiles_skipped=z.astype(int), pairs=z.astype(int),
               bytes_sent=z.astype(int), compute_s=z + 1e-3, compute_cpu_s=z, wait_s=z)
    return {"layouts": {"striped": {"forward": tr}}}


