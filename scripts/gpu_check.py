"""make gpu-check: what a first GPU must show, in one run within a time cap (9 minutes), written to one Markdown file.

    python scripts/gpu_check.py                        # what `make gpu-check` runs (bash scripts/gpu_check.sh)
    python scripts/gpu_check.py --dry-run              # any machine: every step starts, nothing is measured
    python scripts/gpu_check.py --fake-gpu             # any machine: every step runs on a GPU made of NumPy
    python scripts/gpu_check.py --only kernels rates   # some steps
    bash scripts/gpu_check.sh --wheels DIR             # first install carried wheels (make gpu-wheels; no index)

For one machine with a CUDA 13 GPU, CuPy and mpi4py, and no package index:
nothing is installed here (scripts/gpu_check.sh installs carried wheels). A lent
GPU gives one command 10 minutes, so the steps come in the order a first run
needs them, what matters first and the long timings last, and each has a time
limit (`STEPS`) such that their sum, with the install and a margin, fits the
cap (--minutes, 9): every step gets its whole limit. Each runs in a process of
its own, killed when its time is up. After every step the results file
(default bench/results/gpu_check.md, which BENCHMARKS.md includes through
`bench.gpu_bench`) is written again and the step's section printed, so a run
stopped part-way leaves what it measured:

 1. environment   GPU, CUDA, CuPy, MPI library and its CUDA-awareness, mpiexec
                  (required: without it the ring tests cannot run), tools; one
                  kernel compiled by NVRTC and one cuBLAS matmul;
 2. compile       every fused kernel the check launches (version 2's forward and
                  both backward kernels, version 1), and the readable step's CuPy
                  kernels, compiled once in parallel into CuPy's cache on disk;
 3. kernels       the cheapest check of every kernel against the readable step:
                  version 1, version 2's forward and both backward kernels
                  (D = 64 and 128, float16 and bfloat16, GQA, masks);
 4. sanitizer     compute-sanitizer racecheck, synccheck and memcheck on small
                  launches of all three kernels of version 2 (a NaN in V, forward
                  and backward) and of version 1;
 5. race probe    the staged path with kernels, then copies, slowed down on purpose;
 6. GPU tests     tests/gpu/test_gpu.py -m gpu: 1, 2 and 4 MPI ranks sharing the
                  GPU, both transfer paths, the fused kernels; any skip fails;
 7. checked run   S = 65,536, Hq = 8, Hkv = 2, D = 128, float16, forward and
                  backward on 4 ranks, against float64 attention and gradients
                  computed on the GPU itself;
 8. command line  S = 16,384, D = 128, float16, GQA, backward, --check (rank 0
                  checks on the CPU in float64, so 2 query heads);
 9. trace         per round and rank: the step's GPU time and the GPU's idle
                  time before the next step, at 8 query heads: do transfers overlap?;
10. rates         the long timings: the readable step, versions 1 and 2 and
                  torch's flash attention, forward and backward, one block.

--fake-gpu runs the same steps, at small sizes, on tests/support/gpu/queued_device.py
(a GPU made of NumPy whose streams run later; the readable step stands in for
the fused kernels): it checks this script, and measures nothing. The GPU tests
skip there, so those two steps fail, as they must on a GPU where tests skip.

Exit status: 0 every step passed; 1 a step failed; 2 no GPU (nothing was checked).
"""

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))      # its step modules beside it

from gpu_check_base import (INSTALL_S, MARGIN_S, QUEUED_GPU, ROOT, WHOLE_S, Context, Result,  # noqa: E402,F401
                            fenced, run)
from gpu_check_kernels import (compile_builds, compile_kernels, environment, gpu_tests, kernel_checks,  # noqa: E402
                               one_fused_launch, race_probe, rates, sanitizer, warm_readable_step)
from gpu_check_rings import (checked_run, checked_run_worker, command_line, dense_reference_gpu,  # noqa: E402,F401
                             time_shifts, trace)

from mpi_impl.launch import find_mpiexec  # noqa: E402

OUT = ROOT / "bench" / "results" / "gpu_check.md"


# -- the run ------------------------------------------------------------------------------------

# name: (step, short name for --only, limit in seconds), in the order a first run needs them
STEPS = {"environment": (environment, "env", 30), "compile": (compile_kernels, "compile", 45),
         "kernels": (kernel_checks, "kernels", 45), "sanitizer": (sanitizer, "sanitizer", 75),
         "race probe": (race_probe, "race", 25), "GPU tests": (gpu_tests, "tests", 75),
         "checked run": (checked_run, "checked", 50), "command line": (command_line, "cli", 40),
         "trace": (trace, "trace", 40), "rates": (rates, "rates", 50)}
SHORT = {name: short for name, (_, short, _) in STEPS.items()}


def plan(minutes):
    """The steps' limits in their order, and their sum against what the cap leaves them."""
    budget = minutes * 60 - MARGIN_S - INSTALL_S
    total = sum(limit for _, _, limit in STEPS.values())
    steps = ", ".join(f"{name} {limit} s" for name, (_, _, limit) in STEPS.items())
    return (f"Plan: {steps}; {total} s in all, {'within' if total <= budget else 'OVER'} the {budget:.0f} s "
            f"the cap of {minutes * 60:.0f} s leaves after {INSTALL_S} s for installing wheels and "
            f"{MARGIN_S} s kept back.")


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
    Path(path).write_text(head + "\n" + ctx.notes.get("plan", "") + "\n\n" + "\n".join(sections))
    return head


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python scripts/gpu_check.py", description=__doc__.split("\n\n")[0],
                                 epilog="Steps: " + ", ".join(f"{s} ({n})" for n, s in SHORT.items()))
    ap.add_argument("--dry-run", action="store_true", help="start every step without a GPU; measure nothing")
    ap.add_argument("--fake-gpu", action="store_true",
                    help="run every step at small sizes on a GPU made of NumPy (tests/support/gpu/queued_device.py): "
                         "checks this script, measures nothing")
    ap.add_argument("--out", default=str(OUT), help="the Markdown results file (default: %(default)s)")
    ap.add_argument("--only", nargs="+", choices=list(SHORT.values()), help="run only these steps")
    ap.add_argument("--mpiexec", help="the launcher (default: beside python, else on PATH)")
    ap.add_argument("--minutes", type=float, default=WHOLE_S / 60,
                    help="the whole check's time cap, the install of carried wheels included (default: %(default)g): "
                         "no step starts or runs past it")
    ap.add_argument("--started", type=float, default=None,
                    help="when the whole check started (time.time(); default: now): --minutes from then")
    ap.add_argument("--step", choices=list(SHORT.values()), help=argparse.SUPPRESS)       # run one step here
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    ap.add_argument("--one-fused-launch", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compile-builds", help=argparse.SUPPRESS)        # indices into gpu_check_kernels.kernel_builds()
    ap.add_argument("--warm-readable", action="store_true", help=argparse.SUPPRESS)
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
    if args.compile_builds:
        compile_builds([int(i) for i in args.compile_builds.split(",")])
        return 0
    if args.warm_readable:
        warm_readable_step()
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
                  deadline=started + args.minutes * 60 - MARGIN_S)
    reason = None if ctx.dry or ctx.fake else gpu_missing(ctx)
    if reason:
        print(f"gpu-check: no usable GPU here, nothing was checked: {reason}", file=sys.stderr)
        return 2
    names = [n for n in STEPS if not args.only or SHORT[n] in args.only]
    ctx.notes["plan"] = plan(args.minutes)
    print(ctx.notes["plan"], flush=True)
    sections, failed = [], []
    for i, name in enumerate(names):
        t0 = time.time()
        print(f"== {name} ({t0 - started:.0f} s; {ctx.left():.0f} s left)", flush=True)
        limit = min(STEPS[name][2], ctx.left())
        if limit < 10:
            result = Result(False, f"not started: the whole run's {args.minutes * 60:.0f} s are spent "
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
