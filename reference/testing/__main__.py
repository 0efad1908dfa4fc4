"""The kit's command line.

    python -m reference.testing measure --examples 400      # the error model's line, measured
"""

import argparse
import sys

from .measure import measure
from .oracle import GROWTH, ErrorModel


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m reference.testing",
                                 description="The conformance kit's command line.")
    commands = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    m = commands.add_parser("measure", help="the largest error / tolerance of correct implementations, per dtype",
                            description="Measure the error model: the largest error / tolerance of correct "
                                        "implementations (the dense oracle at the dtype, the virtual ring), "
                                        "per dtype; 1 is the line.")
    m.add_argument("--examples", type=int, default=400, help="random cases per dtype (default 400)")
    m.add_argument("--seed", type=int, default=0, help="NumPy seed of the cases (default 0)")
    m.add_argument("--growth", type=float, default=GROWTH, help=f"the error model's growth (default {GROWTH:g})")
    return ap


def run_measure(args):
    print(f"{'dtype':<8} {'dense oracle':>13} {'virtual ring':>13}   (max error / tolerance, growth = {args.growth:g})")
    for name, (dense, ring) in measure(args.examples, args.seed, model=ErrorModel(args.growth)).items():
        print(f"{name:<8} {dense:>13.3g} {ring:>13.3g}")
    return 0


def main(argv=None):
    args = build_parser().parse_args(argv)
    return {"measure": run_measure}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
