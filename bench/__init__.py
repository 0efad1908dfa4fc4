"""Benchmarks: the paper's tables recomputed, predicted and measured speed-ups, plots.

Each section is a module with ``run(quick=True) -> (markdown_text, list_of_png_paths)``;
`bench.run` calls them in turn and writes ``BENCHMARKS.md``. PNG plots go to
``bench/results/`` (a section may take ``results_dir=`` to write them elsewhere).

    python -m bench.run                     # quick, a few minutes on a laptop
    python -m bench.run --only paper predicted --out /tmp/B.md

The sections in BENCHMARKS.md's order, each with its helpers after it. Modules, in reading order:

    run               the driver: every section into BENCHMARKS.md, a headline table on top
    machine           what a figure says about its machine: CPU, BLAS, threads, the matmul rate
    paper             the paper's Theoretical Maximum Speedup beside its printed tables
    predicted         striped's and zigzag's speed-up over contiguous, from the cost model alone
    kernel            one device's step against a plain matmul: share of its rate, memory
    kernel_timing     one step timed on one block, for `kernel`
    torch_compare     torch's CPU attention on the same shapes, in a process of its own
    tile_parts        where a tile's time goes: products, exponentials, masks, copies
    unit_shapes       how step v5's forward is cut into units, tried against other cuts
    block_shapes      what a computed tile costs by the shape of its block
    mpi_scaling       measured speed-ups on MPI processes against the predicted ones
    schemes           the four schemes on MPI ranks against their cost model
    emulated_nodes    ranks as emulated nodes: every scheme and placement against the cost model
    sharing           what ranks sharing the cores add to a step's CPU time, measured
    waits             more ranks than cores: spinning against sleeping
    overlap           whether each K/V transfer hides behind a block's computation
    soak              thousands of ring calls in one job, memory and communicators flat
    virtual_ring      N virtual devices: wall time against the total tile count
    paper_code        N virtual devices against the paper authors' JAX ring
    scale             long sequences on MPI ranks: time, share of sgemm, memory per rank
    model_step        the paper's end-to-end table on CPU: one training step of the model
    masks             packed documents and sliding windows: which layout balances them
    gpu_bench         the ring on CuPy per layout, against cuBLAS and torch
    gpu_kernel        the tensor-core kernel, read before it runs, measured on a GPU
    gpu_kernel_check  version 2 of the fused kernel checked and timed: a step of `make gpu-check`
"""

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def markdown_table(headers, rows, align=None):
    """A GitHub markdown table; `align` is a string of 'l'/'r' per column (default: right)."""
    align             = align or "r" * len(headers)
    rule              = ["---:" if a == "r" else ":---" for a in align]
    lines             = ["| " + " | ".join(map(str, headers)) + " |", "| " + " | ".join(rule) + " |"]
    lines             += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return            "\n".join(lines)
