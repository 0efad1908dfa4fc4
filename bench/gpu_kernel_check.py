"""Version 2 of the fused kernel checked and timed on a GPU: two steps of `make gpu-check`.

`check()` (the step "kernels", before any timing) checks version 2, forward
and both backward kernels, against the readable step on the GPU (D = 64 and
128, float16 and bfloat16, GQA, causal and a window over documents).
`timings()` (the step "rates", last) times versions 1 and 2 and torch's
flash attention on one block, every tile visible, forward and backward, the
kernels alone as well as a whole call. `sanitizer_launches` is what
compute-sanitizer watches (the step "sanitizer"). The tests run all of it on
the CPU emulator of the kernel, with NumPy as CuPy.

    make gpu-check                              # on a machine with a GPU (scripts/gpu_check.py)
"""

import numpy as np

from . import markdown_table

RATE_BLOCK = 8192                               # the timed block: 8192 queries x 8192 keys
CHECK_SEQ = 1024                                # the check against the readable step: 4 striped blocks


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
    from gpu_impl.steps.fused_v2 import HEAD_DIMS, TensorCoreStep
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


def backward_against_readable(cupy, seq=CHECK_SEQ, n=4, hq=8, hkv=2, make_v2=None):
    """(ok, markdown): version 2's backward against the readable step on the
    GPU: the last device's queries against n striped blocks, dQ over the
    rounds and each block's dK, dV, from the same rows (out and lse of the
    readable forward). `make_v2` as for `check_against_readable`."""
    from gpu_impl.steps.fused_v2 import HEAD_DIMS, TensorCoreStep
    from reference import ring
    from reference.heads import q_from_heads, rows_from_heads
    from reference.layouts import positions, shard
    from reference.masks import CAUSAL, make_mask
    from reference.step import BackwardRows, ForwardAcc, Grads, Queries, ReadableStep, finish_forward
    from reference.testing.compare import TOL
    rows, ok = [], True
    for head_dim in HEAD_DIMS:
        for kv_format in ("float16", "bfloat16"):
            rng = np.random.default_rng(head_dim + 1)
            (q16, q), (k16, k), (v16, v), (_, dout) = (_inputs(rng, (1, seq, h, head_dim), kv_format)
                                                       for h in (hq, hkv, hkv, hq))
            pos = positions(seq, n, "striped")
            for name, mask in (("causal", CAUSAL), (f"window {seq // 4}, 3 documents",
                                                    make_mask(window=seq // 4, cu_seqlens=[0, seq // 4,
                                                                                          seq * 5 // 8, seq]))):
                queries = Queries.prepare(cupy.asarray(shard(q, n, "striped")[n - 1]), hkv, pos[n - 1],
                                          head_dim ** -0.5)
                plain = [ring.own_block(*(cupy.asarray(shard(x, n, "striped")[j]) for x in (k, v)), pos[j], j)
                         for j in range(n)]
                acc = ForwardAcc.zeros(queries.q)
                for block in plain:
                    ReadableStep().forward(acc, queries, block, mask=mask, tile_size=512)
                out, lse = finish_forward(acc)
                rows_ = BackwardRows.prepare(q_from_heads(out), rows_from_heads(lse),
                                             cupy.asarray(shard(dout, n, "striped")[n - 1]), hkv, np.float32)
                step, got = (make_v2 or TensorCoreStep)(kv_format=kv_format), []
                for which in ("readable", "v2"):
                    dq, dkv = cupy.asarray(np.zeros(queries.q.shape, np.float32)), []
                    for j in range(n):
                        block = plain[j] if which == "readable" else ring.own_block(
                            *(_on_gpu(cupy, shard(x, n, "striped")[j], kv_format) for x in (k16, v16)), pos[j], j)
                        grads = Grads(dq, *(cupy.asarray(np.zeros(plain[j].k.shape, np.float32)) for _ in range(2)))
                        (ReadableStep() if which == "readable" else step).backward(
                            grads, queries, rows_, block, mask=mask, tile_size=512 if which == "readable" else None)
                        dkv.append((cupy.asnumpy(grads.dk), cupy.asnumpy(grads.dv)))
                    got.append([cupy.asnumpy(dq)] + [x for pair in dkv for x in pair])
                errors = [float(np.abs(b - a).max() / max(1.0, np.abs(a).max())) for a, b in zip(*got)]
                tol = TOL[np.dtype(q16.dtype)].atol
                good = max(errors) <= tol and all(np.isfinite(x).all() for x in got[1])
                ok &= good
                rows.append([head_dim, kv_format, name, f"{errors[0]:.1e}", f"{max(errors[1::2]):.1e}",
                             f"{max(errors[2::2]):.1e}", f"{tol:.1e}", "ok" if good else "FAILED"])
    head = (f"Version 2's backward against the readable step (float32 on the same 16-bit values), S = {seq} on "
            f"{n} striped blocks, the last device's queries, Hq = {hq}, Hkv = {hkv}; dQ over the rounds, the "
            "largest error of any block's dK and dV; errors scaled by max(1, |readable|).\n\n")
    return ok, head + markdown_table(["D", "K/V", "mask", "dQ error", "dK error", "dV error", "limit", ""], rows,
                                     "rllrrrrl")


def sanitizer_launches(cupy, make_v2=None):
    """Version 2's launches for compute-sanitizer (make gpu-check's step
    "sanitizer"): D = 128, float16 and bfloat16, 100 queries and keys (not a
    multiple of any tile), a window of 24 (tiles masked, skipped and full), a
    NaN in V: the forward's guarded path, then the backward of that block
    (its rows hold NaN: the readable step's guarded products), then both
    backward kernels on the block without its NaN. Returns whether out is NaN
    exactly where the NaN reaches, the NaN backward's dQ, dK, dV NaN exactly
    where NumPy's readable step has them, and the kernels' gradients finite."""
    from gpu_impl.steps.fused_v2 import TensorCoreStep
    from reference import ring
    from reference.masks import make_mask
    from reference.heads import q_from_heads, rows_from_heads
    from reference.step import BackwardRows, ForwardAcc, Queries, ReadableStep, finish_forward
    ok, c, window, bad = True, 100, 24, 40                  # key 40 holds a NaN in V
    mask = make_mask(window=window)
    for kv_format in ("float16", "bfloat16"):
        rng = np.random.default_rng(7)
        (_, q), (k16, _), (v16, _) = (_inputs(rng, (1, c, h, 128), kv_format) for h in (4, 2, 2))
        v16[0, bad, 0, 5] = np.nan
        queries = Queries.prepare(cupy.asarray(q), 2, np.arange(c), 128 ** -0.5)
        acc = ForwardAcc.zeros(queries.q)
        block = ring.own_block(_on_gpu(cupy, k16, kv_format), _on_gpu(cupy, v16, kv_format), np.arange(c), 0)
        step = (make_v2 or TensorCoreStep)(kv_format=kv_format)
        step.forward(acc, queries, block, mask=mask, tile_size=None)
        out, lse = finish_forward(acc)
        host_out = q_from_heads(cupy.asnumpy(out))[0]       # (c, 4 query heads, 128)
        sees = (np.arange(c) >= bad) & (np.arange(c) < bad + window)
        ok &= bool(np.isnan(host_out[sees, :2, 5]).all() and np.isfinite(host_out[~sees]).all())
        rows = BackwardRows.prepare(q_from_heads(out), rows_from_heads(lse), q_from_heads(out), 2, np.float32)
        got = _backward(cupy, step, queries, rows, block, mask)
        host = [cupy.asnumpy(x) for x in (q_from_heads(out), rows_from_heads(lse))]
        want = _backward(np, ReadableStep(), Queries.prepare(q, 2, np.arange(c), 128 ** -0.5),
                         BackwardRows.prepare(host[0], host[1], host[0], 2, np.float32),
                         ring.own_block(*(x.astype(np.float32) for x in (k16, v16)), np.arange(c), 0), mask, 64)
        ok &= all(np.array_equal(np.isnan(g), np.isnan(w)) for g, w in zip(got, want)) and np.isnan(got[2]).any()
        # the backward's two kernels, on the same block without its NaN
        v16[0, bad, 0, 5] = 0
        block = ring.own_block(_on_gpu(cupy, k16, kv_format), _on_gpu(cupy, v16, kv_format), np.arange(c), 0)
        acc = ForwardAcc.zeros(queries.q)
        step.forward(acc, queries, block, mask=mask, tile_size=None)
        out, lse = finish_forward(acc)
        rows = BackwardRows.prepare(q_from_heads(out), rows_from_heads(lse), q_from_heads(out), 2, np.float32)
        ok &= all(np.isfinite(x).all() for x in _backward(cupy, step, queries, rows, block, mask))
    return ok


def _backward(xp, step, queries, rows, block, mask, tile_size=None):
    """(dq, dk, dv) on the host: one backward of `step` from zeros, on `xp`'s arrays."""
    from reference.step import Grads
    grads = Grads(*(xp.asarray(np.zeros(x.shape, np.float32)) for x in (queries.q, block.k, block.v)))
    with np.errstate(invalid="ignore", over="ignore"):
        step.backward(grads, queries, rows, block, mask=mask, tile_size=tile_size)
    return [xp.asnumpy(x) if hasattr(xp, "asnumpy") else np.asarray(x) for x in (grads.dq, grads.dk, grads.dv)]


def torch_flash_seconds(c, hq, hkv, head_dim, kv_format, backward=False, repeat=5):
    """Seconds of torch's flash attention on one block (K/V heads repeated for
    the group), or of its backward (the gradients of q, k, v from a kept
    forward); None without torch on CUDA."""
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
    q = torch.randn(1, hq, c, head_dim, device="cuda", dtype=dtype, requires_grad=backward)
    k, v = (torch.randn(1, hkv, c, head_dim, device="cuda", dtype=dtype).repeat_interleave(hq // hkv, 1)
            .requires_grad_(backward) for _ in range(2))

    def forward():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)
    if not backward:
        return timed(torch.cuda.synchronize, forward, repeat=repeat)
    out = forward()
    dout = torch.randn_like(out)
    return timed(torch.cuda.synchronize, lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                 repeat=repeat)


def rates(cupy, c=RATE_BLOCK, hq=8, hkv=2, launches=10, make_v2=None, with_v1=True, repeat=5):
    """Markdown: v1, v2 and torch's flash attention on one block pair, every
    tile visible (`make_v2`, as `check_against_readable`; v1 takes float16
    only), each the best of `repeat` runs after a warm-up."""
    from gpu_impl.steps import fused_v2
    from reference import ring, steps
    from reference.step import BackwardRows, ForwardAcc, Grads, Queries
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
                timings.append(("fused v1 (SIMT), one call", timed(sync, repeat=repeat, fn=lambda: v1.forward(
                    acc, queries, block, causal=True, tile_size=None))))
            step = (make_v2 or fused_v2.TensorCoreStep)(kv_format=kv_format)
            timings.append(("fused v2 (tensor cores), one call", timed(sync, repeat=repeat, fn=lambda: step.forward(
                acc, queries, block, causal=True, tile_size=None))))
            config = fused_v2.kernel_config(None, head_dim, hq // hkv, kv_format)
            kinds = classify(queries.pos, block.pos, (config.queries(hq // hkv), config.bn), True)
            plan = fused_v2.plan_launch(queries, block, queries.mask, config, kinds)
            seconds = timed(sync, repeat=repeat, fn=lambda: [step.launch(acc, queries, block, plan)
                                                             for _ in range(launches)]) / launches
            timings.append(("fused v2, the kernel alone", seconds))
            flash = torch_flash_seconds(c, hq, hkv, head_dim, kv_format, repeat=repeat)
            timings.append(("torch flash attention" if flash else "torch: not installed (or no CUDA)",
                            flash or float("nan")))
            for name, s in timings:
                rows.append([head_dim, kv_format, "forward", name, f"{s * 1e3:.3f}", f"{useful / s / 1e12:.1f}"])
            # the backward: 10 D useful FLOPs per pair (5 products of 2 D), FlashAttention-2's count
            rows_ = BackwardRows.prepare(q, np.zeros((1, hq, c), np.float32), q, hkv, np.float32)
            rows_ = BackwardRows(*(cupy.asarray(x) for x in (rows_.do, rows_.lse, rows_.delta)), finite=True)
            grads = Grads(*(cupy.asarray(np.zeros(x.shape, np.float32)) for x in (queries.q, block.k, block.v)))
            back = [("fused v2 backward (two kernels), one call", timed(sync, repeat=repeat, fn=lambda: step.backward(
                grads, queries, rows_, block, causal=True, tile_size=None)))]
            # the kernels alone: planned once, no host work (the plan, the finiteness look) in the loop
            config = fused_v2.kernel_config(None, head_dim, hq // hkv, kv_format, backward=True)
            kinds = classify(queries.pos, block.pos, (config.queries(hq // hkv), config.bn), True)
            plan = fused_v2.plan_launch(queries, block, queries.mask, config, kinds)
            back.append(("fused v2 backward, the kernels alone", timed(sync, repeat=repeat, fn=lambda: [
                step.launch_backward(grads, queries, rows_, block, plan) for _ in range(launches)]) / launches))
            flash = torch_flash_seconds(c, hq, hkv, head_dim, kv_format, backward=True, repeat=repeat)
            back.append(("torch flash attention backward" if flash else "torch: not installed (or no CUDA)",
                         flash or float("nan")))
            for name, s in back:
                rows.append([head_dim, kv_format, "backward", name, f"{s * 1e3:.3f}", f"{2.5 * useful / s / 1e12:.1f}"])
    return (f"One block pair, every tile visible: {c} queries x {c} keys, Hq = {hq}, Hkv = {hkv}; useful FLOPs "
            f"4 D per pair per query head forward, 10 D backward; best of {repeat}, after a warm-up.\n\n"
            + markdown_table(["D", "K/V", "pass", "what", "ms", "TFLOP/s (useful)"], rows, "rlllrr"))


def check(dry=False, small=False):
    """(ok, markdown) of the step "kernels": version 2, forward and both
    backward kernels, against the readable step on the GPU. `small`: tiny sizes
    (the check's --fake-gpu run on a GPU made of NumPy)."""
    from gpu_impl.steps import fused_v2
    if dry:
        configs = [fused_v2.kernel_config(None, d, 4, f, backward=b) for d in fused_v2.HEAD_DIMS
                   for f in ("float16", "bfloat16") for b in (False, True)]
        return True, ("dry run: would check fused v2's forward (attend_block_v2) and backward (attend_block_v2_dkdv, "
                      "attend_block_v2_dq) against the readable step at "
                      + ", ".join(f"D = {c.head_dim} {'bf16' if c.bf16 else 'f16'} ({c.rows} x {c.bn})"
                                  for c in configs))
    import cupy
    ok, text = check_against_readable(cupy, **(dict(seq=256) if small else {}))
    ok_back, back = backward_against_readable(cupy, **(dict(seq=256) if small else {}))
    return ok and ok_back, text + "\n\n" + back


def timings(dry=False, small=False):
    """(ok, markdown) of the step "rates", the last: versions 1 and 2 and torch timed on one block."""
    if dry:
        return True, f"dry run: would time fused v1 and v2 and torch's flash attention at {RATE_BLOCK} x {RATE_BLOCK}"
    import cupy
    return True, rates(cupy, **(dict(c=32) if small else {}))
