// attend_block_v2_dkdv: version 2's backward, first of its two kernels: dK and
// dV of one key/value block against one query shard, on the tensor cores.
//
// The backward of reference/step.py's contract, per tile, with delta =
// rowsum(dO * out) and lse computed once by the ring (reference.step.BackwardRows):
//   P  = exp(S - lse)                  (S = Q K^T * scale, masked: -inf, so P = 0)
//   dV += P^T dO,   dP = dO V^T,   dS = P (dP - delta)
//   dQ += dS K,     dK += dS^T Q * scale   (Q pre-scaled in the compute layout)
// dK and dV are the block's, accumulated over the ring's rounds in float32
// (each launch adds to them); dQ is this device's, unscaled (the ring
// multiplies by the scale at the end), added by attend_block_v2_dq.cu.
//
// Check it, and run it:
//   nvcc -arch=sm_90 -cubin -Xptxas -v -DHEAD_DIM=64 -DWARPS=4 gpu_impl/steps/kernels/attend_block_v2_dkdv.cu
//   .venv/bin/python -m pytest tests/gpu/test_fused_v2_backward.py -q     # on the CPU, against the readable step
//   make gpu-check                                                        # on a GPU: checked, then timed
//   gpu_impl.ring_attention_backward(q, k, v, out, lse, dout, comm=comm, step="fused_v2")
//
// What version 2's backward changes: before it, a GPU ring's backward ran the
// readable step on CuPy, a few array operations per tile, each a kernel that
// writes S, P, dP and dS of the tile to GPU memory and reads them back. Here
// FlashAttention-2's dataflow on the tensor cores, in two kernels instead of
// its one with atomic adds to dQ: S and dP are computed twice (7 products per
// tile instead of 5), and no two CTAs write the same value, so every run
// gives the same bits.
//
// What it bought: not measured yet, no GPU has run it. Expected on an H200:
// at the forward's rate per product, 5/7 of it in useful backward FLOPs (10 D
// per pair and query head), about 165 TFLOP/s at D = 64 and 186 at D = 128,
// 0.55-0.70 of FlashAttention-2's backward at D = 64 and 0.50-0.63 at D = 128
// (BENCHMARKS.md, "The tensor-core kernel, read before it runs"; docs/gpu.md
// lists what would buy more). `make gpu-check` replaces it with a measurement.
//
// This kernel: one CTA per key tile of BN keys, BN / 16 warps, warp w holding
// keys 16 w .. 16 w + 15 and their dK, dV in registers; it visits the query
// tiles of its column of the plan, RC (32) rows at a time:
//   S^T = K Q^T (A: K through ldmatrix; B: Q rows, as K is read in the forward)
//   P^T = exp(S^T * scale - lse), dP^T = V dO^T, dS^T = P^T (dP^T - delta)
//   dV += P^T dO, dK += dS^T Q: P^T and dS^T are A operands from the registers
//   of S^T and dP^T (the accumulator layout is the A layout, as P in the
//   forward), dO and Q through ldmatrix.trans (as V in the forward).
// Grid (ceil(ck / BN), BH), 2 * BN threads. Shared memory, as the dQ kernel's:
// (2 * BM + 2 * BN) * HEAD_DIM * 2 + BN * 8 + BM * 20 bytes: Q, dO, K, V tiles,
// the keys' positions and documents, and per row lse, delta and what it may see.
//
// Precision. Q and dO are rounded to the 16-bit type (Q after its scale is
// taken off: a float16 or bfloat16 input comes back exactly, and so does dO,
// which the ring holds as float32 copies of the 16-bit dout), P and dS are
// rounded to it as operands of dV, dK and dQ; everything else is float32.
//
// NaN and inf: both backward kernels are launched only for blocks and rows that
// hold none (the owner's flag and BackwardRows.finite say so on the host):
// 0 x NaN in dS^T Q and P^T dO would reach the dK, dV of keys a row cannot
// see. gpu_impl/steps/fused_v2.py hands any other block to the readable step.

#include "attend_block_v2.cuh"

#define KV_WARPS (BN / 16)                    // a warp per 16 keys
#define KV_THREADS (32 * KV_WARPS)
#define RC (BM % 32 == 0 ? 32 : 16)           // rows of a query tile taken at a time

extern "C" __global__ void __launch_bounds__(KV_THREADS)
attend_block_v2_dkdv(const float* __restrict__ q, const float* __restrict__ d_o, const float* __restrict__ lse,
                     const float* __restrict__ delta, const kv_t* __restrict__ k, const kv_t* __restrict__ v,
                     const int* __restrict__ k_pos, const int* __restrict__ q_lo, const int* __restrict__ q_hi,
                     const int* __restrict__ q_doc, const int* __restrict__ k_doc,
                     const signed char* __restrict__ kinds, float* __restrict__ dk, float* __restrict__ dv,
                     int c, int ck, int G, int tq, int has_docs, float unscale, float rescale)
{
#ifdef DYNAMIC_SHARED
    DYNAMIC_SHARED(uint4, smem);
#else
    extern __shared__ uint4 smem[];
#endif
    uint4* Qs = smem;                                   // (BM, HEAD_DIM) 16-bit, swizzled
    uint4* dOs = Qs + BM * CHUNKS;                 // (BM, HEAD_DIM)
    uint4* Ks = dOs + BM * CHUNKS;                 // (BN, HEAD_DIM)
    uint4* Vs = Ks + BN * CHUNKS;                       // (BN, HEAD_DIM)
    int* kpos = reinterpret_cast<int*>(Vs + BN * CHUNKS);   // (BN,)
    int* kdoc = kpos + BN;                              // (BN,)
    float* row_lse = reinterpret_cast<float*>(kdoc + BN);   // (BM,) per row of the query tile
    float* row_delta = row_lse + BM;
    int* row_lo = reinterpret_cast<int*>(row_delta + BM);
    int* row_hi = row_lo + BM;
    int* row_doc = row_hi + BM;

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, quad = lane % 4;
    const long long bh = blockIdx.y, all_rows = (long long)c * G;
    const int n = blockIdx.x, k0 = n * BN, nk = min(BN, ck - k0);
    const int k_tiles = (ck + BN - 1) / BN, q_tiles = (c + tq - 1) / tq, rows = tq * G;

    int x = 0;
    while (x < q_tiles && kinds[(long long)x * k_tiles + n] == TILE_SKIP)
        ++x;
    if (x == q_tiles)
        return;                                         // no query sees a key of this tile

    load_kv(Ks, k + bh * ck * HEAD_DIM, k0, ck, tid, KV_THREADS);
    load_kv(Vs, v + bh * ck * HEAD_DIM, k0, ck, tid, KV_THREADS);
    load_positions(kpos, kdoc, k_pos, k_doc, has_docs, k0, ck, tid, KV_THREADS);
    cp_async_commit();

    float dk_acc[HEAD_DIM / 8][4], dv_acc[HEAD_DIM / 8][4];
    #pragma unroll
    for (int dt = 0; dt < HEAD_DIM / 8; ++dt)
        #pragma unroll
        for (int e = 0; e < 4; ++e)
            dk_acc[dt][e] = dv_acc[dt][e] = 0.0f;

    // ldmatrix rows of this lane, as in the forward: B operands of 16 rows (k_base,
    // K in the forward), B operands transposed (v_base, V in the forward)
    const int k_row = (lane / 16) * 8 + lane % 8, v_row = ((lane / 8) % 2) * 8 + lane % 8;
    const int k_base = k_row * CHUNKS + (((lane / 8) % 2) ^ (lane % 8));
    const int v_base = v_row * CHUNKS + ((lane / 16) ^ (lane % 8));
    const int key0 = warp * 16;                         // this warp's keys in the tile

    while (x < q_tiles) {
        const bool masked = kinds[(long long)x * k_tiles + n] == TILE_MASKED || nk < BN ||
                            rows < BM || (long long)(x + 1) * rows > all_rows;
        const long long row0 = (long long)x * rows;
        __syncthreads();                                // every warp is done with the last query tile
        load_rows(Qs, q + bh * all_rows * HEAD_DIM, row0, rows, all_rows, unscale, tid, KV_THREADS);
        load_rows(dOs, d_o + bh * all_rows * HEAD_DIM, row0, rows, all_rows, 1.0f, tid, KV_THREADS);
        for (int r = tid; r < BM; r += KV_THREADS) {
            const long long row = row0 + r;
            const bool active = r < rows && row < all_rows;
            const RowMask mask = row_mask(q_lo, q_hi, q_doc, has_docs, row, G, active);   // idle: sees nothing
            row_lse[r] = active ? lse[bh * all_rows + row] : 0.0f;
            row_delta[r] = active ? delta[bh * all_rows + row] : 0.0f;
            row_lo[r] = mask.lo;
            row_hi[r] = mask.hi;
            row_doc[r] = mask.doc;
        }
        cp_async_wait<0>();                             // K, V and their positions (the first time)
        __syncthreads();

        for (int rc = 0; rc < rows; rc += RC) {
            // S^T = K Q^T and dP^T = V dO^T: 16 keys x RC rows per warp
            float s[RC / 8][4], dp[RC / 8][4];
            #pragma unroll
            for (int nt = 0; nt < RC / 8; ++nt)
                #pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[nt][e] = dp[nt][e] = 0.0f;
            #pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
                unsigned ka[4], va[4];
                ldmatrix_x4(ka, &Ks[swizzle(key0 + lane % 16, 2 * kk + lane / 16)]);
                ldmatrix_x4(va, &Vs[swizzle(key0 + lane % 16, 2 * kk + lane / 16)]);
                #pragma unroll
                for (int np = 0; np < RC / 16; ++np) {
                    unsigned b[4];
                    ldmatrix_x4(b, &Qs[(rc + np * 16) * CHUNKS + (k_base ^ (2 * kk))]);
                    mma_m16n8k16(s[2 * np], ka, b);
                    mma_m16n8k16(s[2 * np + 1], ka, b + 2);
                    ldmatrix_x4(b, &dOs[(rc + np * 16) * CHUNKS + (k_base ^ (2 * kk))]);
                    mma_m16n8k16(dp[2 * np], va, b);
                    mma_m16n8k16(dp[2 * np + 1], va, b + 2);
                }
            }
            // P^T = exp(S^T * scale - lse) (0 where masked), dS^T = P^T (dP^T - delta);
            // this lane holds keys key0 + g (e < 2), + 8 (e >= 2), rows rc + 8 nt + 2 quad (+1)
            #pragma unroll
            for (int nt = 0; nt < RC / 8; ++nt) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = rc + nt * 8 + 2 * quad + e % 2, t = key0 + g + 8 * (e / 2);
                    const bool hidden = masked && (t >= nk || !sees(RowMask{row_lo[r], row_hi[r], row_doc[r]},
                                                                   kpos[t], kdoc[t], has_docs));
                    const float p = hidden ? 0.0f : exp2f(fmaf(s[nt][e] * rescale, LOG2E, -row_lse[r] * LOG2E));
                    s[nt][e] = p;
                    dp[nt][e] = p * (dp[nt][e] - row_delta[r]);
                }
            }
            // dV += P^T dO and dK += dS^T Q: A from the registers, B through ldmatrix.trans
            #pragma unroll
            for (int ks = 0; ks < RC / 16; ++ks) {
                const unsigned pa[4] = {pack_16x2(s[2 * ks][0], s[2 * ks][1]), pack_16x2(s[2 * ks][2], s[2 * ks][3]),
                                        pack_16x2(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                                        pack_16x2(s[2 * ks + 1][2], s[2 * ks + 1][3])};
                const unsigned da[4] = {pack_16x2(dp[2 * ks][0], dp[2 * ks][1]),
                                        pack_16x2(dp[2 * ks][2], dp[2 * ks][3]),
                                        pack_16x2(dp[2 * ks + 1][0], dp[2 * ks + 1][1]),
                                        pack_16x2(dp[2 * ks + 1][2], dp[2 * ks + 1][3])};
                #pragma unroll
                for (int dq2 = 0; dq2 < HEAD_DIM / 16; ++dq2) {
                    unsigned b[4];
                    ldmatrix_x4_trans(b, &dOs[(rc + ks * 16) * CHUNKS + (v_base ^ (2 * dq2))]);
                    mma_m16n8k16(dv_acc[2 * dq2], pa, b);
                    mma_m16n8k16(dv_acc[2 * dq2 + 1], pa, b + 2);
                    ldmatrix_x4_trans(b, &Qs[(rc + ks * 16) * CHUNKS + (v_base ^ (2 * dq2))]);
                    mma_m16n8k16(dk_acc[2 * dq2], da, b);
                    mma_m16n8k16(dk_acc[2 * dq2 + 1], da, b + 2);
                }
            }
        }
        ++x;
        while (x < q_tiles && kinds[(long long)x * k_tiles + n] == TILE_SKIP)
            ++x;
    }

    // this lane's keys: add to the block's dK (the scale Q carried) and dV
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int t = key0 + g + 8 * h;
        if (t >= nk)
            continue;
        const long long key = bh * ck + k0 + t;
        #pragma unroll
        for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
            float2* kd = reinterpret_cast<float2*>(dk + key * HEAD_DIM + dt * 8 + 2 * quad);
            float2* vd = reinterpret_cast<float2*>(dv + key * HEAD_DIM + dt * 8 + 2 * quad);
            const float2 a = *kd, b = *vd;
            *kd = make_float2(a.x + dk_acc[dt][2 * h] * rescale, a.y + dk_acc[dt][2 * h + 1] * rescale);
            *vd = make_float2(b.x + dv_acc[dt][2 * h], b.y + dv_acc[dt][2 * h + 1]);
        }
    }
}
