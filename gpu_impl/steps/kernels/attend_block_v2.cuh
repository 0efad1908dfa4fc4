// attend_block_v2.cuh: what the three kernels of version 2 share (the forward,
// attend_block_v2.cu; the backward, attend_block_v2_dkdv.cu and
// attend_block_v2_dq.cu): their sizes, the warp-level operations as PTX, the
// swizzled 16-bit tiles in shared memory and the loads that fill them, and what
// a query row may see.
//
// Compute layout (C-contiguous), BH = B * Hkv, G = Hq / Hkv, rows = c * G:
//   q, o     (BH, c, G, HEAD_DIM)  float32; q pre-scaled by the softmax scale
//   m, l     (BH, c, G)            float32 running row max and row sum (forward)
//   lse, delta (BH, c, G)          float32 (backward)
//   k, v     (BH, ck, HEAD_DIM)    16-bit: float16, or bfloat16 with KV_BF16=1
//   k_pos    (ck,)                 global positions of the keys (int32)
//   q_lo, q_hi (c,)                the positions each query may see (int32,
//                                  reference.masks.Mask.key_range clipped to
//                                  [-1, 2^31 - 1]: no bound at either end)
//   q_doc (c,), k_doc (ck,)        documents (int32), read only when has_docs
//                                  (documents that are not one run of positions each)
//   kinds    (ceil(c / tq), ceil(ck / BN))  int8: 0 skip, 1 full, 2 masked
//                                  (reference.tiles.classify at tile (tq, BN))
// A query tile holds tq queries, all G heads of each: rows x*tq*G .. on (the
// rows are query-major), at most BM = 16 * WARPS of them, 16 per warp.
//
// Compile-time sizes (nvcc -D or NVRTC options, gpu_impl/steps/fused_v2.py's
// Config): HEAD_DIM (64 or 128), WARPS (1 to 8), BN (keys per tile: 16, 32, 64
// or 128), KV_BF16.
//
// Flushing. CuPy compiles kernels with -ftz=true: float32 values below 2^-126
// are read and written as 0. So a weight P = exp(S - m) with S - m below about
// -87.3 is 0 here where NumPy's readable step keeps a subnormal: where V holds
// inf at such a key, out is NaN (0 x inf) here and inf there. Every other case
// of the NaN rule is the same. (The CPU emulation, tests/support/gpu/emulate_cuda.cpp,
// flushes likewise.)

#ifndef ATTEND_BLOCK_V2_CUH
#define ATTEND_BLOCK_V2_CUH

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
// NVRTC compile this alike. tests/support/gpu/emulate_cuda.cpp defines the same
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
// Hazard: the source must be aligned to the copy's size (16 bytes: a K or V row
// of a view at an odd offset faults); the host checks it (fused.check_aligned).
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

// The mask of row `row` of a group's c * G rows (query row / G), or nothing
// for an idle row (past the CTA's rows or the group's).
__device__ __forceinline__ RowMask row_mask(const int* q_lo, const int* q_hi, const int* q_doc, int has_docs,
                                            long long row, int G, bool active)
{
    const long long query = row / G;
    return active ? RowMask{q_lo[query], q_hi[query], has_docs ? q_doc[query] : 0} : RowMask{1, 0, 0};
}

// Start copying K (or V) rows k0 .. k0+BN-1 into a swizzled tile, `threads`
// threads; rows at or past ck are zeros. Chunk i is copied by thread i %
// threads (the forward's `v_non_finite` reads back the chunks a thread copied,
// in the same order).
__device__ __forceinline__ void load_kv(uint4* tile, const kv_t* src, int k0, int ck, int tid, int threads)
{
    for (int i = tid; i < BN * CHUNKS; i += threads) {
        const int t = i / CHUNKS, chunk = i % CHUNKS;
        const bool valid = k0 + t < ck;
        cp_async_16(&tile[swizzle(t, chunk)], src + (long long)(valid ? k0 + t : 0) * HEAD_DIM + chunk * 8, valid);
    }
}

__device__ __forceinline__ void load_positions(int* kpos, int* kdoc, const int* k_pos, const int* k_doc,
                                               int has_docs, int k0, int ck, int tid, int threads)
{
    for (int t = tid; t < BN; t += threads) {
        const bool valid = k0 + t < ck;
        cp_async_4(&kpos[t], k_pos + (valid ? k0 + t : 0), valid);
        if (has_docs)
            cp_async_4(&kdoc[t], k_doc + (valid ? k0 + t : 0), valid);
    }
}

// Rows row0 .. row0 + BM - 1 of a float32 (all_rows, HEAD_DIM) array (q or dO)
// into a swizzled 16-bit tile, each value times `factor`; rows past `rows` (the
// CTA's) or past `all_rows` are zeros. Hazard: float4 loads need rows 16-byte
// aligned (the host checks the array's address, fused.check_aligned).
__device__ __forceinline__ void load_rows(uint4* tile, const float* src, long long row0, int rows,
                                          long long all_rows, float factor, int tid, int threads)
{
    for (int i = tid; i < BM * CHUNKS; i += threads) {
        const int r = i / CHUNKS, chunk = i % CHUNKS;
        float x[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (r < rows && row0 + r < all_rows) {
            const float4* s = reinterpret_cast<const float4*>(src + (row0 + r) * HEAD_DIM + chunk * 8);
            const float4 a = s[0], b = s[1];
            x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
            x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
        }
        tile[swizzle(r, chunk)] = make_uint4(pack_16x2(x[0] * factor, x[1] * factor),
                                             pack_16x2(x[2] * factor, x[3] * factor),
                                             pack_16x2(x[4] * factor, x[5] * factor),
                                             pack_16x2(x[6] * factor, x[7] * factor));
    }
}

#endif  // ATTEND_BLOCK_V2_CUH
