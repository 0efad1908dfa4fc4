"""The tensor-core kernel (gpu_impl.steps.fused_v2), read before it runs, and measured where there is a GPU.

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
            code = instructions(body)
            ops = [x[1] for x in code]
            reports[name]["sass"] = {op: ops.count(op) for op in set(ops)} | {"total": len(ops)}
            reports[name]["code"] = code
    return reports


def instructions(sass):
    """[(address, opcode, branch target or None, predicated)] of one function's SASS."""
    found = re.findall(r"^\s+/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)([^;]*);", sass, re.M)
    return [(int(addr, 16), op, int(re.search(r"0x([0-9a-f]+)", rest).group(1), 16) if op == "BRA" else None,
             bool(predicate)) for addr, predicate, op, rest in found]


def product_loop(code, needs=()):
    """(instructions in the innermost loop that holds every HMMA, those a warp
    issues on one pass through it), or None without such a loop. The pass is
    the shortest path over the loop's blocks in address order (back edges of
    loops inside it dropped: those run once) from its head to its backward
    branch through every block holding an HMMA and with at least `needs`
    ({opcode: count}: a full tile's exponentials and loads) on the way;
    None for the pass if there is none."""
    hmma = [x[0] for x in code if x[1] == "HMMA"]
    loops = [(x[2], x[0]) for x in code if hmma and x[2] is not None and x[2] <= min(hmma) and x[0] >= max(hmma)]
    if not loops:
        return None
    head, latch = min(loops, key=lambda loop: loop[1] - loop[0])
    body = [x for x in code if head <= x[0] <= latch]
    starts = sorted({head} | {x[2] for x in body if x[2] is not None and head < x[2] <= latch}
                    | {b[0] for a, b in zip(body, body[1:]) if a[2] is not None or a[1] == "EXIT"})
    ends = starts[1:] + [latch + 1]
    blocks = {s: [x for x in body if s <= x[0] < end] for s, end in zip(starts, ends)}
    needs = dict(needs)

    def counted(got, block):        # the needed opcodes seen so far, each capped at what is needed
        return tuple(min(n, g + sum(x[1] == op for x in block)) for (op, n), g in zip(needs.items(), got))
    passes = {head: {counted((0,) * len(needs), blocks[head]): len(blocks[head])}}   # block -> {counts: cost}
    for i, s in enumerate(starts):
        if s not in passes:
            continue
        if any(x[1] == "HMMA" for x in blocks[s]):
            passes = {s: passes[s]}     # every pass goes through each block holding an HMMA
        _, op, target, predicated = blocks[s][-1]
        following = [] if op in ("BRA", "EXIT") and not predicated else starts[i + 1:i + 2]
        for nxt in following + ([target] if target is not None and s < target <= latch else []):
            into = passes.setdefault(nxt, {})
            for got, cost in passes[s].items():
                key = counted(got, blocks[nxt])
                into[key] = min(into.get(key, float("inf")), cost + len(blocks[nxt]))
    return len(body), passes.get(starts[-1], {}).get(tuple(needs.values()))


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


def full_tile(config, threads):
    """What one pass of a key tile issues at least, per thread: an exponential
    per pair of its 16 rows (32 lanes share them), and its K and V loads."""
    return {"MUFU": 16 * config.bn // 32, "LDGSTS": 2 * config.bn * (config.head_dim // 8) // threads}


def dkdv_rows(config):
    """Rows of a query tile the dK, dV kernel takes at a time (RC in the source)."""
    return 32 if config.rows % 32 == 0 else 16


def issue_ceiling(flops_per_pair, passes):
    """TFLOP/s on an H200 if instruction issue were the only limit: `passes`
    [(instructions a warp issues on a pass, pairs a warp computes on it)],
    one per kernel the work goes through, each issued at one instruction per
    clock on each of the 4 schedulers of every SM; None if a count is unknown."""
    if any(n is None for n, _ in passes):
        return None
    clocks_per_pair = sum(n / pairs for n, pairs in passes) / 4
    return flops_per_pair / clocks_per_pair * H200["sms"] * H200["clock_ghz"] * 1e9 / 1e12


def read_section():
    """The markdown of what nvcc makes of both versions, and the expectation."""
    from gpu_impl.steps import fused, fused_v2
    if tool("nvcc") is None:
        return "nvcc not found: the kernels were not compiled here.\n"
    rows = []

    issued = {}         # (kernel, D) -> instructions a warp issues on one pass of its product loop

    def row(kernel, head_dim, tile, r, threads, smem, needs=None):
        blocks, warps, limit = occupancy(r["registers"], threads, smem)
        sass = r["sass"]
        loop = product_loop(r["code"], needs or {}) if "code" in r else None
        if loop and loop[1]:
            issued.setdefault((kernel.split(" bfloat16")[0].split(" float16")[0], head_dim), loop[1])
        rows.append([kernel, head_dim, tile, r["registers"], r["spills"], f"{smem / 1024:.1f} KiB",
                     f"{blocks} ({warps} warps, {limit})",
                     *(sass.get(op, "?" if not sass else 0) for op in ("HMMA", "LDSM", "LDGSTS", "SHFL", "MUFU")),
                     sass.get("total", "?"), f"{loop[1] or '?'} of {loop[0]}" if loop else "-"])

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "attend_block_v2_all.cu"       # the three kernels, their header inlined
        source.write_text(fused_v2.kernel_source())
        for head_dim in fused_v2.HEAD_DIMS:
            for bf16 in (False, True):
                kind = "bfloat16" if bf16 else "float16"
                config = fused_v2.Config(head_dim, *fused_v2.DEFAULT_CONFIG[head_dim], bf16)
                r = compile_reports(source, config.options(), tmp)["attend_block_v2"]
                row(f"v2 {kind}", head_dim, f"{config.rows} x {config.bn}, {config.warps} warps", r,
                    config.threads, config.shared_bytes, full_tile(config, config.threads))
                config = fused_v2.Config(head_dim, *fused_v2.BACKWARD_CONFIG[head_dim], bf16)
                reports = compile_reports(source, config.options(), tmp)
                row(f"v2 backward dK, dV {kind}", head_dim, f"{dkdv_rows(config)} x {config.bn} at a time, "
                    f"{config.bn // 16} warps", reports["attend_block_v2_dkdv"], config.kv_threads,
                    config.backward_shared_bytes, {"MUFU": dkdv_rows(config) // 2})
                row(f"v2 backward dQ {kind}", head_dim, f"{config.rows} x {config.bn}, {config.warps} warps",
                    reports["attend_block_v2_dq"], config.threads, config.backward_shared_bytes,
                    full_tile(config, config.threads))
            tq, tk = fused.DEFAULT_TILE
            (r,) = compile_reports(fused.SOURCE, list(fused.compile_options(head_dim, (tq, tk), True)), tmp).values()
            row("v1 float16 K/V", head_dim, f"{tq} x {tk}, {tq // 32} warps", r, tq,
                (2 * tk * head_dim + tk * tq) * 4 + tk * 9 + 8)
    table = markdown_table(["kernel", "D", "tile (rows x keys)", "registers", "spill bytes", "shared memory",
                            "CTAs per SM", "HMMA", "LDSM", "LDGSTS", "SHFL", "MUFU", "SASS total",
                            "product loop: a pass (of all)"], rows, "lrlrrrlrrrrrrr")
    expect, backward = [], {}
    for head_dim in fused_v2.HEAD_DIMS:
        serial, ceilings = expected_tflops(head_dim)
        forward_config = fused_v2.Config(head_dim, *fused_v2.DEFAULT_CONFIG[head_dim], False)
        config = fused_v2.Config(head_dim, *fused_v2.BACKWARD_CONFIG[head_dim], False)
        issue = issue_ceiling(4 * head_dim, [(issued.get(("v2", head_dim)), 16 * forward_config.bn)])
        backward[head_dim] = issue_ceiling(10 * head_dim, [
            (issued.get(("v2 backward dK, dV", head_dim)), 16 * dkdv_rows(config)),
            (issued.get(("v2 backward dQ", head_dim)), 16 * config.bn)])
        expected = min(serial, issue or serial)
        fa2 = H200["fa2_tflops"]
        expect.append([head_dim, *(f"{c:.0f}" for c in ceilings.values()), f"{issue:.0f}" if issue else "?",
                       f"{expected:.0f}", f"{expected / fa2[1]:.0%} to {min(1.0, expected / fa2[0]):.0%}",
                       "{} to {}".format(*V1_ESTIMATE[head_dim])])
    expectation = markdown_table(["D", "shared memory ceiling", "exp ceiling", "mma.sync ceiling (assumed)",
                                  "issue ceiling", "expected v2", "share of FlashAttention-2", "v1 (estimated)"],
                                 expect, "rrrrrrrr")
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
        "32 rows per warp gives {} TFLOP/s, within the 250-350 it reaches on this chip. Every instruction "
        "also takes an issue slot, one per clock on each of an SM's 4 schedulers: the table's last column "
        "counts what a warp issues on one pass of the loop that holds the products (the shortest path through "
        "that loop's SASS that issues every HMMA and a full tile's exponentials and loads, loops inside it "
        "once, so a lower bound), of all the instructions in the loop (masked and guarded paths included); "
        "at that count issue alone allows the issue ceiling below, and the expected rate is the lower of it "
        "and the three in turn. So version 2 is expected near three quarters of FlashAttention-2, held back "
        "by its 16 rows per warp (twice the shared-memory reads per FLOP); version 1 by its SIMT "
        "products.".format(" and ".join(
            f"{expected_tflops(d, rows_per_warp=32)[0]:.0f} (D = {d})" for d in fused_v2.HEAD_DIMS)),
        "", expectation, "",
        "The backward (two kernels, `attend_block_v2_dkdv` and `attend_block_v2_dq`) computes 7 products per "
        "tile against FlashAttention-2's 5 (S and dP again in the dQ kernel, in exchange for no atomic adds), "
        "so at the forward's rate per product it would reach 5/7 of that rate in useful backward FLOPs "
        "(10 D per pair and query head): about {} TFLOP/s, leaving out its two exponentials per pair (one "
        "in each kernel) and its loads, which wait for each tile instead of flying while the previous one "
        "is computed. Issue alone, from both kernels' passes in the table, would allow {} TFLOP/s."
        .format(" and ".join(f"{expected_tflops(d)[0] * 5 / 7:.0f} (D = {d})" for d in fused_v2.HEAD_DIMS),
                " and ".join(f"{backward[d]:.0f} (D = {d})" if backward[d] else f"? (D = {d})"
                             for d in fused_v2.HEAD_DIMS)),
        "",
        "To be replaced by the rates measured on a first GPU (`make gpu-check`, step \"rates\").", ""])


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_kernel", description=__doc__.split("\n\n")[0])
    ap.parse_args(argv)
    print(read_section())


def run(quick=True):
    """bench.run's section: (markdown, no plots)."""
    return read_section(), []


if __name__ == "__main__":
    main()
