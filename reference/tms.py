"""Theoretical Maximum Speedup (TMS) of Striped over Ring Attention, by counting FLOPs.

The paper's section 4: one training step timed as the FLOPs on the critical path
(communication overlapped, non-matmul work free), with Ring Attention's busiest
device and with Striped Attention's; TMS is the ratio. It reproduces every TMS of
Tables 3, 4, 5 and Appendix A.1-A.3 (`reference/data/paper_tms.csv`) to within
rounding (largest residual 0.00497 over 190 rows).

Letters: N devices, S = n_seq, c = S // N, d = d_model, f = d_ff, V = n_vocab,
L = n_layer, h = the cost of an attention FLOP against another. Per device and layer:

    F_lin  = c * (8 d^2 + 4 d f + 2 d V / L)     QKV+O, MLP, LM head
    P_ring = c(c+1)/2 + (N-1) c^2                 busiest device's (query, key) pairs
    P_str  = N * c(c+1)/2
    TMS    = (F_lin + 4 d h P_ring) / (F_lin + 4 d h P_str)

- 2 FLOPs per weight and token (Kaplan et al. 2020): the LM head once per model,
  so 2 d V / L a layer. The printed TMS follow a 2-matrix MLP (6 d f for Table 1's
  SwiGLU misses by up to 0.056).
- 4 d per visible pair (S = Q K^T and P V); h = 2 on A100 (attention in TF32,
  the rest in bfloat16), 1 on TPU.
- P_ring: round 0 is the diagonal block, and each of the other N-1 rounds waits
  for a fully visible block; P_str: Work(i, j) = c(c+1)/2 if i >= j else
  c(c-1)/2 (section 2.2), and every round has a device with i >= j.
- The backward (3x every term) and model parallelism (heads and d_ff split
  evenly) cancel. As N and c grow, TMS -> 2 - 1/N -> 2.

    python -m reference.tms                 # every paper row, recomputed
    python -m reference.tms --model 7B --seq-parallel 8 --n-seq 262144 --hardware tpuv4
"""
import argparse
import csv
from pathlib import Path

from . import usage

# Paper Table 1 (from the Ring Attention codebase).
MODELS = {
    "1B": dict(n_vocab=32000, d_model=2048, d_ff=5504, n_layer=22, n_head=16),
    "3B": dict(n_vocab=32000, d_model=3200, d_ff=8640, n_layer=26, n_head=32),
    "7B": dict(n_vocab=32000, d_model=4096, d_ff=11008, n_layer=32, n_head=32),
}

# Cost of one attention FLOP in units of one bf16 matmul FLOP (paper section 4).
HARDWARE = {"a100": 2, "tpuv3": 1, "tpuv4": 1}

PAPER_CSV = Path(__file__).resolve().parent / "data" / "paper_tms.csv"   # package data


def linear_flops_per_token(d_model, d_ff, n_vocab, n_layer):
    """F_lin / c, forward matmul FLOPs per token per layer: 8 d^2 + 4 d f + 2 d V / L."""
    d, f = d_model, d_ff
    return 8 * d * d + 4 * d * f + 2 * d * n_vocab / n_layer


def attention_flops(pairs, head_dim, *, backward=False):
    """Useful attention FLOPs of `pairs` visible (query, key) pairs of one head:
    4 D each forward (S = Q K^T, P V), 10 D backward (S, dV, dP, dQ, dK): the
    count every measured rate divides by (docs/design.md, how fast)."""
    return (10 if backward else 4) * head_dim * pairs


def critical_path_pairs(seq_parallel, c):
    """(ring, striped): sum over rounds of the busiest device's visible (query, key) pairs."""
    diag = c * (c + 1) // 2                        # causal block with its diagonal
    ring = diag + (seq_parallel - 1) * c * c       # round 0, then one full block per round
    striped = seq_parallel * diag                  # Work(i >= j) in every round
    return ring, striped


def theoretical_max_speedup(model, seq_parallel, n_seq, hardware, model_parallel=1):
    """Paper section 4's TMS of Striped over Ring Attention for one training config."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    if hardware not in HARDWARE:
        raise ValueError(f"hardware must be one of {sorted(HARDWARE)}, got {hardware!r}")
    if seq_parallel < 1 or model_parallel < 1:
        raise ValueError(f"seq_parallel and model_parallel must be >= 1, got "
                         f"{seq_parallel} and {model_parallel}")
    if n_seq < 1 or n_seq % seq_parallel:
        raise ValueError(f"n_seq must be a positive multiple of seq_parallel={seq_parallel}, "
                         f"got {n_seq}")
    m = MODELS[model]
    d, f, V, L = m["d_model"], m["d_ff"], m["n_vocab"], m["n_layer"]
    c = n_seq // seq_parallel                                  # tokens per device
    # FLOPs per device per layer; model parallelism splits every term evenly.
    linear = c * linear_flops_per_token(d, f, V, L) / model_parallel
    per_pair = attention_flops(1, d) * HARDWARE[hardware] / model_parallel     # QK^T + PV, hardware-weighted
    ring, striped = critical_path_pairs(seq_parallel, c)
    return (linear + per_pair * ring) / (linear + per_pair * striped)


def paper_rows(path=PAPER_CSV):
    """Rows of reference/data/paper_tms.csv, typed, each with `tms_recomputed` added."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(line for line in fh if not line.startswith("#")))
    for r in rows:
        for k in ("model_parallel", "seq_parallel", "n_seq"):
            r[k] = int(r[k])
        r["tms"], r["speedup"] = float(r["tms"]), float(r["speedup"])
        r["tms_recomputed"] = theoretical_max_speedup(
            r["model"], r["seq_parallel"], r["n_seq"], r["hardware"], r["model_parallel"])
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m reference.tms", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), help="one model of the paper's table (default: all)")
    p.add_argument("--seq-parallel", type=usage.count, default=None, help="devices in the ring N, with --model (default 4)")
    p.add_argument("--n-seq", type=usage.count, default=None,
                   help="sequence length S, a multiple of N, with --model (default 65536)")
    p.add_argument("--hardware", choices=sorted(HARDWARE), default=None,
                   help="the accelerator whose FLOP rate and bandwidth set the overlap, with --model (default a100)")
    args = p.parse_args(argv)
    given = [f"--{name.replace('_', '-')}" for name in ("seq_parallel", "n_seq", "hardware")
             if getattr(args, name) is not None]
    if given and not args.model:
        p.error(f"{', '.join(given)}: for one --model; without it every row of the paper is recomputed as printed")
    args.seq_parallel, args.n_seq = args.seq_parallel or 4, args.n_seq or 65536
    args.hardware = args.hardware or "a100"
    if args.n_seq % args.seq_parallel:
        p.error(f"--n-seq ({args.n_seq}) must be a multiple of --seq-parallel ({args.seq_parallel})")
    if args.model:
        print(f"{theoretical_max_speedup(args.model, args.seq_parallel, args.n_seq, args.hardware):.4f}")
        return
    rows = paper_rows()
    print(f"{'table':>5} {'hw':>5} {'model':>5} {'mesh':>5} {'n_seq':>7} {'paper':>6} {'ours':>7} {'diff':>7}")
    for r in rows:
        mesh = f"{r['model_parallel']}x{r['seq_parallel']}"
        print(f"{r['table']:>5} {r['hardware']:>5} {r['model']:>5} {mesh:>5} {r['n_seq']:>7} "
              f"{r['tms']:>6.2f} {r['tms_recomputed']:>7.4f} {r['tms_recomputed'] - r['tms']:>+7.4f}")
    worst = max(abs(r["tms_recomputed"] - r["tms"]) for r in rows)
    print(f"{len(rows)} rows, largest |ours - paper| = {worst:.5f}")


if __name__ == "__main__":
    main()
