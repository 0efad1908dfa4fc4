// attend_block_v2: version 2 of the fused step's forward, one query shard
// against one key/value block on the tensor cores, FlashAttention-2's dataflow.
//
// The contract of attend_block_v1 and of reference/step.py's step: the running
// softmax state (o, m, l) of every query row is read, updated with the keys of
// this block, and written back, so that calls over the ring's rounds
// accumulate. Paper, Algorithm 1 (AccumulateAttentionFragment) and section
// 2.2.1 (tiles that no query can see are skipped). The layout, the sizes and
// the loads it shares with the backward's two kernels: attend_block_v2.cuh.
//
// Check it, and run it:
//   nvcc -arch=sm_90 -cubin -Xptxas -v -DHEAD_DIM=64 gpu_impl/steps/kernels/attend_block_v2.cu
//   .venv/bin/python -m pytest tests/gpu/test_fused_v2.py -q     # on the CPU, against the readable step
//   make gpu-check                                               # on a GPU: checked, then timed
//   gpu_impl.ring_attention(q, k, v, comm=comm, step="fused_v2")
//
// What version 2 changes from version 1 (attend_block_v1.cu), and what each
// change is expected to buy:
// - S = Q K^T and O += P V on the tensor cores (mma.sync m16n8k16, float16 or
//   bfloat16 operands, float32 accumulation) instead of float32 FFMAs: the
//   H100/H200 tensor cores run 16-bit products about 15x faster than its FP32
//   units, so the products stop being the bound;
// - a warp per 16 query rows and WARPS warps per CTA (v1: a thread per row
//   and a D-long chain of dependent FFMAs per key): S and P stay in registers
//   (v1 keeps S in shared memory), the softmax's row max and row sum are
//   reduced by two shuffles within the quad of lanes that holds a row;
// - P is reused as the A operand of P V: the float32 accumulator layout of
//   one m16n8 tile pair is the A layout of m16n8k16, so P never leaves the
//   registers;
// - Q, K and V in shared memory swizzled by 16-byte chunk (chunk ^ row % 8),
//   read with ldmatrix without bank conflicts (v1's S and its scan for
//   non-finite values are 32-way conflicted);
// - K and V tiles loaded with cp.async: V of tile n arrives while S = Q K^T of
//   tile n is computed, K of the next tile while P V is: loads overlap math;
// - the G query heads that share a key/value head are rows of the same tile
//   (the compute layout's rows are query-major): one K/V tile serves them all
//   (v1: one CTA per query head, each loading the tile again);
// - the tiles to visit come from the host's plan (reference/tiles.py, exact
//   for every mask), and masks from per-query bounds made from positions:
//   windows, documents and padding as well as the causal rule (v1: causal only);
// - non-finite values in V are found while checking the rows each thread
//   loaded itself, in the barrier the pipeline needs anyway (__syncthreads_or):
//   no scan of its own in the common case.
//
// What it bought: not measured yet, no GPU has run it. Expected on an H200 at
// its default tile (128 rows x 64 keys, 8 warps): about 230 TFLOP/s of useful
// work at D = 64 and 260 at D = 128, two thirds to all of FlashAttention-2's
// 250-350, against version 1's estimated 10-25 and 6-15: per pair a warp
// reads D / 4 bytes of K and V through ldmatrix, computes one exponential and
// 4 D FLOPs on the tensor cores, taken in turn, capped by the instructions a
// warp issues on a pass of its product loop, read from its SASS (bench/gpu_kernel.py
// derives it; BENCHMARKS.md, "The tensor-core kernel, read before it runs").
// Held back by its 16 rows per warp, twice FlashAttention-2's shared-memory
// reads per FLOP. `make gpu-check` replaces the expectation with a measurement.
//
// Grid (ceil(c / tq), BH), 32 * WARPS threads: CTA (x, bh) holds the queries
// x*tq .. x*tq+tq-1 of group bh, all G heads of each. Warp w holds 16 of those
// rows. Shared memory (dynamic): (16 * WARPS + 2 * BN) * HEAD_DIM * 2 + BN * 12
// bytes: Q, K and V tiles, the K tile's positions and documents, V's row flags.
//
// Precision. Q is rounded to the 16-bit type after its scale is taken off
// again (q * unscale, unscale = 1 / scale): a float16 or bfloat16 input comes
// back exactly, and the scale is applied to S in float32 (S * rescale), as
// FlashAttention-2 does. P is rounded to the 16-bit type for P V; l sums the
// float32 P. So out differs from the readable step by about one 16-bit
// rounding of each weight, lse by float32 roundings.
//
// Per key tile (FlashAttention's online softmax; m in the units of S):
//   S = Q K^T * rescale (masked: -inf where the mask hides a pair)
//   m_new = max(m, rowmax(S));  P = exp(S - m_new)
//   l = l * exp(m - m_new) + rowsum(P);  O = O * exp(m - m_new) + P V
//
// NaN and inf follow reference/step.py's rule, as its readable step computes
// it: a masked pair contributes nothing whatever its values; a visible pair
// contributes P V even where P underflows to 0 (0 x NaN = NaN, 0 x inf = NaN);
// a row whose scores so far are all -inf subtracts 0, not -inf. The tensor
// cores multiply every P by every V row, so a non-finite V row would reach the
// rows that cannot see it (0 x NaN): a tile whose V holds a NaN or inf zeroes
// those rows in the B operand and adds their terms back in float32, from the
// float32 P, where the pair is visible. (Flushing of subnormals: attend_block_v2.cuh.)

#include "attend_block_v2.cuh"

// After this thread's copies of a V tile have landed: tag the rows of its
// chunks that hold a NaN or inf, and say whether it found one.
__device__ __forceinline__ int v_non_finite(const uint4* vs, int* bad, int tag, int nk, int tid)
{
    int found = 0;
    for (int i = tid; i < BN * CHUNKS; i += THREADS) {
        const int t = i / CHUNKS;
        const uint4 x = vs[swizzle(t, i % CHUNKS)];
        if (t < nk && (non_finite_16x2(x.x) || non_finite_16x2(x.y) || non_finite_16x2(x.z) ||
                       non_finite_16x2(x.w))) {
            bad[t] = tag;
            found = 1;
        }
    }
    return found;
}

// The terms of the V rows that hold a NaN or inf (tagged in `bad`), left out
// of P V, added back in float32 where the pair is visible: P[row][t] * V[t].
// The P of the registers is spent by then, so it is made again from Q and K
// in shared memory (the same 16-bit values, the same formula), the four lanes
// of a quad splitting the dot product. Rare: only tiles whose V is not finite.
__device__ __forceinline__ void add_back_non_finite(float acc[HEAD_DIM / 8][4], const uint4* Qs, const uint4* Ks,
                                                    const uint4* Vs, const int* kpos, const int* kdoc,
                                                    const int* bad, int tag, int nk, bool masked,
                                                    const RowMask mask[2], const float m_safe[2], int has_docs,
                                                    float rescale, int warp, int lane)
{
    const int g = lane / 4, quad = lane % 4;
    for (int t = 0; t < nk; ++t) {
        if (bad[t] != tag)
            continue;                                   // the same for the whole CTA
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float dot = 0.0f;
            for (int d = quad; d < HEAD_DIM; d += 4)
                dot += tile_value(Qs, warp * 16 + g + 8 * h, d) * tile_value(Ks, t, d);
            dot += __shfl_xor_sync(FULL_WARP, dot, 1);
            dot += __shfl_xor_sync(FULL_WARP, dot, 2);
            const float p = exp2f(fmaf(dot * rescale, LOG2E, -m_safe[h] * LOG2E));
            if (masked && !sees(mask[h], kpos[t], kdoc[t], has_docs))
                continue;                               // a masked pair adds nothing, whatever V holds
            #pragma unroll
            for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
                acc[dt][2 * h] += p * tile_value(Vs, t, dt * 8 + 2 * quad);
                acc[dt][2 * h + 1] += p * tile_value(Vs, t, dt * 8 + 2 * quad + 1);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
attend_block_v2(const float* __restrict__ q, const kv_t* __restrict__ k, const kv_t* __restrict__ v,
                const int* __restrict__ k_pos, const int* __restrict__ q_lo, const int* __restrict__ q_hi,
                const int* __restrict__ q_doc, const int* __restrict__ k_doc,
                const signed char* __restrict__ kinds,
                float* __restrict__ o, float* __restrict__ m, float* __restrict__ l,
                int c, int ck, int G, int tq, int has_docs, float unscale, float rescale)
{
#ifdef DYNAMIC_SHARED
    DYNAMIC_SHARED(uint4, smem);
#else
    extern __shared__ uint4 smem[];
#endif
    uint4* Qs = smem;                                   // (BM, HEAD_DIM) 16-bit, swizzled
    uint4* Ks = Qs + BM * CHUNKS;                       // (BN, HEAD_DIM)
    uint4* Vs = Ks + BN * CHUNKS;                       // (BN, HEAD_DIM)
    int* kpos = reinterpret_cast<int*>(Vs + BN * CHUNKS);   // (BN,) the K tile's positions
    int* kdoc = kpos + BN;                              // (BN,) and documents
    int* bad = reinterpret_cast<int*>(kdoc + BN);       // (BN,) = tag: V row holds a NaN or inf

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, quad = lane % 4;            // this lane's rows g, g+8 and columns 2*quad, +1
    const long long bh = blockIdx.y;
    const int rows = tq * G;                            // rows of this CTA (<= BM)
    const long long row0 = (long long)blockIdx.x * rows;  // its first row in the group's c * G
    const int k_tiles = (ck + BN - 1) / BN;
    const signed char* plan = kinds + (long long)blockIdx.x * k_tiles;
    const kv_t* k_bh = k + bh * ck * HEAD_DIM;
    const kv_t* v_bh = v + bh * ck * HEAD_DIM;

    int n = next_tile(plan, 0, k_tiles);
    if (n == k_tiles)
        return;                                         // no query here sees a key of this block
    load_kv(Ks, k_bh, n * BN, ck, tid, THREADS);                 // the first K tile flies while Q is read
    load_positions(kpos, kdoc, k_pos, k_doc, has_docs, n * BN, ck, tid, THREADS);
    cp_async_commit();
    for (int t = tid; t < BN; t += THREADS)
        bad[t] = 0;

    // Q: float32 in global memory, 16-bit and unscaled in shared memory; rows past the CTA's are 0
    load_rows(Qs, q + bh * c * G * HEAD_DIM, row0, rows, (long long)c * G, unscale, tid, THREADS);

    // This lane's two rows: their state, and what their queries may see
    RowMask mask[2];
    float m_r[2], l_r[2], acc[HEAD_DIM / 8][4];
    bool active[2];
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = warp * 16 + g + 8 * h;
        const long long row = row0 + r;
        active[h] = r < rows && row < (long long)c * G;
        mask[h] = row_mask(q_lo, q_hi, q_doc, has_docs, row, G, active[h]);     // idle: sees nothing
        m_r[h] = active[h] ? m[bh * c * G + row] : NEG_INF;
        // l is summed per lane and over the quad at the end: one lane brings the old sum
        l_r[h] = active[h] && quad == 0 ? l[bh * c * G + row] : 0.0f;
        #pragma unroll
        for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
            const float2 x = active[h] ? *reinterpret_cast<const float2*>(
                                             o + (bh * c * G + row) * HEAD_DIM + dt * 8 + 2 * quad)
                                       : make_float2(0.0f, 0.0f);
            acc[dt][2 * h] = x.x;
            acc[dt][2 * h + 1] = x.y;
        }
    }
    __syncthreads();                                    // Q is in shared memory

    // Q as A operands, in registers for the whole block: 16 rows x HEAD_DIM per warp
    unsigned qa[HEAD_DIM / 16][4];
    #pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
        ldmatrix_x4(qa[kk], &Qs[swizzle(warp * 16 + lane % 16, 2 * kk + lane / 16)]);

    // The rows this lane gives to ldmatrix: K rows (keys) 16 np + k_row, chunk 2 kk + k_half
    // (matrices: keys 0-7 | 8-15 x columns 0-7 | 8-15 of 16 kk); V rows 16 ks + v_row, chunk
    // 2 dp + v_half. Swizzled, the chunk is (2 kk) ^ (k_half ^ row % 8): one base per lane,
    // XORed with a constant, so the addresses cost no registers per (np, kk).
    const int k_row = (lane / 16) * 8 + lane % 8, v_row = ((lane / 8) % 2) * 8 + lane % 8;
    const int k_base = k_row * CHUNKS + (((lane / 8) % 2) ^ (lane % 8));
    const int v_base = v_row * CHUNKS + ((lane / 16) ^ (lane % 8));

    while (n < k_tiles) {
        const int k0 = n * BN, nk = min(BN, ck - k0);
        const int next = next_tile(plan, n + 1, k_tiles);
        const bool masked = plan[n] == TILE_MASKED || nk < BN;
        const int tag = n + 1;

        cp_async_wait<0>();                             // this thread's K rows have landed
        __syncthreads();                                // everyone's have; every warp is done with V
        load_kv(Vs, v_bh, k0, ck, tid, THREADS);                 // V flies while S is computed
        cp_async_commit();

        // S = Q K^T: 16 rows x BN keys per warp, float32, in registers
        float s[BN / 8][4];
        #pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt)
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
        #pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            #pragma unroll
            for (int np = 0; np < BN / 16; ++np) {
                unsigned b[4];                          // keys 16 np .. +7 (b[0..1]) and +8 .. +15 (b[2..3])
                ldmatrix_x4(b, &Ks[np * 16 * CHUNKS + (k_base ^ (2 * kk))]);
                mma_m16n8k16(s[2 * np], qa[kk], b);
                mma_m16n8k16(s[2 * np + 1], qa[kk], b + 2);
            }
        }

        // the scale, and the mask from positions: -inf where a row may not see the key
        #pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = nt * 8 + 2 * quad + e % 2;
                s[nt][e] *= rescale;
                if (masked && (t >= nk || !sees(mask[e / 2], kpos[t], kdoc[t], has_docs)))
                    s[nt][e] = NEG_INF;
            }
        }

        // the online softmax, per row: m_new = max(m, rowmax(S)) over the quad
        float m_safe[2];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = NEG_INF;
            #pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt)
                mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_WARP, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_WARP, mx, 2));
            const float m_new = fmaxf(m_r[h], mx);
            // Hazard: a row that has seen no visible key yet has m_new = -inf, and
            // -inf - -inf is NaN: subtract 0 instead, so that P = exp(-inf) = 0.
            m_safe[h] = m_new == NEG_INF ? 0.0f : m_new;
            const float alpha = exp2f((m_r[h] - m_safe[h]) * LOG2E);  // m = -inf: 0, nothing to rescale
            m_r[h] = m_new;
            const float shift = m_safe[h] * LOG2E;
            float sum = 0.0f;
            #pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) {
                s[nt][2 * h] = exp2f(fmaf(s[nt][2 * h], LOG2E, -shift));        // P = exp(S - m_new)
                s[nt][2 * h + 1] = exp2f(fmaf(s[nt][2 * h + 1], LOG2E, -shift));
                sum += s[nt][2 * h] + s[nt][2 * h + 1];
            }
            l_r[h] = l_r[h] * alpha + sum;
            #pragma unroll
            for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
                acc[dt][2 * h] *= alpha;
                acc[dt][2 * h + 1] *= alpha;
            }
        }

        cp_async_wait<0>();                             // this thread's V rows have landed
        // every thread's have, every warp is done with K, and: does a V row hold a NaN or inf?
        const int any_bad = __syncthreads_or(v_non_finite(Vs, bad, tag, nk, tid));
        if (!any_bad && next < k_tiles) {               // the next K tile flies while P V is computed
            load_kv(Ks, k_bh, next * BN, ck, tid, THREADS);
            load_positions(kpos, kdoc, k_pos, k_doc, has_docs, next * BN, ck, tid, THREADS);
            cp_async_commit();
        }

        // O += P V: P from the registers of S (the accumulator layout of keys
        // 16 ks .. +15 is the A layout), V through ldmatrix.trans
        #pragma unroll
        for (int ks = 0; ks < BN / 16; ++ks) {
            const unsigned pa[4] = {pack_16x2(s[2 * ks][0], s[2 * ks][1]), pack_16x2(s[2 * ks][2], s[2 * ks][3]),
                                    pack_16x2(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                                    pack_16x2(s[2 * ks + 1][2], s[2 * ks + 1][3])};
            #pragma unroll
            for (int dp = 0; dp < HEAD_DIM / 16; ++dp) {
                unsigned b[4];                          // columns 16 dp .. +7 (b[0..1]) and +8 .. +15 (b[2..3])
                ldmatrix_x4_trans(b, &Vs[ks * 16 * CHUNKS + (v_base ^ (2 * dp))]);
                if (any_bad) {
                    // Hazard: 0 x NaN = NaN. A V row that holds a NaN or inf is left
                    // out here (register i holds keys 16 ks + 8 (i % 2) + 2 quad, +1)
                    // and added back below where the pair is visible.
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int t = ks * 16 + (i % 2) * 8 + 2 * quad;
                        b[i] &= (bad[t] == tag ? 0u : 0xffffu) | (bad[t + 1] == tag ? 0u : 0xffff0000u);
                    }
                }
                mma_m16n8k16(acc[2 * dp], pa, b);
                mma_m16n8k16(acc[2 * dp + 1], pa, b + 2);
            }
        }

        if (any_bad) {
            add_back_non_finite(acc, Qs, Ks, Vs, kpos, kdoc, bad, tag, nk, masked, mask, m_safe, has_docs,
                                rescale, warp, lane);
            __syncthreads();                            // every warp is done with this K tile
            if (next < k_tiles) {
                load_kv(Ks, k_bh, next * BN, ck, tid, THREADS);
                load_positions(kpos, kdoc, k_pos, k_doc, has_docs, next * BN, ck, tid, THREADS);
                cp_async_commit();
            }
        }
        n = next;
    }

    // l over the quad, then this lane's rows back to global memory
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        l_r[h] += __shfl_xor_sync(FULL_WARP, l_r[h], 1);
        l_r[h] += __shfl_xor_sync(FULL_WARP, l_r[h], 2);
        if (!active[h])
            continue;
        const long long row = bh * c * G + row0 + warp * 16 + g + 8 * h;
        #pragma unroll
        for (int dt = 0; dt < HEAD_DIM / 8; ++dt)
            *reinterpret_cast<float2*>(o + row * HEAD_DIM + dt * 8 + 2 * quad) =
                make_float2(acc[dt][2 * h], acc[dt][2 * h + 1]);
        if (quad == 0) {
            m[row] = m_r[h];
            l[row] = l_r[h];
        }
    }
}
