"""The paper's Theoretical Maximum Speedup (TMS), recomputed beside its printed tables.

Paper section 4: for every configuration of Tables 3, 4, 5 and Appendix A.1-A.3
(typed in `reference/data/paper_tms.csv` with their table numbers) recompute TMS with
`reference.cost.theoretical_max_speedup` and print it beside the paper's TMS and
the paper's measured end-to-end speed-up, table by table, with the largest
difference. A recomputed value within 0.005 of the printed one rounds to it.

Letters: N devices of sequence parallelism (the mesh is "model x sequence"
parallelism, m x N), n_seq tokens, c = n_seq // N tokens per device (Table 5
prints c as "Block Size").

    python -m bench.paper                   # prints the markdown
    python -m bench.run --only paper        # into BENCHMARKS.md
"""

import argparse
import sys
from pathlib import Path

from reference import usage
from reference.cost import HARDWARE, MODELS, paper_rows

from . import RESULTS, markdown_table

TABLES = {   # table -> the paper's caption, shortened
    "3": "Table 3: 8 A100 GPUs, mesh 2 x 4, across model sizes",
    "4": "Table 4: 16 TPU v4 chips, mesh 2 x 8, across model sizes",
    "5": "Table 5: 8 A100 GPUs, model 1B, meshes 1 x N (the paper prints c, not n_seq)",
    "A.1": "Appendix A.1: A100-80GB, 8 GPUs",
    "A.2": "Appendix A.2: TPU v3, 8 chips",
    "A.3": "Appendix A.3: TPU v4, 16 chips",
}
HEADERS = ("model", "mesh m x N", "n_seq", "c", "TMS paper", "TMS recomputed",
           "difference", "speed-up paper", "speed-up / TMS")
PRINTED = 0.01       # one unit of the paper's last printed digit

ASSUMPTIONS = f"""\
Assumptions of the paper's section 4, as `reference/tms.py` implements them: communication
is fully overlapped with compute; FLOPs outside matrix multiplies cost nothing; on A100 an
attention FLOP (TensorFloat-32) costs {HARDWARE['a100']}x a bfloat16 matmul FLOP; on TPU v3
and v4 (bfloat16 throughout) it costs {HARDWARE['tpuv4']}x. Per device and layer, with
d = d_model, f = d_ff, V = n_vocab, L = n_layer and h the attention cost factor:

    F_lin  = c * (8 d^2 + 4 d f + 2 d V / L)       QKV+O, MLP, LM head
    P_ring = c(c+1)/2 + (N-1) c^2                  busiest device's (query, key) pairs
    P_str  = N * c(c+1)/2
    TMS    = (F_lin + 4 d h P_ring) / (F_lin + 4 d h P_str)

Model parallelism m and the backward pass scale every term alike and cancel. Models
(paper Table 1): {", ".join(f"{k} (d={m['d_model']}, f={m['d_ff']}, L={m['n_layer']})" for k, m in MODELS.items())}, V = 32000."""


def _mesh(r):
    return f"{r['model_parallel']} x {r['seq_parallel']}"


def difference(r):
    return r["tms_recomputed"] - r["tms"]


def largest_difference(rows):
    """The row whose recomputed TMS is furthest from the printed one."""
    return max(rows, key=lambda r: abs(difference(r)))


def describe(r):
    return f"Table {r['table']}, {r['hardware']}, {r['model']}, mesh {_mesh(r)}, n_seq {r['n_seq']}"


def table_markdown(rows):
    """One markdown table of paper rows, in the paper's order."""
    body = [(r["model"], _mesh(r), r["n_seq"], r["n_seq"] // r["seq_parallel"],
             f"{r['tms']:.2f}", f"{r['tms_recomputed']:.4f}", f"{difference(r):+.4f}",
             f"{r['speedup']:.2f}", f"{r['speedup'] / r['tms']:.2f}") for r in rows]
    return markdown_table(HEADERS, body)


def summary_markdown(rows):
    """Per table: rows, largest difference, and how far the measured speed-ups fall short."""
    body = []
    for table, caption in TABLES.items():
        sub = [r for r in rows if r["table"] == table]
        worst = largest_difference(sub)
        ratios = [r["speedup"] / r["tms"] for r in sub]
        body.append((caption, len(sub), f"{difference(worst):+.5f}",
                     f"{min(ratios):.2f} .. {max(ratios):.2f}"))
    return markdown_table(("table", "rows", "largest difference", "speed-up / TMS"), body, "lrrr")


def plot(rows, path):
    """Measured speed-up against TMS, and their ratio against the block size c."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    appendix = [r for r in rows if r["table"].startswith("A.")]      # Tables 3-5 repeat it
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for table, marker in zip(("A.1", "A.2", "A.3"), "osD"):
        sub = [r for r in appendix if r["table"] == table]
        label = TABLES[table].split(": ")[1]
        ax1.scatter([r["tms_recomputed"] for r in sub], [r["speedup"] for r in sub],
                    marker=marker, s=18, label=label)
        ax2.scatter([r["n_seq"] // r["seq_parallel"] for r in sub],
                    [r["speedup"] / r["tms_recomputed"] for r in sub], marker=marker, s=18, label=label)
    ax1.plot([1, 2], [1, 2], "k--", lw=1, label="speed-up = TMS")
    ax1.set(xlabel="TMS (recomputed)", ylabel="speed-up measured in the paper",
            title="The paper's speed-ups stay under TMS")
    ax2.set_xscale("log", base=2)
    ax2.axhline(1, color="k", ls="--", lw=1)
    ax2.set(xlabel="tokens per device c = n_seq / N", ylabel="measured speed-up / TMS",
            title="The gap narrows as blocks grow")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(quick=True, *, results_dir=RESULTS):
    """Markdown for every paper table, and the plot. `quick` changes nothing: it is cheap."""
    rows = paper_rows()
    worst = largest_difference(rows)
    within = sum(abs(difference(r)) <= PRINTED for r in rows)
    parts = [
        "Paper section 4's Theoretical Maximum Speedup (TMS) of Striped over Ring Attention, "
        "recomputed by `reference.cost` for every configuration the paper prints "
        "(`reference/data/paper_tms.csv`), beside the printed TMS and the paper's measured "
        "end-to-end training speed-up. Difference = recomputed - printed.",
        ASSUMPTIONS,
        f"**{len(rows)} rows; {within} within {PRINTED} of the printed TMS; largest difference "
        f"{difference(worst):+.5f}** ({describe(worst)}: printed {worst['tms']:.2f}, "
        f"recomputed {worst['tms_recomputed']:.5f}).",
        summary_markdown(rows),
    ]
    for table, caption in TABLES.items():
        sub = [r for r in rows if r["table"] == table]
        parts += [f"### {caption}", table_markdown(sub)]
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    png = plot(rows, results_dir / "paper_tms.png")
    return "\n\n".join(parts) + "\n", [png]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.paper", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=usage.output_folder, default=str(RESULTS),
                    help="folder for the plot (default %(default)s)")
    args = ap.parse_args(argv)
    text, pngs = run(results_dir=args.results)
    print(text)
    print("plots:", *pngs, file=sys.stderr)


if __name__ == "__main__":
    main()
