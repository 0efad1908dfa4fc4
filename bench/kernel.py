"""Kernel efficiency and memory of one device: the step versions against a plain matmul.

DESIGN.md's speed target for the per-device step (`reference/step.py`): at S = 8192,
Hq = 8, D = 64, causal, float32, one device holding the whole sequence as one block
(q_pos = k_pos = 0 .. S-1), the forward and the backward each reach 70% of the same
machine's float32 matmul rate on useful FLOPs:

    forward   4 D FLOPs per visible (query, key) pair per head   (S = QK^T, O += PV)
    backward 10 D FLOPs per visible pair per head                 (S, dV, dP, dQ, dK)
    visible pairs, causal: S (S + 1) / 2

The matmul rate is a 4096 x 4096 @ 4096 x 4096 float32 product, timed in the same run with
the same BLAS threads. What is timed is the step (`Step.forward`, `Step.backward`) as a
ring round calls it; its O(S D) set-up and finish are not.
The machine may be shared: every figure is the best of a few repeats, and the ratios are
only as steady as the machine. Also measured: the same step at other S, D and tile sizes,
every registered NumPy step version (`reference.steps`: v1 readable, v2, v3) side by side, what one
tile's operations cost on one thread (what limits the ratio), and the peak memory of the
single-device forward and backward against S, which grows linearly (no S x S array).

Letters: S tokens, H heads, D head dim, T tile size (tq x tk).

    python -m bench.kernel                 # quick: about a minute on 2 idle cores
    python -m bench.kernel --full          # more sizes and repeats
    python -m bench.kernel --step v2 --threads 1   # one version; checked against float64 first
    python -m bench.kernel --torch-python /tmp/torchvenv/bin/python   # with torch's attention beside it

OpenBLAS reads OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE as it loads, and some
machines set them to another CPU's kernels: where either is set, the command
runs itself again without both (``--as-set`` keeps them), and the report names
the kernels that ran (threadpoolctl).
    python -m bench.run --only kernel      # into BENCHMARKS.md
"""

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reference import attention, attention_backward, steps
from reference.heads import q_from_heads, rows_from_heads
from reference.ring import own_block
from reference.step import BackwardRows, ForwardAcc, Grads, Queries, finish_forward
from reference.cores import blas_description, blas_limit
from reference.tiles import DEFAULT_TILE_SIZE, count_visible_pairs
from reference.tms import attention_flops

from . import RESULTS, markdown_table, torch_compare

FORWARD_TARGET, BACKWARD_TARGET = 0.70, 0.70     # DESIGN.md
RING_TARGET, RING_SIZES = 0.60, (1024, 2048)      # DESIGN.md: blocks of the sizes a ring computes
HEADS, TARGET_S, TARGET_D = 8, 8192, 64
MATMUL_N = 4096
BLAS_IDLE_S = 0.5      # OpenBLAS's idle threads spin for a while after a product: let them settle


@dataclass(frozen=True)
class Sweep:
    target_s: int = TARGET_S                       # the first row, held to the targets
    matmul_n: int = MATMUL_N                       # the product the rates are divided by
    repeats: int = 3                               # best of, at the target point
    repeats_other: int = 2                         # best of, elsewhere
    seq_lens: tuple = (1024, 2048, 4096, 8192)     # against S, D = 64, default tile
    head_dims: tuple = (32, 64, 128)               # against D, at S = sweep_s
    tiles: tuple = (128, 256, 512, (512, 256), (256, 512))   # against T, at S = sweep_s
    sweep_s: int = 4096
    memory_seq_lens: tuple = (1024, 2048, 4096, 8192)
    plain_s: int = 4096                            # the other step versions, for comparison


QUICK = Sweep()
FULL = Sweep(repeats=5, repeats_other=3, seq_lens=(1024, 2048, 4096, 8192, 16384),
             head_dims=(32, 64, 128, 256), sweep_s=8192,
             tiles=(64, 128, 256, 512, 1024, (512, 256), (256, 512), (1024, 256)),
             memory_seq_lens=(1024, 2048, 4096, 8192, 16384), plain_s=8192)


# -- measurements -----------------------------------------------------------

def matmul_rate(repeats, n=MATMUL_N):
    """Best float32 FLOP/s of an n-square product over `repeats` tries."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    a @ a                                                 # warm up the BLAS threads
    rate = 2 * n ** 3 / _best(lambda: a @ a, repeats)
    time.sleep(BLAS_IDLE_S)
    return rate


def _best(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@dataclass
class Problem:
    """One device holding all S tokens as one block (q_pos = k_pos = 0 .. S-1),
    in the step's own types, and the user-layout inputs for the float64 check."""
    queries: object
    block: object
    user: tuple          # q, k, v, dout (1, S, H, D) float32

    @property
    def pos(self):
        return self.queries.pos


def problem(S, D, heads=HEADS, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((1, S, heads, D), dtype=np.float32) for _ in range(4))
    pos = np.arange(S)
    return Problem(Queries.prepare(q, heads, pos, D ** -0.5), own_block(k, v, pos, 0), (q, k, v, do))


def forward(step, pb, tile):
    """One single-device forward: (out, lse, seconds spent in the step)."""
    acc = ForwardAcc.zeros(pb.queries.q)
    t = time.perf_counter()
    step.forward(acc, pb.queries, pb.block, causal=True, tile_size=tile)
    seconds = time.perf_counter() - t
    return (*finish_forward(acc), seconds)


def backward(step, pb, out, lse, tile):
    """One single-device backward: (dq, dk, dv, seconds spent in the step)."""
    q, k, v, do = pb.user
    rows = BackwardRows.prepare(q_from_heads(out), rows_from_heads(lse), do, k.shape[2], np.float32)
    grads = Grads(np.zeros_like(pb.queries.q), np.zeros_like(pb.block.k), np.zeros_like(pb.block.v))
    t = time.perf_counter()
    step.backward(grads, pb.queries, rows, pb.block, causal=True, tile_size=tile)
    return grads.dq, grads.dk, grads.dv, time.perf_counter() - t


CHECK_ROWS = 32     # query rows checked against float64 dense attention (dense on those rows only)


def check_error(pb, out, lse, dq, D):
    """Largest error of out and of dQ on a sample of query rows against float64
    dense attention, relative to the largest reference value."""
    q, k, v, do = (x.astype(np.float64) for x in pb.user)
    S = q.shape[1]
    rows = np.unique(np.linspace(0, S - 1, CHECK_ROWS).astype(int))
    ref_out, ref_lse = attention(q[:, rows], k, v, q_pos=rows, k_pos=np.arange(S))
    ref_dq = attention_backward(q[:, rows], k, v, ref_out, ref_lse, do[:, rows],
                                q_pos=rows, k_pos=np.arange(S))[0]
    got_out, got_dq = q_from_heads(out)[:, rows], q_from_heads(dq)[:, rows] * np.float32(D ** -0.5)
    errors = [np.abs(got_out - ref_out).max() / np.abs(ref_out).max(),
              np.abs(got_dq - ref_dq).max() / np.abs(ref_dq).max()]
    return max(float(e) if np.isfinite(e) else np.inf for e in errors)      # NaN counts as infinite


def kernel_point(S, D, tile, repeats, rate, step):
    """One row: seconds in the step (the O(S D) set-up and finish outside it),
    fraction of the matmul rate, and the error against float64 on sampled rows."""
    pb = problem(S, D)
    out, lse, _ = forward(step, pb, tile)                            # also warms up
    error = check_error(pb, out, lse, backward(step, pb, out, lse, tile)[0], D)
    t_f = min(forward(step, pb, tile)[-1] for _ in range(repeats))
    t_b = min(backward(step, pb, out, lse, tile)[-1] for _ in range(repeats))
    pairs = count_visible_pairs(pb.pos, pb.pos) * HEADS
    flops_f, flops_b = attention_flops(pairs, D), attention_flops(pairs, D, backward=True)
    return dict(S=S, D=D, tile=tile, step=f"step {step.label}", fwd_s=t_f, bwd_s=t_b, error=error,
                fwd=flops_f / t_f / rate, bwd=flops_b / t_b / rate,
                fwd_gflops=flops_f / t_f / 1e9, bwd_gflops=flops_b / t_b / 1e9)


def peak_memory(S, step, D=TARGET_D, tile=None):
    """Peak bytes NumPy allocates during one single-device forward, and backward,
    beyond their inputs (tracemalloc sees NumPy's array buffers): the whole
    pass, accumulators and outputs included."""
    pb = problem(S, D)
    peaks = []
    for run in ("forward", "backward"):
        if run == "backward":
            out, lse, _ = forward(step, pb, tile)
        tracemalloc.start()
        if run == "forward":
            forward(step, pb, tile)
        else:
            backward(step, pb, out, lse, tile)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    return peaks


def tile_costs(T=256, D=TARGET_D, repeats=20):
    """Seconds per visible pair of each operation of one T x T tile on one thread:
    what the NumPy step does (first rows) and the passes it avoids (last rows)."""
    rng = np.random.default_rng(0)
    q1 = rng.standard_normal((T, D + 1), dtype=np.float32) * 0.1
    k1 = rng.standard_normal((T, D + 1), dtype=np.float32) * 0.1
    s, s0 = np.empty((T, T), np.float32), rng.random((T, T), dtype=np.float32)
    inc, col = np.empty((T, D + 1), np.float32), rng.random((T, 1), dtype=np.float32)
    hidden = ~(np.arange(T)[:, None] >= np.arange(T)[None, :])
    ops = [("S - m = [Q, -m] [K, 1]^T (matmul)", lambda: np.matmul(q1, k1.T, out=s)),
           ("P = exp2(S - m)", lambda: np.exp2(s0, out=s)),
           ("[P V, rowsum P] = P [V, 1] (matmul)", lambda: np.matmul(s0, k1, out=inc)),
           ("mask (diagonal tiles only)", lambda: np.copyto(s, -np.inf, where=hidden)),
           ("avoided: rowmax(S)", lambda: s0.max(axis=1)),
           ("avoided: S - m (a pass)", lambda: np.subtract(s0, col, out=s)),
           ("avoided: exp instead of exp2", lambda: np.exp(s0, out=s)),
           ("avoided: rowsum(P) (a pass)", lambda: s0.sum(axis=1))]
    with blas_limit(1):
        return [(name, _best(fn, repeats) / (T * T)) for name, fn in ops]


# -- report -----------------------------------------------------------------

def cpu_model():
    """The CPU's model name (Linux), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def blas_name():
    """The BLAS that ran, with its kernels and threads (threadpoolctl)."""
    return blas_description()


# OpenBLAS reads these as it loads: some machines set them to older kernels (Haswell's on
# an AVX-512 CPU), which handicaps sgemm and every share of its rate measured against it
KERNEL_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def rerun_with_machine_kernels(module, argv, env=None):
    """Where OPENBLAS_CORETYPE or OPENBLAS_L2_SIZE is set, run ``python -m
    module argv`` again without both (for that command only, so that sgemm
    and the steps use the machine's own kernels) and return its exit status;
    None where neither is set."""
    env = os.environ if env is None else env
    found = [f"{name}={env[name]}" for name in KERNEL_ENV if name in env]
    if not found:
        return None
    print(f"  {module}: measuring with the machine's own BLAS kernels: running again without "
          f"{' and '.join(found)} (--as-set keeps them)", file=sys.stderr, flush=True)
    child = {k: v for k, v in env.items() if k not in KERNEL_ENV}
    return subprocess.call([sys.executable, "-m", module, *argv, "--unset", ",".join(found)], env=child)


def kernels_note(unset):
    """What the report says about the kernels' environment (`unset`: the --unset of the rerun)."""
    if unset:
        return f" (the machine's own kernels: {unset.replace(',', ' and ')} unset for this command)"
    set_ = [f"{name}={os.environ[name]}" for name in KERNEL_ENV if name in os.environ]
    return f" (**{' and '.join(set_)} set: not the machine's own kernels**)" if set_ else ""


def _tile_label(t):
    t = DEFAULT_TILE_SIZE if t is None else t
    return f"{t[0]}x{t[1]}" if isinstance(t, tuple) else f"{t}x{t}"


def _rows(points):
    return [[p["S"], p["D"], _tile_label(p["tile"]), p["step"],
             f"{p['fwd_s']:.3f}", f"{p['fwd_gflops']:.0f}", f"{p['fwd']:.0%}",
             f"{p['bwd_s']:.3f}", f"{p['bwd_gflops']:.0f}", f"{p['bwd']:.0%}", f"{p['error']:.1e}"]
            for p in points]


HEADERS = ["S", "D", "tile", "step", "fwd s", "fwd GFLOP/s", "fwd / matmul",
           "bwd s", "bwd GFLOP/s", "bwd / matmul", "error vs float64"]


def plot(points, memory, results_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    by_s = sorted((p for p in points if p["D"] == TARGET_D and p["tile"] is None and p["step"] == points[0]["step"]),
                  key=lambda p: p["S"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, target, label in (("fwd", FORWARD_TARGET, "forward"), ("bwd", BACKWARD_TARGET, "backward")):
        line, = ax.plot([p["S"] for p in by_s], [p[key] for p in by_s], "o-", label=label)
        ax.axhline(target, color=line.get_color(), ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("S (one device, causal)")
    ax.set_ylabel("useful FLOP/s / matmul FLOP/s")
    ax.set_ylim(0, 1)
    ax.set_title(f"step {points[0]['step']}, H={HEADS}, D={TARGET_D}, float32 (dotted: targets)")
    ax.legend()
    fig.tight_layout()
    eff = results_dir / "kernel_efficiency.png"
    fig.savefig(eff, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    seq = [s for s, _, _ in memory]
    ax.plot(seq, [f / 2 ** 20 for _, f, _ in memory], "o-", label="forward")
    ax.plot(seq, [b / 2 ** 20 for _, _, b in memory], "s-", label="backward")
    ax.plot(seq, [s * s * 4 * HEADS / 2 ** 20 for s in seq], "k:", label="S x S float32 scores, all heads")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("S")
    ax.set_ylabel("peak MiB allocated")
    ax.legend()
    fig.tight_layout()
    mem = results_dir / "kernel_memory.png"
    fig.savefig(mem, dpi=110)
    plt.close(fig)
    return [eff, mem]


def run(quick=True, *, results_dir=RESULTS, sweep=None, progress=None, step="auto", threads=None,
        torch_python=None, unset=""):
    """Measure `step` (a name of reference.steps, with `threads` workers where
    it takes them; default: one per core) and every other registered NumPy
    step at one point; torch's attention in `torch_python` (a Python with
    torch; default: this one, if it has torch). `unset`: what the command
    left out of the environment (`rerun_with_machine_kernels`). Returns
    (markdown, [png paths])."""
    sweep = sweep or (QUICK if quick else FULL)
    say = progress or (lambda msg: None)
    threads = os.cpu_count() if threads is None else threads
    main_step = _make_step(step, threads)
    say("matmul rate")
    rate = matmul_rate(sweep.repeats + 2, sweep.matmul_n)
    points = []
    say(f"target point S={sweep.target_s}, step {main_step!r}")
    points.append(kernel_point(sweep.target_s, TARGET_D, None, sweep.repeats, rate, main_step))
    for S in sweep.seq_lens:
        if S != sweep.target_s:
            say(f"S={S}")
            points.append(kernel_point(S, TARGET_D, None, sweep.repeats_other, rate, main_step))
    for D in sweep.head_dims:
        if D != TARGET_D or sweep.sweep_s not in sweep.seq_lens:
            say(f"D={D}")
            points.append(kernel_point(sweep.sweep_s, D, None, sweep.repeats_other, rate, main_step))
    for tile in sweep.tiles:
        if tile != DEFAULT_TILE_SIZE:
            say(f"tile {tile}")
            points.append(kernel_point(sweep.sweep_s, TARGET_D, tile, sweep.repeats_other, rate, main_step))
    for name in numpy_steps():
        other = _make_step(name, threads)
        if other.name != main_step.name:
            say(f"step {other!r}")
            points.append(kernel_point(sweep.plain_s, TARGET_D, None, 1, rate, other))
    rate_after = matmul_rate(sweep.repeats, sweep.matmul_n)   # the machine may have changed meanwhile
    versus = None
    if torch_compare.available(torch_python):
        say("torch's scaled_dot_product_attention, in its own process")
        versus = torch_compare.measure(sweep.target_s, HEADS, TARGET_D, threads, sweep.repeats, torch_python)
    say("one tile's operations, one thread")
    costs = tile_costs()
    say("memory")
    memory = [(S, *peak_memory(S, main_step)) for S in sweep.memory_seq_lens]
    pngs = plot(points, memory, results_dir)
    return report(sweep, rate, rate_after, points, costs, memory, pngs, main_step, versus, unset), pngs


def numpy_steps():
    """The registered steps that compute with NumPy, in version order."""
    return [name for name in steps.STEPS if "numpy" in steps.get(name).array_modules]


def _make_step(name, threads):
    step = steps.get(name, xp=np)
    return steps.get(step.name, workers=threads) if step.takes_workers else step


def blas_limit_note(env=None, cores=None):
    """A warning when the environment holds BLAS below the cores (the matmul
    rate is then a share of the machine, and the ratios are inflated), else ''."""
    env, cores = os.environ if env is None else env, os.cpu_count() if cores is None else cores
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) < cores:
            return (f"**{name}={value} was set:** the matmul rate above is that of {value} of the {cores} cores, "
                    "so the shares below are not of the machine's rate; run without it.")
    return ""


def report(sweep, rate, rate_after, points, costs, memory, pngs, step, versus=None, unset=""):
    target = points[0]
    blas_note = blas_limit_note()
    workers = getattr(step, "workers", 1)
    mode = {QUICK: "quick", FULL: "full"}.get(sweep, "custom")
    lines = [
        f"Made by `python -m bench.kernel{' --full' if mode == 'full' else ''}` ({mode} sizes) on "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}: "
        f"{os.cpu_count()} cores, {platform.machine()} ({cpu_model()}), BLAS {blas_name()}{kernels_note(unset)}; "
        f"step {step.label} (`--step {step.name} --threads {workers}`). numpy {np.__version__}. Best of {sweep.repeats} (target) or "
        f"{sweep.repeats_other} (others) repeats; the machine is shared, so timings are noisy "
        "and the ratios are what to read.",
        "",
        f"float32 matmul {sweep.matmul_n}x{sweep.matmul_n}: **{rate / 1e9:.0f} GFLOP/s** "
        f"(again after the sweep: {rate_after / 1e9:.0f} GFLOP/s). Useful FLOPs: 4 D (forward) and "
        f"10 D (backward) per visible pair per head; H = {HEADS}, causal, one device holding all S tokens. "
        "Timed: the step alone (`Step.forward`, `Step.backward`), as a ring round "
        "calls it; the O(S D) set-up (`ForwardAcc.zeros`, `BackwardRows`) and `finish_forward` are outside "
        "the timer. Before it is timed, each row's out and dQ are checked against float64 dense "
        f"attention on {CHECK_ROWS} sampled query rows (last column: largest error over the "
        "largest reference value).",
        "",
        *([blas_note, ""] if blas_note else []),
        f"**Target (S = {sweep.target_s}, D = {TARGET_D}, tile {_tile_label(None)}):** forward "
        f"{target['fwd']:.0%} of matmul (target {FORWARD_TARGET:.0%}: "
        f"{'met' if target['fwd'] >= FORWARD_TARGET else 'NOT met'}), backward {target['bwd']:.0%} "
        f"(target {BACKWARD_TARGET:.0%}: {'met' if target['bwd'] >= BACKWARD_TARGET else 'NOT met'}).",
        *_ring_sized(points),
        "",
        markdown_table(HEADERS, _rows(points), align="rrrl" + "r" * 7),
        "",
        _versus_torch(target, versus),
        "",
        "Steps (`reference.steps`): v1 is the readable step every array module runs (whole tiles "
        "of all heads, exp, row max, rescaling); v2 arranges the same tiles for a CPU (base 2, "
        "folded columns, one head at a time); v3 adds the lazy max, taller products and worker "
        "threads. The other versions are measured once, at the S of the last rows.",
        "",
        "What limits the ratio: one 256x256 tile (D = 64) on one thread, in nanoseconds per pair. "
        "The two products run at about the one-thread BLAS rate; what the step adds to them "
        "is one exp2 pass (and the mask on diagonal tiles):",
        "",
        markdown_table(["operation", "ns / pair"], [[n, f"{t * 1e9:.3f}"] for n, t in costs], align="lr"),
        "",
        "Peak memory allocated (tracemalloc) during one single-device forward and backward, "
        "beyond the inputs, against S (H = 8, D = 64, float32). It grows linearly; a single "
        "S x S float32 score matrix per head would be the last column:",
        "",
        markdown_table(["S", "forward MiB", "backward MiB", "forward / S (KiB)", "S x S x H MiB"],
                       [[S, f"{f / 2**20:.1f}", f"{b / 2**20:.1f}", f"{f / S / 1024:.2f}",
                         f"{S * S * 4 * HEADS / 2**20:.0f}"] for S, f, b in memory], align="rrrrr"),
    ]
    return "\n".join(lines) + "\n"


def _ring_sized(points):
    """The ring-sized blocks' line: c = 1024 and 2048 (as S, one block) against RING_TARGET."""
    rows = [p for p in points if p["S"] in RING_SIZES and p["D"] == TARGET_D and p["tile"] is None
            and p["step"] == points[0]["step"]]
    if not rows:
        return []
    met = all(p["fwd"] >= RING_TARGET and p["bwd"] >= RING_TARGET for p in rows)
    return ["", f"**Ring-sized blocks (c = {' and '.join(str(p['S']) for p in rows)}):** " + ", ".join(
        f"c = {p['S']}: forward {p['fwd']:.0%}, backward {p['bwd']:.0%}" for p in rows)
        + f" of matmul (target {RING_TARGET:.0%} each: {'met' if met else 'NOT met'})."]


def _versus_torch(target, versus):
    if versus is None:
        return ("torch is not installed, so the comparison with its CPU attention was not run "
                "(`--torch-python` names a Python that has it: `python -m venv /tmp/torchvenv && "
                "/tmp/torchvenv/bin/pip install torch==2.13.0`).")
    return (f"Against torch {versus['version']}'s `scaled_dot_product_attention` (causal, float32, the same "
            f"shapes and threads, in its own process, best of the same repeats): forward "
            f"{target['fwd_s']:.3f} s vs {versus['fwd_s']:.3f} s (**{target['fwd_s'] / versus['fwd_s']:.2f}x** "
            f"torch's time), backward {target['bwd_s']:.3f} s vs {versus['bwd_s']:.3f} s "
            f"(**{target['bwd_s'] / versus['bwd_s']:.2f}x**). Ours is the step alone; torch's includes its "
            "own set-up.")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.kernel", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="more sizes and repeats")
    ap.add_argument("--results", default=str(RESULTS), help="folder for the plots (default: bench/results)")
    ap.add_argument("--step", default="auto", choices=steps.names(),
                    help="the step measured at every point (default: %(default)s, the fastest for NumPy)")
    ap.add_argument("--threads", type=int, default=None,
                    help="worker threads of steps that take them (default: one per core)")
    ap.add_argument("--torch-python", default=None,
                    help="a Python with torch (torch==2.13.0, CPU) for the comparison (default: this one, if it has torch)")
    ap.add_argument("--as-set", action="store_true",
                    help=f"keep {' and '.join(KERNEL_ENV)} where set (default: run again without them)")
    ap.add_argument("--unset", default="", help=argparse.SUPPRESS)     # set by the rerun
    args = ap.parse_args(argv)
    if not args.as_set and not args.unset:
        status = rerun_with_machine_kernels("bench.kernel", sys.argv[1:] if argv is None else argv)
        if status is not None:
            sys.exit(status)
    note = blas_limit_note()
    if note:
        print(f"  kernel: {note}", file=sys.stderr, flush=True)
    text, pngs = run(quick=not args.full, results_dir=args.results, step=args.step, threads=args.threads,
                     torch_python=args.torch_python, unset=args.unset,
                     progress=lambda msg: print(f"  kernel: {msg}", file=sys.stderr, flush=True))
    print(text)
    for png in pngs:
        print(f"wrote {png}", file=sys.stderr)


if __name__ == "__main__":
    main()
