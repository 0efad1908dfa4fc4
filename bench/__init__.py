"""Benchmarks: the paper's tables recomputed, predicted and measured speed-ups, plots.

Each section is a module with ``run(quick=True) -> (markdown_text, list_of_png_paths)``;
`bench.run` calls them in turn and writes ``BENCHMARKS.md``. PNG plots go to
``bench/results/`` (a section may take ``results_dir=`` to write them elsewhere).

    python -m bench.run                     # quick, a few minutes on a laptop
    python -m bench.run --only paper predicted --out /tmp/B.md
"""

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def markdown_table(headers, rows, align=None):
    """A GitHub markdown table; `align` is a string of 'l'/'r' per column (default: right)."""
    align = align or "r" * len(headers)
    rule = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(map(str, headers)) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)
