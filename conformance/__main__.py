"""Hold other projects' ring attention against the oracle and write CONFORMANCE.md and its pages.

    make conformance                                       # installs the peers extra, runs them all
    conformance/.venv/bin/python -m conformance            # every peer: stores each run, renders CONFORMANCE.md
    conformance/.venv/bin/python -m conformance --peer ring-flash-attn/zigzag --examples 10
    conformance/.venv/bin/python -m conformance --render   # CONFORMANCE.md and pages/ from the stored runs
    conformance/.venv/bin/python -m conformance --missing  # only the runs not stored yet
    conformance/.venv/bin/python -m conformance --repro ring-attention-pytorch/striped backward "Case(...)"

The options are checked before any peer is imported (the peers need torch and
the `peers` extra; --help needs neither); the runs are conformance/run.py's.
"""

import argparse
import sys
from pathlib import Path

from reference.testing.harness.torch import close_worlds

from . import results, run

EXTRA = ("the peers need the `peers` extra (torch and the peers' packages): make conformance, "
         "or pip install -e '.[peers]'")


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m conformance", description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=40, help="hypothesis examples per world size of each run")
    ap.add_argument("--peer", action="append", metavar="KEY",
                    help="only this peer (repeatable; a key as ring-flash-attn/zigzag, as conformance/results/ "
                         "names its files with '__' for '/')")
    ap.add_argument("--dtype", action="append", choices=list(results.DTYPE_ORDER), help="only these dtypes (repeatable)")
    ap.add_argument("--masks", action="append", choices=list(run.MASK_SETS), help="only these mask sets (repeatable)")
    ap.add_argument("--pass", dest="passes", action="append", choices=list(results.PASSES),
                    help="only these passes (repeatable)")
    ap.add_argument("--results", default=str(results.RESULTS), help="the results store (a folder of JSON files)")
    ap.add_argument("--out", default=str(results.HERE / "CONFORMANCE.md"),
                    help=f"the summary page ('-': stdout); the library pages go to {run.page.PAGES}/ beside it")
    ap.add_argument("--render", action="store_true", help="only render the pages from the stored runs")
    ap.add_argument("--missing", action="store_true", help="only the runs not stored yet")
    ap.add_argument("--accumulate", choices=list(results.DTYPE_ORDER),
                    help="hold every peer to this accumulation dtype's line instead of its own")
    ap.add_argument("--repro", nargs=3, metavar=("PEER", "PASS", "CASE"), help="check one case and print the result")
    ap.add_argument("--explain-dkv", action="store_true", help="check the ring-attention-pytorch dK/dV finding")
    ap.add_argument("--explain-merge", action="store_true", help="check the float32 sigmoid-merge finding")
    return ap


def checked(ap, args):
    """The options a parser cannot check alone, each a usage error naming it, before any run."""
    if args.examples < 1:
        ap.error(f"--examples must be at least 1, got {args.examples}")
    if not Path(args.results).is_dir():
        ap.error(f"--results: no folder {args.results!r}")
    if args.out != "-" and not Path(args.out).resolve().parent.is_dir():
        ap.error(f"--out: no folder {str(Path(args.out).resolve().parent)!r} to write {args.out!r} in")
    if args.repro and args.repro[1] not in results.PASSES:
        ap.error(f"--repro: the pass must be one of {', '.join(results.PASSES)}, got {args.repro[1]!r}")
    try:
        peers = run.peers()
    except ImportError as e:
        ap.error(f"{EXTRA} ({e})")
    unknown = [key for key in (args.peer or []) + ([args.repro[0]] if args.repro else []) if key not in peers]
    if unknown:
        ap.error(f"--peer / --repro: no peer {', '.join(map(repr, unknown))} (the peers: {', '.join(sorted(peers))})")
    return args


def main(argv=None):
    ap = build_parser()
    args = checked(ap, ap.parse_args(argv))
    if args.accumulate:
        run.hold_to(args.accumulate)
    try:
        if args.repro:
            return run.repro(*args.repro)
        if args.explain_dkv:
            return run.explain_dkv()
        if args.explain_merge:
            return run.explain_merge()
        if not args.render:
            run.run_plan(run.plan(args), args.examples, args.results)
    finally:
        close_worlds()
    print(run.write_pages(args.results, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
