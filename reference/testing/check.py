"""Checking an adapter from the command line: hypothesis draws, runs and shrinks.

`python -m reference.testing check MODULE:ADAPTER` loads an adapter (any
object with the `Adapter` protocol: a subclass of it, or the harnesses'
`reference.testing.harness.jax.JaxAdapter` and the PyTorch one), and for each
world size N asks hypothesis for `examples` cases of the problems it takes
(its layouts, dtypes and masks, narrowed by the options). The first
disagreement, the smallest N first, is shrunk to the smallest case hypothesis
finds; the verdict names it, the first bad element, and the command that
replays it (`--repro`):

    python -m reference.testing check tests/kit/test_kit.py:ToyRing --world-sizes 2,3 --examples 50
    python -m reference.testing check mymodule:MyRing --repro "Case(layout='striped', ...)"

A disagreement is a result outside the error model's line
(`check_ring_attention`'s AssertionError) or an exception from the adapter
(a ring that raises, or a harness that timed out, is not attention either).
"""

import importlib
import importlib.util
import random
import shlex
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .adapter import Unsupported, check_ring_attention
from .cases import INPUT_KINDS, MAX_SEQ, NAMES
from .strategies import cases, check_masks

# what check_ring_attention and the command line read from an adapter
PROTOCOL = ("name", "layouts", "dtypes", "masks", "backward", "outputs", "replicated", "world_sizes",
            "positions", "accumulate_dtype", "document_multiple", "head_multiple", "supports", "run")


def load_adapter(spec):
    """The adapter `spec` names: "module:Name" or "path/to/file.py:Name", where
    Name is an adapter object, or a class made with no arguments. ValueError,
    in words, when it cannot."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:ADAPTER (as mymodule:MyRing or path/to/ring.py:MyRing), got {spec!r}")
    try:
        module = _import(module_name)
    except ValueError:
        raise
    except Exception as e:      # noqa: BLE001 - the user's module failing to import is said in words
        raise ValueError(f"cannot import {module_name!r}: {type(e).__name__}: {e}") from None
    adapter = module
    for part in attr.split("."):
        if not hasattr(adapter, part):
            raise ValueError(f"{module_name!r} has no {attr!r}")
        adapter = getattr(adapter, part)
    if isinstance(adapter, type):
        try:
            adapter = adapter()
        except TypeError as e:
            raise ValueError(f"{spec} is a class that cannot be made with no arguments ({e}): "
                             f"name an object of it instead") from None
    missing = [name for name in PROTOCOL if not hasattr(adapter, name)]
    if missing:
        raise ValueError(f"{spec} is not an adapter: it has no {', '.join(missing)} "
                         f"(subclass reference.testing.Adapter, which gives the defaults)")
    return adapter


def _import(name):
    """A module by dotted name, or a .py file by its path (its folder first on sys.path)."""
    if name.endswith(".py") or "/" in name:
        path = Path(name).resolve()
        if not path.is_file():
            raise ValueError(f"no file {name!r}")
        sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(name)


SKIP_LIMIT = 50      # cases drawn and none taken: the adapter takes nothing at this world size


class _NothingTaken(BaseException):
    """Ends `find` at once (hypothesis passes on what is not an Exception, unshrunk)."""


@dataclass(frozen=True)
class Plan:
    """What to draw: the world sizes, and per case the layouts, dtypes and masks
    (each within what the adapter declares), examples per world size, seed."""
    world_sizes: tuple
    layouts: tuple
    dtypes: tuple
    masks: tuple
    examples: int = 100
    seed: int = 0
    max_seq: int = MAX_SEQ
    shrink_seconds: float = 120.0
    shapes: int = 0


def _narrow(what, asked, declared, name=lambda x: x):
    """`asked` (names, or None for all of `declared`) as `declared`'s values,
    or ValueError naming what the adapter does not take."""
    names = [name(x) for x in declared]
    if asked is None:
        return tuple(declared)
    unknown = [a for a in asked if a not in names]
    if unknown:
        raise ValueError(f"the adapter does not take {what} {', '.join(unknown)} (takes {', '.join(names)})")
    return tuple(declared[names.index(a)] for a in asked)


def make_plan(adapter, *, world_sizes=None, layouts=None, dtypes=None, masks=None, examples=100, seed=0,
              max_seq=MAX_SEQ, shrink_seconds=120.0, shapes=None):
    """The Plan for `adapter`, options given as names (None: all it declares;
    `shapes` None: the adapter's `shape_pool`); ValueError for what it does not take."""
    if examples < 1:
        raise ValueError(f"--examples must be at least 1, got {examples}")
    shapes = getattr(adapter, "shape_pool", 0) if shapes is None else shapes
    if shapes < 0:
        raise ValueError(f"--shapes must be 0 (each case its own shape) or more, got {shapes}")
    sizes = tuple(world_sizes) if world_sizes is not None else tuple(adapter.world_sizes)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"world sizes must be at least 1, got {sizes}")
    return Plan(world_sizes=tuple(sorted(set(sizes))), examples=examples, seed=seed, max_seq=max_seq,
                shrink_seconds=shrink_seconds, shapes=shapes,
                layouts=_narrow("layout", layouts, tuple(adapter.layouts)),
                dtypes=_narrow("dtype", dtypes, tuple(adapter.dtypes), lambda d: np.dtype(d).name),
                masks=check_masks(_narrow("mask", masks, tuple(adapter.masks))))


def strategy(adapter, plan, n):
    """Cases for world size n: what the plan names, documents cut and heads counted
    as the adapter needs, shapes from a pool of `plan.shapes` the adapter takes (where not 0)."""
    return cases(dtypes=plan.dtypes, layouts=plan.layouts, kinds=INPUT_KINDS, masks=plan.masks, devices=(n,),
                 max_seq=max(plan.max_seq, 2 * n), document_multiple=adapter.document_multiple,
                 head_multiple=adapter.head_multiple, shapes=plan.shapes,
                 replicates_kv_heads=getattr(adapter, "replicates_kv_heads", False),
                 keep=lambda case: not adapter.supports(case))


@dataclass
class Verdict:
    """The outcome: examples run per world size, the line used per output
    name (largest error / tolerance over the agreeing examples), and, on a
    disagreement, the smallest case, the kit's message and the world size;
    `skipped`, per world size at which the adapter took none of the cases
    drawn, its reason (gloo cannot send a rank to itself, say, at N = 1)."""
    adapter: str
    plan: Plan
    examples: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)
    used: dict = field(default_factory=dict)
    case: object = None
    message: str = None
    seconds: float = 0.0
    flaky: bool = False
    shrink_cut: bool = False

    @property
    def agrees(self):
        return self.case is None


def failure_message(adapter, case, error):
    """The kit's words for a disagreement: its AssertionError, or what the adapter raised."""
    if isinstance(error, AssertionError):
        return str(error)
    frames = traceback.format_exception(type(error), error, error.__traceback__)
    return (f"{adapter.name} raised on\n  {case!r}\n  {type(error).__name__}: {error}\n"
            + "".join(frames[-3:]).rstrip())


def check_one(adapter, case, usage=None):
    """None when `adapter` agrees with the oracle on `case`, else the message.
    Unsupported (outside hypothesis) and KeyboardInterrupt pass through."""
    try:
        check_ring_attention(adapter, case, usage=usage)
    except Unsupported:
        raise
    except Exception as e:      # noqa: BLE001 - any exception of the ring is a disagreement
        if _hypothesis_own(e):  # assume(False): hypothesis draws another case
            raise
        return failure_message(adapter, case, e)
    return None


def _hypothesis_own(error):
    try:
        from hypothesis.errors import HypothesisException
    except ImportError:
        return False
    return isinstance(error, HypothesisException)


def check_adapter(adapter, plan, progress=None):
    """Run `plan` on `adapter`: per world size (smallest first) hypothesis
    draws up to `plan.examples` cases; at the first disagreement it shrinks
    to the smallest case it finds within `plan.shrink_seconds` (a slow ring's
    shrinking can take many minutes) and the run stops there. Returns a Verdict."""
    from hypothesis import HealthCheck, Phase, Verbosity, assume, find, settings
    from hypothesis.errors import Flaky, NoSuchExample, Unsatisfiable
    verdict, start = Verdict(adapter.name, plan), time.monotonic()
    # no explain phase: its variations of the shrunk case come after it, and
    # `find` returns the last case that failed, so it would return one of them
    config = settings(max_examples=plan.examples, deadline=None, database=None, verbosity=Verbosity.quiet,
                      suppress_health_check=list(HealthCheck), phases=[p for p in Phase if p != Phase.explain])
    for n in plan.world_sizes:
        counts, skipped, failing = dict(run=0, failed=0, before=0), Counter(), {}

        def fails(case):
            if counts["failed"] and time.monotonic() > counts["shrink_until"]:
                # shrinking's time is up: no new case fails, and one seen failing still does, so
                # that hypothesis' last call (the smallest failure, again) finds what it found
                verdict.shrink_cut = True
                return case in failing
            reason = adapter.supports(case)
            if reason:              # not drawn: hypothesis draws another
                skipped[reason] += 1
                if not counts["run"] and skipped.total() >= SKIP_LIMIT:
                    raise _NothingTaken
                assume(False)
            counts["run"] += 1
            if progress:
                progress.update(n, counts["run"], plan.examples, shrinking=counts["failed"])
            usage = {}
            message = check_one(adapter, case, usage)
            failed = message is not None
            if failed:
                failing[case] = message
            if failed and not counts["failed"]:
                counts["before"] = counts["run"] - 1        # the examples that agreed before it
                counts["shrink_until"] = time.monotonic() + plan.shrink_seconds
            counts["failed"] += failed
            if not failed:
                for name, used in usage.items():
                    verdict.used[name] = max(verdict.used.get(name, 0.0), used)
            return failed

        try:
            case = find(strategy(adapter, plan, n), fails, settings=config, random=random.Random(plan.seed))
        except Flaky:
            # the smallest failure agreed when hypothesis ran it again: the ring gave two answers
            case = list(failing)[-1]            # (each failure while shrinking is the smallest yet)
            verdict.examples[n], verdict.flaky = counts["before"], True
            verdict.case, verdict.message = case, failing[case]
            if progress:
                progress.done(n, counts["run"], failed=True)
            break
        except (NoSuchExample, Unsatisfiable, _NothingTaken):
            if not counts["run"]:   # the adapter took none of the cases drawn
                verdict.skipped[n] = skipped.most_common(1)[0][0] if skipped else "no case drawn"
            else:
                verdict.examples[n] = counts["run"]
            if progress:
                progress.done(n, counts["run"])
            continue
        verdict.examples[n] = counts["before"]
        verdict.case, verdict.message = case, failing[case]
        if progress:
            progress.done(n, counts["run"], failed=True)
        break
    verdict.seconds = time.monotonic() - start
    return verdict


def used_line(used):
    """"out 0.31, lse 0.02, dq 0.2, ...": the line used per output (1 is the line)."""
    return ", ".join(f"{name} {used[name]:.3g}" for name in NAMES if name in used) or "nothing compared"


def summary(verdict):
    """The verdict's first line: "agrees (...)" or "disagrees (...)"."""
    sizes = ", ".join(str(n) for n in verdict.examples)
    skipped = "".join(f"; N = {n} skipped: {why}" for n, why in verdict.skipped.items())
    if verdict.agrees and not verdict.examples:
        return f"{verdict.adapter} took none of the cases drawn{skipped}"
    if verdict.agrees:
        each = min(verdict.examples.values())
        return (f"{verdict.adapter} agrees ({each} examples per world size, N = {sizes}; "
                f"line used: {used_line(verdict.used)}; 1 is the line{skipped}; {verdict.seconds:.0f} s)")
    n = list(verdict.examples)[-1]
    if verdict.flaky:
        return (f"{verdict.adapter} disagrees, not every time (N = {n}, after {verdict.examples[n]} agreeing "
                f"examples there): this case disagreed once and agreed when run again:")
    within = f" in {verdict.plan.shrink_seconds:g} s of shrinking (--shrink-seconds)" if verdict.shrink_cut else ""
    if verdict.plan.shapes:
        within += f", its shape one of a pool of {verdict.plan.shapes} (--shapes 0 shrinks the shape too)"
    return (f"{verdict.adapter} disagrees (N = {n}, after {verdict.examples[n]} agreeing examples there; "
            f"the smallest case hypothesis found{within}:)")


class Progress:
    """A progress line on `stream`: rewritten in place on a terminal, else
    one line per world size when it is done."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.live = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.monotonic()

    def update(self, n, run, total, shrinking=0):
        if self.live:
            what = f"shrinking a disagreement ({run} tries)" if shrinking else f"{run}/{total} examples"
            self.stream.write(f"\r  N = {n}: {what}, {time.monotonic() - self.start:.0f} s\x1b[K")
            self.stream.flush()

    def done(self, n, run, failed=False):
        what = f"disagrees ({run} tries, shrinking included)" if failed else f"{run} examples agree"
        what = what if run else "took none of the cases drawn"
        line = f"  N = {n}: {what}, {time.monotonic() - self.start:.0f} s"
        self.stream.write(f"\r{line}\x1b[K\n" if self.live else f"{line}\n")
        self.stream.flush()


def repro_command(spec, case):
    """The command that replays `case` on the adapter `spec`."""
    text = repr(case)
    quoted = f'"{text}"' if not set(text) & set('"$`\\') else shlex.quote(text)
    return f"python -m reference.testing check {spec} --repro {quoted}"


def markdown(verdict, command, repro=None):
    """The verdict as a Markdown section: the command, a row per world size,
    and on a disagreement the kit's message and the command that replays it."""
    lines = [f"## {verdict.adapter}", "", f"`{command}`", "",
             "| N | examples | verdict |", "| --- | --- | --- |"]
    for n, run in verdict.examples.items():
        bad = not verdict.agrees and n == list(verdict.examples)[-1]
        lines.append(f"| {n} | {run} | {'disagrees' if bad else 'agrees'} |")
    lines.append("")
    if verdict.agrees:
        lines.append(f"Line used (largest error / tolerance, 1 is the line): {used_line(verdict.used)}.")
    else:
        found = ("A disagreement that did not come again when the case was run again:" if verdict.flaky
                 else "The smallest disagreement hypothesis found:")
        lines += [found, "", "```text", verdict.message, "```", ""]
        if repro:
            lines.append(f"Replay: `{repro}`")
    return "\n".join(lines) + "\n"
