"""make gpu-check: what a first GPU must show, in one run of under 9 minutes, written to one Markdown file.

    python scripts/gpu_check.py                        # what `make gpu-check` runs (bash scripts/gpu_check.sh)
    python scripts/gpu_check.py --dry-run              # any machine: every step starts, nothing is measured
    python scripts/gpu_check.py --fake-gpu             # any machine: every step runs on a GPU made of NumPy
    python scripts/gpu_check.py --only fused rates     # some steps
    bash scripts/gpu_check.sh --wheels DIR             # first install carried wheels (make gpu-wheels; no index)

For one machine with a CUDA 13 GPU, CuPy and mpi4py, and no package index:
nothing is installed here (scripts/gpu_check.sh installs carried wheels). Each
step runs in a process of its own, killed when its time is up: its own limit,
never past what is left of the whole run's 9 minutes. After every step the
results file (default bench/results/gpu_check.md, which BENCHMARKS.md includes
through `bench.gpu_bench`) is written again and the step's section printed, so a
run stopped part-way leaves what it measured:

 1. environment     GPU, CUDA, CuPy, MPI library and its CUDA-awareness, mpiexec
                    (required: without it the ring tests cannot run), tools;
 2. race probe      the staged path with kernels, then copies, slowed down on purpose;
 3. GPU tests       tests/test_gpu.py -m gpu: 1, 2 and 4 MPI ranks sharing the
                    GPU, both transfer paths, the fused kernel; any skip fails;
 4. fused kernel    against the readable step at D = 64 and 128, GQA, float16 and float32;
 5. tensor cores    fused v2 against the readable step (D = 64 and 128, float16 and
                    bfloat16, GQA, masks), then timed beside v1 and torch's flash
                    attention on one block (bench.gpu_kernel.gpu_check);
 6. checked run     S = 65,536, Hq = 8 (where the GPU lags the host most), Hkv = 2,
                    D = 128, float16, forward and backward on 4 ranks, against
                    float64 attention and gradients computed on the GPU itself;
 7. command line    S = 65,536, D = 128, float16, GQA, backward, --check (rank 0
                    checks on the CPU in float64, so 2 query heads);
 8. trace           per round and rank: the step's GPU time and the GPU's idle
                    time before the next step, at 8 query heads: do transfers overlap?;
 9. sanitizer       compute-sanitizer racecheck and memcheck on one small fused launch;
10. rates           plain and fused steps against torch's flash attention, one block.

--fake-gpu runs the same steps, at small sizes, on tests/gpu/queued_device.py
(a GPU made of NumPy whose streams run later; the readable step stands in for
the fused kernel): it checks this script, and measures nothing. The GPU tests
skip there, so those two steps fail, as they must on a GPU where tests skip.

Exit status: 0 every step passed; 1 a step failed; 2 no GPU (nothing was checked).
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from mpi_impl.launch import find_mpiexec  # noqa: E402

OUT = ROOT / "bench" / "results" / "gpu_check.md"
QUEUED_GPU = ROOT / "tests" / "gpu" / "queued_device.py"
RANKS = 4
WHOLE_S = 9 * 60        # the whole check, wheels installed included (scripts/gpu_check.sh starts the clock)
MARGIN_S = 20           # kept back for writing the results, and for killing a step that ran over
# Open MPI refuses to run as root, and to start more ranks than cores, unless told;
# MPICH ignores these variables.
OPEN_MPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}


@dataclass(frozen=True)
class Sizes:
    """What the steps run: a GPU's sizes, or small ones for --fake-gpu."""
    realistic: tuple        # the command line step's arguments
    traced: tuple           # the trace step's
    fused_seq: int          # the fused kernel against the readable step: 4 striped blocks of fused_seq / 4
    fused_dims: tuple       # head dims
    rate_block: int         # the rates: one block pair of rate_block queries x keys
    checked: dict           # the checked run: seq_len, heads, kv_heads, head_dim, tile (striped, float16)


GPU_SIZES = Sizes(
    realistic=("--seq-len", "65536", "--head-dim", "128", "--dtype", "float16", "--kv-heads", "1", "--heads", "2",
               "--layout", "striped", "--backward", "--check", "--tile-size", "1024", "--no-warmup"),
    traced=("--seq-len", "65536", "--head-dim", "128", "--dtype", "float16", "--heads", "8", "--kv-heads", "2",
            "--layout", "all", "--backward", "--tile-size", "1024", "--repeat", "2"),
    fused_seq=4096, fused_dims=(64, 128), rate_block=4096,
    checked=dict(seq_len=65536, heads=8, kv_heads=2, head_dim=128, tile=1024))
FAKE_SIZES = Sizes(
    realistic=("--seq-len", "256", "--head-dim", "16", "--dtype", "float16", "--kv-heads", "1", "--heads", "2",
               "--layout", "striped", "--backward", "--check", "--tile-size", "32", "--no-warmup"),
    traced=("--seq-len", "256", "--head-dim", "16", "--dtype", "float16", "--heads", "8", "--kv-heads", "2",
            "--layout", "all", "--backward", "--tile-size", "32", "--repeat", "2"),
    fused_seq=64, fused_dims=(64, 128), rate_block=32,
    checked=dict(seq_len=256, heads=8, kv_heads=2, head_dim=16, tile=32))
FUSED_DTYPES = (np.float32, np.float16)


@dataclass
class Context:
    dry: bool
    python: str
    mpiexec: str
    work: Path
    fake: bool = False
    deadline: float = float("inf")      # time.time() by which this step's commands must have ended
    notes: dict = field(default_factory=dict)

    @property
    def sizes(self):
        return FAKE_SIZES if self.fake else GPU_SIZES

    def left(self):
        """Seconds left to this step."""
        return self.deadline - time.time()

    def gpu_python(self):
        """The interpreter, and on a fake GPU the runner that installs one in every process."""
        return [self.python, str(QUEUED_GPU)] if self.fake else [self.python]


@dataclass
class Result:
    ok: bool
    text: str
    skipped: str = ""           # a reason: the step could not run here (a tool is missing)


# -- helpers -------------------------------------------------------------------------

def run(ctx, cmd, limit):
    """(returncode, stdout + stderr) of cmd, or (124, what it printed) once
    `limit` seconds or the step's time left (the smaller) have passed; its whole
    process group (mpiexec and its ranks) is killed then."""
    timeout = min(limit, ctx.left())
    if timeout < 1:
        return 124, "[not started: no time left]"
    full_env = dict(os.environ)
    for name, value in OPEN_MPI_AS_ROOT.items():
        full_env.setdefault(name, value)
    full_env.update(PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
                    OPENBLAS_NUM_THREADS=os.environ.get("OPENBLAS_NUM_THREADS", "4"),
                    MPIEXEC_TIMEOUT=str(max(1, int(timeout) - 5)))    # mpiexec ends its ranks first
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return 124, (out or "") + f"\n[timed out after {timeout:.0f} s]"
    return proc.returncode, out


def fenced(text, limit=60):
    lines = text.strip().splitlines()
    if len(lines) > limit:
        lines = lines[:10] + [f"... ({len(lines) - limit} lines left out) ..."] + lines[-(limit - 10):]
    return "```\n" + "\n".join(lines) + "\n```"


def mpirun(ctx, *args):
    return [ctx.mpiexec, "-n", str(RANKS), *ctx.gpu_python()[:1], "-m", "mpi4py", *ctx.gpu_python()[1:], *args]


def find_sanitizer():
    for candidate in (shutil.which("compute-sanitizer"),
                      *(Path(p) / "bin" / "compute-sanitizer" for p in
                        (os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"))):
        if candidate and Path(candidate).exists():
            return str(candidate)
    return None


def module_version(name):
    try:
        module = __import__(name)
    except Exception as e:      # noqa: BLE001 - reported, not raised
        return f"missing ({type(e).__name__}: {e})"
    return getattr(module, "__version__", "present")


# -- 1. environment --------------------------------------------------------------------

def environment(ctx):
    rows = [("python", sys.version.split()[0] + f" ({ctx.python})")]
    rows += [(name, module_version(name)) for name in ("numpy", "cupy", "mpi4py", "pytest", "hypothesis", "torch")]
    rows.append(("mpiexec", ctx.mpiexec or "NOT FOUND"))
    rows.append(("compute-sanitizer", find_sanitizer() or "not found"))
    code = ("import gpu_impl; from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0]); "
            "print(gpu_impl.mpi_cuda_support()); print(gpu_impl.choose_transfer('auto'))")
    rc, out = run(ctx, [ctx.python, "-c", code], 60)
    lines = out.strip().splitlines()
    rows.append(("MPI library", lines[0] if rc == 0 else "cannot ask: " + " / ".join(lines[-3:])))
    if rc == 0:
        rows.append(("MPIX_Query_cuda_support()", lines[1]))
        rows.append(("transfer='auto'", lines[2]))
    if not ctx.dry:
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(0)
        rows.append(("GPU", f"{cupy.cuda.runtime.getDeviceCount()} x {props['name'].decode()}, "
                            f"{props['totalGlobalMem'] / 2**30:.0f} GiB, sm_{props['major']}{props['minor']}"))
        rows.append(("CUDA runtime / driver", f"{cupy.cuda.runtime.runtimeGetVersion()} / "
                                              f"{cupy.cuda.runtime.driverGetVersion()}"))
    text = "| what | found |\n| :--- | :--- |\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)
    missing = [name for name in ("pytest", "hypothesis") if module_version(name).startswith("missing")]
    if not ctx.mpiexec:
        return Result(False, text + "\n\nmpiexec not found: the ring tests cannot run (give --mpiexec PATH, "
                                    "or carry the mpich wheel: --wheels DIR).")
    if rc != 0:
        return Result(False, text + "\n\nmpi4py cannot load an MPI library: carry the mpich wheel "
                                    "(make gpu-wheels, then --wheels DIR, which installs it in the check's venv).")
    if missing:
        return Result(False, text + f"\n\n{', '.join(missing)} missing: carry their wheels (--wheels DIR).")
    return Result(True, text)


# -- 2, 3. the tests -------------------------------------------------------------------

def pytest_step(ctx, selection):
    """tests/test_gpu.py -m gpu with `selection`; fails on any failure or skip."""
    base = [ctx.python, "-m", "pytest", "tests/test_gpu.py", "-m", "gpu", "-k", selection,
            "-p", "no:cacheprovider", "-q", "-rs"]
    if ctx.dry:
        rc, out = run(ctx, base + ["--collect-only"], 120)
        collected = sum(1 for line in out.splitlines() if "::" in line)
        return Result(rc == 0 and collected > 0, f"dry run: {collected} GPU tests collected\n\n" + fenced(out, 20))
    rc, out = run(ctx, base, ctx.left())
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    ok = rc == 0 and not skipped
    why = "" if ok else ("\n\nFAILED: " + ("tests were skipped although a GPU is present" if skipped
                                           else f"pytest exit status {rc}"))
    return Result(ok, fenced(out, 40) + why)


def race_probe(ctx):
    return pytest_step(ctx, "race_probe")


def gpu_tests(ctx):
    return pytest_step(ctx, "not race_probe")


# -- 4. fused against readable -----------------------------------------------------------

def fused_against_readable(ctx):
    """Max |fused - readable| over |readable| at model shapes: 4 striped blocks, GQA 8/2."""
    from gpu_impl import fused
    if ctx.dry:
        tiles = [fused.fused_tile(None, d) for d in ctx.sizes.fused_dims]
        return Result(True, f"dry run: fused tiles {tiles} fit at D = {ctx.sizes.fused_dims}")
    import cupy
    from reference import ring, steps
    from reference.layouts import positions, shard
    from reference.step import ForwardAcc, Queries, finish_forward
    rows, ok = [], True
    seq = ctx.sizes.fused_seq
    for head_dim, dtype in ((d, t) for d in ctx.sizes.fused_dims for t in FUSED_DTYPES):
        rng = np.random.default_rng(head_dim)
        q = rng.standard_normal((1, seq, 8, head_dim)).astype(dtype)
        k, v = (rng.standard_normal((1, seq, 2, head_dim)).astype(dtype) for _ in range(2))
        pos = positions(seq, 4, "striped")
        queries = Queries.prepare(cupy.asarray(shard(q, 4, "striped")[3]), 2, pos[3], head_dim ** -0.5)
        accs = ForwardAcc.zeros(queries.q), ForwardAcc.zeros(queries.q)
        plain, kernel = steps.get("v1"), steps.get("fused")
        for j in range(4):
            block = ring.own_block(*(cupy.asarray(shard(x, 4, "striped")[j]) for x in (k, v)), pos[j], j)
            plain.forward(accs[0], queries, ring.as_dtype(block, np.float32), causal=True, tile_size=512)
            kernel.forward(accs[1], queries, ring.as_dtype(block, np.float32, kernel), causal=True, tile_size=None)
        (o0, l0), (o1, l1) = ((cupy.asnumpy(x) for x in finish_forward(a)) for a in accs)
        err = max(float(np.abs(o1 - o0).max() / max(1.0, np.abs(o0).max())),
                  float(np.abs(l1 - l0).max() / max(1.0, np.abs(l0).max())))
        good = err <= 1e-4
        ok &= good
        rows.append(f"| {head_dim} | {np.dtype(dtype).name} | {fused.fused_tile(None, head_dim)} | {err:.1e} | "
                    f"{'ok' if good else 'FAILED'} |")
    head = (f"Fused kernel against the readable step (both accumulate in float32), S = {seq} on 4 striped "
            "blocks, Hq = 8, Hkv = 2, causal; error scaled by max(1, |readable|), limit 1e-4.\n\n"
            "| D | inputs | fused tile | max error | |\n| ---: | :--- | :--- | ---: | :--- |\n")
    return Result(ok, head + "\n".join(rows))


# -- 5. the tensor-core kernel -------------------------------------------------------------

def tensor_cores(ctx):
    """fused v2 checked against the readable step on the GPU, then timed (bench.gpu_kernel)."""
    from bench import gpu_kernel
    ok, text = gpu_kernel.gpu_check(dry=ctx.dry, small=ctx.fake)
    return Result(ok, text)


# -- 6. a checked run where the GPU lags ----------------------------------------------------------

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
            f"float16, striped, tile {cfg['tile']}, {RANKS} ranks, forward and backward")
    if ctx.dry:
        return Result(True, f"dry run: {what}")
    path = ctx.work / "checked.json"
    rc, out = run(ctx, mpirun(ctx, str(Path(__file__).resolve()), "--checked-run", str(path), json.dumps(cfg)),
                  300)
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
    opts = dict(comm=comm, layout="striped", tile_size=cfg["tile"])
    comm.Barrier()
    start = time.perf_counter()
    out, lse = gpu_impl.ring_attention(q, k, v, **opts)
    dq, dk, dv = gpu_impl.ring_attention_backward(q, k, v, out, lse, dout, **opts)
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


# -- 7, 8. the command line -------------------------------------------------------------------

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
    rc, out = run(ctx, mpirun(ctx, "-m", "gpu_impl", *realistic), 170)
    return Result(rc == 0, f"`{shown}`\n\n" + fenced(out, 30) + ("" if rc == 0 else f"\n\nFAILED: exit status {rc}"))


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
    rc, out = run(ctx, mpirun(ctx, "-m", "gpu_impl", *args), 110)
    if rc != 0:
        return Result(False, f"`{shown}`\n\n" + fenced(out, 30) + f"\n\nFAILED: exit status {rc}")
    from reference.trace import read_trace
    doc = read_trace(path)
    nbytes = int(doc["layouts"]["striped"]["forward"].bytes_sent[0].max())
    alone = ctx.work / "shift.json"
    rc, shift_out = run(ctx, mpirun(ctx, str(Path(__file__).resolve()), "--time-shifts", str(alone), str(nbytes)),
                        60)
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


# -- 9. compute-sanitizer -------------------------------------------------------------------

def one_fused_launch():
    """One small fused launch per K/V dtype (what the sanitizer watches): a
    partly masked block of 96 keys, D = 64, GQA, tiles cut short at both ends."""
    import cupy

    import gpu_impl  # noqa: F401 - registers its CUDA steps ("fused") with reference.steps
    from reference import ring, steps
    from reference.step import ForwardAcc, Queries
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float16):
        q = cupy.asarray(rng.standard_normal((1, 100, 4, 64)).astype(dtype))
        k, v = (cupy.asarray(rng.standard_normal((1, 96, 2, 64)).astype(dtype)) for _ in range(2))
        queries = Queries.prepare(q, 2, np.arange(100) * 2 + 1, 0.125)
        step = steps.get("fused")
        acc = ForwardAcc.zeros(queries.q)
        block = ring.as_dtype(ring.own_block(k, v, np.arange(96) * 2, 0), np.float32, step)
        step.forward(acc, queries, block, causal=True, tile_size=None)
    cupy.cuda.Device().synchronize()
    print("one fused launch per dtype: done")


def sanitizer(ctx):
    tool = find_sanitizer()
    me = [*ctx.gpu_python(), str(Path(__file__).resolve()), "--one-fused-launch"]
    if ctx.dry:
        rc, out = run(ctx, me + ["--dry-run"], 60)
        return Result(rc == 0, f"dry run: the launch script starts ({out.strip()}); compute-sanitizer: "
                               f"{tool or 'not found'}")
    if tool is None:
        rc, out = run(ctx, me, 60)              # the launch alone, at least
        return Result(rc == 0, "compute-sanitizer not found (CUDA_HOME/bin, /usr/local/cuda/bin, PATH); "
                               "the launch alone:\n\n" + fenced(out, 20), skipped="compute-sanitizer not found")
    parts, ok = [], True
    for name in ("racecheck", "memcheck"):
        rc, out = run(ctx, [tool, "--tool", name, "--error-exitcode", "99", *me], 60)
        good = rc == 0
        ok &= good
        summary = [line for line in out.splitlines() if "SUMMARY" in line or "done" in line]
        parts.append(f"{name}: {'ok' if good else f'FAILED (exit {rc})'}\n\n" + fenced("\n".join(summary) or out, 20))
    return Result(ok, "\n\n".join(parts))


# -- 10. rates --------------------------------------------------------------------------------

def rates(ctx):
    """One block pair, every tile visible: rate_block queries x keys, Hq = 8, Hkv = 2, float16."""
    if ctx.dry:
        return Result(True, f"dry run: torch {module_version('torch')}")
    import cupy

    import gpu_impl  # noqa: F401 - registers its CUDA steps ("fused") with reference.steps
    from bench import gpu_bench
    from reference import ring, steps
    from reference.step import ForwardAcc, Queries
    from reference.tms import attention_flops
    c, hq, hkv = ctx.sizes.rate_block, 8, 2
    rows = []
    for head_dim in (64, 128):
        useful = attention_flops(c * c * hq, head_dim)
        rng = np.random.default_rng(1)
        q = rng.standard_normal((1, c, hq, head_dim)).astype(np.float16)
        k, v = (rng.standard_normal((1, c, hkv, head_dim)).astype(np.float16) for _ in range(2))
        queries = Queries.prepare(cupy.asarray(q), hkv, np.arange(c) + c, head_dim ** -0.5)
        block = ring.own_block(cupy.asarray(k), cupy.asarray(v), np.arange(c), 0)
        for name, step, tile in (("v1 (readable), tile 1024", steps.get("v1"), 1024),
                                 ("fused v1, its tile", steps.get("fused"), None)):
            b = ring.as_dtype(block, np.float32, step)
            seconds = gpu_bench.timed(cupy.cuda.Device().synchronize, lambda: step.forward(
                ForwardAcc.zeros(queries.q), queries, b, causal=True, tile_size=tile), repeat=3)
            rows.append((head_dim, name, seconds, useful / seconds / 1e12))
        flash = torch_flash(c, hq, hkv, head_dim)
        rows.append((head_dim, "torch flash attention" if flash else "torch: not installed (or no CUDA)",
                     flash or float("nan"), useful / flash / 1e12 if flash else float("nan")))
    table = "| D | step | ms | TFLOP/s (useful) |\n| ---: | :--- | ---: | ---: |\n" + "\n".join(
        f"| {d} | {name} | {s * 1e3:.2f} | {r:.1f} |" for d, name, s, r in rows)
    return Result(True, f"One block pair, every tile visible: {c} queries x {c} keys, Hq = 8, Hkv = 2, "
                        "float16 inputs; useful FLOPs 4 D per pair per query head.\n\n" + table)


def torch_flash(c, hq, hkv, head_dim):
    """Seconds of torch's flash attention on the same block, or None without torch."""
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    q = torch.randn(1, hq, c, head_dim, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, hkv, c, head_dim, device="cuda", dtype=torch.float16).repeat_interleave(hq // hkv, 1)
            for _ in range(2))

    def fn():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v)
    from bench import gpu_bench
    return gpu_bench.timed(torch.cuda.synchronize, fn)


# -- the run ------------------------------------------------------------------------------------

STEPS = {"environment": (environment, 60), "race probe": (race_probe, 90), "GPU tests": (gpu_tests, 220),
         "fused kernel": (fused_against_readable, 90), "tensor cores": (tensor_cores, 120),
         "checked run": (checked_run, 240), "command line": (command_line, 180),
         "trace": (trace, 180), "sanitizer": (sanitizer, 130), "rates": (rates, 90)}     # name: (step, limit s)
SHORT = {"environment": "env", "race probe": "race", "GPU tests": "tests", "fused kernel": "fused",
         "tensor cores": "tensor", "checked run": "checked", "command line": "cli", "trace": "trace",
         "sanitizer": "sanitizer", "rates": "rates"}


def run_step(ctx, name, limit, result_file):
    """One step in a process of its own, killed when its time is up (the step
    ends its own commands a few seconds before); the Result it wrote."""
    cmd = [ctx.python, str(Path(__file__).resolve()), "--step", SHORT[name], "--result", str(result_file),
           "--work", str(ctx.work), "--deadline", f"{time.time() + limit - 5:.1f}"]
    cmd += ["--mpiexec", ctx.mpiexec] * bool(ctx.mpiexec) + ["--dry-run"] * ctx.dry + ["--fake-gpu"] * ctx.fake
    rc, out = run(ctx, cmd, limit)
    if result_file.exists():
        result = Result(**json.loads(result_file.read_text()))
        result_file.unlink()
        return result
    return Result(False, f"FAILED: the step's process ended with status {rc} and no result:\n\n" + fenced(out, 40))


def step_main(args):
    """--step: run one step here, write its Result as JSON to --result."""
    ctx = Context(dry=args.dry_run, python=sys.executable, mpiexec=args.mpiexec, work=Path(args.work),
                  fake=args.fake_gpu, deadline=args.deadline)
    name = next(n for n, short in SHORT.items() if short == args.step)
    if ctx.fake and not ctx.dry:
        sys.path.insert(0, str(QUEUED_GPU.parent))
        import queued_device
        queued_device.install_for_process()
    try:
        result = STEPS[name][0](ctx)
    except Exception as e:          # noqa: BLE001 - one step's failure is reported, the others still run
        result = Result(False, f"FAILED: {type(e).__name__}: {e}")
    Path(args.result).write_text(json.dumps(asdict(result)))
    return 0


def gpu_missing(ctx):
    """None where CuPy finds a GPU (asked in a process of its own), else why not."""
    code = "from gpu_impl import require_cupy; require_cupy()"
    rc, out = run(ctx, [ctx.python, "-c", code], 60)
    return None if rc == 0 else out.strip().splitlines()[-1] if out.strip() else f"status {rc}"


def write_results(path, ctx, sections, failed, started, steps_left):
    """The results file as it stands: rewritten after every step."""
    state = ("every step passed" if not failed else "FAILED: " + ", ".join(failed))
    if steps_left:
        state = f"INCOMPLETE ({steps_left} steps still to run); so far " + state
    head = (f"{'Dry run (nothing measured)' if ctx.dry else 'Fake GPU run (nothing measured)' if ctx.fake else 'Results'}"
            f" of `make gpu-check` (scripts/gpu_check.py), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"{time.time() - started:.0f} s; {state}.\n")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(head + "\n" + "\n".join(sections))
    return head


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python scripts/gpu_check.py", description=__doc__.split("\n\n")[0],
                                 epilog="Steps: " + ", ".join(f"{s} ({n})" for n, s in SHORT.items()))
    ap.add_argument("--dry-run", action="store_true", help="start every step without a GPU; measure nothing")
    ap.add_argument("--fake-gpu", action="store_true",
                    help="run every step at small sizes on a GPU made of NumPy (tests/gpu/queued_device.py): "
                         "checks this script, measures nothing")
    ap.add_argument("--out", default=str(OUT), help="the Markdown results file (default: %(default)s)")
    ap.add_argument("--only", nargs="+", choices=list(SHORT.values()), help="run only these steps")
    ap.add_argument("--mpiexec", help="the launcher (default: beside python, else on PATH)")
    ap.add_argument("--started", type=float, default=None,
                    help="when the whole check started (time.time(); default: now): 9 minutes from then")
    ap.add_argument("--step", choices=list(SHORT.values()), help=argparse.SUPPRESS)       # run one step here
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    ap.add_argument("--one-fused-launch", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--time-shifts", nargs=2, metavar=("OUT", "BYTES"), help=argparse.SUPPRESS)
    ap.add_argument("--checked-run", nargs=2, metavar=("OUT", "CONFIG"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.time_shifts:
        time_shifts(args.time_shifts[0], int(args.time_shifts[1]))
        return 0
    if args.checked_run:
        checked_run_worker(args.checked_run[0], json.loads(args.checked_run[1]))
        return 0
    if args.one_fused_launch:
        if args.dry_run:
            print("the fused launch imports")
            return 0
        one_fused_launch()
        return 0
    if args.step:
        return step_main(args)
    started = args.started or time.time()
    ctx = Context(dry=args.dry_run, python=sys.executable, mpiexec=find_mpiexec(sys.executable, args.mpiexec),
                  work=Path(tempfile.mkdtemp(prefix="gpu_check_")), fake=args.fake_gpu,
                  deadline=started + WHOLE_S - MARGIN_S)
    reason = None if ctx.dry or ctx.fake else gpu_missing(ctx)
    if reason:
        print(f"gpu-check: no usable GPU here, nothing was checked: {reason}", file=sys.stderr)
        return 2
    names = [n for n in STEPS if not args.only or SHORT[n] in args.only]
    sections, failed = [], []
    for i, name in enumerate(names):
        t0 = time.time()
        print(f"== {name} ({t0 - started:.0f} s; {ctx.left():.0f} s left)", flush=True)
        limit = min(STEPS[name][1], ctx.left())
        if limit < 10:
            result = Result(False, f"not started: the whole run's {WHOLE_S} s are spent "
                                   f"(rerun it alone: --only {SHORT[name]})")
        else:
            result = run_step(ctx, name, limit, ctx.work / f"{SHORT[name]}.json")
        status = "skipped: " + result.skipped if result.skipped else ("ok" if result.ok else "FAILED")
        if not result.ok:
            failed.append(name)
        sections.append(f"### {name}: {status} ({time.time() - t0:.0f} s)\n\n{result.text}\n")
        stop = name == "environment" and not result.ok          # nothing else can run
        head = write_results(args.out, ctx, sections, failed, started, 0 if stop else len(names) - i - 1)
        print(sections[-1], flush=True)         # after the file: what is printed is kept
        if stop:
            break
    print(f"{head}written: {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
