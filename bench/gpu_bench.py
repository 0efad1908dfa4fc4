"""The GPU table: the ring on CuPy per layout, against the float64 reference, cuBLAS and torch.

Paper, section 2.2.1 and Table 1: striping pays off as wall-clock time once
skipped tiles are skipped for real. On one machine this measures, side by side:

1. the block step on one GPU, one (query shard, key block) pair with every tile
   visible: the plain step (reference/step.py on CuPy) at two tile sizes and
   the fused kernel (gpu_impl/steps/kernels/attend_block_v1.cu), as TFLOP/s on useful
   FLOPs (4*D per visible pair per head) and as a share of the same GPU's
   cuBLAS float32 matmul rate; error against the float64 plain step;
2. the ring, N ranks under mpiexec sharing this node's GPUs (by local rank),
   forward, float32, per layout: error against the float64 dense reference
   (the formula of reference/dense.py on the GPU, itself checked against
   `reference.attention` at a small size), wall time of the slowest rank (best
   of a few), speed-up over contiguous, achieved TFLOP/s on useful FLOPs;
3. torch's scaled_dot_product_attention on the whole sequence, same shapes,
   where torch is importable.

With several ranks on one GPU the ranks time-share it, so the total work, not
the busiest rank, sets the wall time: striped's gain over contiguous shows with
one GPU per rank. Without a GPU, `run` returns a section that says so.

    python -m bench.gpu_bench                     # quick: S = 8192, 4 ranks; prints, writes bench/results/gpu.md
    python -m bench.gpu_bench --full              # S = 32768
    python -m bench.run --only gpu                # into BENCHMARKS.md
    (internal) mpiexec -n N python -m mpi4py -m bench.gpu_bench --ring-worker OUT.json --seq-len S ...
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mpi_impl.launch import find_mpiexec
from reference.tms import attention_flops

from . import RESULTS, markdown_table

ROOT = Path(__file__).resolve().parents[1]
QUICK = dict(seq_len=8192, batch=1, heads=8, head_dim=64, tile=256, ranks=4, repeat=3, block=4096)
FULL = dict(seq_len=32768, batch=1, heads=8, head_dim=64, tile=512, ranks=4, repeat=5, block=8192)
WORKER_TIMEOUT_S = 240


def gpu_missing():
    """None where CuPy sees a GPU, else why not."""
    try:
        from gpu_impl import GpuUnavailable, require_cupy
    except ImportError as e:
        return f"gpu_impl cannot be imported: {e}"
    try:
        require_cupy()
    except GpuUnavailable as e:
        return str(e)
    return None


CHECK_RESULTS = RESULTS / "gpu_check.md"      # what `make gpu-check` wrote on a GPU machine


def no_gpu_section(reason, check_results=None):
    """Says why nothing was measured here, and includes the results `make gpu-check`
    wrote on a GPU machine (bench/results/gpu_check.md) where there are some."""
    text = (f"No GPU here, so nothing was measured: {reason}.\n\n"
            "On a machine with a CUDA 13 GPU, `make gpu-check` (`scripts/gpu_check.py`) runs the GPU "
            "validation and writes bench/results/gpu_check.md, which this section includes.\n")
    path = Path(check_results or CHECK_RESULTS)
    if path.exists() and path.read_text().startswith("Results"):
        text += "\n" + path.read_text()
    return text


def run(quick=True, results_dir=None):
    """(markdown, [png paths]) of the GPU measurements, or a no-GPU section."""
    reason = gpu_missing()
    if reason is not None:
        return no_gpu_section(reason), []
    import cupy
    cfg = QUICK if quick else FULL
    results_dir = Path(results_dir or RESULTS)
    blas = {name: matmul_tflops(cupy, 8192, dt) for name, dt in (("float32", np.float32), ("float16", np.float16))}
    check_dense_gpu(cupy)
    parts = [machine_line(cupy), blas_table(blas), step_table(cupy, cfg, blas["float32"])]
    ring = ring_measure(cfg)
    parts.append(ring_table(ring, cfg, blas["float32"]))
    sdpa = torch_sdpa(cfg)
    parts.append(sdpa_line(sdpa, cfg))
    pngs = [p for p in [plot(ring, sdpa, cfg, results_dir)] if p]
    return "\n\n".join(parts) + "\n", pngs


# -- the machine's own rates --------------------------------------------------

def machine_line(cupy):
    props = cupy.cuda.runtime.getDeviceProperties(0)
    n = cupy.cuda.runtime.getDeviceCount()
    return (f"Machine: {n} x {props['name'].decode()} ({props['totalGlobalMem'] / 2**30:.0f} GiB), "
            f"CuPy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}.")


def timed(synchronize, fn, repeat=5):
    """Best wall time of fn() over `repeat` runs, after one warm-up; `synchronize()`
    waits for the GPU (CuPy's ``cupy.cuda.Device().synchronize``, torch's
    ``torch.cuda.synchronize``)."""
    fn()
    synchronize()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_tflops(cupy, n, dtype):
    """cuBLAS rate of an n x n x n matmul (2 n^3 FLOPs), TFLOP/s."""
    a, b = (cupy.asarray(np.random.default_rng(i).standard_normal((n, n)), dtype=dtype) for i in (0, 1))
    return 2 * n ** 3 / timed(cupy.cuda.Device().synchronize, lambda: a @ b) / 1e12


def blas_table(blas):
    return markdown_table(["cuBLAS matmul (8192^3)", "TFLOP/s"],
                          [[name, f"{rate:.1f}"] for name, rate in blas.items()], "lr")


# -- 1. the block step on one GPU ----------------------------------------------

def step_table(cupy, cfg, blas32):
    """The readable step (two tile sizes) and the fused kernel on one fully visible block pair."""
    from gpu_impl.steps import fused
    from reference import steps
    from reference.step import ForwardAcc, KVBlock, Queries, finish_forward
    c, H, D = cfg["block"], cfg["heads"], cfg["head_dim"]
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s) for s in ((1, H, c, 1, D), (1, H, c, D), (1, H, c, D)))
    q_pos, k_pos = np.arange(c) + c, np.arange(c)            # every key before every query: all tiles FULL
    useful = attention_flops(c * c * H, D)

    def inputs(dtype):
        return (Queries(cupy.asarray(q * D ** -0.5, dtype=dtype), q_pos),
                KVBlock(cupy.asarray(k, dtype=dtype), cupy.asarray(v, dtype=dtype), k_pos,
                        np.array([0, 1], np.int32)))        # device 0, K and V finite: the step reads no flag on the GPU

    def run(step, queries, block, tile):
        acc = ForwardAcc.zeros(queries.q)
        step.forward(acc, queries, block, causal=True, tile_size=tile)
        return acc

    want = cupy.asnumpy(finish_forward(run(steps.get("v1"), *inputs(np.float64), 1024))[0])
    rows = []
    for name, step, tile in (("v1 (readable), tile 256", steps.get("v1"), 256),
                             ("v1 (readable), tile 1024", steps.get("v1"), 1024),
                             (f"fused v{fused.VERSION}, tile {fused.DEFAULT_TILE}", steps.get("fused"), None)):
        queries, block = inputs(np.float32)
        got = cupy.asnumpy(finish_forward(run(step, queries, block, tile))[0])
        seconds = timed(cupy.cuda.Device().synchronize, lambda: run(step, queries, block, tile), repeat=3)
        rate = useful / seconds / 1e12
        rows.append([name, f"{np.abs(got - want).max():.1e}", f"{seconds * 1e3:.2f}", f"{rate:.2f}",
                     f"{rate / blas32:.0%}"])
    title = f"Block step, one GPU: {c} queries x {c} keys, H={H}, D={D}, float32, every tile visible"
    return title + "\n\n" + markdown_table(
        ["step", "max error vs float64", "ms", "TFLOP/s (useful)", "of cuBLAS float32"], rows, "lrrrr")


# -- 2. the ring under mpiexec -------------------------------------------------

def ring_measure(cfg, transfer="auto", step="auto"):
    """Launch the ring worker on cfg['ranks'] ranks; its JSON document."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ring.json"
        cmd = [find_mpiexec() or "mpiexec", "-n", str(cfg["ranks"]), sys.executable,
               "-m", "mpi4py", "-m", "bench.gpu_bench", "--ring-worker", str(out),
               "--seq-len", str(cfg["seq_len"]), "--heads", str(cfg["heads"]), "--head-dim", str(cfg["head_dim"]),
               "--tile", str(cfg["tile"]), "--repeat", str(cfg["repeat"]), "--transfer", transfer,
               "--step", step]
        env = dict(os.environ, PYTHONPATH=str(ROOT), MPIEXEC_TIMEOUT=str(WORKER_TIMEOUT_S))
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S + 30)
        if proc.returncode != 0:
            raise RuntimeError(f"ring worker failed ({' '.join(cmd)}):\n{proc.stdout}\n{proc.stderr}")
        return json.loads(out.read_text())


def useful_flops(S, B, H, D, causal=True):
    pairs = S * (S + 1) // 2 if causal else S * S
    return attention_flops(pairs * H * B, D)


def ring_table(doc, cfg, blas32):
    S, H, D, n = cfg["seq_len"], cfg["heads"], cfg["head_dim"], cfg["ranks"]
    flops = useful_flops(S, cfg["batch"], H, D)
    base = doc["layouts"]["contiguous"]["seconds"]
    rows = []
    for layout, r in doc["layouts"].items():
        rate = flops / r["seconds"] / 1e12
        rows.append([layout, f"{r['max_error']:.1e}", f"{r['seconds'] * 1e3:.1f}", f"{base / r['seconds']:.2f}",
                     f"{rate:.2f}", f"{rate / blas32:.0%}"])
    title = (f"Ring forward: N={n} ranks on {doc['gpus']} GPU(s), S={S}, B={cfg['batch']}, H={H}, D={D}, float32, "
             f"causal, tile {cfg['tile']}, transfer {doc['transfer']}, step {doc['step']}, best of {cfg['repeat']}")
    return title + "\n\n" + markdown_table(
        ["layout", "max error vs float64", "ms", "speed-up over contiguous", "TFLOP/s (useful)", "of cuBLAS float32"],
        rows, "lrrrrr")


def ring_worker(args):
    """One rank: every layout, timed; rank 0 writes errors and times to args.ring_worker."""
    import cupy
    from mpi4py import MPI

    import gpu_impl
    from reference.inputs import make_shard
    from reference import LAYOUTS, positions
    comm, MAX = MPI.COMM_WORLD, MPI.MAX
    n, rank = comm.Get_size(), comm.Get_rank()
    gpu_impl.use_local_device(comm)
    S, H, D = args.seq_len, args.heads, args.head_dim
    shape = (1, S, H, D)
    doc = {"gpus": cupy.cuda.runtime.getDeviceCount(), "step": args.step,
           "transfer": gpu_impl.choose_transfer(args.transfer)[0], "layouts": {}}
    for layout in LAYOUTS:
        pos = positions(S, n, layout)[rank]
        q, k, v = (cupy.asarray(make_shard(args.seed, i, shape, pos, np.float32)) for i in range(3))
        opts = dict(comm=comm, layout=layout, tile_size=args.tile, transfer=args.transfer, step=args.step)
        times = []
        for _ in range(args.repeat + 1):                   # the first run compiles and warms the pool
            comm.Barrier()
            start = time.perf_counter()
            out, _lse = gpu_impl.ring_attention(q, k, v, **opts)
            cupy.cuda.Device().synchronize()
            times.append(comm.allreduce(time.perf_counter() - start, op=MAX))
        best = min(times[1:])
        outs = comm.gather(cupy.asnumpy(out))
        if rank == 0:
            doc["layouts"][layout] = {"seconds": best, "max_error": ring_error(cupy, outs, layout, args)}
    if rank == 0:
        Path(args.ring_worker).write_text(json.dumps(doc))


def ring_error(cupy, outs, layout, args):
    """Largest |out - float64 reference|, scaled by max(1, |reference|)."""
    from reference.inputs import make_shard
    from reference import unshard
    S, H, D = args.seq_len, args.heads, args.head_dim
    full = np.arange(S)
    q, k, v = (make_shard(args.seed, i, (1, S, H, D), full, np.float32) for i in range(3))
    want = dense_gpu(cupy, q, k, v)
    got = unshard(outs, layout, axis=1)
    return float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))


def dense_gpu(cupy, q, k, v):
    """reference/dense.py's causal attention in float64, on the GPU, one head at a
    time (an (S, S) score matrix per head). q, k, v (B, S, H, D) NumPy -> out NumPy."""
    B, S, H, D = q.shape
    out = np.empty(q.shape)
    visible = cupy.tri(S, dtype=bool)                             # key <= query
    for b in range(B):
        for h in range(H):
            qh, kh, vh = (cupy.asarray(x[b, :, h], dtype=cupy.float64) for x in (q, k, v))
            s = qh @ kh.T * D ** -0.5                             # (S, S)
            s = cupy.where(visible, s, -cupy.inf)
            p = cupy.exp(s - s.max(axis=1, keepdims=True))
            out[b, :, h] = cupy.asnumpy((p @ vh) / p.sum(axis=1, keepdims=True))
    return out


def check_dense_gpu(cupy):
    """dense_gpu equals reference.attention (float64) at a small size; `cupy` may
    be NumPy dressed as CuPy (tests/gpu/test_gpu.py)."""
    from reference import attention
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 64, 3, 8)) for _ in range(3))
    err = np.abs(dense_gpu(cupy, q, k, v) - attention(q, k, v)[0]).max()
    assert err < 1e-12, f"dense_gpu differs from reference.attention by {err}"


# -- 3. torch ----------------------------------------------------------------------

def torch_sdpa(cfg):
    """{dtype: seconds} of torch's causal scaled_dot_product_attention on the
    whole sequence (B, H, S, D), or None without torch (or its CUDA)."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    B, S, H, D = cfg["batch"], cfg["seq_len"], cfg["heads"], cfg["head_dim"]
    times = {}
    for name, dt in (("float32", torch.float32), ("float16", torch.float16)):
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dt) for _ in range(3))
        times[name] = timed(torch.cuda.synchronize, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    return times


def sdpa_line(sdpa, cfg):
    if sdpa is None:
        return "torch scaled_dot_product_attention: torch (with CUDA) is not installed here; not measured."
    flops = useful_flops(cfg["seq_len"], cfg["batch"], cfg["heads"], cfg["head_dim"])
    cells = ", ".join(f"{name} {s * 1e3:.2f} ms ({flops / s / 1e12:.1f} TFLOP/s)" for name, s in sdpa.items())
    return f"torch scaled_dot_product_attention, one GPU, the whole sequence, causal: {cells}."


def plot(doc, sdpa, cfg, results_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    layouts = list(doc["layouts"])
    ms = [doc["layouts"][name]["seconds"] * 1e3 for name in layouts]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar(layouts, ms, color=["tab:gray", "tab:blue", "tab:orange"][:len(layouts)])
    if sdpa:
        ax.axhline(sdpa["float32"] * 1e3, color="k", ls="--", label="torch SDPA float32, one GPU")
        ax.legend(fontsize="small")
    ax.set_ylabel("ms (slowest rank)")
    ax.set_title(f"ring forward, N={cfg['ranks']}, S={cfg['seq_len']}")
    fig.tight_layout()
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / "gpu_ring.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="S = 32768 instead of 8192")
    ap.add_argument("--out", default=str(RESULTS / "gpu.md"), help="markdown file (default: %(default)s)")
    ap.add_argument("--ring-worker", metavar="OUT.json", help=argparse.SUPPRESS)
    ap.add_argument("--seq-len", type=int, default=QUICK["seq_len"], help="tokens S")
    ap.add_argument("--heads", type=int, default=QUICK["heads"], help="heads H")
    ap.add_argument("--head-dim", type=int, default=QUICK["head_dim"], help="head dim D")
    ap.add_argument("--tile", type=int, default=QUICK["tile"], help="tile side T")
    ap.add_argument("--repeat", type=int, default=QUICK["repeat"], help="timed runs (the best is kept)")
    ap.add_argument("--transfer", default="auto", help="staged, cuda-aware or auto (what MPI says it supports)")
    ap.add_argument("--step", default="auto", help="block step version (reference.steps)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.ring_worker:
        ring_worker(args)
        return 0
    text, pngs = run(quick=not args.full)
    text = "## GPU\n\n" + text
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(f"written: {args.out}" + "".join(f", {p}" for p in pngs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
