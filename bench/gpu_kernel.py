"""The tensor-core kernel (gpu_impl.fused_v2), read before it runs, and measured where there is a GPU.

Without a GPU this reads what nvcc makes of the fused kernels for sm_90 (the
H100/H200's architecture): registers, spills, shared memory and occupancy
(ptxas -v, and the CUDA occupancy rules of sm_90), the SASS instruction mix
(cuobjdump), and the rate expected of version 2 with its reasoning, version 1
beside it. Nothing here is a measured speed: the expectation is to be replaced
by the rate `make gpu-check` measures on a first GPU.

With a GPU, `gpu_check()` (a step of scripts/gpu_check.py) first checks
version 2 against the readable step on the GPU (D = 64 and 128, float16 and
bfloat16, GQA, causal and a window over documents), then times versions 1 and
2 and torch's flash attention on one block, every tile visible.

    python -m bench.gpu_kernel                  # the section, printed (needs nvcc and cuobjdump)
    python -m bench.run --only gpu_kernel       # into BENCHMARKS.md
"""

import argparse
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from . import markdown_table

ROOT = Path(__file__).resolve().parents[1]

# sm_90 (H100 SXM / H200), per SM: the occupancy rules (CUDA C Programming
# Guide, "Compute capabilities") and the throughputs the expectation uses.
SM90 = dict(regs=65536, reg_unit=256, max_warps=64, max_blocks=32, smem=233472, smem_per_block_reserved=1024)
H200 = dict(sms=132, clock_ghz=1.98,            # boost clock
            smem_bytes_per_clk=128,             # shared memory (ldmatrix) bandwidth per SM
            ex2_per_clk=16,                     # MUFU.EX2 per SM
            mma_sync_tflops=660,                # assumed: mma.sync reaches about 2/3 of the 989 TFLOP/s
                                                # dense FP16 peak (that peak needs wgmma)
            fa2_tflops=(250, 350))              # FlashAttention-2's forward on the same chip
V1_ESTIMATE = {64: (10, 25), 128: (6, 15)}      # version 1 (SIMT), TFLOP/s, estimated from its SASS
RATE_BLOCK = 8192                               # the timed block: 8192 queries x 8192 keys
CHECK_SEQ = 4096                                # the check against the readable step: 4 striped blocks


def tool(name):
    """A CUDA binary tool on PATH, or from its nvidia-cuda-* wheel beside this Python."""
    found = shutil.which(name)
    if found:
        return found
    for site in map(Path, sys.path):
        for candidate in site.glob(f"nvidia/cu*/bin/{name}"):
            return str(candidate)
    return None


# -- read before it runs -------------------------------------------------------------

def _version(path):
    """"13.0.88" from `nvcc --version`'s last line (", V13.0.88")."""
    text = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"V(\d+\.\d+\.\d+)", text)
    return found.group(1) if found else "?"


def nvcc_command(source, options, cubin):
    """nvcc for sm_90, with ptxas's report of registers, spills and shared memory on stderr."""
    return [tool("nvcc"), "-arch=sm_90", "-cubin", "-Xptxas", "-v", *options, "-o", str(cubin), str(source)]


def compile_report(source, options, out_dir):
    """{registers, spill bytes, stack, sass: {instruction: count}} of one build for sm_90."""
    cubin = Path(out_dir) / "k.cubin"
    proc = subprocess.run(nvcc_command(source, options, cubin), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    report = dict(registers=int(re.search(r"Used (\d+) registers", proc.stderr).group(1)),
                  spills=sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", proc.stderr)),
                  stack=int(re.search(r"(\d+) bytes stack frame", proc.stderr).group(1)),
                  static_smem=int((re.search(r"(\d+) bytes smem", proc.stderr) or [0, 0])[1]), sass={})
    dump, disasm = tool("cuobjdump"), tool("nvdisasm")
    if dump and disasm:
        sass = subprocess.run([dump, "--dump-sass", str(cubin)], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, NVDISASM_PATH=disasm)).stdout
        ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, re.M)
        report["sass"] = {op: ops.count(op) for op in set(ops)}
        report["sass"]["total"] = len(ops)
    return report


def occupancy(registers, threads, smem_bytes):
    """(blocks per SM, warps per SM, what limits them) on sm_90."""
    warps = math.ceil(threads / 32)
    per_warp = math.ceil(registers * 32 / SM90["reg_unit"]) * SM90["reg_unit"]
    limits = {"registers": SM90["regs"] // per_warp // warps,
              "shared memory": SM90["smem"] // (smem_bytes + SM90["smem_per_block_reserved"]),
              "warps": SM90["max_warps"] // warps, "blocks": SM90["max_blocks"]}
    blocks = min(limits.values())
    return blocks, blocks * warps, min(limits, key=limits.get)


def expected_tflops(head_dim, rows_per_warp=16):
    """The rate expected of version 2's inner loop on an H200, and the
    ceilings it is made of (TFLOP/s of useful work, 4 D FLOPs per pair):

    - shared memory: per warp and key tile, ldmatrix reads the K and V tiles
      once (2 * BN * D 16-bit values) for 16 * BN pairs, so D / 4 bytes per
      pair per 16 rows a warp holds: 4 D / (D / 4) = 16 FLOPs per byte;
    - the exponential: one MUFU.EX2 per pair;
    - the tensor cores through mma.sync (assumed, see H200).
    Issued one after another (the warps of an SM overlap them only partly),
    the time per pair is the sum of the three."""
    sm = H200["sms"] * H200["clock_ghz"] * 1e9 / 1e12              # TFLOP/s per FLOP/clk/SM
    ceilings = {"shared memory": 16 * rows_per_warp / 16 * H200["smem_bytes_per_clk"] * sm,
                "exp": 4 * head_dim * H200["ex2_per_clk"] * sm,
                "tensor cores": H200["mma_sync_tflops"]}
    serial = 1 / sum(1 / c for c in ceilings.values())
    return serial, ceilings


def read_section():
    """The markdown of what nvcc makes of both versions, and the expectation."""
    from gpu_impl import fused, fused_v2
    if tool("nvcc") is None:
        return "nvcc not found: the kernels were not compiled here.\n"
    rows, v2_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for head_dim in fused_v2.HEAD_DIMS:
            for bf16 in (False, True):
                config = fused_v2.Config(head_dim, *fused_v2.DEFAULT_CONFIG[head_dim], bf16)
                r = compile_report(fused_v2.SOURCE, config.options(), tmp)
                blocks, warps, limit = occupancy(r["registers"], config.threads, config.shared_bytes)
                sass = r["sass"]
                rows.append([f"v2 {'bfloat16' if bf16 else 'float16'}", head_dim,
                             f"{config.rows} x {config.bn}, {config.warps} warps", r["registers"], r["spills"],
                             f"{config.shared_bytes / 1024:.1f} KiB", f"{blocks} ({warps} warps, {limit})",
                             sass.get("HMMA", "?"), sass.get("LDSM", "?"), sass.get("LDGSTS", "?"),
                             sass.get("SHFL", "?"), sass.get("MUFU", "?"), sass.get("total", "?")])
                v2_rows.append((head_dim, bf16, r))
            tq, tk = fused.DEFAULT_TILE
            r = compile_report(fused.SOURCE, [o for o in fused.compile_options(head_dim, (tq, tk), True)], tmp)
            smem = (2 * tk * head_dim + tk * tq) * 4 + tk * 9 + 8
            blocks, warps, limit = occupancy(r["registers"], tq, smem)
            sass = r["sass"]
            rows.append(["v1 float16 K/V", head_dim, f"{tq} x {tk}, {tq // 32} warps", r["registers"], r["spills"],
                         f"{smem / 1024:.1f} KiB", f"{blocks} ({warps} warps, {limit})", sass.get("HMMA", 0),
                         sass.get("LDSM", 0), sass.get("LDGSTS", 0), sass.get("SHFL", 0), sass.get("MUFU", "?"),
                         sass.get("total", "?")])
    table = markdown_table(["kernel", "D", "tile (rows x keys)", "registers", "spill bytes", "shared memory",
                            "CTAs per SM", "HMMA", "LDSM", "LDGSTS", "SHFL", "MUFU", "SASS total"],
                           rows, "lrlrrrlrrrrrr")
    expect = []
    for head_dim in fused_v2.HEAD_DIMS:
        serial, ceilings = expected_tflops(head_dim)
        fa2 = H200["fa2_tflops"]
        expect.append([head_dim, *(f"{c:.0f}" for c in ceilings.values()), f"{serial:.0f}",
                       f"{serial / fa2[1]:.0%} to {min(1.0, serial / fa2[0]):.0%}",
                       "{} to {}".format(*V1_ESTIMATE[head_dim])])
    expectation = markdown_table(["D", "shared memory ceiling", "exp ceiling", "mma.sync ceiling (assumed)",
                                  "expected v2 (in turn)", "share of FlashAttention-2", "v1 (estimated)"],
                                 expect, "rrrrrrr")
    return "\n".join([
        f"Compiled here for sm_90 by nvcc {_version(tool('nvcc'))} (`nvcc -arch=sm_90 -cubin -Xptxas -v`, the SASS read with "
        "`cuobjdump --dump-sass`); default tiles of each version, float16 or bfloat16 K and V. Occupancy from "
        "the sm_90 limits: 65,536 registers, 64 warps, 228 KiB of shared memory, 32 CTAs per SM.",
        "", table, "",
        "Not measured: no GPU here. **Expected** rate of version 2's forward on an H200 (TFLOP/s of useful "
        "work, 4 D FLOPs per visible pair and query head; 132 SMs at 1.98 GHz): per pair a warp reads D / 4 "
        "bytes of K and V through ldmatrix (16 rows share each fragment: 16 FLOPs per byte, 128 bytes per "
        "clock and SM), computes one exponential (16 MUFU.EX2 per clock and SM) and 4 D FLOPs on the tensor "
        "cores through mma.sync (assumed to reach 2/3 of the 989 TFLOP/s dense peak, which needs wgmma). "
        "Taken in turn, the time per pair is the sum of the three; the same arithmetic with FlashAttention-2's "
        "32 rows per warp gives {} TFLOP/s, within the 250-350 it reaches on this chip. So version 2 is "
        "expected near three quarters of FlashAttention-2, held back by its 16 rows per warp (twice the "
        "shared-memory reads per FLOP); version 1 by its SIMT products.".format(" and ".join(
            f"{expected_tflops(d, rows_per_warp=32)[0]:.0f} (D = {d})" for d in fused_v2.HEAD_DIMS)),
        "", expectation, "",
        "To be replaced by the rate measured on a first GPU (`make gpu-check`, step \"tensor cores\").", ""])


# -- on a GPU ------------------------------------------------------------------------------

def _inputs(rng, shape, kv_format):
    """Random values rounded to the 16-bit type: (NumPy array of that type, float32 copy)."""
    from reference.testing.compare import BFLOAT16
    dtype = np.float16 if kv_format == "float16" else BFLOAT16
    x = rng.standard_normal(shape).astype(dtype)
    return x, x.astype(np.float32)


def _on_gpu(cupy, x, kv_format):
    """A 16-bit array on the GPU: float16 as it is, bfloat16 as its bits (CuPy has no bfloat16)."""
    return cupy.asarray(x if kv_format == "float16" else x.view(np.uint16))


def check_against_readable(cupy, seq=CHECK_SEQ, n=4, hq=8, hkv=2, make_v2=None):
    """(ok, markdown): version 2 against the readable step on the GPU, one
    query shard accumulated over n striped blocks. `make_v2(kv_format)`: the
    Step to check (default `fused_v2.TensorCoreStep`; the tests pass the CPU
    emulation, with NumPy as `cupy`)."""
    from gpu_impl.fused_v2 import HEAD_DIMS, TensorCoreStep
    from reference import ring
    from reference.layouts import positions, shard
    from reference.masks import CAUSAL, make_mask
    from reference.step import ForwardAcc, Queries, ReadableStep, finish_forward
    from reference.testing.compare import TOL
    rows, ok = [], True
    for head_dim in HEAD_DIMS:
        for kv_format in ("float16", "bfloat16"):
            rng = np.random.default_rng(head_dim)
            (q16, q), (k16, k), (v16, v) = (_inputs(rng, (1, seq, h, head_dim), kv_format) for h in (hq, hkv, hkv))
            pos = positions(seq, n, "striped")
            for name, mask in (("causal", CAUSAL), (f"window {seq // 4}, 3 documents",
                                                    make_mask(window=seq // 4, cu_seqlens=[0, seq // 4,
                                                                                          seq * 5 // 8, seq]))):
                queries = Queries.prepare(cupy.asarray(shard(q, n, "striped")[n - 1]), hkv, pos[n - 1],
                                          head_dim ** -0.5)
                accs = ForwardAcc.zeros(queries.q), ForwardAcc.zeros(queries.q)
                step = (make_v2 or TensorCoreStep)(kv_format=kv_format)
                for j in range(n):
                    plain = ring.own_block(*(cupy.asarray(shard(x, n, "striped")[j]) for x in (k, v)), pos[j], j)
                    ReadableStep().forward(accs[0], queries, plain, mask=mask, tile_size=512)
                    block = ring.own_block(*(_on_gpu(cupy, shard(x, n, "striped")[j], kv_format)
                                             for x in (k16, v16)), pos[j], j)
                    step.forward(accs[1], queries, block, mask=mask, tile_size=None)
                (o0, l0), (o1, l1) = ((cupy.asnumpy(x) for x in finish_forward(a)) for a in accs)
                err = float(np.abs(o1 - o0).max() / max(1.0, np.abs(o0).max()))
                seen = np.isfinite(l0)
                lse_err = float(np.abs(l1[seen] - l0[seen]).max() / max(1.0, np.abs(l0[seen]).max()))
                tol = TOL[np.dtype(q16.dtype)].atol
                good = err <= tol and lse_err <= TOL[np.dtype(np.float32)].atol and not np.isnan(o1).any()
                ok &= good
                rows.append([head_dim, kv_format, name, f"{err:.1e}", f"{lse_err:.1e}", f"{tol:.1e}",
                             "ok" if good else "FAILED"])
    head = (f"Version 2 against the readable step (float32 on the same 16-bit values), S = {seq} on {n} striped "
            f"blocks, the last device's queries, Hq = {hq}, Hkv = {hkv}; errors scaled by max(1, |readable|).\n\n")
    return ok, head + markdown_table(["D", "K/V", "mask", "out error", "lse error", "out limit", ""], rows,
                                     "rllrrrl")


def sanitizer_launches(cupy, make_v2=None):
    """Version 2's launches for compute-sanitizer (make gpu-check's step 9): D = 128,
    float16 and bfloat16, 100 queries and keys (not a multiple of any tile), a window
    of 24 (tiles masked, skipped and full), a NaN in V (the guarded path); returns
    whether every out is finite where the NaN cannot reach and NaN where it does."""
    from gpu_impl.fused_v2 import TensorCoreStep
    from reference import ring
    from reference.masks import make_mask
    from reference.heads import q_from_heads
    from reference.step import ForwardAcc, Queries, finish_forward
    ok, c, window, bad = True, 100, 24, 40                  # key 40 holds a NaN in V
    for kv_format in ("float16", "bfloat16"):
        rng = np.random.default_rng(7)
        (_, q), (k16, _), (v16, _) = (_inputs(rng, (1, c, h, 128), kv_format) for h in (4, 2, 2))
        v16[0, bad, 0, 5] = np.nan
        queries = Queries.prepare(cupy.asarray(q), 2, np.arange(c), 128 ** -0.5)
        acc = ForwardAcc.zeros(queries.q)
        block = ring.own_block(_on_gpu(cupy, k16, kv_format), _on_gpu(cupy, v16, kv_format), np.arange(c), 0)
        (make_v2 or TensorCoreStep)(kv_format=kv_format).forward(acc, queries, block, mask=make_mask(window=window),
                                                                  tile_size=None)
        out = q_from_heads(cupy.asnumpy(finish_forward(acc)[0]))[0]      # (c, 4 query heads, 128)
        sees = (np.arange(c) >= bad) & (np.arange(c) < bad + window)
        ok &= bool(np.isnan(out[sees, :2, 5]).all() and np.isfinite(out[~sees]).all())
    return ok


def torch_flash_seconds(c, hq, hkv, head_dim, kv_format, repeat=5):
    """Seconds of torch's flash attention on one block (K/V heads repeated for
    the group), or None without torch on CUDA."""
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    from .gpu_bench import timed
    dtype = torch.float16 if kv_format == "float16" else torch.bfloat16
    q = torch.randn(1, hq, c, head_dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, hkv, c, head_dim, device="cuda", dtype=dtype).repeat_interleave(hq // hkv, 1)
            for _ in range(2))

    def fn():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v)
    return timed(torch.cuda.synchronize, fn, repeat=repeat)


def rates(cupy, c=RATE_BLOCK, hq=8, hkv=2, launches=10, make_v2=None, with_v1=True):
    """Markdown: v1, v2 and torch's flash attention on one block pair, every
    tile visible (`make_v2`, as `check_against_readable`; v1 takes float16 only)."""
    from gpu_impl import fused_v2
    from reference import ring, steps
    from reference.step import ForwardAcc, Queries
    from reference.tiles import classify
    from .gpu_bench import timed
    sync = cupy.cuda.Device().synchronize
    rows = []
    for head_dim in fused_v2.HEAD_DIMS:
        useful = 4 * head_dim * c * c * hq
        for kv_format in ("float16", "bfloat16"):
            rng = np.random.default_rng(1)
            (q16, q), (k16, _), (v16, _) = (_inputs(rng, (1, c, h, head_dim), kv_format) for h in (hq, hkv, hkv))
            queries = Queries.prepare(cupy.asarray(q), hkv, np.arange(c) + c, head_dim ** -0.5)
            acc = ForwardAcc.zeros(queries.q)
            block = ring.own_block(_on_gpu(cupy, k16, kv_format), _on_gpu(cupy, v16, kv_format), np.arange(c), 0)
            timings = []
            if kv_format == "float16" and with_v1:
                v1 = steps.get("fused")
                timings.append(("fused v1 (SIMT), one call", timed(sync, lambda: v1.forward(
                    acc, queries, block, causal=True, tile_size=None))))
            step = (make_v2 or fused_v2.TensorCoreStep)(kv_format=kv_format)
            timings.append(("fused v2 (tensor cores), one call", timed(sync, lambda: step.forward(
                acc, queries, block, causal=True, tile_size=None))))
            config = fused_v2.kernel_config(None, head_dim, hq // hkv, kv_format)
            kinds = classify(queries.pos, block.pos, (config.queries(hq // hkv), config.bn), True)
            plan = fused_v2.plan_launch(queries, block, queries.mask, config, kinds)
            seconds = timed(sync, lambda: [step.launch(acc, queries, block, plan) for _ in range(launches)]) / launches
            timings.append(("fused v2, the kernel alone", seconds))
            flash = torch_flash_seconds(c, hq, hkv, head_dim, kv_format)
            timings.append(("torch flash attention" if flash else "torch: not installed (or no CUDA)",
                            flash or float("nan")))
            for name, s in timings:
                rows.append([head_dim, kv_format, name, f"{s * 1e3:.3f}", f"{useful / s / 1e12:.1f}"])
    return (f"One block pair, every tile visible: {c} queries x {c} keys, Hq = {hq}, Hkv = {hkv}; useful FLOPs "
            "4 D per pair per query head; best of 5, after a warm-up.\n\n"
            + markdown_table(["D", "K/V", "what", "ms", "TFLOP/s (useful)"], rows, "rllrr"))


def gpu_check(dry=False, small=False):
    """(ok, markdown) for scripts/gpu_check.py: check version 2 on the GPU,
    and only if it passes, time it beside version 1 and torch. `small`: tiny
    sizes (the check's --fake-gpu run on a GPU made of NumPy)."""
    from gpu_impl import fused_v2
    if dry:
        configs = [fused_v2.kernel_config(None, d, 4, f) for d in fused_v2.HEAD_DIMS for f in ("float16", "bfloat16")]
        return True, ("dry run: would check fused v2 against the readable step and time it at "
                      + ", ".join(f"D = {c.head_dim} {'bf16' if c.bf16 else 'f16'} ({c.rows} x {c.bn})"
                                  for c in configs))
    import cupy
    ok, text = check_against_readable(cupy, **(dict(seq=256) if small else {}))
    if not ok:
        return False, text + "\n\nNot timed: the check failed."
    return True, text + "\n\n" + rates(cupy, **(dict(c=32) if small else {}))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_kernel", description=__doc__.split("\n\n")[0])
    ap.parse_args(argv)
    print(read_section())


def run(quick=True):
    """bench.run's section: (markdown, no plots)."""
    return read_section(), []


if __name__ == "__main__":
    main()
