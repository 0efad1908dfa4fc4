"""The conformance results store (CONFORMANCE.md and its pages are rendered from it by `conformance.page`).

    conformance/results/<peer key, '/' as '__'>.json    one file per peer: what it is, and its runs
    python -m conformance --render                      CONFORMANCE.md and pages/ from every stored file

A run is one (peer, dtype, mask set, pass) of `python -m conformance`.
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

HERE = Path(__file__).resolve().parent            # conformance/: the store, CONFORMANCE.md and its pages
RESULTS = HERE / "results"
WORLD_SIZES = (2, 3, 4)        # gloo cannot send a rank to itself, which every ring here does at N = 1
PASSES = {"forward": FORWARD, "backward": BACKWARD}
DTYPE_ORDER = ("float64", "float32", "float16", "bfloat16")
MASK_ORDER = ("causal / full", "window", "documents", "padding", "padding, full")
# the packages every run names; each peer's own library is added to these
COMMON = ("striped-attention", "numpy", "ml_dtypes", "hypothesis", "torch", "jax", "transformers")


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
