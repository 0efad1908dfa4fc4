"""The paper's end-to-end table on CPU: one training step of the model on MPI ranks.

Paper section 4 measures the training-step speed-up of Striped over Ring Attention
and holds it against its Theoretical Maximum Speedup (TMS). Here: `model`'s
transformer, one Adam step (forward, backward through the ring, allreduce of the
gradients, update) on N = 2 MPI ranks, one BLAS thread each, for a few sequence
lengths and every layout, in one launch:

    OPENBLAS_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py -m bench.model_step --worker OUT.json

Beside each measured speed-up over contiguous: TMS instantiated for this model
(`model.speedup.tms`, its linear FLOPs, pair-counted as the paper does) and the
tile-aware TMS (critical-path tile area from `reference.cost`), both with h, the cost of
an attention FLOP against a linear-layer FLOP, measured in the same run: in the striped
run (whose ranks barely wait), each rank's seconds inside the ring per attention FLOP of
the tiles it computes, over its seconds outside the ring per linear-layer FLOP (so the
norms, the loss, the allreduce and Adam are charged to the linear FLOPs). Seconds are
CPU seconds: the machines this runs on are shared, and a rank's CPU time is its time
with a core to itself (ranks spin while they wait, so the wait for the busiest counts). Then the
paper's own rows, recomputed tile-aware at its tile sizes (`model.speedup`).

    python -m bench.model_step             # quick: about a minute on 2 cores
    python -m bench.model_step --full
    python -m bench.run --only model
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import reference
from reference import usage
from mpi_impl.launch import find_mpiexec
from model import speedup, train, transformer

from . import RESULTS, markdown_table

ROOT = Path(__file__).resolve().parents[1]
N_RANKS = 2
CONFIG = transformer.Config(vocab=256, d_model=128, n_head=2, n_layer=2, d_ff=512)   # D = 64
TILE = 256
QUICK_SEQS, FULL_SEQS = (1024, 2048, 4096), (2048, 4096, 8192)
WARMUP, REPEAT = 1, 5          # steps per (S, layout): the first is not timed; best of the rest
SINGLE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# -- the worker: every rank ------------------------------------------------------------

def worker(out_path, seqs):
    """Time WARMUP + REPEAT steps per (S, layout), the layouts taking turns step by step (so a
    burst of load elsewhere on the machine hits all three); rank 0 writes per-rank seconds."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(0)
    records = []
    for seq_len in seqs:
        tokens = rng.integers(0, CONFIG.vocab, (1, seq_len + 1))    # B = 1, the same on every rank
        runs = {}
        for layout in reference.LAYOUTS:
            params = transformer.init_params(CONFIG, 0, np.float32)
            runs[layout] = (train.mpi(CONFIG, comm, layout, tile_size=TILE), params, train.Adam(params))
        for step in range(WARMUP + REPEAT):
            for layout, (replica, params, opt) in runs.items():
                comm.Barrier()
                attn0, start, cpu = replica.attn.cpu_seconds, time.perf_counter(), time.process_time()
                _, grads = replica.loss_and_grads(params, tokens)
                opt.step(params, grads)
                everyone = comm.gather((time.process_time() - cpu, replica.attn.cpu_seconds - attn0,
                                        time.perf_counter() - start))
                if comm.Get_rank() == 0 and step >= WARMUP:
                    records.append(dict(seq_len=seq_len, layout=layout, **{
                        name: [e[i] for e in everyone] for i, name in enumerate(("step_s", "attention_s", "wall_s"))}))
    if comm.Get_rank() == 0:
        Path(out_path).write_text(json.dumps(records))


def launch(seqs, progress=None, timeout=1200):
    """One mpiexec launch of the worker; its records."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.json"
        cmd = [find_mpiexec() or "mpiexec", "-n", str(N_RANKS), sys.executable, "-m", "mpi4py",
               "-m", "bench.model_step", "--worker", str(out), "--seqs", *map(str, seqs)]
        env = dict(os.environ, PYTHONPATH=str(ROOT), MPIEXEC_TIMEOUT=str(timeout), **SINGLE_THREAD)
        if progress:
            progress(f"mpiexec -n {N_RANKS} ... bench.model_step --worker, S = {list(seqs)}")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout + 30)
        if proc.returncode:
            raise RuntimeError(f"worker failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return json.loads(out.read_text())


# -- from records to the table ----------------------------------------------------------

def summarize(records):
    """Per (S, layout): the best step (least CPU time of its busiest rank), with its per-rank
    CPU times, and the least wall time of a step."""
    best = {}
    for r in records:
        key, step_s = (r["seq_len"], r["layout"]), max(r["step_s"])
        if key not in best or step_s < best[key]["step_s"]:
            best[key] = dict(step_s=step_s, rank_step_s=np.array(r["step_s"]),
                             rank_attention_s=np.array(r["attention_s"]), wall_s=np.inf)
    for r in records:
        b = best[(r["seq_len"], r["layout"])]
        b["wall_s"] = min(b["wall_s"], max(r["wall_s"]))
    return best


def attention_cost_factor(seq_len, rank_step_s, rank_attention_s, config=CONFIG, batch=1):
    """h: seconds per attention FLOP (computed tiles) over seconds per linear FLOP, mean over ranks
    of the striped run. FLOPs are forward counts; the backward scales both alike."""
    area = reference.cost.predict(seq_len, N_RANKS, "striped", TILE).tile_area.sum(axis=0)   # (N,)
    attn_flops = 4 * config.d_model * config.n_layer * batch * area
    lin_flops = batch * seq_len // N_RANKS * config.n_layer * config.linear_flops_per_token()
    other_s = rank_step_s - rank_attention_s
    return float(np.mean((rank_attention_s / attn_flops) / (other_s / lin_flops)))


def rows(summary, seqs):
    out = []
    for S in seqs:
        s = summary[(S, "striped")]
        h = attention_cost_factor(S, s["rank_step_s"], s["rank_attention_s"])
        base = summary[(S, "contiguous")]["step_s"]
        for layout in reference.LAYOUTS:
            m = summary[(S, layout)]
            measured = base / m["step_s"]
            opts = dict(linear_flops_per_token=CONFIG.linear_flops_per_token(), d_model=CONFIG.d_model, h=h,
                        n_seq=S, n_devices=N_RANKS, layout=layout, tile_size=TILE)
            pairs, tiles = speedup.tms(**opts, mode="pairs"), speedup.tms(**opts, mode="tiles")
            share = float(np.mean(m["rank_attention_s"] / m["rank_step_s"]))
            out.append(dict(S=S, layout=layout, step_ms=1e3 * m["step_s"], wall_ms=1e3 * m["wall_s"], share=share,
                            h=h, measured=measured, tms=pairs, tms_tiles=tiles))
    return out


def measured_markdown(rs):
    body = [(r["S"], r["S"] // N_RANKS, r["layout"], f"{r['step_ms']:.0f}", f"{r['wall_ms']:.0f}",
             f"{r['share']:.0%}", f"{r['h']:.2f}",
             f"{r['measured']:.2f}", f"{r['tms']:.2f}", f"{r['tms_tiles']:.2f}",
             f"{r['measured'] / r['tms']:.2f}", f"{r['measured'] / r['tms_tiles']:.2f}") for r in rs]
    return markdown_table(("S", "c", "layout", "step ms", "wall ms", "in ring", "h", "speed-up", "TMS",
                           "TMS tiles", "speed-up / TMS", "speed-up / TMS tiles"), body, "rrlrrrrrrrrr")


def paper_markdown(tables=None):
    rows_ = speedup.paper_rows_tile_aware(tables)
    summary = []
    for table in dict.fromkeys(r["table"] for r in rows_):
        sub = [r for r in rows_ if r["table"] == table]
        a = [r["speedup"] / r["tms"] for r in sub]
        b = [r["speedup"] / r["tms_tiles"] for r in sub]
        hw, tile = sub[0]["hardware"], sub[0]["tile"]
        summary.append((table, hw, f"{tile[0]} x {tile[1]}", len(sub), f"{min(a):.2f} .. {max(a):.2f}",
                        f"{min(b):.2f} .. {max(b):.2f}"))
    parts = [markdown_table(("paper table", "hardware", "tile", "rows", "speed-up / TMS", "speed-up / TMS tiles"),
                            summary, "llrrrr")]
    for table in [t for t in ("3", "5") if tables is None or t in tables]:
        sub = [r for r in rows_ if r["table"] == table]
        body = [(r["model"], f"{r['model_parallel']} x {r['seq_parallel']}", r["n_seq"], r["n_seq"] // r["seq_parallel"],
                 f"{r['tms']:.2f}", f"{r['tms_tiles']:.2f}", f"{r['speedup']:.2f}", f"{r['speedup'] / r['tms']:.2f}",
                 f"{r['speedup'] / r['tms_tiles']:.2f}") for r in sub]
        parts += [f"Paper Table {table} (A100, tiles 2048 x 4096):",
                  markdown_table(("model", "mesh m x N", "n_seq", "c", "TMS", "TMS tiles", "speed-up paper",
                                  "speed-up / TMS", "speed-up / TMS tiles"), body)]
    return "\n\n".join(parts)


def smallest_blocks_note(tables=None):
    """The A100 rows at c = 4096, where tiles of 2048 x 4096 leave striped nothing to skip."""
    sub = [r for r in speedup.paper_rows_tile_aware(tables) if r["hardware"] == "a100"
           and r["n_seq"] // r["seq_parallel"] == 4096]
    assert all(r["tms_tiles"] == 1.0 for r in sub)
    lo = lambda key: min(r[key] for r in sub)
    hi = lambda key: max(r[key] for r in sub)
    return ("The paper's own rows recomputed tile-aware, at the tile sizes of its section 3.1 (A100: 2048 "
            "queries x 4096 keys; TPU: 2048 x 2048) with its h (2 on A100, 1 on TPU); model parallelism "
            f"cancels, as in the paper. At c = 4096 on A100 ({len(sub)} rows) a striped block is one column "
            "of two tiles, each holding a visible pair: striped skips nothing and its tile-aware TMS is 1.00, "
            f"where the pair-counted TMS says {lo('tms'):.2f} to {hi('tms'):.2f}; the paper measured "
            f"{lo('speedup'):.2f} to {hi('speedup'):.2f}.")


def plot(rs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for layout, color in (("striped", "C0"), ("zigzag", "C1")):
        sub = [r for r in rs if r["layout"] == layout]
        S = [r["S"] for r in sub]
        ax.plot(S, [r["measured"] for r in sub], "o-", color=color, label=f"{layout}: measured")
        ax.plot(S, [r["tms"] for r in sub], "--", color=color, label=f"{layout}: TMS (pairs)")
        ax.plot(S, [r["tms_tiles"] for r in sub], ":", color=color, label=f"{layout}: TMS (tiles)")
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="sequence length S", ylabel="training-step speed-up over contiguous",
           title=f"The model on {N_RANKS} MPI ranks, tiles {TILE} x {TILE}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(quick=True, *, results_dir=RESULTS, progress=None, seqs=None, paper_tables=None):
    """Markdown and the plot. `seqs` and `paper_tables` (default: all) narrow it for a smoke test."""
    seqs = seqs or (QUICK_SEQS if quick else FULL_SEQS)
    summary = summarize(launch(seqs, progress))
    rs = rows(summary, seqs)
    c = CONFIG
    text = "\n\n".join([
        f"One Adam step of `model` (d = {c.d_model}, {c.n_head} heads of {c.head_dim}, {c.n_layer} layers, "
        f"d_ff = {c.d_ff}, V = {c.vocab}, B = 1, float32, ring tiles {TILE} x {TILE}) on N = {N_RANKS} MPI "
        f"ranks, one BLAS thread each: `OPENBLAS_NUM_THREADS=1 mpiexec -n {N_RANKS} python -m mpi4py -m "
        f"bench.model_step --worker OUT.json --seqs {' '.join(map(str, seqs))}` (run by `python -m "
        f"bench.model_step{'' if quick else ' --full'}`). *Step*: CPU time of the busiest rank in one step "
        f"(forward, backward through the ring, allreduce, Adam), best of {REPEAT} steps after {WARMUP} untimed, "
        f"the layouts taking turns step by step. CPU time, because the machine is shared: it is the step's "
        f"time with a core per rank (MPI ranks spin while they wait, so waiting for the busiest rank counts); "
        f"*wall*: the best step's wall time, for reference. *Speed-up*: contiguous's step over the layout's. "
        f"*In ring*: share of the step inside the ring (forward + backward). *h*: the measured cost of an "
        f"attention FLOP (of the tiles computed) against a linear-layer FLOP, from the striped run. "
        f"*TMS*: paper section 4 for this model, pair-counted; *TMS tiles*: the same with the critical "
        f"path's tile area (`model.speedup`). Sizes are modest because the machine is shared.",
        measured_markdown(rs),
        smallest_blocks_note(paper_tables),
        paper_markdown(paper_tables),
    ])
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    return text + "\n", [plot(rs, results_dir / "model_step.png")]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.model_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help=f"S = {FULL_SEQS} (default {QUICK_SEQS})")
    ap.add_argument("--worker", metavar="OUT.json", help="run as an MPI rank and write the step times")
    ap.add_argument("--seqs", type=usage.count, nargs="+", default=None, help="sequence lengths (worker)")
    ap.add_argument("--results", type=usage.output_folder, default=str(RESULTS),
                    help="folder for the plot (default %(default)s)")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.seqs or QUICK_SEQS)
        return
    text, pngs = run(not args.full, results_dir=args.results,
                     progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(text)
    print("plots:", *pngs, file=sys.stderr)


if __name__ == "__main__":
    main()
