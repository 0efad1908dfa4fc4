"""Kernel efficiency and memory of one device: the step versions against a plain matmul.

docs/design.md's speed target for the per-device step (`reference/step.py`): at S = 8192,
Hq = 8, D = 64, causal, float32, one device holding the whole sequence as one block
(q_pos = k_pos = 0 .. S-1), the forward and the backward each reach 70% of the same
machine's float32 matmul rate on useful FLOPs:

    forward   4 D FLOPs per visible (query, key) pair per head   (S = QK^T, O += PV)
    backward 10 D FLOPs per visible pair per head                 (S, dV, dP, dQ, dK)
    visible pairs, causal: S (S + 1) / 2

The matmul rate is a 4096 x 4096 @ 4096 x 4096 float32 product, timed in the same run with
the same BLAS threads; what is timed is the step (`Step.forward`, `Step.backward`) as a
ring round calls it, each figure the best of a few repeats. Also measured: other S, D and
tiles, every registered NumPy step version side by side, what one tile's operations cost
on one thread, and the peak memory against S, which grows linearly (no S x S array).

Letters: S tokens, H heads, D head dim, T tile size (tq x tk).

    python -m bench.kernel                 # quick: about a minute on 2 idle cores
    python -m bench.kernel --full          # more sizes and repeats
    python -m bench.kernel --step v2 --threads 1   # one version; checked against float64 first
    python -m bench.kernel --torch-python /tmp/torchvenv/bin/python   # with torch's attention beside it
    python -m bench.run --only kernel      # into BENCHMARKS.md

Where OPENBLAS_CORETYPE or OPENBLAS_L2_SIZE is set (another CPU's kernels), the
command runs itself again without both (``--as-set`` keeps them), and the report
names the kernels that ran.
"""

import argparse
import datetime
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reference import steps, usage
from reference.tiles import DEFAULT_TILE_SIZE


from . import RESULTS, markdown_table, torch_compare
from .kernel_timing import CHECK_ROWS, HEADS, TARGET_D, TARGET_S, kernel_point, peak_memory, tile_costs
from .machine import (KERNEL_ENV, MATMUL_N, blas_limit_note, blas_name, cpu_name, kernels_note,
                      matmul_rate, rerun_with_machine_kernels)

FORWARD_TARGET, BACKWARD_TARGET = 0.70, 0.70     # docs/design.md
RING_TARGET, RING_SIZES = 0.60, (1024, 2048)      # docs/design.md: blocks of the sizes a ring computes


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
TINY = Sweep(target_s=512, matmul_n=256, repeats=1, repeats_other=1, seq_lens=(256, 512), head_dims=(16,),
             tiles=((64, 32),), sweep_s=256, memory_seq_lens=(256, 512), plain_s=256)   # seconds: the command checked
FULL = Sweep(repeats=5, repeats_other=3, seq_lens=(1024, 2048, 4096, 8192, 16384),
             head_dims=(32, 64, 128, 256), sweep_s=8192,
             tiles=(64, 128, 256, 512, 1024, (512, 256), (256, 512), (1024, 256)),
             memory_seq_lens=(1024, 2048, 4096, 8192, 16384), plain_s=8192)


# -- report -----------------------------------------------------------------

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
    text = report(sweep, rate, rate_after, points, costs, memory, pngs, main_step, versus=versus, unset=unset)
    return text, pngs, headlines(points, sweep)


def numpy_steps():
    """The registered steps that compute with NumPy, in version order."""
    return [name for name in steps.STEPS if "numpy" in steps.get(name).array_modules]


def _make_step(name, threads):
    step = steps.get(name, xp=np)
    return steps.get(step.name, workers=threads) if step.takes_workers else step


def report(sweep, rate, rate_after, points, costs, memory, pngs, step, *, versus=None, unset=""):
    target = points[0]
    blas_note = blas_limit_note()
    workers = getattr(step, "workers", 1)
    mode = {QUICK: "quick", FULL: "full", TINY: "tiny"}.get(sweep, "custom")
    lines = [
        f"Made by `python -m bench.kernel{f' --{mode}' if mode in ('full', 'tiny') else ''}` ({mode} sizes) on "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}: "
        f"{os.cpu_count()} cores, {platform.machine()} ({cpu_name()}), BLAS {blas_name()}{kernels_note(unset)}; "
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


def headlines(points, sweep):
    """[(what, measured, goal)]: the target point's shares of the matmul rate, and the ring-sized blocks'."""
    target = points[0]
    lines = [(f"{target['step']}, forward, S = {sweep.target_s}: share of the matmul rate",
              f"{target['fwd']:.0%}", f">= {FORWARD_TARGET:.0%}"),
             (f"{target['step']}, backward, S = {sweep.target_s}: share of the matmul rate",
              f"{target['bwd']:.0%}", f">= {BACKWARD_TARGET:.0%}")]
    for p in points[1:]:
        if p["S"] in RING_SIZES and p["D"] == TARGET_D and p["tile"] is None and p["step"] == target["step"]:
            lines.append((f"a ring-sized block, c = {p['S']}: forward / backward share of the matmul rate",
                          f"{p['fwd']:.0%} / {p['bwd']:.0%}", f">= {RING_TARGET:.0%}"))
    return lines


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
    sizes = ap.add_mutually_exclusive_group()
    sizes.add_argument("--full", action="store_true", help="more sizes and repeats")
    sizes.add_argument("--tiny", action="store_true",
                       help="the smallest sizes, a few seconds: the command checked end to end, its figures meaningless")
    ap.add_argument("--results", type=usage.output_folder, default=str(RESULTS),
                    help="folder for the plots (default: bench/results)")
    ap.add_argument("--step", default="auto", choices=steps.names(),
                    help="the step measured at every point (default: %(default)s, the fastest for NumPy)")
    ap.add_argument("--threads", type=usage.count, default=None,
                    help="worker threads of steps that take them (default: one per core)")
    ap.add_argument("--torch-python", default=None,
                    help="a Python with torch (torch==2.13.0, CPU) for the comparison (default: this one, if it has torch)")
    ap.add_argument("--as-set", action="store_true",
                    help=f"keep {' and '.join(KERNEL_ENV)} where set (default: run again without them)")
    ap.add_argument("--unset", default="", help=argparse.SUPPRESS)     # set by the rerun
    args = ap.parse_args(argv)
    if args.torch_python is not None and not (shutil.which(args.torch_python)
                                              and torch_compare.available(args.torch_python)):
        ap.error(f"--torch-python {args.torch_python}: not a Python that can import torch")
    if not args.as_set and not args.unset:
        status = rerun_with_machine_kernels("bench.kernel", sys.argv[1:] if argv is None else argv)
        if status is not None:
            sys.exit(status)
    note = blas_limit_note()
    if note:
        print(f"  kernel: {note}", file=sys.stderr, flush=True)
    text, pngs, _ = run(quick=not args.full, sweep=TINY if args.tiny else None, results_dir=args.results,
                        step=args.step, threads=args.threads, torch_python=args.torch_python, unset=args.unset,
                        progress=lambda msg: print(f"  kernel: {msg}", file=sys.stderr, flush=True))
    print(text)
    for png in pngs:
        print(f"wrote {png}", file=sys.stderr)


if __name__ == "__main__":
    main()
