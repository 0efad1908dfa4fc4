// attend_block_v2_dq: version 2's backward, second of its two kernels: dQ of
// one query shard against one key/value block, on the tensor cores.
//
// The backward's contract, what version 2's backward changes, what it is
// expected to buy, its precision and why it takes finite inputs only:
// attend_block_v2_dkdv.cu, which runs first and adds the block's dK and dV.
//
// Check it, and run it:
//   nvcc -arch=sm_90 -cubin -Xptxas -v -DHEAD_DIM=64 -DWARPS=4 gpu_impl/steps/kernels/attend_block_v2_dq.cu
//   .venv/bin/python -m pytest tests/gpu/test_fused_v2_backward.py -q     # on the CPU, against the readable step
//
// This kernel: one CTA per query tile of 16 * WARPS rows, as the forward,
// visiting the key tiles of its row of the plan:
//   S = Q K^T, P = exp(S * scale - lse), dP = dO V^T (A: dO through ldmatrix;
//   B: V rows), dS = P (dP - delta), dQ += dS K (A: dS from registers; B: K
//   through ldmatrix.trans).
// S and dP are computed again here (the dK, dV kernel computed them too), so
// that dQ is written by one CTA per row, without atomic adds. A key past the
// block's end (the last tile cut short: nk < BN) is zeros in shared memory,
// so its S is 0 and exp(0 - lse) overflows where a row's lse is strongly
// negative: it is masked like a hidden pair (`masked` and t >= nk), else inf
// times its zero K row gives NaN in dQ.
// Grid (ceil(c / tq), BH), 32 * WARPS threads; shared memory as the dK, dV kernel's.

#include "attend_block_v2.cuh"

extern "C" __global__ void __launch_bounds__(THREADS)
attend_block_v2_dq(const float* __restrict__ q, const float* __restrict__ d_o, const float* __restrict__ lse,
                   const float* __restrict__ delta, const kv_t* __restrict__ k, const kv_t* __restrict__ v,
                   const int* __restrict__ k_pos, const int* __restrict__ q_lo, const int* __restrict__ q_hi,
                   const int* __restrict__ q_doc, const int* __restrict__ k_doc,
                   const signed char* __restrict__ kinds, float* __restrict__ dq,
                   int c, int ck, int G, int tq, int has_docs, float unscale, float rescale)
{
#ifdef DYNAMIC_SHARED
    DYNAMIC_SHARED(uint4, smem);
#else
    extern __shared__ uint4 smem[];
#endif
    uint4* Qs = smem;                                   // the same layout as attend_block_v2_dkdv
    uint4* dOs = Qs + BM * CHUNKS;
    uint4* Ks = dOs + BM * CHUNKS;
    uint4* Vs = Ks + BN * CHUNKS;
    int* kpos = reinterpret_cast<int*>(Vs + BN * CHUNKS);
    int* kdoc = kpos + BN;

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, quad = lane % 4;
    const long long bh = blockIdx.y, all_rows = (long long)c * G;
    const int rows = tq * G;
    const long long row0 = (long long)blockIdx.x * rows;
    const int k_tiles = (ck + BN - 1) / BN;
    const signed char* plan = kinds + (long long)blockIdx.x * k_tiles;
    const kv_t* k_bh = k + bh * ck * HEAD_DIM;
    const kv_t* v_bh = v + bh * ck * HEAD_DIM;

    int n = next_tile(plan, 0, k_tiles);
    if (n == k_tiles)
        return;

    load_rows(Qs, q + bh * all_rows * HEAD_DIM, row0, rows, all_rows, unscale, tid, THREADS);
    load_rows(dOs, d_o + bh * all_rows * HEAD_DIM, row0, rows, all_rows, 1.0f, tid, THREADS);
    RowMask mask[2];
    float row_lse[2], row_delta[2], acc[HEAD_DIM / 8][4];
    bool active[2];
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = warp * 16 + g + 8 * h;
        const long long row = row0 + r;
        active[h] = r < rows && row < all_rows;
        mask[h] = row_mask(q_lo, q_hi, q_doc, has_docs, row, G, active[h]);
        row_lse[h] = active[h] ? lse[bh * all_rows + row] : 0.0f;
        row_delta[h] = active[h] ? delta[bh * all_rows + row] : 0.0f;
    }
    #pragma unroll
    for (int dt = 0; dt < HEAD_DIM / 8; ++dt)
        acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.0f;
    __syncthreads();                                    // Q and dO are in shared memory

    unsigned qa[HEAD_DIM / 16][4];                      // Q as A operands, for the whole block
    #pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
        ldmatrix_x4(qa[kk], &Qs[swizzle(warp * 16 + lane % 16, 2 * kk + lane / 16)]);

    const int k_row = (lane / 16) * 8 + lane % 8, v_row = ((lane / 8) % 2) * 8 + lane % 8;
    const int k_base = k_row * CHUNKS + (((lane / 8) % 2) ^ (lane % 8));
    const int v_base = v_row * CHUNKS + ((lane / 16) ^ (lane % 8));

    while (n < k_tiles) {
        const int k0 = n * BN, nk = min(BN, ck - k0);
        const bool masked = plan[n] == TILE_MASKED || nk < BN;
        __syncthreads();                                // every warp is done with the last K, V tile
        load_kv(Ks, k_bh, k0, ck, tid, THREADS);
        load_kv(Vs, v_bh, k0, ck, tid, THREADS);
        load_positions(kpos, kdoc, k_pos, k_doc, has_docs, k0, ck, tid, THREADS);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        // S = Q K^T and dP = dO V^T: 16 rows x BN keys per warp
        float s[BN / 8][4], dp[BN / 8][4];
        #pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt)
            #pragma unroll
            for (int e = 0; e < 4; ++e)
                s[nt][e] = dp[nt][e] = 0.0f;
        #pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            unsigned da[4];
            ldmatrix_x4(da, &dOs[swizzle(warp * 16 + lane % 16, 2 * kk + lane / 16)]);
            #pragma unroll
            for (int np = 0; np < BN / 16; ++np) {
                unsigned b[4];
                ldmatrix_x4(b, &Ks[np * 16 * CHUNKS + (k_base ^ (2 * kk))]);
                mma_m16n8k16(s[2 * np], qa[kk], b);
                mma_m16n8k16(s[2 * np + 1], qa[kk], b + 2);
                ldmatrix_x4(b, &Vs[np * 16 * CHUNKS + (k_base ^ (2 * kk))]);
                mma_m16n8k16(dp[2 * np], da, b);
                mma_m16n8k16(dp[2 * np + 1], da, b + 2);
            }
        }
        // P = exp(S * scale - lse) (0 where masked), dS = P (dP - delta)
        #pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = nt * 8 + 2 * quad + e % 2, h = e / 2;
                const bool hidden = masked && (t >= nk || !sees(mask[h], kpos[t], kdoc[t], has_docs));
                const float p = hidden ? 0.0f : exp2f(fmaf(s[nt][e] * rescale, LOG2E, -row_lse[h] * LOG2E));
                dp[nt][e] = p * (dp[nt][e] - row_delta[h]);
            }
        }
        // dQ += dS K: dS from the registers, K through ldmatrix.trans
        #pragma unroll
        for (int ks = 0; ks < BN / 16; ++ks) {
            const unsigned da[4] = {pack_16x2(dp[2 * ks][0], dp[2 * ks][1]), pack_16x2(dp[2 * ks][2], dp[2 * ks][3]),
                                    pack_16x2(dp[2 * ks + 1][0], dp[2 * ks + 1][1]),
                                    pack_16x2(dp[2 * ks + 1][2], dp[2 * ks + 1][3])};
            #pragma unroll
            for (int dq2 = 0; dq2 < HEAD_DIM / 16; ++dq2) {
                unsigned b[4];
                ldmatrix_x4_trans(b, &Ks[ks * 16 * CHUNKS + (v_base ^ (2 * dq2))]);
                mma_m16n8k16(acc[2 * dq2], da, b);
                mma_m16n8k16(acc[2 * dq2 + 1], da, b + 2);
            }
        }
        n = next_tile(plan, n + 1, k_tiles);
    }

    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (!active[h])
            continue;
        const long long row = bh * all_rows + row0 + warp * 16 + g + 8 * h;
        #pragma unroll
        for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
            float2* d = reinterpret_cast<float2*>(dq + row * HEAD_DIM + dt * 8 + 2 * quad);
            const float2 a = *d;
            *d = make_float2(a.x + acc[dt][2 * h], a.y + acc[dt][2 * h + 1]);
        }
    }
}
