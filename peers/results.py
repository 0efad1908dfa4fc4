"""The conformance results store, and CONFORMANCE.md rendered from all of it.

    peers/results/<peer key, '/' as '__'>.json     one file per peer: what it is, and its runs
    python -m peers.conformance --render            CONFORMANCE.md from every stored file, nothing run

A run is one (peer, dtype, mask set, pass) of `python -m peers.conformance`.
It is saved as soon as it finishes (`save`), replacing the stored run of the
same (dtype, mask set, pass), so that `--peer X` changes only X's cells and
runs made on other days, other machines or other branches stay on the page.
A stored run keeps what the page shows: the examples per world size, the line
used per output, the failure's smallest case (its repr, read back with the
kit's `parse_case`) and message, the finding that explained it, and the
versions, date and seconds of the run. Beside its runs the file keeps what the
page says of the peer (name, library, layouts, what it does not support and
why, its conventions: the adapter module's docstring), so that rendering needs
neither torch nor the peers' packages (NumPy only).
"""

import fcntl
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from reference.testing import BACKWARD, FORWARD, parse_case

from .findings import BY_KEY, classify

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "peers" / "results"
WORLD_SIZES = (2, 3, 4)        # gloo cannot send a rank to itself, which every ring here does at N = 1
PASSES = {"forward": FORWARD, "backward": BACKWARD}
DTYPE_ORDER = ("float64", "float32", "float16", "bfloat16")
MASK_ORDER = ("causal / full", "window", "documents", "padding", "padding, full")
# the packages every run names; each peer's own library is added to these
COMMON = ("striped-attention", "numpy", "ml_dtypes", "hypothesis", "torch", "jax", "transformers")
REPRO = "{env}peers/.venv/bin/python -m peers.conformance --repro {peer} {phase} \"{case!r}\""


@dataclass
class Peer:
    """What the page says of a peer, stored beside its runs."""
    key: str
    name: str
    library: str
    layouts: tuple
    conventions: str = ""             # the adapter module's docstring
    unsupported: dict = field(default_factory=dict)     # a dtype or a mask set ("padding, full") -> why
    repro_env: str = ""               # what --repro needs in front (BPT=path/to/bpt.py )

    @classmethod
    def of(cls, adapter):
        import sys
        module = getattr(adapter, "conventions", type(adapter).__module__)
        return cls(key=adapter.key, name=adapter.name, library=adapter.library, layouts=tuple(adapter.layouts),
                   conventions=(sys.modules[module].__doc__ or "").strip(),
                   unsupported=unsupported(adapter),
                   repro_env=getattr(adapter, "repro_env", ""))


def unsupported(adapter):
    """What the matrix says a peer does not take: its `unsupported` (a dtype or a mask set -> why),
    and the padding of its full rows where it has no key mask (the kit's `Adapter.no_key_mask`)."""
    whys = dict(getattr(adapter, "unsupported", {}))
    if adapter.no_key_mask and {"full", "padding"} <= set(adapter.masks):
        whys["padding, full"] = adapter.no_key_mask
    return whys


@dataclass
class Run:
    """One (peer, dtype, mask set, pass): the examples it ran and its smallest failure."""
    peer: Peer
    dtype: str
    masks: str
    phase: str
    examples: int = 0                 # cases checked, those hypothesis ran while shrinking included
    world_sizes: Counter = field(default_factory=Counter)     # N -> cases checked
    usage: dict = field(default_factory=dict)     # output -> largest error / tolerance of any element
    failure: tuple = None             # (smallest Case or None, the kit's message or a traceback)
    asked: int = 0                    # examples asked of each world size (--examples)
    seconds: float = 0.0
    date: str = ""
    versions: dict = field(default_factory=dict)   # package -> version, and "python", "platform"
    stored_finding: str = None        # the key of the finding that explained it when it ran

    @property
    def cell(self):
        return (self.dtype, self.masks, self.phase)

    def finding(self):
        """What explains the failure: FINDINGS read now (so that a finding written
        later classifies a stored run), else the one stored with the run."""
        return classify(self) or BY_KEY.get(self.stored_finding)

    def to_json(self):
        case, message = self.failure if self.failure is not None else (None, None)
        finding = self.finding()
        return dict(dtype=self.dtype, masks=self.masks, phase=self.phase, examples=self.examples,
                    world_sizes={str(n): c for n, c in sorted(self.world_sizes.items())},
                    usage={name: float(u) for name, u in self.usage.items()},
                    failure=None if self.failure is None else
                    dict(case=None if case is None else repr(case), message=message),
                    finding=finding["key"] if finding else None,
                    asked=self.asked, seconds=round(self.seconds, 1), date=self.date, versions=self.versions)

    @classmethod
    def from_json(cls, peer, d):
        failure = None
        if d["failure"] is not None:
            case = d["failure"]["case"]
            failure = (None if case is None else parse_case(case), d["failure"]["message"])
        return cls(peer, d["dtype"], d["masks"], d["phase"], examples=d["examples"],
                   world_sizes=Counter({int(n): c for n, c in d["world_sizes"].items()}), usage=d["usage"],
                   failure=failure, asked=d["asked"], seconds=d["seconds"], date=d["date"], versions=d["versions"],
                   stored_finding=d["finding"])


# -- the store --------------------------------------------------------------

def path_for(key, directory=RESULTS):
    return Path(directory) / (key.replace("/", "__") + ".json")


def save(run, directory=RESULTS):
    """Store `run`, replacing the stored run of its cell; the peer's description is
    rewritten from the run's. Locked: two runners may store at once."""
    path = path_for(run.peer.key, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read()
        runs = [] if not text.strip() else json.loads(text)["runs"]
        runs = [r for r in runs if (r["dtype"], r["masks"], r["phase"]) != run.cell] + [run.to_json()]
        runs.sort(key=lambda r: _order(r["dtype"], r["masks"], r["phase"]))
        f.seek(0)
        f.truncate()
        json.dump(dict(peer={**asdict(run.peer), "layouts": list(run.peer.layouts)}, runs=runs), f, indent=1)
        f.write("\n")


def load(directory=RESULTS, order=()):
    """Every stored run: peers in `order` first (keys), then the rest by key."""
    files = sorted(Path(directory).glob("*.json"))
    stored = [json.loads(path.read_text()) for path in files]
    rank = {key: i for i, key in enumerate(order)}
    stored.sort(key=lambda s: (rank.get(s["peer"]["key"], len(rank)), s["peer"]["key"]))
    runs = []
    for s in stored:
        peer = Peer(**{**s["peer"], "layouts": tuple(s["peer"]["layouts"])})
        runs += [Run.from_json(peer, d) for d in s["runs"]]
    return runs


def _order(dtype, masks, phase):
    def index(values, value):
        return values.index(value) if value in values else len(values)
    return (index(DTYPE_ORDER, dtype), index(MASK_ORDER, masks), index(tuple(PASSES), phase))


# -- the page ---------------------------------------------------------------

def render(runs, planned=()):
    """CONFORMANCE.md from `runs` (in the order given); `planned`: (Peer, dtype, mask set) of
    every cell the runner would run, so that those not stored show as not run."""
    missing = _missing(runs, planned)
    lines = ["# Conformance: other projects' ring attention against this project's oracle", "",
             header(runs), "", *summary(runs, missing), *matrix(runs, missing), *sections(runs)]
    return "\n".join(lines) + "\n"


def _missing(runs, planned):
    """{peer key: (Peer, [(dtype, mask set), ...])} of the planned cells no run is stored for."""
    stored = {(run.peer.key, run.dtype, run.masks) for run in runs}
    missing = {}
    for peer, dtype, masks in planned:
        if (peer.key, dtype, masks) not in stored:
            cells = missing.setdefault(peer.key, (peer, []))[1]
            if (dtype, masks) not in cells:
                cells.append((dtype, masks))
    return missing


def header(runs):
    asked = dict.fromkeys(str(run.asked) for run in runs if run.asked)
    return (
        "Generated by `make conformance` (`python -m peers.conformance`: each run stored in peers/results/ as it "
        "finishes, this page rendered from every stored run) " + _stated(runs, "on", lambda run: run.date) + ", " +
        _stated(runs, "", lambda run: run.versions.get("platform", "")) + ", Python " +
        _stated(runs, "", lambda run: run.versions.get("python", "")) + "; "
        f"{sum(run.seconds for run in runs):.0f} s of runs in all on a shared 2-core machine. Every rank's results "
        "are held against the float64 oracle by `reference.testing.check_ring_attention`, element by element, "
        "within the kit's error model (docs/kit.md). Each run draws up to "
        f"{' or '.join(asked)} hypothesis cases (seed 0) of the peer's layout on each world size "
        f"{', '.join(map(str, WORLD_SIZES))} in turn (up to the first that disagrees), B <= 2 (1 for the varlen "
        "functions), S <= 48, GQA and MQA heads, D <= 8, causal or not (where the peer takes both), every input "
        "kind (scores in the hundreds, constant rows, values exact in float16), in each mask set the peer takes, "
        "in every dtype it takes: causal / full; a sliding window (every case has one); packed documents (every "
        "case has two or more, `cu_seqlens`, each the length the function's sharding needs); padding (S not a "
        "multiple of the layout's unit: the shards end in padding tokens no real query may see). A disagreement "
        "is shrunk to the smallest case hypothesis finds. Forward: out and lse; backward: dq, dk, dv by autograd "
        "of sum(out * dout). The adapters' conventions are in peers/*_adapter.py and below. Packages: " +
        "; ".join(_stated(runs, name, lambda run, name=name: run.versions.get(name, "not installed"),
                          skip="not installed") for name in _packages(runs)) + ".")


def _packages(runs):
    """The packages the runs name (COMMON and each peer's library), those installed for at least one run."""
    names = dict.fromkeys(COMMON + tuple(run.peer.library for run in runs))
    return [name for name in names if any(run.versions.get(name, "not installed") != "not installed" for run in runs)]


def _stated(runs, label, value, skip=None):
    """`label value` where every run has the same value, else each value with the peers whose runs had it."""
    by_value = {}
    for run in runs:
        v = value(run)
        if v and v != skip:
            by_value.setdefault(v, []).append(run.peer.key)
    prefix = f"{label} " if label else ""
    if len(by_value) <= 1:
        return prefix + (next(iter(by_value), "?"))
    return prefix + " and ".join(f"{v} ({', '.join(dict.fromkeys(keys))})" for v, keys in by_value.items())


def summary(runs, missing={}):
    """Which implementations agree everywhere they claim to work, and each defect in one sentence."""
    peers = {}
    for run in runs:
        peers.setdefault(run.peer.key, []).append(run)
    agree, defects, other = [], [], []
    for mine in peers.values():
        name, failed = mine[0].peer.name, [run for run in mine if run.failure is not None]
        by_verdict = {}
        for run in failed:
            by_verdict.setdefault(verdict(run.finding()), []).append(run)
        ran = (f"{len(mine)} runs, {len(mine) - len(failed)} agree: " + ", ".join(dict.fromkeys(r.dtype for r in mine))
               + "; " + ", ".join(dict.fromkeys(r.masks for r in mine)))
        if mine[0].peer.key in missing:
            ran += f"; {len(missing[mine[0].peer.key][1])} rows not run"
        if "defect" not in by_verdict and len(failed) < len(mine):       # (and something agrees)
            notes = [f"{_first(group[0])} ({_where(group)})" for v in ("marginal", "unclaimed")
                     for group in _by_finding(by_verdict.get(v, []))]
            agree.append(f"- **{name}** ({ran})" + (": " + " ".join(notes) if notes else "."))
        else:
            defects.append(f"- **{name}** ({ran}):")
            defects += [f"  - {_label(group[0])} ({_where(group)}): {_first(group[0])}"
                        for v in ("defect", "unclaimed", "marginal") for group in _by_finding(by_verdict.get(v, []))]
    unrun = [peer.name for key, (peer, _) in missing.items() if key not in peers]
    agreeing = [run for run in runs if run.failure is None]
    fewest = min((min(run.world_sizes.values()) for run in agreeing if run.world_sizes), default=0)
    return ["## Summary", "",
            f"{len(peers)} implementations and entry points, {len(runs)} runs (a dtype, a mask set, a pass), "
            f"{len(agreeing)} of which agree, each on at least {fewest} examples on every world size "
            f"({', '.join(map(str, WORLD_SIZES))}).", "",
            "**Agree everywhere they claim to work** (what disagrees is outside what they claim, or rounding "
            "just over the line, as said):", "", *agree, "",
            "**Disagree** (each defect in one sentence, where it shows; the sections below give the smallest "
            "case, the first bad element, the lines of their code that explain it and the command that "
            "reproduces it):", "", *defects, "",
            *([f"**Not run yet**: {', '.join(unrun)} (`python -m peers.conformance --missing`).", ""] if unrun else [])]


def verdict(finding):
    """defect; marginal (rounding just over the line); unclaimed (outside what the peer claims: a
    dtype its kernels refuse, a pass it does not implement). A failure no finding explains: defect."""
    if finding is None:
        return "defect"
    kind = finding["kind"]
    return finding.get("verdict") or ("marginal" if kind.startswith("over the line") else
                                      "unclaimed" if kind.startswith("not supported") else "defect")


def _by_finding(runs):
    groups = {}
    for run in runs:
        finding = run.finding()
        groups.setdefault(finding["key"] if finding else None, []).append(run)
    return list(groups.values())


def _label(run):
    finding = run.finding()
    return finding["kind"] if finding else "not classified"


def _first(run):
    """The finding in one sentence: its summary, or its text's first sentence."""
    finding = run.finding()
    if finding is None:
        return "not classified: see below."
    return finding.get("summary") or finding["text"].split(". ")[0].rstrip(".") + "."


def _where(runs):
    """Where a group of runs failed, shortest first: 'float16, bfloat16: window (forward, backward)'."""
    cells = {}
    for run in runs:
        cells.setdefault((run.masks, run.phase), []).append(run.dtype)
    by_dtypes = {}
    for (masks, phase), dtypes in cells.items():
        by_dtypes.setdefault(", ".join(dtypes), []).append((masks, phase))
    parts = []
    for dtypes, where in by_dtypes.items():
        masks, phases = list(dict.fromkeys(m for m, _ in where)), list(dict.fromkeys(p for _, p in where))
        if len(where) == len(masks) * len(phases):          # every mask set in every pass
            parts.append(f"{dtypes}: {', '.join(masks)} ({', '.join(phases)})")
        else:
            parts.append(f"{dtypes}: " + ", ".join(f"{m} ({p})" for m, p in where))
    return "; ".join(parts)


def matrix(runs, missing={}):
    lines = ["## Matrix", "",
             "| implementation | version | layout | dtype | masks | forward | backward |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    table = {}
    for run in runs:
        table.setdefault((run.peer.key, run.dtype, run.masks), {})[run.phase] = run
    for key in dict.fromkeys([run.peer.key for run in runs] + list(missing)):
        mine = [run for run in runs if run.peer.key == key]
        peer = mine[0].peer if mine else missing[key][0]
        version = _stated(mine, peer.library, lambda run: run.versions.get(peer.library, "")) if mine else peer.library
        rows = [(dtype, masks, [cell(by_phase.get(phase)) for phase in PASSES])
                for (k, dtype, masks), by_phase in table.items() if k == key]
        rows += [(dtype, masks, ["not run"] * len(PASSES)) for dtype, masks in missing.get(key, (None, []))[1]]
        # (what it does not take: a dtype, with any mask; or a mask set, "padding, full", in any dtype)
        rows += [(what, "any", [f"not supported: {why}"] * len(PASSES)) if what in DTYPE_ORDER else
                 ("any", what, [f"not supported: {why}"] * len(PASSES)) for what, why in peer.unsupported.items()]
        rows.sort(key=lambda row: _order(row[0], row[1], "forward"))
        lines += [f"| {peer.name} | {version} | {', '.join(peer.layouts)} | {dtype} | {masks} | " +
                  " | ".join(cells) + " |" for dtype, masks, cells in rows]
    return lines + [
        "", "A cell: *agrees*, or the disagreement below; then the examples run by world size "
        "(with those hypothesis ran while shrinking a disagreement); for a run that agrees, the "
        "largest error / tolerance of any element of each output (1 is the line; the project's "
        "own virtual ring reaches 0.27 in float32 and 0.98 in float16, where the final rounding "
        "alone can take it all: `python -m reference.testing measure`).", ""]


def sections(runs):
    """Per library: the adapters' conventions, then each failure: its smallest case, the
    kit's message, the command that reproduces it and what explains it (written out
    the first time, then pointed to)."""
    lines = []
    for library in dict.fromkeys(run.peer.library for run in runs):
        mine = [run for run in runs if run.peer.library == library]
        lines += [f"## {_stated(mine, library, lambda run: run.versions.get(library, ''))}", ""]
        for conventions in dict.fromkeys(run.peer.conventions for run in mine):
            lines += ["Conventions (from the adapter):", ""]
            lines += ["> " + line if line else ">" for line in conventions.splitlines()] + [""]
        explained = {}                  # finding key -> the heading that gives its text
        for run in mine:
            if run.failure is None:
                continue
            case, message = run.failure
            finding = run.finding()
            heading = f"{run.peer.name}, {run.dtype}, {run.masks}, {run.phase}: " + \
                (finding["kind"] if finding else "not classified")
            lines += [f"### {heading}", ""]
            if case is not None:
                command = REPRO.format(env=run.peer.repro_env, peer=run.peer.key, phase=run.phase, case=case)
                lines += [f"Smallest case: `{case!r}`", "", "```", message.strip(), "```", "",
                          f"Reproduce: `{command}`", ""]
            else:
                lines += ["```", _last_lines(message, 20), "```", ""]
            if finding and finding["key"] in explained:
                lines += [f"{finding['summary'] if 'summary' in finding else ''} (Explained under "
                          f"\"{explained[finding['key']]}\" above.)".lstrip(), ""]
            elif finding:
                explained[finding["key"]] = heading
                lines += [finding["text"], ""]
    return lines


def cell(run):
    """A matrix cell: agrees (examples per world size, line used) or the disagreement's kind."""
    if run is None:
        return "not run"
    sizes = ", ".join(f"N={n}: {c}" for n, c in sorted(run.world_sizes.items()))
    if run.failure is None:
        used = ", ".join(f"{name} {run.usage[name]:.2g}" for name in PASSES[run.phase] if name in run.usage)
        return f"agrees ({run.examples}; {sizes}; line used: {used})"
    finding = run.finding()
    what = finding["kind"] if finding else "disagrees, not classified"
    return f"**{what}** ({run.examples}; {sizes})"


def _last_lines(text, n=6):
    return "\n".join(text.strip().splitlines()[-n:])
