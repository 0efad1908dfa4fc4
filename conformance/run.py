"""The runner: other projects' ring attention held against the oracle, run by run, stored as it goes.

    conformance/.venv/bin/python -m conformance --peer ring-flash-attn/zigzag --examples 10   # (__main__.py)

For each peer (conformance.PEERS), each dtype it takes, each mask set (causal /
full; a sliding window; packed documents; padding: the last three where the
peer takes them) and each pass (forward: out and lse; backward:
dq, dk, dv from autograd of sum(out * dout)), hypothesis draws cases
(`reference.testing.cases`, the peer's layout and positions, N in WORLD_SIZES)
and `check_ring_attention` holds every rank's results against the float64
oracle. A disagreement is shrunk to its smallest case (hypothesis replays the
minimal example last, so the last failure seen is it); what explains it is
looked up in conformance/findings.py (written by reading the peer's code; "not
classified" when none matches). Each run is stored in conformance/results/ as it
finishes (conformance/results.py) and the pages are rendered from every stored run
(conformance/page.py: CONFORMANCE.md, and one page per library in conformance/pages/),
so a run of some peers changes only their cells. Examples are drawn from a
fixed seed: the same versions give the same report.
"""

import argparse
import copy
import datetime
import functools
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from reference.testing import Case, cases, check_ring_attention, parse_case
from reference.testing.compare import where_raised
from reference.testing.harness.torch import close_worlds

from . import page, results
from .results import PASSES, WORLD_SIZES, Peer, Run

LIBRARIES = ("striped-attention", "torch", "numpy", "ml_dtypes", "hypothesis", "ring-attention-pytorch",
             "ring-flash-attn", "axolotl-ringmaster", "yunchang", "transformers", "jax", "flax")
# The matrix's mask columns: the kit's masks a set adds to causal / full, and what a case of it carries
# (cases without it are drawn again). Each runs in every dtype the peer takes.
MASK_SETS = {"causal / full": ((), lambda case: True),
             "window": (("window",), lambda case: case.window is not None),
             "documents": (("cu_seqlens",), lambda case: case.cu_seqlens is not None and len(case.cu_seqlens) > 2),
             "padding": (("padding",), lambda case: case.padded > case.S)}


def peers():
    """Every adapter by key (`conformance.PEERS`, built on first use: it imports torch
    and the peers' packages, which the command line's --help does not need)."""
    from . import PEERS
    return PEERS


FLAKY = ("\n  (not shrunk: hypothesis ran this case again and it agreed, so the result depends on what the "
         "ranks ran before it; the command below may agree)")


class Check:
    """What hypothesis calls with each drawn case: counts it in `run` and keeps the
    last failure (hypothesis replays the smallest one last)."""

    def __init__(self, peer, run):
        self.peer, self.run, self.adapter = peer, run, for_pass(peer, run.phase)

    def __call__(self, case):
        from hypothesis import reject
        if self.peer.supports(case) or not MASK_SETS[self.run.masks][1](case):
            reject()                   # not counted: hypothesis draws another
        self.run.examples += 1
        self.run.world_sizes[case.n_devices] += 1
        try:
            check_ring_attention(self.adapter, case, names=PASSES[self.run.phase], usage=self.run.usage)
        except AssertionError as e:
            self.run.failure = (case, str(e))
            raise
        except Exception as e:          # noqa: BLE001 - a peer that raises disagrees too
            if type(e).__name__ in ("UnsatisfiedAssumption",):
                raise
            self.run.failure = (case, f"raised {where_raised(str(e))}")
            raise


def _fixed_dtype(acc, dtype):
    return acc


def hold_to(accumulate):
    """Hold every peer to `accumulate`'s line instead of its own (--accumulate)."""
    for peer in peers().values():
        peer.accumulate_dtype = functools.partial(_fixed_dtype, np.dtype(accumulate))      # (picklable)


def for_pass(peer, phase):
    """The peer as run for one pass: without its backward for the forward pass
    (so that a backward that raises does not fail the forward)."""
    adapter = copy.copy(peer)
    adapter.backward = phase == "backward"
    return adapter


def mask_sets(peer):
    """The mask sets a peer runs: causal / full always; a window, documents,
    padding where it takes them."""
    return [name for name, (extra, _) in MASK_SETS.items() if set(extra) <= set(peer.masks)]


def strategy(peer, dtype, n, masks):
    plain = tuple(m for m in ("causal", "full") if m in peer.masks)
    extra = MASK_SETS[masks][0]
    return cases(dtypes=(dtype,), layouts=peer.layouts, devices=(n,), max_seq=48, max_head_dim=8, masks=plain + extra,
                 # (the kit draws padding only where documents need no multiple: here none are drawn with it)
                 document_multiple=peer.document_multiple if "cu_seqlens" in extra else 1,
                 head_multiple=peer.head_multiple, replicates_kv_heads=peer.replicates_kv_heads,
                 max_batch=getattr(peer, "max_batch", 2), shapes=getattr(peer, "shape_pool", 0),
                 keep=lambda case: not peer.supports(case))     # (a compiled ring compiles once a shape)


def run_one(peer, dtype, masks, phase, examples, progress=lambda n, checked: None):
    """`examples` cases on each world size in turn, up to the first that disagrees
    (its smallest case is then on the smallest world size that shows it);
    `progress(n, checked)` after each world size that agrees."""
    from hypothesis import HealthCheck, Phase, given, seed, settings
    run = Run(Peer.of(peer), np.dtype(dtype).name, masks, phase, asked=examples,
              date=datetime.date.today().isoformat(), versions=versions(peer))
    check, start = Check(peer, run), time.monotonic()
    for n in WORLD_SIZES:
        # seed(0), not derandomize=True: as reproducible, and hypothesis shrinks a derandomized failure only part way
        @seed(0)
        # (no explain phase: it reruns a shrunk failure dozens of times to say which part matters)
        @settings(max_examples=examples, deadline=None, database=None, print_blob=False,
                  phases=[p for p in Phase if p.name != "explain"],
                  suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
        @given(strategy(peer, dtype, n, masks))
        def body(case):
            check(case)

        try:
            body()
        except Exception as e:         # noqa: BLE001 - the failure is recorded in run.failure
            if run.failure is None:
                run.failure = (None, traceback.format_exc())
            elif "Flaky" in type(e).__name__:      # hypothesis ran the failing case again and it agreed
                run.failure = (run.failure[0], run.failure[1] + FLAKY)
            break
        progress(n, run.world_sizes[n])
    run.seconds = time.monotonic() - start
    return run


def versions(peer):
    """The versions a run of `peer` names: the common packages, its library, the Python and platform."""
    from importlib.metadata import PackageNotFoundError, version
    found = {}
    for name in LIBRARIES:          # (a run of some peers alone, --peer, needs only theirs)
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    if hasattr(peer, "version"):    # a peer that is not an installed package (bpt.py, a file at a commit)
        found[peer.library] = peer.version
    return {**found, "python": platform.python_version(), "platform": f"{platform.machine()} {platform.system()}"}


def repro(key, phase, case_text):
    case = parse_case(case_text)
    try:
        check_ring_attention(for_pass(peers()[key], phase), case, names=PASSES[phase])
    except AssertionError as e:
        print(e)
        return 1
    except Exception as e:          # noqa: BLE001 - a peer that raises disagrees
        print(f"{peers()[key].name} on {case!r} ({phase}): raised {where_raised(str(e))}")
        return 1
    print(f"{peers()[key].name} agrees with the oracle on {case!r} ({phase})")
    return 0


def explain_dkv():
    """Checks the ring-attention-pytorch finding: rank r's dk is dK + dV of its
    own keys, its dv is dK + dV of rank r + 1's keys."""
    from reference.testing import make_shards, oracle
    peer = peers()["ring-attention-pytorch/contiguous"]
    for n in (2, 3):
        case = Case("contiguous", n, 1, 2 * n, 2, 1, 3, None, True, None, np.float32, "gaussian", 0)
        pos = peer.positions(case)
        got = peer.run(case, make_shards(case, pos))
        both = oracle(case)["dk"] + oracle(case)["dv"]
        same = dict(rtol=1e-5, atol=1e-6)
        for r in range(n):
            own, right = np.take(both, pos[r], axis=1), np.take(both, pos[(r + 1) % n], axis=1)
            print(f"N={n} rank {r}: dk == dK + dV of its own keys: {np.allclose(got[r]['dk'], own, **same)}; "
                  f"dv == dK + dV of rank {(r + 1) % n}'s keys: {np.allclose(got[r]['dv'], right, **same)}")
    return 0


def explain_merge():
    """Checks the sigmoid-merge finding: each float32 case over the line agrees
    once the merge is the weighted sum (conformance/weighted_merge.py)."""
    from reference.testing import FORWARD
    from .weighted_merge import CASES
    for which, label in ((0, "as shipped (sigmoid merge)"), (1, "weighted-sum merge")):   # (shipped first)
        for key, weighted, text in CASES:
            adapter, case = for_pass((peers()[key], weighted)[which], "forward"), parse_case(text)
            try:
                check_ring_attention(adapter, case, names=FORWARD)
                verdict = "agrees"
            except AssertionError as e:
                verdict = str(e).strip().splitlines()[-1].strip()
            print(f"{key} on {case!r}, {label}: {verdict}")
    return 0


def plan(args):
    """(peer, dtype, mask set, pass) of every run the options ask for."""
    runs = [(peers()[key], dtype, masks, phase) for key in args.peer or peers() for dtype in peers()[key].dtypes
            if not args.dtype or np.dtype(dtype).name in args.dtype
            for masks in mask_sets(peers()[key]) if not args.masks or masks in args.masks
            for phase in PASSES if not args.passes or phase in args.passes]
    if args.missing:
        stored = {(run.peer.key, *run.cell) for run in results.load(args.results)}
        runs = [r for r in runs if (r[0].key, np.dtype(r[1]).name, r[2], r[3]) not in stored]
    return runs


def run_plan(runs, examples, directory):
    """Each run in turn, stored as it finishes, with a progress line: which run, how far, how long."""
    start, terminal = time.monotonic(), sys.stdout.isatty()

    def progress(n, checked):          # (on a terminal: each world size as it agrees, on the run's line)
        if terminal:
            print(f"{' ' if n == WORLD_SIZES[0] else ', '}N={n}: {checked} agree", end="", flush=True)

    for i, (peer, dtype, masks, phase) in enumerate(runs, start=1):
        print(f"[{i}/{len(runs)} {time.monotonic() - start:4.0f} s] {peer.name} | {np.dtype(dtype).name} | "
              f"{masks} | {phase} ...", end="" if terminal else "\n", flush=True)
        run = run_one(peer, dtype, masks, phase, examples, progress)
        if terminal:
            print()
        results.save(run, directory)
        print(f"[{i}/{len(runs)} {time.monotonic() - start:4.0f} s]   {page.cell(run)} ({run.seconds:.0f} s)",
              flush=True)



def write_pages(directory, out):
    """CONFORMANCE.md (`out`, '-': stdout) and its pages (page.PAGES beside it) from
    every run stored in `directory`; stale pages removed. Returns what it says it wrote."""
    every = argparse.Namespace(peer=None, dtype=None, masks=None, passes=None, missing=False)
    planned = [(Peer.of(peer), np.dtype(dtype).name, masks) for peer, dtype, masks, _ in plan(every)]
    runs = results.load(directory, order=peers())
    text = page.render(runs, planned)
    if out == "-":
        return text
    Path(out).write_text(text)
    pages = Path(out).resolve().parent / page.PAGES
    pages.mkdir(exist_ok=True)
    written = page.render_pages(runs)
    for stale in set(p.name for p in pages.glob("*.md")) - set(written):
        (pages / stale).unlink()
    for name, text in written.items():
        (pages / name).write_text(text)
    return f"wrote {out} and {len(written)} pages in {pages} from the runs stored in {directory}"
