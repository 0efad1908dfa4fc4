"""The tensor-core kernel (gpu_impl.fused_v2), read before it runs, and measured where there is a GPU.

Without a GPU this reads what nvcc makes of the fused kernels for sm_90 (the
H100/H200's architecture): registers, spills, shared memory and occupancy
(ptxas -v, and the CUDA occupancy rules of sm_90), the SASS instruction mix
(cuobjdump), and the rate expected of version 2 with its reasoning, version 1
beside it. Nothing here is a measured speed: the expectation is to be replaced
by the rate `make gpu-check` measures on a first GPU.

With a GPU, `bench.gpu_kernel_check` (a step of scripts/gpu_check.py) checks
version 2 against the readable step there and measures its rate.

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


def compile_reports(source, options, out_dir):
    """{kernel: {registers, spills, stack, sass: {instruction: count}}} of one
    build for sm_90, for each entry function of `source`."""
    cubin = Path(out_dir) / "k.cubin"
    proc = subprocess.run(nvcc_command(source, options, cubin), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    reports = {}
    for name, body in re.findall(r"Compiling entry function '(\w+)' for 'sm_90'\n(.*?)(?=Compiling entry|\Z)",
                                 proc.stderr, re.S):
        reports[name] = dict(registers=int(re.search(r"Used (\d+) registers", body).group(1)),
                             spills=sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", body)),
                             stack=int(re.search(r"(\d+) bytes stack frame", body).group(1)), sass={})
    dump, disasm = tool("cuobjdump"), tool("nvdisasm")
    if dump and disasm:
        sass = subprocess.run([dump, "--dump-sass", str(cubin)], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, NVDISASM_PATH=disasm)).stdout
        for name, body in re.findall(r"Function : (\w+)\n(.*?)(?=Function : |\Z)", sass, re.S):
            ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", body, re.M)
            reports[name]["sass"] = {op: ops.count(op) for op in set(ops)} | {"total": len(ops)}
    return reports


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
    rows = []

    def row(kernel, head_dim, tile, r, threads, smem):
        blocks, warps, limit = occupancy(r["registers"], threads, smem)
        sass = r["sass"]
        rows.append([kernel, head_dim, tile, r["registers"], r["spills"], f"{smem / 1024:.1f} KiB",
                     f"{blocks} ({warps} warps, {limit})",
                     *(sass.get(op, "?" if not sass else 0) for op in ("HMMA", "LDSM", "LDGSTS", "SHFL", "MUFU")),
                     sass.get("total", "?")])

    with tempfile.TemporaryDirectory() as tmp:
        for head_dim in fused_v2.HEAD_DIMS:
            for bf16 in (False, True):
                kind = "bfloat16" if bf16 else "float16"
                config = fused_v2.Config(head_dim, *fused_v2.DEFAULT_CONFIG[head_dim], bf16)
                r = compile_reports(fused_v2.SOURCE, config.options(), tmp)["attend_block_v2"]
                row(f"v2 {kind}", head_dim, f"{config.rows} x {config.bn}, {config.warps} warps", r,
                    config.threads, config.shared_bytes)
                config = fused_v2.Config(head_dim, *fused_v2.BACKWARD_CONFIG[head_dim], bf16)
                reports = compile_reports(fused_v2.SOURCE, config.options(), tmp)
                row(f"v2 backward dK, dV {kind}", head_dim, f"32 x {config.bn} at a time, {config.bn // 16} warps",
                    reports["attend_block_v2_dkdv"], config.kv_threads, config.backward_shared_bytes)
                row(f"v2 backward dQ {kind}", head_dim, f"{config.rows} x {config.bn}, {config.warps} warps",
                    reports["attend_block_v2_dq"], config.threads, config.backward_shared_bytes)
            tq, tk = fused.DEFAULT_TILE
            (r,) = compile_reports(fused.SOURCE, list(fused.compile_options(head_dim, (tq, tk), True)), tmp).values()
            row("v1 float16 K/V", head_dim, f"{tq} x {tk}, {tq // 32} warps", r, tq,
                (2 * tk * head_dim + tk * tq) * 4 + tk * 9 + 8)
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
        "The backward (two kernels, `attend_block_v2_dkdv` and `attend_block_v2_dq`) computes 7 products per "
        "tile against FlashAttention-2's 5 (S and dP again in the dQ kernel, in exchange for no atomic adds), "
        "so at the forward's rate per product it would reach 5/7 of that rate in useful backward FLOPs "
        "(10 D per pair and query head): about {} TFLOP/s, leaving out its two exponentials per pair (one "
        "in each kernel) and its loads, which wait for each tile instead of flying while the previous one "
        "is computed.".format(" and ".join(
            f"{expected_tflops(d)[0] * 5 / 7:.0f} (D = {d})" for d in fused_v2.HEAD_DIMS)),
        "",
        "To be replaced by the rates measured on a first GPU (`make gpu-check`, step \"tensor cores\").", ""])


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_kernel", description=__doc__.split("\n\n")[0])
    ap.parse_args(argv)
    print(read_section())


def run(quick=True):
    """bench.run's section: (markdown, no plots)."""
    return read_section(), []


if __name__ == "__main__":
    main()
