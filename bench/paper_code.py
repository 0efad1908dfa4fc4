"""N virtual devices against the paper authors' JAX ring attention, on the same inputs.

The paper's code (github.com/exists-forall/striped_attention, ``bpt.py``:
`ring_attention` with ``causal_layout="normal"`` for contiguous blocks and
``"striped"`` for striped ones) runs under `shard_map` on N CPU devices of one
process (``XLA_FLAGS=--xla_force_host_platform_device_count=N``), jit-compiled,
with chunks of T queries by T keys, as the authors' model calls it
(float32 logits, checkpoint policy ``nothing_saveable``). Beside it,
`reference.ring_attention` and `ring_attention_backward` on N virtual devices,
tiles of T, step "auto", threads as `reference.cores` shares them. Both get the
same float32 inputs (written once, read by both), causal, forward and backward,
and both sides' results are compared, so that the times are of the same work.

The project does not ship that code or JAX: pass the path of ``bpt.py`` and a
Python that has jax, flax and einops (bpt.py imports them). The JAX side runs
in that Python, in a process of its own; ours in this one. Each is timed as
the best of --repeats after one untimed run (JAX's includes compiling);
ours includes sharding and unsharding the natural-order arrays, theirs takes
inputs already permuted (striped) and placed on the devices.

    python -m venv /tmp/jaxvenv && /tmp/jaxvenv/bin/pip install 'jax[cpu]' numpy flax einops
    git clone https://github.com/exists-forall/striped_attention /tmp/striped_attention
    python -m bench.paper_code --bpt /tmp/striped_attention/bpt.py --jax-python /tmp/jaxvenv/bin/python
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

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"contiguous": "normal", "striped": "striped"}     # ours -> bpt.py's causal_layout
NAMES = ("q", "k", "v", "dout")


# -- the JAX side (runs in the other Python: jax and numpy only) --------------------

def jax_worker(args):
    """Time bpt.ring_attention forward + backward for each layout and tile; write
    their results beside the inputs and print one JSON line of timings."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.n_devices}").strip()
    import importlib.util
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    spec = importlib.util.spec_from_file_location("bpt", args.bpt)
    bpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bpt)
    data = np.load(args.inputs)
    q, k, v, dout = (data[n] for n in NAMES)                         # (B, S, H, D) natural order
    S, N = q.shape[1], args.n_devices
    mesh = Mesh(np.array(jax.devices()[:N]), ("sp",))
    seq = NamedSharding(mesh, P(None, "sp", None, None))
    results, out = {"jax": jax.__version__, "devices": len(jax.devices())}, {}
    for layout, causal_layout in LAYOUTS.items():
        order = _striped_order(S, N) if layout == "striped" else np.arange(S)   # bpt.permute_tokens
        inputs = [jax.device_put(x[:, order], seq) for x in (q, k, v, dout)]
        bias = jax.device_put(np.zeros((1, 1, 1, S), np.float32), NamedSharding(mesh, P()))
        for tile in args.tiles:
            fn = jax.jit(_fwd_bwd(bpt, mesh, causal_layout, tile, S // N))
            res = jax.block_until_ready(fn(*inputs, bias))               # compiles
            results[f"{layout} {tile}"] = _best(lambda: jax.block_until_ready(fn(*inputs, bias)), args.repeats)
            back = np.argsort(order)                                     # bpt.unpermute_outputs
            for name, x in zip(("out", "dq", "dk", "dv"), res):
                out[f"{layout} {tile} {name}"] = np.asarray(x)[:, back]
    np.savez(args.results, **out)
    print(json.dumps(results))


def _fwd_bwd(bpt, mesh, causal_layout, tile, block_size):
    """out and the gradients of <out, dout> with respect to q, k, v, as the paper's model calls ring_attention."""
    from functools import partial
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    try:
        from jax import shard_map
    except ImportError:                                   # jax before 0.7
        from jax.experimental.shard_map import shard_map
    import inspect
    unchecked = {"check_vma": False} if "check_vma" in inspect.signature(shard_map).parameters else {"check_rep": False}
    attend = partial(bpt.ring_attention, axis_name="sp", float32_logits=True, blockwise_kwargs=dict(
        deterministic=True, dropout_rng=None, attn_pdrop=0.0, causal_layout=causal_layout,
        query_chunk_size=tile, key_chunk_size=tile, block_size=block_size, dtype=jnp.float32,
        policy=jax.checkpoint_policies.nothing_saveable, precision=None, prevent_cse=True))
    seq = P(None, "sp", None, None)
    sharded = shard_map(attend, mesh=mesh, in_specs=(seq, seq, seq, P()), out_specs=seq, **unchecked)

    def fwd_bwd(q, k, v, dout, bias):
        out, vjp = jax.vjp(lambda q, k, v: sharded(q, k, v, bias), q, k, v)
        return (out, *vjp(dout))
    return fwd_bwd


def _striped_order(S, N):
    """Natural positions in bpt.permute_tokens' order: 'b (n d) -> b (d n)', d = N."""
    return np.arange(S).reshape(S // N, N).T.reshape(-1)


def _best(fn, repeats):
    """(least wall seconds, least CPU seconds of the whole process, every thread) of `repeats` calls."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - start), min(cpu, time.process_time() - start_cpu)
    return wall, cpu


# -- our side, and the comparison ------------------------------------------------------

def ours(inputs, n_devices, layout, tile, repeats, step="auto"):
    """(best seconds of forward + backward on N virtual devices, out, dq, dk, dv, the Trace's threads)."""
    from reference import ring_attention, ring_attention_backward
    q, k, v, dout = inputs
    opts = dict(n_devices=n_devices, layout=layout, tile_size=tile, step=step)

    def run():
        out, lse, trace = ring_attention(q, k, v, trace=True, **opts)
        return (out, *ring_attention_backward(q, k, v, out, lse, dout, **opts)), getattr(trace, "threads", "")
    results, threads = run()                                        # untimed, as JAX's compile run
    return (*_best(run, repeats), *results, threads)


def run_jax(python, bpt, inputs_path, results_path, n_devices, tiles, repeats):
    cmd = [python, "-m", "bench.paper_code", "--worker", "--bpt", str(bpt), "--inputs", str(inputs_path),
           "--results", str(results_path), "--n-devices", str(n_devices), "--repeats", str(repeats),
           "--tiles", *map(str, tiles)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the JAX side failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def compare(args):
    from reference import cores
    from .machine import cpu_name
    from . import markdown_table
    rng = np.random.default_rng(args.seed)
    shape = (1, args.seq_len, args.heads, args.head_dim)
    inputs = tuple(rng.standard_normal(shape, dtype=np.float32) for _ in NAMES)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        inputs_path, results_path = Path(tmp) / "inputs.npz", Path(tmp) / "results.npz"
        np.savez(inputs_path, **dict(zip(NAMES, inputs)))
        print(f"  paper_code: the JAX side ({args.jax_python})", file=sys.stderr, flush=True)
        theirs = run_jax(args.jax_python, args.bpt, inputs_path, results_path, args.n_devices, args.tiles,
                         args.repeats)
        got = np.load(results_path)
        for layout in LAYOUTS:
            for tile in args.tiles:
                print(f"  paper_code: ours, {layout}, tiles of {tile}", file=sys.stderr, flush=True)
                seconds, cpu, *results, threads = ours(inputs, args.n_devices, layout, tile, args.repeats,
                                                       args.step)
                diff = max(float(np.abs(a - got[f"{layout} {tile} {n}"]).max() / np.abs(a).max())
                           for n, a in zip(("out", "dq", "dk", "dv"), results))
                jax_s, jax_cpu = theirs[f"{layout} {tile}"]
                rows.append([layout, f"{tile} x {tile}", f"{seconds:.2f}", f"{jax_s:.2f}", f"{seconds / jax_s:.2f}",
                             f"{cpu:.2f}", f"{jax_cpu:.2f}", f"{cpu / jax_cpu:.2f}", f"{diff:.1e}"])
    S, N = args.seq_len, args.n_devices
    text = "\n".join([
        f"Made by `python -m bench.paper_code --bpt PATH/bpt.py --jax-python PATH/python` on "
        f"{cores.available_cores()} cores ({cpu_name()}), BLAS {cores.blas_description()}; "
        f"JAX {theirs['jax']} on {theirs['devices']} CPU devices. S = {S}, N = {N}, H = {args.heads}, "
        f"D = {args.head_dim}, float32, causal, forward + backward, best of {args.repeats} after one untimed run. "
        f"Ours: `reference.ring_attention` + `ring_attention_backward`, step {args.step}, {threads}. "
        "*CPU*: the process's CPU seconds over the same calls, every thread (spinning ones too), least of the "
        "repeats: on a machine others use too, wall times follow the machine's load and CPU times much less. "
        "Difference: the largest over out, dq, dk, dv of |ours - theirs| / max |ours|.",
        "",
        markdown_table(["layout", "tile", "ours s", "paper's JAX s", "ours / JAX", "ours CPU s", "JAX CPU s",
                        "ours / JAX, CPU", "difference"], rows, "llrrrrrrr"),
    ])
    return text + "\n"


def main(argv=None):
    from reference import steps, usage       # not at the top: the JAX side imports this module too
    ap = argparse.ArgumentParser(prog="python -m bench.paper_code", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bpt", required=True, help="path of the paper authors' bpt.py")
    ap.add_argument("--jax-python", default=sys.executable,
                    help="a Python with jax, flax and einops (default: this one)")
    ap.add_argument("--seq-len", type=usage.count, default=8192, help="tokens S (default %(default)s)")
    ap.add_argument("--n-devices", type=usage.count, default=8, help="devices N (default %(default)s)")
    ap.add_argument("--heads", type=usage.count, default=4, help="heads H (default %(default)s)")
    ap.add_argument("--head-dim", type=usage.count, default=64, help="head dim D (default %(default)s)")
    ap.add_argument("--tiles", type=usage.count, nargs="+", default=[128, 256], help="tile sides T (default 128 256)")
    ap.add_argument("--step", default="auto", choices=steps.names(), help="our step (default %(default)s)")
    ap.add_argument("--repeats", type=usage.count, default=3, help="best of (default %(default)s)")
    ap.add_argument("--seed", type=usage.natural, default=0, help="seed of the random inputs")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)     # the JAX side
    ap.add_argument("--inputs", help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not Path(args.bpt).is_file():
        ap.error(f"--bpt {args.bpt}: no such file")
    if args.worker:
        return jax_worker(args)
    print(compare(args))


if __name__ == "__main__":
    main()
