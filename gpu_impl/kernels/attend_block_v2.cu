// attend_block_v2: one query shard against one key/value block on the tensor
// cores, with FlashAttention-2's dataflow.
//
// The contract of attend_block_v1 and of reference/step.py's step: the running
// softmax state (o, m, l) of every query row is read, updated with the keys of
// this block, and written back, so that calls over the ring's rounds
// accumulate. Paper, Algorithm 1 (AccumulateAttentionFragment) and section
// 2.2.1 (tiles that no query can see are skipped).
//
// What version 2 changes from version 1, and what each change is expected to
// buy (expected, not measured: BENCHMARKS.md gives the reasoning, to be
// replaced by the rate measured on a first GPU):
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
// Compute layout (C-contiguous), BH = B * Hkv, G = Hq / Hkv, rows = c * G:
//   q, o     (BH, c, G, HEAD_DIM)  float32; q pre-scaled by the softmax scale
//   m, l     (BH, c, G)            float32 running row max and row sum
//   k, v     (BH, ck, HEAD_DIM)    16-bit: float16, or bfloat16 with KV_BF16=1
//   k_pos    (ck,)                 global positions of the keys (int32)
//   q_lo, q_hi (c,)                the positions each query may see (int32,
//                                  reference.masks.Mask.key_range clipped to
//                                  [-1, 2^31 - 1]: no bound at either end)
//   q_doc (c,), k_doc (ck,)        documents (int32), read only when has_docs
//                                  (documents that are not one run of positions each)
//   kinds    (ceil(c / tq), ceil(ck / BN))  int8: 0 skip, 1 full, 2 masked
//                                  (reference.tiles.classify at tile (tq, BN))
// Grid (ceil(c / tq), BH), 32 * WARPS threads: CTA (x, bh) holds the queries
// x*tq .. x*tq+tq-1 of group bh, all G heads of each: rows x*tq*G .. on, at
// most 16 * WARPS of them. Warp w holds 16 of those rows.
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
// float32 P, where the pair is visible.
//
// Flushing. CuPy compiles kernels with -ftz=true: float32 values below 2^-126
// are read and written as 0. So a weight P = exp(S - m) with S - m below about
// -87.3 is 0 here where NumPy's readable step keeps a subnormal: where V holds
// inf at such a key, out is NaN (0 x inf) here and inf there. Every other case
// of the rule is the same. (The CPU emulation, tests/gpu/emulate_cuda.cpp,
// flushes likewise.)
//
// Compile-time sizes (nvcc -D or NVRTC options): HEAD_DIM (64 or 128), WARPS
// (1 to 8), BN (keys per tile: 16, 32, 64 or 128), KV_BF16. The forward's shared memory is
// dynamic: (16 * WARPS + 2 * BN) * HEAD_DIM * 2 + BN * 12 bytes
// (gpu_impl/fused_v2.py sizes the launch).
// Check: nvcc -arch=sm_90 -cubin -Xptxas -v -DHEAD_DIM=64 gpu_impl/kernels/attend_block_v2.cu
//        cuobjdump --dump-sass attend_block_v2.cubin | grep HMMA

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#ifndef WARPS
#define WARPS 4
#endif
#ifndef BN
#define BN 64
#endif
#ifndef KV_BF16
#define KV_BF16 0
#endif

#define THREADS (32 * WARPS)
#define BM (16 * WARPS)                  // query rows of a CTA, 16 per warp
#define CHUNKS (HEAD_DIM / 8)            // 16-byte chunks in a row of 16-bit values
#define FULL_WARP 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)
#define LOG2E 1.4426950408889634f
#define TILE_SKIP 0                      // reference/tiles.py's SKIP, FULL, MASKED
#define TILE_FULL 1
#define TILE_MASKED 2

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "HEAD_DIM must be 64 or 128");
static_assert(WARPS >= 1 && WARPS <= 8, "WARPS must be 1 to 8");
static_assert(BN == 16 || BN == 32 || BN == 64 || BN == 128, "BN must be 16, 32, 64 or 128");

typedef unsigned short kv_t;             // a float16 or bfloat16, as its bits

#ifndef EMULATED
// The warp-level operations, one PTX instruction each: no header, so nvcc and
// NVRTC compile this alike. tests/gpu/emulate_cuda.cpp defines the same
// functions for the CPU, with the same fragment layouts.
#if KV_BF16
#define ELT "bf16"
#else
#define ELT "f16"
#endif

__device__ __forceinline__ unsigned shared_address(const void* p)
{
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// d += a b: a 16x16 (row), b 16x8 (col), d 16x8 float32. Lane = 4 * g + t holds
// a: rows g, g+8 x columns 2t, 2t+1 (registers 0, 1), the same + 8 (2, 3);
// b: rows 2t, 2t+1 (register 0), + 8 (1), column g; d: rows g (0, 1), g+8 (2, 3),
// columns 2t, 2t+1.
__device__ __forceinline__ void mma_m16n8k16(float d[4], const unsigned a[4], const unsigned b[2])
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." ELT "." ELT ".f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Four 8x8 matrices of 16-bit values; lanes 8i..8i+7 give the rows of matrix
// i, and lane 4 * g + t receives, in register i, row g's columns 2t, 2t+1
// (transposed: rows 2t, 2t+1 of column g).
__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const void* row)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(row)) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const void* row)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(row)) : "memory");
}

// Asynchronous copies to shared memory; `valid` false writes zeros (reads nothing).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(shared_address(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
                 :: "r"(shared_address(dst)), "l"(src), "r"(valid ? 4 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Wait until at most N groups of this thread's copies are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

// Two float32 -> one register of two 16-bit values (lo in the low half), rounded to nearest even.
__device__ __forceinline__ unsigned pack_16x2(float lo, float hi)
{
    unsigned r;
    asm("cvt.rn." ELT "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float from_16(kv_t h)
{
#if KV_BF16
    return __int_as_float((int)h << 16);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}
#endif  // EMULATED

// A NaN or inf in either 16-bit half of a register.
__device__ __forceinline__ bool non_finite_16x2(unsigned w)
{
#if KV_BF16
    const unsigned e = 0x7f807f80u;
#else
    const unsigned e = 0x7c007c00u;
#endif
    return (w & (e & 0xffffu)) == (e & 0xffffu) || (w & (e & 0xffff0000u)) == (e & 0xffff0000u);
}

// 16-byte chunk `chunk` of row `row` in a swizzled tile: the 8 rows an
// ldmatrix reads (same chunk, consecutive rows) fall in 8 different bank groups.
__device__ __forceinline__ int swizzle(int row, int chunk) { return row * CHUNKS + (chunk ^ (row & 7)); }

__device__ __forceinline__ float tile_value(const uint4* tile, int row, int col)
{
    return from_16(reinterpret_cast<const kv_t*>(&tile[swizzle(row, col >> 3)])[col & 7]);
}

// The next tile to visit at or after n in this CTA's row of the plan.
__device__ __forceinline__ int next_tile(const signed char* kinds, int n, int tiles)
{
    while (n < tiles && kinds[n] == TILE_SKIP)
        ++n;
    return n;
}

// What a query row may see (reference.masks): keys lo <= pos <= hi, of its document.
struct RowMask {
    int lo, hi, doc;
};

__device__ __forceinline__ bool sees(const RowMask& r, int pos, int doc, int has_docs)
{
    return pos >= r.lo && pos <= r.hi && (!has_docs || doc == r.doc);
}

// Start copying K (or V) rows k0 .. k0+BN-1 into a swizzled tile; rows at or
// past ck are zeros. Chunk i is copied by thread i % THREADS: `v_non_finite`
// reads back the chunks this thread copied, in the same order.
__device__ __forceinline__ void load_kv(uint4* tile, const kv_t* src, int k0, int ck, int tid)
{
    for (int i = tid; i < BN * CHUNKS; i += THREADS) {
        const int t = i / CHUNKS, chunk = i % CHUNKS;
        const bool valid = k0 + t < ck;
        cp_async_16(&tile[swizzle(t, chunk)], src + (long long)(valid ? k0 + t : 0) * HEAD_DIM + chunk * 8, valid);
    }
}

__device__ __forceinline__ void load_positions(int* kpos, int* kdoc, const int* k_pos, const int* k_doc,
                                               int has_docs, int k0, int ck, int tid)
{
    for (int t = tid; t < BN; t += THREADS) {
        const bool valid = k0 + t < ck;
        cp_async_4(&kpos[t], k_pos + (valid ? k0 + t : 0), valid);
        if (has_docs)
            cp_async_4(&kdoc[t], k_doc + (valid ? k0 + t : 0), valid);
    }
}

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
    load_kv(Ks, k_bh, n * BN, ck, tid);                 // the first K tile flies while Q is read
    load_positions(kpos, kdoc, k_pos, k_doc, has_docs, n * BN, ck, tid);
    cp_async_commit();
    for (int t = tid; t < BN; t += THREADS)
        bad[t] = 0;

    // Q: float32 in global memory, 16-bit and unscaled in shared memory; rows past the CTA's are 0
    for (int i = tid; i < BM * CHUNKS; i += THREADS) {
        const int r = i / CHUNKS, chunk = i % CHUNKS;
        float x[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (r < rows && row0 + r < (long long)c * G) {
            const float4* src = reinterpret_cast<const float4*>(q + ((bh * c * G + row0 + r) * HEAD_DIM + chunk * 8));
            const float4 a = src[0], b = src[1];
            x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
            x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
        }
        Qs[swizzle(r, chunk)] = make_uint4(pack_16x2(x[0] * unscale, x[1] * unscale),
                                           pack_16x2(x[2] * unscale, x[3] * unscale),
                                           pack_16x2(x[4] * unscale, x[5] * unscale),
                                           pack_16x2(x[6] * unscale, x[7] * unscale));
    }

    // This lane's two rows: their state, and what their queries may see
    RowMask mask[2];
    float m_r[2], l_r[2], acc[HEAD_DIM / 8][4];
    bool active[2];
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = warp * 16 + g + 8 * h;
        const long long row = row0 + r, query = row / G;
        active[h] = r < rows && row < (long long)c * G;
        mask[h] = active[h] ? RowMask{q_lo[query], q_hi[query], has_docs ? q_doc[query] : 0}
                            : RowMask{1, 0, 0};         // sees nothing
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
        load_kv(Vs, v_bh, k0, ck, tid);                 // V flies while S is computed
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
            load_kv(Ks, k_bh, next * BN, ck, tid);
            load_positions(kpos, kdoc, k_pos, k_doc, has_docs, next * BN, ck, tid);
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
                load_kv(Ks, k_bh, next * BN, ck, tid);
                load_positions(kpos, kdoc, k_pos, k_doc, has_docs, next * BN, ck, tid);
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

// ===================================================================================
// The backward: FlashAttention-2's dataflow on the tensor cores, in two kernels.
//
// The contract of reference/step.py's backward, per tile, with delta =
// rowsum(dO * out) and lse computed once by the ring (reference.step.BackwardRows):
//   P  = exp(S - lse)                  (S = Q K^T * scale, masked: -inf, so P = 0)
//   dV += P^T dO,   dP = dO V^T,   dS = P (dP - delta)
//   dQ += dS K,     dK += dS^T Q * scale   (Q pre-scaled in the compute layout)
// dK and dV are the block's, accumulated over the ring's rounds in float32
// (each launch adds to them); dQ is this device's, unscaled (the ring
// multiplies by the scale at the end).
//
// attend_block_v2_dkdv: one CTA per key tile of BN keys, BN / 16 warps, warp w
// holding keys 16 w .. 16 w + 15 and their dK, dV in registers; it visits the
// query tiles of its column of the plan, 32 rows at a time:
//   S^T = K Q^T (A: K through ldmatrix; B: Q rows, as K is read in the forward)
//   P^T = exp(S^T * scale - lse), dP^T = V dO^T, dS^T = P^T (dP^T - delta)
//   dV += P^T dO, dK += dS^T Q: P^T and dS^T are A operands from the registers
//   of S^T and dP^T (the accumulator layout is the A layout, as P in the
//   forward), dO and Q through ldmatrix.trans (as V in the forward).
// attend_block_v2_dq: one CTA per query tile of 16 * WARPS rows, as the forward,
// visiting the key tiles of its row of the plan:
//   S = Q K^T, P = exp(S * scale - lse), dP = dO V^T (A: dO through ldmatrix;
//   B: V rows), dS = P (dP - delta), dQ += dS K (A: dS from registers; B: K
//   through ldmatrix.trans).
// Two kernels instead of FlashAttention-2's one with atomic adds to dQ: S and
// dP are computed twice (7 products per tile instead of 5), and no two CTAs
// write the same value, so every run gives the same bits.
//
// Precision. Q and dO are rounded to the 16-bit type (Q after its scale is
// taken off: a float16 or bfloat16 input comes back exactly, and so does dO,
// which the ring holds as float32 copies of the 16-bit dout), P and dS are
// rounded to it as operands of dV, dK and dQ; everything else is float32.
//
// NaN and inf: these kernels are launched only for blocks and rows that hold
// none (the owner's flag and BackwardRows.finite say so on the host);
// gpu_impl/fused_v2.py hands any other block to the readable step.
//
// Shared memory, both kernels: (2 * BM + 2 * BN) * HEAD_DIM * 2 + BN * 8 + BM * 20
// bytes: Q, dO, K, V tiles, the keys' positions and documents, and per row
// (dkdv) lse, delta and what the row may see.

#define BM_ROWS (16 * WARPS)                  // rows of a query tile
#define KV_WARPS (BN / 16)                    // dkdv: a warp per 16 keys
#define KV_THREADS (32 * KV_WARPS)
#define RC (BM_ROWS % 32 == 0 ? 32 : 16)      // dkdv: rows of a query tile taken at a time

// Rows r0 .. r0 + BM_ROWS - 1 of q (float32, pre-scaled) and dO (float32) as
// 16-bit tiles, q unscaled; rows past `rows` (or past c * G) are zeros.
__device__ __forceinline__ void load_rows(uint4* Qs, uint4* dOs, const float* q_bh, const float* do_bh,
                                          long long row0, int rows, long long all_rows, float unscale,
                                          int tid, int threads)
{
    for (int i = tid; i < BM_ROWS * CHUNKS; i += threads) {
        const int r = i / CHUNKS, chunk = i % CHUNKS;
        float x[8] = {0, 0, 0, 0, 0, 0, 0, 0}, y[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (r < rows && row0 + r < all_rows) {
            const float4* qs = reinterpret_cast<const float4*>(q_bh + (row0 + r) * HEAD_DIM + chunk * 8);
            const float4* ds = reinterpret_cast<const float4*>(do_bh + (row0 + r) * HEAD_DIM + chunk * 8);
            const float4 a = qs[0], b = qs[1], e = ds[0], f = ds[1];
            x[0] = a.x * unscale; x[1] = a.y * unscale; x[2] = a.z * unscale; x[3] = a.w * unscale;
            x[4] = b.x * unscale; x[5] = b.y * unscale; x[6] = b.z * unscale; x[7] = b.w * unscale;
            y[0] = e.x; y[1] = e.y; y[2] = e.z; y[3] = e.w;
            y[4] = f.x; y[5] = f.y; y[6] = f.z; y[7] = f.w;
        }
        Qs[swizzle(r, chunk)] = make_uint4(pack_16x2(x[0], x[1]), pack_16x2(x[2], x[3]),
                                           pack_16x2(x[4], x[5]), pack_16x2(x[6], x[7]));
        dOs[swizzle(r, chunk)] = make_uint4(pack_16x2(y[0], y[1]), pack_16x2(y[2], y[3]),
                                            pack_16x2(y[4], y[5]), pack_16x2(y[6], y[7]));
    }
}

// K or V rows k0 .. k0 + BN - 1 into a swizzled tile, `threads` threads; rows at or past ck are zeros.
__device__ __forceinline__ void load_kv_by(uint4* tile, const kv_t* src, int k0, int ck, int tid, int threads)
{
    for (int i = tid; i < BN * CHUNKS; i += threads) {
        const int t = i / CHUNKS, chunk = i % CHUNKS;
        const bool valid = k0 + t < ck;
        cp_async_16(&tile[swizzle(t, chunk)], src + (long long)(valid ? k0 + t : 0) * HEAD_DIM + chunk * 8, valid);
    }
}

__device__ __forceinline__ void load_positions_by(int* kpos, int* kdoc, const int* k_pos, const int* k_doc,
                                                  int has_docs, int k0, int ck, int tid, int threads)
{
    for (int t = tid; t < BN; t += threads) {
        const bool valid = k0 + t < ck;
        cp_async_4(&kpos[t], k_pos + (valid ? k0 + t : 0), valid);
        if (has_docs)
            cp_async_4(&kdoc[t], k_doc + (valid ? k0 + t : 0), valid);
    }
}

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
    uint4* Qs = smem;                                   // (BM_ROWS, HEAD_DIM) 16-bit, swizzled
    uint4* dOs = Qs + BM_ROWS * CHUNKS;                 // (BM_ROWS, HEAD_DIM)
    uint4* Ks = dOs + BM_ROWS * CHUNKS;                 // (BN, HEAD_DIM)
    uint4* Vs = Ks + BN * CHUNKS;                       // (BN, HEAD_DIM)
    int* kpos = reinterpret_cast<int*>(Vs + BN * CHUNKS);   // (BN,)
    int* kdoc = kpos + BN;                              // (BN,)
    float* row_lse = reinterpret_cast<float*>(kdoc + BN);   // (BM_ROWS,) per row of the query tile
    float* row_delta = row_lse + BM_ROWS;
    int* row_lo = reinterpret_cast<int*>(row_delta + BM_ROWS);
    int* row_hi = row_lo + BM_ROWS;
    int* row_doc = row_hi + BM_ROWS;

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

    load_kv_by(Ks, k + bh * ck * HEAD_DIM, k0, ck, tid, KV_THREADS);
    load_kv_by(Vs, v + bh * ck * HEAD_DIM, k0, ck, tid, KV_THREADS);
    load_positions_by(kpos, kdoc, k_pos, k_doc, has_docs, k0, ck, tid, KV_THREADS);
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
                            rows < BM_ROWS || (long long)(x + 1) * rows > all_rows;
        const long long row0 = (long long)x * rows;
        __syncthreads();                                // every warp is done with the last query tile
        load_rows(Qs, dOs, q + bh * all_rows * HEAD_DIM, d_o + bh * all_rows * HEAD_DIM, row0, rows,
                  all_rows, unscale, tid, KV_THREADS);
        for (int r = tid; r < BM_ROWS; r += KV_THREADS) {
            const long long row = row0 + r;
            const bool active = r < rows && row < all_rows;
            const long long query = row / G;
            row_lse[r] = active ? lse[bh * all_rows + row] : 0.0f;
            row_delta[r] = active ? delta[bh * all_rows + row] : 0.0f;
            row_lo[r] = active ? q_lo[query] : 1;       // an idle row sees nothing
            row_hi[r] = active ? q_hi[query] : 0;
            row_doc[r] = active && has_docs ? q_doc[query] : 0;
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
                    const bool hidden = masked && (t >= nk || !(kpos[t] >= row_lo[r] && kpos[t] <= row_hi[r] &&
                                                                (!has_docs || kdoc[t] == row_doc[r])));
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
    uint4* dOs = Qs + BM_ROWS * CHUNKS;
    uint4* Ks = dOs + BM_ROWS * CHUNKS;
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

    load_rows(Qs, dOs, q + bh * all_rows * HEAD_DIM, d_o + bh * all_rows * HEAD_DIM, row0, rows, all_rows,
              unscale, tid, THREADS);
    RowMask mask[2];
    float row_lse[2], row_delta[2], acc[HEAD_DIM / 8][4];
    bool active[2];
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = warp * 16 + g + 8 * h;
        const long long row = row0 + r, query = row / G;
        active[h] = r < rows && row < all_rows;
        mask[h] = active[h] ? RowMask{q_lo[query], q_hi[query], has_docs ? q_doc[query] : 0} : RowMask{1, 0, 0};
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
        load_kv_by(Ks, k_bh, k0, ck, tid, THREADS);
        load_kv_by(Vs, v_bh, k0, ck, tid, THREADS);
        load_positions_by(kpos, kdoc, k_pos, k_doc, has_docs, k0, ck, tid, THREADS);
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
