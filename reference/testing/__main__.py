"""The kit's command line.

    python -m reference.testing check mymodule:MyRing --world-sizes 2,3,4   # hold a ring against the oracle
    python -m reference.testing check mymodule:MyRing --repro "Case(...)"   # replay one case
    python -m reference.testing measure --examples 400      # the error model's line, measured

`check` exits 0 when the ring agrees, 1 on a disagreement (printed: the
smallest case, the first bad element, the command that replays it), 2 on a
usage error.
"""

import argparse
import shlex
import sys

from .. import usage
from .cases import MAX_SEQ, _hypothesis, parse_case
from .check import (Progress, check_adapter, check_one, load_adapter, make_plan, markdown, repro_command,
                    summary)
from .measure import measure
from .oracle import GROWTH, ErrorModel

CHECK_EPILOG = """\
ADAPTER is an object with the kit's Adapter protocol (a subclass of
reference.testing.Adapter; the harnesses' JaxAdapter and the PyTorch one are),
or a class made with no arguments. For each world size, hypothesis draws up to
--examples cases among the layouts, dtypes and masks the adapter declares
(narrowed by the options) and shrinks the first disagreement to the smallest
case it finds. Exit status: 0 agrees, 1 disagrees, 2 usage error (or no case drawn that
the adapter takes).

examples:
  python -m reference.testing check examples/jax_ring.py:JaxRing --world-sizes 2,4
  python -m reference.testing check mymodule:MyRing --dtypes bfloat16 --masks causal,window
  python -m reference.testing check mymodule:MyRing --repro "Case(layout='striped', ...)"
"""


def names(text):
    """"a,b, c" -> ("a", "b", "c")."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


def sizes(text):
    try:
        found = tuple(int(x) for x in names(text))
    except ValueError:
        found = ()
    if not found or min(found) < 1:
        raise argparse.ArgumentTypeError(f"expected integers like 2,3,4 (world sizes, each at least 1), got {text!r}")
    return found


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m reference.testing",
                                 description="The conformance kit's command line.")
    commands = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = commands.add_parser("check", help="hold a ring attention (an adapter) against the float64 oracle",
                            description="Hold MODULE:ADAPTER's ring attention against the float64 oracle "
                                        "on cases hypothesis draws, and shrink a disagreement to its "
                                        "smallest case.",
                            epilog=CHECK_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("adapter", metavar="MODULE:ADAPTER",
                   help="a module (mymodule) or file (path/to/ring.py), a colon, the adapter's name")
    c.add_argument("--examples", type=usage.count, default=100, help="cases per world size (default 100)")
    c.add_argument("--world-sizes", type=sizes, default=None, metavar="N,N,...",
                   help="world sizes (default: the adapter's world_sizes)")
    c.add_argument("--dtypes", type=names, default=None, metavar="NAME,...",
                   help="float64, float32, float16, bfloat16 (default: the adapter's dtypes)")
    c.add_argument("--masks", type=names, default=None, metavar="NAME,...",
                   help="causal, full, window, cu_seqlens, segment_ids, padding; causal or full among them "
                        "(default: the adapter's masks)")
    c.add_argument("--layouts", type=names, default=None, metavar="NAME,...",
                   help="contiguous, striped, zigzag (default: the adapter's layouts)")
    c.add_argument("--max-seq", type=usage.count, default=MAX_SEQ, help=f"the longest sequence drawn (default {MAX_SEQ})")
    c.add_argument("--shrink-seconds", type=usage.seconds, default=120,
                   help="how long to shrink a disagreement before printing the smallest so far (default 120)")
    c.add_argument("--shapes", type=usage.natural, default=None, metavar="K",
                   help="draw each world size's shapes (B, S, heads, D, tile, scale) from K, masks and inputs "
                        "still varying: a ring that compiles per shape compiles K times, not once a case "
                        "(default: the adapter's shape_pool, 4 for the JAX harness; 0: each case its own)")
    c.add_argument("--seed", type=usage.natural, default=0, help="hypothesis's seed (default 0: the same run each time)")
    c.add_argument("--markdown", type=usage.output_file, metavar="FILE", help="also write the verdict to FILE as Markdown")
    c.add_argument("--repro", metavar="CASE", help="run this one case (the line a disagreement prints) and stop")
    c.add_argument("--quiet", action="store_true", help="no progress display")
    c.set_defaults(parser=c)
    m = commands.add_parser("measure", help="the largest error / tolerance of correct implementations, per dtype",
                            description="Measure the error model: the largest error / tolerance of correct "
                                        "implementations (the dense oracle at the dtype, the virtual ring), "
                                        "per dtype; 1 is the line.")
    m.add_argument("--examples", type=usage.count, default=400, help="random cases per dtype (default 400)")
    m.add_argument("--seed", type=usage.natural, default=0, help="NumPy seed of the cases (default 0)")
    m.add_argument("--growth", type=usage.rate, default=GROWTH, help=f"the error model's growth (default {GROWTH:g})")
    return ap


def run_check(args, ap):
    try:
        adapter = load_adapter(args.adapter)
        case = parse_case(args.repro) if args.repro else None
        if not case:
            _hypothesis()                  # ImportError with the extra to install, before any work
        plan = None if case else make_plan(adapter, world_sizes=args.world_sizes, layouts=args.layouts,
                                           dtypes=args.dtypes, masks=args.masks, examples=args.examples,
                                           seed=args.seed, max_seq=args.max_seq,
                                           shrink_seconds=args.shrink_seconds, shapes=args.shapes)
    except (ValueError, ImportError) as e:
        ap.error(str(e))                   # exit 2
    try:
        return replay(adapter, case, ap) if case else check_plan(adapter, plan, args)
    finally:
        if callable(getattr(adapter, "close", None)):
            adapter.close()


def replay(adapter, case, ap):
    reason = adapter.supports(case)
    if reason:
        ap.error(f"{adapter.name} does not take this case: {reason}")
    message = check_one(adapter, case)
    print(message or f"{adapter.name} agrees on\n  {case!r}")
    return 1 if message else 0


def check_plan(adapter, plan, args):
    verdict = check_adapter(adapter, plan, None if args.quiet else Progress())
    print(summary(verdict))
    repro = None
    if not verdict.agrees:
        repro = repro_command(args.adapter, verdict.case)
        print(verdict.message)
        print(f"replay it: {repro}")
    if args.markdown:
        command = "python -m reference.testing " + " ".join(shlex.quote(a) for a in args.argv)
        with open(args.markdown, "w") as f:
            f.write(markdown(verdict, command, repro))
    if not verdict.examples:
        return 2                    # nothing checked: the options leave nothing the adapter takes
    return 0 if verdict.agrees else 1


def run_measure(args):
    print(f"{'dtype':<8} {'dense oracle':>13} {'virtual ring':>13}   (max error / tolerance, growth = {args.growth:g})")
    for name, (dense, ring) in measure(args.examples, args.seed, model=ErrorModel(args.growth)).items():
        print(f"{name:<8} {dense:>13.3g} {ring:>13.3g}")
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.command == "check":
        args.argv = argv
        return run_check(args, args.parser)
    return run_measure(args)


if __name__ == "__main__":
    sys.exit(main())
