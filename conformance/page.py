"""CONFORMANCE.md and one page per library, rendered from the results store (NumPy only).

    conformance/CONFORMANCE.md          how the runs were made, the summary (each defect in one
                                        sentence, linked), one row per implementation and dtype
    conformance/pages/<library>.md      per library: every run's cell, the adapters' conventions,
                                        each failure's smallest case, message, command and explanation

    pages = render_pages(load())        # {file name: text}: a function of the stored runs alone
    text = render(load(), planned)      # `planned`: every cell the runner would run (needs the adapters)
"""

import re

from .results import COMMON, DTYPE_ORDER, PASSES, WORLD_SIZES, _order

REPRO = "{env}conformance/.venv/bin/python -m conformance --repro {peer} {phase} \"{case!r}\""
PAGES = "pages"                     # the pages' folder, beside CONFORMANCE.md


def render(runs, planned=()):
    """CONFORMANCE.md from `runs` (implementations by key, each's runs in the order given);
    `planned`: (Peer, dtype, mask set) of every cell the runner would run, so that those not
    stored show as not run."""
    runs = sorted(runs, key=in_order)
    missing = dict(sorted(_missing(runs, planned).items()))
    lines = ["# Conformance: other projects' ring attention against this project's oracle", "",
             header(runs), "", *summary(runs, missing), *overview(runs, missing)]
    return as_references("\n".join(lines) + "\n")


def as_references(text):
    """The links into the pages as numbered reference links, each target once at the
    end: the page links each failure from the summary and the matrix, hundreds of times."""
    targets = {}

    def number(match):
        label = targets.setdefault(match.group(2), len(targets) + 1)
        return f"[{match.group(1)}][{label}]"
    text = re.sub(r"\[([^\]]+)\]\((" + re.escape(PAGES) + r"/[^)]+)\)", number, text)
    return text + "\n" + "".join(f"[{label}]: {target}\n" for target, label in targets.items())


def render_pages(runs):
    """{file name: text} of one page per family of implementations (a peer key's first
    part: 'ring-flash-attn', 'yunchang', 'bpt'): its runs' cells, conventions and
    failures. A function of the stored runs alone (no planned cells), so that a test
    holds the committed pages equal to them without the peers installed."""
    pages = {}
    for family in dict.fromkeys(family_of(run) for run in runs):
        mine = sorted((run for run in runs if family_of(run) == family), key=in_order)
        libraries = dict.fromkeys(run.peer.library for run in mine)
        title = "; ".join(_stated(mine, library, lambda run, library=library: run.versions.get(library, ""))
                          for library in libraries)
        pages[page_name(mine[0])] = "\n".join([
            f"# {title}: against the oracle", "",
            "[CONFORMANCE.md](../CONFORMANCE.md) says how the runs were made; this page gives every run "
            "of these implementations and each disagreement in full.", "",
            *matrix(mine), *sections(mine)]) + "\n"
    return pages


def in_order(run):
    """Implementations by key, each's runs by dtype, mask set and pass: the pages
    read the same whatever order the runs come in."""
    return (run.peer.key, _order(*run.cell))


def family_of(run):
    return run.peer.key.split("/")[0]


def page_name(run):
    """The page of a run's family: 'ring-flash-attn.md', 'bpt.md'."""
    return re.sub(r"[^\w.-]+", "-", family_of(run)) + ".md"


def heading(run):
    finding = run.finding()
    return f"{run.peer.name}, {run.dtype}, {run.masks}, {run.phase}: " + \
        (finding["kind"] if finding else "not classified")


def anchor(run):
    """The id a failure is written under on its page: its finding's name (the
    first run of a finding is written out; the rest point to it), else the run's cell."""
    finding = run.finding()
    if finding:
        return finding["key"].split("/")[-1]
    return re.sub(r"[^\w-]+", "-", f"{run.peer.key}-{run.dtype}-{run.masks}-{run.phase}").lower()


def link(run):
    """Where a run's failure is written out: its page and anchor."""
    return f"{PAGES}/{page_name(run)}#{anchor(run)}"


def overview(runs, missing={}):
    """One row per implementation: each dtype's runs in one cell, what agrees and what does not, linked."""
    lines = ["## Matrix", "",
             "One row per implementation, one column per dtype: how many of its runs (a mask set, a pass) "
             "agree, each kind of disagreement linked to where its page writes it out, the cells not run, "
             "and the dtypes it does not take (why: on its page). "
             f"Every run's own cell (examples by world size, line used) is on its library's page in "
             f"[{PAGES}/]({PAGES}/).", "",
             "| implementation | layout | " + " | ".join(DTYPE_ORDER) + " |",
             "| --- | --- | " + " | ".join("---" for _ in DTYPE_ORDER) + " |"]
    for key in dict.fromkeys([run.peer.key for run in runs] + list(missing)):
        mine = [run for run in runs if run.peer.key == key]
        peer = mine[0].peer if mine else missing[key][0]
        name = f"[{peer.name}]({PAGES}/{page_name(mine[0])})" if mine else peer.name
        cells = []
        for dtype in DTYPE_ORDER:
            ran = [run for run in mine if run.dtype == dtype]
            unrun = sum(len(PASSES) for d, _ in missing.get(key, (None, []))[1] if d == dtype)
            parts = [f"{sum(run.failure is None for run in ran)}/{len(ran)} agree"] if ran else []
            kinds = {}
            for run in ran:
                if run.failure is not None:
                    kinds.setdefault(run.finding()["kind"] if run.finding() else "not classified", run)
            parts += [f"[{kind}]({link(run)})" for kind, run in kinds.items()]
            parts += [f"{unrun} not run"] * bool(unrun)
            if dtype in peer.unsupported:
                parts.append("not supported")
            cells.append("; ".join(parts) or "-")
        lines.append(f"| {name} | {', '.join(peer.layouts)} | " + " | ".join(cells) + " |")
    return lines + [""]


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
        "Generated by `make conformance` (`python -m conformance`: each run stored in conformance/results/ as it "
        "finishes, this page and its pages in conformance/pages/ rendered from every stored run) " + _stated(runs, "on", lambda run: run.date) + ", " +
        _stated(runs, "", lambda run: run.versions.get("platform", "")) + ", Python " +
        _stated(runs, "", lambda run: run.versions.get("python", "")) + "; "
        f"{sum(run.seconds for run in runs):.0f} s of runs in all on a shared 2-core machine. Every rank's results "
        "are held against the float64 oracle by `reference.testing.check_ring_attention`, element by element, "
        "within the kit's error model (docs/kit.md). Each run draws up to "
        f"{' or '.join(asked)} hypothesis cases (seed 0) of the peer's layout on each world size "
        f"{', '.join(map(str, WORLD_SIZES))} in turn (up to the first that disagrees), B <= 2 (1 for the varlen "
        "functions), S <= 48, GQA and MQA heads (for Ulysses and USP both counts multiples of the Ulysses degree, "
        "two KV heads a rank first), D <= 8, causal or not (where the peer takes both), every input "
        "kind (scores in the hundreds, constant rows, values exact in float16), in each mask set the peer takes, "
        "in every dtype it takes: causal / full; a sliding window (every case has one); packed documents (every "
        "case has two or more, `cu_seqlens`, each the length the function's sharding needs); padding (S not a "
        "multiple of the layout's unit: the shards end in padding tokens no real query may see). A disagreement "
        "is shrunk to the smallest case hypothesis finds. Forward: out and lse; backward: dq, dk, dv by autograd "
        "of sum(out * dout). The adapters' conventions are in conformance/*_adapter.py and on each page. Packages: " +
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
    agree, defects = [], []
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
            defects += [f"  - [{_label(group[0])}]({link(group[0])}) ({_where(group)}): {_first(group[0])}"
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
            "**Disagree** (each defect in one sentence, where it shows; its link leads to the smallest "
            "case, the first bad element, the lines of their code that explain it and the command that "
            "reproduces it):", "", *defects, "",
            *([f"**Not run yet**: {', '.join(unrun)} (`python -m conformance --missing`).", ""] if unrun else [])]


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
    lines = ["## Every run", "",
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
    """The adapters' conventions, then each failure: its smallest case, the kit's
    message, the command that reproduces it and what explains it (written out
    the first time, then pointed to)."""
    lines = []
    for conventions in dict.fromkeys(run.peer.conventions for run in runs):
        lines += ["## Conventions (from the adapter)", ""]
        lines += ["> " + line if line else ">" for line in conventions.splitlines()] + [""]
    explained, anchored = {}, set()     # finding key -> the heading that gives its text; ids written
    for run in runs:
        if run.failure is None:
            continue
        case, message = run.failure
        finding = run.finding()
        if anchor(run) not in anchored:
            anchored.add(anchor(run))
            lines += [f'<a id="{anchor(run)}"></a>', ""]
        lines += [f"### {heading(run)}", ""]
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
            explained[finding["key"]] = heading(run)
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
