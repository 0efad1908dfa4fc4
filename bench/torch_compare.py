"""torch's CPU attention on the kernel benchmark's shapes, in a process of its own.

`bench.kernel` compares its step with `torch.nn.functional.scaled_dot_product_attention`
(causal, float32, one device holding all S tokens, H heads, D head dim), forward
and backward, each timed here, in a separate process, so that the two libraries'
thread pools never share one. Needs torch (torch==2.13.0, its CPU build), in this
Python or, better, in a venv of its own (`bench.kernel --torch-python`);
without it `available()` is False and the kernel section says so.

    python -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch==2.13.0 numpy
    /tmp/torchvenv/bin/python -m bench.torch_compare --seq-len 8192 --heads 8 --head-dim 64 --threads 2
"""

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def available(python=None):
    """Whether `python` (default: this one) has torch."""
    if python is None:
        return importlib.util.find_spec("torch") is not None
    return subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0


def measure(S, H, D, threads, repeats=3, python=None):
    """{"version", "fwd_s", "bwd_s"}: best of `repeats`, in a child process of
    `python` (default: this one)."""
    cmd = [python or sys.executable, "-m", "bench.torch_compare", "--seq-len", str(S), "--heads", str(H),
           "--head-dim", str(D), "--threads", str(threads), "--repeats", str(repeats), "--json"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"torch measurement failed: {' '.join(cmd)}\n{proc.stderr}")
    return json.loads(proc.stdout.splitlines()[-1])


def time_sdpa(S, H, D, threads, repeats):
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, H, S, D, generator=gen) for _ in range(4))   # (B, H, S, D)
    fwd = bwd = float("inf")
    for _ in range(repeats + 1):                          # the first run warms up
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        start = time.perf_counter()
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
        mid = time.perf_counter()
        out.backward(dout)
        end = time.perf_counter()
        fwd, bwd = min(fwd, mid - start), min(bwd, end - mid)
    return dict(version=torch.__version__, fwd_s=fwd, bwd_s=bwd)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.torch_compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=8192, help="tokens S (default %(default)s)")
    ap.add_argument("--heads", type=int, default=8, help="heads H (default %(default)s)")
    ap.add_argument("--head-dim", type=int, default=64, help="head dim D (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="best of (default %(default)s)")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args(argv)
    if not available():
        ap.exit(2, "torch is not installed: pip install -e '.[compare]'\n")
    r = time_sdpa(args.seq_len, args.heads, args.head_dim, args.threads, args.repeats)
    print(json.dumps(r) if args.json else
          f"torch {r['version']} sdpa, S={args.seq_len} H={args.heads} D={args.head_dim}: "
          f"forward {r['fwd_s']:.3f} s, backward {r['bwd_s']:.3f} s")


if __name__ == "__main__":
    main()
