"""make gpu-check's steps on the kernels: the environment, compiling every
kernel once, the cheapest check of each kernel, compute-sanitizer, the GPU
tests, and last the rates (scripts/gpu_check.py runs them).
"""

import os
import sys
import time

import numpy as np

from gpu_check_base import FUSED_DTYPES, SCRIPT, Result, fenced, find_sanitizer, module_version, run, run_all

# -- environment --------------------------------------------------------------------

def environment(ctx):
    rows = [("python", sys.version.split()[0] + f" ({ctx.python})")]
    rows += [(name, module_version(name)) for name in ("numpy", "cupy", "mpi4py", "pytest", "hypothesis", "torch")]
    rows.append(("mpiexec", ctx.mpiexec or "NOT FOUND"))
    rows.append(("compute-sanitizer", find_sanitizer() or "not found"))
    code = ("import gpu_impl; from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0]); "
            "print(gpu_impl.mpi_cuda_support()); print(gpu_impl.choose_transfer('auto'))")
    rc, out = run(ctx, [ctx.python, "-c", code], 60)
    lines = out.strip().splitlines()
    rows.append(("MPI library", lines[0] if rc == 0 else "cannot ask: " + " / ".join(lines[-3:])))
    if rc == 0:
        rows.append(("MPIX_Query_cuda_support()", lines[1]))
        rows.append(("transfer='auto'", lines[2]))
    if not ctx.dry:
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(0)
        rows.append(("GPU", f"{cupy.cuda.runtime.getDeviceCount()} x {props['name'].decode()}, "
                            f"{props['totalGlobalMem'] / 2**30:.0f} GiB, sm_{props['major']}{props['minor']}"))
        rows.append(("CUDA runtime / driver", f"{cupy.cuda.runtime.runtimeGetVersion()} / "
                                              f"{cupy.cuda.runtime.driverGetVersion()}"))
    text = "| what | found |\n| :--- | :--- |\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)
    missing = [name for name in ("pytest", "hypothesis") if module_version(name).startswith("missing")]
    if not ctx.mpiexec:
        return Result(False, text + "\n\nmpiexec not found: the ring tests cannot run (give --mpiexec PATH, "
                                    "or carry the mpich wheel: --wheels DIR).")
    if rc != 0:
        return Result(False, text + "\n\nmpi4py cannot load an MPI library: carry the mpich wheel "
                                    "(make gpu-wheels, then --wheels DIR, which installs it in the check's venv).")
    if missing:
        return Result(False, text + f"\n\n{', '.join(missing)} missing: carry their wheels (--wheels DIR).")
    if not (ctx.dry or ctx.fake):
        ok, probed = cuda_probe(ctx)
        text += f"\n\n{probed}"
        if not ok:
            return Result(False, text)
    return Result(True, text)


PROBE = """import cupy
twice = cupy.RawKernel(r'extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }', "twice")
x = cupy.arange(32, dtype=cupy.float32)
twice((1,), (32,), (x,))
a = cupy.ones((64, 64), dtype=cupy.float32)
print(float(x[3]), float((a @ a)[0, 0]))
"""
PROBE_EXPECTED = "6.0 64.0"


def cuda_probe(ctx):
    """(ok, what it says): one RawKernel compiled by NVRTC and one cuBLAS matmul, in a
    process of its own, so that a CuPy that imports but cannot reach NVRTC or cuBLAS
    fails here, at once, saying what to set, rather than at every later step."""
    rc, out = run(ctx, [ctx.python, "-c", PROBE], 120)
    lines = out.strip().splitlines()
    if rc == 0 and lines and lines[-1] == PROBE_EXPECTED:
        return True, "CUDA probe: one kernel compiled by NVRTC and one cuBLAS matmul ran (x2 = 6.0, 64 x 64 ones: 64.0)."
    return False, ("FAILED: CuPy imports but cannot compile a kernel (NVRTC) or run a matmul (cuBLAS):\n\n"
                   + fenced(out, 12) + "\n\nCuPy finds NVRTC and cuBLAS in the running interpreter's "
                   "site-packages (site.getsitepackages(): the nvidia-* wheels) or under CUDA_PATH. Run the "
                   "check with the machine's own python (--python PATH), or set CUDA_PATH to the CUDA toolkit "
                   "(for example /usr/local/cuda), or LD_LIBRARY_PATH to the folders of libnvrtc and libcublas.")


# -- compile: every kernel once, at the start ---------------------------------------------

def kernel_builds():
    """Every build of the fused kernels the later steps launch, as
    (label, version, arguments): version 2's forward and its two backward
    kernels at their default tiles (every tile the check's rings and timings
    use is one of them), version 1 at its tile, D = 64 and 128."""
    from gpu_impl.steps import fused, fused_v2
    builds = []
    for d in fused_v2.HEAD_DIMS:
        for bf16 in (False, True):
            for table, names in ((fused_v2.DEFAULT_CONFIG, ("attend_block_v2",)),
                                 (fused_v2.BACKWARD_CONFIG, ("attend_block_v2_dkdv", "attend_block_v2_dq"))):
                config = fused_v2.Config(d, *table[d], bf16)
                builds += [(f"{name} D={d} {'bf16' if bf16 else 'f16'} {config.rows}x{config.bn}", 2,
                            (d, *table[d], bf16, name)) for name in names]
        for kv_half in (False, True):
            builds.append((f"attend_block_v1 D={d} {'f16' if kv_half else 'f32'} K/V {fused.DEFAULT_TILE}", 1,
                           (d, *fused.DEFAULT_TILE, kv_half)))
    return builds


def compile_builds(indices):
    """In a process of its own: compile `kernel_builds()[i]` for each i (NVRTC,
    into CuPy's kernel cache on disk, where every later step's process finds
    it); print each one's seconds."""
    from gpu_impl.steps import fused, fused_v2
    builds = kernel_builds()
    for i in indices:
        label, version, args = builds[i]
        start = time.perf_counter()
        if version == 2:
            fused_v2._kernel(fused_v2.Config(*args[:4]), args[4])       # compiles: it sets the shared memory size
        else:
            fused._kernel(*args)
        print(f"| {label} | {time.perf_counter() - start:.1f} |", flush=True)


def warm_readable_step():
    """In a process of its own: the readable step on CuPy, forward and
    backward, float32 and float64, causal and windowed, on a tiny block: CuPy
    compiles its own kernels for it once, into its cache, for the later steps."""
    import cupy

    from reference.masks import make_mask
    from reference.heads import q_from_heads, rows_from_heads
    from reference.ring import own_block
    from reference.step import BackwardRows, ForwardAcc, Grads, Queries, ReadableStep, finish_forward
    start = time.perf_counter()
    for dtype in (np.float32, np.float64):
        x = cupy.asarray(np.random.default_rng(0).standard_normal((1, 8, 2, 4)).astype(dtype))
        for mask in (make_mask(), make_mask(window=3)):
            queries = Queries.prepare(x, 1, np.arange(8), 0.5)
            block = own_block(x[:, :, :1].copy(), x[:, :, 1:].copy(), np.arange(8), 0)
            acc = ForwardAcc.zeros(queries.q)
            ReadableStep().forward(acc, queries, block, mask=mask, tile_size=4)
            out, lse = finish_forward(acc)
            rows = BackwardRows.prepare(q_from_heads(out), rows_from_heads(lse), x, 1, queries.q.dtype)
            grads = Grads(cupy.zeros_like(queries.q), cupy.zeros_like(block.k), cupy.zeros_like(block.v))
            ReadableStep().backward(grads, queries, rows, block, mask=mask, tile_size=4)
    cupy.cuda.Device().synchronize()
    print(f"| the readable step's CuPy kernels (float32, float64) | {time.perf_counter() - start:.1f} |", flush=True)


def compile_kernels(ctx):
    """Every fused kernel the check launches, compiled once by NVRTC, and the
    readable step's CuPy kernels, in parallel processes: CuPy keeps them in its
    cache on disk, so that no later step (each a process of its own) spends
    its time compiling."""
    builds = kernel_builds()
    head = "| build | seconds |\n| :--- | ---: |\n"
    if ctx.dry:
        return Result(True, f"dry run: would compile {len(builds)} builds\n\n" + head
                      + "\n".join(f"| {label} | - |" for label, *_ in builds))
    workers = 0 if ctx.fake else max(1, min(8, (os.cpu_count() or 2) - 1, len(builds)))   # the fake compiles nothing
    groups = [list(range(i, len(builds), workers)) for i in range(workers)]
    cmds = [[ctx.python, str(SCRIPT), "--compile-builds", ",".join(map(str, g))] for g in groups]
    cmds.append([*ctx.gpu_python(), str(SCRIPT), "--warm-readable"])
    start = time.perf_counter()
    results = run_all(ctx, cmds, ctx.left())
    ok = all(rc == 0 for rc, _ in results)
    rows = [line for _, out in results for line in out.splitlines() if line.startswith("| ")]
    failed = [fenced(out, 20) for rc, out in results if rc != 0]
    return Result(ok, f"{len(builds) if workers else 0} builds of the fused kernels and the readable step's kernels, "
                      f"{len(cmds)} processes side by side, {time.perf_counter() - start:.0f} s\n\n" + head
                  + "\n".join(rows) + ("\n\nFAILED:\n\n" + "\n\n".join(failed) if failed else ""))


# -- the GPU tests -------------------------------------------------------------------

def pytest_step(ctx, selection):
    """tests/gpu/test_gpu.py -m gpu with `selection`; fails on any failure or skip."""
    base = [ctx.python, "-m", "pytest", "tests/gpu/test_gpu.py", "-m", "gpu", "-k", selection,
            "-p", "no:cacheprovider", "-q", "-rs"]
    if ctx.dry:
        rc, out = run(ctx, base + ["--collect-only"], 120)
        collected = sum(1 for line in out.splitlines() if "::" in line)
        return Result(rc == 0 and collected > 0, f"dry run: {collected} GPU tests collected\n\n" + fenced(out, 20))
    rc, out = run(ctx, base, ctx.left())
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    ok = rc == 0 and not skipped
    why = "" if ok else ("\n\nFAILED: " + ("tests were skipped although a GPU is present" if skipped
                                           else f"pytest exit status {rc}"))
    return Result(ok, fenced(out, 40) + why)


def race_probe(ctx):
    return pytest_step(ctx, "race_probe")


def gpu_tests(ctx):
    return pytest_step(ctx, "not race_probe")


# -- kernels: the cheapest check of every kernel, before any timing --------------------

def kernel_checks(ctx):
    """Version 1 against the readable step, then version 2's forward and both
    backward kernels (bench.gpu_kernel_check.check), at small sizes."""
    from bench import gpu_kernel_check
    ok1, v1 = fused_against_readable(ctx)
    ok2, v2 = gpu_kernel_check.check(dry=ctx.dry, small=ctx.fake)
    return Result(ok1 and ok2, v1 + "\n\n" + v2)


def fused_against_readable(ctx):
    """(ok, markdown): max |fused - readable| over |readable|: 4 striped blocks, GQA 8/2."""
    from gpu_impl.steps import fused
    if ctx.dry:
        tiles = [fused.fused_tile(None, d) for d in ctx.sizes.fused_dims]
        return True, f"dry run: would check fused v1 (attend_block_v1) at tiles {tiles}, D = {ctx.sizes.fused_dims}"
    import cupy
    from reference import ring, steps
    from reference.layouts import positions, shard
    from reference.step import ForwardAcc, Queries, finish_forward
    rows, ok = [], True
    seq = ctx.sizes.fused_seq
    for head_dim, dtype in ((d, t) for d in ctx.sizes.fused_dims for t in FUSED_DTYPES):
        rng = np.random.default_rng(head_dim)
        q = rng.standard_normal((1, seq, 8, head_dim)).astype(dtype)
        k, v = (rng.standard_normal((1, seq, 2, head_dim)).astype(dtype) for _ in range(2))
        pos = positions(seq, 4, "striped")
        queries = Queries.prepare(cupy.asarray(shard(q, 4, "striped")[3]), 2, pos[3], head_dim ** -0.5)
        accs = ForwardAcc.zeros(queries.q), ForwardAcc.zeros(queries.q)
        plain, kernel = steps.get("v1"), steps.get("fused")
        for j in range(4):
            block = ring.own_block(*(cupy.asarray(shard(x, 4, "striped")[j]) for x in (k, v)), pos[j], j)
            plain.forward(accs[0], queries, ring.as_dtype(block, np.float32), causal=True, tile_size=512)
            kernel.forward(accs[1], queries, ring.as_dtype(block, np.float32, kernel), causal=True, tile_size=None)
        (o0, l0), (o1, l1) = ((cupy.asnumpy(x) for x in finish_forward(a)) for a in accs)
        err = max(float(np.abs(o1 - o0).max() / max(1.0, np.abs(o0).max())),
                  float(np.abs(l1 - l0).max() / max(1.0, np.abs(l0).max())))
        good = err <= 1e-4
        ok &= good
        rows.append(f"| {head_dim} | {np.dtype(dtype).name} | {fused.fused_tile(None, head_dim)} | {err:.1e} | "
                    f"{'ok' if good else 'FAILED'} |")
    head = (f"Fused v1 against the readable step (both accumulate in float32), S = {seq} on 4 striped "
            "blocks, Hq = 8, Hkv = 2, causal; error scaled by max(1, |readable|), limit 1e-4.\n\n"
            "| D | inputs | fused tile | max error | |\n| ---: | :--- | :--- | ---: | :--- |\n")
    return ok, head + "\n".join(rows)


# -- compute-sanitizer, on all three kernels of version 2 and on version 1 --------------------

def one_fused_launch():
    """What the sanitizer watches: one small launch of version 1 per K/V
    dtype (a partly masked block of 96 keys, D = 64, GQA, tiles cut short at
    both ends), then version 2's three kernels (bench.gpu_kernel_check.sanitizer_launches)."""
    import cupy

    import gpu_impl  # noqa: F401 - registers its CUDA steps ("fused") with reference.steps
    from reference import ring, steps
    from reference.step import ForwardAcc, Queries
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float16):
        q = cupy.asarray(rng.standard_normal((1, 100, 4, 64)).astype(dtype))
        k, v = (cupy.asarray(rng.standard_normal((1, 96, 2, 64)).astype(dtype)) for _ in range(2))
        queries = Queries.prepare(q, 2, np.arange(100) * 2 + 1, 0.125)
        step = steps.get("fused")
        acc = ForwardAcc.zeros(queries.q)
        block = ring.as_dtype(ring.own_block(k, v, np.arange(96) * 2, 0), np.float32, step)
        step.forward(acc, queries, block, causal=True, tile_size=None)
    from bench.gpu_kernel_check import sanitizer_launches
    finite_where_it_should_be = sanitizer_launches(cupy)            # fused_v2: D = 128, float16 and bfloat16
    cupy.cuda.Device().synchronize()
    print("one fused launch per dtype: done")
    print(f"fused_v2 launches (D = 128, float16 and bfloat16, a window, a NaN in V; its backward, and both "
          f"backward kernels): "
          f"{'done' if finite_where_it_should_be else 'FAILED: NaN where it cannot reach, or none where it does'}")
    if not finite_where_it_should_be:
        raise SystemExit(1)


def sanitizer(ctx):
    """compute-sanitizer's racecheck, synccheck and memcheck on `one_fused_launch`."""
    tool = find_sanitizer()
    me = [*ctx.gpu_python(), str(SCRIPT), "--one-fused-launch"]
    if ctx.dry:
        rc, out = run(ctx, me + ["--dry-run"], 60)
        return Result(rc == 0, f"dry run: the launch script starts ({out.strip()}); compute-sanitizer: "
                               f"{tool or 'not found'}")
    if tool is None:
        rc, out = run(ctx, me, 60)              # the launch alone, at least
        return Result(rc == 0, "compute-sanitizer not found (CUDA_HOME/bin, /usr/local/cuda/bin, PATH); "
                               "the launch alone:\n\n" + fenced(out, 20), skipped="compute-sanitizer not found")
    parts, ok = [], True
    tools = ("racecheck", "synccheck", "memcheck")
    for i, name in enumerate(tools):             # the step's time shared by the tools still to run
        rc, out = run(ctx, [tool, "--tool", name, "--error-exitcode", "99", *me], ctx.left() / (len(tools) - i))
        good = rc == 0
        ok &= good
        summary = [line for line in out.splitlines() if "SUMMARY" in line or "done" in line]
        parts.append(f"{name}: {'ok' if good else f'FAILED (exit {rc})'}\n\n" + fenced("\n".join(summary) or out, 20))
    return Result(ok, "\n\n".join(parts))


# -- rates: the long timings, last ------------------------------------------------------------

def rates(ctx):
    """The long timings, last: one block pair, every tile visible,
    rate_block queries x keys, Hq = 8, Hkv = 2, float16: the readable step and
    version 1, then version 2 and torch's flash attention, forward and
    backward (bench.gpu_kernel_check.timings)."""
    from bench import gpu_kernel_check
    if ctx.dry:
        return Result(True, f"dry run: torch {module_version('torch')}; {gpu_kernel_check.timings(dry=True)[1]}")
    import cupy

    import gpu_impl  # noqa: F401 - registers its CUDA steps ("fused") with reference.steps
    from bench import gpu_bench
    from reference import ring, steps
    from reference.step import ForwardAcc, Queries
    from reference.tms import attention_flops
    c, hq, hkv = ctx.sizes.rate_block, 8, 2
    rows = []
    for head_dim in (64, 128):
        useful = attention_flops(c * c * hq, head_dim)
        rng = np.random.default_rng(1)
        q = rng.standard_normal((1, c, hq, head_dim)).astype(np.float16)
        k, v = (rng.standard_normal((1, c, hkv, head_dim)).astype(np.float16) for _ in range(2))
        queries = Queries.prepare(cupy.asarray(q), hkv, np.arange(c) + c, head_dim ** -0.5)
        block = ring.own_block(cupy.asarray(k), cupy.asarray(v), np.arange(c), 0)
        for name, step, tile in (("v1 (readable), tile 1024", steps.get("v1"), 1024),
                                 ("fused v1, its tile", steps.get("fused"), None)):
            b = ring.as_dtype(block, np.float32, step)
            seconds = gpu_bench.timed(cupy.cuda.Device().synchronize, lambda: step.forward(
                ForwardAcc.zeros(queries.q), queries, b, causal=True, tile_size=tile), repeat=3)
            rows.append((head_dim, name, seconds, useful / seconds / 1e12))
    table = "| D | step | ms | TFLOP/s (useful) |\n| ---: | :--- | ---: | ---: |\n" + "\n".join(
        f"| {d} | {name} | {s * 1e3:.2f} | {r:.1f} |" for d, name, s, r in rows)
    ok, v2 = gpu_kernel_check.timings(small=ctx.fake)
    return Result(ok, f"The readable step and version 1 on one block pair, every tile visible: {c} queries x {c} "
                      "keys, Hq = 8, Hkv = 2, float16 inputs; useful FLOPs 4 D per pair per query head.\n\n"
                      + table + "\n\n" + v2)
